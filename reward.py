r"""
Rewards, D3S step 2 (docs/algorithm.md): r_i = 1 when the final answer of completion i, written in
the format the prompt asks for, equals the reference answer, else 0; a completion with no such
answer, or one that hedges, scores 0 and is counted.

    final_answers(text, truncated=False) -> list[str] | None   what a completion offers as final
    extract_answer(text, truncated=False) -> str | None        the same, as one string
    grade(text, reference, truncated=False) -> float           1.0 right, 0.0 wrong, hedged or none
    score(completions, references, truncated=None)             a step's rewards, counted

[ours] The final answer is what the completion's boxes hold: every \boxed{} and \fbox{} (the
instruction says "put your final answer within \boxed{}"), at any depth; with no box, its `####`
lines (GSM8K's format, the tiny worlds'). They must all hold the same value, or the completion is a
hedge: a policy paid for "\boxed{5}, or maybe \boxed{6}" learns to offer more values, and no list of
separators or of changes of mind can name every way to write one. Each holds one value (a number, a
name, an expression; machinery/grader.py reads it), and nothing outside them is read: a rule that
reads prose keeps meeting phrasings it misreads, and in RL each misreading is a reward a policy can
find. A truncated rollout counts only a finished answer. The rules and their examples are
docs/grading.md.
"""
from machinery.grader import MAX_SPELLINGS, boxes, canonical, judge

_HASHES = "####"


def final_answers(text, truncated=False):
    """The final answer of a completion as written, its distinct spellings in order, or None.

    1. The content of every box, at any depth (`\\boxed{\\boxed{5} - 1}` holds "\\boxed{5} - 1"
       and "5"). An empty box (`\\boxed{}`, a model repeating the instruction) is skipped; a box
       that never closes is no answer (the model had not finished).
    2. With no box, the rest of every `####` line, with markdown's ** and _ around it dropped.
    Spellings that differ only in spacing, $ or \\text{} wrappers are one; reading stops past
    grader.MAX_SPELLINGS of them (a hedge, whatever they say), so that the time stays linear.
    truncated: the completion hit max_new_tokens without a stop token. Then the last `####` line
    counts only when it has ended (its number may have been cut: "1,0" of "1,080"), and a
    brace-less box only when it does not run into the end of the text.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}; "
                         f"decode the completion first")
    _check_truncated(truncated)
    spans = boxes(text)
    if spans is None or spans and truncated and spans[-1][1] == len(text):
        return None
    answers = _distinct(text[start:end] for start, end in spans)
    if not answers:  # no box, or only empty ones
        lines = text.split(_HASHES)[1:]
        if lines and truncated and "\n" not in lines[-1]:
            return None  # the last #### line never ended
        answers = _distinct(line.partition("\n")[0].strip().strip("*_") for line in lines)
    return answers or None


def _distinct(written):
    """The non-empty spellings in `written`, each once (by canonical form), in order; at most
    MAX_SPELLINGS + 1 of them are read."""
    seen, answers = set(), []
    for answer in written:
        key = canonical(answer)
        if key and key not in seen:
            seen.add(key)
            answers.append(answer.strip())
            if len(answers) > MAX_SPELLINGS:
                break
    return answers


def extract_answer(text, truncated=False):
    """The final answer written in a completion, as one string (its spellings joined by " | "), or
    None when there is none (final_answers)."""
    answers = final_answers(text, truncated)
    return None if answers is None else " | ".join(answers)


def grade(text, reference, truncated=False):
    """1.0 when the final answer in the completion `text` equals `reference`, else 0.0.

    Plain numbers compare exactly, as fractions (1,000 = $1000 = \\text{1000 dollars}; 3 1/2 = 3.5;
    1.5 million = 1500000; 1000001 != 1000000; 2 pi is not 2), the rest through math-verify
    (\\sqrt{2}/2 = \\frac{\\sqrt{2}}{2}, (x+1)^2 = x^2+2x+1). Boxes that disagree score 0, and so
    does a box that holds no one value (`6 \\text{ doubled}`, `5 \\wedge 6`). truncated: only a
    finished answer counts (final_answers). Never raises and returns within a second for any
    completion text (plus a one-time warm-up of ~0.3 s per process). A text that is not a str, a
    reference that is not a non-empty str or number, or a truncated that is not a bool is a bug in
    the caller and raises ValueError.
    """
    return _judge(text, _check_reference(reference), truncated)[0]


def _judge(text, reference, truncated):
    """(reward, outcome): outcome "no_answer", or judge's "correct", "wrong", "hedge", "timeout"
    (math-verify ran out of time) or "error" (math-verify failed); all but "correct" score 0."""
    answers = final_answers(text, truncated)
    outcome = "no_answer" if answers is None else judge(answers, reference)
    return float(outcome == "correct"), outcome


def score(completions, references, truncated=None):
    """Grade a step's batch: rewards[i] = grade(completions[i], references[i], truncated[i]).

    truncated: one bool per completion (train.py passes rollouts.truncated.tolist()), or None when
    none was cut off. Returns (rewards: list[float], stats: dict) with stats n, correct, no_answer
    (no final answer in the asked format, a truncated completion's unfinished one included), hedge
    (final answers that are not all one value), timeout, error, accuracy (correct / n).
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
