"""
Rewards: pull the final answer out of a completion and grade it against the reference.

D3S step 2 (../shared/D3S.md): r_i in {0, 1}, 1 when the final answer in the completion equals
the reference answer. Parse failures score 0 and are counted.
"""
import re

# -----------------------------------------------------------------------------
# Finding the answer in a completion

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")  # not `\boxedsymbol`
_BARE = re.compile(r"[^\s$]+")  # `\boxed 5`: up to whitespace or `$`


def last_boxed(text):
    """Content of the last \\boxed{...} or \\fbox{...} in text, with balanced braces, or None.

    Also accepts the brace-less form `\\boxed 5` (MATH solutions use it now and then), whose
    content runs to the next whitespace or `$`. A last box that never closes (a completion cut off
    mid-answer) gives None rather than an earlier box: the model had not finished answering.
    data.py uses this to read MATH's reference answers out of its solutions.
    """
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    n = len(text)
    j = i
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
                    return text[j + 1:k]
            k += 1
        return None  # unbalanced: cut off before the box closed
    m = _BARE.match(text, j)
    return m.group(0) if m else None
