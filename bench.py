"""
Does D3S learn more with less? Train every method with every seed on the tiny world, side by side.

    python bench.py --methods grpo,d3s --seeds 2 --steps 20 --jobs 2     # ~3 minutes on 2 CPU cores
    python bench.py --methods all --seeds 5                              # the README's table
    python bench.py --methods d3s --s_init 0.5 --t_init 0.4 --out out/tune-a   # tune the schedule
    python bench.py --methods grpo,d3s --seeds 1 --steps 2 --prompts_per_step 2 --group_size 4  # smoke test

Seeds are 0..N-1. --steps, --eval_every, --eval_size, --lr, --s_init, --s_final, --t_init, --t_final,
--prompts_per_step and --group_size go to train.Config unchanged; left out, they are train.py's
defaults. --jobs J runs J runs at once in separate processes, each with cores // J torch threads
(--threads overrides it; 1 is much faster on a machine whose cores are busy).

Every run is train.train() itself (no second copy of the loop), from the same warmed-up model, with
the same prompts in the same order for a given seed (train.batch_at), and the same held-out subset
(greedy). What each run writes (log.jsonl, config.json) lands in DIR/runs/<method>-seed<k>; bench
reads it back and writes:
  DIR/results.md    the table below, as printed
  DIR/results.json  every run's held-out history and per-step rows, and the table's numbers as printed
  DIR/bench.png     held-out accuracy against step and against tokens trained (seed mean, a +-std
                    band), and the gradient norm per step (the paper argues D3S raises it)

The table, one row per method:
  final acc %      held-out accuracy after the last step, mean +- sample std over seeds (0 for one)
  best acc %       each run's best held-out accuracy, averaged over seeds
  steps to GRPO    the first evaluated step at which the seed-mean curve reaches GRPO's final mean
  rollouts, tokens what the loss was computed on (kept rollouts / kept tokens summed over the run),
                   mean over seeds, and as a share of GRPO's
  gen s, upd s     seconds per step: generating the rollouts, and everything after (reward to update)
  total s          the wall time of the method's runs, added up
A run that raises is listed as failed with its one-line error; the other runs go on.
"""
import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
import traceback

import matplotlib
matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

import d3s
import tiny
import train

# Per-step fields of log.jsonl kept in results.json: what the table and the plot are computed from.
STEP_FIELDS = ("step", "reward", "kept", "rollouts", "tokens", "valid", "grad_norm", "t_gen", "t_upd", "skipped")
# Config fields bench passes through when given on the command line (the rest: train.py's defaults).
PASS_THROUGH = ("steps", "eval_every", "eval_size", "lr", "s_init", "s_final", "t_init", "t_final",
                "prompts_per_step", "group_size")

# -----------------------------------------------------------------------------
# one run


def run_one(cfg):
    """Train one (method, seed) with train.train; return its history, per-step rows and wall time,
    or its one-line error. Runs in a worker process when --jobs > 1."""
    t0 = time.time()
    os.makedirs(cfg.out_dir, exist_ok=True)
    result = {"method": cfg.method, "seed": cfg.seed, "out_dir": cfg.out_dir, "history": [], "steps": [],
              "wall": 0.0, "error": None}
    with open(os.path.join(cfg.out_dir, "train.log"), "w") as logf:  # train.py's text lines, for reading later
        try:
            result["history"] = train.train(cfg, log=lambda line: print(line, file=logf, flush=True))
            with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            result["steps"] = [{k: row[k] for k in STEP_FIELDS} for row in rows]
            # [ours] the final checkpoint (weights + AdamW state) is not needed for the table; dropping
            # it keeps a 40-run benchmark folder small.
            shutil.rmtree(os.path.join(cfg.out_dir, "checkpoint"), ignore_errors=True)
        except Exception as e:  # reported in the table; the other runs go on
            traceback.print_exc(file=logf)
            lines = str(e).strip().splitlines()
            result["error"] = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    result["wall"] = time.time() - t0
    return result


def _init_worker(threads):
    torch.set_num_threads(threads)  # J workers share the cores instead of each taking all of them

# -----------------------------------------------------------------------------
# the table


def mean_std(xs):
    """Mean and sample std (0 for a single seed)."""
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def curve(runs):
    """Seed-mean (and std) held-out accuracy and tokens trained at each evaluated step."""
    steps = [h["step"] for h in runs[0]["history"]]  # the same config gives the same evaluation steps
    acc = [[r["history"][i]["accuracy"] for r in runs] for i in range(len(steps))]
    tok = [[r["history"][i]["tokens"] for r in runs] for i in range(len(steps))]
    return {"step": steps, "acc_mean": [statistics.mean(a) for a in acc], "acc_std": [mean_std(a)[1] for a in acc],
            "tokens_mean": [statistics.mean(t) for t in tok]}


def aggregate(results, methods):
    """One row per method, its numbers rounded exactly as the table prints them; and the curves."""
    rows, curves = [], {}
    for m in methods:
        runs = [r for r in results if r["method"] == m and r["error"] is None]
        failed = [f"seed {r['seed']}: {r['error']}" for r in results if r["method"] == m and r["error"]]
        row = {"method": m, "runs": len(runs), "failed": failed,
               "wall": round(sum(r["wall"] for r in results if r["method"] == m))}
        if runs:
            curves[m] = curve(runs)
            final_mean, final_std = mean_std([r["history"][-1]["accuracy"] for r in runs])
            row.update(
                final_mean=round(100 * final_mean, 1), final_std=round(100 * final_std, 1),
                best=round(100 * statistics.mean(max(h["accuracy"] for h in r["history"]) for r in runs), 1),
                rollouts=round(statistics.mean(sum(s["kept"] for s in r["steps"]) for r in runs)),
                tokens=round(statistics.mean(sum(s["tokens"] for s in r["steps"]) for r in runs)),
                t_gen=round(statistics.mean(s["t_gen"] for r in runs for s in r["steps"]), 2),
                t_upd=round(statistics.mean(s["t_upd"] for r in runs for s in r["steps"]), 2),
            )
        rows.append(row)
    # relative to GRPO: its final seed-mean accuracy (unrounded) and its rollouts / tokens
    grpo = next((r for r in rows if r["method"] == "grpo" and r["runs"]), None)
    for row in rows:
        if not row["runs"]:
            continue
        if grpo is None:
            row.update(steps_to_grpo="-", rollouts_pct=None, tokens_pct=None)
            continue
        target = curves["grpo"]["acc_mean"][-1]
        c = curves[row["method"]]
        hit = [s for s, a in zip(c["step"], c["acc_mean"]) if a >= target - 1e-9]  # float sums of k/n
        row["steps_to_grpo"] = hit[0] if hit else "not reached"
        row["rollouts_pct"] = round(100 * row["rollouts"] / max(grpo["rollouts"], 1), 1)
        row["tokens_pct"] = round(100 * row["tokens"] / max(grpo["tokens"], 1), 1)
    return rows, curves


def format_table(rows):
    """The markdown table (and nothing else)."""
    def pct(x):
        return "" if x is None else f" ({x:.1f}%)"
    lines = ["| method | final acc % | best acc % | steps to GRPO | rollouts trained | tokens trained "
             "| gen s/step | upd s/step | total s | runs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        status = f"{r['runs']}/{r['runs'] + len(r['failed'])}" + "".join(f"; failed {f}" for f in r["failed"])
        if not r["runs"]:
            lines.append(f"| {r['method']} | failed | - | - | - | - | - | - | {r['wall']} | {status} |")
            continue
        lines.append(
            f"| {r['method']} | {r['final_mean']:.1f} ± {r['final_std']:.1f} | {r['best']:.1f} | {r['steps_to_grpo']} "
            f"| {r['rollouts']}{pct(r['rollouts_pct'])} | {r['tokens']}{pct(r['tokens_pct'])} "
            f"| {r['t_gen']:.2f} | {r['t_upd']:.2f} | {r['wall']} | {status} |")
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# the plot


def smooth(y, alpha=0.3):
    """[ours] A light exponential moving average: the gradient norm is noisy step to step."""
    out, acc = [], y[0]
    for v in y:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def plot(results, curves, path):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=80)
    for m, c in curves.items():
        mean, std = np.array(c["acc_mean"]), np.array(c["acc_std"])
        for ax, x in ((axes[0], c["step"]), (axes[1], c["tokens_mean"])):
            line, = ax.plot(x, mean, marker=".", label=m)
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        runs = [r for r in results if r["method"] == m and r["error"] is None]
        grad = np.mean([[s["grad_norm"] for s in r["steps"]] for r in runs], axis=0)  # seed mean, per step
        axes[2].plot([s["step"] for s in runs[0]["steps"]], smooth(list(grad)), label=m, color=line.get_color())
    for ax, xlabel, ylabel in zip(axes, ("step", "tokens trained", "step"),
                                  ("held-out accuracy", "held-out accuracy", "gradient norm (before clipping, EMA)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--methods", default="grpo,d3s", help=f"comma-separated, or all: {','.join(d3s.METHODS)}")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per method")
    p.add_argument("--out", default=os.path.join("out", "bench"), help="results folder")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    p.add_argument("--model", default="tiny", help="tiny, or a model folder (every run starts from it)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda (default: train.py's, auto)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores // jobs)")
    for name in PASS_THROUGH:  # None: train.py's default for the world
        kind = int if name in ("steps", "eval_every", "eval_size", "prompts_per_step", "group_size") else float
        p.add_argument(f"--{name}", type=kind, default=None, help="passed to train.Config")
    return p.parse_args(argv)


def configs(args):
    """One train.Config per (method, seed), checked up front so bad knobs fail before any run starts."""
    names = d3s.METHODS if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    methods = list(dict.fromkeys(names))  # in order, each once
    for m in methods:
        if m not in d3s.METHODS:
            raise ValueError(f"--methods: {m!r} is unknown; choose from {', '.join(d3s.METHODS)} or all")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    knobs = {name: getattr(args, name) for name in PASS_THROUGH if getattr(args, name) is not None}
    if args.device is not None:
        knobs["device"] = args.device
    # only the final checkpoint (deleted by run_one); no step lines on the terminal, they go to train.log
    knobs.update(model=args.model, save_every=10 ** 9, progress=False)
    cfgs = [train.Config(method=m, seed=s, out_dir=os.path.join(args.out, "runs", f"{m}-seed{s}"), **knobs)
            for m in methods for s in range(args.seeds)]
    train.resolve(cfgs[0])  # raises the one-line ValueError of train.check on a bad lr, ratio, ...
    return methods, cfgs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        methods, cfgs = configs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.model == "tiny":
        tiny.pretrained()  # build out/tiny once, here, so that parallel workers do not race to build it
    os.makedirs(args.out, exist_ok=True)
    # [ours] --threads 1 on a busy machine: a tiny model's generate is ~100x slower when its
    # OpenMP threads fight other processes for the cores.
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    t0, results = time.time(), []
    bar = tqdm(total=len(cfgs), desc="bench", unit="run", dynamic_ncols=True)

    def done(r):
        results.append(r)
        acc = f"acc {r['history'][-1]['accuracy']:.3f}" if r["error"] is None else f"FAILED {r['error']}"
        tqdm.write(f"{r['method']} seed {r['seed']}: {acc} in {r['wall']:.0f}s ({r['out_dir']})")
        bar.update(1)

    if args.jobs == 1:
        _init_worker(threads)
        for cfg in cfgs:
            done(run_one(cfg))
    else:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no forked torch state
        with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_init_worker, initargs=(threads,)) as pool:
            futures = {pool.submit(run_one, cfg): cfg for cfg in cfgs}
            for fut in cf.as_completed(futures):
                try:
                    done(fut.result())
                except Exception as e:  # the worker itself died (killed, out of memory): still one row
                    cfg = futures[fut]
                    done({"method": cfg.method, "seed": cfg.seed, "out_dir": cfg.out_dir, "history": [],
                          "steps": [], "wall": 0.0, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    bar.close()
    wall = time.time() - t0

    order = {(c.method, c.seed): i for i, c in enumerate(cfgs)}
    results.sort(key=lambda r: order[(r["method"], r["seed"])])
    rows, curves = aggregate(results, methods)
    table = format_table(rows)
    command = "python bench.py " + " ".join(argv)
    shared = {k: v for k, v in dataclasses.asdict(train.resolve(cfgs[0])).items()  # what every run shares
              if k not in ("method", "seed", "out_dir")}
    print(table)
    print(f"{len(cfgs)} runs in {wall:.0f}s with {args.jobs} job(s); {args.out}/results.md, results.json, bench.png")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"`{command.strip()}`\n\n{table}\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command.strip(), "wall": wall, "config": shared,
                   "table": rows, "curves": curves, "runs": results}, f, indent=1)
    if curves:
        plot(results, curves, os.path.join(args.out, "bench.png"))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
