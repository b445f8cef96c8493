"""experiments/budget.py: a step's cost on a device, the steps a budget affords, the step a run
crosses it at and the paired accuracy there, by hand."""
import json

import pytest

import d3s
from experiments import budget

SCHEDULE = {"s_init": 0.25, "s_final": 0.75, "t_init": 0.2, "t_final": 0.6}  # train.py's


def test_crossing_counts_the_step_it_falls_in_in_proportion():
    costs = [1.0, 0.5, 0.5, 1.0]  # cumulative 1, 1.5, 2, 3
    assert budget.crossing(costs, 1.75) == pytest.approx(2.5)
    assert budget.crossing(costs, 1.0) == pytest.approx(1.0)
    assert budget.crossing(costs, 3.0) == pytest.approx(4.0) and budget.crossing(costs, 0) == 0.0
    assert budget.crossing(costs, 3.5) is None  # the run ends first
    assert list(budget.step_costs(0.6, [1.0, 0.5, 0.0])) == pytest.approx([1.0, 0.8, 0.6])


def test_affordable_solves_for_the_runs_own_schedule():
    """f = 0.5, the ratio 0.2 at the first step to 0.6 at the last (a run of n >= 2 steps averages
    0.4): C(n) = 0.7 n, so 4 GRPO steps afford 5.71; a 1-step run is all at 0.2 (0.6)."""
    ratios_of = lambda n: [0.2 + 0.4 * i / (n - 1) if n > 1 else 0.2 for i in range(n)]  # noqa
    assert budget.affordable(4, 0.5, ratios_of) == pytest.approx(4 / 0.7)
    assert budget.affordable(0.3, 0.5, ratios_of) == pytest.approx(0.5)
    assert budget.affordable(6, 0.5, lambda n: [1.0] * n) == pytest.approx(6.0)  # GRPO itself
    with pytest.raises(ValueError, match="a step priced at 0"):
        budget.affordable(5, 0.0, lambda n: [0.0] * n, limit=100)


def test_ratios_follow_train_pys_schedule():
    config = dict(SCHEDULE, method="d3s")
    rhos = budget.schedule(config, 5)
    assert rhos == [d3s.keep_ratios(i, 5, "linear", 0.25, 0.75, 0.2, 0.6)[0] for i in range(5)]
    dev = budget.devices("dev:share=0.5,d3s@0.25=0.2,d3s@0.75=0.6,d2s=0.3")[0]
    assert budget.device_ratios(dev, "d3s", config, 5) == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6])
    assert budget.device_ratios(dev, "grpo", config, 3) == [1.0] * 3
    assert budget.device_ratios(dev, "d2s", {}, 2) == [0.3, 0.3]  # one number: no schedule read
    assert budget.device_ratios(dev, "pods", config, 2) is None
    assert budget.ratio_at([[0.75, 0.6], [0.25, 0.2]], 0.1) == 0.2  # the nearest one's outside
    with pytest.raises(ValueError, match="lacks s_init"):
        budget.device_ratios(dev, "d3s", {"method": "d3s"}, 2)
    with pytest.raises(ValueError, match="d3s has a mean ratio and ratios by rho_s"):
        budget.devices("dev:share=0.5,d3s=0.3,d3s@0.25=0.2")
    with pytest.raises(ValueError, match="'d3s' is not KEY=VALUE"):
        budget.devices("dev:share=0.5,d3s")


def run(folder, method, seed, accs, every, t_gen, t_upd, tokens=0):
    """A finished bench run: held-out accuracy every `every` steps, constant seconds a step."""
    n = every * (len(accs) - 1)
    result = {"method": method, "seed": seed, "error": None,
              "history": [{"step": every * i, "accuracy": a} for i, a in enumerate(accs)],
              "steps": [{"step": i, "t_gen": t_gen, "t_upd": t_upd, "fwd_bwd_tokens": tokens}
                        for i in range(n)]}
    out = folder / "runs" / f"{method}-{n}-seed{seed}"
    out.mkdir(parents=True)
    config = dict(SCHEDULE, steps=n, method=method)
    (out / "result.json").write_text(json.dumps({"config": config, "result": result}))


def study(tmp_path):
    """GRPO: 4 steps of 1 s generating + 3 s updating (f0 = 0.25), 0.2, 0.4, 0.6 at steps 0, 2, 4.
    d3s: 8-step runs updating in 1 s (1/3 of GRPO's here), 0.2, 0.3, 0.4, 0.5, 0.7 at 0, 2 .. 8
    (seed 1: 0.1 higher from step 2), and 4-step runs."""
    for s in (0, 1):
        run(tmp_path, "grpo", s, [0.2, 0.4, 0.6], 2, 1.0, 3.0, tokens=300)
        run(tmp_path, "d3s", s, [0.2] + [a + 0.1 * s for a in (0.3, 0.4, 0.5, 0.7)], 2, 1.0, 1.0,
            tokens=100)
        run(tmp_path, "d3s", s, [0.2, 0.3, 0.4], 2, 1.0, 1.0, tokens=100)
    return budget.runs_of([tmp_path])


def test_read_pairs_the_accuracy_where_each_run_crosses_the_budget(tmp_path):
    """On a device with f = 0.5 and d3s's update 0.25 of GRPO's, a d3s step costs 0.625 GRPO
    steps: a budget of 2 is crossed at step 3.2, where seed 0 is at 0.3 + 0.6 * 0.1 = 0.36 and
    seed 1 at 0.46; GRPO at step 2 is at 0.4: -4 and +6 points. The 4-step runs (0.36 for both
    seeds) cost 2.5: they cross it too, at the same step; at a budget of 4 they end first. On this
    CPU (f0 = 0.25, d3s's update 1/3 of GRPO's: 0.5 a step) the budget of 2 is crossed at step 4,
    at 0.4 and 0.5."""
    runs = study(tmp_path)
    dev = budget.devices("dev:share=0.5,d3s=0.25")[0]
    f, rows = budget.read(runs, dev, 2)
    by = {(r["method"], r["steps"]): r for r in rows}
    assert f == 0.5 and by["d3s", 8]["step"] == pytest.approx(3.2)
    assert by["d3s", 8]["diffs"] == pytest.approx([-0.04, 0.06])
    assert by["d3s", 4]["diffs"] == pytest.approx([-0.04, -0.04])
    assert by["grpo", 4]["step"] == pytest.approx(2.0) and by["grpo", 4]["diffs"] == [0.0, 0.0]
    at_4 = {(r["method"], r["steps"]): r for r in budget.read(runs, dev, 4)[1]}
    assert at_4["d3s", 4]["step"] is None and at_4["d3s", 8]["step"] == pytest.approx(6.4)
    f, rows = budget.read(runs, budget.devices("cpu")[0], 2)
    d3s_8 = next(r for r in rows if r["method"] == "d3s" and r["steps"] == 8)
    assert f == pytest.approx(0.25) and d3s_8["step"] == pytest.approx(4.0)
    assert d3s_8["diffs"] == pytest.approx([0.0, 0.1])
    assert "this CPU's ratio (t_upd over GRPO's)" == d3s_8["priced_by"]
    # by tokens: d3s trains 100 tokens a step where GRPO trains 300, the same ratio here
    f, rows = budget.read(runs, budget.devices("cpu")[0], 2, cost="tokens")
    d3s_8 = next(r for r in rows if r["method"] == "d3s" and r["steps"] == 8)
    assert d3s_8["step"] == pytest.approx(4.0) and "fwd_bwd_tokens" in d3s_8["priced_by"]


def test_the_commands_print_what_the_lead_reads(tmp_path, capsys):
    """read: the t interval of -4 and +6 points is 1 +- 12.706 * 7.07 / sqrt(2) = 63.5. plan:
    the H200's GRPO 60 steps afford D3S 65.8 (half of them 32.9), GRPO itself 30 and 60."""
    study(tmp_path)
    assert budget.main(["read", str(tmp_path), "--device", "dev:share=0.5,d3s=0.25",
                        "--budgets", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "dev: generation 0.500 of GRPO's step (given on the command line); a budget of 2" in out
    assert "| d3s | 8 | dev's 0.25 | 3.2 | 41.0 | +1.0 ± 63.5 (n = 2) | 2/2 |" in out
    assert "| d3s | 4 | dev's 0.25 | ends before the budget | ends before the budget | ends " in out
    assert budget.main(["plan", "--device", "h200-hf", "--steps", "60"]) == 0
    out = capsys.readouterr().out
    assert "| grpo | GRPO's own (the unit) | 30.0 | 60.0 |" in out
    assert "| d3s | h200-hf's 0.348 at ρs 0.25, 1.15 at ρs 0.75 | 32.9 | 65.8 |" in out
    assert budget.main(["plan", "--device", "cpu", "--steps", "4", str(tmp_path)]) == 0
    assert "| d3s | this CPU's ratio (t_upd over GRPO's) | 4.0 | 8.0 |" in capsys.readouterr().out
    assert budget.main(["read", "--device", "h200-hf", "--steps", "60"]) == 2
    assert "read: pass the bench.py folders" in capsys.readouterr().err
    assert budget.main(["plan", "--device", "cpu", "--steps", "60"]) == 2
    assert "its share is measured in runs" in capsys.readouterr().err
