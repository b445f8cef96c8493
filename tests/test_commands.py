"""What README.md and the docs print is true: every command they show runs from where they say (its
--help, each in a fresh interpreter's state), every link points at a file, and the README's line
counts are the files'."""
import json
import re
import subprocess
import sys

from conftest import ROOT

PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
         *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "experiments").glob("*.md"))]
# the program of a command line: `python train.py ...`, `python -m machinery.plots ...`,
# `accelerate launch ... experiments/trl_d3s.py ...`, `bash experiments/study.sh ...`
PYTHON = re.compile(r"(?:^|[\s`(])(?:\.venv/bin/)?python3? (-m [\w.]+|[\w/]+\.py)\b")
LAUNCHED = re.compile(r"(?:launch|torchrun)\b[^\n`]*?\s([\w/]+\.py)\b")
BASH = re.compile(r"\bbash ([\w/.]+\.sh)\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")

# Runs each program's --help as `python PROGRAM --help` would, one after the other in one process
# (so torch is imported once): sys.argv and sys.path[0] as Python sets them, the project's modules
# fresh. Prints {program: [exit code, the first line of its output]}.
CHECK = r'''
import contextlib, io, json, os, runpy, sys
here, out = os.getcwd() + os.sep, {}
for program in sys.argv[1:]:
    for name, module in list(sys.modules.items()):  # the project's modules: fresh for each program
        path = getattr(module, "__file__", None) or ""
        if path.startswith(here) and "site-packages" not in path:
            del sys.modules[name]
    text, path = io.StringIO(), list(sys.path)
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            if program.startswith("-m "):
                sys.argv = [program[3:], "--help"]
                sys.path[0] = os.getcwd()
                runpy.run_module(program[3:], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [program, "--help"]
                sys.path[0] = os.path.dirname(os.path.abspath(program))
                runpy.run_path(program, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            code, text = 1, io.StringIO(f"{type(e).__name__}: {e}")
    sys.path[:] = path
    out[program] = [code, (text.getvalue().strip().splitlines() or [""])[0]]
print(json.dumps(out))
'''


def printed():
    """{program: the pages that print it}: every python program, launched script and bash script."""
    found = {}
    for page in PAGES:
        text = (ROOT / page).read_text()
        for pattern in (PYTHON, LAUNCHED, BASH):
            for program in pattern.findall(text):
                found.setdefault(program, set()).add(page)
    return found


def test_every_printed_command_runs_from_where_the_docs_say():
    programs = printed()
    scripts = sorted(p for p in programs if p.endswith(".py") or p.startswith("-m "))
    scripts.remove("-m pytest")  # the test command itself
    assert {"train.py", "eval.py", "-m machinery.plots", "experiments/bench.py",
            "experiments/trl_d3s.py"} <= set(scripts), scripts
    for program in scripts:
        if not program.startswith("-m "):
            assert (ROOT / program).is_file(), f"{program}, printed in {sorted(programs[program])}, is no file"
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", CHECK, *scripts], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for program, (code, first) in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert code == 0 and first.startswith("usage:"), (program, sorted(programs[program]), code, first)
    for script in sorted(p for p in programs if p.endswith(".sh")):
        run = subprocess.run(["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "usage" in run.stdout.lower(), (script, run.stdout, run.stderr)


def test_every_link_in_the_docs_points_at_a_file():
    for page in PAGES:
        for target in LINK.findall((ROOT / page).read_text()):
            if not target.startswith(("http://", "https://", "mailto:")):
                assert ((ROOT / page).parent / target).exists(), f"{page} links to {target}, which is missing"


def test_the_readme_gives_each_files_line_count():
    """The README's reading order names each file with its length: the file's, as wc -l counts it."""
    rows = re.findall(r"^\| `([\w/]+\.py)` \| (\d+) \|", (ROOT / "README.md").read_text(), re.M)
    assert {name for name, _ in rows} >= {"train.py", "d3s.py", "rollout.py", "reward.py", "eval.py"}
    for name, lines in rows:
        assert int(lines) == len((ROOT / name).read_text().splitlines()), name


def test_the_readme_layout_names_every_tiny_world():
    """The README's Layout names the tiny worlds machinery/tiny.py has, every one of them."""
    from machinery import tiny
    layout = (ROOT / "README.md").read_text().split("## Layout")[1]
    line = next(x for x in layout.splitlines() if "tiny.py" in x)
    named = line.split(":", 1)[1].replace(",", " ").split()
    assert named == list(tiny.WORLDS), line
