"""experiments/share.py: the speed-up over GRPO at any generation share, by hand."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import share  # noqa: E402


def run(method, seed, accs, every, t_gen, t_upd):
    """A finished bench run: held-out accuracy every `every` steps, constant seconds a step."""
    n = every * (len(accs) - 1)
    return {"method": method, "seed": seed, "error": None,
            "history": [{"step": every * i, "tokens": 0, "accuracy": a}
                        for i, a in enumerate(accs)],
            "steps": [{"step": i, "t_gen": t_gen, "t_upd": t_upd} for i in range(n)]}


def folder(tmp_path, seeds=(0, 1)):
    """GRPO: 4 steps of 1 s generating + 3 s updating (f0 = 0.25), 0.6 at its end. grpo-filter: 4
    steps of 1 + 2 s, 0.6 at step 4. d3s, in GRPO's budget: 8 steps of 1 + 1 s, 0.5 at step 6 and
    0.7 at step 8, so 0.6 at step 7 by interpolation. d3s-random never gets there."""
    fixed = [run("grpo", s, [0.2, 0.4, 0.6], 2, 1.0, 3.0) for s in seeds]
    fixed += [run("grpo-filter", s, [0.2, 0.5, 0.6], 2, 1.0, 2.0) for s in seeds]
    fixed += [run("d3s", s, [0.2, 0.3, 0.4], 2, 1.0, 1.0) for s in seeds]
    fixed += [run("d3s-random", s, [0.2, 0.2, 0.3], 2, 1.0, 1.0) for s in seeds]
    budget = [run("d3s", s, [0.2, 0.3, 0.4, 0.5, 0.7], 2, 1.0, 1.0) for s in seeds]
    budget += [run("d3s-random", s, [0.2, 0.2, 0.3, 0.3, 0.3], 2, 1.0, 1.0) for s in seeds]
    (tmp_path / "results.json").write_text(json.dumps({"runs": fixed, "budget": {"runs": budget}}))
    return tmp_path


def test_speed_up_and_break_even_by_hand(tmp_path):
    """GRPO reaches 0.6 at step 4: G = 4 s, U = 12 s. d3s at step 7 of its longer runs: G = U = 7 s.
    At the measured share (a = 1) d3s takes 14 s against 16: 1.14x. At f = 0.5, generation scaled
    by a = 0.5 * 3 / (0.5 * 1) = 3: 24 s against 28, 0.86x. Break-even: 4a + 12 = 7a + 7 at
    a = 5/3, f = (5/3) / (5/3 + 3) = 5/14. Against the filter (4a + 8): a = 1/3, f = 1/10."""
    r = share.analyse(share.load(folder(tmp_path)))
    assert r["f0"] == pytest.approx(0.25)
    d3s = r["methods"]["d3s"]
    assert d3s["steps_run"] == 8 and d3s["reach"] == pytest.approx(7.0)
    assert d3s["cost"] == pytest.approx([7.0, 7.0])
    assert r["methods"]["grpo"]["cost"] == pytest.approx([4.0, 12.0])
    x, (lo, hi) = d3s["at"]["0.25"]
    assert x == pytest.approx(16 / 14) and (lo, hi) == pytest.approx((16 / 14, 16 / 14))
    assert d3s["at"]["0.5"][0] == pytest.approx(24 / 28)
    f, below, _ = d3s["even_grpo"]
    assert f == pytest.approx(5 / 14) and below  # faster below 0.36, slower above
    assert d3s["even_filter"][0] == pytest.approx(0.1)
    assert share.speedup((4, 12), (7, 7), share.scale(5 / 14, 1.0, 3.0)) == pytest.approx(1.0)
    # the filter: 12 s against 16 at f0, and the same steps: faster at every share
    assert r["methods"]["grpo-filter"]["at"]["0.25"][0] == pytest.approx(16 / 12)
    assert r["methods"]["grpo-filter"]["even_grpo"][0] == 1.0
    # never there: 0x at every share, break-even at no share
    rnd = r["methods"]["d3s-random"]
    assert rnd["reach"] is None and max(rnd["curve"]) == 0.0 and rnd["even_grpo"][0] == 0.0
    text = share.table(r)
    assert "| d3s | 8 | 7.0 | 7.0 + 7.0 | 1.14x [1.14, 1.14]" in text
    assert "0.36 (faster below) [0.36, 0.36]" in text and "| d3s-random | 8 | not reached |" in text


def test_reach_interpolates_between_evaluations():
    assert share.reach([0, 10, 20], [0.2, 0.4, 0.8], 0.6) == pytest.approx(15.0)
    assert share.reach([0, 10, 20], [0.2, 0.4, 0.8], 0.4) == 10.0
    assert share.reach([0, 10, 20], [0.7, 0.4, 0.8], 0.6) == 0.0
    assert share.reach([0, 10, 20], [0.2, 0.4, 0.5], 0.6) is None


def test_a_folder_without_results_or_grpo_is_one_line(tmp_path, capsys):
    assert share.main([str(tmp_path)]) == 2
    assert "has no results.json" in capsys.readouterr().err
    (tmp_path / "results.json").write_text(json.dumps({"runs": [run("d3s", 0, [0.2, 0.3], 2,
                                                                      1.0, 1.0)]}))
    assert share.main([str(tmp_path)]) == 2
    assert "has no finished grpo run" in capsys.readouterr().err


def test_the_command_prints_the_table_and_draws(tmp_path, capsys):
    out = tmp_path / "share.png"
    assert share.main([str(folder(tmp_path)), "--out", str(out), "--json",
                       str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    assert "generation's share measured here f0 = 0.25" in printed and out.stat().st_size > 0
    assert json.loads((tmp_path / "s.json").read_text())[tmp_path.name]["f0"] == 0.25
