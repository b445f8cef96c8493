"""bench.py: the study's numbers (95% t intervals, paired differences, AUC, steps to GRPO with a
bootstrap interval, seconds to GRPO, shares) against hand computations on fake run folders; GRPO's
budget of seconds (each method's step count, budget.json read again, the speed-up in seconds with
its bootstrap interval, the seconds axis of bench.png); the updates made per step under a mini-batch
size, here and in paired.py; reuse of finished runs and refusal of a changed config; per-method
learning rates, the tuning mode and its lrs.json; the schedule knobs reaching only the methods that
read them, the random controls included; and a real 2-step run of grpo and d3s, its table checked
against the runs' own log.jsonl / train.log / config.json."""
import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from experiments import bench
from machinery import checkpoint, config
import train

DIVISOR = getattr(train.Config, "divisor", None)  # a knob of train.py's to come

# -----------------------------------------------------------------------------
# helpers


def table_rows(text):
    """{method (and lr and K when a method has several rows): [cells]} from the markdown table in
    a text."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in bench.d3s.METHODS:
            rows[cells[0] if cells[0] not in rows else " ".join(cells[:3])] = cells
    return rows


def fake_steps(steps, kept, tokens, t_gen, t_upd, zero_var=lambda i: 0.5, updates=lambda i: 1):
    return [{"step": i, "reward": 0.5, "zero_var": zero_var(i), "kept": kept, "rollouts": 128,
             "tokens": tokens, "fwd_bwd_tokens": 40 * kept, "valid": 2 * tokens,  # 40 a rollout
             "grad_norm": 1.0, "t_gen": t_gen,
             "t_upd": t_upd, "nonfinite": 0, "updates": updates(i), "pad_share": 0.1 + 0.1 * (i % 2)}
            for i in range(steps)]


def fake_folders(args, accs, per_step, tmp_path):
    """Write a finished run folder (result.json) for every (method, lr, K, seed) that `args` asks
    for, as if bench had run it: accs[(method, lr, K, seed)] are the accuracies at steps 0, 10, 20
    (tokens: 100 a step), per_step[method](seed) the per-step rows. Returns the configs."""
    _, cfgs = bench.configs(bench.parse_args(args))
    for cfg in cfgs:
        history = [{"step": 10 * i, "tokens": 1000 * i, "accuracy": a}
                   for i, a in enumerate(accs[(*bench.key(cfg), cfg.seed)])]
        result = dict(bench.blank_result(cfg), history=history,
                      steps=per_step[cfg.method](cfg.seed), wall=10.0)
        (tmp_path / cfg.out_dir).mkdir(parents=True)
        saved = {"config": bench.as_json(cfg), "result": result}
        (tmp_path / cfg.out_dir / "result.json").write_text(json.dumps(saved))
    return cfgs


def main(args, capsys):
    """Run bench.main, return what it printed."""
    bench.main(args)
    return capsys.readouterr().out


@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """Work in tmp_path; any run that bench would start fails the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run_one",
                        lambda cfg, context: pytest.fail(f"{cfg.out_dir} was run, not reused"))
    return tmp_path

# -----------------------------------------------------------------------------
# statistics, by hand


def test_t_quantile_matches_the_printed_table():
    # Student's t, two-sided 95%: the textbook table's values
    for df, t in [(1, 12.706), (2, 4.303), (3, 3.182), (7, 2.365), (15, 2.131), (30, 2.042)]:
        assert bench.t_quantile(df) == pytest.approx(t, abs=5e-4)
    assert 1.96 < bench.t_quantile(10_000) < 1.961  # the normal's 1.95996 in the limit


def test_mean_ci_auc_first_reach():
    m, ci = bench.mean_ci([0.5, 0.6, 0.7])  # sd 0.1, n 3: 4.303 * 0.1 / sqrt(3)
    assert m == pytest.approx(0.6) and ci == pytest.approx(4.3027 * 0.1 / math.sqrt(3), rel=1e-4)
    assert bench.mean_ci([0.4]) == (0.4, None)
    # (10 * (0.2 + 0.4) / 2 + 20 * (0.4 + 0.5) / 2) / 30 = (3 + 9) / 30
    assert bench.auc([{"step": 0, "accuracy": 0.2}, {"step": 10, "accuracy": 0.4},
                      {"step": 30, "accuracy": 0.5}]) == pytest.approx(0.4)
    assert bench.first_reach([0, 10, 20], [0.2, 0.5, 0.6], 0.5) == 10
    # 0.6000000000000001: reached
    assert bench.first_reach([0, 10, 20], [0.2, 0.3, 0.6], 0.1 + 0.2 + 0.3) == 20
    assert bench.first_reach([0, 10, 20], [0.2, 0.3, 0.4], 0.5) is None


def test_reach_interval_two_seeds_by_hand():
    # seed A reaches GRPO's 0.5 at step 10, seed B never; a resample of 2 seeds is AA (1/4: step
    # 10), AB (1/2: mean .2 .4 .5, step 20) or BB (1/4: never). Both AA and BB are far above 2.5%
    # of 1000.
    accs = [[0.2, 0.5, 0.6], [0.2, 0.3, 0.4]]
    lo, hi, reached = bench.reach_interval([0, 10, 20], accs, [0.5, 0.5])
    assert (lo, hi) == (10, None)
    assert 0.70 < reached < 0.80  # 3/4 of the resamples reach it
    again = bench.reach_interval([0, 10, 20], accs, [0.5, 0.5])
    assert again == (lo, hi, reached)  # seeded
    # every resample reaches at the same step: the interval is that step
    accs = [[0.2, 0.7, 0.6], [0.2, 0.8, 0.7]]
    assert bench.reach_interval([0, 10, 20], accs, [0.5, 0.7]) == (10, 10, 1.0)

# -----------------------------------------------------------------------------
# the table of a fake study, by hand


STUDY = ["--methods", "grpo,d3s,d2s", "--seeds", "3", "--steps", "20", "--eval_every", "10",
         "--out", "study", "--lr", "1e-4", "--updates_per_batch", "1"]
ACCS = {  # accuracy at steps 0, 10, 20 of each (method, lr, K, seed)
    ("grpo", 1e-4, 1, 0): [0.2, 0.4, 0.5], ("grpo", 1e-4, 1, 1): [0.2, 0.3, 0.6],
    ("grpo", 1e-4, 1, 2): [0.2, 0.5, 0.7],
    ("d3s", 1e-4, 1, 0): [0.2, 0.7, 0.6], ("d3s", 1e-4, 1, 1): [0.2, 0.8, 0.7],
    ("d3s", 1e-4, 1, 2): [0.2, 0.7, 0.9],
    ("d2s", 1e-4, 1, 0): [0.2, 0.3, 0.4], ("d2s", 1e-4, 1, 1): [0.2, 0.3, 0.4],
    ("d2s", 1e-4, 1, 2): [0.2, 0.3, 0.4],
}
PER_STEP = {  # 20 steps each; grpo keeps all 128 rollouts and 1000 tokens a step
    "grpo": lambda seed: fake_steps(20, kept=128, tokens=1000, t_gen=1.0 + 0.1 * seed, t_upd=0.5,
                                    zero_var=lambda i: 0.25 * (1 + seed)),  # .25 .5 .75 by seed
    "d3s": lambda seed: fake_steps(20, kept=64, tokens=150, t_gen=1.0, t_upd=0.3,
                                   zero_var=lambda i: 0.5 * (i % 2)),  # .25 for each seed
    "d2s": lambda seed: fake_steps(20, kept=32, tokens=50, t_gen=1.0, t_upd=0.2),
}


def test_study_table_by_hand(no_training, capsys):
    fake_folders(STUDY, ACCS, PER_STEP, no_training)
    printed = main(STUDY, capsys)
    assert "9 runs: 9 finished before (reused), 0 to run" in printed
    res = json.loads((no_training / "study" / "results.json").read_text())
    grpo, d3s, d2s = res["table"]
    t2 = 4.302653  # t(0.975, 2 degrees of freedom): 3 seeds
    # grpo: finals .5 .6 .7 (sd .1); AUC (10*(.2+.4)/2 + 10*(.4+.5)/2)/20 = .375, then .35, .475
    assert grpo["final"] == [60.0, round(100 * t2 * 0.1 / math.sqrt(3), 1)] == [60.0, 24.8]
    assert grpo["auc"] == [40.0, 16.4]          # sd of .375 .35 .475 = sqrt(.004375) = .0661
    assert grpo["final_diff"] == [0.0, 0.0] and grpo["auc_diff"] == [0.0, 0.0]
    # its own mean curve .2 .4 .6 reaches its final .6 at step 20, in every resample (each seed's
    # step-10 value is below its own final); the 20 steps before cost
    # (1.0 + 1.1 + 1.2) / 3 * 20 s + 0.5 * 20 s
    assert (grpo["steps_to_grpo"], grpo["steps_ci"], grpo["reached"]) == (20, [20, 20], 1.0)
    assert grpo["s_to_grpo"] == [22.0, 10.0]
    # d3s: finals .6 .7 .9; AUC .55 .625 .625; paired differences .1 .1 .2 and .175 .275 .15
    assert d3s["final"] == [73.3, 37.9] and d3s["auc"] == [60.0, 10.8]
    assert d3s["final_diff"] == [13.3, 14.3] and d3s["auc_diff"] == [20.0, 16.4]
    # step-10 values .7 .8 .7 are at or above any resample's target (at most .7): step 10 always
    assert (d3s["steps_to_grpo"], d3s["steps_ci"], d3s["reached"]) == (10, [10, 10], 1.0)
    assert d3s["s_to_grpo"] == [10.0, 3.0]  # steps 0..9: 10 * 1.0 s generating, 10 * 0.3 s updating
    shares = (d3s["rollouts"], d3s["rollouts_pct"], d3s["tokens"], d3s["tokens_pct"])
    assert shares == (1280, 50.0, 3000, 15.0)
    assert (grpo["t_gen"], d3s["t_upd"]) == (1.1, 0.3)
    # the zero-variance share, a run's mean over its steps: grpo .25 .5 .75 (sd .25), d3s .25 always
    assert grpo["zero_var"] == [50.0, round(100 * t2 * 0.25 / math.sqrt(3), 1)] == [50.0, 62.1]
    assert d3s["zero_var"] == [25.0, 0.0] and d2s["zero_var"] == [50.0, 0.0]
    # d2s: .2 .3 .4 for every seed: never reaches .6, in no resample
    assert d2s["final"] == [40.0, 0.0] and d2s["auc"] == [30.0, 0.0]
    assert d2s["final_diff"] == [-20.0, 24.8] and d2s["auc_diff"] == [-10.0, 16.4]
    reach = (d2s["steps_to_grpo"], d2s["steps_ci"], d2s["reached"], d2s["s_to_grpo"])
    assert reach == (None, [None, None], 0.0, None)
    # the printed table is those numbers
    rows = table_rows(printed)
    assert table_rows((no_training / "study" / "results.md").read_text()) == rows
    divisor = DIVISOR or "-"  # the tiny world's default, "-" where train.py has no --divisor
    assert rows["grpo"][1:10] == ["0.0001", "1", divisor, "60.0 ± 24.8", "+0.0 ± 0.0",
                                  "40.0 ± 16.4", "+0.0 ± 0.0", "20 [20, 20]", "32 (22+10)"]
    assert rows["d3s"][4:12] == ["73.3 ± 37.9", "+13.3 ± 14.3", "60.0 ± 10.8", "+20.0 ± 16.4",
                                 "10 [10, 10]", "13 (10+3)", "1280 (50.0%)", "3000 (15.0%)"]
    assert rows["d2s"][5:10] == ["-20.0 ± 24.8", "30.0 ± 0.0", "-10.0 ± 16.4",
                                 "not reached [never, never]", "-"]
    assert rows["d2s"][-1] == "3/3"
    # the compute: every kept rollout's 40 tokens forwarded and back-propagated, 20 steps
    assert rows["grpo"][12] == "102400 (100.0%)" and rows["d3s"][12] == "51200 (50.0%)"
    cells = (rows["grpo"][13], rows["d3s"][13], rows["d3s"][14])
    assert cells == ("50.0 ± 62.1", "25.0 ± 0.0", "1.00")
    # the plot's curves: seed means, t intervals, paired differences to grpo
    curve = res["curves"]["d3s lr 0.0001 K 1"]
    assert curve["step"] == [0, 10, 20]
    assert curve["acc_mean"] == pytest.approx([0.2, 2.2 / 3, 2.2 / 3])
    # at step 10: .7 .8 .7, sd sqrt(1/300)
    assert curve["acc_ci"][0] == 0.0
    assert curve["acc_ci"][1] == pytest.approx(t2 * math.sqrt(1 / 300 / 3), rel=1e-4)
    # paired differences (.3 .5 .2) and (.1 .1 .2)
    assert curve["diff_mean"] == pytest.approx([0.0, 0.3333333, 0.1333333])
    assert (no_training / "study" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_aggregate_failures_and_no_grpo():
    def run(method, seed, accs, error=None):
        return {"method": method, "lr": 1e-4, "updates_per_batch": 1, "seed": seed, "wall": 10.0,
                "error": error,
                "history": [{"step": 10 * i, "tokens": 100 * i, "accuracy": a}
                            for i, a in enumerate(accs)],
                "steps": [] if error else fake_steps(20, kept=8, tokens=100, t_gen=1.0, t_upd=0.5)}
    results = [run("grpo", 0, [0.2, 0.4, 0.5]), run("grpo", 1, [0.2, 0.3, 0.7]),
               run("d3s", 0, [0.2, 0.7, 0.6]), run("d3s", 1, [], error="RuntimeError: boom"),
               run("d2s", 0, [], error="ValueError: bad")]
    rows, _ = bench.aggregate(results, [("grpo", 1e-4, 1), ("d3s", 1e-4, 1), ("d2s", 1e-4, 1)])
    grpo, d3s, d2s = rows
    assert grpo["final"] == [60.0, 127.1]  # t(0.975, 1) 12.706 * sd .1414 / sqrt(2)
    # one d3s seed: no interval; paired with grpo's seed 0 only: .6 - .5
    assert d3s["final"] == [60.0, None] and d3s["final_diff"] == [10.0, None]
    assert d3s["runs"] == 1 and d3s["wall"] == 20
    assert d3s["failed"] == ["seed 1: RuntimeError: boom"]
    assert d2s == {"method": "d2s", "lr": 1e-4, "updates_per_batch": 1, "runs": 0,
                   "failed": ["seed 0: ValueError: bad"], "wall": 10}
    cells = table_rows(bench.format_table(rows))
    assert cells["d3s"][4:6] == ["60.0", "+10.0"]
    assert cells["d3s"][-1] == "1/2; failed seed 1: RuntimeError: boom"
    assert cells["d2s"][4] == "failed" and cells["d2s"][-1] == "0/1; failed seed 0: ValueError: bad"
    assert len(cells["d2s"]) == len(cells["d3s"]) == 19  # a failed row has every column
    assert cells["d3s"][16] == "15.0"  # pad %: log.jsonl's pad_share, mean over the steps (.1, .2)
    # runs of before the zero-var column (no zero_var in their steps): "-", not a wrong number
    for step in results[0]["steps"]:
        del step["zero_var"], step["pad_share"]
    rows, _ = bench.aggregate(results[:2], [("grpo", 1e-4, 1)])
    assert rows[0]["zero_var"] is None and table_rows(bench.format_table(rows))["grpo"][13] == "-"
    assert rows[0]["pad"] is None and table_rows(bench.format_table(rows))["grpo"][16] == "-"
    # without grpo there is nothing to compare with
    rows, _ = bench.aggregate(results[2:3], [("d3s", 1e-4, 1)])
    assert rows[0]["final_diff"] is None and rows[0]["steps_to_grpo"] is None
    # AUC (4.5 + 6.5) / 20
    assert table_rows(bench.format_table(rows))["d3s"][5:10] == ["-", "55.0", "-", "-", "-"]

# -----------------------------------------------------------------------------
# the paper's unit: seconds, and GRPO's budget of them


def test_sooner_by_hand():
    # GRPO reaches its final 0.5 at 100 s (its last evaluation), the method at 50 s: 2.0x sooner
    base_acc, base_s = np.array([[0.2, 0.4, 0.5]] * 2), np.array([[0.0, 50.0, 100.0]] * 2)
    acc, secs = np.array([[0.2, 0.5, 0.6]] * 2), np.array([[0.0, 50.0, 100.0]] * 2)
    assert bench.reach_seconds(base_acc, base_s, 0.5) == 100.0
    assert bench.reach_seconds(acc, secs, 0.5) == 50.0
    assert bench.sooner_interval(acc, secs, base_acc, base_s) == (2.0, 2.0, 2.0, 1.0)
    # seconds are seed means: the seeds spent 40 and 60 s before the reaching evaluation
    assert bench.reach_seconds(acc, np.array([[0, 40, 90], [0, 60, 110]]), 0.5) == 50.0
    # never within the run: no speed-up, and every resample counts as "never"
    assert bench.sooner_interval(acc - 0.2, secs, base_acc, base_s) == (None, None, None, 0.0)
    # two seeds: alone, seed 0 reaches at 50 s (2x), seed 1 at 80 s (1.25x), together (mean .45,
    # then .6) at 80 s; resamples 00 (1/4), 01 and 10 (1/2), 11 (1/4): [1.25, 2]
    acc = np.array([[0.2, 0.5, 0.6], [0.2, 0.4, 0.7]])
    secs = np.array([[0.0, 50.0, 80.0], [0.0, 50.0, 80.0]])
    x, lo, hi, reached = bench.sooner_interval(acc, secs, base_acc, base_s)
    assert (x, lo, hi, reached) == (1.25, 1.25, 2.0, 1.0)
    assert bench.sooner(10.0, 0.0) == math.inf and bench.sooner(0.0, 0.0) == 1.0


def fake_train(accs, seconds, trained):
    """train.train as bench calls it: writes log.jsonl, every step taking seconds[method] (half
    generating, half updating), and returns the evaluations accs[(method, steps, seed)] at steps 0,
    eval_every, ... Appends each run folder to `trained`."""
    def train_(cfg, log=print, given=None):
        trained.append(cfg.out_dir)
        half = seconds[cfg.method] / 2
        rows = fake_steps(cfg.steps, kept=8, tokens=100, t_gen=half, t_upd=half)
        Path(cfg.out_dir, "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        evals = range(0, cfg.steps + 1, cfg.eval_every)
        return [{"step": s, "tokens": 100 * s, "accuracy": a}
                for s, a in zip(evals, accs[(cfg.method, cfg.steps, cfg.seed)], strict=True)]
    return train_


BUDGET = ["--methods", "grpo,d3s", "--seeds", "2", "--steps", "20", "--eval_every", "10", "--out",
          "study", "--lr", "1e-4", "--updates_per_batch", "1", "--threads", "1", "--budget",
          "seconds"]
BUDGET_ACCS = {  # (method, steps, seed): accuracy at steps 0, 10, ...
    ("grpo", 20, 0): [0.2, 0.4, 0.5], ("grpo", 20, 1): [0.2, 0.4, 0.5],
    ("d3s", 20, 0): [0.2, 0.3, 0.4], ("d3s", 20, 1): [0.2, 0.3, 0.4],
    ("d3s", 40, 0): [0.2, 0.3, 0.5, 0.6, 0.6], ("d3s", 40, 1): [0.2, 0.4, 0.4, 0.5, 0.7],
    ("d2s", 20, 0): [0.2, 0.3, 0.3], ("d2s", 20, 1): [0.2, 0.3, 0.3],
    ("d2s", 80, 0): [0.2] * 9, ("d2s", 80, 1): [0.2] * 9}


def tables(printed):
    """(the fixed-step table's rows, the budget table's rows) of bench's output."""
    fixed, budget = printed.split("In GRPO's budget:")
    return table_rows(fixed), table_rows(budget)


def test_budget_of_seconds_by_hand(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "load_model", lambda name: None)  # nothing to build
    monkeypatch.setattr(bench, "_init_worker", lambda threads: None)
    trained = []
    seconds = {"grpo": 2.0, "d3s": 1.0, "d2s": 0.5}  # per step
    monkeypatch.setattr(train, "train", fake_train(BUDGET_ACCS, seconds, trained))
    printed = main(BUDGET, capsys)
    # GRPO's 2 s a step buy 40 s in 20 steps; D3S's 1 s a step buys 40 steps of its own
    plan = json.loads((tmp_path / "study" / "budget.json").read_text())
    assert {k: plan[k] for k in ("steps", "seconds_per_step", "budget_steps")} == {
        "steps": 20, "seconds_per_step": {"grpo": 2.0, "d3s": 1.0},
        "budget_steps": {"grpo": 20, "d3s": 40}}
    runs = [f"study/runs/{run}-seed{s}" for run in ("grpo", "d3s", "d3s-budget") for s in (0, 1)]
    assert trained == runs  # GRPO's budget runs are its fixed-step runs
    saved = json.loads((tmp_path / runs[-1] / "result.json").read_text())
    assert (saved["config"]["steps"], saved["config"]["eval_every"]) == (40, 10)
    assert "in GRPO's budget of seconds, 2 runs at their own step counts: 0 finished before" \
        in printed
    fixed, budget = tables(printed)
    assert fixed["d3s"][8] == "not reached [never, never]"  # in 20 steps D3S never gets there
    # GRPO's curve reaches its final .5 at its last evaluation, 40 s. D3S's seed-mean curve
    # (.2 .35 .45 .55 .65 at 0 10 20 30 40 s) reaches .5 at 30 s: 40 / 30 = 1.33x. Resampled: seed
    # 0 alone reaches at 20 s (2x, 1/4 of the resamples), seed 1 alone and both at 30 s
    divisor = DIVISOR or "-"
    assert "In GRPO's budget: 20 steps x 2.00 s = 40.0 s of generation + update per run" in printed
    assert budget["grpo"] == ["grpo", "0.0001", "1", divisor, "20", "2.00", "40.0", "50.0 ± 0.0",
                              "+0.0 ± 0.0", "40.0", "1.00x [1.00, 1.00]", "2/2"]
    # finals .6 .7: sd .0707, t(0.975, 1) 12.706: ± 63.5; paired to GRPO's .5 .5: +.1 +.2
    assert budget["d3s"] == ["d3s", "0.0001", "1", divisor, "40", "1.00", "40.0", "65.0 ± 63.5",
                             "+15.0 ± 63.5", "30.0", "1.33x [1.33, 2.00]", "2/2"]
    res = json.loads((tmp_path / "study" / "results.json").read_text())
    row = res["budget"]["table"][1]
    assert (row["sooner"], row["sooner_ci"], row["sooner_reached"]) == (1.33, [1.33, 2.0], 1.0)
    assert (row["s_to_grpo"], row["seconds"]) == ([15.0, 15.0], 40.0)
    assert [r["out_dir"] for r in res["budget"]["runs"]] == runs[-2:]
    # how the runs ran: one at a time, one thread, for this command and for each run
    assert (res["jobs"], res["threads"]) == (1, 1)
    assert all((r["jobs"], r["threads"]) == (1, 1) for r in res["runs"] + res["budget"]["runs"])
    assert "6 runs in " in printed and "1 at a time with 1 torch thread(s) each" in printed

    # the same command again: every run reused, the same tables
    again = main(BUDGET, capsys)
    assert trained == runs and tables(again) == (fixed, budget)
    # a fixed-step run timed again differently does not move the plan: budget.json is read
    before = (tmp_path / "study" / "budget.json").read_text()
    (tmp_path / runs[3] / "result.json").unlink()
    seconds["d3s"] = 0.25
    main(BUDGET, capsys)
    assert trained == runs + runs[3:4]
    assert (tmp_path / "study" / "budget.json").read_text() == before
    # a method added later is timed against the GRPO seconds the plan holds: 20 * 2 / 0.5 = 80
    more = main(BUDGET[:1] + ["grpo,d3s,d2s"] + BUDGET[2:], capsys)
    plan = json.loads((tmp_path / "study" / "budget.json").read_text())
    assert plan["budget_steps"] == {"grpo": 20, "d3s": 40, "d2s": 80}
    assert trained[-4:] == [f"study/runs/{run}-seed{s}" for run in ("d2s", "d2s-budget")
                            for s in (0, 1)]
    assert tables(more)[1]["d2s"][4:7] == ["80", "0.50", "40.0"]
    assert tables(more)[1]["d2s"][9:11] == ["not reached", "never [never, never]"]


def test_the_figure_has_accuracy_against_seconds(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "load_model", lambda name: None)
    monkeypatch.setattr(bench, "_init_worker", lambda threads: None)
    monkeypatch.setattr(train, "train", fake_train(BUDGET_ACCS, {"grpo": 2.0, "d3s": 1.0}, []))
    main(BUDGET, capsys)
    res = json.loads((tmp_path / "study" / "results.json").read_text())
    fig = bench.figure(res["curves"], res["budget"]["curves"])
    seconds = fig.axes[2]
    plt.close(fig)
    assert seconds.get_xlabel() == "seconds of generation + update (t_gen + t_upd), seed mean"
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()), ln.get_linestyle())
             for ln in seconds.get_lines()}
    assert lines["grpo lr 0.0001 K 1"][:2] == ([0.0, 20.0, 40.0], [0.2, 0.4, 0.5])
    assert lines["d3s lr 0.0001 K 1"][:2] == ([0.0, 10.0, 20.0], pytest.approx([0.2, 0.3, 0.4]))
    assert "grpo lr 0.0001 K 1, in GRPO's seconds" not in lines  # its own runs: drawn once
    budget = lines["d3s lr 0.0001 K 1, in GRPO's seconds"]
    assert budget[0] == [0.0, 10.0, 20.0, 30.0, 40.0] and budget[2] == "--"
    assert budget[1] == pytest.approx([0.2, 0.35, 0.45, 0.55, 0.65])
    assert (tmp_path / "study" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_mini_batch_size_shows_the_updates_made_per_step():
    def run(method, updates, minibatch):
        return {"method": method, "lr": 1e-4, "updates_per_batch": 4, "seed": 0, "wall": 1.0,
                "error": None, "divisor": "valid", "minibatch_size": minibatch,
                "history": [{"step": 0, "tokens": 0, "accuracy": 0.2},
                            {"step": 4, "tokens": 400, "accuracy": 0.4}],
                "steps": fake_steps(4, kept=8, tokens=100, t_gen=1.0, t_upd=0.5,
                                    updates=lambda i: updates[i])}
    rows, curves = bench.aggregate([run("grpo", [4, 4, 4, 3], 0), run("d3s", [1, 2, 2, 3], 8)],
                                   [("grpo", 1e-4, 4), ("d3s", 1e-4, 4)])
    cells = table_rows(bench.format_table(rows))
    # K fixed: K; a mini-batch size M: the updates made, mean over the steps
    assert cells["grpo"][2:4] == ["4", "valid"] and cells["d3s"][2:4] == ["M 8: 2.00", "valid"]
    assert list(curves) == ["grpo lr 0.0001 K 4", "d3s lr 0.0001 M 8"]
    assert rows[0]["updates"] == 3.75


# -----------------------------------------------------------------------------
# finished runs: reused, and never for another config


def test_changed_config_is_refused_not_reused(no_training, capsys):
    fake_folders(STUDY, ACCS, PER_STEP, no_training)
    with pytest.raises(SystemExit) as e:
        bench.main(STUDY[:5] + ["30"] + STUDY[6:])  # --steps 30
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "study/runs/grpo-seed0 holds a finished run with another config" in err[0]
    assert "steps 20 there, 30 now" in err[0]
    assert not (no_training / "study" / "results.json").exists()


def test_only_unfinished_runs_are_run(no_training, monkeypatch, capsys):
    fake_folders(STUDY, ACCS, PER_STEP, no_training)
    # failed or interrupted: no result.json
    (no_training / "study" / "runs" / "d3s-seed1" / "result.json").unlink()
    ran = []

    def run_one(cfg, context):
        ran.append(cfg.out_dir)
        accs = ACCS[("d3s", cfg.lr, 1, 1)]
        history = [{"step": 10 * i, "tokens": 1000 * i, "accuracy": a} for i, a in enumerate(accs)]
        return dict(bench.blank_result(cfg, context), history=history, steps=PER_STEP["d3s"](1),
                    wall=10.0)
    monkeypatch.setattr(bench, "run_one", run_one)
    # no tiny model to build for a fake run
    monkeypatch.setattr(bench, "load_model", lambda name: None)
    # leave this process's torch threads alone
    monkeypatch.setattr(bench, "_init_worker", lambda threads: None)
    printed = main(STUDY, capsys)
    assert ran == ["study/runs/d3s-seed1"]
    assert "9 runs: 8 finished before (reused), 1 to run" in printed
    results = json.loads((no_training / "study" / "results.json").read_text())
    assert results["table"][1]["final"] == [73.3, 37.9]

# -----------------------------------------------------------------------------
# learning rates: per method, a tuning grid, its lrs.json


def test_lr_per_method_and_from_a_tuned_file(tmp_path):
    def settings(*flags):
        args = ["--methods", "grpo,d3s", "--seeds", "1", "--out", str(tmp_path), *flags]
        _, cfgs = bench.configs(bench.parse_args(args))
        return {c.method: (c.lr, c.updates_per_batch) for c in cfgs}
    # train.py's defaults for the tiny world
    assert settings() == {"grpo": (5e-5, 4), "d3s": (5e-5, 4)}
    assert settings("--lr", "3e-4") == {"grpo": (3e-4, 4), "d3s": (3e-4, 4)}
    per_method = settings("--lr", "grpo=5e-5,d3s=2e-4", "--updates_per_batch", "2")
    assert per_method == {"grpo": (5e-5, 2), "d3s": (2e-4, 2)}
    tuned = {"lr": {"grpo": 2e-4, "d3s": 5e-5, "pods": 1.0},
             "updates_per_batch": {"grpo": 1, "d3s": 4, "pods": 1}}
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    from_file = settings("--tuned", str(tmp_path / "tuned.json"))
    assert from_file == {"grpo": (2e-4, 1), "d3s": (5e-5, 4)}


def test_tuning_mode_chooses_each_methods_lr_by_auc(no_training, capsys):
    tune = ["--methods", "grpo,d3s", "--lr_grid", "2e-4,1e-4", "--seeds", "2",
            "--seed_start", "100", "--steps", "20", "--eval_every", "10", "--out", "tune",
            "--updates_per_batch", "1"]
    # mean AUC: grpo 1e-4 (.2+.5)/4 + (.5+.5)/4 = .425 vs 2e-4 .4 ; d3s tie .4 = .4: the smaller lr
    accs = {
        ("grpo", 1e-4, 1, 100): [0.2, 0.5, 0.5], ("grpo", 1e-4, 1, 101): [0.2, 0.5, 0.5],
        # better final, lower AUC
        ("grpo", 2e-4, 1, 100): [0.2, 0.3, 0.8], ("grpo", 2e-4, 1, 101): [0.2, 0.4, 0.6],
        ("d3s", 1e-4, 1, 100): [0.2, 0.4, 0.6], ("d3s", 1e-4, 1, 101): [0.2, 0.4, 0.6],
        ("d3s", 2e-4, 1, 100): [0.2, 0.5, 0.4], ("d3s", 2e-4, 1, 101): [0.2, 0.3, 0.8],
    }
    cfgs = fake_folders(tune, accs, PER_STEP, no_training)
    assert sorted(c.out_dir for c in cfgs)[:2] == ["tune/runs/d3s-lr0.0001-seed100",
                                                   "tune/runs/d3s-lr0.0001-seed101"]
    printed = main(tune, capsys)
    chosen = json.loads((no_training / "tune" / "tuned.json").read_text())
    assert chosen["lr"] == {"grpo": 1e-4, "d3s": 1e-4}
    assert chosen["updates_per_batch"] == {"grpo": 1, "d3s": 1}
    assert chosen["auc"]["grpo lr 0.0002 K 1"] == [40.0, 0.0]
    assert chosen["auc"]["grpo lr 0.0001 K 1"] == [42.5, 0.0]
    assert "chosen (highest mean AUC): grpo lr 0.0001 K 1, d3s lr 0.0001 K 1" in printed
    rows = table_rows(printed)  # two grpo rows: no comparison to GRPO in tuning
    assert len(rows) == 4 and all(r[5] == "-" and r[8] == "-" for r in rows.values())
    # the study reads the file: seeds 0.. with the chosen rates
    _, cfgs = bench.configs(bench.parse_args(["--methods", "grpo,d3s", "--tuned", "tune/tuned.json",
                                              "--seeds", "8"]))
    assert {(c.method, c.lr) for c in cfgs} == {("grpo", 1e-4), ("d3s", 1e-4)}
    assert [c.seed for c in cfgs[:8]] == list(range(8))


def test_tuning_k_and_lr_together(no_training, capsys):
    tune = ["--methods", "grpo,d3s", "--lr_grid", "1e-4,5e-5", "--updates_grid", "4,2",
            "--seeds", "1", "--seed_start", "100", "--steps", "20", "--eval_every", "10",
            "--out", "tune-k"]
    flat, good = [0.2, 0.4, 0.4], [0.2, 0.6, 0.6]  # AUC .35 and .5
    accs = {(m, lr, k, 100): flat for m in ("grpo", "d3s") for lr in (5e-5, 1e-4) for k in (2, 4)}
    accs[("grpo", 5e-5, 4, 100)] = good                               # grpo: the one best pair
    accs[("d3s", 1e-4, 4, 100)] = accs[("d3s", 5e-5, 4, 100)] = good  # d3s: a tie at K 4, small lr
    cfgs = fake_folders(tune, accs, PER_STEP, no_training)
    assert [c.out_dir for c in cfgs[:4]] == [f"tune-k/runs/grpo-lr{lr}-K{k}-seed100"
                                             for k in (2, 4) for lr in ("5e-05", "0.0001")]
    assert [c.updates_per_batch for c in cfgs[:4]] == [2, 2, 4, 4]
    main(tune, capsys)
    chosen = json.loads((no_training / "tune-k" / "tuned.json").read_text())
    assert chosen["lr"] == {"grpo": 5e-5, "d3s": 5e-5}
    assert chosen["updates_per_batch"] == {"grpo": 4, "d3s": 4}
    _, cfgs = bench.configs(bench.parse_args(["--methods", "d3s,grpo", "--tuned",
                                              "tune-k/tuned.json", "--seeds", "1"]))
    assert [(c.method, c.lr, c.updates_per_batch, c.out_dir) for c in cfgs] == [
        ("d3s", 5e-5, 4, "out/bench/runs/d3s-seed0"),
        ("grpo", 5e-5, 4, "out/bench/runs/grpo-seed0")]


# -----------------------------------------------------------------------------
# what reaches train.Config


# the random controls as train.py names them: D3S's twin (rollouts, then tokens, drawn uniformly,
# on D3S's schedule) and D1S-cross's (rollouts only)
TWINS = {"d3s-random": ("d3s", dict(sample="random", token="random", schedule="linear")),
         "d3s-random-nonzero": ("d3s", dict(sample="random-nonzero", token="random",
                                            schedule="linear")),
         "d1s-cross-random": ("d1s-cross",
                              dict(sample="random", token="none", schedule="constant"))}


@pytest.fixture
def twins(monkeypatch):
    """d3s.METHODS with the random controls (as they are, or as they will be)."""
    for name, (_, spec) in TWINS.items():
        monkeypatch.setitem(bench.d3s.METHODS, name, bench.d3s.METHODS.get(name, spec))


def test_schedule_knobs_reach_only_the_methods_that_read_them(tmp_path, twins):
    knobs = {"grpo": [], "pods": ["s_init"], "d1s": ["s_init"], "d1s-cross": ["s_init"],
             "d2s": ["s_init", "t_init"], "d3s": ["s_init", "s_final", "t_init", "t_final"],
             "d3s-i": ["s_init", "s_final", "t_init", "t_final"],
             "entropy": [],  # entropy keeps its fixed t_keep 0.2
             "grpo-filter": [],  # every rollout with A != 0: no ratio
             "d3s-entropy": ["s_init", "s_final", "t_init", "t_final"]}
    # a random mode reads its ratio like the mode it stands in for
    knobs.update({name: knobs[twin] for name, (twin, _) in TWINS.items()})
    assert {m: bench.schedule_knobs(m) for m in bench.d3s.METHODS} == knobs


def test_any_schedule_but_the_constant_one_reads_the_final_ratios(monkeypatch):
    """Whether a method has a schedule comes from d3s (not a test for "linear"): a schedule added
    to d3s.py, say "cosine", reads *_final like the linear one; "constant" reads *_init only."""
    spec = dict(sample="cross", token="adv_entropy")
    monkeypatch.setitem(bench.d3s.METHODS, "d3s-cosine", dict(spec, schedule="cosine"))
    monkeypatch.setitem(bench.d3s.METHODS, "d3s-flat", dict(spec, schedule="constant"))
    assert bench.schedule_knobs("d3s-cosine") == ["s_init", "s_final", "t_init", "t_final"]
    assert bench.schedule_knobs("d3s-flat") == ["s_init", "t_init"]


def test_all_methods_get_the_ratios_they_read(tmp_path):
    _, cfgs = bench.configs(bench.parse_args(["--methods", "all", "--seeds", "1", "--out",
                                              str(tmp_path), "--s_init", "0.5", "--s_final", "0.9",
                                              "--t_init", "0.3", "--t_final", "0.8"]))
    assert [c.method for c in cfgs] == list(bench.d3s.METHODS)  # all: every named method
    # no error: train.py refuses a ratio a method would ignore. config.json records what each
    # applies: 1 where it keeps everything, entropy's fixed 0.2, init = final without a schedule
    got = {c.method: (c.s_init, c.s_final, c.t_init, c.t_final) for c in cfgs}
    assert got["grpo"] == (1.0, 1.0, 1.0, 1.0) and got["entropy"] == (1.0, 1.0, 0.2, 0.2)
    assert got["pods"] == got["d1s"] == got["d1s-cross"] == (0.5, 0.5, 1.0, 1.0)
    assert got["d2s"] == (0.5, 0.5, 0.3, 0.3) and got["d3s"] == got["d3s-i"] == (0.5, 0.9, 0.3, 0.8)
    for name, (twin, _) in TWINS.items():  # once train.py has them: the ratios of their twins
        assert got.get(name, got[twin]) == got[twin], name


def test_help_lists_every_named_method(twins, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    text = "".join(capsys.readouterr().out.split())  # as wrapped: at spaces or after a hyphen
    assert e.value.code == 0 and f"orall:{','.join(bench.d3s.METHODS)}" in text
    assert "d3s-random" in text and "d1s-cross-random" in text and "--budget{steps,seconds}" in text


def test_pass_through_and_the_whole_test_split(tmp_path):
    _, cfgs = bench.configs(bench.parse_args(["--methods", "grpo", "--seeds", "2", "--seed_start",
                                              "100", "--out", str(tmp_path), "--eval_size", "all",
                                              "--eval_every", "10", "--loss", "gspo",
                                              "--updates_per_batch", "1", "--optimizer", "sgd",
                                              "--max_new_tokens", "40", "--micro_batch_size", "7",
                                              "--grad_clip", "0", "--generation", "hf"]))
    assert [c.seed for c in cfgs] == [100, 101]
    c = cfgs[0]
    assert (c.eval_size, c.eval_every) == (1036, 10)  # the tiny world's whole test split
    knobs = (c.loss, c.updates_per_batch, c.optimizer, c.max_new_tokens, c.micro_batch_size)
    assert knobs == ("gspo", 1, "sgd", 40, 7)
    assert c.grad_clip == 0.0  # off: the gradient norm D3S raises reaches SGD's step unclipped
    assert c.generation == "hf"  # the engine: study.md compares the two
    assert c.save_every == 0 and c.out_dir == str(tmp_path / "runs" / "grpo-seed100")
    assert bench.train_command(c).startswith("python train.py --method grpo --loss gspo ")


def test_the_divisor_and_the_mini_batch_size_pass_through_where_train_has_them(tmp_path):
    for knob, flags, value in (("divisor", ["--divisor", "seq"], "seq"),
                               ("minibatch_size", ["--minibatch_size", "8"], 8)):
        assert (knob in bench.PASS_THROUGH) == hasattr(train.Config, knob)
        if knob in bench.PASS_THROUGH:  # train.py has it: the flag reaches train.Config
            _, cfgs = bench.configs(bench.parse_args(["--methods", "d3s", "--seeds", "1",
                                                      "--out", str(tmp_path), *flags]))
            assert getattr(cfgs[0], knob) == value and bench.blank_result(cfgs[0])[knob] == value

# -----------------------------------------------------------------------------
# a real 2-step run of grpo and d3s through train.train


ARGS = ["--methods", "grpo,d3s", "--seeds", "1", "--steps", "2", "--eval_every", "1", "--eval_size",
        "16", "--prompts_per_step", "2", "--group_size", "4", "--threads", "1", "--out", "bench",
        "--lr", "grpo=1e-4,d3s=2e-4", "--max_new_tokens", "30", "--micro_batch_size", "3",
        "--s_init", "0.5", "--t_final", "0.7"]


@pytest.fixture(scope="module")
def benched(tiny_dir, tmp_path_factory):
    """Run bench once (in this process, one thread) in a temporary folder; return its outputs."""
    tmp = tmp_path_factory.mktemp("bench")
    shutil.copytree(tiny_dir, tmp / "tiny")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench.main(ARGS + ["--model", str(tmp / "tiny")])
    torch.set_num_threads(threads)
    res = json.loads((tmp / "bench" / "results.json").read_text())
    return tmp, out.getvalue(), res


def test_real_runs_table_matches_the_runs_logs(benched):
    tmp, printed, res = benched
    out_dir = tmp / "bench"
    rows = table_rows(printed)
    assert list(rows) == ["grpo", "d3s"]
    table = {r["method"]: r for r in res["table"]}
    logs, accs = {}, {}
    for m, lr in (("grpo", 1e-4), ("d3s", 2e-4)):
        run = out_dir / "runs" / f"{m}-seed0"
        logs[m] = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        ran = json.loads((run / "config.json").read_text())
        knobs = (ran["method"], ran["lr"], ran["max_new_tokens"], ran["micro_batch_size"])
        assert knobs == (m, lr, 30, 3)
        # what a repeat compares with: config.json's knobs
        assert json.loads((run / "result.json").read_text())["config"] == {
            k: v for k, v in ran.items() if k not in checkpoint.RECORDED}
        # train.py's own printed evaluations, independent of the returned history
        accs[m] = [float(a) for a in re.findall(r"held-out accuracy (\d\.\d+) \(",
                                                (run / "train.log").read_text())]
        assert len(logs[m]) == 2 and len(accs[m]) == 3  # steps 0, 1; evaluations at 0, 1, 2
        assert not (run / "checkpoint").exists()
    # the ratio knobs reached d3s only (train.py would refuse them for grpo, which keeps everything)
    ran_cfgs = {m: json.loads((out_dir / "runs" / f"{m}-seed0" / "config.json").read_text())
                for m in ("grpo", "d3s")}
    grpo_cfg, d3s_cfg = ran_cfgs["grpo"], ran_cfgs["d3s"]
    assert (grpo_cfg["s_init"], grpo_cfg["t_final"]) == (1.0, 1.0)
    assert (d3s_cfg["s_init"], d3s_cfg["t_final"]) == (0.5, 0.7)
    for m, cells in rows.items():
        t, log = table[m], logs[m]
        assert cells[3] == (DIVISOR and ran_cfgs[m]["divisor"] or "-")  # where train.py has it
        assert cells[4] == f"{t['final'][0]:.1f}"
        assert t["final"] == [round(100 * accs[m][-1], 1), None]
        assert t["rollouts"] == sum(r["kept"] for r in log)
        assert t["tokens"] == sum(r["tokens"] for r in log) == log[-1]["tokens_trained"]
        assert t["t_gen"] == round(sum(r["t_gen"] for r in log) / 2, 2)
        assert cells[-1] == "1/1"
        run = next(r for r in res["runs"] if r["method"] == m)
        # printed with 3 decimals: 0.1875 is "0.188", exactly 5e-4 away
        assert [h["accuracy"] for h in run["history"]] == pytest.approx(accs[m], abs=5e-4 + 1e-9)
        # its train.py command line is this very run
        cfg, given = config.parse_args(train.Config, run["command"].split()[2:])
        saved = json.loads((out_dir / "runs" / f"{m}-seed0" / "config.json").read_text())
        assert saved.pop("method_spec") == bench.d3s.METHODS[m]  # beside the knobs: the method
        # and the config block's values the run took: none, bench gives train.train every knob
        assert saved.pop("picked") == {}
        assert bench.as_json(config.resolve(cfg, given)) == saved
    # by hand: grpo trains all 2*4 rollouts a step; d3s keeps round(rho_s * 8) with rho_s 0.5 ->
    # 0.75, and round(0.7 * valid) tokens at the last step (t_final 0.7)
    assert table["grpo"]["rollouts"] == 16 and table["d3s"]["rollouts"] == 4 + 6
    assert table["d3s"]["rollouts_pct"] == 62.5
    assert logs["d3s"][1]["tokens"] == bench.d3s.num_keep(0.7, logs["d3s"][1]["valid"])
    assert (out_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeating_the_command_reuses_the_runs(benched, monkeypatch, capsys):
    tmp, printed, res = benched
    monkeypatch.chdir(tmp)
    monkeypatch.setattr(train, "train",
                        lambda *a, **k: pytest.fail("a finished run was trained again"))
    again = main(ARGS + ["--model", str(tmp / "tiny")], capsys)
    assert "2 runs: 2 finished before (reused), 0 to run" in again
    assert table_rows(again) == table_rows(printed)
    assert json.loads((tmp / "bench" / "results.json").read_text())["runs"] == res["runs"]


def test_an_unfinished_run_is_run_again_in_its_folder(benched, tmp_path, monkeypatch, capsys):
    # a run interrupted after some steps leaves its log.jsonl and no result.json; train.py refuses
    # such a folder unless overwrite is true, so bench passes it and the run starts again at step 0
    tmp, printed, res = benched
    shutil.copytree(tmp / "bench", tmp_path / "bench")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "bench" / "runs" / "d3s-seed0"
    (run / "result.json").unlink()
    (run / "log.jsonl").write_text('{"step": 0}\n')  # a torn log of the interrupted run
    again = main(ARGS + ["--model", str(tmp / "tiny")], capsys)
    assert "2 runs: 1 finished before (reused), 1 to run" in again and "FAILED" not in again
    assert json.loads((run / "result.json").read_text())["config"]["overwrite"] is True
    # steps 0 and 1 of the new run only
    assert len((run / "log.jsonl").read_text().splitlines()) == 2
    # the same run, the same numbers
    assert table_rows(again)["d3s"][3:9] == table_rows(printed)["d3s"][3:9]

# -----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("flags, word", [
    (["--methods", "grpo,nope"], "nope"), (["--seeds", "0"], "--seeds"),
    (["--steps", "0"], "--steps"), (["--lr", "-1"], "--lr"),
    (["--s_init", "2", "--methods", "d3s"], "--s_init"),
    (["--lr", "grpo=1e-4"], "no learning rate for d3s"),
    (["--lr", "grpo=x,d3s=1"], "'x' is not a number"), (["--tuned", "nofile.json"], "no such file"),
    (["--lr", "1e-4", "--lr_grid", "1e-4,2e-4"], "give one of the three"),
    (["--lr", "grpo=1e-4,d3s"], "method=lr pairs"),
    (["--updates_grid", "2,x"], "'x' is not a number"),
    (["--optimizer", "adam"], "--optimizer"), (["--eval_size", "0"], "--eval_size"),
    (["--budget", "seconds", "--methods", "d3s,d2s"], "add grpo to --methods"),
    (["--budget", "seconds", "--lr_grid", "1e-4,2e-4"], "tune first"),
])
def test_bad_input_is_one_line_and_exit_2(flags, word, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and word in err[0]
    assert not (tmp_path / "out").exists()  # nothing was built or written


def test_paired_compares_a_mini_batch_size_with_a_fixed_k(tmp_path, capsys):
    from experiments import paired

    def study(name, minibatch, updates, finals):
        runs = []
        for seed, final in enumerate(finals):
            out_dir = tmp_path / name / "runs" / f"d3s-seed{seed}"
            out_dir.mkdir(parents=True)
            rows = [dict(s, clip_frac=0.1, ratio_min=0.9, ratio_max=1.1)
                    for s in fake_steps(2, kept=8, tokens=100, t_gen=1.0, t_upd=0.5,
                                        updates=lambda i: updates[seed][i])]
            (out_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs.append({"method": "d3s", "seed": seed, "lr": 5e-5, "updates_per_batch": 4,
                         "minibatch_size": minibatch, "out_dir": str(out_dir), "error": None,
                         "history": [{"step": 0, "accuracy": 0.2}, {"step": 2, "accuracy": final}]})
        (tmp_path / name / "results.json").write_text(json.dumps({"runs": runs}))
        return str(tmp_path / name)
    k4 = study("k4", 0, [[4, 4], [4, 3]], [0.5, 0.6])
    m8 = study("m8", 8, [[1, 2], [2, 3]], [0.6, 0.6])  # 2 updates a step on the mean
    paired.main(k4, m8)
    row = table_rows(capsys.readouterr().out)["d3s"]
    # final .6 - .5, .6 - .6; AUC (.2 + .6) / 2 - (.2 + .5) / 2 = .05, 0
    assert row[1:5] == ["2", "K 4, 5e-05", "M 8 (2.00/step), 5e-05", "+5.0 ± 63.5"]
    assert row[5:] == ["+2.5 ± 31.8", "1/2", "0.100, 0.90-1.10", "0.100, 0.90-1.10"]


def test_paired_compares_a_method_with_its_random_twin_in_one_study(tmp_path, capsys):
    from experiments import paired
    runs = []
    for method, finals in (("d3s", [0.6, 0.7, 0.5]), ("d3s-random", [0.4, 0.6, 0.5])):
        for seed, final in enumerate(finals):
            out_dir = tmp_path / "runs" / f"{method}-seed{seed}"
            out_dir.mkdir(parents=True)
            rows = fake_steps(2, kept=8, tokens=100, t_gen=1.0, t_upd=0.5, updates=lambda i: 4)
            (out_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs.append({"method": method, "seed": seed, "lr": 5e-5, "updates_per_batch": 4,
                         "out_dir": str(out_dir), "error": None,
                         "history": [{"step": 0, "accuracy": 0.2}, {"step": 2, "accuracy": final}]})
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    paired.main(f"{tmp_path}:d3s-random", f"{tmp_path}:d3s")
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("| d3s - "))
    row = [c.strip() for c in line.strip("|").split("|")]
    assert row[0] == "d3s - d3s-random"
    # finals .6 - .4, .7 - .6, .5 - .5: mean .1, sd .1, t(0.975, 2) 4.303: ± 24.8; AUC halves them
    assert row[1:] == ["3", "K 4, 5e-05", "K 4, 5e-05", "+10.0 ± 24.8", "+5.0 ± 12.4", "2/3",
                       "0.000, 1.00-1.00", "0.000, 1.00-1.00"]
    with pytest.raises(SystemExit, match="on both sides"):
        paired.main(f"{tmp_path}:d3s-random", str(tmp_path))
    with pytest.raises(SystemExit, match="no results.json"):
        paired.main(str(tmp_path / "runs"), str(tmp_path))


def test_paired_with_one_seed_prints_the_difference_and_says_it_has_no_interval(tmp_path, capsys):
    from experiments import paired
    runs = []
    for method, final in (("d3s", 0.6), ("d3s-random", 0.45)):
        out_dir = tmp_path / "runs" / f"{method}-seed0"
        out_dir.mkdir(parents=True)
        rows = fake_steps(2, kept=8, tokens=100, t_gen=1.0, t_upd=0.5, updates=lambda i: 4)
        (out_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append({"method": method, "seed": 0, "lr": 5e-5, "updates_per_batch": 4,
                     "out_dir": str(out_dir), "error": None,
                     "history": [{"step": 0, "accuracy": 0.2}, {"step": 2, "accuracy": final}]})
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    paired.main(f"{tmp_path}:d3s-random", f"{tmp_path}:d3s")
    out = capsys.readouterr().out.splitlines()
    line = next(s for s in out if s.startswith("| d3s - "))
    row = [c.strip() for c in line.strip("|").split("|")]
    # final .6 - .45 = +15.0 points; AUC (.2 + .6) / 2 - (.2 + .45) / 2 = +7.5; no "±"
    assert row[:7] == ["d3s - d3s-random", "1", "K 4, 5e-05", "K 4, 5e-05", "+15.0", "+7.5", "1/1"]
    assert out[-1] == ("d3s - d3s-random: one seed, so its differences have no interval (a 95% "
                       "interval needs two or more seeds)")


def test_paired_and_study_sh_print_their_usage():
    # what the docs print: --help exits 0 with the usage on stdout; no argument is an error
    root = Path(bench.__file__).resolve().parents[1]
    paired = [sys.executable, "experiments/paired.py"], "usage: python experiments/paired.py", 1
    study = ["bash", "experiments/study.sh"], "usage: bash experiments/study.sh", 2
    for command, usage, code in (paired, study):
        ok = subprocess.run(command + ["--help"], cwd=root, capture_output=True, text=True)
        assert ok.returncode == 0 and ok.stdout.startswith(usage)
        bad = subprocess.run(command, cwd=root, capture_output=True, text=True)
        assert bad.returncode == code and bad.stderr.startswith("usage: ") and not bad.stdout


def test_a_budget_at_a_generation_share_scales_generation_only(tmp_path):
    """--budget seconds --share 0.8: GRPO's step is 1 s generating + 3 s updating, D3S's 1 + 1. As
    measured, D3S's 2 s a step buy it 20 * 4 / 2 = 40 steps of GRPO's 20. Where generation is 0.8 of
    GRPO's step, generation scales by a = 0.8 * 3 / (0.2 * 1) = 12: GRPO's step 15 s, D3S's 13 s,
    round(20 * 15 / 13) = 23 steps: a cheaper update buys little where generation dominates."""
    ok = {"grpo": [{"steps": fake_steps(20, 128, 100, 1.0, 3.0)}],
          "d3s": [{"steps": fake_steps(20, 64, 20, 1.0, 1.0)}]}
    plan = bench.budget_plan(str(tmp_path / "budget.json"), 20, ok, "cmd")
    assert plan["budget_steps"] == {"grpo": 20, "d3s": 40} and "share" not in plan
    shared = bench.budget_plan(str(tmp_path / "budget-share0.8.json"), 20, ok, "cmd", share=0.8)
    assert shared["budget_steps"] == {"grpo": 20, "d3s": 23} and shared["share"] == 0.8
    assert shared["seconds_per_step"] == {"grpo": 15.0, "d3s": 13.0}
    args = bench.parse_args(["--share", "0.8", "--out", str(tmp_path)])
    assert bench.share_suffix(args) == "-share0.8"
    with pytest.raises(ValueError, match=r"--share 0.8 needs --budget seconds"):
        bench.configs(args)
