"""experiments/share.py: the speed-up over GRPO at any generation share, by hand."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import share  # noqa: E402
from experiments import budget  # noqa: E402  the module share.py prices devices with


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
    config = {"steps": n, "method": method, "s_init": 0.25, "s_final": 0.75, "t_init": 0.2,
              "t_final": 0.6}  # train.py's schedule
    (out / "result.json").write_text(json.dumps({"config": config, "result": result}))


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
    assert "| x sooner at f = 0.4, projected | faster than GRPO below f |" in printed
    assert "At another share f the update keeps this CPU's ratio to GRPO's: projected" in printed
    assert "| d3s | 4 steps: not reached; 8 steps: 7.0 (7.0 + 7.0) | 1.14x [1.14, 1.14] | 0.95x" \
        in printed
    assert share.main([str(tmp_path), "--at", "0.4,1.5"]) == 2
    assert "--at 0.4,1.5: each share must be in [0, 1)" in capsys.readouterr().err


def test_a_device_prices_the_update_with_its_own_ratio(tmp_path, capsys):
    """The folder above on a device where generation is half of GRPO's step (f = 0.5), GRPO's
    budget 4 of its steps. d3s's update 0.25 of GRPO's there (a step costs 0.5 + 0.5 * 0.25 =
    0.625): the budget affords it 6.4 steps, nearest its 8-step runs, whose 7 steps to the target
    cost 4.375: 4 / 4.375 = 0.91x. On this CPU its update is 1/3 of GRPO's, which would give
    4 / (7 * 2/3) = 0.86x. grpo-filter has no ratio there: this CPU's 2/3, projected (4 steps of
    0.5 + 1/3: 4 / 3.33 = 1.2x)."""
    dev = "dev:share=0.5,d3s=0.25"
    r = share.analyse(share.load(folder(tmp_path)), devices=budget.devices(dev))
    on = r["devices"]["dev"]
    assert on["share"] == 0.5 and on["budget_steps"] == 4
    d3s = on["methods"]["d3s"]
    assert d3s["afford"] == pytest.approx(6.4) and d3s["run"] == 8 and not d3s["projection"]
    assert d3s["runs"]["4"] is None and d3s["runs"]["8"]["cost"] == pytest.approx(4.375)
    assert d3s["x"][0] == pytest.approx(4 / 4.375) and d3s["priced_by"] == "dev's 0.25"
    flt = on["methods"]["grpo-filter"]
    assert flt["projection"] and flt["x"][0] == pytest.approx(1.2) and "projection" in \
        flt["priced_by"]
    assert on["methods"]["grpo"]["x"][0] == 1.0 and on["methods"]["d3s-random"]["x"][0] == 0.0
    assert share.main([str(tmp_path), "--device", dev, "--gpu", "", "--out",
                       str(tmp_path / "s.png")]) == 0
    printed = capsys.readouterr().out
    assert "On dev: generation 0.500 of GRPO's step (given on the command line)" in printed
    assert ("| d3s | dev's 0.25 | 6.4 steps | 4 steps: not reached; 8 steps: 7.0 (4.4, 0.91x) | "
            "0.91x [0.91, 0.91] (8 steps) |") in printed
    assert "| grpo-filter | this CPU's ratio (t_upd over GRPO's), a projection: dev has none" \
        in printed and "1.20x [1.20, 1.20] (4 steps), projected |" in printed


def test_a_device_ratio_by_rho_follows_each_runs_schedule(tmp_path):
    """d3s's update 0.2 of GRPO's at rho_s 0.25 and 0.6 at 0.75: over an 8-step run rho_s goes
    0.25 + 0.5 i / 7, its ratio 0.2 + 0.4 i / 7; its first 7 steps sum to 1.4 + 0.4 * 21 / 7 = 2.6,
    so at f = 0.5 they cost 3.5 + 1.3 = 4.8: 4 / 4.8 = 0.83x. A run of n >= 2 steps averages 0.4,
    0.7 n in all: GRPO's 4 steps afford 5.7, nearer the 4-step runs, which never get there."""
    dev = budget.devices("dev:share=0.5,d3s@0.25=0.2,d3s@0.75=0.6")
    r = share.analyse(share.load(folder(tmp_path)), devices=dev)
    d3s = r["devices"]["dev"]["methods"]["d3s"]
    assert d3s["runs"]["8"]["cost"] == pytest.approx(4.8) and d3s["runs"]["8"]["x"] == \
        pytest.approx(4 / 4.8)
    assert d3s["afford"] == pytest.approx(4 / 0.7) and d3s["run"] == 4 and d3s["x"][0] == 0.0
    assert d3s["priced_by"] == "dev's 0.2 at ρs 0.25, 0.6 at ρs 0.75"


def rerun(tmp_path, reached_at=66.2, steps=73):
    """study.md's rerun with the loop in tiny, reduced to what the speed-up reads: GRPO's 60-step
    runs end at the target, 0.5; D3S's 60-step runs never get there, its runs of `steps` steps
    reach it at step `reached_at` (evaluations at 0, 65 and 70: 0.44, then 0.69 at 70, so 66.2
    by interpolation; the seconds this CPU's, not used on a device with D3S's ratio)."""
    up = (0.5 - 0.44) / (reached_at - 65) * 5 + 0.44
    for s in (0, 1):
        run(tmp_path, "grpo", s, [0.2, 0.5], 60, 0.25, 0.75)
        run(tmp_path, "d3s", s, [0.2, 0.3], 60, 0.25, 0.4)
        runs = tmp_path / "runs" / f"d3s-budget-seed{s}"
        runs.mkdir(parents=True)
        result = {"method": "d3s", "seed": s, "error": None,
                  "history": [{"step": k, "tokens": 0, "accuracy": a}
                              for k, a in ((0, 0.2), (65, 0.44), (70, up), (steps, up))],
                  "steps": [{"step": i, "t_gen": 0.25, "t_upd": 0.4, "fwd_bwd_tokens": 0}
                            for i in range(steps)]}
        config = {"steps": steps, "method": "d3s", "s_init": 0.25, "s_final": 0.75,
                  "t_init": 0.2, "t_final": 0.6}
        (runs / "result.json").write_text(json.dumps({"config": config, "result": result}))
    return share.load(tmp_path)


def test_the_h200s_own_update_prices_the_gpu_answer_at_about_1(tmp_path):
    """experiments/speed.md's H200 (HF generate): GRPO 18.7 s a step = 12.1 generating + 6.6
    updating (f = 12.1 / 18.7); D3S's update 2.3 s at 0.25/0.2 and 7.6 s at 0.75/0.6, a schedule
    mean of (2.3 + 7.6) / 2 / 6.6 = 0.75 of GRPO's. A D3S step there: 12.1 + 0.75 * 6.6 = 17.05 s,
    so GRPO's 60 steps (1122 s) afford 1122 / 17.05 = 65.8 D3S steps, where study.md's rerun
    needed 66.2 (its 73-step runs): 1122 / (66.2 * 17.05) = 0.99x; J's first runs needed 60.1 (of
    69): 1.10x. Priced step by step along the 73-step run's own schedule (ratio 0.348 + 0.803 i / 72
    at step i), its 66.2 steps cost 59.47 of GRPO's: 1.01x. About 1.0 either way, where the
    CPU's update ratio (about 0.53) gave 1.13x at f = 0.65."""
    f = 12.1 / 18.7
    mean = lambda n: [0.75] * n  # noqa: E731
    assert budget.affordable(60, f, mean) == pytest.approx(1122 / 17.05) == pytest.approx(65.806,
                                                                                          abs=1e-3)
    h200 = budget.devices("h200-hf")[0]
    assert h200["share"] == f and budget.ratio_at(h200["ratio"]["d3s"], 0.5) == pytest.approx(0.75)
    config = {"method": "d3s", "s_init": 0.25, "s_final": 0.75, "t_init": 0.2, "t_final": 0.6}
    by_rho = lambda n: budget.device_ratios(h200, "d3s", config, n)  # noqa: E731
    assert budget.affordable(60, f, by_rho) == pytest.approx(65.806, abs=1e-3)
    step = f + (1 - f) * 0.75  # 17.05 / 18.7 of GRPO's step
    assert 60 / (66.2 * step) == pytest.approx(0.994, abs=5e-4)
    assert 60 / (60.1 * step) == pytest.approx(1.095, abs=5e-4)
    on = share.analyse(rerun(tmp_path), resamples=10,
                       devices=budget.devices("h200:share=0.647059,d3s=0.75"))
    d3s = on["devices"]["h200"]["methods"]["d3s"]
    assert d3s["afford"] == pytest.approx(65.806, abs=1e-3)
    assert d3s["runs"]["73"]["step"] == pytest.approx(66.2)
    assert d3s["runs"]["73"]["x"] == pytest.approx(0.994, abs=5e-4)
    # the runs nearest 65.8 steps are the 60-step ones, which never get there: "unresolved"
    assert d3s["run"] == 60 and d3s["x"][0] == 0.0
    own = share.analyse(rerun(tmp_path / "own"), resamples=10, devices=[h200])
    assert own["devices"]["h200-hf"]["methods"]["d3s"]["runs"]["73"]["cost"] == \
        pytest.approx(59.473, abs=1e-3)
    assert own["devices"]["h200-hf"]["methods"]["d3s"]["runs"]["73"]["x"] == \
        pytest.approx(1.0089, abs=1e-4)


def test_a_device_from_gpu_checks_summary(tmp_path, capsys):
    """gpu_check's summary.json, as its compare part writes it: GRPO's steady generation share, and
    D3S's update over GRPO's at each fixed ratio. Unfinished, it is one line and exit code 2."""
    summary = {"card": {"name": "NVIDIA H200"}, "dry_run": False,
               "runs": {"grpo": {"status": "done", "command": "python train.py --method grpo",
                                 "steady_median": {"generation_share": 0.4}}},
               "parts": {"compare": {"status": "done", "micro_batch_size": 16, "rows": {
                   "grpo": {"update_s": 6.0, "update_over_grpo": 1.0},
                   "d3s 0.25/0.2": {"update_s": 1.5, "update_over_grpo": 0.25},
                   "d3s 0.75/0.6": {"update_s": 4.5, "update_over_grpo": 0.75}}}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    dev, = budget.devices(str(path))
    assert dev["name"] == "NVIDIA H200 (gpu_check)" and dev["share"] == 0.4
    assert dev["ratio"] == {"d3s": [[0.25, 0.25], [0.75, 0.75]]}
    assert "--generation loop" in dev["source"]
    summary["parts"]["compare"] = {"status": "not started"}
    path.write_text(json.dumps(summary))
    assert share.main([str(folder(tmp_path / "f")), "--device", str(path)]) == 2
    assert "gpu_check's compare part is not started: no update ratio was measured" in \
        capsys.readouterr().err
    assert share.main([str(tmp_path / "f"), "--device", "dev:share=1.5"]) == 2
    assert "device dev: share 1.5" in capsys.readouterr().err
    assert share.main([str(tmp_path / "f"), "--device", "h100"]) == 2
    assert "--device h100: not one of h200-hf, cpu, a file" in capsys.readouterr().err
