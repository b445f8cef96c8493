"""Python 3.10 is the oldest supported version: no project file may use syntax, regular-expression
features or standard-library names that only exist in a newer one.

With a real Python 3.10 on the machine (python3.10 on PATH, or a pyenv 3.10), the check runs in it:
every file is compiled by 3.10's compiler, every regex literal handed to re.* is compiled by 3.10's
`re` (atomic groups `(?>...)` and possessive quantifiers `*+ ++ ?+ {m,n}+` are 3.11+), and every
standard-library module and name a file imports or uses must exist in 3.10. Without one, the same
check runs statically in the current interpreter: ast.parse(feature_version=(3, 10)), a scan of the
regex literals for those two constructs, and a table of the library names added since 3.10.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

SKIP_DIRS = {".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache"}  # and out/, and any virtualenv

# The checker runs as a script, in Python 3.10 itself when there is one, so it is 3.10 code too.
# argv: [--static] FILE...; prints a JSON list of "path:line: what" problems.
CHECKER = r'''
import ast, importlib, json, re, sys

STATIC = "--static" in sys.argv or sys.version_info[:2] != (3, 10)
FILES = [a for a in sys.argv[1:] if not a.startswith("--")]
# 3.10's own list lacks the modules added later (tomllib), so the caller adds its interpreter's list
STDLIB = set(getattr(sys, "stdlib_module_names", ())).union(
    *(a[len("--stdlib="):].split(",") for a in sys.argv[1:] if a.startswith("--stdlib=")))
# index of the flags argument of each re function, for patterns that need re.X to parse
RE_FUNCS = {"compile": 1, "search": 2, "match": 2, "fullmatch": 2, "findall": 2, "finditer": 2,
            "split": 3, "sub": 4, "subn": 4}
# what the standard library gained after 3.10 (for the static check; a real 3.10 is asked instead)
NEWER = {
    "tomllib": "3.11", "wsgiref.types": "3.11", "datetime.UTC": "3.11", "hashlib.file_digest": "3.11",
    "contextlib.chdir": "3.11", "math.cbrt": "3.11", "math.exp2": "3.11", "operator.call": "3.11",
    "re.NOFLAG": "3.11", "sys.exception": "3.11", "logging.getLevelNamesMapping": "3.11",
    "asyncio.TaskGroup": "3.11", "asyncio.timeout": "3.11", "asyncio.Runner": "3.11",
    "asyncio.Barrier": "3.11", "inspect.getmembers_static": "3.11", "enum.StrEnum": "3.11",
    "enum.ReprEnum": "3.11", "enum.verify": "3.11", "enum.member": "3.11", "enum.nonmember": "3.11",
    "enum.global_enum": "3.11", "enum.EnumCheck": "3.11", "enum.FlagBoundary": "3.11",
    "typing.Self": "3.11", "typing.LiteralString": "3.11", "typing.Never": "3.11",
    "typing.assert_never": "3.11", "typing.assert_type": "3.11", "typing.reveal_type": "3.11",
    "typing.TypeVarTuple": "3.11", "typing.Unpack": "3.11", "typing.Required": "3.11",
    "typing.NotRequired": "3.11", "typing.dataclass_transform": "3.11", "typing.get_overloads": "3.11",
    "typing.clear_overloads": "3.11", "typing.override": "3.12", "typing.TypeAliasType": "3.12",
    "itertools.batched": "3.12", "math.sumprod": "3.12", "typing.TypeIs": "3.13",
    "typing.ReadOnly": "3.13", "warnings.deprecated": "3.13", "copy.replace": "3.13",
    "os.process_cpu_count": "3.13", "math.fma": "3.13",
}
NEWER_BUILTINS = {"ExceptionGroup": "3.11", "BaseExceptionGroup": "3.11", "PythonFinalizationError": "3.13"}


def newer_regex(pattern):
    """The first 3.11+ construct in a pattern, or None: an atomic group or a possessive quantifier."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2  # an escaped character: `\++` is a literal + repeated
            continue
        if c == "[":  # a character class: no groups or quantifiers inside
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1  # a ] first in the class is a literal ]
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            continue
        if pattern.startswith("(?>", i):
            return "atomic group (?>...)"
        if pattern.startswith("(?", i):
            i += 2  # this ? opens a group; it is not a quantifier
            continue
        m = re.compile(r"[*+?]|\{(?:\d+|\d*,\d*)\}").match(pattern, i)
        if m:
            if m.end() < n and pattern[m.end()] == "+":
                return "possessive quantifier " + m.group(0) + "+"
            i = m.end()
            continue
        i += 1
    return None


def constants(tree):
    """Module-level NAME = "string" assignments, to fill in f-string patterns like rf"{_PLAIN}+"."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            out[node.targets[0].id] = node.value.value
    return out


def pattern_text(node, names):
    """(the pattern, complete): a literal, or an f-string whose fields are module-level string constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        return node.value, True
    if isinstance(node, ast.JoinedStr):
        parts, complete = [], True
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(v.value)
            elif (isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id in names
                  and v.conversion == -1 and v.format_spec is None):
                parts.append(names[v.value.id])
            else:
                complete = False
        return "".join(parts), complete
    return None, False


def flags(node):
    if node is None:
        return 0
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "re":
        return getattr(re, node.attr, 0)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return flags(node.left) | flags(node.right)
    return 0


def regex_calls(tree):
    """(line, pattern node, flags node) of every re.FUNC(pattern, ...) call."""
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "re"
                and f.attr in RE_FUNCS):
            kw = {k.arg: k.value for k in node.keywords}
            pattern = node.args[0] if node.args else kw.get("pattern")
            i = RE_FUNCS[f.attr]
            flag = node.args[i] if len(node.args) > i else kw.get("flags")
            if pattern is not None:
                yield node.lineno, pattern, flag


def stdlib_uses(tree):
    """(line, "module" or "module.name") for every standard-library import and attribute use."""
    stdlib = STDLIB
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in stdlib:
                    yield node.lineno, a.name
                    # `import os.path` binds os; `import xml.etree as et` binds et to xml.etree
                    aliases[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in stdlib:
                yield node.lineno, node.module
                for a in node.names:
                    if a.name != "*":
                        yield node.lineno, node.module + "." + a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            yield node.lineno, aliases[node.value.id] + "." + node.attr


def exists_here(dotted):
    """Whether a module, or a module's attribute or submodule, exists in this interpreter."""
    try:
        importlib.import_module(dotted)
        return True
    except ImportError:
        pass
    module, _, name = dotted.rpartition(".")
    try:
        return bool(module) and hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def check(path):
    with open(path, "rb") as f:
        source = f.read()
    try:
        if STATIC:
            tree = ast.parse(source, path, feature_version=(3, 10))
        else:
            compile(source, path, "exec", dont_inherit=True)  # py_compile's check, without writing a .pyc
            tree = ast.parse(source, path)
    except SyntaxError as e:
        return [f"{path}:{e.lineno}: syntax newer than Python 3.10: {e.msg}"]
    problems, names = [], constants(tree)
    for line, node, flag in regex_calls(tree):
        pattern, complete = pattern_text(node, names)
        if pattern is None:
            continue
        if STATIC or not complete:
            what = newer_regex(pattern if isinstance(pattern, str) else pattern.decode("latin-1"))
            if what:
                problems.append(f"{path}:{line}: regex {pattern!r}: {what} needs Python 3.11")
        else:
            try:
                re.compile(pattern, flags(flag))
            except re.error as e:
                problems.append(f"{path}:{line}: regex {pattern!r} does not compile on Python 3.10: {e}")
    for line, dotted in stdlib_uses(tree):
        new = NEWER.get(dotted) if STATIC else (None if exists_here(dotted) else "3.11+")
        if new:
            problems.append(f"{path}:{line}: {dotted} needs Python {new}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            problems.append(f"{path}:{node.lineno}: {node.id} needs Python {NEWER_BUILTINS[node.id]}")
    return problems


print(json.dumps({"static": STATIC, "version": list(sys.version_info[:3]),
                  "problems": [p for path in FILES for p in check(path)]}))
'''


def project_files(root=ROOT):
    """Every .py file of the project: not in .git, a virtual environment or the top-level out/."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS
                         and not (folder == str(root) and d == "out")
                         and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg")))
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


def python310():
    """A working Python 3.10 interpreter, or None: python3.10 on PATH first, then pyenv's 3.10s.
    (A pyenv shim is on PATH even where 3.10 is not the selected version, and then it fails to run.)"""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = [shutil.which("python3.10")]
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", "3.10*", "bin", "python3.10")))
    for exe in filter(None, candidates):
        try:
            proc = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0 and proc.stdout.strip() == "True":
            return exe
    return None


PYTHON310 = python310()


def run_checker(files, python=None, static=False):
    python = python or PYTHON310 or sys.executable
    options = ["--stdlib=" + ",".join(sorted(sys.stdlib_module_names))] + (["--static"] if static else [])
    proc = subprocess.run([python, "-I", "-c", CHECKER] + options + [str(f) for f in files],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)

# -----------------------------------------------------------------------------
# The project itself


def test_every_project_file_runs_on_python_3_10():
    files = project_files()
    assert os.path.join(str(ROOT), "reward.py") in files and os.path.join(str(ROOT), "tests", "conftest.py") in files
    assert not any(os.sep + ".venv" + os.sep in f or f.startswith(os.path.join(str(ROOT), "out", "")) for f in files)
    result = run_checker(files)
    how = "statically" if result["static"] else "in Python %d.%d.%d" % tuple(result["version"])
    print(f"\nchecked {len(files)} files {how}")
    assert result["problems"] == [], "\n".join(result["problems"])


# -----------------------------------------------------------------------------
# The check itself finds what it claims to (in both modes)

NEWER_FILES = {
    "except_star.py": "try:\n    pass\nexcept* ValueError:\n    pass\n",
    "atomic.py": "import re\nP = re.compile(r'\\$(?>\\d+)x')\n",
    "possessive.py": "import re\nprint(re.search('a*+b', 'aab'))\n",
    "possessive_braces.py": "import re\nprint(re.sub(r'[ab]{2,3}+', '', 'ab'))\n",
    "atomic_fstring.py": "import re\nD = r'\\d'\nP = re.compile(rf'(?>{D}+)')\n",
    "tomllib.py": "import tomllib\n",
    "typing_self.py": "from typing import Self\n",
    "datetime_utc.py": "import datetime\nprint(datetime.UTC)\n",
    "exception_group.py": "raise ExceptionGroup('x', [ValueError()])\n",
}
FINE_FILE = textwrap.dedent(r'''
    import re
    import datetime
    from typing import Optional
    PLAIN = r"\d+"
    A = re.compile(r"\++[+]+(?:ab)?c{2}")        # escaped and class pluses, a non-greedy group
    B = re.compile(rf"(?={PLAIN})x*?")
    C = re.compile(r"(?P<n>\d)(?=(\d+))\2(?!\.)(?<=\d)(?#comment)", re.IGNORECASE | re.VERBOSE)
    D = re.sub(r"\s+", " ", "a  b", flags=re.M)
    match datetime.timezone.utc:
        case _:
            pass
''')


def _check_catches(tmp_path, python, static):
    for name, source in NEWER_FILES.items():
        (tmp_path / name).write_text(source)
    (tmp_path / "fine.py").write_text(FINE_FILE)
    result = run_checker(sorted(tmp_path.glob("*.py")), python=python, static=static)
    flagged = {os.path.basename(p.split(":")[0]) for p in result["problems"]}
    assert flagged == set(NEWER_FILES), "\n".join(result["problems"])
    return result


def test_static_check_catches_newer_features(tmp_path):
    result = _check_catches(tmp_path, sys.executable, static=True)
    assert result["static"]


@pytest.mark.skipif(PYTHON310 is None, reason="no Python 3.10 interpreter on this machine")
def test_real_python_3_10_catches_newer_features(tmp_path):
    result = _check_catches(tmp_path, PYTHON310, static=False)
    assert not result["static"] and result["version"][:2] == [3, 10]
