"""Grade time on long generated inputs: every grade within 0.3 s on 10,000 characters and 1 s on
100,000, each input graded in a process of its own. The inputs repeat one piece (a command, a brace,
a digit, a space) alone, in a box, on a #### line, after and between boxes, and nested in boxes.
The test allows MARGIN times the bound, so that a loaded machine does not fail it (a quadratic
scan takes seconds at 100,000 characters); run as a script, this file prints the seconds
themselves, the figures in docs/grading.md:

    python tests/test_grade_time.py
"""
import argparse
import multiprocessing
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from machinery import grader  # noqa: E402
from reward import grade  # noqa: E402
from conftest import seconds_in_a_child  # noqa: E402

BOUNDS = {10_000: 0.3, 100_000: 1.0}  # characters: seconds
MARGIN = 3.0
PIECES = ["\\boxed1", "\\boxed 1 ", "\\boxed{1}", "\\boxed{", "\\boxed", "\\boxed-", "\\fbox1",
          "\\boxed\\frac", "\\boxed{1", "}", "{", "{}", "\\text{", "\\text{ }", "\\frac", "\\frac1",
          "\\sqrt", "^{", "\\\\", "\\", "\\!", "$", "####", "#### 1\n", "1,", "1 ", "7", " ", "\n",
          "\\left(", "|", "\\overline{", "\\mathbf{", "€", "5^{\\text{th}}", "\\phantom{0}",
          "\\boxed{\\text{", "1 000 ", "!", "&", "\\pounds", "0.\\overline{3}"]


def inputs(n):
    """{name: text} for every piece, each form about n characters long."""
    out = {}
    for piece in PIECES:
        run = (piece * (n // len(piece) + 1))[:n]
        for form, text in [("run", run), ("in a box", "\\boxed{" + run + "}"),
                           ("#### line", "#### " + run + "\n"), ("after a box", "\\boxed{5}" + run),
                           ("between boxes", "\\boxed{5}" + run + "\\boxed{6}"),
                           ("nested", "\\boxed{" * (n // 16) + piece + "}" * (n // 16))]:
            out[f"{form}: {piece!r}"] = text
    return out


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
@pytest.mark.parametrize("n", list(BOUNDS))
def test_every_grade_is_fast_on_generated_inputs(n):
    grader._symbolic_equal("x^2", "x^2")  # the one-time warm-up, as in training
    slow = {name: seconds for name, text in inputs(n).items()
            if (seconds := seconds_in_a_child(lambda: grade(text, "3"), 2 * MARGIN * BOUNDS[n]))
            > MARGIN * BOUNDS[n]}
    assert slow == {}


if __name__ == "__main__":
    argparse.ArgumentParser(description="The seconds grade takes on each length's generated "
                                        "inputs, each in its own process.").parse_args()
    grader._symbolic_equal("x^2", "x^2")
    for n, bound in BOUNDS.items():
        times = sorted(((seconds_in_a_child(lambda: grade(text, "3"), 60), name)
                        for name, text in inputs(n).items()), reverse=True)
        print(f"{n:,} characters, {len(times)} inputs: slowest {times[0][0]:.3f} s "
              f"({times[0][1]}), median {times[len(times) // 2][0]:.3f} s, bound {bound} s")
        for seconds, name in times[:3]:
            print(f"  {seconds:.3f} s  {name}")
