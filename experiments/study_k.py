"""
Section K of experiments/study.md, read from its runs: paired accuracy at equal seconds, each device
pricing its own steps, every comparison Holm-corrected; then per step, per token, and how much sooner
each method reaches a target fixed before the runs.

    python experiments/study_k.py --prices tiny=out/k/update-tiny.json,... --json out/study/k.json

(from the folder bench.py ran in: each run's log.jsonl is read from its out_dir).

For each world W, the runs are bench.py's folders out/study/cut-W (grpo and grpo-filter, 60 steps),
cut-W-d3s-cpu (d3s, the steps this CPU's prices planned) and cut-W-d3s-h200 (the H200's). This
CPU prices each step by its own counts, with its seconds timed on a quiet machine (--prices: a
world's `bench_update.py --json`): step 1's seconds on the world's batch, plus the update's, a + b
fwd_bwd_tokens + c nograd_tokens fitted by least squares to every configuration's median update
(a step with nothing to learn runs no pass); a step's cost is that over GRPO's mean step in the
world. The H200 prices a step as experiments/budget.py does, f + (1 - f) r in GRPO steps, with
budget.DEVICES["h200-hf"]: its generation share and D3S's update ratios at rho_s, measured before
the update was cut, and grpo-filter's 1 [a projection: it forwards exactly GRPO's rollouts now].

At each budget (half and all of GRPO's 60 steps) each run is read where its priced seconds cross it,
its accuracy interpolated between evaluations; a run that ends first is read at its end (and
counted). Contrasts d3s - grpo, grpo-filter - grpo, d3s - grpo-filter, paired by seed: the mean, its
95% t interval, a two-sided paired t-test's p, and Holm's correction over every comparison made.
The target accuracy of each world was fixed before the runs (TARGETS); "x sooner" is GRPO's priced
seconds to it over the method's, each from the seed-mean curve, with a 95% bootstrap interval over
seeds (BOOTSTRAP resamples, numpy seed 0; a resample that never gets there counts as 0). And where
this CPU's answer would flip (flip_share): the generation share of GRPO's step below which a method
is sooner, its update priced by this CPU's counts and generation's seconds scaled [a projection],
with an interval over the same resamples.
"""
import argparse
import json
import os
import sys

import mpmath
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget  # noqa: E402

TARGETS = {"tiny": 0.50, "tiny-fork": 0.85, "tiny-weak": 0.35}  # fixed before the runs
BUDGETS = (30, 60)  # GRPO steps: half and all of its 60 steps' seconds
CONTRASTS = (("d3s", "grpo"), ("grpo-filter", "grpo"), ("d3s", "grpo-filter"))
BOOTSTRAP = 1000


def t_test(diffs):
    """(mean, 95% half-width, two-sided p) of a paired t-test on diffs."""
    d = np.asarray(diffs, dtype=float)
    n, mean, sd = len(d), float(d.mean()), float(d.std(ddof=1))
    if sd == 0:
        return mean, 0.0, 1.0 if mean == 0 else 0.0
    t, df = mean / (sd / np.sqrt(n)), n - 1
    p = float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    q = float(mpmath.findroot(lambda x: mpmath.betainc(df / 2, 0.5, 0, df / (df + x * x),
                                                        regularized=True) - 0.05, 2.0))
    return mean, q * sd / np.sqrt(n), p


def holm(ps, alpha=0.05):
    """Holm's step-down: which of the p-values survive at family-wise alpha."""
    order, keep = np.argsort(ps), [False] * len(ps)
    for rank, i in enumerate(order):
        if ps[i] > alpha / (len(ps) - rank):
            break
        keep[i] = True
    return keep


def cpu_prices(paths):
    """This CPU's prices from bench_update.py --json files (one a world): (a, b, c) of the update's
    seconds a + b fwd_bwd_tokens + c nograd_tokens, least squares over every configuration of the
    checkout measured ("now"), and each world's step 1 seconds."""
    rows, gen = [], {}
    for world, path in paths.items():
        with open(path) as f:
            saved = json.load(f)
        now = saved["results"]["now"]
        gen[world] = now["grpo"]["upd_s"] * now["share"] / (1 - now["share"])  # step 1, seconds
        rows += [(1.0, v["fwd_bwd_tokens"], v["nograd_tokens"], v["upd_s"])
                 for k, v in now.items() if k != "share"]
    X = np.array(rows)
    coef = np.linalg.lstsq(X[:, :3], X[:, 3], rcond=None)[0]
    fit = float(np.max(np.abs(X[:, :3] @ coef - X[:, 3]) / X[:, 3]))
    return tuple(float(c) for c in coef), gen, fit


def step_seconds(run, coef, gen):
    """(n,) a run's steps priced on this CPU: step 1's seconds + the update's by its counts."""
    a, b, c = coef
    return np.array([gen + (not s["no_signal"]) * (a + b * s["fwd_bwd_tokens"]
                                                    + c * s.get("nograd_tokens", 0))
                     for s in run["steps"]])


def costs_of(run, device):
    """(n,) a run's steps in GRPO steps on the device."""
    if "unit" in device:  # this CPU: each step by its own counts
        return step_seconds(run, device["coef"], device["gen"]) / device["unit"]
    return budget.step_costs(device["share"], budget.device_ratios(
        device, run["method"], run["config"], len(run["steps"])))


def h200_device():
    d = dict(budget.DEVICES["h200-hf"], name="h200-hf")
    d["ratio"] = dict(d["ratio"], **{"grpo-filter": 1.0})
    return d


def read_at(run, device, at):
    """(step, accuracy, ended): the run read where its priced cumulative seconds reach `at`."""
    s = budget.crossing(costs_of(run, device), at)
    ended = s is None
    s = len(run["steps"]) if ended else s
    return s, budget.accuracy_at(run["history"], s), ended


def cost_to(runs, device, target):
    """Priced seconds (GRPO steps) until the seed-mean curve of runs first reaches target."""
    evals = [h["step"] for h in runs[0]["history"]]
    acc = np.mean([[h["accuracy"] for h in r["history"]] for r in runs], axis=0)
    for j, a in enumerate(acc):
        if a >= target - 1e-9:
            s = evals[0] if j == 0 else evals[j - 1] + (target - acc[j - 1]) / (
                a - acc[j - 1]) * (evals[j] - evals[j - 1])
            costs = [costs_of(r, device) for r in runs]
            cum = np.mean([np.concatenate([[0.0], np.cumsum(c)]) for c in costs], axis=0)
            i = min(int(s), len(cum) - 2)
            return float(cum[i] + (s - i) * (cum[i + 1] - cum[i]))
    return None


def flip_share(grpo_runs, runs, coef, update, target):
    """The generation share of GRPO's step below which `runs` reach the target sooner than GRPO,
    with this CPU's update prices (coef) and generation's seconds scaled to each share [a
    projection: a device's own update ratio may differ]. At step-1 seconds g, x = (s_grpo g +
    U_grpo) / (s g + U) (s: steps to the target, U: the update's seconds until then) is 1 at g* =
    (U_grpo - U) / (s - s_grpo): the share g* / (g* + update), update GRPO's mean update seconds a
    step. 1.0: sooner at
    every share; 0.0: at none; None: a set never reaches the target, or is sooner only above a
    share (fewer steps, a dearer update)."""
    each_step = {"coef": (0.0, 0.0, 0.0), "gen": 1.0, "unit": 1.0}  # costs: steps
    update_only = {"coef": coef, "gen": 0.0, "unit": 1.0}  # costs: the update's seconds
    (sg, ug), (sm, um) = ((cost_to(rs, each_step, target), cost_to(rs, update_only, target))
                          for rs in (grpo_runs, runs))
    if None in (sg, sm) or (sm < sg and um > ug):
        return None
    if sm <= sg and um <= ug:
        return 1.0
    if sm >= sg and um >= ug:
        return 0.0
    g = (ug - um) / (sm - sg)
    return g / (g + update)


def world(name, root, prices):
    runs = budget.runs_of([os.path.join(root, f"cut-{name}{x}") for x in ("", "-d3s-cpu",
                                                                         "-d3s-h200")])
    for rs in (rs for sets in runs.values() for rs in sets.values()):
        for r in rs:  # every count of each step: the run's own log.jsonl (bench.py keeps a few)
            with open(os.path.join(r["out_dir"], "log.jsonl")) as f:
                r["steps"] = [json.loads(line) for line in f][:len(r["steps"])]
    coef, gen, _ = prices
    grpo_steps = np.concatenate([step_seconds(r, coef, gen[name]) for r in runs["grpo"][60]])
    cpu = {"name": "cpu", "coef": coef, "gen": gen[name], "unit": float(grpo_steps.mean())}
    cpu["share"] = gen[name] / cpu["unit"]  # generation's share of GRPO's mean step
    d3s_steps = sorted(runs["d3s"])  # the H200's plan is the shorter run
    pick = {"cpu": {"grpo": 60, "grpo-filter": 60, "d3s": d3s_steps[-1]},
            "h200-hf": {"grpo": 60, "grpo-filter": 60, "d3s": d3s_steps[0]}}
    out = {"target": TARGETS[name], "devices": {}, "per_step": {}, "per_token": {}}
    for device in (cpu, h200_device()):
        chosen = {m: runs[m][n] for m, n in pick[device["name"]].items()}
        seeds = [r["seed"] for r in chosen["grpo"]]
        assert all([r["seed"] for r in rs] == seeds for rs in chosen.values()), "unpaired seeds"
        dev = out["devices"][device["name"]] = {
            "share": device["share"], "budgets": {}, "steps": pick[device["name"]],
            "cost": {m: float(np.mean([costs_of(r, device).sum() for r in rs]))  # whole runs
                     for m, rs in chosen.items()}}
        for at in BUDGETS:
            read = {m: [read_at(r, device, at) for r in rs] for m, rs in chosen.items()}
            acc = {m: [x[1] for x in v] for m, v in read.items()}
            dev["budgets"][at] = {
                "accuracy": {m: float(np.mean(v)) for m, v in acc.items()},
                "step": {m: float(np.mean([x[0] for x in v])) for m, v in read.items()},
                "ended_first": {m: sum(x[2] for x in v) for m, v in read.items()},
                "contrasts": {f"{a} - {b}": t_test(np.subtract(acc[a], acc[b]))
                              for a, b in CONTRASTS}}
        rng = np.random.default_rng(0)
        n = len(seeds)
        boots = [rng.integers(0, n, n) for _ in range(BOOTSTRAP)]
        base = cost_to(chosen["grpo"], device, TARGETS[name])
        sooner = {}
        for m, rs in chosen.items():
            mine = cost_to(rs, device, TARGETS[name])
            point = base / mine if base and mine else 0.0
            vals = []
            for b in boots:
                g, x = cost_to([chosen["grpo"][i] for i in b], device, TARGETS[name]), \
                    cost_to([rs[i] for i in b], device, TARGETS[name])
                vals.append(g / x if g and x else 0.0)
            sooner[m] = {"cost": mine, "x": point,
                         "ci": [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]}
        dev["sooner"] = sooner
        if device["name"] == "cpu":  # where this CPU's answer would flip, generation scaled
            update = device["unit"] - device["gen"]
            flip = {}
            for m, rs in chosen.items():
                vals = [flip_share([chosen["grpo"][i] for i in b], [rs[i] for i in b], coef,
                                   update, TARGETS[name]) for b in boots]
                vals = [0.0 if v is None else v for v in vals]
                flip[m] = {"share": flip_share(chosen["grpo"], rs, coef, update, TARGETS[name]),
                           "ci": [float(np.percentile(vals, 2.5)),
                                  float(np.percentile(vals, 97.5))]}
            dev["flip"] = flip
    for m, sets in runs.items():  # per step: the first 60 steps of every run, AUC by trapezoid
        for n, rs in sets.items():
            aucs = []
            for r in rs:
                h = [x for x in r["history"] if x["step"] <= 60]
                s, a = [x["step"] for x in h], [x["accuracy"] for x in h]
                aucs.append(float(np.trapezoid(a, s) / (s[-1] - s[0])))
            out["per_step"][f"{m} ({n} steps)"] = {
                "auc": float(np.mean(aucs)), "final60": float(np.mean(
                    [budget.accuracy_at(r["history"], 60) for r in rs])), "aucs": aucs}
            steps = [s for r in rs for s in r["steps"][:60]]
            out["per_token"][f"{m} ({n} steps)"] = {
                k: float(np.mean([s.get(k, 0) for s in steps])) for k in
                ("tokens", "fwd_bwd_tokens", "nograd_tokens", "head_rows", "valid_all")}
    base = out["per_step"]["grpo (60 steps)"]["aucs"]
    for k, v in out["per_step"].items():
        v["auc_vs_grpo"] = t_test(np.subtract(v["aucs"], base))
    return out


def report(results):
    tests = [(w, d, at, c, v) for w, r in results.items() for d, dv in r["devices"].items()
             for at, bv in dv["budgets"].items() for c, v in bv["contrasts"].items()]
    survive = holm([v[2] for *_, v in tests])
    lines = [f"{len(tests)} comparisons; Holm at a family-wise 0.05: {sum(survive)} survive", "",
             "| world | device | budget (GRPO steps) | contrast | points, mean ± 95% CI | p | "
             "survives Holm |", "|" + " --- |" * 7]
    for (w, d, at, c, (mean, half, p)), ok in zip(tests, survive):
        lines.append(f"| {w} | {d} | {at} | {c} | {100 * mean:+.1f} ± {100 * half:.1f} | "
                     f"{p:.3g} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--root", default=os.path.join("out", "study"))
    p.add_argument("--prices", required=True, help="WORLD=bench_update.json,... (this CPU's)")
    p.add_argument("--worlds", default="", help="the worlds to read (default: every one priced)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    paths = dict(x.split("=", 1) for x in args.prices.split(","))
    prices = cpu_prices(paths)
    print(f"this CPU: update seconds = {prices[0][0]:.4f} + {prices[0][1]:.3e} x fwd_bwd_tokens + "
          f"{prices[0][2]:.3e} x nograd_tokens (the largest error {100 * prices[2]:.1f}% over "
          f"{len(paths)} worlds' configurations); step 1: " + ", ".join(
              f"{w} {s:.3f} s" for w, s in prices[1].items()) + "\n")
    worlds = args.worlds.split(",") if args.worlds else list(paths)
    results = {w: world(w, args.root, prices) for w in worlds}
    for w, r in results.items():
        print(f"## {w} (target {100 * r['target']:.0f}%)\n")
        for d, dv in r["devices"].items():
            print(f"{d}: share {dv['share']:.3f}; runs (steps: their whole cost in GRPO steps) "
                  + ", ".join(f"{m} ({n}: {dv['cost'][m]:.1f})" for m, n in dv["steps"].items()))
            for at, bv in dv["budgets"].items():
                acc = ", ".join(f"{m} {100 * a:.1f}% (step {bv['step'][m]:.1f}"
                                + (f", {bv['ended_first'][m]} ended first" if bv['ended_first'][m]
                                   else "") + ")" for m, a in bv["accuracy"].items())
                print(f"  at {at} GRPO steps: {acc}")
            print("  x sooner to the target: " + ", ".join(
                f"{m} {v['x']:.2f}x [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}]"
                for m, v in dv["sooner"].items()))
            if "flip" in dv:
                print("  sooner than GRPO below a generation share of (this CPU's update, "
                      "generation scaled; 1: at every share): " + ", ".join(
                          f"{m} {v['share']:.2f} [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}]"
                          for m, v in dv["flip"].items() if m != "grpo"))
        for k, v in r["per_step"].items():
            m, h, pv = v["auc_vs_grpo"]
            print(f"  per step, {k}: AUC to step 60 {100 * v['auc']:.1f}% ({100 * m:+.1f} ± "
                  f"{100 * h:.1f} vs grpo, p {pv:.3g}), accuracy at step 60 "
                  f"{100 * v['final60']:.1f}%")
        for k, v in r["per_token"].items():
            print(f"  per step's tokens, {k}: trained {v['tokens']:.0f}, fwd+bwd "
                  f"{v['fwd_bwd_tokens']:.0f}, no-grad {v['nograd_tokens']:.0f}, lm_head rows "
                  f"{v['head_rows']:.0f}, generated {v['valid_all']:.0f}")
        print()
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
