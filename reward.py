r"""
Rewards, D3S step 2 (docs/algorithm.md): r_i = 1 when the final answer of completion i, written in
the format the prompt asks for, equals the reference answer, else 0; a completion with no such
answer, or a hedge ("5 or 6"), scores 0 and is counted.

    extract_answer(text, truncated=False) -> str | None   the final answer written in a completion
    grade(text, reference, truncated=False) -> float      1.0 right, 0.0 wrong, hedged or no answer
    score(completions, references, truncated=None)        a step's rewards, with counts of outcomes

[ours] One explicit final answer is read: the last \boxed{} (the instruction says "put your final
answer within \boxed{}"), else the last `####` line (GSM8K's format, the tiny worlds'). No number
is picked out of prose: a rule that reads free text keeps meeting phrasings it misreads ("not 5;
it is 7"), and in RL each misreading is a reward a policy can find. An answer that offers more
values than the reference ("5 or 6", `#### 5, 6`) is a hedge. A truncated rollout counts only a
finished answer. How two answers compare is machinery/grader.py; the rules and their examples are
docs/grading.md. last_boxed also reads MATH's reference answers (machinery/data.py).
"""
import re

from machinery.grader import canonical, judge

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")  # not `\boxedsymbol`
_BARE = re.compile(r"[^\s$]+")  # `\boxed 5`: up to whitespace or `$`
_HASHES = "####"
# What may stand between two boxes of one final answer ("\boxed{5} or \boxed{6}", "$\boxed{a}$,
# $\boxed{b}$"): spacing, math delimiters, separators, "or" and "and". Other words ("first
# \boxed{3}, on reflection \boxed{5}") part a changed mind from the final answer.
_WORD = r"(?i:and/or|or|and)"
_JOIN = re.compile(rf"(?:\s|[$,;~]|\\[()\[\],;:! ]|\\q?quad|\\\\|\\(?:lor|vee|mid)(?![A-Za-z])"
                   rf"|{_WORD}(?![A-Za-z])"
                   rf"|\\(?:text|mbox|textrm|mathrm|textbf)\s*\{{\s*,?\s*{_WORD}?\s*,?\s*\}})*")


def last_boxed(text):
    """Content of the last \\boxed{...} or \\fbox{...} in text, with balanced braces, or None.

    Also accepts the brace-less form `\\boxed 5` (MATH solutions use it now and then), whose
    content runs to the next whitespace or `$`. A last box that never closes (a completion cut off
    mid-answer) gives None rather than an earlier box: the model had not finished answering.
    """
    boxes = list(_BOX.finditer(text))
    box = _box_content(text, boxes[-1].end()) if boxes else None
    return None if box is None else box[0]


def extract_answer(text, truncated=False):
    """The final answer written in a completion, as a string, or None when there is none.

    1. The content of the last non-empty \\boxed{...} / \\fbox{...}, with the boxes joined to it
       before it (_JOIN): "\\boxed{5} or \\boxed{6}" is "5, 6". An empty box (`\\boxed{}`, a model
       repeating the instruction) is skipped; a last box that never closes is no answer.
    2. Else the rest of the last `####` line, as written: "#### not 5; it is 7" is that whole text,
       never the 5 or the 7 in it.
    truncated: the completion hit max_new_tokens without a stop token. Then a `####` line counts
    only when it has ended (its number may have been cut: "1,0" of "1,080"), and a brace-less box
    only when it does not run into the end of the text.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}; "
                         f"decode the completion first")
    _check_truncated(truncated)
    answer, start = [], len(text)  # the final answer's boxes, last first; where the first starts
    for box in reversed(list(_BOX.finditer(text))):
        found = _box_content(text, box.end())
        if found is None:  # a box that never closes: cut off mid-answer
            return ", ".join(reversed(answer)) or None
        content, end, runs_to_end = found
        if answer and not (canonical(content) and end <= start
                           and _JOIN.fullmatch(text, end, start)):
            break  # not joined to the final answer
        if canonical(content):  # else an empty box: the one before it counts
            if truncated and runs_to_end:
                return None
            answer.append(content.strip())
            start = box.start()
    if answer:
        return ", ".join(reversed(answer))
    i = text.rfind(_HASHES)
    eol = text.find("\n", i)
    if i < 0 or (eol < 0 and truncated):  # no #### line, or one that never ended
        return None
    return text[i + len(_HASHES):eol if eol >= 0 else len(text)].strip() or None


def _box_content(text, i):
    """(content, end, runs_to_end) of the box whose command ends at text[i], or None if it never
    closes (end: where the box ends). runs_to_end: a brace-less box (`\\boxed 5`) that stops only
    at the end of the text, so a completion cut off there may have lost the rest ("5" of "56")."""
    n, j = len(text), i
    while j < n and text[j] in " \t":
        j += 1
    if j < n and text[j] == "{":
        depth, k = 0, j
        while k < n:
            c = text[k]
            if c == "\\":
                k += 2  # an escaped character (`\{`, `\}`, `\\`) never opens or closes the box
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1:k], k + 1, False
            k += 1
        return None  # unbalanced: cut off before the box closed
    m = _BARE.match(text, j)
    return (m.group(0), m.end(), m.end() == n) if m else None


def grade(text, reference, truncated=False):
    """1.0 when the final answer in the completion `text` equals `reference`, else 0.0.

    Plain numbers compare exactly, as fractions (1,000 = $1000 = \\text{1000 dollars}; 3 1/2 = 3.5;
    1.5 million = 1500000; 1000001 != 1000000; 2 pi is not 2), the rest through math-verify
    (\\sqrt{2}/2 = \\frac{\\sqrt{2}}{2}, (x+1)^2 = x^2+2x+1). An answer with more values than the
    reference scores 0. truncated: only a finished answer counts (extract_answer). Never raises and
    returns within a second for any completion text (plus a one-time warm-up of ~0.3 s per
    process). A text that is not a str, a reference that is not a non-empty str or number, or a
    truncated that is not a bool is a bug in the caller and raises ValueError.
    """
    return _judge(text, _check_reference(reference), truncated)[0]


def _judge(text, reference, truncated):
    """(reward, outcome): outcome "no_answer", or judge's "correct", "wrong", "hedge", "timeout"
    (math-verify ran out of time) or "error" (math-verify failed); all but "correct" score 0."""
    answer = extract_answer(text, truncated)
    outcome = "no_answer" if answer is None else judge(answer, reference)
    return float(outcome == "correct"), outcome


def score(completions, references, truncated=None):
    """Grade a step's batch: rewards[i] = grade(completions[i], references[i], truncated[i]).

    truncated: one bool per completion (train.py passes rollouts.truncated.tolist()), or None when
    none was cut off. Returns (rewards: list[float], stats: dict) with stats n, correct, no_answer
    (no final answer in the asked format, a truncated completion's unfinished one included), hedge
    (more values than the reference), timeout, error, accuracy (correct / n).
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
    stats = {"n": len(completions), "correct": 0, "no_answer": 0, "hedge": 0, "timeout": 0,
             "error": 0}
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
