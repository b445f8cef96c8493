"""experiments/share.py: the speed-up over GRPO at any generation share, by hand."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import share  # noqa: E402


def run(folder, method, seed, accs, every, t_gen, t_upd, name=None, tokens=0):
    """A finished bench run in folder/runs: held-out accuracy every `every` steps, constant seconds
    and tokens forwarded and back-propagated a step."""
    n = every * (len(accs) - 1)
    result = {"method": method, "seed": seed, "error": None,
              "history": [{"step": every * i, "tokens": 0, "accuracy": a}
                          for i, a in enumerate(accs)],
              "steps": [{"step": i, "t_gen": t_gen, "t_upd": t_upd, "fwd_bwd_tokens": tokens}
                        for i in range(n)]}
    out = folder / "runs" / f"{name or method}-seed{seed}"
    out.mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({"config": {"steps": n}, "result": result}))


def folder(tmp_path, seeds=(0, 1)):
    """GRPO: 4 steps of 1 s generating + 3 s updating (f0 = 0.25), 0.6 at its end. grpo-filter: 4
    steps of 1 + 2 s, 0.6 at step 4. d3s: 4 steps of 1 + 1 s that end at 0.4, and 8 (in GRPO's
    budget) that are at 0.5 at step 6 and 0.7 at step 8, so 0.6 at step 7 by interpolation.
    d3s-random never gets there."""
    for s in seeds:
        run(tmp_path, "grpo", s, [0.2, 0.4, 0.6], 2, 1.0, 3.0)
        run(tmp_path, "grpo-filter", s, [0.2, 0.5, 0.6], 2, 1.0, 2.0)
        run(tmp_path, "d3s", s, [0.2, 0.3, 0.4], 2, 1.0, 1.0)
        run(tmp_path, "d3s", s, [0.2, 0.3, 0.4, 0.5, 0.7], 2, 1.0, 1.0, "d3s-budget")
        run(tmp_path, "d3s-random", s, [0.2, 0.2, 0.3], 2, 1.0, 1.0)
    return tmp_path


def test_speed_up_and_break_even_by_hand(tmp_path):
    """GRPO reaches 0.6 at step 4: G = 4 s, U = 12 s. d3s in its 8-step runs at step 7: G = U = 7 s;
    in its 4-step runs never. GRPO's budget affords d3s 4 (a + 3) / (a + 1) steps at generation
    scale a: 8 at the measured share (a = 1: 14 s against 16, 1.14x); 6 at f = 0.5 (a = 3), as
    near 4 as 8: the longer runs (24 s against 28, 0.86x); 4.6 at f = 0.8 (a = 12): the 4-step
    runs, which never get there (0x). d3s is faster while 4a + 12 > 7a + 7, a < 5/3, f < 5/14:
    the break-even share, by the grid's interpolation."""
    r = share.analyse(share.load(folder(tmp_path)))
    assert r["f0"] == pytest.approx(0.25) and r["target"] == pytest.approx(0.6)
    d3s = r["methods"]["d3s"]
    assert d3s["runs"]["4"] is None and d3s["runs"]["8"]["step"] == pytest.approx(7.0)
    assert (d3s["runs"]["8"]["gen_s"], d3s["runs"]["8"]["upd_s"]) == pytest.approx((7.0, 7.0))
    assert r["methods"]["grpo"]["runs"]["4"]["upd_s"] == pytest.approx(12.0)
    x, (lo, hi) = d3s["at"]["0.25"]
    assert x == pytest.approx(16 / 14) and (lo, hi) == pytest.approx((16 / 14, 16 / 14))
    assert d3s["at"]["0.5"][0] == pytest.approx(24 / 28) and d3s["at"]["0.8"][0] == 0.0
    assert d3s["even_grpo"][0] == pytest.approx(5 / 14, abs=0.005)
    assert share.speedup((4, 12), (7, 7), share.scale(5 / 14, 1.0, 3.0)) == pytest.approx(1.0)
    # the filter: 12 s against 16 at f0, the same steps: faster at every share
    assert r["methods"]["grpo-filter"]["at"]["0.25"][0] == pytest.approx(16 / 12)
    assert r["methods"]["grpo-filter"]["even_grpo"][0] == 1.0
    # d3s against the filter (4a + 8): faster while 7a + 7 < 4a + 8, a < 1/3, f < 1/10
    assert d3s["even_filter"][0] == pytest.approx(0.1, abs=0.005)
    # never there: 0x at every share, faster at no share
    rnd = r["methods"]["d3s-random"]
    assert max(rnd["curve"]) == 0.0 and rnd["even_grpo"][0] == 0.0
    text = share.table(r)
    assert "| d3s | 4 steps: not reached; 8 steps: 7.0 (7.0 + 7.0) | 1.14x [1.14, 1.14]" in text
    assert "| d3s-random | 4 steps: not reached |" in text


def test_cost_by_tokens_prices_each_step_at_grpos_seconds(tmp_path, capsys):
    """--cost tokens: GRPO's steps generate in 1 s (seed 0) and 3 s (seed 1), a mean of 2 s, and
    update 300 tokens in 3 s: 0.01 s a token. d3s's runs, measured on a slower host (5 s + 4 s a
    step), train 100 tokens a step: priced at 2 + 1 s. So at f0 = 0.4 (2 / (2 + 3)) GRPO's 4 steps
    cost 20 s, d3s's 7 steps of its 8-step runs 21 s: 20 / 21; measured, d3s is never faster."""
    for s in (0, 1):
        run(tmp_path, "grpo", s, [0.2, 0.4, 0.6], 2, 1.0 + 2 * s, 3.0, tokens=300)
        run(tmp_path, "d3s", s, [0.2, 0.3, 0.4, 0.5, 0.7], 2, 5.0, 4.0, "d3s-budget", tokens=100)
    r = share.analyse(share.by_tokens(share.load(tmp_path)))
    assert r["f0"] == pytest.approx(0.4)
    assert (r["methods"]["d3s"]["runs"]["8"]["gen_s"], r["methods"]["d3s"]["runs"]["8"]["upd_s"]) \
        == pytest.approx((14.0, 7.0))
    assert r["methods"]["d3s"]["at"]["0.4"][0] == pytest.approx(20 / 21)
    assert share.analyse(share.load(tmp_path))["methods"]["d3s"]["at"]["0.4"][0] < 0.5
    assert share.main([str(tmp_path), "--cost", "tokens", "--gpu", ""]) == 0
    assert "| d3s | 8 steps: 7.0 (14.0 + 7.0) | 0.95x" in capsys.readouterr().out


def test_reach_interpolates_between_evaluations():
    assert share.reach([0, 10, 20], [0.2, 0.4, 0.8], 0.6) == pytest.approx(15.0)
    assert share.reach([0, 10, 20], [0.2, 0.4, 0.8], 0.4) == 10.0
    assert share.reach([0, 10, 20], [0.7, 0.4, 0.8], 0.6) == 0.0
    assert share.reach([0, 10, 20], [0.2, 0.4, 0.5], 0.6) is None


def test_first_below_reads_the_crossing():
    n = len(share.SHARES)
    assert share.first_below([1.5] * n) == 1.0 and share.first_below([0.5] * n) == 0.0
    curve = [2.0 - 2 * f for f in share.SHARES]  # 1 at f = 0.5
    assert share.first_below(curve) == pytest.approx(0.5)


def test_a_folder_without_runs_or_grpo_is_one_line(tmp_path, capsys):
    assert share.main([str(tmp_path)]) == 2
    assert "has no finished run" in capsys.readouterr().err
    run(tmp_path, "d3s", 0, [0.2, 0.3], 2, 1.0, 1.0)
    assert share.main([str(tmp_path)]) == 2
    assert "has no finished grpo run" in capsys.readouterr().err


def test_the_command_prints_the_table_and_draws(tmp_path, capsys):
    out = tmp_path / "share.png"
    assert share.main([str(folder(tmp_path)), "--out", str(out), "--json",
                       str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    assert "generation's share measured here f0 = 0.25" in printed and out.stat().st_size > 0
    assert json.loads((tmp_path / "s.json").read_text())[tmp_path.name]["f0"] == 0.25


def test_the_speed_up_at_any_share_asked_for(tmp_path, capsys):
    """--at 0.4: a = 0.4 * 3 / (0.6 * 1) = 2; GRPO's budget affords d3s 4 (a + 3) / (a + 1) = 6.7
    steps, nearest its 8-step runs: 4a + 12 = 20 s against 7a + 7 = 21, 0.95x."""
    assert share.main([str(folder(tmp_path)), "--at", "0.4", "--gpu", ""]) == 0
    printed = capsys.readouterr().out
    assert "| x sooner at f = 0.4 | faster than GRPO below f |" in printed
    assert "| d3s | 4 steps: not reached; 8 steps: 7.0 (7.0 + 7.0) | 1.14x [1.14, 1.14] | 0.95x" \
        in printed
    assert share.main([str(tmp_path), "--at", "0.4,1.5"]) == 2
    assert "--at 0.4,1.5: each share must be in [0, 1)" in capsys.readouterr().err
