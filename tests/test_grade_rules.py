"""The rules of docs/grading.md at their edges: a box the grammar refuses is worth nothing (no
fallback reads a number out of it), gaps are never erased, the forms real models write pay, huge
computed values are refused before sympy sees them; and a property test of the rule "a box holds
one value" over generated pairs of values."""
import multiprocessing
import random
import time
from fractions import Fraction

import pytest

from machinery import grader
from machinery.grader import canonical, read
from reward import final_answers, grade
from conftest import in_a_child


def boxed(answer):
    return "\\boxed{" + answer + "}"

# -----------------------------------------------------------------------------
# A box the grammar refuses scores 0: math-verify parses what the grammar read, whole, or nothing


REFUSED = [  # (answer, the numbers in it): each was paid against one of them
    (r"|5, 6|", ["5", "6"]),
    (r"\lfloor 5 \text{ or } 6 \rfloor", ["5", "6"]),
    (r"\lceil 5, 6 \rceil", ["5", "6"]),
    (r"{5, 6} + 0", ["5", "6"]),
    (r"\sin(5, 6)", ["5", "6"]),
    (r"\log(2, 8)", ["2", "8", "3"]),
    (r"\sqrt{\{5, 6\}}", ["5", "6"]),
]


@pytest.mark.parametrize("answer, numbers", REFUSED)
def test_a_box_the_grammar_refuses_scores_zero(answer, numbers):
    assert read(answer) is None
    assert [grade(boxed(answer), n) for n in numbers] == [0.0] * len(numbers)


@pytest.mark.parametrize("latex, reference", [
    (r"|5, 6|", "6"), (r"\sin(5, 6)", "6"), (r"\log(2, 8)", "8"), (r"\frac\pi 6", "6"),
    (r"\lfloor 5 , 6 \rfloor", "6")])
def test_math_verify_has_no_fallback(latex, reference):
    # asked directly, past the grammar: what its LaTeX parser cannot read whole is no value, not
    # the last number its expression extraction finds in it
    assert grader._symbolic_equal(latex, reference) is False


@pytest.mark.parametrize("answer, reference, expected", [
    (r"\frac\pi 6", "6", 0.0),                   # was 1: math-verify read \frac{\}{p}i 6
    (r"\frac\pi 6", r"\frac{\pi}{6}", 1.0),      # was 0: the grammar hands on braced arguments
    (r"\frac\pi6", r"\pi/6", 1.0),
    (r"\sqrt2 x^2", r"\sqrt{2}x^{2}", 1.0),
    (r"\log_2 8", "3", 1.0),
    # what math-verify cannot parse equals only the same value: x = v and v
    (r"x = \frac{-b \pm \sqrt{b^2-4ac}}{2a}", r"\frac{-b \pm \sqrt{b^2-4ac}}{2a}", 1.0),
    (r"x = \frac{-b \pm \sqrt{b^2-4ac}}{2a}", r"\frac{-b \pm \sqrt{b^2+4ac}}{2a}", 0.0),
])
def test_the_grammar_hands_on_what_it_read(answer, reference, expected, patient):
    assert grade(boxed(answer), reference) == expected


# -----------------------------------------------------------------------------
# Gaps are never erased: digits apart are one number only as thousands groups

GAPS = [
    (r"12 {} 34", "1234"), (r"12 \text{ } 34", "1234"), (r"12\phantom{0}34", "1234"),
    (r"12 {}{} 34", "1234"), (r"5 \; 6^1", "30"), (r"5 \; 6!", "720"), (r"5 \; {6}^1", "30"),
    (r"5^2 \, 6", "150"), (r"(5)^1 (6)", "30"), (r"|5| \, |6|", "30"), (r"\frac12 \; 3", "1.5"),
    (r"{3}{\frac{4}{2}}", "5"), (r"3\frac{4}{2}", "5"), (r"1.5 \; \frac{1}{2}", "0.75"),
]


@pytest.mark.parametrize("answer, reference", GAPS)
def test_gaps_are_not_erased(answer, reference, patient):
    assert canonical(answer) != canonical(reference)
    assert grade(boxed(answer), reference) == 0.0


@pytest.mark.parametrize("answer, shape", [
    ("x 2", None), (r"\pi 2", None), (r"\overline{CD} 3!", None), (r"\sqrt{2} \; 0", None),
    ("x (3/4)", None), (r"x |2 \cdot 3|", None), ("2x", "one"), (r"2\sqrt{2}", "one"),
    ("(x+1)(x-1)", "one"), ("x(x+1)", "one"), (r"\frac{1}{2}x", "one"), (r"x \cdot 2", "one"),
    (r"2 \cdot 3", "one")])
def test_a_number_comes_first(answer, shape):
    # a number after another factor side by side is two values, whatever precedes it
    value = read(answer)
    assert (value and value.shape) == shape

# -----------------------------------------------------------------------------
# What real models write

WRITTEN = [  # (completion, reference, reward)
    (r"\boxed{\mathbf{18}}", "18", 1.0),
    (r"\boxed{\mathbf{18}}", "17", 0.0),
    (r"\boxed{\boldsymbol{x+1}}", "1+x", 1.0),
    (r"\boxed{€18}", "18", 1.0),
    (r"\boxed{\pounds 18}", "18", 1.0),
    (r"\boxed{£1.5 \text{ million}}", "1500000", 1.0),
    (r"\boxed{0.\overline{3}}", "1/3", 1.0),
    (r"\boxed{0.\overline{3}}", "0.3333333", 1.0),     # a rounding of 1/3
    (r"\boxed{0.\overline{3}}", "0.3", 0.0),
    (r"\boxed{0.1\overline{6}}", r"\frac16", 1.0),
    (r"\boxed{0.\overline{142857}}", "1/7", 1.0),
    (r"\boxed{1.\overline{3}}", "4/3", 1.0),
    (r"\boxed{0.\overline{3}}", "3", 0.0),
    (r"\boxed{5^{\text{th}}}", "5", 1.0),
    (r"\boxed{5^\text{th}}", "5", 1.0),
    (r"\boxed{21^{st}}", "21", 1.0),
    (r"\boxed{5^{\text{rd}}}", "5", 0.0),               # only a number's own suffix
    (r"\boxed{50 \text{ per cent}}", "0.5", 1.0),
    (r"\boxed{50 per cent}", "50\\%", 1.0),
    (r"\boxed{50 \text{ per cent}}", "50", 1.0),         # a bare number for a percentage
    (r"\boxed{0.5 \text{ per cent}}", "0.5", 0.0),
    (r"Use \boxed, then: \boxed{18}", "18", 1.0),        # the command named in prose
    (r"Use \boxed to mark it: \boxed{18}", "18", 1.0),
    (r"(in \boxed) \boxed{18}", "18", 1.0),
    (r"\boxed: \boxed{18}", "18", 1.0),
    (r"so \boxed 18", "18", 1.0),                        # a brace-less box still counts
    (r"so \boxed -3", "-3", 1.0),
    (r"so \boxed \frac12", "0.5", 1.0),
    (r"\boxed{18} or \boxed 17", "18", 0.0),
    (r"\boxed{A} then \boxed B", "A", 0.0),
]


@pytest.mark.parametrize("text, reference, expected", WRITTEN)
def test_what_models_write(text, reference, expected, patient):
    assert grade(text, reference) == expected


def test_a_brace_less_box_stops_at_the_next_box():
    assert final_answers(r"\boxed1\boxed1\fbox1") == ["1"]
    assert final_answers(r"\boxed1\boxed2") == ["1", "2"]

# -----------------------------------------------------------------------------
# Huge computed values: refused by the grammar, in microseconds, even where no deadline can run


HUGE = [r"3^{999 \cdot 999 \cdot 999}", r"(999 \cdot 999 \cdot 99)!", r"x^{999 \cdot 999}",
        r"2^{\frac{1}{1 - 0.999999}}", r"(x - x + 10^{6})!", r"10^{99}^{99}^{99}",
        r"\binom{999 \cdot 999}{2}", r"\sqrt[0.0001]{10}", r"e^{999 \cdot 999}",
        r"\exp(999 \cdot 999)", r"(10^{400})^{9}", r"3!!", r"2^{2^{40}}", r"1000000!"]
FINE = [r"2^{10}", r"2^{2^3}", r"e^{-x^2}", r"(n+1)!", r"\binom{2n}{n}", r"x^{999}", r"100!",
        r"10^{-3}", r"e^{i\pi/3}", r"\sqrt[3]{2}", r"2^{n+1}", r"\frac{1}{x+1}", r"(x+1)^{-2}"]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_huge_computed_values_are_refused_fast(warm):
    def grade_all():
        times = []
        for answer in HUGE:
            t0 = time.perf_counter()
            assert grade(boxed(answer), "3") == 0.0
            times.append(time.perf_counter() - t0)
        return max(times)
    assert in_a_child(grade_all, 20, thread=True) < 0.5  # was over 30 s for the first
    assert [a for a in HUGE if read(a) is not None] == []
    assert [a for a in FINE if read(a) is None] == []


def test_huge_values_still_equal_their_own_spelling():
    assert grade(boxed(r"3^{999 \cdot 999 \cdot 999}"), r"3^{999\cdot999\cdot999}") == 1.0


@pytest.fixture
def warm():
    grader._symbolic_equal("x^2", "x^2")


@pytest.fixture
def patient(monkeypatch):
    monkeypatch.setattr(grader, "DEADLINE_S", 30.0)  # what is graded, not how fast (test_reward)

# -----------------------------------------------------------------------------
# A box holds one value: for generated pairs of distinct values a, b joined by any separator,
# wrapper, function or LaTeX form, the grade never pays both, and pays either only when the
# grammar read exactly one value; two values side by side pay nothing, nor their product or digits


VALUES = ["0", "1", "5", "6", "7", "12", "20", "34", "1000", "-3", "2.5", "0.3", r"\frac{1}{2}",
          "3/4", r"\sqrt{2}", r"2\pi", "x+1"]
SIDE_BY_SIDE = ["A B", r"A \; B", r"A \, B", r"A \quad B", "A~B", r"A \ B", "A {} B",
                r"A \text{ } B", r"A\phantom{0}B", "{A}{B}", "(A)(B)", "[A] B", r"A \; B^1",
                r"A \; B!", r"A \; {B}^1", "(A) B^{1}", r"A^1 \; B", r"|A| \, |B|", r"A \; (B)",
                r"\mathbf{A} \; \mathbf{B}", r"A \; B \%"]
JOINED = [
    "A, B", "A; B", "A or B", r"A \text{ or } B", r"A \text{ and } B", r"A \lor B", r"A \vee B",
    r"A \mid B", "A | B", r"A \to B", r"A \wedge B", "A = B", "A < B", r"A \le B", r"A \approx B",
    r"A \pm B", "A & B", r"A \\ B", r"A \ldots B", "A / B", r"A \cdot B", "A + B", "A - B",
    r"A \cup B", r"A \text{, } B", r"A \text{ or maybe } B", r"A \Rightarrow B", "A -> B",
    "(A, B)", "[A, B]", r"\{A, B\}", "|A, B|", r"\lfloor A, B \rfloor",
    r"\lceil A \text{ or } B \rceil", "{A, B}", r"\left(A, B\right)", r"\langle A, B \rangle",
    r"\mathbf{A, B}", r"\overline{A, B}", r"\text{A or B}", r"\begin{pmatrix} A & B \end{pmatrix}",
    r"\begin{cases} A \\ B \end{cases}", r"\sin(A, B)", r"\log(A, B)", r"\max(A, B)",
    r"\gcd(A, B)", r"\sqrt{A, B}", r"\sqrt[A]{B}", r"\frac{A}{B}", r"\frac A B",
    r"\binom{A}{B}", "A^{B}", "A_{B}", r"\log_{A} B", r"x = A \text{ or } x = B", "x = A, B",
    r"\boxed{A} \text{ or } B", r"\boxed{A} B", r"\text{A} \text{B}", r"A \text{ not } B",
    r"A \; (\text{or } B)",
]


def _number(v):
    """The exact value of a plain number in VALUES, or None for the symbolic ones."""
    v = v.replace("\\frac{1}{2}", "1/2")
    try:
        return Fraction(v)
    except ValueError:
        return None


def _written(q):
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def _cases(rng, forms, n, right=VALUES):
    """n pairs of distinct values for each form, and the answer each writes; the right-hand value
    b from `right`."""
    for form in forms:
        for a in rng.choices(VALUES, k=n):
            b = rng.choice([v for v in right if v != a])
            yield form, a, b, form.replace("A", "\0").replace("B", b).replace("\0", a)


def test_each_form_holds_each_value_once():
    # A and B stand for the values: no LaTeX command of the tables spells either letter
    assert [f for f in SIDE_BY_SIDE + JOINED if (f.count("A"), f.count("B")) != (1, 1)] == []


def test_a_box_holds_one_value(patient):
    rng = random.Random(58)
    failures = []
    for form, a, b, answer in _cases(rng, JOINED, 6):
        paid = [x for x in (a, b) if grade(boxed(answer), x)]
        value = read(answer)
        if len(paid) == 2 or paid and (value is None or value.shape != "one"):
            failures.append((form, a, b, paid, value))
        # one of the two paid whatever the other is: it was read alone (0 and 1 aside: 0 \cdot b;
        # and a base: 52_8 is 52 [ours], as MATH writes a number in base 8)
        for x in (x for x in paid if x not in ("0", "1") and form != "A_{B}"):
            others = rng.sample([v for v in VALUES if v not in (a, b, "0", "1")], 2)
            if all(grade(boxed(form.replace("AB"[x == a], o).replace("AB"[x == b], x)), x)
                   for o in others):
                failures.append((form, a, b, "pays", x, "whatever the other is"))
    # a number on the right: a term before it (1 \sqrt{2}) or a sign (5 \; -3) makes one value
    plain = [v for v in VALUES if _number(v) is not None and _number(v) >= 0]
    for form, a, b, answer in _cases(rng, SIDE_BY_SIDE, 6, plain):
        x = _number(a)
        references = [a, b] + ([_written(x * _number(b))] if x is not None else [])
        if a.isdigit() and b.isdigit():
            references.append(a + b)  # the digits side by side
        paid = [r for r in references if grade(boxed(answer), r)]
        if paid:
            failures.append((form, a, b, paid))
    assert failures == []
