"""
Per second at any generation share: how many times sooner than GRPO each method reaches GRPO's final
accuracy when generation is a share f of GRPO's step, for f from 0 to 0.95, from a bench folder's
measured steps and seconds.

    python experiments/share.py out/study/share-tiny out/study/share-tiny-fork \
        out/study/share-tiny-weak --out experiments/figures/share.png
    python experiments/share.py out/study/share-tiny --json out/share.json   # one world

Why: a step is generation plus update. Every method generates the same rollouts (B = P x G of them),
so a method that trains on less saves only update time, and what that buys in seconds depends on
how much of the step generation takes: little on this project's CPU (about a quarter), most of the
step with HF `generate` on a GPU. The steps a method needs are measured once; the share is then
only a change of units.

A folder is one `experiments/bench.py --budget seconds` command's (results.json): each method's
fixed-step runs, and its longer runs in GRPO's budget where it has them. For each method m:
  s_m        the step at which its seed-mean held-out accuracy first reaches GRPO's final seed-mean
             accuracy (the target), read from its longest runs and interpolated linearly between
             two evaluations [ours: an evaluation grid alone would put "x sooner" one evaluation
             early or late]; GRPO's own from its fixed-step runs (at most their last step)
  G_m, U_m   the seconds of generation and of update it spent before s_m (t_gen, t_upd of
             log.jsonl summed over its steps, the step s_m falls in counted in proportion; seed
             mean)
  g, u       GRPO's seconds of generation and update per step (its fixed-step runs), so that the
             share measured here is f0 = g / (g + u)
At a share f, generation's seconds are scaled by a = f u / ((1 - f) g) (a = 1 at f0), the steps and
the update's seconds as measured: T_m(f) = a G_m + U_m, and the speed-up over GRPO is
T_grpo(f) / T_m(f) (over the filter baseline, grpo-filter, T_filter(f) / T_m(f)). It is monotone
in f, so it crosses 1 at most once: the break-even share f*, where T_m = T_ref, i.e.
a* = (U_ref - U_m) / (G_m - G_ref). A method that needs more steps than GRPO but a cheaper update
is faster below f* and slower above it.

Every interval is a 95% bootstrap over seeds (BOOTSTRAP resamples, numpy seed 0): the same resampled
seeds for every method of a folder, each resample with its own target. A resample in which a method
never reaches the target counts as speed-up 0 and break-even 0 (slower at every share); one in
which it is at least as fast at every share counts as break-even 1.

Prints, per folder, a markdown table: steps to the target, seconds, the speed-up at the measured
share and at f = 0.5, 0.8 and 0.95, and the break-even share against GRPO and against the filter;
and draws the speed-up against f, a panel per folder, a line per method with its band (--out).
--gpu marks where a GPU step would sit: the project's estimate unless measured (experiments/
study.md says its basis).
"""
import argparse
import json
import os
import sys

import numpy as np

BOOTSTRAP = 1000  # resamples of the seeds, as bench.py's
SHARES = np.round(np.arange(0, 0.951, 0.01), 2)  # the figure's f
SHOWN = (0.5, 0.8, 0.95)  # the table's f, beside the measured share


def load(folder):
    """{method: (the fixed-step runs, its longest runs)} of a bench folder, each list ordered by
    seed: the longest are the runs in GRPO's budget where they have more steps than the fixed."""
    path = os.path.join(folder, "results.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} has no results.json; pass the --out folder of an "
                         "experiments/bench.py command (with --budget seconds for methods that "
                         "need more steps than GRPO)")
    with open(path) as f:
        res = json.load(f)
    ok = [r for r in res["runs"] if r["error"] is None]
    budget = [r for r in res.get("budget", {}).get("runs", []) if r["error"] is None]
    out = {}
    for m in dict.fromkeys(r["method"] for r in ok):
        fixed = sorted((r for r in ok if r["method"] == m), key=lambda r: r["seed"])
        longer = sorted((r for r in budget if r["method"] == m), key=lambda r: r["seed"])
        long_ = longer if longer and steps(longer[0]) > steps(fixed[0]) else fixed
        out[m] = (fixed, long_)
    if "grpo" not in out:
        raise ValueError(f"{folder} has no finished grpo run: the speed-up is GRPO's seconds over "
                         "a method's")
    return out


def steps(run):
    return len(run["steps"])


def cumulative(run, field):
    """(steps + 1,) the seconds of `field` (t_gen, t_upd) spent before each step, 0 first."""
    return np.concatenate([[0.0], np.cumsum([s[field] for s in run["steps"]])])


def at(cum, s):
    """A cumulative sum at a fractional step s: the step s falls in counts in proportion."""
    i = min(int(s), len(cum) - 2)
    return cum[i] + (s - i) * (cum[i + 1] - cum[i])


def reach(evals, acc, target):
    """The first (fractional) step at which the curve acc (at the steps evals) reaches target,
    linearly interpolated between the two evaluations around it; None if it never does."""
    for j, a in enumerate(acc):
        if a >= target:
            if j == 0:
                return float(evals[0])
            lo, hi = acc[j - 1], a
            return evals[j - 1] + (target - lo) / (hi - lo) * (evals[j] - evals[j - 1])
    return None


def cost(runs, target, rows):
    """(G, U): the seed-mean seconds of generation and of update before the seed-mean curve of
    runs[rows] reaches target, or None when it never does."""
    evals = [h["step"] for h in runs[0]["history"]]
    acc = np.mean([[h["accuracy"] for h in runs[i]["history"]] for i in rows], axis=0)
    s = reach(evals, acc, target)
    if s is None:
        return None
    return tuple(np.mean([at(cumulative(runs[i], f), s) for i in rows]) for f in ("t_gen", "t_upd"))


def scale(f, g, u):
    """a: generation's seconds scaled so that it is a share f of GRPO's step (g + u per step)."""
    return f * u / ((1 - f) * g)


def speedup(ref, mine, a):
    """T_ref / T_mine at generation scale a; 0 when the method never reaches the target."""
    if mine is None:
        return 0.0
    return (a * ref[0] + ref[1]) / (a * mine[0] + mine[1])


def break_even(ref, mine, g, u):
    """(f*, faster_below): the share at which T_mine = T_ref, clamped to [0, 1] (0: slower at every
    share, 1: at least as fast at every share), and whether the method is the faster one below
    it."""
    if mine is None:
        return 0.0, True
    dG, dU = mine[0] - ref[0], mine[1] - ref[1]  # T_mine - T_ref = a dG + dU
    if dG >= 0 and dU >= 0:
        return (1.0, True) if dG == dU == 0 else (0.0, True)
    if dG <= 0 and dU <= 0:
        return 1.0, True
    a = -dU / dG  # > 0: the crossing
    return float(a * g / (a * g + u)), bool(dG > 0)


def analyse(runs_by_method, resamples=BOOTSTRAP, seed=0):
    """Every number of a folder's table and panel: per method, the point estimates and their
    bootstrap intervals (see the module docstring)."""
    grpo_fixed = runs_by_method["grpo"][0]
    n = len(grpo_fixed)
    seeds = [r["seed"] for r in grpo_fixed]
    for m, (fixed, long_) in runs_by_method.items():
        if [r["seed"] for r in long_] != seeds:
            raise ValueError(f"{m}'s runs have seeds {[r['seed'] for r in long_]}, GRPO's {seeds}: "
                             "the speed-up pairs them seed by seed")
    g = np.mean([np.mean([s["t_gen"] for s in r["steps"]]) for r in grpo_fixed])
    u = np.mean([np.mean([s["t_upd"] for s in r["steps"]]) for r in grpo_fixed])
    f0 = g / (g + u)

    def numbers(rows):
        target = np.mean([grpo_fixed[i]["history"][-1]["accuracy"] for i in rows])
        gg = np.mean([np.mean([s["t_gen"] for s in grpo_fixed[i]["steps"]]) for i in rows])
        uu = np.mean([np.mean([s["t_upd"] for s in grpo_fixed[i]["steps"]]) for i in rows])
        costs = {m: cost(long_ if m != "grpo" else fixed, target, rows)
                 for m, (fixed, long_) in runs_by_method.items()}
        out = {}
        for m, c in costs.items():
            row = {"curve": [speedup(costs["grpo"], c, scale(f, gg, uu)) for f in SHARES],
                   "at": {f: speedup(costs["grpo"], c, scale(f, gg, uu)) for f in (f0, *SHOWN)},
                   "even_grpo": break_even(costs["grpo"], c, gg, uu)}
            if "grpo-filter" in costs and m != "grpo-filter":  # a filter that never gets there:
                ref = costs["grpo-filter"]  # a method that does is faster at every share
                row["even_filter"] = (break_even(ref, c, gg, uu) if ref is not None else
                                      (float(c is not None), True))
            out[m] = row
        return costs, out

    costs, point = numbers(range(n))
    rng = np.random.default_rng(seed)
    boots = [numbers(rng.integers(0, n, n))[1] for _ in range(resamples)]
    result = {"f0": f0, "g": g, "u": u, "seeds": seeds, "methods": {}}
    for m in runs_by_method:
        long_ = runs_by_method[m][1 if m != "grpo" else 0]
        evals = [h["step"] for h in long_[0]["history"]]
        acc = np.mean([[h["accuracy"] for h in r["history"]] for r in long_], axis=0)
        target = np.mean([r["history"][-1]["accuracy"] for r in grpo_fixed])
        p = point[m]

        def ci(get):
            vals = np.array([get(b[m]) for b in boots])
            return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]
        row = {"steps_run": steps(long_[0]), "reach": reach(evals, acc, target),
               "cost": None if costs[m] is None else [float(x) for x in costs[m]],
               "curve": p["curve"],
               "curve_ci": [ci(lambda b, k=k: b["curve"][k]) for k in range(len(SHARES))],
               "at": {str(round(f, 4)): [p["at"][f], ci(lambda b, f=f: b["at"][f])]
                      for f in (f0, *SHOWN)},
               "even_grpo": [*p["even_grpo"], ci(lambda b: b["even_grpo"][0])]}
        if "even_filter" in p:
            row["even_filter"] = [*p["even_filter"], ci(lambda b: b["even_filter"][0])]
        result["methods"][m] = row
    return result


def x_cell(v):
    x, (lo, hi) = v
    return f"{x:.2f}x [{lo:.2f}, {hi:.2f}]"


def even_cell(v):
    """"0.57 [0.41, 0.70] (faster below)"; "every share", "no share"."""
    if v is None:
        return "-"
    f, below, (lo, hi) = v
    where = ("no share" if f == 0 else "every share" if f == 1 else
             f"{f:.2f} (faster {'below' if below else 'above'})")
    return f"{where} [{lo:.2f}, {hi:.2f}]"


def table(result):
    """The markdown table of one folder's analyse()."""
    f0 = result["f0"]
    head = (f"GRPO's step: {result['g']:.3f} s generation + {result['u']:.3f} s update, "
            f"generation's share measured here f0 = {f0:.2f}; {len(result['seeds'])} seeds")
    cols = (["method", "steps run", "steps to GRPO's acc", "gen s + upd s to it",
             f"x sooner at f0 = {f0:.2f}"] + [f"x sooner at f = {f}" for f in SHOWN]
            + ["break-even f vs GRPO", "break-even f vs grpo-filter"])
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for m, r in result["methods"].items():
        reached = "not reached" if r["reach"] is None else f"{r['reach']:.1f}"
        spent = "-" if r["cost"] is None else f"{r['cost'][0]:.1f} + {r['cost'][1]:.1f}"
        cells = [m, str(r["steps_run"]), reached, spent]
        cells += [x_cell(r["at"][str(round(f, 4))]) for f in (f0, *SHOWN)]
        cells += [even_cell(r["even_grpo"]), even_cell(r.get("even_filter"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(results, names, gpu=None):
    """Speed-up over GRPO against f: a panel per folder, a line per method with its band; the
    measured share, and the GPU's (estimate or measurement) as a band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.6), dpi=90,
                             squeeze=False)
    for ax, result, name in zip(axes[0], results, names):
        for m, r in result["methods"].items():
            if m == "grpo":
                continue
            lo, hi = np.array(r["curve_ci"]).T
            line, = ax.plot(SHARES, r["curve"], label=m)
            ax.fill_between(SHARES, lo, hi, color=line.get_color(), alpha=0.12)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axvline(result["f0"], color="grey", linestyle=":",
                   label=f"measured here (CPU): f = {result['f0']:.2f}")
        if gpu:
            ax.axvspan(*gpu[:2], color="orange", alpha=0.12, label=gpu[2])
        ax.set_title(name)
        ax.set_xlabel("generation's share f of GRPO's step")
        ax.set_ylabel("x sooner than GRPO to GRPO's final accuracy")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("folders", nargs="+", help="bench.py --out folders (results.json)")
    p.add_argument("--out", default="", help="draw the figure here (a .png)")
    p.add_argument("--json", default="", help="write every number here")
    p.add_argument("--gpu", default="0.6,0.9,GPU step, the project's estimate",
                   help="LOW,HIGH,LABEL: the band of f where a GPU step sits ('': none)")
    args = p.parse_args(argv)
    try:
        results = [analyse(load(f)) for f in args.folders]
        gpu = None
        if args.gpu:
            lo, hi, label = args.gpu.split(",", 2)
            gpu = (float(lo), float(hi), label)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = [os.path.basename(os.path.normpath(f)) for f in args.folders]
    for name, result in zip(names, results):
        print(f"## {name}\n\n{table(result)}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(zip(names, results)), f, indent=1)
    if args.out:
        fig = figure(results, names, gpu)
        fig.savefig(args.out)
        print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
