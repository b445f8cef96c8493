r"""
Is a final answer equal to the reference? reward.py's grade asks judge(answer, reference); the
rules and their examples are in docs/grading.md.

    judge(answer, reference)   -> "hedge" (more values than the reference) or compare's outcome
    compare(answer, reference) -> "correct" | "wrong" | "timeout" | "error"
    values(answer)                the values an answer offers: "5 or 6" two, "(5, 6)" one
    canonical(s)                  a spelling-insensitive form of a LaTeX answer (no spaces, no $)

Grading has two paths. Most answers (all of GSM8K, half of MATH) are plain numbers, compared as
exact fractions in pure Python, in microseconds (_as_number, _numbers_equal), words after the
number included [ours]: a unit is dropped, a scale word multiplies, any other word may be
mathematics and makes the answer no plain number. Everything else goes through math-verify, which
parses both sides into sympy, with its own unit stripping off (it dropped single letters and any
trailing \text{}); _for_sympy drops a trailing unit by our rule instead. sympy can run for seconds
or forever on a hostile input (`2^{2^{40}}`), and a grader inside an RL loop sees hostile inputs,
so that path has two fences: long, deeply nested or huge-number answers compare as strings
(_too_risky), and on the main thread a wall-clock deadline stops it (_with_deadline); math-verify's
own timeouts use whole-second signal.alarm, which raises off the main thread, so they are off.
"""
import logging
import re
import signal
import sys
import threading
import time
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
    ok = _plain_equal(answer, reference)
    if ok is None and (_too_risky(answer) or _too_risky(reference)):
        ok = False  # only the string comparison above, which failed
    elif ok is None:
        try:
            ok = _symbolic_equal(answer, reference)
        except _OutOfTime:
            return "timeout"
        except Exception:
            # math-verify catches its own errors; this is for whatever it lets through (a
            # RecursionError in sympy, say). An answer we cannot compare is not a right answer.
            return "error"
    return "correct" if ok else "wrong"


def judge(answer, reference):
    """compare for a final answer, or "hedge" when it offers more different values than the
    reference does (values, distinct): "5 or 6" against 5 or against 6. Values the answer repeats
    count once and are compared once ("5 \\text{ or } 5.0" is 5); telling symbolic values apart
    gets half of DEADLINE_S, so that it and the comparison after it stay within a second."""
    if _too_risky(answer):
        return compare(answer, reference)  # compared as a string: only the reference's own passes
    offered, limit = values(answer), len(values(reference))
    if len(offered) > limit:
        offered = distinct(offered, limit, DEADLINE_S / 2)
        if len(offered) > limit:
            return "hedge"
        answer = ", ".join(offered)
    return compare(answer, reference)


def _plain_equal(answer, reference):
    """compare's fast path, with no sympy: True or False for two plain numbers, True for two equal
    spellings, else None (math-verify decides)."""
    a, b = _as_number(answer), _as_number(reference)
    if a is not None and b is not None:
        return _numbers_equal(a, b) or _percent_written_bare(answer, reference, a, b)
    return True if canonical(answer) == canonical(reference) else None

# -----------------------------------------------------------------------------
# Plain numbers: exact fractions, no sympy

# Wrappers that never change a value: math mode, spacing commands, \left/\right, \displaystyle.
_NOISE = re.compile(r"\\[!,;: ]|\\left|\\right|\\displaystyle|\$")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
# A text box is unwrapped into its words, with a space on either side, so that `3\text{i}` reads as
# "3 i" (a number and a letter) and `\text{18 dollars}` as "18 dollars"; what the words are worth is
# decided word by word below. Nothing is dropped here.
_TEXT_BOX = re.compile(r"\\(?:text|mbox|textrm|mathrm|textbf)\s*\{([^{}]*)\}")

# Words after a number [ours], each one of: a scale word, an exact multiplier right after the
# number (1.5 million = 1500000; not "k": a letter is as often a variable); a unit or a noun,
# dropped (18 dollars = 18, 15 cm^2 = 15); anything else, which may be mathematics: then the answer
# is no plain number and math-verify decides (2 \mathrm{i}, 2 pi, 2 xy are not 2). A unit is a
# listed abbreviation (_UNITS) or a word of four letters or more that names no mathematics
# (_MATH_WORDS, _FUNCTION_OF). Single letters and other short words (xy, ab) are not units: a false
# negative on an unlisted short unit (7 pm, 5 m), never a false positive on a symbol.
_SCALES = {"hundred": 100, "thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9,
           "trillion": 10 ** 12, "dozen": 12, "percent": Fraction(1, 100)}  # % is "percent"
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
_SI_LETTERS = frozenset("m s g h l".split())  # metre, second, gram, hour, litre: in a rate only
# A function name, alone or applied to one letter: sin, sinh, arcsin, sinx, cosh, logx, lnx, sqrtx.
_FUNCTION_OF = re.compile(
    r"(?:arc)?(?:sin|cos|tan|cot|sec|csc)h?[a-z]?|(?:log|ln|lg|exp|sqrt)[a-z]?")


def _scale(word):
    """The multiplier a scale word stands for (million: 10^6, millions too), else None."""
    w = word.lower()
    return _SCALES.get(w) or _SCALES.get(w[:-1] if w.endswith("s") else w)


def _is_unit(word):
    """True when a word after a number is a unit or a noun, to be dropped; see above. A rate (m/s,
    km/h, dollars/hour) is one when each part is a unit or one of _SI_LETTERS: alone a letter is a
    variable, but a letter over a letter written after a number is a unit."""
    w = word.lower()
    if "/" in w:
        return all(_is_unit(part) or part in _SI_LETTERS for part in re.split(r"\s*/\s*", w))
    if _scale(w):
        return False  # a multiplier, never dropped
    if w in _UNITS:
        return True
    return len(w) >= 4 and w not in _MATH_WORDS and not _FUNCTION_OF.fullmatch(w)


# cm, sq., cm^2, cm^{2}, m/s
_WORD = re.compile(r"([A-Za-z]+(?:\s*/\s*[A-Za-z]+)*)\.?(\s*\^\s*(?:\d|\{\s*\d\s*\}))?")


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
_W = r"[A-Za-z]+(?:\s*/\s*[A-Za-z]+)*\.?(?:\s*\^\s*(?:\d|\{\s*\d\s*\}))?"
_WORDS = rf"((?:\s*{_W}(?:\s+{_W})*)?)\s*\.?"
# Scientific notation: 1e9, 1.5e3, 6.02\times10^{23}; exponents of up to three digits.
_TIMES_TEN = (r"(?:[eE]([+-]?\d{1,3})"
              r"|\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*(?:\{\s*([+-]?\d{1,3})\s*\}|(\d)))?")
_FRAC = r"\\[dt]?frac\s*(?:\{{\s*({sign}\d+)\s*\}}|(\d))\s*(?:\{{\s*({sign}\d+)\s*\}}|(\d))"
# The forms of a plain number. In each, group 1 is the sign and the last group the words after it.
_AS_NUMBER = re.compile(rf"{_SIGNED}({_PLAIN}){_TIMES_TEN}{_WORDS}")        # 18, -1,000.5, 1e3
_AS_SLASH = re.compile(rf"{_SIGNED}({_PLAIN})\s*/\s*({_PLAIN}){_WORDS}")     # 3/4, 1.5/2
_AS_FRAC = re.compile(rf"{_SIGNED}{_FRAC.format(sign='[+-]?')}{_WORDS}")     # \frac{3}{4}, \frac34
# [ours] A mixed number: a whole number, then a proper fraction of positive integers, with a space
# before a/b (3 1/2) and none needed before \frac (3\frac{1}{2}, as MATH writes it). It means
# 3 + 1/2 = 7/2, as in GSM8K's and MATH's solutions; a plain-number answer has no other reading.
_AS_MIXED = re.compile(
    rf"{_SIGNED}(\d+)(?:\s+(\d+)/(\d+)|\s*{_FRAC.format(sign='')}){_WORDS}")
_DECIMALS = re.compile(r"\.\d")  # "0.5", ".5"; not "5." (an integer with a full stop)
_ORDINAL = re.compile(r"(\d+)\s*(st|nd|rd|th)")  # 5th = 5; 5rd is no ordinal


def _as_number(s):
    """(exact value as a Fraction, written with decimals) when s is a plain number, else None.

    A plain number: an integer, a decimal (1.5e3 too), a/b, \\frac{a}{b}, a mixed number or an
    ordinal (5th), with $, commas, degrees and "x =" allowed, and after it only scale words and
    units (see _words_factor); % is the scale word "percent", 1/100. This is the fast path: no
    sympy, a few microseconds."""
    if len(s) > 60:
        return None  # no plain number is this long; also keeps int() below its digit limit
    s = _NOISE.sub("", s.replace("\\$", "").replace("\\%", "%")).replace("{,}", ",")
    s = _TEXT_BOX.sub(r" \1 ", _DEGREES.sub("", s.replace("%", " percent "))).strip()
    s = re.sub(r",\s+(?=\d{3}\b)", ",", s)  # "11, 111, 100" once `\!` is gone
    if (m := _ORDINAL.fullmatch(s)) and m[2] == _ordinal_suffix(int(m[1])):
        s = m[1]
    if m := _AS_MIXED.fullmatch(s):
        whole, num, den = (int(x) for x in m.groups()[1:-1] if x is not None)
        if not 0 < num < den:
            return None  # "3 4/2" is no mixed number we know; math-verify decides
        value, decimals = whole + Fraction(num, den), False
    elif m := _AS_NUMBER.fullmatch(s):
        value, decimals = Fraction(m[2].replace(",", "")), _DECIMALS.search(m[2]) is not None
        value *= Fraction(10) ** int(m[3] or m[4] or m[5] or 0)
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


def _ordinal_suffix(n):
    return "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


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


_PERCENT = re.compile(r"%|\bpercents?\b", re.IGNORECASE)


def _percent_written_bare(answer, reference, a, b):
    """[ours] True for a bare number x against p% (either way round) when x = p and |x| > 1: data
    sets write "50" for "50%", and a model may too. a and b are the two sides' _as_number, in which
    p% is already p/100 (50% = 0.5). Not for |x| <= 1, where the bare number may as well be the
    fraction itself: 0.5% is not 0.5."""
    if bool(_PERCENT.search(answer)) == bool(_PERCENT.search(reference)):
        return False
    (x, x_decimal), (p, p_decimal) = (b, a) if _PERCENT.search(answer) else (a, b)
    return abs(x) > 1 and _numbers_equal((x, x_decimal), (p * 100, p_decimal))


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
# How many values an answer offers

# [ours] The values of an answer are its parts between separators: the words "or" and "and"
# (inside a \text{} too, and anywhere: "5 (or 6)" is two values), and at the top level (outside
# (), [], {}, \{\} and \begin...\end) a comma (not one inside a number: 1,080 and 1,\! 080 are
# one), ;, \\, \lor, \vee and \mid. A value with \pm or \mp is two, a+b and a-b.
_TOKEN = re.compile(r"\\\\|\\[{}]|\\[A-Za-z]+|\\.|[A-Za-z]+|[(\[{]|[)\]}]|[,;]")
_OPEN, _CLOSE = ("(", "[", "{", "\\{", "\\begin"), (")", "]", "}", "\\}", "\\end")
_SEPARATORS = (",", ";", "\\\\", "\\lor", "\\vee", "\\mid")
_TEXT_SEPARATOR = re.compile(r"[,;]|\b(?:or|and)\b", re.IGNORECASE)
_THOUSANDS = re.compile(r"(?:\s*\\!\s*)?\d{3}(?!\d)")  # after "1,"
_PLUS_MINUS = re.compile(r"\\(pm|mp)(?![A-Za-z])")


def values(s):
    """The values an answer offers (see above), each a non-empty string: values("5 \\text{ or }
    5.0") is ["5", "5.0"], values("(3, 4)") is ["(3, 4)"], values("\\pm 2") is ["+ 2", "- 2"]."""
    t = _TEXT_BOX.sub(lambda m: f" {m[1]} " if _TEXT_SEPARATOR.search(m[1]) else m[0], s)
    parts, depth, start = [], 0, 0
    for m in _TOKEN.finditer(t):
        w = m[0].lower()
        depth += (w in _OPEN) - (w in _CLOSE)
        if w in ("or", "and") or depth <= 0 and w in _SEPARATORS and not (
                w == "," and t[m.start() - 1:m.start()].isdigit() and _THOUSANDS.match(t, m.end())):
            parts.append(t[start:m.start()])
            start = m.end()
    parts = [p.strip() for p in parts + [t[start:]] if canonical(p)] or [s.strip()]
    return [v for p in parts for v in _plus_minus(p)]


def _plus_minus(value):
    """[value], or the two values it stands for when it holds \\pm or \\mp: a+b and a-b."""
    if not _PLUS_MINUS.search(value):
        return [value]
    return [_PLUS_MINUS.sub(lambda m: signs[m[1] == "mp"], value) for signs in ("+-", "-+")]


def distinct(answers, limit, seconds=0.0):
    """The first of each group of equal answers, by compare's equality, stopping once there are
    more than `limit`. math-verify is asked only within `seconds` in all; past that, two answers
    whose plain comparison cannot decide count as different."""
    found, end = [], time.monotonic() + seconds
    for a in answers:
        if not any(_equal_within(a, b, end - time.monotonic()) for b in found):
            found.append(a)
            if len(found) > limit:
                break
    return found


def _equal_within(a, b, seconds):
    """compare(a, b) == "correct", with math-verify given `seconds`; a timeout or error is False."""
    ok = _plain_equal(a, b)
    if ok is None and seconds > 0 and not (_too_risky(a) or _too_risky(b)):
        try:
            ok = _symbolic_equal(a, b, seconds)
        except (_OutOfTime, Exception):
            ok = False
    return bool(ok)

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
    r"(?:\\(?:text|mbox|textrm|mathrm)\s*\{([A-Za-z ./]*)\}"
    r"|(?<![\\A-Za-z])([A-Za-z]+(?:\s+[A-Za-z]+)*))"
    r"(?:\s*\^\s*(?:\d|\{\s*\d\s*\}))?\s*\.?\s*$")
# An angle in degrees as a trigonometric function's argument, which sympy would read in radians:
# \sin 30^\circ is \sin(30\pi/180).
_TRIG_DEGREES = re.compile(r"(\\(?:sin|cos|tan|cot|sec|csc)\s*\(?\s*)(\d+(?:\.\d+)?)"
                           r"\s*(?:\^\s*\{?\s*\\circ\s*\}?|°)")
_ROMAN_CONSTANT = re.compile(r"\\(?:text|mathrm|textrm|mbox)\s*\{\s*([ie])\s*\}")  # \mathrm{i}


def _for_sympy(s):
    """s as math-verify should see it. The words at its end are dropped when every one is a unit by
    _is_unit and something is left (8\\sqrt{3}\\text{ square inches} is 8\\sqrt{3}; \\text{Evelyn}
    and 2\\sqrt{2}\\text{ million} stay whole), and \\mathrm{i}, \\text{e} become the constants i
    and e, and an angle in degrees inside \\sin, \\cos, ... is read in degrees."""
    m = _TRAILING_WORDS.search(s)
    if m and s[:m.start()].strip():
        words = re.findall(r"[A-Za-z]+(?:\s*/\s*[A-Za-z]+)*", m[2] if m[1] is None else m[1])
        if all(_is_unit(w) for w in words):
            s = s[:m.start()]
    s = _TRIG_DEGREES.sub(r"\1(\2\\pi/180)", s)
    return _ROMAN_CONSTANT.sub(r" \1 ", s)


_warmed_up = False
# [ours] One comparison of each kind that loads more of sympy the first time: a polynomial (the
# LaTeX grammar, ~0.1 s, and simplification, ~0.3 s), an interval (0.24 s), a logarithm (0.18 s),
# a trigonometric value (0.16 s), an inequality (0.12 s), pi (0.09 s), a root (0.05 s): each
# measured as the first of its kind after the polynomial alone, on a quiet 2-core machine.
_WARM_UP = (("(a+1)^2", "a^2+2a+1"), ("x \\in [-2,7]", "[-2,7]"), ("\\log_2 8", "3"),
            ("\\sin 30^\\circ", "\\frac12"), ("x>2", "(2,\\infty)"), ("\\pi/4", "\\frac{\\pi}{4}"),
            ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"))


def _symbolic_equal(answer, reference, seconds=None):
    """math-verify's verdict on two LaTeX answers, within `seconds` (DEADLINE_S) on the main
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
    # The gold answer goes first: math-verify's verify is not symmetric (it may rewrite the gold
    # side, e.g. an assignment `x=5`). Both sides are boxed, the form it extracts first.
    # allow_set_relation_comp: an inequality answer equals an interval reference (x > 2 =
    # (2,\infty)); by default math-verify allows that only with the inequality as the gold.
    gold = parse("\\boxed{" + _for_sympy(reference) + "}", _EXTRACTION, parsing_timeout=None)
    pred = parse("\\boxed{" + _for_sympy(answer) + "}", _EXTRACTION, parsing_timeout=None)
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None,
                                                allow_set_relation_comp=True)
