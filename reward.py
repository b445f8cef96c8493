r"""
Rewards, D3S step 2 (docs/algorithm.md): r_i = 1 when the final answer written in completion i
equals the reference answer, else 0; a completion with no answer, or a hedge ("5 or 6"), scores
0 and is counted.

    extract_answer(text, truncated=False) -> str | None   the final answer written in a completion
    grade(text, reference, truncated=False) -> float      1.0 right, 0.0 wrong or no answer
    score(completions, references, truncated=None)        a step's rewards, with counts of outcomes

[ours] A truncated rollout (it hit max_new_tokens without a stop token) counts only an explicit,
finished answer (a closed \boxed{}, a `####` number whose line has ended), never its last number:
cut off mid-reasoning, that is an intermediate result, equal to the reference often enough to earn
r_i = 1 and a positive advantage, and D3S keeps exactly the high-|A| rollouts and high |A| x entropy
tokens, so it would reinforce rambling up to the token limit. How two answers are compared is
machinery/grader.py; the rules and their examples are docs/grading.md. last_boxed also reads MATH's
reference answers out of its solutions (machinery/data.py).
"""
import re

from machinery.grader import box_content, canonical, compare, hedged

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")  # not `\boxedsymbol`


def last_boxed(text):
    """Content of the last \\boxed{...} or \\fbox{...} in text, with balanced braces, or None.

    Also accepts the brace-less form `\\boxed 5` (MATH solutions use it now and then), whose
    content runs to the next whitespace or `$`. A last box that never closes (a completion cut off
    mid-answer) gives None rather than an earlier box: the model had not finished answering.
    """
    boxes = list(_BOX.finditer(text))
    box = box_content(text, boxes[-1].end()) if boxes else None
    return None if box is None else box[0]


# A number in running text: -12, 1,234.5, .5, 3/4, a mixed number 3 1/2, and a percent sign or the
# scale words after it, which the grader reads as multipliers ("1.5 million" is 1500000). A
# minus sign counts only where it cannot be subtraction (not after a digit, letter or bracket).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?:\d+[ \t]+\d+/\d+(?![\d/]|\.\d)"                                     # 3 1/2
    r"|(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?!\.\d))?)"  # 1,234.5, 3/4
    r"(?:\\?%|(?:[ \t]+(?i:hundred|thousand|million|billion|trillion|dozen|percent)s?\b)*)")
# "12 * 3 = 36" after "the answer is": an arithmetic chain, whose value is its last (36).
_CHAIN = re.compile(r"(?:[ \t]*(?:[-+*×÷·=]|\\times|\\cdot|\\div|(?<=[ \t])[xX](?=[ \t]))"
                    rf"[ \t]*\\?\$?(?:{_NUMBER.pattern}))*")
_HASHES = "####"
_ANSWER_IS = re.compile(r"the (?:final )?answer is", re.IGNORECASE)
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# "$18." or "$18 each" is money, not a $...$ span: a number after the `$` followed by neither the
# closing `$` nor anything mathematical. The whole number must be followed so, not a prefix ("$1,"
# of "$1,000$"): the lookahead captures the longest number and \1 consumes exactly that, with no
# backtracking into it (an atomic group says the same, but only from Python 3.11).
_CURRENCY = re.compile(r"\$(?=(\d[\d,]*(?:\.\d+)?))\1(?![\d$\\^_{}/*+=A-Za-z])")


def extract_answer(text, truncated=False):
    """The final answer written in a completion, as a string, or None when there is none.

    In this order (the first that applies wins):
    1. the content of the last non-empty \\boxed{...} / \\fbox{...} (the instruction asks for one);
    2. the number after the last `####` (GSM8K's own format);
    3. what follows the last "the answer is": a $...$ / \\(...\\) span right after it, else the
       first number on the rest of that line, or the last value of the arithmetic it begins
       ("12 * 3 = 36": 36);
    4. the last number anywhere in the text (3 1/2, 1.5 million and 50% are numbers, as in a box).
    [ours] A hedge, two values joined by "or" in rules 1-3 ("5 or 6", "\\boxed{5} or \\boxed{6}"),
    is no answer: the model has not chosen (machinery/grader.py's hedged). An empty box
    (`\\boxed{}`, `\\boxed{ $ $ }`) is skipped as if it were not there. A box that never closes
    (cut off at max_new_tokens) gives None: the model had not finished writing.
    truncated: the completion hit max_new_tokens without a stop token. Then only rules 1 and 2
    apply, and rule 2 only when the `####` line has ended (the number itself may have been cut:
    "1,0" of "1,080"); likewise a brace-less box must not run into the end of the text.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}; "
                         f"decode the completion first")
    _check_truncated(truncated)
    for box in reversed(list(_BOX.finditer(text))):  # the last box first
        content = box_content(text, box.end())
        if content is None:
            return None  # this box never closed: cut off mid-answer
        content, stop, runs_to_end = content
        if canonical(content):
            cut = truncated and runs_to_end
            return None if cut or hedged(content, text, box.start(), stop) else content.strip()
        # an empty box: try the one before it
    i = text.rfind(_HASHES)
    if i >= 0:
        m = _NUMBER.search(text, i + len(_HASHES))
        if m and not (truncated and text.find("\n", m.end()) < 0):
            return None if hedged(m.group(0), text, *m.span()) else m.group(0)
    if truncated:
        return None  # no explicit, finished answer: rules 3 and 4 are for completions that ended
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        j = matches[-1].end()
        while j < len(text) and text[j] in " \t:*":
            j += 1
        m = None if _CURRENCY.match(text, j) else _MATH_SPAN.match(text, j)
        if m:
            span = next(g for g in m.groups() if g is not None).strip()
            if span:
                return None if hedged(span, text, *m.span()) else span
        eol = text.find("\n", j)
        eol = len(text) if eol < 0 else eol  # the end of that line
        m = _NUMBER.search(text, j, eol)
        if m:  # the first number on the rest of the line, or the last value of its chain
            end = _CHAIN.match(text, m.end(), eol).end()
            start = max(m.start(), text.rfind("=", m.start(), end) + 1)
            answer = text[start:end].strip(" \t\\$")
            return None if hedged(answer, text, start, end) else answer
    numbers = list(_NUMBER.finditer(text))
    return numbers[-1].group(0) if numbers else None


def grade(text, reference, truncated=False):
    """1.0 when the final answer in the completion `text` equals `reference`, else 0.0.

    Plain numbers compare exactly, as fractions (1,000 = $1000 = \\text{1000 dollars}; 3 1/2 = 3.5;
    1.5 million = 1500000; 1000001 != 1000000; 2 pi is not 2), the rest through math-verify
    (\\sqrt{2}/2 = \\frac{\\sqrt{2}}{2}, (x+1)^2 = x^2+2x+1). truncated: only an explicit, finished
    answer counts (extract_answer). Never raises and returns within a second for any completion text
    (plus a one-time warm-up of ~0.3 s per process). A text that is not a str, a reference that is
    not a non-empty str or number, or a truncated that is not a bool is a bug in the caller and
    raises ValueError.
    """
    return _judge(text, _check_reference(reference), truncated)[0]


def _judge(text, reference, truncated):
    """(reward, outcome): outcome "no_answer", or compare's "correct", "wrong", "timeout"
    (math-verify ran out of time) or "error" (math-verify failed); the last two score 0."""
    answer = extract_answer(text, truncated)
    outcome = "no_answer" if answer is None else compare(answer, reference)
    return float(outcome == "correct"), outcome


def score(completions, references, truncated=None):
    """Grade a step's batch: rewards[i] = grade(completions[i], references[i], truncated[i]).

    truncated: one bool per completion (train.py passes rollouts.truncated.tolist()), or None when
    none was cut off. Returns (rewards: list[float], stats: dict) with stats n, correct, no_answer
    (no extractable answer: the algorithm's parse failures, hedges and truncated completions
    without an explicit answer included), timeout, error, accuracy (correct / n).
    """
    if len(completions) != len(references):
        raise ValueError(f"completions and references must have the same length, got "
                         f"{len(completions)} and {len(references)}; repeat each reference "
                         f"group_size times")
    if truncated is None:
        truncated = [False] * len(completions)
    if len(truncated) != len(completions):
        raise ValueError(f"truncated must have one flag per completion, got {len(truncated)} for "
                         f"{len(completions)} completions; pass rollouts.truncated.tolist()")
    stats = {"n": len(completions), "correct": 0, "no_answer": 0, "timeout": 0, "error": 0}
    rewards = []
    for text, reference, cut in zip(completions, references, truncated):
        reward, outcome = _judge(text, _check_reference(reference), cut)
        rewards.append(reward)
        if outcome != "wrong":
            stats[outcome] += 1
    stats["accuracy"] = stats["correct"] / max(stats["n"], 1)
    return rewards, stats


# -----------------------------------------------------------------------------
# Argument checks: a wrong argument is the caller's bug, told in one line

def _check_truncated(truncated):
    if truncated not in (True, False):  # also lets numpy / tensor bools through
        raise ValueError(f"truncated must be True or False, got {truncated!r}; pass "
                         f"rollouts.truncated, one flag per completion")


def _check_reference(reference):
    if isinstance(reference, bool) or not isinstance(reference, (str, int, float)):
        raise ValueError(f"reference must be a str (or a number), got "
                         f"{type(reference).__name__}: {reference!r:.80}")
    reference = str(reference).strip()
    if not reference:
        raise ValueError("reference is empty; every problem needs a reference answer (check the "
                         "data set's answer field)")
    return reference
