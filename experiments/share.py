"""
Per second at any generation share: how many times sooner than GRPO each method reaches GRPO's final
accuracy when generation is a share f of GRPO's step, for f from 0 to 0.95, from a bench folder's
measured steps and seconds.

    python experiments/share.py out/study/share-tiny out/study/share-tiny-fork \
        out/study/share-tiny-weak --out experiments/figures/share.png
    python experiments/share.py out/study/share-tiny --json out/share.json   # one world
    python experiments/share.py out/study/share-tiny --cost tokens   # seconds from the work done
    python experiments/share.py out/study/share-tiny --device h200-hf  # the H200's own update

Why: a step is generation plus update. Every method generates the same rollouts (B = P x G of them),
so a method that trains on less saves only update time, and what that buys in seconds depends on
how much of the step generation takes: little on this project's CPU (about a quarter), most of the
step with HF `generate` on a GPU. The steps a method needs are measured once; the share is then
only a change of units.

A folder is one `experiments/bench.py` folder: every finished run under DIR/runs, each method's
fixed-step runs and its runs in GRPO's budgets (`--budget seconds`, at the share measured here, and
`--budget seconds --share 0.8`, at that share), each at its own step count. For each method m and
each of its run lengths:
  s_m        the step at which its seed-mean held-out accuracy first reaches GRPO's final seed-mean
             accuracy (the target), interpolated linearly between two evaluations [ours: an
             evaluation grid alone puts "x sooner" one evaluation early or late]; GRPO's own from
             its fixed-step runs (at most their last step)
  G_m, U_m   the seconds of generation and of update it spent before s_m (t_gen, t_upd of
             log.jsonl summed over its steps, the step s_m falls in counted in proportion; seed
             mean)
  g, u       GRPO's seconds of generation and update per step (its fixed-step runs), so that the
             share measured here is f0 = g / (g + u)
At a share f, generation's seconds are scaled by a = f u / ((1 - f) g) (a = 1 at f0), the steps and
the update's seconds as measured: T_m(f) = a G_m + U_m, and the speed-up over GRPO is
T_grpo(f) / T_m(f) (over the filter baseline, grpo-filter, T_filter(f) / T_m(f)). [ours] Which of
m's runs: those whose length is nearest the steps GRPO's budget affords m at f, S (a g + u) /
(a g_m + u_m) with g_m, u_m its own per step. A scheduled method is not the same method run
longer (its keep ratios relax over its own steps), and the steps it needs change with the steps it
is given: where generation dominates, GRPO's seconds buy it few more steps than GRPO's. The
break-even share is where the speed-up first drops below 1 (interpolated on the f grid). At every
share but f0 this keeps this CPU's update ratio to GRPO's (about 0.5 for D3S here): the table calls
those columns projected.

--device D prices the answer on a device with its own update: its share f and each method's update
seconds over GRPO's as the device measured them, per rho_s or as the schedule's mean (a name of
experiments/budget.py's DEVICES such as h200-hf, NAME:share=F,d3s=R,d3s@RHO_S=R, a JSON file, or
gpu_check's summary.json; budget.py says how). In GRPO steps on D, m's seconds to s_m are f s_m +
(1 - f) R_m(s_m), R_m the sum of its steps' ratios before s_m (at each step's scheduled rho_s, the
step s_m falls in counted in proportion), and GRPO's budget affords m the N steps whose run costs
GRPO's S (budget.affordable); its runs nearest N give the speed-up, as above. A method D gives no
ratio for keeps this CPU's, U_m / u: the table says which each method used, and "projected" where
it is this CPU's. With speed.md's H200 (f = 12.1 / 18.7, D3S's update 0.35 of GRPO's at 0.25/0.2
and 1.15 at 0.75/0.6, a schedule mean of 0.75) GRPO's 60 steps afford D3S 65.8.

--cost tokens replaces each step's measured seconds by a count of its work [ours], so that a host
that runs the same steps faster or slower from one hour to the next (measured: up to a third, in
experiments/study.md section J) does not move the answer: every step generates in GRPO's mean
generation seconds per step (every method generates the same rollouts), and its update takes GRPO's
update seconds per token forwarded and back-propagated times the step's fwd_bwd_tokens (every token
of a kept rollout, each update). Only g and u, GRPO's own, stay measured.

Every interval is a 95% bootstrap over seeds (BOOTSTRAP resamples, numpy seed 0): the same resampled
seeds for every method and run length of a folder, each resample with its own target. A resample in
which a method never reaches the target counts as speed-up 0 (slower at every share it applies to).

Prints, per folder, a markdown table: each run length's steps to the target and seconds, the
speed-up at the measured share and at f = 0.5, 0.8 and 0.95, and the share below which the method
is faster than GRPO and than the filter; per --device, what each method's update was priced with,
the steps GRPO's budget affords it there, each run length's cost to the target and speed-up, and the
speed-up of the runs chosen; and draws the speed-up against f, a panel per folder, a line per
method with its band, each device's speed-up a point at its share (--out).
--gpu marks where a GPU step would sit: the project's estimate unless measured (experiments/
study.md says its basis).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from experiments import budget  # noqa: E402  devices, their prices, a step's cost on one

BOOTSTRAP = 1000  # resamples of the seeds, as bench.py's
SHARES = np.round(np.arange(0, 0.951, 0.01), 2)  # the figure's f
SHOWN = (0.5, 0.8, 0.95)  # the table's f, beside the measured share


def load(folder):
    """{method: {steps: runs}} of a bench folder, from every finished run under DIR/runs (its
    fixed-step runs and its runs in GRPO's budgets, each budget's at its own step count), each
    list ordered by seed, each run with its config."""
    out = budget.runs_of([folder])
    if "grpo" not in out:
        raise ValueError(f"{folder} has no finished grpo run: the speed-up is GRPO's seconds over "
                         "a method's")
    return out


def by_tokens(runs_by_method):
    """--cost tokens: each step's t_gen and t_upd from its work, at GRPO's measured prices (the
    module docstring)."""
    grpo = [s for rs in runs_by_method["grpo"].values() for r in rs for s in r["steps"]]
    gen = np.mean([s["t_gen"] for s in grpo])
    per_token = sum(s["t_upd"] for s in grpo) / sum(s["fwd_bwd_tokens"] for s in grpo)
    for sets in runs_by_method.values():
        for rs in sets.values():
            for r in rs:
                r["steps"] = [dict(s, t_gen=gen, t_upd=per_token * s["fwd_bwd_tokens"])
                              for s in r["steps"]]
    return runs_by_method


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
        if a >= target - 1e-9:  # a curve reaches its own mean, whatever the order of the sums
            if j == 0:
                return float(evals[0])
            lo, hi = acc[j - 1], a
            return evals[j - 1] + (target - lo) / (hi - lo) * (evals[j] - evals[j - 1])
    return None


def cost(runs, target, rows):
    """(G, U, s): the seed-mean seconds of generation and of update before the seed-mean curve of
    runs[rows] reaches target, and the step it does, or None when it never does."""
    evals = [h["step"] for h in runs[0]["history"]]
    acc = np.mean([[h["accuracy"] for h in runs[i]["history"]] for i in rows], axis=0)
    s = reach(evals, acc, target)
    if s is None:
        return None
    return (*(np.mean([at(cumulative(runs[i], f), s) for i in rows]) for f in ("t_gen", "t_upd")),
            s)


def per_step(runs, rows):
    """(generation, update): seed-mean seconds per step of runs[rows]."""
    return tuple(np.mean([np.mean([s[f] for s in runs[i]["steps"]]) for i in rows])
                 for f in ("t_gen", "t_upd"))


def scale(f, g, u):
    """a: generation's seconds scaled so that it is a share f of GRPO's step (g + u per step)."""
    return f * u / ((1 - f) * g)


def speedup(ref, mine, a):
    """T_ref / T_mine at generation scale a; 0 when the method never reaches the target."""
    if mine is None:
        return 0.0
    if ref is None:
        return np.inf
    return (a * ref[0] + ref[1]) / (a * mine[0] + mine[1])


def first_below(curve):
    """The share at which a speed-up curve over SHARES first drops below 1 from at or above it,
    interpolated: 0 when it starts below (slower at every share), 1 when it never drops (at least
    as fast at every share up to SHARES' end)."""
    for k, x in enumerate(curve):
        if x < 1:
            if k == 0:
                return 0.0
            lo, hi = curve[k - 1], x
            if not np.isfinite(lo):  # the reference never got there: no line to interpolate on
                return float(SHARES[k])
            return float(SHARES[k - 1] + (lo - 1) / (lo - hi) * (SHARES[k] - SHARES[k - 1]))
    return 1.0


def device_cost(f, c, cum, u):
    """A method's seconds to the target in GRPO steps on a device where generation is a share f:
    c = (G, U, s) from cost() (None: never there), cum the (n + 1,) cumulative update ratios of its
    run on the device (None: none measured there, so U / u, this CPU's, a projection)."""
    if c is None:
        return None
    return f * c[2] + (1 - f) * (at(cum, c[2]) if cum is not None else c[1] / u)


def on_device(runs_by_method, device):
    """{method: (cumulative ratios {steps: (steps + 1,)} or None, the steps GRPO's budget affords
    it, or None)} on a device: None where the device has no ratio for the method."""
    (S, _), = runs_by_method["grpo"].items()
    out = {}
    for m, sets in runs_by_method.items():
        config = next(iter(sets.values()))[0].get("config", {})
        if budget.device_ratios(device, m, config, 1) is None:
            out[m] = (None, None)
            continue
        cums = {k: np.concatenate([[0.0], np.cumsum(budget.device_ratios(device, m, config, k))])
                for k in sets}
        out[m] = (cums, budget.affordable(S, device["share"], lambda n, c=config:
                                          budget.device_ratios(device, m, c, n)))
    return out


def analyse(runs_by_method, resamples=BOOTSTRAP, seed=0, shown=SHOWN, devices=(),
            pricing="seconds"):
    """Every number of a folder's table and panel (see the module docstring): per method, at each
    share f its runs whose length is nearest the steps GRPO's budget affords it there, the
    speed-ups over GRPO and the filter, and the break-even shares, with bootstrap intervals; the
    speed-up at f0 and at each share in `shown`; and on each device, priced with its own update
    ratios where it has them (pricing: how this CPU's were, in words: seconds or tokens)."""
    (S, grpo), = runs_by_method["grpo"].items()
    n, seeds = len(grpo), [r["seed"] for r in grpo]
    for m, sets in runs_by_method.items():
        for k, rs in sets.items():
            if [r["seed"] for r in rs] != seeds:
                raise ValueError(f"{m}'s {k}-step runs have seeds {[r['seed'] for r in rs]}, "
                                 f"GRPO's {seeds}: the speed-up pairs them seed by seed")
    methods = list(runs_by_method)
    g0, u0 = per_step(grpo, range(n))
    f0 = float(g0 / (g0 + u0))
    priced = {d["name"]: on_device(runs_by_method, d) for d in devices}

    def numbers(rows):
        target = np.mean([grpo[i]["history"][-1]["accuracy"] for i in rows])
        g, u = per_step(grpo, rows)
        costs = {m: {k: cost(rs, target, rows) for k, rs in sets.items()}
                 for m, sets in runs_by_method.items()}
        steps_per = {m: per_step(sets[min(sets)], rows) for m, sets in runs_by_method.items()}

        def nearest(m, afford):  # the run length nearest the steps afforded, the longer on a tie
            return min(costs[m], key=lambda k: (abs(k - afford), -k))

        def chosen(m, f):  # the cost from the runs nearest the steps GRPO's budget affords m at f
            a = scale(f, g, u)
            afford = S * (a * g + u) / (a * steps_per[m][0] + steps_per[m][1])
            return costs[m][nearest(m, afford)], a

        out = {}
        for m in methods:
            row = {}
            for name, ref in (("grpo", "grpo"), ("filter", "grpo-filter")):
                if ref not in costs or (m == ref and name == "filter"):
                    continue
                curve = []
                for f in SHARES:
                    mine, a = chosen(m, f)
                    curve.append(speedup(chosen(ref, f)[0], mine, a))
                row[name] = curve
                if name == "grpo":
                    row["at"] = {f: speedup(chosen(ref, f)[0], *chosen(m, f)) for f in (f0, *shown)}
            out[m] = row
        for d in devices:
            f, on = d["share"], priced[d["name"]]
            ref = device_cost(f, costs["grpo"][S], on["grpo"][0][S], u)
            for m in methods:
                cums, afford = on[m]
                if afford is None:  # this CPU's ratio: its own update per step over GRPO's
                    afford = S / (f + (1 - f) * steps_per[m][1] / u)
                runs = {k: device_cost(f, c, None if cums is None else cums[k], u)
                        for k, c in costs[m].items()}
                x = {k: 0.0 if c is None else np.inf if ref is None else ref / c
                     for k, c in runs.items()}
                k = nearest(m, afford)
                out[m][d["name"]] = {"afford": afford, "run": k, "x": x[k], "runs": runs,
                                     "xs": x}
        return costs, out

    costs, point = numbers(range(n))
    rng = np.random.default_rng(seed)
    boots = [numbers(rng.integers(0, n, n))[1] for _ in range(resamples)]
    target = np.mean([r["history"][-1]["accuracy"] for r in grpo])
    result = {"f0": f0, "g": float(g0), "u": float(u0), "seeds": seeds, "target": float(target),
              "shown": list(shown), "methods": {}, "devices": {}}
    for m in methods:
        p = point[m]

        def ci(get):
            vals = np.array([get(b[m]) for b in boots], dtype=float)
            return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]
        row = {"runs": {str(k): (None if c is None else {"gen_s": float(c[0]), "upd_s": float(c[1]),
                                                         "step": float(c[2])})
                        for k, c in sorted(costs[m].items())},
               "curve": [float(x) for x in p["grpo"]],
               "curve_ci": [ci(lambda b, k=k: b["grpo"][k]) for k in range(len(SHARES))],
               "at": {str(round(f, 4)): [float(p["at"][f]), ci(lambda b, f=f: b["at"][f])]
                      for f in (f0, *shown)},
               "even_grpo": [first_below(p["grpo"]), ci(lambda b: first_below(b["grpo"]))]}
        if "filter" in p:
            row["even_filter"] = [first_below(p["filter"]), ci(lambda b: first_below(b["filter"]))]
        result["methods"][m] = row
        for d in devices:
            q, name = p[d["name"]], d["name"]
            entry = result["devices"].setdefault(name, {
                "share": d["share"], "source": d["source"], "budget_steps": S, "methods": {}})
            entry["methods"][m] = {
                "priced_by": budget.priced_by(d, m, pricing),
                "projection": priced[name][m][1] is None, "afford": float(q["afford"]),
                "run": q["run"], "x": [float(q["x"]), ci(lambda b, name=name: b[name]["x"])],
                "runs": {str(k): None if c is None else {
                    "step": float(costs[m][k][2]), "cost": float(c), "x": float(q["xs"][k])}
                    for k, c in sorted(q["runs"].items())}}
    return result


def x_cell(v):
    x, (lo, hi) = v
    return f"{x:.2f}x [{lo:.2f}, {hi:.2f}]"


def even_cell(v):
    """"0.57 [0.41, 0.70]": faster than the reference below that share; or at "every share", at
    "no share"."""
    if v is None:
        return "-"
    f, (lo, hi) = v
    where = "no share" if f == 0 else "every share to 0.95" if f == 1 else f"{f:.2f}"
    return f"{where} [{lo:.2f}, {hi:.2f}]"


def table(result):
    """The markdown table of one folder's analyse(), then one per device."""
    f0, shown = result["f0"], result.get("shown", SHOWN)
    head = (f"GRPO's step: {result['g']:.3f} s generation + {result['u']:.3f} s update, "
            f"generation's share measured here f0 = {f0:.2f}; its final accuracy, the target: "
            f"{100 * result['target']:.1f}%; {len(result['seeds'])} seeds. At another share f the "
            "update keeps this CPU's ratio to GRPO's: projected")
    cols = (["method", "runs: steps to the target (gen s + upd s to it)",
             f"x sooner at f0 = {f0:.2f}"] + [f"x sooner at f = {f}, projected" for f in shown]
            + ["faster than GRPO below f", "faster than grpo-filter below f"])
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for m, r in result["methods"].items():
        runs = "; ".join(f"{k} steps: not reached" if c is None else
                         f"{k} steps: {c['step']:.1f} ({c['gen_s']:.1f} + {c['upd_s']:.1f})"
                         for k, c in r["runs"].items())
        cells = [m, runs] + [x_cell(r["at"][str(round(f, 4))]) for f in (f0, *shown)]
        cells += [even_cell(r["even_grpo"] if m != "grpo" else None),
                  even_cell(r.get("even_filter"))]
        lines.append("| " + " | ".join(cells) + " |")
    for name, d in result.get("devices", {}).items():
        lines += ["", device_table(name, d)]
    return "\n".join(lines)


def device_table(name, d):
    """On one device: each method's update priced as it says, the steps GRPO's budget affords it,
    each run length's cost to the target and speed-up, and the speed-up of the runs chosen."""
    head = (f"On {name}: generation {d['share']:.3f} of GRPO's step ({d['source']}); GRPO's "
            f"budget: its {d['budget_steps']} steps there. Cost in GRPO steps")
    cols = ["method", "update priced by", "GRPO's budget affords",
            "runs: steps to the target (cost, x sooner)", f"x sooner on {name} (the runs chosen)"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for m, r in d["methods"].items():
        runs = "; ".join(f"{k} steps: not reached" if c is None else
                         f"{k} steps: {c['step']:.1f} ({c['cost']:.1f}, {c['x']:.2f}x)"
                         for k, c in r["runs"].items())
        x = x_cell(r["x"]) + f" ({r['run']} steps)" + (", projected" if r["projection"] else "")
        lines.append("| " + " | ".join([m, r["priced_by"], f"{r['afford']:.1f} steps", runs, x])
                     + " |")
    return "\n".join(lines)


def figure(results, names, gpu=None):
    """Speed-up over GRPO against f: a panel per folder, a line per method with its band (this
    CPU's update ratio at every f), each device's speed-up a point at its share; the measured
    share, and the GPU's (estimate or measurement) as a band."""
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
            for k, (dev, d) in enumerate(result.get("devices", {}).items()):
                on = d["methods"][m]
                x, (xlo, xhi) = on["x"]
                ax.errorbar([d["share"]], [x], yerr=[[x - xlo], [xhi - x]], capsize=3,
                            color=line.get_color(), marker="os^Dv"[k % 5], linestyle="none",
                            label=f"{m} on {dev}: " + ("this CPU's update ratio, projected"
                                                       if on["projection"] else "its own update"))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axvline(result["f0"], color="grey", linestyle=":",
                   label=f"measured here (CPU): f = {result['f0']:.2f}")
        if gpu:
            ax.axvspan(*gpu[:2], color="orange", alpha=0.12, label=gpu[2])
        ax.set_xlabel("generation's share f of GRPO's step")
        ax.set_ylabel("x sooner than GRPO to GRPO's final accuracy")
        ax.set_title(f"{name} (lines: this CPU's update ratio at every f)", fontsize=10)
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
    p.add_argument("--at", default=",".join(map(str, SHOWN)),
                   help="the shares f at which the table gives the speed-up, beside the measured "
                        "one")
    p.add_argument("--cost", default="seconds", choices=("seconds", "tokens"),
                   help="each step's seconds as measured, or from its tokens at GRPO's prices")
    p.add_argument("--device", action="append", default=[],
                   help=f"price on a device with its own update ratios (repeatable): "
                        f"{', '.join(budget.DEVICES)}, NAME:share=F,METHOD=R,METHOD@RHO_S=R, or a "
                        "JSON file (experiments/budget.py)")
    args = p.parse_args(argv)
    try:
        price = by_tokens if args.cost == "tokens" else (lambda runs: runs)
        shown = tuple(float(f) for f in args.at.split(","))
        if not all(0 <= f < 1 for f in shown):
            raise ValueError(f"--at {args.at}: each share must be in [0, 1)")
        devices = [d for spec in args.device for d in budget.devices(spec)]
        if any(d["share"] is None for d in devices):
            raise ValueError("--device cpu is this table's own f0: name a device with a share")
        results = [analyse(price(load(f)), shown=shown, devices=devices, pricing=args.cost)
                   for f in args.folders]
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
