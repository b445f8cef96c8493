r"""
Is an extracted answer equal to the reference? reward.py's grade asks compare(answer, reference);
the rules and their examples are in docs/grading.md.

    compare(answer, reference) -> "correct" | "wrong" | "timeout" | "error"
    canonical(s)                  a spelling-insensitive form of a LaTeX answer (no spaces, no $)

Grading has two paths. Most answers (all of GSM8K, half of MATH) are plain numbers, and those
compare as exact fractions in pure Python, in microseconds (_as_number, _numbers_equal), words after
the number included [ours]: a unit or noun is dropped, a scale word multiplies, and any other word
may be mathematics and makes the answer no plain number, so nothing mathematical is ever dropped.
Everything else goes through math-verify, which parses both sides into sympy and compares them
symbolically, with its own unit stripping off (it dropped single letters and any trailing \text{});
our rule drops a trailing unit there instead (_for_sympy). sympy can run for seconds or forever on a
hostile input (`2^{2^{40}}`), and a grader inside an RL loop sees hostile inputs, so that path has
two fences: cheap checks that send long, deeply nested or huge-number answers to a string
comparison (_too_risky), and, on the main thread, a wall-clock deadline (_with_deadline).
math-verify's own timeouts use signal.alarm (whole seconds, main thread only; in a worker thread
they raise), so we switch them off and keep our own.
"""
import logging
import re
import signal
import sys
import threading
from fractions import Fraction

from math_verify import (ExprExtractionConfig, LatexExtractionConfig, LatexNormalizationConfig,
                         parse, verify)

# -----------------------------------------------------------------------------
# Limits. The grader must return within a second on any completion.

REL_TOL = 1e-6            # a rounded decimal = a fraction when |a - b| <= REL_TOL * max(|a|, |b|)
MAX_SYMBOLIC_CHARS = 300  # longer answers are compared as strings only; MATH-500's longest is 53
MAX_NESTING = 12          # deeper ({[ nesting is compared as a string only
DEADLINE_S = 0.5          # main thread: wall-clock budget for one math-verify comparison
RETRY_S = 0.02            # after the deadline, the alarm repeats this often until it lands
# [ours], all five: the paper does not grade answers.

# We enforce our own time limits (see _with_deadline); math-verify's warnings that its own are
# off, and its per-timeout warnings, would only repeat that on every call.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def compare(answer, reference):
    """The outcome of comparing an extracted answer with a reference (both non-empty str):
    "correct", "wrong", "timeout" (math-verify ran out of time) or "error" (math-verify failed)."""
    a, b = _as_number(answer), _as_number(reference)
    if a is not None and b is not None:
        ok = _numbers_equal(a, b)
    elif canonical(answer) == canonical(reference):
        ok = True
    elif _too_risky(answer) or _too_risky(reference):
        ok = False  # only the string comparison above, which failed
    else:
        try:
            ok = _symbolic_equal(answer, reference)
        except _OutOfTime:
            return "timeout"
        except Exception:
            # math-verify catches its own errors; this is for whatever it lets through (a
            # RecursionError in sympy, say). An answer we cannot compare is not a right answer.
            return "error"
    return "correct" if ok else "wrong"

# -----------------------------------------------------------------------------
# Plain numbers: exact fractions, no sympy

# Wrappers that never change a value: math mode, spacing commands, \left/\right, \displaystyle.
_NOISE = re.compile(r"\\[!,;: ]|\\left|\\right|\\displaystyle|\$")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
# A text box is unwrapped into its words, with a space on either side, so that `3\text{i}` reads as
# "3 i" (a number and a letter) and `\text{18 dollars}` as "18 dollars"; what the words are worth is
# decided word by word below. Nothing is dropped here.
_TEXT_BOX = re.compile(r"\\(?:text|mbox|textrm|mathrm|textbf)\s*\{([^{}]*)\}")

# Words after a number [ours]. A plain number may be followed by words, and each word is one of:
#   a scale word, an exact multiplier, written right after the number: 1.5 million = 1500000,
#     2 dozen = 24, 5 million != 5. (Not "k": a single letter is as often a variable, so `5k` is no
#     plain number and math-verify reads it as 5k.)
#   a unit or another noun, which is dropped: 18 dollars = 18, 15 cm^2 = 15, 42 apples = 42;
#   anything else, which may be mathematics: then the answer is no plain number and math-verify
#     decides (2 \mathrm{i}, 2 pi and 2 xy are not 2).
# A word counts as a unit only when it cannot be mathematics: it is a listed abbreviation
# (_UNITS), or it has four letters or more and is no function, Greek letter, constant or
# value-changing word (_MATH_WORDS, _FUNCTION_OF). Single letters are variables or constants (x,
# i, e). Other words of two or three letters are ambiguous, a product of variables (xy, ab, mn) as
# likely as a unit, and we decide conservatively: not a unit, so that the answer is not a plain
# number and math-verify, which does not strip them either (see _EXTRACTION), decides. The cost is
# a false negative on an unlisted short unit (7 pm, 5 m), never a false positive on a symbol.
_SCALES = {"hundred": 100, "thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9,
           "trillion": 10 ** 12, "dozen": 12}
# "sec" and "min" are seconds and minutes here: right after a number, with no argument, they cannot
# be the functions. "per" and "of" join unit words (5 miles per hour, 3 cups of flour).
_UNITS = frozenset(
    "mm cm dm km in ft yd mi mg kg lb lbs oz ml cl dl gal qt pt cc ms sec secs min mins "
    "hr hrs wk wks yr yrs mph kph kmh sq cu deg rad usd per of".split())
_MATH_WORDS = frozenset(  # words of four letters or more that name mathematics, not a thing counted
    "alpha beta gamma delta epsilon varepsilon zeta theta vartheta iota kappa lambda sigma upsilon "
    "varphi omega omicron infty infinity sqrt frac cdot times sine cosine tangent "
    "half halves third thirds quarter quarters fourth fourths fifth fifths sixth sixths seventh "
    "sevenths eighth eighths ninth ninths tenth tenths hundredth hundredths thousandth thousandths "
    "millionth millionths billionth billionths squared cubed factorial".split())
# A function name, alone or applied to one letter: sin, sinh, arcsin, sinx, cosh, logx, lnx, sqrtx.
_FUNCTION_OF = re.compile(
    r"(?:arc)?(?:sin|cos|tan|cot|sec|csc)h?[a-z]?|(?:log|ln|lg|exp|sqrt)[a-z]?")


def _scale(word):
    """The multiplier a scale word stands for (million: 10^6, millions too), else None."""
    w = word.lower()
    return _SCALES.get(w) or _SCALES.get(w[:-1] if w.endswith("s") else w)


def _is_unit(word):
    """True when a word after a number is a unit or a noun, to be dropped; see above."""
    w = word.lower()
    if _scale(w):
        return False  # a multiplier, never dropped
    if w in _UNITS:
        return True
    return len(w) >= 4 and w not in _MATH_WORDS and not _FUNCTION_OF.fullmatch(w)


_WORD = re.compile(r"([A-Za-z]+)\.?(\s*\^\s*(?:\d|\{\s*\d\s*\}))?")  # cm, sq., cm^2, cm^{2}


def _words_factor(words):
    """What the words after a number multiply it by (a Fraction), or None when one may be math.

    A scale word multiplies only before any unit; after one it is part of the unit ("5 dollars per
    dozen" is 5). An exponent belongs to a unit only ("15 cm^2" is 15; "5 million^2" we do not
    read)."""
    factor, seen_unit = Fraction(1), False
    for word, power in _WORD.findall(words):
        if _scale(word) and not seen_unit and not power:
            factor *= _scale(word)
        elif _is_unit(word) or (_scale(word) and seen_unit):
            seen_unit = True
        else:
            return None
    return factor


_PLAIN = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)"  # 18, 1,000, 18.50, 5., .5
_SIGNED = r"(?:[A-Za-z]\w*\s*=\s*)?([+-]?)\s*"  # an optional "x =", then the sign
# Words after the number, separated by spaces (a space before the first is optional: 15cm). Two
# words always need a space between them, so a run of letters is one word and the pattern never
# backtracks into splitting it. An exponent belongs to a word only: "2^3" is no plain number
# (math-verify makes it 8).
_W = r"[A-Za-z]+\.?(?:\s*\^\s*(?:\d|\{\s*\d\s*\}))?"
_WORDS = rf"((?:\s*{_W}(?:\s+{_W})*)?)\s*\.?"
_FRAC = r"\\[dt]?frac\s*(?:\{{\s*({sign}\d+)\s*\}}|(\d))\s*(?:\{{\s*({sign}\d+)\s*\}}|(\d))"
# The forms of a plain number. In each, group 1 is the sign and the last group the words after it.
_AS_NUMBER = re.compile(rf"{_SIGNED}({_PLAIN}){_WORDS}")                    # 18, -1,000.5
_AS_SLASH = re.compile(rf"{_SIGNED}({_PLAIN})\s*/\s*({_PLAIN}){_WORDS}")     # 3/4, 1.5/2
_AS_FRAC = re.compile(rf"{_SIGNED}{_FRAC.format(sign='[+-]?')}{_WORDS}")     # \frac{3}{4}, \frac34
# [ours] A mixed number: a whole number, then a proper fraction of positive integers, with a space
# before a/b (3 1/2) and none needed before \frac (3\frac{1}{2}, as MATH writes it). It means
# 3 + 1/2 = 7/2, as in GSM8K's and MATH's solutions; a plain-number answer has no other reading.
_AS_MIXED = re.compile(
    rf"{_SIGNED}(\d+)(?:\s+(\d+)/(\d+)|\s*{_FRAC.format(sign='')}){_WORDS}")
_DECIMALS = re.compile(r"\.\d")  # "0.5", ".5"; not "5." (an integer with a full stop)


def _as_number(s):
    """(exact value as a Fraction, written with decimals) when s is a plain number, else None.

    A plain number: an integer, a decimal, a/b, \\frac{a}{b} or a mixed number, with $, %, commas,
    degrees and "x =" allowed, and after it only scale words and units (see _words_factor). This is
    the fast path: no sympy, a few microseconds."""
    if len(s) > 60:
        return None  # no plain number is this long; also keeps int() below its digit limit
    s = _NOISE.sub("", s.replace("\\$", "")).replace("{,}", ",").replace("\\%", "").replace("%", "")
    s = _TEXT_BOX.sub(r" \1 ", _DEGREES.sub("", s)).strip()
    s = re.sub(r",\s+(?=\d{3}\b)", ",", s)  # "11, 111, 100" once `\!` is gone
    if m := _AS_MIXED.fullmatch(s):
        whole, num, den = (int(x) for x in m.groups()[1:-1] if x is not None)
        if not 0 < num < den:
            return None  # "3 4/2" is no mixed number we know; math-verify decides
        value, decimals = whole + Fraction(num, den), False
    elif m := _AS_NUMBER.fullmatch(s):
        value, decimals = Fraction(m[2].replace(",", "")), _DECIMALS.search(m[2]) is not None
    elif m := _AS_SLASH.fullmatch(s) or _AS_FRAC.fullmatch(s):
        num, den = (x.replace(",", "") for x in m.groups()[1:-1] if x is not None)
        if Fraction(den) == 0:
            return None
        value = Fraction(num) / Fraction(den)
        decimals = any(_DECIMALS.search(x) for x in (num, den))
    else:
        return None
    factor = _words_factor(m.groups()[-1])
    if factor is None:
        return None
    return (-value if m[1] == "-" else value) * factor, decimals


def _numbers_equal(a, b):
    """Two plain numbers from _as_number, each (value, written with decimals), compared.

    Exactly, as fractions: integers (1000001 is not 1000000), exact decimals (0.1 = 1/10, 18.50 =
    18.5) and fractions of integers. [ours] The one exception: a number written with decimals
    against a fraction that has no finite decimal expansion (1/3, 2/7: a denominator with a prime
    factor other than 2 and 5). That decimal can only be a rounding, so it is equal within the
    relative tolerance REL_TOL (0.3333333 = 1/3, 0.3333 is not). Two decimals never get the
    tolerance: each is exactly what it says.
    """
    (x, x_decimal), (y, y_decimal) = a, b
    if x == y:
        return True
    rounded = (x_decimal and not _terminates(y)) or (y_decimal and not _terminates(x))
    return rounded and abs(x - y) <= REL_TOL * max(abs(x), abs(y))


def _terminates(q):
    """True when the Fraction q has a finite decimal expansion: its denominator is 2^i 5^j."""
    d = q.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def canonical(s):
    """A spelling-insensitive form of a LaTeX answer, for a cheap exact-string check (and for
    reward.extract_answer, an empty box is one whose canonical form is empty)."""
    s = _NOISE.sub("", s.replace("\\$", ""))
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _DEGREES.sub("", s)
    s = re.sub(r"\\(?:text|mbox|textbf|mathrm)\s*\{([^{}]*)\}", r"\1", s)
    return re.sub(r"\s+", "", s).rstrip(".")

# -----------------------------------------------------------------------------
# Everything else: math-verify, behind two fences

_HUGE = re.compile(
    r"\^\s*\{?\s*[+-]?\d{4,}"          # an exponent of 1000 or more
    r"|\^\s*\{[^{}]*\^"               # a tower a^{b^c}
    r"|\d{4,}\s*!|\\binom\s*\{?\s*\d{4,}"  # a factorial or binomial of 1000 or more
    r"|[\w)}\]]\s*!\s*!"                 # n!!: math-verify reads (n!)!, and 5!!! is (120!)!
    r"|\*\*"                           # python-style power: the same risks, unparsed by LaTeX rules
)


def _too_risky(s):
    """True when sympy might spend far too long on s, so we compare it as a string only.
    These are cheap fences for where no deadline can be set (a worker thread); they do not bound
    every slow sympy simplification (a (x+y+z)^{20} can take seconds there)."""
    if len(s) > MAX_SYMBOLIC_CHARS or _HUGE.search(s):
        return True
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
    _too_risky checks are the only protection. The same when someone else's SIGALRM timer is
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


# math-verify's default extraction (LaTeX, then plain expressions), with its unit stripping switched
# off. That step removes any trailing \text{...} or \mathrm{...} whatever it says, and a list of
# "units" that includes single letters (c, d, g, h, l, m, s, t) and "ab": it graded 2\mathrm{i},
# 3\text{i}, 2\mathrm{e}, 2c and 2 ab equal to 2 and 3. _for_sympy drops units by our rule instead.
_EXTRACTION = [
    LatexExtractionConfig(normalization_config=LatexNormalizationConfig(
        basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all",
        equations=False)),
    ExprExtractionConfig()]
# The words at the end of an answer: a text box of words, or bare words not glued to a command or a
# letter before them (`\pi inches`, not the "pi" of `\pi`); an exponent may follow.
_TRAILING_WORDS = re.compile(
    r"(?:\\(?:text|mbox|textrm|mathrm)\s*\{([A-Za-z .]*)\}"
    r"|(?<![\\A-Za-z])([A-Za-z]+(?:\s+[A-Za-z]+)*))"
    r"(?:\s*\^\s*(?:\d|\{\s*\d\s*\}))?\s*\.?\s*$")
_ROMAN_CONSTANT = re.compile(r"\\(?:text|mathrm|textrm|mbox)\s*\{\s*([ie])\s*\}")  # \mathrm{i}


def _for_sympy(s):
    """s as math-verify should see it. The words at its end are dropped when every one is a unit by
    _is_unit and something is left (8\\sqrt{3}\\text{ square inches} is 8\\sqrt{3}; \\text{Evelyn}
    and 2\\sqrt{2}\\text{ million} stay whole), and \\mathrm{i}, \\text{e} become the constants i
    and e."""
    m = _TRAILING_WORDS.search(s)
    if m and s[:m.start()].strip():
        words = re.findall(r"[A-Za-z]+", m[2] if m[1] is None else m[1])
        if all(_is_unit(w) for w in words):
            s = s[:m.start()]
    return _ROMAN_CONSTANT.sub(r" \1 ", s)


_warmed_up = False
# [ours] One comparison of each kind that loads more of sympy the first time: a polynomial (the
# LaTeX grammar, ~0.1 s, and simplification, ~0.3 s), an interval (0.24 s), a logarithm (0.18 s),
# a trigonometric value (0.16 s), an inequality (0.12 s), pi (0.09 s), a root (0.05 s): each
# measured as the first of its kind after the polynomial alone, on a quiet 2-core machine.
_WARM_UP = (("(a+1)^2", "a^2+2a+1"), ("x \\in [-2,7]", "[-2,7]"), ("\\log_2 8", "3"),
            ("\\sin 30^\\circ", "\\frac12"), ("x>2", "(2,\\infty)"), ("\\pi/4", "\\frac{\\pi}{4}"),
            ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"))


def _symbolic_equal(answer, reference):
    """math-verify's verdict on two LaTeX answers, within DEADLINE_S on the main thread."""
    global _warmed_up
    if not _warmed_up:
        # What sympy loads on first use is loaded once, outside the deadline, so that it is not
        # charged to whichever answer of its kind comes first (over 0.5 s on a busy machine: a
        # right answer graded 0 as a timeout).
        for gold, pred in _WARM_UP:
            verify(parse(f"${gold}$", _EXTRACTION, parsing_timeout=None),
                   parse(f"${pred}$", _EXTRACTION, parsing_timeout=None), timeout_seconds=None)
        _warmed_up = True

    def run():
        # The gold answer goes first: math-verify's verify is not symmetric (it may rewrite the
        # gold side, e.g. an assignment `x=5`). Both sides are boxed, the form it extracts first.
        gold = parse("\\boxed{" + _for_sympy(reference) + "}", _EXTRACTION, parsing_timeout=None)
        pred = parse("\\boxed{" + _for_sympy(answer) + "}", _EXTRACTION, parsing_timeout=None)
        return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)

    return _with_deadline(run, DEADLINE_S)
