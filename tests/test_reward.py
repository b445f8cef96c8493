"""Tests for reward.py and machinery/grader.py: reading boxes, the final answers, one value per box,
grading (hand-written tables, real GSM8K / MATH-500 references and solutions, adversarial
completions), linear time, and the batch scorer."""
import importlib
import json
import multiprocessing
import random
import re
import signal
import threading
import time
from fractions import Fraction

import pytest

from machinery import grader
from machinery.data import _answer
from machinery.grader import boxes, last_boxed, read

import reward
from conftest import SHARED, requires_shared, seconds_in_a_child
from reward import extract_answer, final_answers, grade, score

# -----------------------------------------------------------------------------
# Boxes: every \boxed{} and \fbox{}, nested ones too, in one pass

@pytest.mark.parametrize("text, expected", [
    (r"so $\boxed{5}$.", "5"),
    (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),                 # nested braces
    (r"\boxed{1} first, then \boxed{2}", "2"),                  # the last one
    (r"\fbox{3}", "3"),
    (r"\boxed 5$", "5"),                                        # the brace-less form
    (r"\boxed {7}", "7"),                                       # space before the brace
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),                           # escaped braces do not count
    (r"\boxed{\left[ 0, \frac{\pi}{2} \right)}", r"\left[ 0, \frac{\pi}{2} \right)"),
    (r"\boxed{}", ""),
    (r"\boxed{12", None),                                       # never closes: cut off
    (r"\boxed{1} and \boxedsymbol", "1"),                       # another command, not a box
    (r"\boxed{\boxed{5} - 1}", "5"),                            # the last to open
    ("no box at all 42", None),
    ("", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text, contents", [
    (r"\boxed{\boxed{5} - 1}", [r"\boxed{5} - 1", "5"]),        # in the order they open
    (r"\fbox{a} \boxed{b{c}} \boxed 7 then", ["a", "b{c}", "7"]),
    ("\\boxed{6}\n\nNote that \\boxed\nwas used.", ["6"]),     # the command named in prose
    (r"\boxed{6} and \boxed", None),                            # ... but at the end: cut off
    (r"\boxed{6} and \boxed{7", None),
    (r"\\boxed{6}", []),                                        # `\\` is a line break, then text
    (r"} \boxed{6} }", ["6"]),                                  # stray braces around a box
    (r"\beta \boxed{6}", ["6"]),
])
def test_boxes(text, contents):
    spans = boxes(text)
    assert (None if spans is None else [text[a:b] for a, b in spans]) == contents


# -----------------------------------------------------------------------------
# final_answers / extract_answer: the boxes, or with no box the #### lines

@pytest.mark.parametrize("text, expected", [
    (r"#### 7 but finally \boxed{9}, and 11", "9"),             # a box beats ####
    ("She pays 5 + 2 = 7.\n#### 1,000\nand then 3", "1,000"),  # the rest of the #### line
    ("#### 4\n#### 8 then 9", "4 | 8 then 9"),                  #   every line, as written
    ("#### $18.\n", "$18."),
    ("#### **18**\n", "18"),                                    #   markdown's emphasis dropped
    ("####\n18", None),                                         # an empty #### line: no answer
    (r"I will put it in \boxed{12", None),                      # a cut-off box is no answer
    (r"\boxed{ }", None),                                       # an empty box is no answer
    (r"put it in \boxed{}. So \boxed{5}", "5"),                 # an empty box is skipped
    (r"\boxed{5}, as asked in \boxed{}", "5"),
    (r"\boxed{5} then \boxed{ $ $ } and \boxed{\text{}}", "5"),  # spacing, math mode: empty too
    (r"\boxed{5} \boxed{~} \boxed{\quad} \boxed{\phantom{0}}", "5"),
    (r"put it in \boxed{}." "\n#### 7\n", "7"),                 # only empty boxes: the #### line
    (r"\boxed{5} or \boxed{6}", "5 | 6"),                       # every box: two spellings
    (r"$\boxed{5}$ and $\boxed{ 5 }$ and \boxed{\text{5}}", "5"),  # one spelling, three times
    (r"first \boxed{3}, on reflection \boxed{5}", "3 | 5"),
    (r"\boxed{\boxed{5}}", r"\boxed{5} | 5"),                   # boxes at any depth
    (r"which is $\frac{72}{6}$, or $\boxed{12}$.", "12"),
    (r"\boxed{5} or 6", "5"),                                   # outside a box nothing is read
    ("The answer is 12. Check: 12 + 1 = 13", None),            # nor in prose
    (r"The answer is $\frac{1}{2}$.", None),
    ("so x = 5 and y = -3", None),
    (r"answer in \boxed{}. 3 + 4 = 7", None),
    ("no numbers here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_final_answers_stop_past_the_limit():
    text = "".join(f"\\boxed{{{i}}}" for i in range(1000))
    assert final_answers(text) == [str(i) for i in range(grader.MAX_SPELLINGS + 1)]
    assert score([text], ["0"])[1]["hedge"] == 1


# -----------------------------------------------------------------------------
# The classes of answers found paid, or refused, against the rules. Each row: (completion,
# reference, reward, outcome). The grader this replaced gave every row another reward but the nine
# marked "kept" (two of them 0 as "wrong", not as a hedge).

FOUND = [
    # 1. boxes that disagree are a hedge, whatever stands between them
    (r"\boxed{5} / \boxed{6}", "6", 0.0, "hedge"),
    (r"\boxed{5} (or \boxed{6})", "6", 0.0, "hedge"),
    (r"**\boxed{5}** or **\boxed{6}**", "6", 0.0, "hedge"),
    ("- \\boxed{5}\n- \\boxed{6}", "6", 0.0, "hedge"),
    (r"\boxed{5} vs. \boxed{6}", "6", 0.0, "hedge"),
    (r"\boxed{5}, or possibly \boxed{6}", "6", 0.0, "hedge"),
    (r"\boxed{5} \to \boxed{6}", "6", 0.0, "hedge"),
    (r"$\boxed{5}$ | $\boxed{6}$", "6", 0.0, "hedge"),
    (r"\boxed{5} \& \boxed{6}", "6", 0.0, "hedge"),
    (r"\boxed{5}; alternatively \boxed{6}", "6", 0.0, "hedge"),
    (r"\boxed{5} \text{ or perhaps } \boxed{6}", "6", 0.0, "hedge"),
    ("\\boxed{5}\n\nWait, actually \\boxed{6}", "6", 0.0, "hedge"),
    (r"first \boxed{3}, on reflection \boxed{5}", "5", 0.0, "hedge"),
    (r"\fbox{5}. Final: \boxed{6}", "6", 0.0, "hedge"),
    ("#### 5\n#### 6\n", "6", 0.0, "hedge"),
    # 2. nested boxes: every box counts, the outer one read with the inner unwrapped
    (r"\boxed{\boxed{5} \text{ or } 6}", "5", 0.0, "hedge"),
    (r"\boxed{\text{not } \boxed{5}}", "5", 0.0, "hedge"),
    (r"\boxed{\boxed{5} - 1}", "4", 0.0, "hedge"),               # kept: 0, then as "wrong"
    (r"\boxed{6 \boxed{5}}", "5", 0.0, "hedge"),
    (r"\fbox{\boxed{5} or 6}", "5", 0.0, "hedge"),
    (r"\boxed{\boxed{5} \text{ is wrong; } 6}", "5", 0.0, "hedge"),
    (r"\boxed{\boxed{5} \text{ is wrong; } 6}", "6", 0.0, "hedge"),  # kept: 0, then "wrong"
    # 3. a word that is no unit makes a box no value (not a unit dropped)
    (r"\boxed{6 \text{ doubled}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ halved}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ elevenths}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ plus three}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ point five}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ negative}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ thousand three hundred}}", "6000", 0.0, "wrong"),
    (r"\boxed{6 \text{ inverse}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ reciprocal}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ twice}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ negated}}", "6", 0.0, "wrong"),
    (r"\boxed{6 \text{ tenfold}}", "6", 0.0, "wrong"),
    ("#### 6 doubled\n", "6", 0.0, "wrong"),
    # 4. an operator is no value, never one of its sides
    (r"\boxed{5 \wedge 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 = 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \to 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \Rightarrow 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \implies 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \approx 6}", "5", 0.0, "wrong"),
    (r"\boxed{5 \sim 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \cup 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \setminus 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \perp 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 \circ 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 & 6}", "6", 0.0, "wrong"),
    (r"\boxed{5 -> 6}", "6", 0.0, "wrong"),
    (r"\boxed{x = 5 = 6}", "6", 0.0, "wrong"),
    (r"\boxed{x^2 + y^2 = 13}", "13", 0.0, "wrong"),            # an equation is no number
    (r"\boxed{5 \ldots 6}", "11", 0.0, "wrong"),
    (r"\boxed{5'6}", "56", 0.0, "wrong"),
    (r"\boxed{6 inf}", r"\infty", 0.0, "wrong"),                 # letters are letters: i n f
    (r"\boxed{5 pct}", "0.05", 0.0, "wrong"),
    # 5. digits apart are one number only as thousands groups; numbers side by side are no value
    (r"\boxed{12 34}", "1234", 0.0, "wrong"),
    (r"\boxed{12\,34}", "1234", 0.0, "wrong"),
    (r"\boxed{12~34}", "1234", 0.0, "wrong"),                    # kept
    (r"\boxed{5 \quad 6}", "11", 0.0, "wrong"),
    (r"\boxed{(5)(6)}", "11", 0.0, "wrong"),
    (r"\boxed{2(3)}", "5", 0.0, "wrong"),
    (r"\boxed{{5}{6}}", "11", 0.0, "wrong"),
    (r"\boxed{[5] 6}", "11", 0.0, "wrong"),
    # 6. and what the old rules refused that is one answer
    ("\\boxed{6}\n\nNote that \\boxed\nwas used.", "6", 1.0, "correct"),
    (r"\boxed{6} and later \boxed{~}", "6", 1.0, "correct"),
    (r"\boxed{6} and later \boxed{\quad}", "6", 1.0, "correct"),
    (r"\boxed{6} and later \boxed{\phantom{6}}", "6", 1.0, "correct"),  # kept
    ("#### **18**\n", "18", 1.0, "correct"),
    ("#### *18*\n", "18", 1.0, "correct"),
    ("#### __18__\n", "18", 1.0, "correct"),
    (r"\boxed{1\,000}", "1000", 1.0, "correct"),               # kept: thousands groups
    (r"\boxed{1 000 000}", "1000000", 1.0, "correct"),          # kept
    (r"\boxed{\boxed{5}}", "5", 1.0, "correct"),                # kept: boxes that agree
    (r"\boxed{5} and so \boxed{5.0}", "5", 1.0, "correct"),     # kept
    (r"\boxed{\frac{1}{2}}, i.e. \boxed{0.5}", "0.5", 1.0, "correct"),  # kept
]


@pytest.mark.parametrize("text, reference, reward_, outcome", FOUND)
def test_found(text, reference, reward_, outcome, patient):
    assert grade(text, reference) == reward_
    assert reward._judge(text, reference, False) == (reward_, outcome)


def test_found_table_covers_every_class():
    assert len(FOUND) >= 60 and {o for *_, o in FOUND} == {"hedge", "wrong", "correct"}


# Found paid by earlier graders: prose is never read
W = "Janet has 6 + 6 = 12 eggs.\n"
FOUND_PAID = [
    ("The answer is 5 OR 6.", ["5", "6"]),
    ("The answer is 5, or maybe 6.", ["5", "6"]),
    ("The answer is 5 (or 6).", ["5", "6"]),
    ("The answer is 5\nor 6", ["5", "6"]),
    ("The answer is not 5; it is 7.", ["5", "7"]),
    ("The answer is negative 5.", ["5"]),
    ("The answer is at least 5.", ["5"]),
    ("The answer is between 5 and 6.", ["5", "6"]),
    ("The answer is 5. Wait, no: 6.", ["5", "6"]),
    ("Answer: 5 or 6", ["5", "6"]),
    (W + "The answer is eleven.", ["11", "12"]),
]


@pytest.mark.parametrize("text, references", FOUND_PAID)
def test_prose_is_never_read(text, references, patient):
    assert [grade(text, r) for r in references] == [0.0] * len(references)


# The same words in the asked format: one box or line, read as a whole, is no value
IN_FORMAT = [
    ("#### not 5; it is 7\n", ["5", "7"]),
    ("#### negative 5\n", ["5"]),
    ("#### less than 5\n", ["5"]),
    ("#### at least 5\n", ["5"]),
    ("#### 5 to 6\n", ["5", "6"]),
    ("#### between 5 and 6\n", ["5", "6"]),
    ("#### 5. Wait, no: 6.\n", ["5", "6"]),
    ("#### eleven\n", ["11"]),
    ("#### 5 OR 6\n", ["5", "6"]),                      # a list: not 5, not 6
    ("#### 5 (or 6)\n", ["5", "6"]),
    ("#### 5, 6\n", ["5", "6"]),
    ("#### 5 apples or 6 apples\n", ["5", "6"]),
    (r"\boxed{5 \text{ OR } 6}", ["5", "6"]),
    (r"\boxed{5, \text{ or maybe } 6}", ["5", "6"]),
    (r"\boxed{5 (\text{or } 6)}", ["5", "6"]),
    (r"\boxed{\text{not } 5}", ["5"]),
    (r"\boxed{\text{at least } 5}", ["5"]),
    (r"\boxed{5 \text{ to } 6}", ["5", "6"]),
    (r"\boxed{5; 6}", ["5", "6"]),
    (r"\boxed{5 \text{ and } 6}", ["5", "6"]),
    (r"\boxed{1 \\ 2 \\ 3 \\ 4 \\ 6}", ["6"]),
    (r"\boxed{5 \lor 6}", ["5", "6"]),
    (r"\boxed{5 \vee 6}", ["5", "6"]),
    (r"\boxed{1 \mid 2 \mid 6}", ["1", "6"]),
    (r"\boxed{\pm 5}", ["5", "-5"]),                    # \pm is two values
    (r"\boxed{5 \pm 1}", ["4", "6"]),
    (r"\boxed{5 \mp 1}", ["4", "6"]),
]


@pytest.mark.parametrize("text, references", IN_FORMAT)
def test_words_in_the_asked_format_are_read_whole(text, references, patient):
    assert [grade(text, r) for r in references] == [0.0] * len(references)


# -----------------------------------------------------------------------------
# read: one value, or None

@pytest.mark.parametrize("answer, kind, shape", [
    ("18", "number", "one"),
    (r"\$1,000", "number", "one"),
    (r"1.5 \text{ million dollars}", "number", "one"),
    ("x = -5", "number", "one"),
    (r"\frac{\sqrt{3}}{2}", "math", "one"),
    (r"y = 2x + 3", "math", "one"),                             # var = value is the value
    (r"x^2 + y^2 = 13", "math", "equation"),
    (r"x > 2", "math", "interval"),
    (r"-1 < x \le 3", "math", "interval"),
    ("(3, 4)", "math", "interval"),                             # a pair or an open interval
    (r"[0, \infty)", "math", "interval"),
    (r"(0,9) \cup (9,36)", "math", "interval"),
    ("3, 4", "math", "list"),                                   # solutions
    (r"\{1, 2\}", "math", "list"),
    (r"x = 2 \text{ or } x = 3", "math", "list"),
    (r"1 \pm \sqrt{19}", "math", "list"),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", "math", "one"),
    (r"\text{Evelyn}", "text", "one"),
    (r"(\text{E})", "text", "one"),
    (r"\log_2 8 + \sin^2 x + |y| + \lfloor z \rfloor", "math", "one"),
    (r"2\sqrt[3]{x} e^{i\pi} \binom{5}{2} \overline{CD} \cdot 3!", "math", "one"),
])
def test_read_values(answer, kind, shape):
    value = read(answer)
    assert (value.kind, value.shape) == (kind, shape)


@pytest.mark.parametrize("answer", [
    r"5 \wedge 6", "5 = 6", r"5 \to 6", r"x = 5 = 6", "12 34", "(5)(6)", r"1.5 \frac{1}{2}",
    r"6 \text{ doubled}", r"\text{not } 5", r"5 \cup 6", "x_6_7", "5'6", r"5 \ldots 6", "5 & 6",
    r"1 \\ 2", r"\frac{1}{2", r"\sqrt", r"\binom 5 2", r"\begin{foo} 1 \end{foo}", "5 < 6",
    r"\mathbb{5}", "", "   ", "x" * (grader.MAX_SYMBOLIC_CHARS + 1), r"2^{2^{40}}",
])
def test_read_refuses(answer):
    assert read(answer) is None


def test_long_answers_are_compared_as_strings():
    # over MAX_SYMBOLIC_CHARS nothing is read: only the reference's own spelling could pass
    many = ", ".join(str(i) for i in range(1000))
    assert grader.compare(many, "5") == "wrong" and grader.compare(many, many) == "correct"


@pytest.mark.parametrize("answers, reference, expected", [
    (["5"], "5", "correct"),
    (["5", "6"], "5", "hedge"),
    (["5", "6"], "6", "hedge"),
    (["5, 6"], "5", "wrong"),                                   # one box with a list: a value
    (["5, 6"], "5, 6", "correct"),
    (["6, 5"], "5, 6", "correct"),
    (["5, 7"], "5, 6", "wrong"),
    (["5"], "5, 6", "wrong"),
    (["5", "5.0", r"\frac{10}{2}"], "5", "correct"),            # one value, three spellings
    (["x+11", "11+x"], "x+11", "correct"),                      # equal by math-verify
    ([r"5 \text{ or } 5.0"], "5", "wrong"),                     # a list of two is no number
    (["(3, 4)"], "(3, 4)", "correct"),
    (["3, 4"], "(3, 4)", "wrong"),                              # [ours] write a pair as a pair
    ([r"1 \pm \sqrt{19}"], r"1 \pm \sqrt{19}", "correct"),
    ([r"1 + \sqrt{19}, 1 - \sqrt{19}"], r"1 \pm \sqrt{19}", "correct"),
    ([r"1 + \sqrt{19}"], r"1 \pm \sqrt{19}", "wrong"),
    (["3, -3"], r"\pm 3", "correct"),
    ([r"\pm 3"], "3", "wrong"),
    ([r"x = 2 \text{ or } x = 3"], "2, 3", "correct"),          # equations joined by or: a list
    ([r"x = 2 \text{ or } x = 3"], r"2 \text{ or } 3", "correct"),
    ([r"x = 2 \text{ or } x = 3"], "3, 2", "correct"),
    ([r"x = 2 \text{ or } x = 3"], "2", "wrong"),
    ([r"x = 2 \text{ or } x = 3"], "2, 4", "wrong"),
    (["2", "3"], "2, 3", "hedge"),                              # two boxes are two answers
    ([r"6 \text{ doubled}", "12"], "12", "hedge"),              # no value disagrees with any
])
def test_judge(answers, reference, expected, patient):
    assert grader.judge(answers, reference) == expected


def test_telling_spellings_apart_has_a_budget(warm):
    # Two spellings sympy cannot tell apart within half the deadline count as different: a hedge,
    # in under a second, rather than an unbounded wait.
    t0 = time.perf_counter()
    assert grader.judge(["(x+y+z)^{40}", "(x+y+z+1)^{40}"], "3") == "hedge"
    assert time.perf_counter() - t0 < 1.0


def test_hedges_score_zero_and_are_counted():
    completions = [r"\boxed{5} or \boxed{6}", r"\boxed{5, 6}", r"\boxed{5}", r"\boxed{6}",
                   "The answer is 5.", r"\boxed{5, 6}", r"\boxed{6} and \boxed{5}"]
    rewards, stats = score(completions, ["5", "6", "5", "5", "5", "6, 5", "6, 5"])
    assert rewards == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert stats == {"n": 7, "correct": 2, "no_answer": 1, "hedge": 2, "timeout": 0, "error": 0,
                     "accuracy": 2 / 7}


# -----------------------------------------------------------------------------
# Truncated completions: only an explicit, finished answer counts

TRUNCATED = [  # (completion cut off at max_new_tokens, its answer when truncated, when not)
    (r"First 3 + 4 = 7, so \boxed{7} is it. Let me double-check: 3", "7", "7"),
    ("3 + 4 = 7\n#### 7\nQuestion: what is", "7", "7"),
    ("#### 1,0", None, "1,0"),                                         # the number may be cut
    ("#### 7", None, "7"),                                             #   (7, 75, 7.5, 7/8, ...)
    ("#### 7 dollars and", None, "7 dollars and"),                     #   its line never ended
    ("#### 7\n#### 7", None, "7"),                                     #   the last one counts
    (r"so \boxed 7", None, "7"),                                       # a brace-less box, the same
    (r"so \boxed 7 and more", "7", "7"),
    (r"\boxed{5} or \boxed{7} then", "5 | 7", "5 | 7"),                # closed boxes
    (r"\boxed{7} and then \boxed{1", None, None),                     # a box cut off mid-answer
    (r"\boxed{7} and then \boxed", None, None),
    ("Step 1: 3 + 4 = 7. Step 2: 7", None, None),                     # no answer in the format
    ("", None, None),
]


@pytest.mark.parametrize("text, cut, whole", TRUNCATED)
def test_truncated_completions_need_an_explicit_answer(text, cut, whole):
    assert extract_answer(text, truncated=True) == cut
    assert extract_answer(text) == extract_answer(text, truncated=False) == whole
    reference = "7"
    assert grade(text, reference, truncated=True) == (0.0 if cut is None
                                                      else grade(text, reference))


def test_truncation_flag_is_checked():
    for bad in ["yes", None, 2]:
        with pytest.raises(ValueError, match="truncated"):
            extract_answer("#### 7", truncated=bad)
        with pytest.raises(ValueError, match="truncated"):
            grade("#### 7", "7", truncated=bad)
    with pytest.raises(ValueError, match="truncated"):
        score(["#### 7"], ["7"], truncated=[True, False])  # one flag per completion
    with pytest.raises(ValueError, match="decode"):
        extract_answer(b"#### 7")


def test_score_with_truncation_flags():
    completions = ["#### 7", r"so \boxed 7", r"\boxed{7} but wait", "#### 7\nQ", "3 + 4 = 7"]
    rewards, stats = score(completions, ["7"] * 5, truncated=[False, True, True, True, True])
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert stats == {"n": 5, "correct": 3, "no_answer": 2, "hedge": 0, "timeout": 0, "error": 0,
                     "accuracy": 3 / 5}
    assert score(completions, ["7"] * 5, truncated=None) == score(completions, ["7"] * 5) \
        == score(completions, ["7"] * 5, truncated=[False] * 5)
    assert score(completions, ["7"] * 5)[0] == [1.0] * 4 + [0.0]


# -----------------------------------------------------------------------------
# grade: at least 50 hand-written cases, right and wrong, over every form an answer takes

RIGHT = [
    # where the answer sits
    (r"\boxed{18}", "18"),
    ("#### 18", "18"),
    ("9 * 2 = 18 dollars\n#### 18 dollars\n", "18"),
    (r"\fbox{7}", "7"),
    (r"\boxed 7", "7"),
    # numbers as numbers: commas, $, units, trailing .0, percent, fractions, degrees
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{1,\!000}", "1000"),
    (r"\boxed{1{,}000}", "1,000"),
    (r"\boxed{\$18}", "18"),
    ("#### $18", "18"),
    (r"\boxed{\$32,348}", r"\$32,\!348"),
    (r"\boxed{18 dollars}", "18"),
    (r"\boxed{18\text{ dollars}}", "18"),
    (r"\boxed{15}", r"15\mbox{ cm}^2"),
    (r"\boxed{18.0}", "18"),
    (r"\boxed{18.00}", "18.0"),
    (r"\boxed{5.}", "5"),
    (r"\boxed{25\%}", "25"),
    ("#### 25%", "25"),
    (r"\boxed{30^\circ}", "30"),
    (r"\boxed{3/4}", "0.75"),
    (r"\boxed{-3/4}", "-0.75"),
    (r"\boxed{0.75}", r"\frac{3}{4}"),
    (r"\boxed{0.3333333}", r"\frac13"),              # within the relative tolerance
    (r"\boxed{x = -5}", "-5"),
    (r"\boxed{\text{18 dollars}}", "18"),                # the number inside a \text{}
    (r"\boxed{\text{18}}", "18"),
    (r"\boxed{\mbox{1,000 cm}}", "1000"),
    (r"\boxed{15\text{ cm}^2}", "15"),                   # an exponent after a unit is the unit's
    (r"\boxed{15 cm^2}", "15"),
    (r"\boxed{1000000}", "1,000,000"),                   # large integers, exactly
    (r"\boxed{123456789012345678}", "123456789012345678"),
    (r"\boxed{0.1}", "1/10"),                            # exact decimals, exactly
    (r"\boxed{0.1428571}", r"\frac{1}{7}"),              # tolerance: the decimal is a rounded 1/7
    (r"\boxed{1/3}", 0.3333333333333333),                # ... on either side (a float reference)
    ("#### 27.0", 27.0),                              # AMC23 stores answers as floats
    # LaTeX and symbolic answers, through math-verify
    (r"\boxed{\frac12}", "0.5"),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\tfrac{1}{2}}", "1/2"),
    (r"\boxed{\frac{-3}{8}}", r"-\frac{3}{8}"),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}"),
    (r"\boxed{10^{3}}", "1000"),
    (r"\boxed{2^3}", "8"),                               # powers are evaluated, never dropped
    (r"\boxed{2^{10}}", "1024"),
    (r"\boxed{-2^2}", "-4"),
    (r"\boxed{3^2 \text{ cm}}", "9"),
    (r"\boxed{137.5}", r"137 \frac{1}{2}"),
    (r"\boxed{\frac{270}{7}}", r"\frac{270}7\text{ degrees}"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{\frac{1}{2}x}", "x/2"),
    (r"\boxed{2+3i}", "3i+2"),
    (r"\boxed{y = 2x + 3}", "y=2x+3"),
    (r"\boxed{x=5}", "5"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3, \pi/2)"),      # tuples
    (r"\boxed{[1,2)}", "[1, 2)"),                                       # intervals
    (r"\boxed{(-\infty, 0]}", r"(-\infty,0]"),
    (r"\boxed{x \in [-2,7]}", "[-2,7]"),
    (r"\boxed{3, 5, 7}", "7, 5, 3"),                                    # sets of solutions
    (r"\boxed{x = 3 \text{ or } x = 7}", "3, 7"),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}"),                       # \text{}
    (r"\boxed{Evelyn}", r"\text{Evelyn}"),
    (r"\boxed{\text{(C)}}", "C"),
    (r"#### \frac{1}{2}", "0.5"),                                       # LaTeX in a #### line
]

WRONG = [
    (r"\boxed{17}", "18"),
    (r"\boxed{-18}", "18"),
    (r"\boxed{1800}", "18"),
    (r"\boxed{18.5}", "18"),
    (r"\boxed{1,000}", "1"),
    (r"\boxed{1,2}", "12"),                          # two values, not twelve
    (r"\boxed{0.3333}", "1/3"),                      # outside the relative tolerance
    (r"\boxed{2^3}", "2"),                          # an exponent is not a unit
    (r"\boxed{2^3}", "6"),
    (r"\boxed{10^2}", "10"),
    (r"\boxed{-2^2}", "4"),
    (r"\boxed{1000001}", "1000000"),                # integers compare exactly: off by one is wrong
    (r"\boxed{1,000,001}", "1000000"),
    ("#### 123456789012345679", "123456789012345678"),
    (r"\boxed{1000000.5}", "1000000"),              # so do exact decimals
    (r"\boxed{0.3333334}", "0.3333333"),            # two decimals: neither is the other rounded
    (r"\boxed{\text{17 dollars}}", "18"),
    (r"\boxed{1/2}", "0.51"),
    (r"\boxed{5x}", "5"),
    (r"\boxed{5 x}", "5"),                          # one letter is a variable, not a unit
    (r"\boxed{2\pi}", "2"),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}"),
    (r"\boxed{x^2+1}", "(x+1)^2"),
    (r"\boxed{y = 2x + 4}", "y=2x+3"),
    (r"\boxed{(1,2)}", "(2,1)"),                     # tuples are ordered
    (r"\boxed{[1,2]}", "[1,2)"),                     # closed vs half-open
    (r"\boxed{(-\infty, 0)}", r"(-\infty,0]"),
    (r"\boxed{(3, \frac{\pi}{3})}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed{3, 5}", "3, 5, 7"),
    (r"\boxed{1 + \sqrt{19}}", r"1 \pm \sqrt{19}"),
    (r"\boxed{\begin{pmatrix} 1 \\ 3 \end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"\boxed{\text{Navin}}", r"\text{Evelyn}"),
    (r"\boxed{\text{(B)}}", r"\text{(C)}"),
    # precedence: the right number is present, but not where the final answer is
    (r"\boxed{17} #### 18", "18"),
    ("#### 17\nbut really 18", "18"),
    ("The answer is 17. Check: 18", "18"),
    (r"\boxed{3} then \boxed{5}", "3"),                # two boxes that disagree: a hedge
    (r"$\boxed{3}$ and $\boxed{7}$", "3, 7"),         #   even where they are both solutions
    ("The answer is 18.", "18"),                     # no answer in the asked format
    ("so she makes 9 * 2 = 18 dollars", "18"),
    # no answer at all
    (r"so it is \boxed{18", "18"),                   # cut off inside the box
    (r"\boxed{}", "18"),
    ("no numbers here", "18"),
    ("", "18"),
]


@pytest.fixture
def patient(monkeypatch):
    """The verdict tables test what the grader answers, not how fast it answers: under the 0.5 s
    wall-clock deadline a right answer was graded 0 as a timeout now and then on a loaded 2-core CI
    machine (two test processes, a browser), e.g. \\boxed{10^{3}} against 1000, which takes 0.03 s
    alone. The deadline has its own tests (below, with the `warm` fixture)."""
    monkeypatch.setattr(grader, "DEADLINE_S", 30.0)


@pytest.mark.parametrize("text, reference", RIGHT)
def test_grade_right(text, reference, patient):
    assert grade(text, reference) == 1.0


@pytest.mark.parametrize("text, reference", WRONG)
def test_grade_wrong(text, reference, patient):
    assert grade(text, reference) == 0.0


def test_case_table_is_large_enough():
    assert len(RIGHT) + len(WRONG) >= 50


# -----------------------------------------------------------------------------
# Words after a number: units are dropped, mathematics never is, scale words multiply,
# mixed numbers add. Each row: (answer, reference, verdict). The rows marked "was 1" / "was 0" got
# the other verdict before: the old shortcut removed any \text{}/\mathrm{} and any trailing words
# of two letters or more, and math-verify's own unit stripping removed single letters and "ab".

UNITS = [
    # the first cases found
    (r"2\mathrm{i}", "2", 0.0),                  # was 1: i is the imaginary unit
    (r"3\text{i}", "3", 0.0),                    # was 1
    (r"2\mathrm{e}", "2", 0.0),                  # was 1: e is Euler's number
    ("2 pi", "2", 0.0),                          # was 1
    ("2 xy", "2", 0.0),                          # was 1: a product of variables
    ("5 million", "5", 0.0),                     # was 1: a scale word multiplies
    (r"1.5 \text{ million}", "1500000", 1.0),    # was 0
    ("3 1/2", "3.5", 1.0),                       # was 0: a mixed number
    # more of the same kind
    ("2 ab", "2", 0.0),                          # was 1: short words are not units unless listed
    ("2 theta", "2", 0.0),                       # was 1: a Greek letter spelled out
    ("2 sin", "2", 0.0),                         # was 1: a function name
    ("2 log", "2", 0.0),                         # was 1
    ("2 sinx", "2", 0.0),                        # was 1: a function applied to a letter
    ("2c", "2", 0.0),                            # was 1: math-verify dropped "c" as a unit
    (r"2 \text{ e}", "2", 0.0),                  # was 1
    (r"3 \mathrm{i}", "3", 0.0),                 # was 1
    ("5 squared", "5", 0.0),                     # was 1: words that change the value
    ("5 thousandths", "5", 0.0),                 # was 1
    ("3 quarters", "3", 0.0),                    # was 1
    ("2 dozen", "2", 0.0),                       # was 1
    ("5 million^2", "5", 0.0),                   # was 1: an exponent belongs to a unit only
    (r"2 \text{ hours and } 30 \text{ minutes}", "2", 0.0),  # was 1: "and 30" is no unit
    (r"5 \text{ m}", "5", 0.0),                  # was 1 [ours]: a single letter is never a unit,
                                                 #   not even m for meters: as likely a variable
    ("2 dozen", "24", 1.0),                      # was 0
    ("3 hundred thousand", "300000", 1.0),       # was 0
    (r"5 \text{ million}", "5000000", 1.0),      # was 0
    (r"\$1.5 \text{ million}", "1,500,000", 1.0),  # was 0
    ("2 Millions", "2000000", 1.0),              # was 0
    (r"0.3333333 \text{ million}", r"\frac{1000000}{3}", 1.0),  # was 0: the decimal is a rounding
    (r"-3 1/2", "-3.5", 1.0),                    # was 0
    (r"x = 3 1/2", "7/2", 1.0),                  # was 0
    (r"8\sqrt{3}", r"8\sqrt{3} \text { square inches}", 1.0),  # was 0: a MATH reference with a unit
    (r"2 \sqrt{2} \text{ million}", r"2\sqrt{2}", 0.0),  # was 1: a scale word is never dropped
    # kept as they were
    (r"3\frac{1}{2}", "3.5", 1.0),               # MATH writes mixed numbers so
    (r"-3\frac{1}{2}", "-3.5", 1.0),
    (r"2 \frac{1}{2} \text{ cups}", "2.5", 1.0),
    (r"1\frac{4}{5}", "1.8", 1.0),
    (r"2\frac{1}{2}", "1", 0.0),                 # a mixed number, not 2 times 1/2
    ("3 4/2", "5", 0.0),                         # no proper fraction: no mixed number we read
    (r"\text{18 dollars}", "18", 1.0),           # units and nouns are dropped
    ("42 apples", "42", 0.0),                    # [ours] "apples" is no unit: 42 a p p l e s
    (r"2 \mathrm{cm}", "2", 1.0),
    (r"4 \text{ km}^2", "4", 1.0),
    ("15cm", "15", 1.0),
    (r"5 \text{ sq. ft.}", "5", 1.0),
    (r"5 \text{ miles per hour}", "5", 1.0),
    ("5 dollars per dozen", "5", 1.0),           # after a unit, a scale word is part of the unit
    (r"25 \text{ percent}", "25", 1.0),          # as 25\% = 25
    (r"10\%", "10", 1.0),
    (r"99\pi", r"99\pi \text{ square inches}", 1.0),
    (r"10\sqrt{2}\text{ cm}", r"10\sqrt{2}", 1.0),
    (r"2+3\mathrm{i}", "2+3i", 1.0),             # \mathrm{i} is i
    (r"2\mathrm{i}", "2i", 1.0),
    (r"2\sqrt{2}", "2", 0.0),                    # commands are never dropped
    (r"2 \pi", "2", 0.0),
    ("2x", "2", 0.0),
    ("2 i", "2", 0.0),
    (r"3 \text{ and } 4", "3", 0.0),
    (r"5 \text{ or } 6", "5", 0.0),
    ("5k", "5000", 0.0),                         # [ours] k is a letter, so no scale word
]


@pytest.mark.parametrize("answer, reference, expected", UNITS)
def test_words_after_a_number(answer, reference, expected, patient):
    assert grade(f"\\boxed{{{answer}}}", reference) == expected
    assert grade(f"\\boxed{{{reference}}}", answer) == expected  # the same the other way round
    assert score([f"So the answer is \\boxed{{{answer}}}."], [reference])[0] == [expected]


@pytest.mark.parametrize("text, reference, expected", [
    ("#### 1.5 million\n", "1500000", 1.0),
    ("#### 1.5 million\n", "1.5", 0.0),
    ("#### 2 dozen\n", "24", 1.0),
    ("#### 3 1/2 cups\n", "3.5", 1.0),
    ("#### 3 1/2 cups\n", "3", 0.0),
    ("#### 3 1/2\n", "1/2", 0.0),
    ("#### 50%\n", "0.5", 1.0),
])
def test_words_after_a_number_in_a_hash_line(text, reference, expected, patient):
    # the rest of a #### line is read as the same answer in a box
    assert grade(text, reference) == expected


@pytest.mark.parametrize("answer, reference, expected", [
    ("575", r"575\text{ students}", 1.0),      # [ours] the data set's own last words are dropped
    (r"575 \text{ students}", "575", 0.0),     #   a completion's must be units
    ("7", r"7 \text{ pm}", 1.0),
    (r"7 \text{ pm}", "7", 0.0),
    ("65", r"65 \text{ children tickets }", 1.0),
    (r"65 \text{ children}", r"65 \text{ children tickets }", 0.0),
    (r"65 \text{ children tickets}", r"65 \text{ children tickets }", 1.0),  # the same spelling
    ("1.5", r"1.5\text{ million}", 0.0),       #   never a scale word
    ("12, 13", r"12\text{ and }13", 1.0),      #   and "and" joins a list
    ("12", r"12\text{ and }13", 0.0),
])
def test_a_references_own_words(answer, reference, expected, patient):
    assert grade(f"\\boxed{{{answer}}}", reference) == expected


def test_scale_words_and_mixed_numbers_are_exact(patient):
    # Fraction arithmetic, no float: 1.5 million is 1500000 exactly, one more is not equal
    assert grader._as_number(r"1.5 \text{ million}") == (1500000, True, False)
    assert grader._as_number("3 1/2") == grader._as_number(r"3\frac{1}{2}") \
        == (Fraction(7, 2), False, False)
    assert grader._as_number("-3 1/2") == (Fraction(-7, 2), False, False)
    assert grader._as_number("1.2 trillion dollars") == (1_200_000_000_000, True, False)
    assert grader._as_number("50%") == (Fraction(1, 2), False, True)
    assert grade(r"\boxed{1.5 million}", "1500001") == 0.0
    for not_plain in [r"2\mathrm{i}", "2 pi", "2 xy", r"5 \text{ m}", "2 sin", "5 million^2",
                      "3 4/2"]:
        assert grader._as_number(not_plain) is None, not_plain  # math-verify decides these


# -----------------------------------------------------------------------------
# Every grade honest: each row was graded the other way before (answer, reference, verdict), and
# holds both ways round. Percent: p% is p/100, and a bare x against p% is also right when x = p
# and |x| > 1 (data sets write "50" for "50%"); 0.5% is not 0.5.

HONEST = [
    (r"0.5\%", "0.5", 0.0),                      # was 1: the percent sign dropped without dividing
    (r"\frac{1}{2}\%", "0.5", 0.0),              # was 1
    (r"50\%", "0.5", 1.0),                       # was 0
    (r"5\%", "0.05", 1.0),                       # was 0
    (r"1.5e3", "1500", 1.0),                     # was 0: math-verify read 1.5 * e * 3
    (r"6.02\times10^{23}", "602000000000000000000000", 1.0),  # was 0
    (r"\sin 30^\circ", r"\frac12", 1.0),         # was 0: sympy read 30 radians
    (r"x > 2", r"(2,\infty)", 1.0),              # was 0: math-verify set only a gold inequality
    (r"x \geq 2", r"[2,\infty)", 1.0),           # was 0
    (r"9.8\text{ m/s}^2", "9.8", 1.0),           # was 0: a rate of units is a unit
    (r"5\text{th}", "5", 1.0),                   # was 0: an ordinal
    # kept as they were, and the edges of the new rules
    ("50", r"50\%", 1.0),                        # a bare number for a percentage: x = p, |x| > 1
    ("44", r"44\%", 1.0),
    ("0.44", r"44\%", 1.0),
    ("1", r"1\%", 0.0),                          # |x| = 1: not a percentage written bare
    ("0.5", r"0.5\%", 0.0),
    (r"25 \text{ percent}", "0.25", 1.0),        # the word is the sign
    (r"33.3\%", "0.333", 1.0),
    (r"33.3\%", "33", 0.0),
    ("3.0e-3", "0.003", 1.0),
    (r"2 \cdot 10^3", "2000", 1.0),
    (r"6.02\times10^{23}", "602000000000000000000001", 0.0),  # exact, as every plain number
    ("2e", "2", 0.0),                            # e alone is Euler's number, no exponent
    (r"\sin 30", r"\frac12", 0.0),               # radians without the degree sign
    (r"\cos 60^\circ", "0.5", 1.0),
    (r"x > 2", r"[2,\infty)", 0.0),              # open is not closed
    (r"x \geq 2", r"(2,\infty)", 0.0),
    (r"x < 3", r"(-\infty, 3)", 1.0),
    (r"5 \text{ km/h}", "5", 1.0),
    ("5 x/y", "5", 0.0),                         # letters that are no units: variables
    ("21st", "21", 1.0),
    ("5rd", "5", 0.0),                           # only a number's own ordinal suffix
    ("12nd", "12", 0.0),
]


@pytest.mark.parametrize("answer, reference, expected", HONEST)
def test_every_grade_honest(answer, reference, expected, patient):
    assert grade(f"\\boxed{{{answer}}}", reference) == expected
    assert grade(f"\\boxed{{{reference}}}", answer) == expected  # the same the other way round


@pytest.mark.parametrize("gold, pred", grader._WARM_UP)
def test_warm_up_pairs_are_equal(gold, pred, patient):
    # the grader's own warm-up pairs are equal answers; \sin 30^\circ = \frac12 was graded 0
    assert grader.compare(pred, gold) == grader.compare(gold, pred) == "correct"


def test_bad_reference_raises_one_line_value_error():
    for bad in [None, "", "   ", ["18"], True]:
        with pytest.raises(ValueError, match="reference") as e:
            grade(r"\boxed{18}", bad)
        assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# score: the batch version

def test_score_counts():
    completions = [r"\boxed{18}", "#### 17", "no idea", r"\boxed{\frac12}", r"\boxed{12", ""]
    references = ["18", "18", "18", "0.5", "12", "3"]
    rewards, stats = score(completions, references)
    assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert stats["n"] == 6
    assert stats["correct"] == 2
    assert stats["no_answer"] == 3                   # "no idea", the cut-off box, ""
    assert stats["accuracy"] == pytest.approx(2 / 6)
    assert score([], []) == ([], {"n": 0, "correct": 0, "no_answer": 0, "hedge": 0, "timeout": 0,
                                  "error": 0, "accuracy": 0.0})


def test_score_length_mismatch():
    with pytest.raises(ValueError, match="same length"):
        score(["1", "2"], ["1"])


def test_numbers_never_reach_math_verify(monkeypatch):
    # The training loop grades ~128 completions a step: plain numbers take the exact-fraction path
    # and never pay for a math-verify parse (its speed is not asserted here; only which path runs).
    def forbidden(*args):
        raise AssertionError("math-verify was called for a plain number")
    monkeypatch.setattr(grader, "_symbolic_equal", forbidden)
    text = "Janet sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = $18. The answer is \\boxed{18}."
    for completion, reference, expected in [
            (text, "18", 1.0), (text, "19", 0.0), ("#### 1,080", "1080", 1.0),
            ("\\boxed{3/4}", "0.75", 1.0), ("\\boxed{25\\%}", "25", 1.0),
            ("\\boxed{1.5 \\text{ million}}", "1500000", 1.0),
            ("\\boxed{5 million}", "5", 0.0), ("\\boxed{42 \\text{ dollars}}", "42", 1.0),
            ("\\boxed{3 1/2}", "3.5", 1.0), ("\\boxed{3\\frac{1}{2}}", "3.5", 1.0)]:
        assert grade(completion, reference) == expected


# -----------------------------------------------------------------------------
# Never raises, never hangs

ADVERSARIAL = {
    "200 kB of text": "lorem ipsum dolor sit amet " * 7500,
    "200 kB of digits": "9" * 200_000,
    "200 kB of numbers": "1 " * 100_000,
    "10,000 nested braces in a box": "\\boxed{" + "{" * 10_000 + "}" * 10_000 + "}",
    "10,000 nested braces": "{" * 10_000 + "}" * 10_000,
    "10,000 open braces in a box": "\\boxed{" + "{" * 10_000,
    "10,000 nested fractions": "\\boxed{" + "\\frac{" * 10_000 + "1" + "}{2}" * 10_000 + "}",
    "only unicode": "αβγ∑∫ 日本語 🙂 ‮ " * 1000,
    "empty": "",
    "power tower": r"\boxed{2^{2^{40}}}",
    "huge factorial": r"\boxed{1000000!}",
    "iterated factorial": r"\boxed{5!!!}",
    "many dollars": "$" * 100_000,
    "many answer-is": "the answer is " * 20_000,
    "many ####": "####" * 50_000,
    "many boxes": r"\boxed{}" * 30_000,
    "slow simplification": r"\boxed{(x+y+z)^{40}}",
    "a long arithmetic chain": "The answer is " + "1 + " * 50_000 + "1",
    "many hedges": "The answer is 5" + " or 6" * 30_000,
    "a slow hedge": r"\boxed{(x+y+z)^{40}} or \boxed{(x+y+z+1)^{40}}",
    "many joined boxes": r"\boxed{3} or " * 20_000 + r"\boxed{4}",
    "many values": r"\boxed{" + "3, " * 50_000 + "4}",
    "many values, short": r"\boxed{" + ", ".join(f"x+{i}" for i in range(40)) + "}",
    "many equal values": r"\boxed{" + ", ".join(["x+1", "1+x"] * 20) + "}",
    "many plus-minus": r"\boxed{1" + r" \pm 1" * 40 + "}",
    "a long #### line": "#### " + "3 or " * 50_000,
    # the three slow inputs found: seconds each, spent backtracking in two regular expressions
    "spaces in a \\text{ between boxes": "\\boxed{5}\\text{" + " " * 400 + "\\boxed{6}",
    "newlines in a \\text{ between boxes": "\\boxed{5}\\text{" + "\n" * 300 + "\\boxed{6}",
    "spaces after a caret": "\\boxed{^" + " " * 20_000 + "}",
}


@pytest.fixture
def warm():
    """The timed tests measure the grader as it runs in training: after the one-time warm-up of the
    first math-verify comparison in a process (~0.3 s, outside the deadline), which run alone they
    would otherwise pay inside their one-second window."""
    grader._symbolic_equal("x^2", "x^2")


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_returns_zero_within_a_second(name, warm):
    t0 = time.perf_counter()
    reward = grade(ADVERSARIAL[name], "3")
    assert reward == 0.0
    # a second, documented and measured alone (docs/grading.md); three here, where the suite's
    # other process shares 2 cores: a quadratic scan takes 16 s on 200 kB, and still fails
    assert time.perf_counter() - t0 < 3.0
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL  # our deadline handler is gone


def test_deadline_counts_timeouts(warm):
    # Unfenced, sympy needs seconds to tell these apart; the main-thread deadline stops it.
    t0 = time.perf_counter()
    rewards, stats = score([r"\boxed{(x+y+z)^{40}}"], ["(x+y+z+1)^{40}"])
    assert time.perf_counter() - t0 < 1.0
    assert rewards == [0.0] and stats["timeout"] == 1


def test_deadline_survives_a_swallowed_alarm():
    """Python ignores an exception raised inside a weakref callback, and sympy fires such callbacks
    all the time: the first alarm can be swallowed. Here fn swallows the first one itself, as such a
    callback would; the deadline must still stop it, not let it run its 3 s."""
    swallowed = []

    def stubborn():
        end = time.perf_counter() + 3
        while time.perf_counter() < end:
            try:
                while time.perf_counter() < end:
                    pass
            except grader._OutOfTime:
                if swallowed:
                    raise
                swallowed.append(1)
        return "ran to the end"

    t0 = time.perf_counter()
    with pytest.raises(grader._OutOfTime):
        grader._with_deadline(stubborn, 0.2)
    assert swallowed and time.perf_counter() - t0 < 0.5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_deadline_leaves_a_running_timer_alone():
    # Someone else's SIGALRM timer (pytest-timeout, the caller's) is neither clobbered nor stopped.
    fired = []
    theirs = lambda signum, frame: fired.append(signum)  # noqa: E731
    old = signal.signal(signal.SIGALRM, theirs)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert grade(r"\boxed{x^2+2x+1}", "(x+1)^2") == 1.0
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 25.0 < remaining <= 30.0
        assert signal.getsignal(signal.SIGALRM) is theirs and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_grade_off_the_main_thread(warm):
    # math-verify's own timeouts use signal.alarm and raise in a worker thread; ours must not.
    cases = [(r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0), (r"\boxed{\frac12}", "0.5", 1.0),
             (r"\boxed{[1,2)}", "[1,2]", 0.0), (r"\boxed{18}", "18", 1.0),
             (ADVERSARIAL["power tower"], "3", 0.0), (ADVERSARIAL["huge factorial"], "3", 0.0),
             (ADVERSARIAL["iterated factorial"], "3", 0.0),
             (ADVERSARIAL["10,000 nested fractions"], "3", 0.0),
             (ADVERSARIAL["200 kB of text"], "3", 0.0)]
    results, errors = [], []

    def worker():
        try:
            for text, reference, _ in cases:
                t0 = time.perf_counter()
                results.append((grade(text, reference), time.perf_counter() - t0))
        except BaseException as e:  # surface anything to the main thread
            errors.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors
    assert [r for r, _ in results] == [want for _, _, want in cases]
    assert all(seconds < 1.0 for _, seconds in results)


# -----------------------------------------------------------------------------
# Fuzz: thousands of random and adversarial strings, seeded

_PIECES = ["\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "{}", "\\frac{", "\\dfrac", "\\sqrt{", "^",
           "^{", "_", "\\text{", "\\mbox{ ", "\\left(", "\\right)", "\\!", "\\,", "{,}", "$", "$$",
           "\\$", "\\(", "\\)", "\\[", "\\]", "####", "#### ", "the answer is ",
           "The final answer is: ", "\\circ", "%", "\\%", "-", "+", "*", "**", "/", ".", ",", "=",
           "x", "y", "\\pi", "\\infty", "(", ")", "[", "]", "!", "\\binom", "\\begin{pmatrix}",
           "\\end{pmatrix}", "\\\\", "&", " ", "\n", "\t", "dollars", "cm", "0", "1", "7", "9",
           "12", "1,000", "3.14", "0.5", "1/2", "1e9", "9" * 40, "1" + "0" * 400, "é", "∑", "−",
           "×", "÷", "½", "٣", "日本", "🙂", "\u202e", "\x00", "\ufeff", "\\"]
_REFERENCES = ["7", "1000000", "0.5", "\\frac{1}{2}", "x^2+1", "(1, 2)", "[0, 1)", "\\text{Evelyn}",
               "2\\sqrt{3}", "8"]


def _fuzz_cases(rng):
    """Random concatenations of LaTeX and number fragments, plus structured adversarial shapes."""
    cases = ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 40))) for _ in range(1400)]
    cases += ["".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(rng.randint(1, 200)))  # any char
              for _ in range(300)]
    for _ in range(40):
        k = rng.randint(1, 3000)
        cases += [
            "\\boxed{" + "{" * k + "7" + "}" * rng.randint(0, k + 1),            # deep, maybe open
            "\\boxed{" + "\\frac{" * k + "1" + "}{2}" * rng.randint(0, k) + "}",
            "\\boxed{" + str(rng.randint(1, 9)) * k + "}",                      # huge numbers
            "#### " + "9" * k + "." + "9" * rng.randint(0, k),
            "\\boxed{" + "2^{" * rng.randint(1, 6) + str(rng.randint(1, 10 ** 6)) + "}" * 6 + "}",
            "\\boxed{" + str(rng.randint(2, 99)) + "!" * rng.randint(1, 4) + "}",
            "\\boxed{" + "(x+" * rng.randint(1, 20) + "1" + ")^{9}" * rng.randint(1, 20) + "}",
            "the answer is " * rng.randint(1, 50) + "$" * rng.randint(0, 50) + "7",
        ]
    for _ in range(200):  # an answer in the format after random text: some pay
        junk = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 10)))
        cases += [junk + "\n\\boxed{7}", junk + "\n#### 7\n"]
    line = "".join(rng.choice(_PIECES) for _ in range(20000))                  # a very long line
    cases += [line, line.replace("\n", " "), "\\boxed{" + line + "}", "7 " * 50000]
    return cases


def test_fuzz_never_raises_and_never_hangs(monkeypatch):
    # No timed assertion: every math-verify call stops at grader.DEADLINE_S on this (main) thread
    # and the rest is regular expressions and linear scans, so the run is bounded by the grader.
    # The deadline is shortened (the same mechanism, a smaller budget) so that the few dozen cases
    # sympy cannot finish, nested powers mostly, cost seconds rather than half a minute.
    monkeypatch.setattr(grader, "DEADLINE_S", 0.05)
    rng = random.Random(12)
    cases = _fuzz_cases(rng)
    assert len(cases) > 2000
    outcomes = {0.0: 0, 1.0: 0}
    for text in cases:
        whole, cut = extract_answer(text), extract_answer(text, truncated=True)
        assert whole is None or (isinstance(whole, str) and whole.strip() == whole and whole)
        assert cut is None or cut == whole  # truncation only ever takes an answer away
        reference = rng.choice(_REFERENCES)
        r = grade(text, reference, truncated=rng.random() < 0.3)
        outcomes[r] += 1  # a KeyError here: a reward that is not 0 or 1
    assert outcomes[1.0] > 0 and outcomes[0.0] > outcomes[1.0]
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


# -----------------------------------------------------------------------------
# Linear time, by construction: no regular expression of reward.py or the grader nests or chains
# unbounded repeats, and each one, and grade itself, is fed long runs of one character

try:  # re's own parser: re._parser from Python 3.11, sre_parse before
    _re_parser = importlib.import_module("re._parser")
except ImportError:
    _re_parser = importlib.import_module("sre_parse")
_re_constants = _re_parser  # it re-exports the opcodes: MAX_REPEAT, SUBPATTERN, BRANCH, ...

_REPEATS = {_re_constants.MAX_REPEAT, _re_constants.MIN_REPEAT}


def _patterns():
    """Every compiled regular expression at module level in reward.py and machinery/grader.py."""
    return {f"{m.__name__}.{name}": value for m in (reward, grader)
            for name, value in vars(m).items() if isinstance(value, re.Pattern)}


def _shape(items, problems):
    """(can match nothing, can begin with an unbounded repeat, can end with one) for a parsed
    sequence, appending to `problems` each unbounded repeat nested in another ("nested") and each
    two that can meet with nothing but optional items between them ("adjacent")."""
    nullable, starts, open_end = True, False, False
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            n, s, e = _shape(body, problems)
            unbounded = high == _re_constants.MAXREPEAT
            if unbounded and _has_unbounded(body):
                problems.append("nested")
            n, s, e = low == 0 or n, unbounded or s, unbounded or e
        elif op == _re_constants.SUBPATTERN:
            n, s, e = _shape(av[-1], problems)
        elif op == _re_constants.BRANCH:
            shapes = [_shape(branch, problems) for branch in av[1]]
            n, s, e = (any(x[k] for x in shapes) for k in range(3))
        else:  # a character, a class, an assertion, an anchor
            n, s, e = op in (_re_constants.ASSERT, _re_constants.ASSERT_NOT, _re_constants.AT), \
                False, False
        if open_end and s:
            problems.append("adjacent")
        starts = starts or nullable and s
        open_end, nullable = e or open_end and n, nullable and n
    return nullable, starts, open_end


def _has_unbounded(items):
    for op, av in items:
        if op in _REPEATS and (av[1] == _re_constants.MAXREPEAT or _has_unbounded(av[2])):
            return True
        if op == _re_constants.SUBPATTERN and _has_unbounded(av[-1]):
            return True
        if op == _re_constants.BRANCH and any(_has_unbounded(b) for b in av[1]):
            return True
    return False


def _problems(pattern, flags=0):
    problems = []
    _shape(_re_parser.parse(pattern, flags), problems)
    return problems


def test_the_pattern_check_finds_backtracking():
    # the patterns the issue found slow, and the shapes of catastrophic backtracking
    for bad in [r"\^\s*\{?\s*\\circ", r"(?:\s|x)*\{\s*,?\s*(?:or)?\s*,?\s*\}", r"(a+)+",
                r"\w*\s*=", r"(?:\s*x?)*"]:
        assert _problems(bad), bad
    for good in [r"\d+(?:\.\d+)?", r"x(?:a|b)*y", r"\\text ?\{([^{}]*)\}", r"\s+"]:
        assert not _problems(good), good


def test_no_pattern_nests_or_chains_unbounded_repeats():
    found = _patterns()
    assert len(found) >= 20 and "machinery.grader._TEXT" in found
    assert {name: p for name, p in ((n, _problems(v.pattern, v.flags)) for n, v in found.items())
            if p} == {}


# What each pattern and grade are fed: a prefix that starts a partial match, then a long run of one
# character (or two) on which a backtracking pattern would try every split
PREFIXES = ["", "^", "\\text{", "{", "5", "\\"]
RUNS = {"spaces": " ", "newlines": "\n", "open braces": "{", "close braces": "}",
        "\\text{": "\\text{", "digits": "7", "letters": "a", "words": "a "}


def _run(unit, n):
    return (unit * (n // len(unit) + 1))[:n]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_every_pattern_is_linear_on_long_runs():
    # each pattern, search and fullmatch, on every prefix and 100,000 characters of every run: a
    # linear pattern takes milliseconds on each, a quadratic one minutes (the one the issue found
    # in the degree sign, \^\s*\{?\s*\\circ, takes seconds on "^" and 20,000 spaces)
    texts = [prefix + _run(unit, 100_000) for prefix in PREFIXES for unit in RUNS.values()]

    def use(pattern):
        for text in texts:
            pattern.search(text), pattern.fullmatch(text)

    slow = {name: seconds for name, pattern in _patterns().items()
            if (seconds := seconds_in_a_child(lambda: use(pattern), 20)) > 5.0}
    assert slow == {}


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_grade_is_fast_on_long_runs(warm):
    # grade on each run, after each prefix and around boxes, each in its own process: within 0.3 s
    # for 10,000 characters, 1 s for 100,000
    slow = {}
    for n, limit in ((10_000, 0.3), (100_000, 1.0)):
        for unit in RUNS.values():
            run = _run(unit, n)
            around = ["\\boxed{5}" + run + "\\boxed{6}", "\\boxed{" + run + "}", "#### " + run + "\n"]
            for text in [prefix + run for prefix in PREFIXES] + around:
                seconds = seconds_in_a_child(lambda: grade(text, "3"), 10 * limit)
                if seconds > limit:
                    slow[f"{n} {text[:20]!r}"] = seconds
    assert slow == {}


# -----------------------------------------------------------------------------
# The real references and solutions: GSM8K and MATH

def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _report(title, failures, n):
    print(f"\n{title}: {n - len(failures)}/{n} pass ({(n - len(failures)) / n:.2%})")
    for row in failures:
        print("  ", row)


@requires_shared
def test_gsm8k_references():
    rows = _jsonl(SHARED / "data/gsm8k/test.jsonl")
    refs = [row["answer"].split("####")[-1].strip() for row in rows]
    assert len(refs) == 1319
    # every reference, as GSM8K writes it and boxed, grades 1.0 against itself
    failures = [r for r in refs
                if grade(f"#### {r}", r) != 1.0 or grade(f"\\boxed{{{r}}}", r) != 1.0]
    _report("GSM8K reference vs itself", failures, len(refs))
    assert not failures
    # and 0.0 against the next row's, where the two differ (15 neighbours share an answer)
    pairs = [(a, b) for a, b in zip(refs, refs[1:] + refs[:1]) if a != b]
    failures = [(a, b) for a, b in pairs if grade(f"\\boxed{{{a}}}", b) != 0.0]
    _report("GSM8K reference vs next row's", failures, len(pairs))
    assert not failures


@requires_shared
def test_gsm8k_solutions_pay():
    # GSM8K's own worked answers, their final `#### N` written as \boxed{N}: all 8792 pay
    rows = _jsonl(SHARED / "data/gsm8k/test.jsonl") + _jsonl(SHARED / "data/gsm8k/train.jsonl")
    solutions = [re.sub(r"#### ?(.*)$", lambda m: "\\boxed{" + m[1].strip() + "}",
                        row["answer"].strip()) for row in rows]
    rewards, stats = score(solutions, [row["answer"].split("####")[-1].strip() for row in rows])
    assert stats["n"] == 8792 and stats["correct"] == 8792


@requires_shared
def test_math500_references(patient):
    rows = _jsonl(SHARED / "data/math500/test.jsonl")
    assert len(rows) == 500
    answers = [row["answer"] for row in rows]
    failures = [a for a in answers
                if grade(f"\\boxed{{{a}}}", a) != 1.0 or grade(f"#### {a}\n", a) != 1.0]
    _report("MATH-500 answer vs itself, boxed and as a #### line", failures, len(answers))
    assert not failures
    # each worked solution, its boxes in context, against the answer field: all 500 pay
    failures = [(extract_answer(row["solution"]), row["answer"]) for row in rows
                if grade(row["solution"], row["answer"]) != 1.0]
    _report("MATH-500 solution vs answer", failures, len(rows))
    assert not failures
    # a reference against the next row's, where the two differ as strings
    pairs = [(a, b) for a, b in zip(answers, answers[1:] + answers[:1]) if a != b]
    failures = [(a, b) for a, b in pairs if grade(f"\\boxed{{{a}}}", b) != 0.0]
    _report("MATH-500 answer vs next row's", failures, len(pairs))
    assert failures == [("5", "x=5")]  # x = 5 is 5


@requires_shared
def test_math_solutions_pay_unless_they_box_two_answers(patient):
    # MATH's 5000 test solutions against their last box (the reference machinery/data.py reads):
    # 14 box two different values ("the roots are \boxed{-2} and \boxed{1}", an intermediate
    # result boxed, three angles boxed), a hedge by the rule; every other one pays
    rows = _jsonl(SHARED / "data/math/test.jsonl")
    rewards, stats = score([row["solution"] for row in rows],
                           [_answer(row["solution"], solution=True) for row in rows])
    assert stats["n"] == 5000 and stats["correct"] == 4986 and stats["hedge"] == 14
