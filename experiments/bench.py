"""
Does D3S learn more with less? Train every method with every seed on a tiny world, side by side, and
say with what confidence each one learns faster or slower than GRPO.

    python experiments/bench.py --methods grpo,d3s --seeds 2 --steps 20 --jobs 2 --threads 1  # mins
    # a table like experiments/study.md's
    python experiments/bench.py --methods all --seeds 5 --jobs 2 --threads 1
    # a smoke test
    python experiments/bench.py --methods grpo,d3s --seeds 1 --steps 2 --prompts_per_step 2 \
        --group_size 4
    # the study's protocol (experiments/study.md): each method's lr from a grid on tuning seeds 100,
    # 101 ...
    python experiments/bench.py --methods grpo,d3s --lr_grid 5e-5,1e-4,2e-4 --seeds 2 \
        --seed_start 100 --out out/tune
    # ... then 8 reported seeds 0..7 with the chosen lrs, evaluated on the whole test split every
    # 10 steps
    python experiments/bench.py --methods grpo,d3s --tuned out/tune/tuned.json --seeds 8 \
        --eval_size all --eval_every 10 --out out/study
    # each method's (lr, K updates per step) from both grids
    python experiments/bench.py --methods grpo,d3s --lr_grid 5e-5,1e-4 --updates_grid 2,4 \
        --seeds 2 --seed_start 100 --out out/tune-k

The runs. Seeds are seed_start .. seed_start + N - 1. A seed fixes the prompts and their order
(train.batch_at), so a method's run k and GRPO's run k see the same prompts: differences to GRPO are
paired by seed. Every run is train.train() itself (no second copy of the loop), from the same
warmed-up model (--model: tiny, a harder world of tiny.WORLDS such as tiny-long, or a folder), and
is evaluated greedily on the same held-out questions (--eval_size all: the world's whole test split,
1036 questions for tiny). These flags go to train.Config unchanged, and left out are train.py's
defaults: --steps --eval_every --eval_size --prompts_per_step --group_size --max_new_tokens
--micro_batch_size --loss --updates_per_batch --optimizer --grad_clip. --s_init --s_final --t_init
--t_final go only to the methods that read them (schedule_knobs; train.py refuses them elsewhere).

The learning rate: --lr 1e-4 for every method, --lr grpo=1e-4,d3s=2e-4 per method, or --tuned FILE,
the tuned.json of a tuning run (each method's lr, and its K when K was tuned too). --lr_grid
5e-5,1e-4,2e-4 (and --updates_grid 2,4 for K = --updates_per_batch) is the tuning mode: every method
at every lr (and K), and DIR/tuned.json gets each method's setting with the highest mean AUC over
the seeds [ours: AUC rather than final accuracy, because one number per run from every evaluation is
less noisy than the last one, and it marks down a run that climbs and then collapses; a tie, to 0.1
point, goes to the smaller K, then the smaller lr]. Tune on seeds that are not reported
(--seed_start 100).

Finished runs are kept. A run that finished leaves DIR/runs/<run>/result.json with its resolved
config; the same command again reuses it instead of training (a failed or interrupted run is run
again from the start, in its own folder: bench passes train.py overwrite=True). A finished run
whose config differs from the one asked for is an error that names the differences (use another
--out, or delete the folder): an old result never silently stands for a new config. (The code is
not compared: after changing train.py, use a new --out.)

--jobs J runs J runs at once in separate processes, each with cores // J torch threads (--threads
overrides it; 1 is much faster on a machine whose cores are busy).

What bench writes in DIR (--out):
  results.md    the command and the table, as printed
  results.json  the command, every run (its train.py command line, held-out history, per-step rows,
                wall time), the table's numbers as printed, and the curves of the plot
  bench.png     held-out accuracy against step and against tokens trained, the paired difference to
                GRPO against step (seed means with 95% confidence bands), and the gradient norm per
                step
  tuned.json    tuning mode only: {"lr": {method: lr}, "updates_per_batch": {method: K}, "auc":
                ...}, what --tuned FILE reads

The table, one row per method (and lr and K). Every "±" is a 95% confidence interval over seeds from
Student's t with n - 1 degrees of freedom: mean ± t(0.975, n-1) · s / sqrt(n), s the sample std
(no interval for one seed):
  lr, K            the row's learning rate and updates per step (--updates_per_batch; a step is one
                   rollout batch, an update one optimizer step on a mini-batch)
  final acc %      held-out accuracy after the last step
  Δ final          paired, in points: per seed, final accuracy minus GRPO's with the same seed
  AUC %            area under the accuracy-vs-step curve (trapezoid over the evaluated steps, step 0
                   included) divided by the step span: the run's mean held-out accuracy over
                   training
  Δ AUC            the same, paired to GRPO
  steps to GRPO    the first evaluated step at which the seed-mean curve reaches GRPO's final
                   seed-mean accuracy; in brackets a 95% bootstrap interval: BOOTSTRAP resamples of
                   the seeds (with replacement, the same seeds for the method and for GRPO, numpy
                   seed 0), each with its own target; a resample that never reaches it counts as
                   "never" (later than every step), so an upper end "never" means more than 2.5% of
                   resamples never did (results.json: `reached`, the share of resamples that reach
                   it)
  s to GRPO        seconds of generation + update (train.py's t_gen + t_upd; evaluation not counted)
                   in the steps before "steps to GRPO", mean over seeds
  rollouts, tokens what the loss was computed on (kept rollouts / kept tokens summed over the run),
                   mean over seeds, and as a share of GRPO's
  zero-var %       the share of the step's zero-variance groups, whose rewards are all equal (all
                   right or all wrong: every advantage 0, nothing to learn), log.jsonl's zero_var,
                   averaged over the run's steps; mean ± interval over seeds. It depends on the
                   policy, so on the method: a method that learns faster leaves fewer all-wrong
                   groups (and more all-right ones)
  gen s, upd s     seconds per step: generating the rollouts, and everything after (reward to
                   update)
  total s          the wall time of the method's runs, added up (runs share the cores: compare
                   loosely)
A run that raises is listed as failed with its one-line error; the other runs go on.
"""
import argparse
import concurrent.futures as cf
import dataclasses
import functools
import json
import math
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from machinery import config
import d3s
from machinery import tiny
import train
from machinery.data import load_problems
from machinery.model import load_model

# Per-step fields of log.jsonl kept in results.json: what the table and the plot are computed from.
STEP_FIELDS = ("step", "reward", "zero_var", "kept", "rollouts", "tokens", "valid", "grad_norm",
               "t_gen", "t_upd", "nonfinite")
# train.Config fields bench passes on when given on the command line (the rest: train.py's
# defaults).
PASS_THROUGH = {"steps": int, "eval_every": int, "eval_size": int, "prompts_per_step": int,
                "group_size": int, "max_new_tokens": int, "micro_batch_size": int,
                "updates_per_batch": int, "loss": str, "optimizer": str, "grad_clip": float}
RATIOS = ("s_init", "s_final", "t_init", "t_final")  # passed only to the methods that read them
CONFIDENCE = 0.95   # of every interval
BOOTSTRAP = 1000    # resamples of the seeds for the interval of "steps to GRPO"

# -----------------------------------------------------------------------------
# the runs


def schedule_knobs(method):
    """The keep-ratio knobs a method reads (d3s.METHODS): rho_s if it selects samples, rho_t if it
    selects tokens, their *_final only on the linear schedule. entropy (80/20) keeps a fixed
    t_keep."""
    spec = d3s.METHODS[method]
    final = spec["schedule"] == "linear"
    knobs = []
    if spec["sample"] != "none":
        knobs += ["s_init", "s_final"] if final else ["s_init"]
    if spec["token"] != "none" and "t_keep" not in spec:
        knobs += ["t_init", "t_final"] if final else ["t_init"]
    return knobs


def as_json(cfg):
    """A config as it reads back from JSON: what a saved config is compared with."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def train_command(cfg):
    """The train.py command line that is this run: every knob that differs from train.Config's
    default."""
    default = train.Config()
    return "python train.py " + " ".join(f"--{f.name} {getattr(cfg, f.name)}"
                                         for f in dataclasses.fields(cfg)
                                         if getattr(cfg, f.name) != getattr(default, f.name))


def finished(cfg):
    """The saved result of cfg's run folder if that run finished with exactly this config, else
    None. A finished run with another config is a ValueError that names the differences."""
    path = os.path.join(cfg.out_dir, "result.json")
    if not os.path.isfile(path):
        return None  # never run, failed or interrupted: run it (again)
    with open(path) as f:
        saved = json.load(f)
    have, want = saved["config"], as_json(cfg)
    if have != want:
        diff = [f"{k} {have.get(k, 'absent')} there, {want.get(k, 'absent')} now"
                for k in dict.fromkeys([*want, *have])
                if have.get(k, "absent") != want.get(k, "absent")]
        raise ValueError(f"{cfg.out_dir} holds a finished run with another config "
                         f"({'; '.join(diff)}); use another --out, or delete that folder to run it "
                         "again")
    return saved["result"]


def run_one(cfg):
    """Train one (method, lr, seed) with train.train; return its history, per-step rows and wall
    time, or its one-line error. A finished run also writes result.json (written last, so it marks
    the run finished). Runs in a worker process when --jobs > 1."""
    t0 = time.time()
    os.makedirs(cfg.out_dir, exist_ok=True)
    result = {"method": cfg.method, "lr": cfg.lr, "updates_per_batch": cfg.updates_per_batch,
              "seed": cfg.seed, "out_dir": cfg.out_dir, "command": train_command(cfg),
              "history": [], "steps": [], "wall": 0.0, "error": None}
    # train.log: train.py's text lines, for reading later
    with open(os.path.join(cfg.out_dir, "train.log"), "w") as logf:
        try:
            # cfg is resolved (configs()): every knob is as the run uses it, so none is a default to
            # fill in again
            given = [f.name for f in dataclasses.fields(cfg)]
            log = functools.partial(print, file=logf, flush=True)
            result["history"] = train.train(cfg, log=log, given=given)
            with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            result["steps"] = [{k: row[k] for k in STEP_FIELDS} for row in rows]
            # [ours] the final checkpoint (weights + optimizer state) is not needed for the table;
            # dropping it keeps a 200-run study folder small.
            shutil.rmtree(os.path.join(cfg.out_dir, "checkpoint"), ignore_errors=True)
        except Exception as e:  # reported in the table; the other runs go on
            traceback.print_exc(file=logf)
            lines = str(e).strip().splitlines()
            result["error"] = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    result["wall"] = time.time() - t0
    if result["error"] is None:
        tmp = os.path.join(cfg.out_dir, "result.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"config": as_json(cfg), "result": result}, f)
        os.replace(tmp, os.path.join(cfg.out_dir, "result.json"))
    return result


def _init_worker(threads):
    torch.set_num_threads(threads)  # J workers share the cores instead of each taking all of them

# -----------------------------------------------------------------------------
# statistics over seeds


@functools.lru_cache(maxsize=None)
def t_quantile(df, q=(1 + CONFIDENCE) / 2):
    """The q quantile of Student's t with df degrees of freedom (12.706 for df 1 and q 0.975, 2.365
    for df 7): bisection on its CDF, the density integrated by Simpson's rule (there is no scipy
    here)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x):  # P(T <= x) for x >= 0
        t = np.linspace(0.0, x, 20001)
        y = c * (1 + t * t / df) ** (-(df + 1) / 2)
        return 0.5 + (t[1] - t[0]) / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum())

    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


def mean_ci(xs):
    """The mean and the half-width of its 95% t interval (None for a single value)."""
    if len(xs) < 2:
        return statistics.mean(xs), None
    return statistics.mean(xs), t_quantile(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def auc(history):
    """Area under held-out accuracy against step (trapezoid over the evaluated steps) divided by the
    step span: the run's mean accuracy over training."""
    s = [h["step"] for h in history]
    a = [h["accuracy"] for h in history]
    area = sum((s1 - s0) * (a0 + a1) / 2 for s0, s1, a0, a1 in zip(s, s[1:], a, a[1:]))
    return area / (s[-1] - s[0])


def first_reach(steps, curve, target):
    """The first evaluated step at which a curve is at or above target, or None if it never is."""
    # 1e-9: float sums of k/n
    return next((s for s, a in zip(steps, curve) if a >= target - 1e-9), None)


def reach_interval(steps, acc, base_final, resamples=BOOTSTRAP, seed=0):
    """95% bootstrap interval of first_reach: acc is (seeds, evaluations) of the method, base_final
    the final accuracy of GRPO's runs with the same seeds (paired). Each resample draws the seeds
    with replacement and takes the method's mean curve and GRPO's mean final accuracy over them; one
    that never reaches it counts as infinitely late. Returns (low, high, share of resamples that
    reach); an end is None for "never"."""
    rng = np.random.default_rng(seed)
    acc, base_final = np.asarray(acc, dtype=float), np.asarray(base_final, dtype=float)
    hits = []
    for idx in rng.integers(0, len(base_final), size=(resamples, len(base_final))):
        hit = first_reach(steps, acc[idx].mean(axis=0), base_final[idx].mean())
        hits.append(math.inf if hit is None else hit)
    # observed values
    lo, hi = np.quantile(hits, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2], method="inverted_cdf")
    never = lambda x: None if math.isinf(x) else int(x)  # noqa: E731
    return never(lo), never(hi), sum(not math.isinf(h) for h in hits) / resamples

# -----------------------------------------------------------------------------
# the table


def pct(mean_and_ci):
    """(mean, ci) of shares -> [mean %, ci %], rounded as printed (ci None for one seed)."""
    m, ci = mean_and_ci
    return [round(100 * m, 1), None if ci is None else round(100 * ci, 1)]


def key(run):
    """What a row of the table is: (method, lr, K) of a run's result or config."""
    if isinstance(run, dict):
        return run["method"], run["lr"], run["updates_per_batch"]
    return run.method, run.lr, run.updates_per_batch


def label(k):
    """A row's name in the plot and in tuned.json: "d3s lr 0.0001 K 1"."""
    method, lr, updates = k
    return f"{method} lr {lr:g} K {updates}"


def aggregate(results, keys):
    """One row per (method, lr, K) key, its numbers rounded exactly as the table prints them; and
    the curves of the plot. Comparisons are to the one GRPO row (none when there are several, as in
    tuning)."""
    ok = {k: [r for r in results if key(r) == k and r["error"] is None] for k in keys}
    grpo = [k for k in keys if k[0] == "grpo" and ok[k]]
    base = {r["seed"]: r for r in ok[grpo[0]]} if len(grpo) == 1 else None  # GRPO's runs by seed
    rows, curves = [], {}
    for k in keys:
        runs = ok[k]
        mine = [r for r in results if key(r) == k]
        row = {"method": k[0], "lr": k[1], "updates_per_batch": k[2], "runs": len(runs),
               "failed": [f"seed {r['seed']}: {r['error']}" for r in mine if r["error"]],
               "wall": round(sum(r["wall"] for r in mine))}
        rows.append(row)
        if not runs:
            continue
        # the same config gives the same evaluation steps
        steps = [h["step"] for h in runs[0]["history"]]
        acc = np.array([[h["accuracy"] for h in r["history"]] for r in runs])  # (seeds, evals)
        tokens = [[h["tokens"] for h in r["history"]] for r in runs]
        # a null grad_norm: a step without an update
        grad = [[np.nan if s["grad_norm"] is None else s["grad_norm"] for s in r["steps"]]
                for r in runs]
        curves[label(k)] = curve = {
            "step": steps, "acc_mean": acc.mean(axis=0).tolist(),
            "acc_ci": [mean_ci(list(a))[1] or 0.0 for a in acc.T],
            "tokens_mean": np.mean(tokens, axis=0).tolist(),
            "grad_step": [s["step"] for s in runs[0]["steps"]],
            "grad_mean": np.nanmean(grad, axis=0).tolist()}
        row.update(
            seeds=[r["seed"] for r in runs],
            final=pct(mean_ci([r["history"][-1]["accuracy"] for r in runs])),
            auc=pct(mean_ci([auc(r["history"]) for r in runs])),
            rollouts=round(statistics.mean(sum(s["kept"] for s in r["steps"]) for r in runs)),
            # runs of before the column have no zero_var: "-"
            zero_var=(pct(mean_ci([statistics.mean(s["zero_var"] for s in r["steps"])
                                   for r in runs]))
                      if all("zero_var" in s for r in runs for s in r["steps"]) else None),
            tokens=round(statistics.mean(sum(s["tokens"] for s in r["steps"]) for r in runs)),
            t_gen=round(statistics.mean(s["t_gen"] for r in runs for s in r["steps"]), 2),
            t_upd=round(statistics.mean(s["t_upd"] for r in runs for s in r["steps"]), 2),
            **versus_grpo(runs, base, steps, curve))
    return rows, curves


def versus_grpo(runs, base, steps, curve):
    """A row's numbers relative to GRPO's runs (base: seed -> run, or None: no comparison); adds the
    paired difference curve to `curve`."""
    if base is None:
        return dict(vs_grpo=False, final_diff=None, auc_diff=None, steps_to_grpo=None,
                    steps_ci=None, reached=None, s_to_grpo=None, rollouts_pct=None, tokens_pct=None)
    out = dict(vs_grpo=True, final_diff=None, auc_diff=None, steps_ci=None, reached=None,
               s_to_grpo=None)
    final = lambda r: r["history"][-1]["accuracy"]  # noqa: E731
    out["steps_to_grpo"] = hit = first_reach(steps, curve["acc_mean"],
                                             statistics.mean(map(final, base.values())))
    if hit is not None:  # steps 0 .. hit-1 were trained before the evaluation at step `hit`
        out["s_to_grpo"] = [round(statistics.mean(sum(s[t] for s in r["steps"] if s["step"] < hit)
                                                  for r in runs), 1)
                            for t in ("t_gen", "t_upd")]
    for name, field in (("rollouts", "kept"), ("tokens", "tokens")):
        ours, grpo = (statistics.mean(sum(s[field] for s in r["steps"]) for r in rs)
                      for rs in (runs, base.values()))
        out[f"{name}_pct"] = round(100 * ours / max(grpo, 1), 1)
    pairs = [(r, base[r["seed"]]) for r in runs if r["seed"] in base]  # same seed, same prompts
    if pairs:
        out["final_diff"] = pct(mean_ci([final(r) - final(b) for r, b in pairs]))
        out["auc_diff"] = pct(mean_ci([auc(r["history"]) - auc(b["history"]) for r, b in pairs]))
        lo, hi, reached = reach_interval(steps,
                                         [[h["accuracy"] for h in r["history"]] for r, _ in pairs],
                                         [final(b) for _, b in pairs])
        out.update(steps_ci=[lo, hi], reached=round(reached, 3))
        diff = np.array([[h["accuracy"] - g["accuracy"] for h, g in zip(r["history"], b["history"])]
                         for r, b in pairs])
        curve.update(diff_mean=diff.mean(axis=0).tolist(),
                     diff_ci=[mean_ci(list(d))[1] or 0.0 for d in diff.T])
    return out


def format_table(rows):
    """The markdown table (and nothing else)."""
    def pm(x, sign=""):  # [mean, ci] -> "61.3 ± 2.7"
        if x is None:
            return "-"
        return f"{x[0]:{sign}.1f}" + ("" if x[1] is None else f" ± {x[1]:.1f}")

    def share(n, p):
        return f"{n}" + ("" if p is None else f" ({p:.1f}%)")

    def steps(r):  # "40 [30, 60]", "not reached [90, never]"
        if not r["vs_grpo"]:
            return "-"
        text = "not reached" if r["steps_to_grpo"] is None else str(r["steps_to_grpo"])
        if r["steps_ci"] is not None:
            lo, hi = ("never" if x is None else str(x) for x in r["steps_ci"])
            text += f" [{lo}, {hi}]"
        return text

    lines = ["| method | lr | K | final acc % | Δ final | AUC % | Δ AUC | steps to GRPO "
             "| s to GRPO (gen+upd) | rollouts trained | tokens trained | zero-var % | gen s/step "
             "| upd s/step | total s | runs |",
             "|" + " --- |" * 16]
    for r in rows:
        status = (f"{r['runs']}/{r['runs'] + len(r['failed'])}"
                  + "".join(f"; failed {f}" for f in r["failed"]))
        if not r["runs"]:
            lines.append(f"| {r['method']} | {r['lr']:g} | {r['updates_per_batch']} | failed "
                         f"| - | - | - | - | - | - | - | - | - | - | {r['wall']} | {status} |")
            continue
        s = r["s_to_grpo"]
        seconds = "-" if s is None else f"{s[0] + s[1]:.0f} ({s[0]:.0f}+{s[1]:.0f})"
        lines.append(
            f"| {r['method']} | {r['lr']:g} | {r['updates_per_batch']} | {pm(r['final'])} "
            f"| {pm(r['final_diff'], '+')} | {pm(r['auc'])} | {pm(r['auc_diff'], '+')} "
            f"| {steps(r)} | {seconds} | {share(r['rollouts'], r['rollouts_pct'])} "
            f"| {share(r['tokens'], r['tokens_pct'])} | {pm(r['zero_var'])} | {r['t_gen']:.2f} "
            f"| {r['t_upd']:.2f} | {r['wall']} | {status} |")
    return "\n".join(lines)


def choose(rows):
    """Tuning mode: each method's (lr, K) with the highest mean AUC over the tuning seeds, compared
    as printed (to 0.1 point; ties: the smaller K, then the smaller lr). -> {method: (lr, K)}"""
    best = {}
    ran = (r for r in rows if r["runs"])
    for r in sorted(ran, key=lambda r: (r["updates_per_batch"], r["lr"])):
        if r["method"] not in best or r["auc"][0] > best[r["method"]]["auc"][0]:
            best[r["method"]] = r
    return {m: (r["lr"], r["updates_per_batch"]) for m, r in best.items()}

# -----------------------------------------------------------------------------
# the plot


def smooth(y, alpha=0.3):
    """[ours] A light exponential moving average: the gradient norm is noisy step to step."""
    out, acc = [], y[0]
    for v in y:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def plot(curves, path):
    """Accuracy against step and against tokens, the paired difference to GRPO, the gradient
    norm."""
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=80)
    (ax_step, ax_tok), (ax_diff, ax_grad) = axes
    for name, c in curves.items():
        mean, ci = np.array(c["acc_mean"]), np.array(c["acc_ci"])
        for ax, x in ((ax_step, c["step"]), (ax_tok, c["tokens_mean"])):
            line, = ax.plot(x, mean, marker=".", label=name)
            ax.fill_between(x, mean - ci, mean + ci, color=line.get_color(), alpha=0.15)
        if "diff_mean" in c:  # GRPO's own is the zero line
            d, dci = np.array(c["diff_mean"]), np.array(c["diff_ci"])
            ax_diff.plot(c["step"], d, marker=".", label=name, color=line.get_color())
            ax_diff.fill_between(c["step"], d - dci, d + dci, color=line.get_color(), alpha=0.15)
        ax_grad.plot(c["grad_step"], smooth(c["grad_mean"]), label=name, color=line.get_color())
    labels = (("step", "held-out accuracy (seed mean, 95% CI)"), ("tokens trained (seed mean)",
                                                                  "held-out accuracy"),
              ("step", "accuracy minus GRPO's, same seed (mean, 95% CI)"),
              ("step", "gradient norm (before clipping, seed mean, EMA)"))
    for ax, (xlabel, ylabel) in zip(axes.flat, labels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--methods", default="grpo,d3s",
                   help=f"comma-separated, or all: {','.join(d3s.METHODS)}")
    p.add_argument("--seeds", type=int, default=5,
                   help="seeds per method: seed_start .. seed_start + N - 1")
    p.add_argument("--seed_start", type=int, default=0,
                   help="the first seed (tune on others, e.g. 100)")
    p.add_argument("--out", default=os.path.join("out", "bench"),
                   help="results folder (finished runs are reused)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    p.add_argument("--model", default="tiny",
                   help="tiny, a world of tiny.WORLDS (tiny-long, ...), or a model folder")
    p.add_argument("--device", default=None, help="auto | cpu | cuda (default: train.py's, auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (default: cores // jobs)")
    p.add_argument("--lr", default=None, help="1e-4, or grpo=1e-4,d3s=2e-4 (default: train.py's)")
    p.add_argument("--tuned", default=None,
                   help="a tuning run's tuned.json: each method's lr (and K)")
    p.add_argument("--lr_grid", default=None,
                   help="tuning mode: every method at each of these lrs: 5e-5,1e-4,2e-4")
    p.add_argument("--updates_grid", default=None,
                   help="tuning mode: and at each of these K (updates per step): 2,4")
    for name, kind in PASS_THROUGH.items():  # None: train.py's default for the world
        kind = (lambda s: s if s == "all" else int(s)) if name == "eval_size" else kind
        p.add_argument(f"--{name}", type=kind, default=None, help="passed to train.Config" +
                       (" (all: the whole test split)" if name == "eval_size" else ""))
    for name in RATIOS:
        p.add_argument(f"--{name}", type=float, default=None,
                       help="passed to train.Config for the methods that use it")
    return p.parse_args(argv)


def settings(args, methods):
    """{method: [(lr, K), ...]}: every pair of the grids in tuning mode, else one pair per method
    (None: train.py's default)."""
    def number(text, flag, kind=float):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{flag}: {text!r} is not a number") from None

    def grid(text, flag, kind=float):
        return sorted({number(x, flag, kind) for x in text.split(",")})

    tuning = args.lr_grid is not None or args.updates_grid is not None
    if sum([tuning, args.lr is not None, args.tuned is not None]) > 1:
        raise ValueError("--lr, --tuned and the grids (--lr_grid, --updates_grid): give one of the "
                         "three")
    if tuning:
        lrs = [None] if args.lr_grid is None else grid(args.lr_grid, "--lr_grid")
        ks = ([args.updates_per_batch] if args.updates_grid is None
              else grid(args.updates_grid, "--updates_grid", int))
        return {m: [(lr, k) for k in ks for lr in lrs] for m in methods}
    if args.tuned is not None:
        if not os.path.isfile(args.tuned):
            raise ValueError(f"--tuned {args.tuned}: no such file; pass the tuned.json of a tuning "
                             "run (--lr_grid)")
        if args.updates_per_batch is not None:
            raise ValueError("--tuned sets each method's K (updates per batch); leave out "
                             "--updates_per_batch")
        with open(args.tuned) as f:
            tuned = json.load(f)
        missing = [m for m in methods if m not in tuned["lr"]]
        if missing:
            raise ValueError(f"--tuned {args.tuned} has no setting for {', '.join(missing)}; tune "
                             "them first")
        return {m: [(tuned["lr"][m], tuned["updates_per_batch"][m])] for m in methods}
    if args.lr is None or "=" not in args.lr:
        lr = None if args.lr is None else number(args.lr, "--lr")
        return {m: [(lr, args.updates_per_batch)] for m in methods}
    pairs = [pair.split("=", 1) for pair in args.lr.split(",")]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"--lr {args.lr}: give one number, or method=lr pairs separated by commas")
    chosen = dict(pairs)
    missing = [m for m in methods if m not in chosen]
    if missing:
        raise ValueError(f"--lr {args.lr} gives no learning rate for {', '.join(missing)}")
    return {m: [(number(chosen[m], "--lr"), args.updates_per_batch)] for m in methods}


def configs(args):
    """One resolved train.Config per (method, lr, K, seed), checked up front so that bad knobs, and
    finished runs with another config, fail before any run starts."""
    names = d3s.METHODS if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    methods = list(dict.fromkeys(names))  # in order, each once
    for m in methods:
        if m not in d3s.METHODS:
            raise ValueError(f"--methods: {m!r} is unknown; choose from {', '.join(d3s.METHODS)} "
                             "or all")
    for name in ("seeds", "jobs", "threads", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    grid = settings(args, methods)
    knobs = {name: getattr(args, name) for name in PASS_THROUGH if getattr(args, name) is not None}
    knobs.pop("updates_per_batch", None)  # in the settings
    if args.device is not None:
        knobs["device"] = args.device
    # only the final checkpoint (deleted by run_one); no step lines on the terminal, they go to
    # train.log. overwrite: a run that did not finish left its log in its folder; it is run again
    # there from the start
    knobs.update(model=args.model, save_every=0, overwrite=True)
    if knobs.get("eval_size") == "all":  # the whole test split of the world's held-out data set
        knobs.pop("eval_size")
        first = config.resolve(train.Config(**knobs), given=knobs)
        knobs["eval_size"] = len(load_problems(first.dataset, "test",
                                               data_dir=first.data_dir or None))
    cfgs = []
    for m in methods:
        ratios = {k: getattr(args, k) for k in schedule_knobs(m) if getattr(args, k) is not None}
        for lr, k in grid[m]:
            run = (m + ("" if args.lr_grid is None else f"-lr{lr:g}")
                   + ("" if args.updates_grid is None else f"-K{k}"))
            for s in range(args.seed_start, args.seed_start + args.seeds):
                mine = {"method": m, "seed": s,
                        "out_dir": os.path.join(args.out, "runs", f"{run}-seed{s}"), **knobs,
                        **ratios, **({} if lr is None else {"lr": lr}),
                        **({} if k is None else {"updates_per_batch": k})}
                # the knobs bench sets are given; the others take train.py's defaults and presets.
                # A bad knob: config.check's one line
                cfgs.append(config.resolve(train.Config(**mine), given=mine))
    return methods, cfgs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = "python experiments/bench.py " + " ".join(argv)
    try:
        methods, cfgs = configs(args)
        saved = {cfg.out_dir: finished(cfg) for cfg in cfgs}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    todo = [cfg for cfg in cfgs if saved[cfg.out_dir] is None]
    print(f"{command.strip()}\n{len(cfgs)} runs: {len(cfgs) - len(todo)} finished before "
          f"(reused), {len(todo)} to run")
    if todo and args.model in tiny.WORLDS:
        # build out/<world> once, here, so that parallel workers do not race to build it
        load_model(args.model)
    os.makedirs(args.out, exist_ok=True)
    # [ours] --threads 1 on a busy machine: a tiny model's generate is ~100x slower when its
    # OpenMP threads fight other processes for the cores.
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    t0, results = time.time(), [r for r in saved.values() if r is not None]
    bar = tqdm(total=len(todo), desc="bench", unit="run", dynamic_ncols=True)

    def done(r):
        results.append(r)
        acc = (f"acc {r['history'][-1]['accuracy']:.3f}" if r["error"] is None
               else f"FAILED {r['error']}")
        tqdm.write(f"{label(key(r))} seed {r['seed']}: {acc} in {r['wall']:.0f}s ({r['out_dir']})")
        bar.update(1)

    if args.jobs == 1:
        _init_worker(threads)
        for cfg in todo:
            done(run_one(cfg))
    elif todo:
        # a fresh interpreter per worker: no forked torch state
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_init_worker,
                                    initargs=(threads,)) as pool:
            futures = {pool.submit(run_one, cfg): cfg for cfg in todo}
            for fut in cf.as_completed(futures):
                try:
                    done(fut.result())
                except Exception as e:  # the worker died (killed, out of memory): still one row
                    cfg = futures[fut]
                    done({"method": cfg.method, "lr": cfg.lr,
                          "updates_per_batch": cfg.updates_per_batch, "seed": cfg.seed,
                          "out_dir": cfg.out_dir, "command": train_command(cfg), "history": [],
                          "steps": [], "wall": 0.0,
                          "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    bar.close()
    wall = time.time() - t0

    order = {cfg.out_dir: i for i, cfg in enumerate(cfgs)}
    results.sort(key=lambda r: order[r["out_dir"]])
    keys = list(dict.fromkeys(key(cfg) for cfg in cfgs))
    rows, curves = aggregate(results, keys)
    table = format_table(rows)
    # the ratios each method applies
    per_run = ("method", "seed", "lr", "updates_per_batch", "out_dir", *RATIOS)
    # what every run shares
    shared = {k: v for k, v in as_json(cfgs[0]).items() if k not in per_run}
    print(table)
    print(f"{len(todo)} runs in {wall:.0f}s with {args.jobs} job(s); {args.out}/results.md, "
          "results.json, bench.png")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"`{command.strip()}`\n\n{table}\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command.strip(), "wall": wall, "config": shared,
                   "table": rows, "curves": curves, "runs": results}, f, indent=1)
    if curves:
        plot(curves, os.path.join(args.out, "bench.png"))
    if args.lr_grid is not None or args.updates_grid is not None:
        chosen = choose(rows)
        path = os.path.join(args.out, "tuned.json")
        with open(path, "w") as f:
            json.dump({"command": command.strip(),
                       "criterion": "highest mean AUC over the seeds (to 0.1 point); ties: the "
                                    "smaller K, then the smaller lr",
                       "lr": {m: lr for m, (lr, _) in chosen.items()},
                       "updates_per_batch": {m: k for m, (_, k) in chosen.items()},
                       "auc": {label(key(r)): r.get("auc") for r in rows}}, f, indent=1)
        print("chosen (highest mean AUC): "
              + ", ".join(f"{m} lr {lr:g} K {k}" for m, (lr, k) in chosen.items()))
        print(f"the study: the same command with --tuned {path} instead of the grids, the reported "
              "seeds (--seed_start 0) and its own --out")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
