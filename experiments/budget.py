"""
Equal seconds on a device: the steps a method's run affords in a budget of GRPO's seconds there, and
the step at which a finished run's priced seconds cross that budget, so that held-out accuracy is
compared at budgets fixed before the runs (paired accuracy at equal seconds).

    python experiments/budget.py plan --device h200-hf --steps 60 --budgets 30,60 --methods grpo,d3s
    python experiments/budget.py read out/study/tiny out/study/tiny-h200 --device h200-hf \
        --device cpu --budgets 30,60
    python experiments/budget.py plan --device OUT/gpu_check/summary.json --steps 60 --budgets 60

The unit is GRPO's step on the device, generation a share f of it. Every method generates the same
rollouts (B = P x G), so a method's step i costs c_i = f + (1 - f) r_i, r_i its update's seconds
over GRPO's at that step (GRPO's r = 1): the device's ratio at the step's scheduled rho_s (linear
between the rho_s it was measured at, the nearest one's outside them [ours: rho_t moves with rho_s
on the schedule]), or one number (the schedule's mean, or a fixed-ratio method's). A method the
device gives no ratio for is priced with this CPU's, a projection the output names as one: its
step's t_upd over GRPO's mean t_upd per step in the runs read (--cost tokens: its fwd_bwd_tokens
over GRPO's mean). A run of N steps, its schedule spanning them, costs C(N), the sum of its c_i; a
budget of X GRPO steps affords the N with C(N) = X, linear between the two whole N around it [ours].
A finished run crosses X at the fractional step where its cumulative cost reaches X (the step it
falls in counted in proportion, as experiments/share.py counts); its held-out accuracy there is
interpolated between the two evaluations around it [ours] and paired seed by seed with GRPO's at
step X: the mean difference with bench.py's 95% t interval. With experiments/speed.md's H200
(h200-hf: f = 12.1 / 18.7; D3S's update 0.35 of GRPO's at 0.25/0.2 and 1.15 at 0.75/0.6, a schedule
mean of 0.75) GRPO's 60 steps afford D3S 65.8.

A device (--device, repeatable): a name of DEVICES below (its share, its ratios and where they were
measured); `cpu` (the share and every ratio as measured in the runs read); NAME:share=F,METHOD=R,
METHOD@RHO_S=R,... (R a ratio at that rho_s, or without @ the schedule's mean); a JSON file {NAME:
{"share": F, "ratio": {METHOD: R or [[RHO_S, R], ...]}, "source": "..."}}; or gpu_check's
summary.json (GRPO's generation share with the decode loop, and D3S's update over GRPO's at the
ratios of its compare part, in one process at one micro-batch).

plan prints, per device and budget, the steps each method's run affords there (a run planned for
that budget: its schedule spans those steps); read prints, per device and budget, for each method
and run length, the step its runs cross the budget at, the accuracy there and the paired difference
to GRPO's.
"""
import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

KNOBS = ("s_init", "s_final", "t_init", "t_final")  # the schedule's, as train.Config names them
DEVICES = {  # name: generation's share of GRPO's step, each method's update over GRPO's, the source
    "h200-hf": dict(
        share=12.1 / 18.7, ratio={"d3s": [[0.25, 2.3 / 6.6], [0.75, 7.6 / 6.6]]},
        source="experiments/speed.md, GPU: the first measurements: one H200, HF generate, "
               "Qwen2.5-0.5B's shape with random weights; GRPO 12.1 s + 6.6 s a step, D3S's "
               "update 2.3 s at 0.25/0.2 (24 GiB, micro-batch 8) and 7.6 s at 0.75/0.6 (the "
               "whole card, micro-batch 16): not like for like"),
}

# -----------------------------------------------------------------------------
# pricing: pure functions


def ratio_at(spec, rho_s):
    """A method's update over GRPO's at a step of keep ratio rho_s: spec one number, or [[rho_s,
    r], ...] measured points (linear between them, the nearest one's outside them)."""
    if isinstance(spec, (int, float)):
        return float(spec)
    xs, ys = zip(*sorted(spec))
    return float(np.interp(rho_s, xs, ys))


def step_costs(f, ratios):
    """(n,) each step's seconds in GRPO steps on a device where generation is a share f of GRPO's
    step and the update's ratio to GRPO's is ratios[i]."""
    return f + (1 - f) * np.asarray(ratios, dtype=float)


def crossing(costs, budget):
    """The fractional step at which the cumulative costs reach budget (the step it falls in counted
    in proportion); None when the run ends first."""
    cum = np.concatenate([[0.0], np.cumsum(costs)])
    if cum[-1] < budget - 1e-9:
        return None
    j = int(np.searchsorted(cum, budget - 1e-9))  # the first step boundary at or past the budget
    if j == 0:
        return 0.0
    return j - 1 + (budget - cum[j - 1]) / (cum[j] - cum[j - 1])


def affordable(budget, f, ratios_of, limit=1_000_000):
    """The steps a run affords in `budget` GRPO steps: the N whose run (of N steps: ratios_of(N) its
    ratios, its schedule spanning them) costs the budget, linear between two whole N."""
    before = 0.0
    for n in range(1, limit):
        cost = float(step_costs(f, ratios_of(n)).sum())
        if cost >= budget - 1e-9:
            return n - 1 + (budget - before) / (cost - before)
        before = cost
    raise ValueError(f"a budget of {budget} GRPO steps affords more than {limit} steps: a step "
                     "priced at 0?")


def accuracy_at(history, s):
    """Held-out accuracy at the fractional step s, linear between the evaluations around it."""
    return float(np.interp(s, [h["step"] for h in history], [h["accuracy"] for h in history]))


def schedule(config, n):
    """rho_s at each step of an n-step run of config's method and keep ratios (d3s.keep_ratios)."""
    import d3s  # here: pricing by one number needs no torch
    missing = [k for k in ("method", *KNOBS) if k not in config]
    if missing:
        raise ValueError(f"a run's config lacks {', '.join(missing)}: its schedule is unknown")
    kind = d3s.METHODS[config["method"]]["schedule"]
    return [d3s.keep_ratios(i, n, kind, *(config[k] for k in KNOBS))[0] for i in range(n)]


def device_ratios(device, method, config, n):
    """(n,) a method's ratios over an n-step run on the device (GRPO's 1), or None when the device
    gives none for it."""
    if method == "grpo":
        return [1.0] * n
    spec = device["ratio"].get(method)
    if spec is None:
        return None
    if isinstance(spec, (int, float)):
        return [float(spec)] * n
    return [ratio_at(spec, rho) for rho in schedule(config, n)]


def priced_by(device, method, cost="seconds"):
    """In words: what a method's update is priced with on the device."""
    if method == "grpo":
        return "GRPO's own (the unit)"
    spec = device["ratio"].get(method)
    if spec is None:
        what = "t_upd" if cost == "seconds" else "fwd_bwd_tokens"
        return (f"this CPU's ratio ({what} over GRPO's)" +
                ("" if device["name"] == "cpu" else f", a projection: {device['name']} has none"))
    if isinstance(spec, (int, float)):
        return f"{device['name']}'s {spec:.3g}"
    points = ", ".join(f"{r:.3g} at ρs {x:g}" for x, r in sorted(spec))
    return f"{device['name']}'s {points}"

# -----------------------------------------------------------------------------
# devices and runs: the inputs


def devices(spec):
    """--device SPEC -> a list of devices {name, share (None: measured), ratio, source}."""
    if spec in DEVICES:
        return [dict(DEVICES[spec], name=spec)]
    if spec == "cpu":
        return [{"name": "cpu", "share": None, "ratio": {},
                 "source": "GRPO's share and every update as measured in the runs read"}]
    if os.path.isfile(spec):
        with open(spec) as f:
            data = json.load(f)
        if "parts" in data:
            return [from_gpu_check(data, spec)]
        return [checked(dict(v, name=k, source=v.get("source", spec))) for k, v in data.items()]
    name, colon, rest = spec.partition(":")
    if not colon or not name:
        raise ValueError(f"--device {spec}: not one of {', '.join([*DEVICES, 'cpu'])}, a file, nor "
                         "NAME:share=F,METHOD=R,METHOD@RHO_S=R")
    out = {"name": name, "share": None, "ratio": {}, "source": "given on the command line"}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--device {spec}: {item!r} is not KEY=VALUE")
        if key == "share":
            out["share"] = float(value)
        elif "@" in key:
            method, rho = key.split("@", 1)
            spec_m = out["ratio"].setdefault(method, [])
            if not isinstance(spec_m, list):
                raise ValueError(f"--device {spec}: {method} has a mean ratio and ratios by rho_s")
            spec_m.append([float(rho), float(value)])
        else:
            out["ratio"][key] = float(value)
    return [checked(out)]


def checked(device):
    """A device whose share is in (0, 1) and whose ratios are numbers >= 0, else a ValueError."""
    f, name = device.get("share"), device["name"]
    if f is None or not 0 < f < 1:
        raise ValueError(f"device {name}: share {f}: generation's share of GRPO's step, in (0, 1)")
    for method, spec in device.get("ratio", {}).items():
        values = [spec] if isinstance(spec, (int, float)) else [r for _, r in spec]
        if not values or min(values) < 0:
            raise ValueError(f"device {name}: {method}'s ratio {spec}: one number or [[rho_s, r], "
                             "...], each r >= 0")
    return dict(device, ratio=dict(device.get("ratio", {})))


def from_gpu_check(summary, path):
    """A device from gpu_check's summary.json: GRPO's steady generation share, and D3S's update
    over GRPO's at each fixed ratio of its compare part ("d3s 0.25/0.2": ...)."""
    compare = summary["parts"].get("compare", {})
    if compare.get("status") != "done":
        raise ValueError(f"{path}: gpu_check's compare part is {compare.get('status', 'absent')}: "
                         "no update ratio was measured")
    points = [[float(label.split()[1].split("/")[0]), row["update_over_grpo"]]
              for label, row in compare["rows"].items() if label.startswith("d3s ")]
    grpo = summary.get("runs", {}).get("grpo", {})
    if grpo.get("status") != "done":
        raise ValueError(f"{path}: gpu_check's grpo run is {grpo.get('status', 'absent')}: no "
                         "generation share was measured")
    card = summary.get("card", {}).get("name", "GPU")
    dry = " (a dry run: no figures)" if summary.get("dry_run") else ""
    return checked({"name": f"{card} (gpu_check)", "ratio": {"d3s": points},
                    "share": grpo["steady_median"]["generation_share"],
                    "source": f"{path}: experiments/gpu_check.py, GRPO's generation share with "
                              f"--generation {generation(summary)}, its compare part{dry}"})


def generation(summary):
    """The engine of gpu_check's grpo run: hf where its command says so, else the loop."""
    return "hf" if "--generation hf" in str(summary["runs"]["grpo"].get("command")) else "loop"


def runs_of(folders):
    """{method: {steps: [runs, by seed]}} of every finished run under each FOLDER/runs (bench.py's
    --out), each its result with `config` and `steps_run`."""
    out, seen = {}, set()
    for folder in folders:
        paths = sorted(glob.glob(os.path.join(folder, "runs", "*", "result.json")))
        if not paths:
            raise ValueError(f"{folder} has no finished run (runs/*/result.json); pass the --out "
                             "folder of an experiments/bench.py command (with --budget seconds)")
        for path in paths:
            with open(path) as f:
                saved = json.load(f)
            r = dict(saved["result"], config=saved["config"], steps_run=saved["config"]["steps"])
            key = (r["method"], r["steps_run"], r["seed"])
            if key in seen:
                raise ValueError(f"{path}: a second {r['steps_run']}-step {r['method']} run of "
                                 f"seed {r['seed']}: pass each run once")
            seen.add(key)
            out.setdefault(r["method"], {}).setdefault(r["steps_run"], []).append(r)
    for sets in out.values():
        for rs in sets.values():
            rs.sort(key=lambda r: r["seed"])
    return out


def measured(runs_by_method, cost="seconds"):
    """(f0, base): GRPO's generation share as measured, and its mean update per step (t_upd, or
    --cost tokens fwd_bwd_tokens), over all its runs."""
    if "grpo" not in runs_by_method:
        raise ValueError("no finished grpo run: a budget is counted in GRPO's steps")
    steps = [s for rs in runs_by_method["grpo"].values() for r in rs for s in r["steps"]]
    gen, upd = (np.mean([s[k] for s in steps]) for k in ("t_gen", "t_upd"))
    base = upd if cost == "seconds" else np.mean([s["fwd_bwd_tokens"] for s in steps])
    return float(gen / (gen + upd)), float(base)


def run_ratios(device, run, base, cost="seconds"):
    """(n,) a finished run's ratio at each of its steps: the device's, else its own over GRPO's
    mean (base)."""
    r = device_ratios(device, run["method"], run["config"], len(run["steps"]))
    if r is not None:
        return r
    field = "t_upd" if cost == "seconds" else "fwd_bwd_tokens"
    return [s[field] / base for s in run["steps"]]

# -----------------------------------------------------------------------------
# the two commands


def plan(device, budgets, methods, steps_config, runs_by_method=None, cost="seconds"):
    """{method: (priced_by, [steps afforded at each budget])}: a method the device gives no ratio
    for takes the mean of its runs' (this CPU's), or is left out when none was read."""
    f, out = device["share"], {}
    base = None
    if runs_by_method is not None:
        f0, base = measured(runs_by_method, cost)
        f = f if f is not None else f0
    if f is None:
        raise ValueError(f"device {device['name']}: its share is measured in runs: pass bench.py "
                         "folders to plan from")
    for m in methods:
        config = dict(steps_config, method=m)
        if device_ratios(device, m, config, 1) is not None:
            ratios_of = lambda n, m=m, c=config: device_ratios(device, m, c, n)  # noqa: E731
        elif runs_by_method and m in runs_by_method:
            rs = [r for sets in runs_by_method[m].values() for r in sets]
            mean = np.mean([np.mean(run_ratios(device, r, base, cost)) for r in rs])
            ratios_of = lambda n, mean=mean: [mean] * n  # noqa: E731
        else:
            out[m] = (f"no ratio on {device['name']} and no runs of {m} read", None)
            continue
        out[m] = (priced_by(device, m, cost), [affordable(x, f, ratios_of) for x in budgets])
    return f, out


def read(runs_by_method, device, budget, cost="seconds"):
    """[row]: for each method and run length, each seed's crossing of the budget (GRPO steps), its
    accuracy there and its difference to GRPO's at step `budget`, seed by seed."""
    f0, base = measured(runs_by_method, cost)
    f = device["share"] if device["share"] is not None else f0
    grpo = max(runs_by_method["grpo"].items())[1]  # its longest runs
    ref = {r["seed"]: accuracy_at(r["history"], budget) for r in grpo
           if len(r["steps"]) >= budget - 1e-9}
    rows = []
    for m, sets in runs_by_method.items():
        for n, rs in sorted(sets.items()):
            seeds = {}
            for r in rs:
                s = crossing(step_costs(f, run_ratios(device, r, base, cost)), budget)
                seeds[r["seed"]] = None if s is None else (s, accuracy_at(r["history"], s))
            crossed = {k: v for k, v in seeds.items() if v is not None}
            rows.append({
                "method": m, "steps": n, "priced_by": priced_by(device, m, cost),
                "seeds": len(rs), "crossed": len(crossed),
                "step": float(np.mean([v[0] for v in crossed.values()])) if crossed else None,
                "accuracy": float(np.mean([v[1] for v in crossed.values()])) if crossed else None,
                "diffs": [v[1] - ref[k] for k, v in sorted(crossed.items()) if k in ref]})
    return f, rows


def plan_table(device, f, budgets, planned):
    head = (f"{device['name']}: generation {f:.3f} of GRPO's step ({device['source']}). The steps "
            "a run planned for each budget affords (its schedule spanning them):")
    cols = ["method", "update priced by"] + [f"{x:g} GRPO steps" for x in budgets]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for m, (words, steps) in planned.items():
        cells = ["-"] * len(budgets) if steps is None else [f"{s:.1f}" for s in steps]
        lines.append("| " + " | ".join([m, words] + cells) + " |")
    return "\n".join(lines)


def read_table(device, f, budget, rows, mean_ci):
    head = (f"{device['name']}: generation {f:.3f} of GRPO's step ({device['source']}); a budget "
            f"of {budget:g} GRPO steps:")
    cols = ["method", "run steps", "update priced by", "crosses the budget at step",
            "accuracy % there", "Δ accuracy vs GRPO (paired, points)", "seeds crossing"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        if r["step"] is None:
            step = acc = diff = "ends before the budget"
        else:
            step, acc = f"{r['step']:.1f}", f"{100 * r['accuracy']:.1f}"
            mean, half = mean_ci(r["diffs"]) if r["diffs"] else (None, None)
            diff = "-" if mean is None else f"{100 * mean:+.1f}" + (
                "" if half is None else f" ± {100 * half:.1f}") + f" (n = {len(r['diffs'])})"
        lines.append("| " + " | ".join([r["method"], str(r["steps"]), r["priced_by"], step, acc,
                                        diff, f"{r['crossed']}/{r['seeds']}"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("command", choices=("plan", "read"))
    p.add_argument("folders", nargs="*", help="bench.py --out folders (read; plan: optional, for "
                                              "the ratios a device lacks)")
    p.add_argument("--device", action="append", default=[],
                   help=f"{', '.join(DEVICES)}, cpu, NAME:share=F,METHOD=R,METHOD@RHO_S=R, or a "
                        "JSON file (repeatable)")
    p.add_argument("--budgets", default="", help="budgets in GRPO steps, e.g. 30,60")
    p.add_argument("--steps", type=int, default=0, help="plan: GRPO's steps (budgets default to "
                                                        "half and all of them)")
    p.add_argument("--methods", default="grpo,d3s", help="plan: which methods")
    p.add_argument("--cost", default="seconds", choices=("seconds", "tokens"),
                   help="this CPU's ratio: update seconds, or tokens forwarded and back-propagated")
    args = p.parse_intermixed_args(argv)  # folders before or after the flags
    try:
        chosen = [d for spec in (args.device or ["cpu"]) for d in devices(spec)]
        budgets = ([float(x) for x in args.budgets.split(",")] if args.budgets else
                   [args.steps / 2, args.steps] if args.steps else [])
        if not budgets or min(budgets) <= 0:
            raise ValueError("give --budgets (GRPO steps, > 0) or --steps")
        runs = runs_of(args.folders) if args.folders else None
        if args.command == "plan":
            from train import Config  # the schedule's defaults
            ratios = {k: getattr(Config, k) for k in KNOBS}
            for d in chosen:
                f, planned = plan(d, budgets, args.methods.split(","), ratios, runs, args.cost)
                print(plan_table(d, f, budgets, planned) + "\n")
            return 0
        if runs is None:
            raise ValueError("read: pass the bench.py folders whose runs to read")
        from experiments.bench import mean_ci  # here: plan and a wrong call need no bench
        for d in chosen:
            for x in budgets:
                f, rows = read(runs, d, x, args.cost)
                print(read_table(d, f, x, rows, mean_ci) + "\n")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
