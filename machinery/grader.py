r"""
Is a completion's final answer equal to the reference? reward.py reads the answers a completion
writes (boxes(), or its #### lines) and asks judge(answers, reference); the rules, with examples,
are docs/grading.md.

    boxes(text)                every \boxed{} / \fbox{} of a text, nested ones too, as spans
    last_boxed(text)           the content of the last box (machinery/data.py reads MATH's
                               references with it)
    judge(answers, reference)  "hedge" when the answers are not all one value, else compare's
    compare(answer, reference) "correct" | "wrong" | "timeout" | "error"
    read(s)                    what an answer is worth, or None when it is not one value
    canonical(s)               a spelling-insensitive form (no spaces, no $, no \text{} wrapper)

[ours], all of it: the paper does not grade answers. An answer is one value or it is worth
nothing: a plain number (exact, as a Fraction, in microseconds), a text answer (a name, a letter),
or a math expression that our own small grammar accepts (_Grammar), which math-verify then
compares. The grammar is the guard: math-verify reads `5 \wedge 6` as 6, `12 34` as 46 and
`x^2+y^2=13` as 13, because its job is to find some value in any text; ours is to refuse whatever
is not one value. Words count only from explicit lists (UNITS, SCALES). No regular expression here
has nested or adjacent unbounded repeats, so each runs in linear time on any input (a test checks
every one); sympy can still run for seconds or forever on a hostile value (`2^{2^{40}}`), so that
path has two fences: long, deep or huge values are no value (the grammar works out how big each
one is), and on the main thread a wall-clock deadline stops sympy (_with_deadline); math-verify's
own timeouts use whole-second signal.alarm, which raises off the main thread, so they are off.
"""
import logging
import re
import signal
import sys
import threading
import time
from collections import namedtuple
from fractions import Fraction

import mpmath
from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse, verify

# -----------------------------------------------------------------------------
# Limits. The grader must return within a second on any completion.

REL_TOL = 1e-6            # a rounded decimal = a fraction when |a - b| <= REL_TOL * max(|a|, |b|)
MAX_SYMBOLIC_CHARS = 300  # longer answers are compared as strings only; MATH-500's longest is 53
MAX_NESTING = 12          # deeper ({[ nesting is compared as a string only
MAX_OPERAND = 1000        # an exponent, factorial or binomial of this or more: compared as a string
MAX_DIGITS = 3000         # a power or factorial of more digits: compared as a string
MAX_SPELLINGS = 8         # more different spellings in one completion's boxes: a hedge
DEADLINE_S = 0.5          # main thread: wall-clock budget for one math-verify comparison
RETRY_S = 0.02            # after the deadline, the alarm repeats this often until it lands

# We enforce our own time limits (see _with_deadline); math-verify's warnings that its own are
# off, and its per-timeout warnings, would only repeat that on every call.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# -----------------------------------------------------------------------------
# Boxes: one pass over the text

_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])|\\.|[{}]", re.S)  # not `\boxedsymbol`
_BLANKS = re.compile(r"[ \t]*")
# `\boxed 5`: a value's first character (a digit, a sign, a command, a letter alone), then up to
# whitespace, `$`, a brace or the next box (past which the scans would overlap: quadratic time)
_BARE = re.compile(r"(?=[-+.\d\\]|[A-Za-z](?![A-Za-z]))"
                   r"(?:[^\s${}\\]|\\(?!(?:boxed|fbox)(?![A-Za-z])))+")


def boxes(text):
    """The content spans (start, end) of every box in text, in the order the boxes open, nested
    ones included; None when a box never closes (a completion cut off mid-answer). A brace-less
    box (`\\boxed 5`) holds what follows up to whitespace, `$`, a brace or the next box, when that
    begins as a value can; else, and with nothing after it on its line, `\\boxed` is the command
    named in prose (`use \\boxed, then`), except at the end of the text, where it is a box that
    never closed. Escaped braces (`\\{`) neither open nor close a box."""
    spans, open_at, depth = [], [], 0  # open_at: (brace depth outside the box, content start)
    for m in _BOX_TOKEN.finditer(text):
        token = m[0]
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if open_at and depth == open_at[-1][0]:
                spans.append((open_at.pop()[1], m.start()))
        elif len(token) > 2:  # \boxed or \fbox; every other escape is two characters
            j = _BLANKS.match(text, m.end()).end()
            if j == len(text):
                return None  # `\boxed` and then the end: cut off
            if text[j] == "{":
                open_at.append((depth, j + 1))
            elif bare := _BARE.match(text, j):
                spans.append((j, bare.end()))
    if open_at:
        return None
    return sorted(spans)


def last_boxed(text):
    """The content of the last box to open in text, or None when there is none or a box never
    closes."""
    spans = boxes(text)
    return text[slice(*spans[-1])] if spans else None

# -----------------------------------------------------------------------------
# Judging: all answers one value, then that value against the reference


def judge(answers, reference):
    """The outcome for a completion whose final answer is written as `answers` (its distinct
    spellings, the last one last): "hedge" when they are not all one value (more than
    MAX_SPELLINGS of them, or two that differ), else compare(answers[-1], reference). Telling
    spellings apart gets half of DEADLINE_S of math-verify in all; what it cannot decide in that
    time counts as different."""
    if len(answers) > MAX_SPELLINGS:
        return "hedge"
    last, end = read(answers[-1]), time.monotonic() + DEADLINE_S / 2
    for other in answers[:-1]:
        if last is None or not _equal_within(read(other), last, end - time.monotonic()):
            return "hedge"
    return compare(answers[-1], reference)


def compare(answer, reference):
    """The outcome of comparing an answer with a reference (both non-empty str): "correct",
    "wrong", "timeout" (math-verify ran out of time) or "error" (math-verify failed). The same
    spelling is always correct; else an answer that is not one value is wrong."""
    if canonical(answer) == canonical(reference):
        return "correct"
    a, b = read(answer), read(reference, reference=True)
    if a is None or b is None:
        return "wrong"
    if a.kind == b.kind == "number":
        ok = _numbers_equal(a.number, b.number) or _percent_written_bare(a, b)
        return "correct" if ok else "wrong"
    try:
        return "correct" if _equal(a, b, DEADLINE_S) else "wrong"
    except _OutOfTime:
        return "timeout"
    except Exception:
        # math-verify catches its own errors; this is for whatever it lets through (a
        # RecursionError in sympy, say). An answer we cannot compare is not a right answer.
        return "error"


def _equal(a, b, seconds):
    """Two read values equal? Numbers exactly, text by its key, the rest through math-verify (within
    `seconds`), and only values of one shape: a list never equals a tuple or one value, an equation
    only an equation. The same value read (x = 5 and 5) is equal, whether math-verify parses it or
    not (it cannot parse \\pm inside a fraction)."""
    if a.kind == b.kind == "number":
        return _numbers_equal(a.number, b.number)
    if "text" in (a.kind, b.kind):
        return a.key == b.key
    if a.shape != b.shape:
        return False
    return a.latex == b.latex or _symbolic_equal(a.latex, b.latex, seconds)


def _equal_within(a, b, seconds):
    """_equal for two of a completion's own answers; False when either is no value, or when
    math-verify cannot decide within `seconds`."""
    if a is None or b is None:
        return False
    asks_math_verify = "text" not in (a.kind, b.kind) and not a.kind == b.kind == "number"
    if asks_math_verify and seconds <= 0:
        return False
    try:
        return _equal(a, b, seconds)
    except (_OutOfTime, Exception):
        return False

# -----------------------------------------------------------------------------
# Reading an answer: what one value it holds, or None

Value = namedtuple("Value", "kind number latex shape key")
# kind: "number" (number: (Fraction, written with decimals, written with %)), "text" or "math";
# latex: what math-verify compares; shape: "one", "list" (solutions: a, b or \{a, b\} or a \pm b),
# "interval" (a bracketed pair, an interval, an inequality) or "equation"; key: the text key.

# Explicit lists [ours]. A unit after a value is dropped; a scale word multiplies a plain number;
# any other word makes an answer no value. Single letters are never units: x, e, i, m are as
# often symbols. "sec" and "min" right after a number cannot be the functions.
UNITS = frozenset("""
    dollar dollars cent cents usd mm cm dm km ft yd mi inch inches foot feet yard yards mile miles
    meter meters metre metres centimeter centimeters millimeter millimeters kilometer kilometers
    square sq cubic cu mg kg lb lbs oz gram grams kilogram kilograms pound pounds ounce ounces ton
    tons ml liter liters litre litres gallon gallons gal quart quarts qt pint pints cup cups cc
    sec secs second seconds min mins minute minutes hr hrs hour hours day days wk wks week weeks
    month months yr yrs year years mph kph kmh deg degree degrees rad radian radians unit units
    per""".split())
SCALES = {"hundred": 100, "thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9,
          "trillion": 10 ** 12, "dozen": 12, "percent": Fraction(1, 100)}  # % is "percent"
_RATE_LETTERS = frozenset("m s g h l".split())  # in a rate only (m/s, km/h): a letter over a unit

_SPACE = re.compile(r"\s+")
# _NOISE and _SPACING first take a row break `\\` whole (and keep it): in `1 \\ 2` there is no `\ `
_NOISE = re.compile(r"(\\\\)|\\(?:left|right)(?![A-Za-z])\.?|\\displaystyle|\\!"
                    r"|\\(?:mathbf|boldsymbol|bm) ?\{([^{}]*)\}")  # bold 18 is 18
_SPACING = re.compile(r"(\\\\)|\\(?:[,;: ]|q?quad(?![A-Za-z])"
                      r"|phantom ?\{[^{}]*\})|~")  # \phantom{2}: a space the size of a 2
_PER_CENT = re.compile(r"(?<![A-Za-z])per ?cent(?![A-Za-z])", re.I)
_THOUSANDS_GAP = re.compile(r",\\! ?(?=\d{3}(?!\d))")  # 1,\!000 and 11,\! 111
_DEGREE = re.compile(r"\^ ?(?:\\circ|\{ ?\\circ ?\})")  # after _SPACE: one space at most
_TEXT = re.compile(r"\\(?:text(?:rm|bf|it|normal|up)?|mbox|mathrm) ?\{([^{}]*)\}")
_AND_OR = re.compile(r"(?<![A-Za-z\\])(?i:and|or)(?![A-Za-z])")
_COMMAS = re.compile(r", ?(?:, ?)+")
_GAP = re.compile(r" (?!\d)|(?<!\d) ")  # a space, unless between two digits: 12 34 is not 1234
_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_UNICODE = {"−": "-", "×": "\\times ", "÷": "\\div ", "π": "\\pi ", "∞": "\\infty ",
            "≤": "\\le ", "≥": "\\ge ", "°": "^\\circ", "\\%": "%", "{,}": ",",
            "\\$": "", "$": "", "€": "", "£": "", "¥": "", "\\pounds": "", "\\euro": ""}
_ALIASES = {"\\dfrac": "\\frac", "\\tfrac": "\\frac", "\\cfrac": "\\frac", "\\dbinom": "\\binom"}


def canonical(s):
    """A spelling-insensitive form of an answer, for an exact-string check and for telling a
    completion's spellings apart: spaces, $, spacing commands, \\left/\\right, \\dfrac and the
    \\text{} wrapper make no difference, but a gap never joins two numbers (`12 {} 34` is not 1234).
    An empty box is one whose canonical form is empty."""
    s = _TEXT.sub(r" \1 ", _normalize(s)).replace("{}", " ")
    return _GAP.sub("", _SPACE.sub(" ", s).strip())


def _normalize(s):
    s = _SPACE.sub(" ", s)
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    s = _THOUSANDS_GAP.sub(",", _PER_CENT.sub("percent", s))
    s = _NOISE.sub(lambda m: m[1] or m[2] or "", s)
    s = _SPACING.sub(lambda m: m[1] or " ", s)
    for old, new in _ALIASES.items():
        s = s.replace(old, new)
    s = _DEGREE.sub("°", s)
    return _SPACE.sub(" ", s).strip().rstrip(".").strip()


def _strip_braces(s):
    """s without braces around all of it: {{5}} is 5."""
    while s.startswith("{") and s.endswith("}") and _closes_last(s):
        s = s[1:-1].strip()
    return s


def _closes_last(s):
    depth = 0
    for i, c in enumerate(s):
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return i == len(s) - 1
    return False


def read(s, reference=False):
    """What the answer s is worth, a Value, or None when s is not one value (docs/grading.md):
    an empty or over-long string, a word that is neither a unit nor a scale word, a spelling our
    grammar does not accept (`5 \\wedge 6`, `12 34`, `5 = 6`). reference: [ours] the data set's
    own answer is trusted, so its last \\text{} of words is dropped whatever the words are (MATH's
    `575\\text{ students}` is 575); a completion's words must be units."""
    if len(s) > MAX_SYMBOLIC_CHARS:
        return None
    t = _strip_braces(_BOX_CMD.sub("", _normalize(s)))
    if not t:
        return None
    key = _TEXT.sub(r"\1", t).lower()
    key = "".join(c for c in key if c not in " (){}[].")
    if _TEXT.search(t) and not any(c.isdigit() for c in t) and not _TEXT.sub("", t).strip(" (),"):
        return Value("text", None, None, "one", key)  # \text{Evelyn}, (\text{E}), \text{even}
    t = _COMMAS.sub(", ", _AND_OR.sub(",", _TEXT.sub(_text_piece, t))).strip(", ")
    if reference and (m := _LAST_TEXT.search(t)) and t[:m.start()].strip() and not any(
            w.lower() in SCALES for w in re.findall(r"[A-Za-z]+", m[1])):
        t = t[:m.start()].strip()
    t = _strip_units(_TRIG_DEGREES.sub(r"\1(\2\\pi/180)", t).replace("°", " "))  # a unit
    if number := _as_number(t):
        return Value("number", number, _as_latex(number[0]), "one", key)
    if _TEXT.search(t) or _too_deep(t):
        return None  # words that are no unit, or too deep to read safely
    try:
        latex, shape = _Grammar(t).read()
    except (_NotAValue, RecursionError):  # a value nests 12 deep at most (_too_deep)
        return None
    return Value("math", None, latex.replace("%", "\\%"), shape, key)


def _text_piece(m):
    """A \\text{} inside an answer: a blank is a space, "and"/"or" join a list (a comma), one letter
    is that letter (\\mathrm{i} is i), one without letters is what it holds (\\text{13}); words stay
    boxed."""
    inner = m[1].strip(" ,")
    if not m[1].strip():
        return " "
    if inner.lower() in ("", "and", "or"):
        return ","
    if len(inner) == 1 and inner.isalpha() or not any(c.isalpha() for c in inner):
        return f" {inner} "
    return m[0]


# The last \text{} of words, and an exponent after it (45 \text{ units}^2)
_LAST_TEXT = re.compile(r"\\(?:text(?:rm|bf|it|normal|up)?|mbox|mathrm) ?\{([^{}]*)\}"
                        r"(?: ?\^ ?(?:\d|\{\d\}))?$")
# The last piece of an answer: a \text{} or a bare word, with an exponent (cm^2)
_TAIL = re.compile(r"(?:\\(?:text(?:rm|bf|it|normal|up)?|mbox|mathrm) ?\{([^{}]*)\}"
                   r"|(?<![\\A-Za-z])([A-Za-z]+)\.?)(?: ?\^ ?(?:\d|\{\d\}))? ?$")
# An angle in degrees as a trigonometric function's argument, which sympy would read in radians:
# \sin 30^\circ is \sin(30\pi/180).
_TRIG_DEGREES = re.compile(r"(\\(?:sin|cos|tan|cot|sec|csc) ?\(? ?)(\d+(?:\.\d+)?) ?°")


def _strip_units(t):
    """t without the units at its end, as long as something is left: 15 \\text{ cm}^2 is 15,
    8\\sqrt{3} \\text{ square inches} is 8\\sqrt{3}."""
    while (m := _TAIL.search(t)) and t[:m.start()].strip():
        words = (m[2] if m[1] is None else m[1]).replace(" /", "/").replace("/ ", "/").split()
        if not words or not all(_is_unit(w) for w in words):
            break
        t = t[:m.start()].strip()
    return t


def _is_unit(word):
    w = word.lower().rstrip(".")
    if "/" in w:
        return all(p in UNITS or p in _RATE_LETTERS for p in w.split("/"))
    return w in UNITS

# -----------------------------------------------------------------------------
# Plain numbers: exact fractions, no sympy

# The forms of a plain number, each matched at the start of the answer (after an optional "x ="
# and a sign), then words: scale words, then units. Digits grouped by spaces are one number only as
# thousands groups (1 000 000); 12 34 is no number.
_INT = r"\d{1,3}(?:,\d{3})+(?!\d)|\d{1,3}(?: \d{3})+(?![\d/])|\d+"
_ASSIGN = re.compile(r"[A-Za-z] ?= ?")
_SIGN = re.compile(r"([+-]?) ?")
_DECIMAL = re.compile(rf"({_INT})(\.\d*)?|\.\d+")  # 18, 1,000, 1 000, 18.50, 5., .5
_TIMES_TEN = re.compile(r"[eE]([+-]?\d{1,3})(?![\d.])| ?(?:\\times|\\cdot) ?10 ?\^ ?"
                        r"(?:\{ ?([+-]?\d{1,3}) ?\}|(\d))")  # 1e9, 6.02\times10^{23}
_SLASH = re.compile(r" ?/ ?(\d+)")  # 3/4 once 3 is read
_FRAC = re.compile(r"\\frac ?(?:\{ ?([+-]?(?:\d{1,3}(?:,\d{3})+|\d+)) ?\}|(\d)) ?"
                   r"(?:\{ ?(\d{1,3}(?:,\d{3})+|\d+) ?\}|(\d))")  # \frac{12}{5,525}
_BASE = re.compile(r"_ ?(?:\d|\{ ?\d+ ?\})")  # 52_8 [ours]: the digits, as MATH means them
_MIXED = re.compile(r"(?<!\d)(\d+) ?(?: (\d+) ?/ ?(\d+)|\\frac ?(?:\{ ?(\d+) ?\}|(\d)) ?"
                    r"(?:\{ ?(\d+) ?\}|(\d)))")  # 3 1/2, 3\frac{1}{2}
_ORDINAL = re.compile(r" ?(?:\^ ?)?(\{ ?)?(st|nd|rd|th)\b ?(\})?")  # 5th = 5^{th} = 5; 5rd is none
_REPEATING = re.compile(r" ?\\(?:overline|bar) ?\{ ?(\d{1,20}) ?\}")  # 0.1\overline{6} = 1/6


def _as_number(t):
    """(exact value as a Fraction, written with decimals, written with %) when t is a plain
    number, else None: an integer, a decimal (1.5e3 too), a/b, \\frac{a}{b}, a mixed number (3
    1/2 = 7/2, as GSM8K and MATH write them), a repeating decimal (0.\\overline{3}) or an ordinal
    (5th, 5^{\\text{th}}), after an optional "x =" and sign, followed only by scale words and then
    units. A few microseconds, no sympy."""
    if len(t) > 60:
        return None  # no plain number is this long; also keeps int() below its digit limit
    t = _TEXT.sub(r" \1 ", t).replace("%", " percent ").strip()
    i = m.end() if (m := _ASSIGN.match(t)) else 0
    sign = _SIGN.match(t, i)
    i, negative, decimals = sign.end(), sign[1] == "-", False
    if m := _MIXED.match(t, i):
        whole, num, den = (int(x) for x in m.groups() if x is not None)
        if not 0 < num < den or not whole:
            return None  # "3 4/2" and "0 3/4" are no mixed numbers we know
        value = whole + Fraction(num, den)
    elif m := _FRAC.match(t, i):
        num, den = (int(x.replace(",", "")) for x in m.groups() if x is not None)
        if den == 0:
            return None
        value = Fraction(num, den)
    elif m := _DECIMAL.match(t, i):
        value = Fraction(m[0].replace(",", "").replace(" ", ""))
        decimals = "." in m[0] and not m[0].endswith(".")
        if "." in m[0] and (r := _REPEATING.match(t, m.end())):  # exact: no rounding
            places = len(m[0]) - m[0].index(".") - 1
            value += Fraction(int(r[1]), (10 ** len(r[1]) - 1) * 10 ** places)
            m, decimals = r, False
        elif e := _TIMES_TEN.match(t, m.end()):
            value *= Fraction(10) ** int(e[1] or e[2] or e[3])
            m = e
        elif s := _SLASH.match(t, m.end()):
            if int(s[1]) == 0:
                return None
            value, m = value / int(s[1]), s
        elif (o := _ORDINAL.match(t, m.end())) and o[2] == _ordinal_suffix(value) and (
                bool(o[1]) == bool(o[3])):
            m = o
        elif b := _BASE.match(t, m.end()):
            m = b
    else:
        return None
    factor = _words_factor(t[m.end():])
    if factor is None:
        return None
    percent = "percent" in t[m.end():].lower()
    return (-value if negative else value) * factor, decimals, percent


def _ordinal_suffix(q):
    n = int(q)
    return "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _words_factor(words):
    """What the words after a number multiply it by (a Fraction), or None when one is neither a
    scale word nor a unit. A scale word multiplies only before any unit ("5 dollars per dozen" is
    5); an exponent belongs to a unit only (15 cm^2 is 15; 2^3 is no plain number)."""
    factor, seen_unit = Fraction(1), False
    for word in words.replace("^ ", "^").split():
        word, _, power = word.partition("^")
        if power and power.strip("{}") not in ("1", "2", "3"):
            return None
        scale = SCALES.get(word.lower()) or SCALES.get(word.lower()[:-1])  # millions too
        if scale and power:
            return None  # 5 million^2
        if scale and not seen_unit:
            factor *= scale
        elif _is_unit(word) or scale:
            seen_unit = True
        else:
            return None
    return factor


def _as_latex(q):
    return str(q.numerator) if q.denominator == 1 else f"\\frac{{{q.numerator}}}{{{q.denominator}}}"


def _numbers_equal(a, b):
    """Two plain numbers from _as_number compared exactly, as fractions: integers (1000001 is not
    1000000), exact decimals (0.1 = 1/10) and fractions. [ours] The one exception: a number written
    with decimals against a fraction with no finite decimal expansion (1/3, 2/7) can only be a
    rounding, so it is equal within REL_TOL (0.3333333 = 1/3, 0.3333 is not). Two decimals never
    get the tolerance: each is exactly what it says."""
    (x, x_decimal, _), (y, y_decimal, _) = a, b
    if x == y:
        return True
    rounded = (x_decimal and not _terminates(y)) or (y_decimal and not _terminates(x))
    return rounded and abs(x - y) <= REL_TOL * max(abs(x), abs(y))


def _percent_written_bare(a, b):
    """[ours] True for a bare number x against p% (either way round) when x = p and |x| > 1: data
    sets write "50" for "50%", and a model may too. In p% the value is already p/100. Not for
    |x| <= 1, where the bare number may as well be the fraction itself: 0.5% is not 0.5."""
    (x, x_dec, x_pct), (p, p_dec, p_pct) = a.number, b.number
    if x_pct == p_pct:
        return False
    if x_pct:
        (x, x_dec), (p, p_dec) = (p, p_dec), (x, x_dec)
    return abs(x) > 1 and _numbers_equal((x, x_dec, False), (p * 100, p_dec, False))


def _terminates(q):
    """True when the Fraction q has a finite decimal expansion: its denominator is 2^i 5^j."""
    d = q.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1

# -----------------------------------------------------------------------------
# The grammar of one value [ours]: what math-verify may compare


class _NotAValue(Exception):
    pass


_TOKEN = re.compile(r"\d+(?:\.\d+)?|\.\d+|\\[A-Za-z]+|\\.|\S")
_GREEK = frozenset(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi "
    "rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi "
    "Omega".split())
_FUNCTIONS = frozenset("sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp"
                       .split())
_RELATIONS = frozenset("= < > \\le \\leq \\ge \\geq \\lt \\gt \\leqslant \\geqslant \\in".split())
_ADD = frozenset("+ - \\pm \\mp".split())
_MUL = frozenset("* / \\cdot \\times \\div".split())
_SET_OPS = frozenset("\\cup \\cap \\setminus".split())
_CLOSERS = {"(": (")", "]"), "[": (")", "]"), "{": ("}",), "\\{": ("\\}",), "|": ("|",),
            "\\lfloor": ("\\rfloor",), "\\lceil": ("\\rceil",)}
_MATRICES = frozenset("pmatrix bmatrix matrix vmatrix Bmatrix".split())


class _Grammar:
    """A recursive-descent reader of one value: items separated by commas, each an expression,
    `var = expression` or `var \\in set` (the value is the right side), an inequality with a
    variable in it, or an equation. Expressions are what a final answer is made of: numbers,
    letters, Greek letters, \\pi, \\infty, + - \\pm \\cdot \\times / ^ _ ! %, brackets,
    |abs|, \\frac, \\sqrt, \\binom, functions, matrices, \\cup of sets. Anything else is no
    value: an unlisted command (`\\wedge`, `\\to`, `\\ldots`), a chain of relations (`5 = 6`),
    a list where one value belongs (`|5, 6|`, `\\sin(5, 6)`), a number after another factor side
    by side (`12 34`, `5 \\; 6^1`, `(5)(6)`, `2(3)`, which math-verify reads as 46, 30, 11 and 5).
    Each value is also worked out roughly (mpmath, a letter a number of its own): sympy computes
    what is written, for minutes on `3^{999 \\cdot 999 \\cdot 999}`, so an exponent, factorial or
    binomial of MAX_OPERAND or more, or a power or factorial of over MAX_DIGITS digits, is no value.
    read() returns (the latex of the value, each argument braced, its shape)."""

    def __init__(self, t):
        self.t, self.i, self.bars = t, 0, 0
        self.words, self.braced = set(), set()  # \begin{pmatrix}'s letters; arguments to brace
        self.tokens = [(m[0], m.start(), m.end()) for m in _TOKEN.finditer(t)]

    def peek(self):
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def take(self, *allowed):
        token = self.peek()
        if token is None or allowed and token not in allowed:
            raise _NotAValue()
        self.i += 1
        return token

    def read(self):
        items, shapes = [], []
        while True:
            shape, first = self.item()
            items.append(self._latex(first, self.i))
            shapes.append(shape)
            if self.peek() != ",":
                break
            self.take()
        if self.peek() is not None:
            raise _NotAValue()
        if len(items) > 1 or any(tok[0] in ("\\pm", "\\mp") for tok in self.tokens):
            return ", ".join(items), "list"
        return items[0], shapes[0]

    def _latex(self, first, last):
        """The text of tokens[first:last], each argument braced (math-verify reads `\\frac\\pi 6`
        as `\\frac{\\}{p}i 6`), with a space between two letters side by side: we read `inf` and
        `pct` as products of letters, and so must math-verify (alone, it reads \\infty and %)."""
        out, pos = [], self.tokens[first][1]
        for k in range(first, last):
            token, start, end = self.tokens[k]
            out.append(self.t[pos:start])
            if k > first and start == pos and token.isalpha() and len(token) == 1 and (
                    self.tokens[k - 1][0].isalpha()) and k not in self.words:
                out.append(" ")
            text = self.t[start:end]
            out.append("{" + text + "}" if k in self.braced else text)
            pos = end
        return "".join(out)

    def item(self):
        """(shape, index of the value's first token)."""
        starts, kinds, relations = [self.i], [self.setexpr()[0]], []
        while self.peek() in _RELATIONS:
            relations.append(self.take())
            starts.append(self.i)
            kinds.append(self.setexpr()[0])
        if not relations:
            return _SHAPES.get(kinds[0], "one"), starts[0]
        if relations in (["="], ["\\in"]) and kinds[0] == "var":
            return _SHAPES.get(kinds[1], "one"), starts[1]  # x = 5 is 5
        if relations == ["="] and any(len(tok) == 1 and tok.isalpha() or tok[1:] in _GREEK
                                      for tok, _, _ in self.tokens[starts[0]:self.i]):
            return "equation", starts[0]  # x^2 + y^2 = 13; 5 = 6 is no value
        if len(relations) <= 2 and "var" in kinds and not {"=", "\\in"} & set(relations):
            return "interval", starts[0]  # x > 2, -1 < x \le 3
        raise _NotAValue()

    # Each method below reads a piece and returns (its kind, its rough value): kind "int" or "num"
    # (a number, a fraction of two, bracketed or signed), "var", "interval", "list" or "other"

    def setexpr(self):
        kind, value = self.expr()
        kinds = [kind]
        while self.peek() in _SET_OPS:
            self.take()
            kinds.append(self.expr()[0])
        if len(kinds) > 1 and any(k not in ("interval", "list") for k in kinds):
            raise _NotAValue()  # 5 \cup 6
        return (kind if len(kinds) == 1 else "interval"), value

    def expr(self):
        sign = self.take() if self.peek() in _ADD else None
        (kind, value), terms = self.term(), 1
        value = -value if sign == "-" else value
        while self.peek() in _ADD:
            minus = self.take() == "-"
            term = self.term()[1]
            value = value - term if minus else value + term
            terms += 1
        if terms > 1 or sign and kind not in _NUMBERS:
            return "other", value
        return ("num" if sign else kind), value

    def term(self):
        kinds, (kind, _, value) = [], self.factor()
        while (token := self.peek()) is not None:
            if token in _MUL:
                self.take()
                kinds.append(kind)
                kind, _, factor = self.factor()
                value = _quotient(value, factor) if token in ("/", "\\div") else value * factor
            elif self._starts_factor(token):
                kinds.append(kind)
                kind, first, factor = self.factor()
                if first in _NUMBERS:
                    raise _NotAValue()  # 12 34, 5 6^1, (5)(6), 2(3), x 2: numbers go first
                value *= factor
            else:
                break
        if kinds:  # 3/4 and 2 \cdot 3 are numbers too: not after x either
            return ("num" if set(kinds + [kind]) <= _NUMBERS else "other"), value
        return kind, value

    def _starts_factor(self, token):
        return (token[0].isdigit() or token[0] == "." and len(token) > 1
                or token.isalpha() and len(token) == 1
                or token in ("(", "[", "{", "\\{", "\\lfloor", "\\lceil")
                or token == "|" and not self.bars
                or token[0] == "\\" and token[1:] in _ATOMS)

    def factor(self):
        """(kind, the atom's kind, value): the atom's kind tells a number with a postfix."""
        kind, value = first = self.atom()
        subscripts, last = 0, None
        while (token := self.peek()) in ("^", "_", "!", "'", "%"):
            self.take()
            subscripts += token == "_"
            if token in "_'" and kind != "var" or subscripts > 1 or token == last == "!":
                raise _NotAValue()  # 5_6, 5'6, x_1_2, 3!! (math-verify reads (3!)!)
            if token == "^":
                value = _power(value, self.arg()[1])
            elif token == "_":
                self.arg()
            elif token == "!":
                value = _not_huge(mpmath.factorial(abs(_operand(value))))
            elif token == "%":
                value /= 100
            kind, last = kind if token == "_" else "other", token
        return kind, first[0], value

    def atom(self):
        token = self.take()
        if token[0].isdigit() or token[0] == "." and len(token) > 1:
            return ("num" if "." in token else "int"), mpmath.mpf(token)
        if token.isalpha() and len(token) == 1:
            return "var", _letter(token)
        if token in _CLOSERS:
            self.bars += token == "|"
            kinds, value = self.group(_CLOSERS[token])
            self.bars -= token == "|"
            if token == "\\{":
                return "list", value
            if len(kinds) > 1 and token not in ("(", "["):
                raise _NotAValue()  # |5, 6|, \lfloor 5, 6 \rfloor, {5, 6}: one value or none
            if len(kinds) > 1:
                return "interval", value  # (5, 6), [0, 1)
            return (kinds[0] if token in ("(", "[", "{") or kinds[0] in _NUMBERS
                    else "other"), value
        name = token[1:] if token[0] == "\\" else None
        if name in _GREEK:
            return "var", _letter(name)
        if name in ("pi", "infty"):
            return "other", mpmath.pi if name == "pi" else mpmath.inf
        if name in ("emptyset", "varnothing"):
            return "list", mpmath.mpf(0)
        if name in ("frac", "binom"):
            (top, a), (bottom, b) = self.arg(brace=name == "binom"), self.arg(brace=name == "binom")
            if name == "binom":
                return "other", _power(2, abs(a))  # at most 2^n
            return ("num" if {top, bottom} <= _NUMBERS else "other"), _quotient(a, b)
        if name == "sqrt":
            root = 2
            if self.peek() == "[":
                self.take()
                root = self.expr()[1]
                self.take("]")
            return "other", _power(self.arg()[1], _quotient(1, root))
        if name == "overline":
            self.arg(brace=True)
            return "other", mpmath.mpf(1)
        if name == "mathbb":
            self.take("{")
            if not self.take().isalpha():
                raise _NotAValue()
            self.take("}")
            return "interval", mpmath.mpf(1)
        if name in _FUNCTIONS:
            scripts = {}
            while (script := self.peek()) in ("^", "_"):
                self.take()
                scripts[script] = self.arg()[1]
            kind, _, value = self.factor()  # the argument: \sin x, \log_2 8, \cos(2x)
            if kind in ("interval", "list"):
                raise _NotAValue()  # \sin(5, 6), \log(2, 8)
            return "other", _power(_power(mpmath.e, value) if name == "exp" else 1,
                                   scripts.get("^", 1))
        if name == "begin":
            return self.matrix()
        raise _NotAValue()  # an unlisted command, or an operator where a value should be

    def group(self, closers):
        """(the kinds of the items, the value of the first)."""
        kind, value = self.setexpr()
        kinds = [kind]
        while self.peek() == ",":
            self.take()
            kinds.append(self.setexpr()[0])
        self.take(*closers)
        return kinds, value

    def arg(self, brace=False):
        """The argument of \\frac, \\sqrt, ^ or _: {expr}, or one digit, letter or symbol, which
        _latex braces."""
        token = self.peek()
        if token == "{":
            self.take()
            kind, value = self.setexpr()
            self.take("}")
            if kind in ("interval", "list"):
                raise _NotAValue()  # \sqrt{\{5, 6\}}
            return kind, value
        if brace or token is None:
            raise _NotAValue()
        if token.isdigit() and len(token) > 1:  # \frac12: the 1, and the 2 is left
            _, start, end = self.tokens[self.i]
            self.tokens[self.i:self.i + 1] = [(token[0], start, start + 1),
                                              (token[1:], start + 1, end)]
            token = token[0]
        elif not (token.isdigit() or token.isalpha() and len(token) == 1
                  or token[1:] in _GREEK or token in ("\\pi", "\\infty")):
            raise _NotAValue()
        self.braced.add(self.i)
        return self.atom()

    def matrix(self):
        self.take("{")
        env, start = "", self.i
        while self.peek() not in ("}", None):
            env += self.take()
        self.words.update(range(start, self.i))
        self.take("}")
        if env not in _MATRICES:
            raise _NotAValue()
        self.setexpr()
        while self.take("&", "\\\\", "\\end") != "\\end":
            self.setexpr()
        self.take("{")
        start = self.i
        for c in env:
            self.take(c)
        self.words.update(range(start, self.i))
        self.take("}")
        return "other", mpmath.mpf(1)


_SHAPES = {"interval": "interval", "list": "list"}
_NUMBERS = frozenset("int num".split())
_HUGE = mpmath.mpf(10) ** MAX_DIGITS
_ATOMS = _GREEK | _FUNCTIONS | {"pi", "infty", "emptyset", "varnothing", "frac", "binom", "sqrt",
                                "overline", "mathbb", "begin"}


def _letter(name):
    """[ours] A letter's rough value: a complex number of its own, so that x - y is not 0."""
    return mpmath.mpc(1 + sum(map(ord, name)) % 97 / 97, 0.5)



def _operand(x):
    """x, when an exponent, factorial or binomial of it is safe to compute: |x| < MAX_OPERAND."""
    if not abs(x) < MAX_OPERAND:  # nan too
        raise _NotAValue()
    return x


def _not_huge(x):
    """x, when it has at most MAX_DIGITS digits."""
    if not abs(x) < _HUGE:  # nan too
        raise _NotAValue()
    return x


def _power(base, exponent):
    """base^exponent, when the exponent is below MAX_OPERAND and the power within MAX_DIGITS."""
    try:
        return _not_huge(base ** _operand(exponent))
    except ZeroDivisionError:  # 0^{-1}
        raise _NotAValue() from None


def _quotient(a, b):
    """a / b, infinite for b = 0 (`\\frac{1}{0}`: nothing sympy computes)."""
    try:
        return a / b
    except ZeroDivisionError:
        return mpmath.inf

# -----------------------------------------------------------------------------
# math-verify, behind two fences: the grammar's bounds and _too_deep, and a deadline


def _too_deep(s):
    """True when s nests brackets over MAX_NESTING deep: the grammar and sympy recurse on it."""
    depth = deepest = 0
    for c in s:
        if c in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "})]":
            depth -= 1
    return deepest > MAX_NESTING


class _OutOfTime(BaseException):
    """Raised by our SIGALRM handler. A BaseException, so that math-verify's and sympy's
    `except Exception` blocks cannot swallow it."""


def _with_deadline(fn, seconds):
    """fn(), interrupted after `seconds` of wall-clock time with _OutOfTime.

    Only the main thread can receive signals; in any other thread fn runs unfenced and the
    grammar's bounds are the only protection. The same when someone else's SIGALRM timer is
    already running (pytest-timeout, the caller's own): we leave theirs alone rather than clobber
    it.
    """
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer") or signal.getitimer(signal.ITIMER_REAL)[0] > 0
            or signal.getsignal(signal.SIGALRM) is None):
        return fn()

    def on_alarm(signum, frame):
        raise _OutOfTime()

    # [ours] The handler raises wherever the interpreter happens to be, and Python ignores an
    # exception raised inside a weakref callback or a __del__; sympy's caches fire such callbacks
    # all the time, so in a process with a large heap about one alarm in two was swallowed and sympy
    # ran on unfenced (1.8 s for a 0.5 s deadline, measured in the full test suite). So the alarm
    # repeats every RETRY_S until one lands, and the swallowed ones are not reported as "Exception
    # ignored".
    old, hook = signal.signal(signal.SIGALRM, on_alarm), sys.unraisablehook
    sys.unraisablehook = lambda u: None if isinstance(u.exc_value, _OutOfTime) else hook(u)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, RETRY_S)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:  # again: an alarm may have cut the line above short (the next one is RETRY_S away)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        sys.unraisablehook = hook


# math-verify's LaTeX extraction alone, with its unit stripping switched off: it removed any
# trailing \text{} whatever it said, and single letters (c, d, g, h, l, m, s, t) and "ab" as
# units, so 2\mathrm{i}, 3\text{i} and 2c equalled 2; read() drops units by our list. No fallback:
# its expression extraction read a bare number out of what its LaTeX parser could not (6 out of
# `|5, 6|`), so the grammar's value is parsed whole, or it is no value.
_EXTRACTION = [LatexExtractionConfig(normalization_config=LatexNormalizationConfig(
    basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all",
    equations=False))]

_warmed_up = False
# [ours] One comparison of each kind that loads more of sympy the first time: a polynomial (the
# LaTeX grammar, ~0.1 s, and simplification, ~0.3 s), an interval (0.24 s), a logarithm (0.18 s),
# a trigonometric value (0.16 s), an inequality (0.12 s), pi (0.09 s), a root (0.05 s): each
# measured as the first of its kind after the polynomial alone, on a quiet 2-core machine.
_WARM_UP = (("(a+1)^2", "a^2+2a+1"), ("[-2,7]", "[-2,7]"), ("\\log_2 8", "3"),
            ("\\sin(30\\pi/180)", "\\frac12"), ("x>2", "(2,\\infty)"),
            ("\\pi/4", "\\frac{\\pi}{4}"), ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"))


def _symbolic_equal(answer, reference, seconds=None):
    """math-verify's verdict on two LaTeX values, within `seconds` (DEADLINE_S) on the main
    thread."""
    global _warmed_up
    if not _warmed_up:
        # What sympy loads on first use is loaded once, outside the deadline, so that it is not
        # charged to whichever answer of its kind comes first (over 0.5 s on a busy machine: a
        # right answer graded 0 as a timeout).
        for gold, pred in _WARM_UP:
            _verify(pred, gold)
        _warmed_up = True
    return _with_deadline(lambda: _verify(answer, reference), seconds or DEADLINE_S)


def _verify(answer, reference):
    # The gold answer goes first: math-verify's verify is not symmetric. Both sides are boxed, the
    # form it extracts first. allow_set_relation_comp: an inequality answer equals an interval
    # reference (x > 2 = (2,\infty)); by default math-verify allows that only with the inequality
    # as the gold.
    gold, pred = (parse("\\boxed{" + s + "}", _EXTRACTION, "no_fallback", "first_match", None)
                  for s in (reference, answer))
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None,
                                                allow_set_relation_comp=True)
