"""
How far does an update move the weights, GRPO against D3S? Does AdamW cancel the token-mean divisor?

    python experiments/step_size.py run --model tiny --lr 5e-5 --updates_per_batch 4 --out A.json
    python experiments/step_size.py run --model tiny-weak --tuned TUNED.json --out B.json  # tuned
    python experiments/step_size.py show A.json B.json --png step-size.png  # the table and the plot

`bash experiments/study.sh weak` runs it in both worlds for experiments/study.md.

The question (experiments/study.md, section F). A step is one rollout batch and its K updates.
GRPO's loss is a mean over every token of the step, the tokens of zero-variance groups (all rewards
equal: advantage 0, nothing to learn) included, so its gradient shrinks with the share of
informative groups; D3S's is a mean over the tokens it keeps, most of them with a nonzero
advantage, so its gradient is larger (experiments/study.md, section A: about 1 / the share of tokens
kept). Under SGD a larger gradient is a larger update. AdamW divides each parameter's update by a
running root-mean-square of its gradient, so a gradient scaled by a constant moves the weights as
far; but the running mean remembers earlier updates (beta2 0.999), so a gradient that is smaller
than usual on one step (GRPO on a step with few informative groups) still moves them less. And
before AdamW, the clip (grad_clip 1.0) scales any gradient norm above 1 down to 1. This script
measures what reaches the weights, instead of asserting it.

`run` trains each method with each seed through train.train itself (the same code as every study
run) and records, without changing what is computed:
  per update  the gradient norm before clipping (train.optimizer_step's own) and ||delta theta||,
              the L2 norm of the change of all weights made by that optimizer step
  per step    ||theta after its K updates - theta before||, and from log.jsonl the share of
              zero-variance groups (zero_var) and the tokens trained
`show` prints, per world and method, from the steps after the first SKIP = 5 (AdamW's first
updates, bias-corrected, move every weight by about lr whatever the gradient: a transient, the same
for every method): the mean gradient norm, the share of updates the clip at 1.0 cut, the mean
||delta theta|| per update and per step (that over lr; lr * sqrt(number of weights) would be every
weight moving by lr), and how the step's ||delta theta|| follows the informative share 1 - zero_var:
the Pearson correlation over steps and the slope, as the change of ||delta theta|| (relative to its
run's mean) per 0.1 more of the share (seeds pooled, each run's values taken relative to its own
mean). One thread (torch.set_num_threads(1)); runs one after another.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from machinery import config  # noqa: E402
import train  # noqa: E402

SKIP = 5  # steps left out of `show`'s numbers: AdamW's first, bias-corrected updates


def flat(model):
    """All weights as one float32 vector (a copy)."""
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def measured_run(cfg):
    """train.train(cfg) with the weights' change recorded per update and per step."""
    updates, starts = [], []  # starts: the weights before each step's generation
    optimizer_step, generate_groups = train.optimizer_step, train.generate_groups

    def step_and_measure(model, optimizer, grad_clip, loss):
        before = flat(model)
        out = optimizer_step(model, optimizer, grad_clip, loss)
        if out.get("applied", True):  # a skipped update (zero or non-finite gradient) moved nothing
            updates.append({"step": len(starts) - 1, "grad_norm": out["grad_norm"],
                            "delta": (flat(model) - before).norm().item()})
        return out

    def generate_and_mark(model, *args, **kwargs):  # train.py's step 1, once per step
        starts.append(flat(model))
        return generate_groups(model, *args, **kwargs)

    train.optimizer_step, train.generate_groups = step_and_measure, generate_and_mark
    try:
        given = [f.name for f in dataclasses.fields(cfg)]
        history = train.train(cfg, log=lambda line: None, given=given)
    finally:
        train.optimizer_step, train.generate_groups = optimizer_step, generate_groups
    with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # the net change of each step but the last (its end is not marked by a next generation)
    batches = [{"step": r["step"], "zero_var": r["zero_var"], "tokens": r["tokens"],
                "updates": r["updates"], "delta": (b - a).norm().item()}
               for r, a, b in zip(rows, starts, starts[1:])]
    return {"method": cfg.method, "seed": cfg.seed, "lr": cfg.lr,
            "updates_per_batch": cfg.updates_per_batch, "grad_clip": cfg.grad_clip,
            "history": history, "updates": updates, "batches": batches}


def run(args):
    torch.set_num_threads(1)
    tuned = json.load(open(args.tuned)) if args.tuned else None
    runs, t0 = [], time.time()
    for method in args.methods.split(","):
        knobs = {"model": args.model, "method": method, "steps": args.steps, "eval_every": 0,
                 "save_every": 0, "overwrite": True}
        if tuned:
            knobs.update(lr=tuned["lr"][method],
                         updates_per_batch=tuned["updates_per_batch"][method])
        for name in ("lr", "updates_per_batch"):
            if getattr(args, name) is not None:
                knobs[name] = getattr(args, name)
        for seed in range(args.seeds):
            mine = {**knobs, "seed": seed, "out_dir": os.path.join("out", "step-size",
                                                                   f"{args.model}-{method}-{seed}")}
            cfg = config.resolve(train.Config(**mine), given=mine)
            runs.append(measured_run(cfg))
            print(f"{args.model} {method} seed {seed}: {len(runs[-1]['updates'])} updates, "
                  f"{time.time() - t0:.0f}s", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model,
                   "command": "python experiments/step_size.py " + " ".join(sys.argv[1:]),
                   "runs": runs}, f)


def pearson(xs, ys):
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def summary(runs, skip=SKIP):
    """The table's numbers for one method's runs (all seeds), from step `skip` on."""
    ups = [(u, r) for r in runs for u in r["updates"] if u["step"] >= skip]
    bat = [b for r in runs for b in r["batches"] if b["step"] >= skip]
    # per step, relative to its run's mean: seeds pooled without their offsets
    rel_delta, rel_info = [], []
    for r in runs:
        d = [b["delta"] for b in r["batches"] if b["step"] >= skip]
        i = [1 - b["zero_var"] for b in r["batches"] if b["step"] >= skip]
        rel_delta += [x / statistics.mean(d) for x in d]
        rel_info += [x - statistics.mean(i) for x in i]
    lr = runs[0]["lr"]
    return {"lr": lr, "K": runs[0]["updates_per_batch"], "seeds": len(runs), "updates": len(ups),
            "grad_norm": statistics.mean(u["grad_norm"] for u, _ in ups),
            "clipped": sum(u["grad_norm"] > r["grad_clip"] > 0 for u, r in ups) / len(ups),
            "delta_update": statistics.mean(u["delta"] for u, _ in ups),
            "delta_batch": statistics.mean(b["delta"] for b in bat),
            "delta_batch_over_lr": statistics.mean(b["delta"] for b in bat) / lr,
            "zero_var": statistics.mean(b["zero_var"] for b in bat),
            "corr_info": pearson(rel_info, rel_delta),
            # least squares: relative ||delta theta|| = 1 + slope * (share - its mean); x 0.1:
            # per 0.1 of share
            "slope_info": 0.1 * sum(x * y for x, y in zip(rel_info, rel_delta))
            / sum(x * x for x in rel_info)}


def show(args):
    rows = []
    print(f"steps {SKIP} and later; Δθ: the change of all weights (L2 norm)")
    print("| world | method | lr | K | seeds | grad norm / update (pre-clip) | clipped "
          "| ‖Δθ‖ / update | ‖Δθ‖ / step | ÷ lr | zero-var | corr(‖Δθ‖ step, 1 - zero-var) "
          "| per +0.1 of it |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        for method in dict.fromkeys(r["method"] for r in data["runs"]):
            s = summary([r for r in data["runs"] if r["method"] == method])
            rows.append((data["model"], method, s,
                         [r for r in data["runs"] if r["method"] == method]))
            print(f"| {data['model']} | {method} | {s['lr']:g} | {s['K']} | {s['seeds']} "
                  f"| {s['grad_norm']:.2f} | {s['clipped']:.2f} | {s['delta_update']:.4f} "
                  f"| {s['delta_batch']:.4f} "
                  f"| {s['delta_batch_over_lr']:.0f} | {s['zero_var']:.2f} | {s['corr_info']:+.2f} "
                  f"| {100 * s['slope_info']:+.1f}% |")
    if args.png:
        plot(rows, args.png)


def plot(rows, path):
    """||delta theta|| per step against step, and against the informative share, per world."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    worlds = list(dict.fromkeys(w for w, *_ in rows))
    fig, axes = plt.subplots(2, len(worlds), figsize=(6 * len(worlds), 8), dpi=80, squeeze=False)
    for col, world in enumerate(worlds):
        top, bottom = axes[0, col], axes[1, col]
        for w, method, s, runs in rows:
            if w != world:
                continue
            steps = [b["step"] for b in runs[0]["batches"]]
            mean = [statistics.mean(r["batches"][i]["delta"] for r in runs)
                    for i in range(len(steps))]
            line, = top.plot(steps, mean, label=f"{method} (lr {s['lr']:g}, K {s['K']})")
            later = [b for r in runs for b in r["batches"] if b["step"] >= SKIP]
            bottom.scatter([1 - b["zero_var"] for b in later], [b["delta"] for b in later], s=8,
                           alpha=0.5, color=line.get_color(),
                           label=f"{method}: corr {s['corr_info']:+.2f}")
        top.set_title(world)
        top.set_xlabel("step")
        top.set_ylabel("‖Δθ‖ of the step (seed mean)")
        bottom.set_xlabel("share of the step's informative groups (1 - zero-var)")
        bottom.set_ylabel(f"‖Δθ‖ of the step (steps {SKIP} and later)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train and record the step sizes")
    r.add_argument("--model", default="tiny", help="a tiny world: tiny, tiny-weak, ...")
    r.add_argument("--methods", default="grpo,d3s")
    r.add_argument("--seeds", type=int, default=2, help="seeds 0 .. N-1")
    r.add_argument("--steps", type=int, default=60)
    r.add_argument("--tuned", default=None, help="a bench.py tuned.json: each method's lr and K")
    r.add_argument("--lr", type=float, default=None, help="every method's lr (over --tuned's)")
    r.add_argument("--updates_per_batch", type=int, default=None,
                   help="every method's K (over --tuned's)")
    r.add_argument("--out", required=True, help="the JSON of every update and step")
    s = sub.add_parser("show", help="the table (and a plot) of one or more run files")
    s.add_argument("files", nargs="+")
    s.add_argument("--png", default=None)
    args = p.parse_args(argv)
    run(args) if args.command == "run" else show(args)


if __name__ == "__main__":
    main()
