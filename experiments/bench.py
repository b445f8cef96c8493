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
    # the paper's unit: then each method again in GRPO's seconds; how much sooner it gets there
    python experiments/bench.py --methods grpo,d3s --tuned out/tune/tuned.json --seeds 8 \
        --eval_size all --eval_every 10 --budget seconds --out out/study

The runs. Seeds are seed_start .. seed_start + N - 1. A seed fixes the prompts and their order
(train.batch_at), so a method's run k and GRPO's run k see the same prompts: differences to GRPO are
paired by seed. Every run is train.train() itself (no second copy of the loop), from the same
warmed-up model (--model: tiny, a harder world of tiny.WORLDS such as tiny-long, or a folder), and
is evaluated greedily on the same held-out questions (--eval_size all: the world's whole test split,
1036 questions for tiny). These flags go to train.Config unchanged, and left out are train.py's
defaults: --steps --eval_every --eval_size --prompts_per_step --group_size --max_new_tokens
--micro_batch_size --loss --updates_per_batch --optimizer --grad_clip, and where train.py has them
--divisor and --minibatch_size (M rollouts per update, ceil(kept / M) updates a step, instead of K).
--s_init --s_final --t_init --t_final go only to the methods that read them (schedule_knobs;
train.py refuses them elsewhere). --methods all is every method of d3s.METHODS, its random controls
included.

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
overrides it; 1 is much faster on a machine whose cores are busy). Each run's result records the
jobs and threads it ran with: its seconds were taken beside jobs - 1 other runs.

GRPO's budget of seconds (--budget seconds), the paper's unit: a method whose step is cheaper gets
more steps in the same wall-clock time. After the fixed-step runs, each method's seconds per step
(t_gen + t_upd, the mean over its steps, then over its seeds) gives its step count in GRPO's budget,
S_m = round(S * GRPO's s/step / its s/step) for --steps S. DIR/budget.json records them the first
time and is read afterwards, so the same command asks for the same runs and reuses them; a method it
lacks is added. Each method with S_m != S then runs with S_m steps (its schedule spanning its own
steps, evaluated every --eval_every of its own steps) in DIR/runs/<method>-budget-seed<k>; a method
with S_m = S (GRPO always) is its fixed-step runs. A second table compares them (below).
--share F (with --budget seconds) plans GRPO's budget on a machine where generation is a share F of
GRPO's step (0.8: a GPU, say): each method's generation seconds scaled by F u / ((1 - F) g) (g, u:
GRPO's seconds per step), its update's as measured. Its plan, runs and files carry -shareF
(budget-share0.8.json, runs/<method>-budget-share0.8-seed<k>, results-share0.8.md), beside the
measured budget's; experiments/share.py turns all of a folder's runs into speed-ups at any share.

What bench writes in DIR (--out):
  results.md    the command and the table(s), as printed
  results.json  the command, its "jobs" and "threads", every run (its train.py command line,
                held-out history, per-step rows, wall time, jobs and threads), the table's numbers
                as printed, and the curves of the plot; with --budget seconds also "budget": the
                plan, the budget's runs, its table and its curves
  bench.png     held-out accuracy against step, against tokens trained and against the seconds of
                generation + update before each evaluation (seed means with 95% confidence bands;
                dashed: the runs in GRPO's budget), the paired difference to GRPO against step,
                the gradient norm per step, and the seconds spent so far
  tuned.json    tuning mode only: {"lr": {method: lr}, "updates_per_batch": {method: K}, "auc":
                ...}, what --tuned FILE reads
  budget.json   --budget seconds only: {"steps": S, "seconds_per_step": {method: s},
                "budget_steps": {method: S_m}}

The table, one row per method (and lr and K). Every "±" is a 95% confidence interval over seeds from
Student's t with n - 1 degrees of freedom: mean ± t(0.975, n-1) · s / sqrt(n), s the sample std
(no interval for one seed):
  lr, K            the row's learning rate and updates per step (--updates_per_batch; a step is one
                   rollout batch, an update one optimizer step on a mini-batch); with a
                   mini-batch size M (--minibatch_size) instead "M 8: 2.44", the updates made per
                   step (log.jsonl's `updates`), mean over the steps and the seeds
  divisor          what each update's loss is divided by (train.py's --divisor: kept, valid or seq;
                   "-" where train.py has no such knob)
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
  tokens fwd+bwd   the compute: every token (prompt and completion) of the kept rollouts that an
                   update forwarded and back-propagated (log.jsonl's fwd_bwd_tokens), summed over
                   the run, mean over seeds, and as a share of GRPO's
  zero-var %       the share of the step's zero-variance groups, whose rewards are all equal (all
                   right or all wrong: every advantage 0, nothing to learn), log.jsonl's zero_var,
                   averaged over the run's steps; mean ± interval over seeds. It depends on the
                   policy, so on the method: a method that learns faster leaves fewer all-wrong
                   groups (and more all-right ones)
  gen s, upd s     seconds per step: generating the rollouts, and everything after (reward to
                   update)
  pad %            the share of the decoded row-positions (rows x decode steps) that came after
                   their row had stopped (log.jsonl's pad_share): what the longest row of a
                   generation call costs the others, mean over steps and seeds ("-": runs of
                   before the field)
  total s          the wall time of the method's runs, added up (runs share the cores: compare
                   loosely)
A run that raises is listed as failed with its one-line error; the other runs go on.

The budget table (--budget seconds), one row per method, after a line giving GRPO's budget (S
steps x its s/step). Seconds are of generation + update (t_gen + t_upd), evaluation not counted; the
method's curve is its seed-mean accuracy against its seed-mean seconds spent before each evaluation:
  lr, K, divisor   as above
  steps            S_m, the method's step count in GRPO's budget (budget.json)
  s/step           its seconds per step in the fixed-step runs, which set S_m (budget.json)
  s used           the seconds its budget runs spent, mean over seeds (about GRPO's budget)
  final acc %      held-out accuracy at the end of the budget; Δ final paired to GRPO as above
  s to GRPO's acc  t, the seconds at which its curve first reaches GRPO's final seed-mean accuracy
                   ("not reached" within the budget)
  x sooner         t_GRPO / t, t_GRPO the seconds at which GRPO's own curve first reaches it (its
                   last evaluation, unless it got there before): how many times sooner than GRPO
                   the method reaches GRPO's accuracy. In brackets a 95% bootstrap interval, paired
                   like "steps to GRPO" (the same resampled seeds for the method and GRPO, each
                   resample with its own target and its own t_GRPO); a resample that never reaches
                   it counts as 0 ("never"), so a lower end "never" means more than 2.5% of
                   resamples never did (results.json: `sooner_reached`). "D3S reaches GRPO's
                   accuracy 1.6x sooner in seconds [1.2, 2.1]" reads off d3s's row
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
from experiments.share import scale  # generation scaled to a share of the step
import d3s
from machinery import plots
from machinery import tiny
import train
from machinery.data import load_problems
from machinery.model import load_model

# Per-step fields of log.jsonl kept in results.json: what the table and the plot are computed from.
STEP_FIELDS = ("step", "reward", "zero_var", "kept", "rollouts", "tokens", "fwd_bwd_tokens",
               "nograd_tokens", "head_rows", "upd_pad_share", "no_signal", "valid", "grad_norm",
               "t_gen", "t_upd", "nonfinite", "updates", "pad_share")
# train.Config fields bench passes on when given on the command line (the rest: train.py's
# defaults); the divisor and the mini-batch size where this train.py has them
PASS_THROUGH = {"steps": int, "eval_every": int, "eval_size": int, "prompts_per_step": int,
                "group_size": int, "max_new_tokens": int, "micro_batch_size": int,
                "updates_per_batch": int, "loss": str, "optimizer": str, "grad_clip": float,
                "generation": str,
                **{k: t for k, t in (("divisor", str), ("minibatch_size", int))
                   if hasattr(train.Config, k)}}
RATIOS = ("s_init", "s_final", "t_init", "t_final")  # passed only to the methods that read them
CONFIDENCE = 0.95   # of every interval
BOOTSTRAP = 1000    # resamples of the seeds for the interval of "steps to GRPO"

# -----------------------------------------------------------------------------
# the runs


def schedule_knobs(method):
    """The keep-ratio knobs a method reads (d3s.METHODS): rho_s if it selects samples, rho_t if it
    selects tokens, their *_final on any schedule but the constant one (d3s.SCHEDULES). entropy
    (80/20) keeps a fixed t_keep."""
    spec = d3s.METHODS[method]
    final = spec["schedule"] != "constant"
    knobs = []
    if spec["sample"] not in ("none", "nonzero"):
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


def blank_result(cfg, context=None):
    """A run's result before it has run: which run it is and how it runs (context: "jobs", the runs
    at once, and "threads", each one's torch threads: its timings were taken beside jobs - 1 other
    runs), nothing measured yet."""
    return {"method": cfg.method, "lr": cfg.lr, "updates_per_batch": cfg.updates_per_batch,
            "divisor": getattr(cfg, "divisor", None),
            "minibatch_size": getattr(cfg, "minibatch_size", 0), "seed": cfg.seed,
            "out_dir": cfg.out_dir, "command": train_command(cfg), "history": [], "steps": [],
            "wall": 0.0, "error": None, **(context or {})}


def run_one(cfg, context=None):
    """Train one (method, lr, seed) with train.train; return its history, per-step rows and wall
    time, or its one-line error. A finished run also writes result.json (written last, so it marks
    the run finished). Runs in a worker process when --jobs > 1."""
    t0 = time.time()
    os.makedirs(cfg.out_dir, exist_ok=True)
    result = blank_result(cfg, context)
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
            result["steps"] = [{k: row[k] for k in STEP_FIELDS if k in row} for row in rows]
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


def execute(todo, args, threads, desc="bench"):
    """Run the configs in todo, --jobs at once, each with `threads` torch threads; a line for each
    run as it finishes. -> their results, a failed run's with its one-line error."""
    if todo and args.model in tiny.WORLDS:
        # build out/<world> once, here, so that parallel workers do not race to build it
        load_model(args.model)
    jobs, context, results = args.jobs, {"jobs": args.jobs, "threads": threads}, []
    bar = tqdm(total=len(todo), desc=desc, unit="run", dynamic_ncols=True)

    def done(r):
        results.append(r)
        acc = (f"acc {r['history'][-1]['accuracy']:.3f}" if r["error"] is None
               else f"FAILED {r['error']}")
        tqdm.write(f"{label(key(r), r['minibatch_size'])} seed {r['seed']}: {acc} in "
                   f"{r['wall']:.0f}s ({r['out_dir']})")
        bar.update(1)

    if jobs == 1:
        _init_worker(threads)
        for cfg in todo:
            done(run_one(cfg, context))
    elif todo:
        # a fresh interpreter per worker: no forked torch state
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker,
                                    initargs=(threads,)) as pool:
            futures = {pool.submit(run_one, cfg, context): cfg for cfg in todo}
            for fut in cf.as_completed(futures):
                try:
                    done(fut.result())
                except Exception as e:  # the worker died (killed, out of memory): still one row
                    done({**blank_result(futures[fut], context),
                          "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    bar.close()
    return results

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


def bootstrap(n, stat, resamples=BOOTSTRAP, seed=0):
    """stat(idx) for each of `resamples` draws idx of n seeds with replacement (numpy seed `seed`);
    idx indexes the method's runs and GRPO's together (paired). -> (the values, their 95% interval
    as two observed values)."""
    rng = np.random.default_rng(seed)
    values = [stat(idx) for idx in rng.integers(0, n, size=(resamples, n))]
    ends = np.quantile(values, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2], method="inverted_cdf")
    return values, ends


def reach_interval(steps, acc, base_final, resamples=BOOTSTRAP, seed=0):
    """95% bootstrap interval of first_reach: acc is (seeds, evaluations) of the method, base_final
    the final accuracy of GRPO's runs with the same seeds (paired). Each resample draws the seeds
    with replacement and takes the method's mean curve and GRPO's mean final accuracy over them; one
    that never reaches it counts as infinitely late. Returns (low, high, share of resamples that
    reach); an end is None for "never"."""
    acc, base_final = np.asarray(acc, dtype=float), np.asarray(base_final, dtype=float)

    def hit(idx):
        step = first_reach(steps, acc[idx].mean(axis=0), base_final[idx].mean())
        return math.inf if step is None else step
    hits, (lo, hi) = bootstrap(len(base_final), hit, resamples, seed)
    never = lambda x: None if math.isinf(x) else int(x)  # noqa: E731
    return never(lo), never(hi), sum(not math.isinf(h) for h in hits) / resamples


def reach_seconds(acc, seconds, target):
    """The seconds at which the seed-mean curve of accuracy against seed-mean seconds first reaches
    target, or None if it never does. acc, seconds: (seeds, evaluations), the seconds of generation
    + update before each evaluation."""
    i = first_reach(range(acc.shape[1]), acc.mean(axis=0), target)
    return None if i is None else float(seconds[:, i].mean())


def sooner(t_grpo, t):
    """How many times sooner than GRPO: t_grpo / t (0 for "never", t None; both reached at step 0:
    1)."""
    if t is None:
        return 0.0
    return t_grpo / t if t > 0 else (math.inf if t_grpo > 0 else 1.0)


def sooner_interval(acc, seconds, base_acc, base_seconds, resamples=BOOTSTRAP, seed=0):
    """The speed-up in seconds over GRPO and its 95% bootstrap interval: t_GRPO / t, t the seconds
    at which the method's curve first reaches GRPO's final mean accuracy, t_GRPO those at which
    GRPO's own curve first reaches it (reach_seconds). Arrays (seeds, evaluations), the method's
    row i and GRPO's row i of the same seed; each resample draws the seeds with replacement, the
    same for both (paired), with its own target. Returns (speed-up or None for never, low, high,
    share of resamples that reach); "never" counts as a speed-up of 0, an end None."""
    def ratio(idx):
        target = base_acc[idx, -1].mean()
        return sooner(reach_seconds(base_acc[idx], base_seconds[idx], target),
                      reach_seconds(acc[idx], seconds[idx], target))
    point = ratio(np.arange(len(acc)))
    values, (lo, hi) = bootstrap(len(acc), ratio, resamples, seed)
    never = lambda x: None if x == 0 else round(float(x), 2)  # noqa: E731
    return never(point), never(lo), never(hi), sum(v > 0 for v in values) / resamples

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


def label(k, minibatch=0):
    """A row's name in the plot and in tuned.json: "d3s lr 0.0001 K 1" (with a mini-batch size,
    --minibatch_size 8: "d3s lr 0.0001 M 8")."""
    method, lr, updates = k
    return f"{method} lr {lr:g} " + (f"M {minibatch}" if minibatch else f"K {updates}")


def acc_and_seconds(runs):
    """(seeds, evaluations) arrays: each run's held-out accuracy, and the seconds of generation +
    update it spent before each evaluation (plots.seconds_at)."""
    acc = np.array([[h["accuracy"] for h in r["history"]] for r in runs], dtype=float)
    seconds = np.array([plots.seconds_at(r["steps"], [h["step"] for h in r["history"]])
                        for r in runs], dtype=float)
    return acc, seconds


def run_means(runs, field):
    """Each run's mean of a per-step field over its steps; None when some row lacks it (runs of
    before the field)."""
    if not all(field in s for r in runs for s in r["steps"]):
        return None
    return [statistics.mean(s[field] for s in r["steps"]) for r in runs]


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
        acc, seconds = acc_and_seconds(runs)  # (seeds, evals)
        tokens = [[h["tokens"] for h in r["history"]] for r in runs]
        # a null grad_norm: a step without an update
        grad = [[np.nan if s["grad_norm"] is None else s["grad_norm"] for s in r["steps"]]
                for r in runs]
        minibatch = runs[0].get("minibatch_size") or 0
        curves[label(k, minibatch)] = curve = {
            "step": steps, "acc_mean": acc.mean(axis=0).tolist(),
            "acc_ci": [mean_ci(list(a))[1] or 0.0 for a in acc.T],
            "tokens_mean": np.mean(tokens, axis=0).tolist(),
            "seconds_mean": seconds.mean(axis=0).tolist(),
            "grad_step": [s["step"] for s in runs[0]["steps"]],
            "grad_mean": np.nanmean(grad, axis=0).tolist()}
        # runs of before the zero_var and updates fields: "-"
        zero_var, updates = run_means(runs, "zero_var"), run_means(runs, "updates")
        pad = run_means(runs, "pad_share")
        row.update(
            seeds=[r["seed"] for r in runs], divisor=runs[0].get("divisor"),
            minibatch_size=minibatch,
            updates=None if updates is None else round(statistics.mean(updates), 2),
            final=pct(mean_ci([r["history"][-1]["accuracy"] for r in runs])),
            auc=pct(mean_ci([auc(r["history"]) for r in runs])),
            rollouts=round(statistics.mean(sum(s["kept"] for s in r["steps"]) for r in runs)),
            zero_var=None if zero_var is None else pct(mean_ci(zero_var)),
            tokens=round(statistics.mean(sum(s["tokens"] for s in r["steps"]) for r in runs)),
            fwd_bwd=None if run_means(runs, "fwd_bwd_tokens") is None else round(statistics.mean(
                sum(s["fwd_bwd_tokens"] for s in r["steps"]) for r in runs)),
            t_gen=round(statistics.mean(s["t_gen"] for r in runs for s in r["steps"]), 2),
            t_upd=round(statistics.mean(s["t_upd"] for r in runs for s in r["steps"]), 2),
            pad=None if pad is None else round(100 * statistics.mean(pad), 1),
            seconds=round(float(seconds[:, -1].mean()), 1),  # all steps: before the last eval
            **versus_grpo(runs, base, steps, curve))
    return rows, curves


def versus_grpo(runs, base, steps, curve):
    """A row's numbers relative to GRPO's runs (base: seed -> run, or None: no comparison); adds the
    paired difference curve to `curve` when both evaluate at the same steps."""
    none = dict(final_diff=None, auc_diff=None, steps_ci=None, reached=None, s_to_grpo=None,
                sooner=None, sooner_ci=None, sooner_reached=None)
    if base is None:
        return dict(none, vs_grpo=False, steps_to_grpo=None, rollouts_pct=None, tokens_pct=None,
                    fwd_bwd_pct=None)
    out = dict(none, vs_grpo=True)
    final = lambda r: r["history"][-1]["accuracy"]  # noqa: E731
    out["steps_to_grpo"] = hit = first_reach(steps, curve["acc_mean"],
                                             statistics.mean(map(final, base.values())))
    if hit is not None:  # steps 0 .. hit-1 were trained before the evaluation at step `hit`
        out["s_to_grpo"] = [round(statistics.mean(sum(s[t] for s in r["steps"] if s["step"] < hit)
                                                  for r in runs), 1)
                            for t in ("t_gen", "t_upd")]
    for name, field in (("rollouts", "kept"), ("tokens", "tokens"), ("fwd_bwd", "fwd_bwd_tokens")):
        if any(field not in s for r in (*runs, *base.values()) for s in r["steps"]):
            out[f"{name}_pct"] = None  # runs of before the field
            continue
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
        x, lo, hi, reached = sooner_interval(*acc_and_seconds([r for r, _ in pairs]),
                                             *acc_and_seconds([b for _, b in pairs]))
        out.update(sooner=x, sooner_ci=[lo, hi], sooner_reached=round(reached, 3))
        evaluated = lambda r: [h["step"] for h in r["history"]]  # noqa: E731
        if all(evaluated(r) == evaluated(b) for r, b in pairs):  # not so in a budget of seconds
            diff = np.array([[h["accuracy"] - g["accuracy"]
                              for h, g in zip(r["history"], b["history"])] for r, b in pairs])
            curve.update(diff_mean=diff.mean(axis=0).tolist(),
                         diff_ci=[mean_ci(list(d))[1] or 0.0 for d in diff.T])
    return out


def pm(x, sign=""):
    """[mean, ci] -> "61.3 ± 2.7" ("-" for None)."""
    if x is None:
        return "-"
    return f"{x[0]:{sign}.1f}" + ("" if x[1] is None else f" ± {x[1]:.1f}")


def status(r):
    """The runs cell: "8/8", or "7/8; failed seed 3: ..."."""
    return f"{r['runs']}/{r['runs'] + len(r['failed'])}" + "".join(f"; failed {f}"
                                                                  for f in r["failed"])


def setting(r):
    """The lr, K and divisor cells. K: updates per step, --updates_per_batch; with a mini-batch size
    M (--minibatch_size) the mean over the steps of the updates made instead, "M 8: 2.44"."""
    k = str(r["updates_per_batch"])
    if r.get("minibatch_size"):
        k = f"M {r['minibatch_size']}: " + ("-" if r["updates"] is None else f"{r['updates']:.2f}")
    return f"{r['lr']:g} | {k} | {r.get('divisor') or '-'}"


def format_table(rows):
    """The markdown table (and nothing else)."""
    def share(n, p):
        return "-" if n is None else f"{n}" + ("" if p is None else f" ({p:.1f}%)")

    def steps(r):  # "40 [30, 60]", "not reached [90, never]"
        if not r["vs_grpo"]:
            return "-"
        text = "not reached" if r["steps_to_grpo"] is None else str(r["steps_to_grpo"])
        if r["steps_ci"] is not None:
            lo, hi = ("never" if x is None else str(x) for x in r["steps_ci"])
            text += f" [{lo}, {hi}]"
        return text

    lines = ["| method | lr | K | divisor | final acc % | Δ final | AUC % | Δ AUC | steps to GRPO "
             "| s to GRPO (gen+upd) | rollouts trained | tokens trained | tokens fwd+bwd "
             "| zero-var % | gen s/step | upd s/step | pad % | total s | runs |",
             "|" + " --- |" * 19]
    for r in rows:
        if not r["runs"]:
            lines.append(f"| {r['method']} | {setting(r)} | failed " + "| - " * 12
                         + f"| {r['wall']} | {status(r)} |")
            continue
        s = r["s_to_grpo"]
        seconds = "-" if s is None else f"{s[0] + s[1]:.0f} ({s[0]:.0f}+{s[1]:.0f})"
        lines.append(
            f"| {r['method']} | {setting(r)} | {pm(r['final'])} "
            f"| {pm(r['final_diff'], '+')} | {pm(r['auc'])} | {pm(r['auc_diff'], '+')} "
            f"| {steps(r)} | {seconds} | {share(r['rollouts'], r['rollouts_pct'])} "
            f"| {share(r['tokens'], r['tokens_pct'])} "
            f"| {share(r.get('fwd_bwd'), r.get('fwd_bwd_pct'))} | {pm(r['zero_var'])} "
            f"| {r['t_gen']:.2f} | {r['t_upd']:.2f} | {'-' if r.get('pad') is None else r['pad']} "
            f"| {r['wall']} | {status(r)} |")
    return "\n".join(lines)


def format_budget_table(rows, plan):
    """--budget seconds: the line that gives GRPO's budget, then the markdown table."""
    grpo = plan["seconds_per_step"]["grpo"]
    budget = f"{plan['steps']} steps x {grpo:.2f} s = {plan['steps'] * grpo:.1f} s"
    lines = [f"In GRPO's budget: {budget} of generation + update per run (budget.json)", "",
             "| method | lr | K | divisor | steps | s/step | s used | final acc % | Δ final "
             "| s to GRPO's acc | x sooner than GRPO | runs |",
             "|" + " --- |" * 12]
    for r in rows:
        head = (f"| {r['method']} | {setting(r)} | {plan['budget_steps'][r['method']]} "
                f"| {plan['seconds_per_step'][r['method']]:.2f}")
        if not r["runs"]:
            lines.append(f"{head} | failed | - | - | - | - | {status(r)} |")
            continue
        s, x = r["s_to_grpo"], r["sooner"]
        ends = ("never" if e is None else f"{e:.2f}" for e in r["sooner_ci"] or [None, None])
        lines.append(f"{head} | {r['seconds']:.1f} | {pm(r['final'])} | {pm(r['final_diff'], '+')} "
                     f"| {'not reached' if s is None else f'{s[0] + s[1]:.1f}'} "
                     f"| {'never' if x is None else f'{x:.2f}x'} [{', '.join(ends)}] "
                     f"| {status(r)} |")
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


def figure(curves, budget=None):
    """bench.png: accuracy against step, against tokens and against seconds, the paired difference
    to GRPO, the gradient norm, the seconds spent. budget: the curves of the runs in GRPO's budget
    of seconds (--budget seconds), dashed on the seconds panel."""
    fig, axes = plt.subplots(2, 3, figsize=(18, 9), dpi=80)
    (ax_step, ax_tok, ax_sec), (ax_diff, ax_grad, ax_spent) = axes
    for name, c in curves.items():
        mean, ci = np.array(c["acc_mean"]), np.array(c["acc_ci"])
        for ax, x in ((ax_step, c["step"]), (ax_tok, c["tokens_mean"]),
                      (ax_sec, c["seconds_mean"])):
            line, = ax.plot(x, mean, marker=".", label=name)
            ax.fill_between(x, mean - ci, mean + ci, color=line.get_color(), alpha=0.15)
        if "diff_mean" in c:  # GRPO's own is the zero line
            d, dci = np.array(c["diff_mean"]), np.array(c["diff_ci"])
            ax_diff.plot(c["step"], d, marker=".", label=name, color=line.get_color())
            ax_diff.fill_between(c["step"], d - dci, d + dci, color=line.get_color(), alpha=0.15)
        ax_grad.plot(c["grad_step"], smooth(c["grad_mean"]), label=name, color=line.get_color())
        ax_spent.plot(c["step"], c["seconds_mean"], marker=".", label=name, color=line.get_color())
        b = (budget or {}).get(name)  # the same method in GRPO's seconds, at its own steps
        if b and b["step"] != c["step"]:  # (at the same steps: these very runs, GRPO's always)
            ax_sec.plot(b["seconds_mean"], b["acc_mean"], marker=".", linestyle="--",
                        color=line.get_color(), label=f"{name}, in GRPO's seconds")
    labels = (("step", "held-out accuracy (seed mean, 95% CI)"), ("tokens trained (seed mean)",
                                                                  "held-out accuracy"),
              (f"{plots.SECONDS}, seed mean", "held-out accuracy (dashed: in GRPO's budget)"),
              ("step", "accuracy minus GRPO's, same seed (mean, 95% CI)"),
              ("step", "gradient norm (before clipping, seed mean, EMA)"),
              ("step", "seconds of generation + update so far (seed mean)"))
    for ax, (xlabel, ylabel) in zip(axes.flat, labels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_step.legend(fontsize=8)
    if budget:
        ax_sec.legend(fontsize=8)
    fig.tight_layout()
    return fig


# -----------------------------------------------------------------------------
# GRPO's budget of seconds (--budget seconds)


def seconds_per_step(runs, scale=1.0):
    """Seconds of generation (times `scale`) + update per step: each run's mean over its steps, then
    the mean over the seeds."""
    return statistics.mean(statistics.mean(scale * s["t_gen"] + s["t_upd"] for s in r["steps"])
                           for r in runs)


def generation_scale(grpo_runs, share):
    """a: generation's seconds scaled so that they are a share `share` of GRPO's step (its
    fixed-step runs), the update's as measured (experiments/share.py); 1 with no share."""
    if share is None:
        return 1.0
    g, u = (statistics.mean(statistics.mean(s[t] for s in r["steps"]) for r in grpo_runs)
            for t in ("t_gen", "t_upd"))
    return scale(share, g, u)


def read_plan(path, steps):
    """DIR/budget.json, or None before the first budget; a plan made for another --steps is a
    ValueError."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        plan = json.load(f)
    if plan["steps"] != steps:
        raise ValueError(f"{path} gives GRPO's budget of {plan['steps']} steps, not {steps}; use "
                         "another --out, or delete it (and the runs/*-budget-* folders)")
    return plan


def budget_plan(path, steps, ok, command, share=None):
    """Each method's step count in GRPO's budget of seconds: round(steps * GRPO's seconds per step /
    the method's), the seconds per step from its finished fixed-step runs (ok: {method: runs}),
    rounded to 4 digits and kept in DIR/budget.json. Written the first time and read afterwards, so
    that the same command asks for the same runs; a method that the file lacks is added, against
    the GRPO seconds it holds. share (--share): generation's seconds scaled to that share of GRPO's
    step (generation_scale), so the counts are those of a machine where generation weighs so."""
    plan = read_plan(path, steps)
    if plan is None and not ok.get("grpo"):
        raise ValueError("--budget seconds: no GRPO run finished, so there is no budget of seconds "
                         "(see the failed runs above)")
    plan = plan or {"command": command, "steps": steps, "seconds_per_step": {}, "budget_steps": {},
                    **({} if share is None else {"share": share})}
    new = sorted((m for m, runs in ok.items() if runs and m not in plan["budget_steps"]),
                 key=lambda m: m != "grpo")  # GRPO's first: the others are timed against it
    scale = generation_scale(ok.get("grpo") or [], share) if new else 1.0
    for m in new:
        plan["seconds_per_step"][m] = per_step = round(seconds_per_step(ok[m], scale), 4)
        plan["budget_steps"][m] = max(1, round(steps * plan["seconds_per_step"]["grpo"] / per_step))
    if new:
        with open(path, "w") as f:
            json.dump(plan, f, indent=1)
    return plan


def budget_configs(args, plan):
    """The budget's runs: every method whose step count differs from --steps, at its own count; a
    method at --steps (GRPO always) has its fixed-step runs."""
    steps = {m: n for m, n in plan["budget_steps"].items() if n != plan["steps"]}
    return configs(args, steps)[1] if steps else []


def in_budget(args, steps, keys, results, threads, command):
    """After the fixed-step runs (results, their keys): the plan, its runs (those finished before
    are reused), and their table and curves beside GRPO's fixed-step runs. -> {"plan", "table",
    "curves", "runs", "ran": how many of the runs this command ran}."""
    ok = {k[0]: [r for r in results if key(r) == k and r["error"] is None] for k in keys}
    plan = budget_plan(os.path.join(args.out, f"budget{share_suffix(args)}.json"), steps, ok,
                       command, args.share)
    cfgs = budget_configs(args, plan)
    saved = {cfg.out_dir: finished(cfg) for cfg in cfgs}
    todo = [cfg for cfg in cfgs if saved[cfg.out_dir] is None]
    print(f"in GRPO's budget of seconds, {len(cfgs)} runs at their own step counts: "
          f"{len(cfgs) - len(todo)} finished before (reused), {len(todo)} to run")
    runs = [r for r in saved.values() if r is not None] + execute(todo, args, threads, "budget")
    order = {cfg.out_dir: i for i, cfg in enumerate(cfgs)}
    runs.sort(key=lambda r: order[r["out_dir"]])
    same = [r for r in results if plan["budget_steps"].get(r["method"]) == plan["steps"]]
    rows, curves = aggregate(same + runs, [k for k in keys if k[0] in plan["budget_steps"]])
    return {"plan": plan, "table": rows, "curves": curves, "runs": runs, "ran": len(todo)}

# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
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
    p.add_argument("--budget", choices=("steps", "seconds"), default="steps",
                   help="steps: every method runs --steps steps. seconds: then each runs again in "
                        "GRPO's seconds of generation + update, at round(steps * GRPO's s/step / "
                        "its own) steps (DIR/budget.json), and a second table says how much sooner "
                        "than GRPO it reaches GRPO's final accuracy")
    p.add_argument("--share", type=float, default=None,
                   help="with --budget seconds: GRPO's budget on a machine where generation is "
                        "this share of its step (0.8: a GPU, say), generation's seconds scaled "
                        "(experiments/share.py gives the speed-up); its plan, runs and results "
                        "have -share0.8 in their names")
    for name, kind in PASS_THROUGH.items():  # None: train.py's default for the world
        kind = (lambda s: s if s == "all" else int(s)) if name == "eval_size" else kind
        p.add_argument(f"--{name}", type=kind, default=None, help="passed to train.Config" +
                       (" (all: the whole test split)" if name == "eval_size" else ""))
    for name in RATIOS:
        p.add_argument(f"--{name}", type=float, default=None,
                       help="passed to train.Config for the methods that use it")
    return p.parse_args(argv)


def share_suffix(args):
    """"-share0.8" for a budget at a generation share (--share), "" for the measured one."""
    return "" if getattr(args, "share", None) is None else f"-share{args.share:g}"


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


def configs(args, budget=None):
    """One resolved train.Config per (method, lr, K, seed), checked up front so that bad knobs, and
    finished runs with another config, fail before any run starts. budget: {method: steps}, the
    runs of GRPO's budget of seconds instead (--budget seconds): those methods only, each at its own
    step count, in runs/<method>-budget-seed<k>."""
    names = d3s.METHODS if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    methods = list(dict.fromkeys(names))  # in order, each once
    for m in methods:
        if m not in d3s.METHODS:
            raise ValueError(f"--methods: {m!r} is unknown; choose from {', '.join(d3s.METHODS)} "
                             "or all")
    for name in ("seeds", "jobs", "threads", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.share is not None and (args.budget != "seconds" or not 0 < args.share < 1):
        raise ValueError(f"--share {args.share} needs --budget seconds and a share in (0, 1)")
    if args.budget == "seconds" and "grpo" not in methods:
        raise ValueError("--budget seconds gives each method GRPO's seconds: add grpo to --methods")
    if args.budget == "seconds" and (args.lr_grid or args.updates_grid):
        raise ValueError("--budget seconds compares one setting per method: tune first "
                         "(--lr_grid), then pass --tuned")
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
    for m in methods if budget is None else [m for m in methods if m in budget]:
        ratios = {k: getattr(args, k) for k in schedule_knobs(m) if getattr(args, k) is not None}
        for lr, k in grid[m]:
            run = (m + ("" if args.lr_grid is None else f"-lr{lr:g}")
                   + ("" if args.updates_grid is None else f"-K{k}")
                   + ("" if budget is None else "-budget" + share_suffix(args)))
            for s in range(args.seed_start, args.seed_start + args.seeds):
                mine = {"method": m, "seed": s,
                        "out_dir": os.path.join(args.out, "runs", f"{run}-seed{s}"), **knobs,
                        **ratios, **({} if lr is None else {"lr": lr}),
                        **({} if k is None else {"updates_per_batch": k}),
                        **({} if budget is None else {"steps": budget[m]})}
                # the knobs bench sets are given; the others take train.py's defaults and presets.
                # A bad knob: config.check's one line
                cfgs.append(config.resolve(train.Config(**mine), given=mine))
    return methods, cfgs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = ("python experiments/bench.py " + " ".join(argv)).strip()
    try:
        methods, cfgs = configs(args)
        saved = {cfg.out_dir: finished(cfg) for cfg in cfgs}
        plan = (read_plan(os.path.join(args.out, f"budget{share_suffix(args)}.json"),
                          cfgs[0].steps) if args.budget == "seconds" else None)
        for cfg in budget_configs(args, plan) if plan else []:  # a repeat: check its budget's too
            finished(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    todo = [cfg for cfg in cfgs if saved[cfg.out_dir] is None]
    print(f"{command}\n{len(cfgs)} runs: {len(cfgs) - len(todo)} finished before (reused), "
          f"{len(todo)} to run")
    os.makedirs(args.out, exist_ok=True)
    # [ours] --threads 1 on a busy machine: a tiny model's generate is ~100x slower when its
    # OpenMP threads fight other processes for the cores.
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    t0 = time.time()
    results = [r for r in saved.values() if r is not None] + execute(todo, args, threads)
    order = {cfg.out_dir: i for i, cfg in enumerate(cfgs)}
    results.sort(key=lambda r: order[r["out_dir"]])
    keys = list(dict.fromkeys(key(cfg) for cfg in cfgs))
    rows, curves = aggregate(results, keys)
    tables, budget = [format_table(rows)], None
    if args.budget == "seconds":
        try:
            budget = in_budget(args, cfgs[0].steps, keys, results, threads, command)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if args.share is None:  # at another share its seconds are not these: share.py's table
            tables.append(format_budget_table(budget["table"], budget["plan"]))
        else:
            tables.append(f"In GRPO's budget at generation share {args.share:g}: steps "
                          f"{budget['plan']['budget_steps']} (the speed-up: experiments/share.py)")
    wall = time.time() - t0
    # the ratios each method applies
    per_run = ("method", "seed", "lr", "updates_per_batch", "out_dir", *RATIOS)
    # what every run shares
    shared = {k: v for k, v in as_json(cfgs[0]).items() if k not in per_run}
    ran = (f"{len(todo) + (budget['ran'] if budget else 0)} runs in {wall:.0f}s, {args.jobs} "
           f"at a time with {threads} torch thread(s) each (each run's own: results.json)")
    print("\n\n".join(tables))
    name = "results" + share_suffix(args)  # a share's budget keeps the measured one's files
    print(f"{ran}; {args.out}/{name}.md, {name}.json, bench{share_suffix(args)}.png")
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(f"`{command}`\n\n" + "\n\n".join(tables) + f"\n\n{ran}\n")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"command": command, "wall": wall, "jobs": args.jobs, "threads": threads,
                   "config": shared, "table": rows, "curves": curves, "runs": results,
                   **({"budget": budget} if budget else {})}, f, indent=1)
    if curves:
        fig = figure(curves, budget and budget["curves"])
        fig.savefig(os.path.join(args.out, f"bench{share_suffix(args)}.png"))
        plt.close(fig)
    if args.lr_grid is not None or args.updates_grid is not None:
        chosen = choose(rows)
        path = os.path.join(args.out, "tuned.json")
        with open(path, "w") as f:
            json.dump({"command": command,
                       "criterion": "highest mean AUC over the seeds (to 0.1 point); ties: the "
                                    "smaller K, then the smaller lr",
                       "lr": {m: lr for m, (lr, _) in chosen.items()},
                       "updates_per_batch": {m: k for m, (_, k) in chosen.items()},
                       "auc": {label(key(r), r.get("minibatch_size")): r.get("auc")
                               for r in rows}}, f, indent=1)
        print("chosen (highest mean AUC): "
              + ", ".join(f"{m} lr {lr:g} K {k}" for m, (lr, k) in chosen.items()))
        print(f"the study: the same command with --tuned {path} instead of the grids, the reported "
              "seeds (--seed_start 0) and its own --out")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
