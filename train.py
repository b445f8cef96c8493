"""
Train a language model on math with GRPO and D3S (Dynamic Dual-Level Down-Sampling, arXiv 2509.22115).

    python train.py                                  # the offline tiny world, CPU, about two minutes
    python train.py --method grpo                    # the baseline, same world
    python train.py --model Qwen2.5-0.5B             # GSM8K on one GPU (the REAL_MODEL preset below)
    python train.py --model Qwen2.5-0.5B --loss gspo --updates_per_batch 4
    python train.py --resume out/d3s-tiny            # continue an interrupted run
    python train.py --help                           # every knob, its default and what it does

One step (docs/algorithm.md has every equation and every [ours] choice):
    1 rollout: G samples per prompt -> 2 reward (0/1) -> 3 group advantages -> 4 sample selection (the
    rollouts whose advantages have maximal variance) -> 5 forward of the kept rollouts only -> 6 token
    selection (top |A| * entropy, pooled over the step) -> 7 K optimizer steps on the kept tokens.
Every knob is in the config block below, with its value; override any with --name value or --name=value.
"""
import argparse
import copy
import dataclasses
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

import d3s
import tiny
from data import format_prompt, load_problems
from eval import evaluate
from model import autocast, load_model, weight_dtype
from plots import plot_run
from reward import score
from rollout import CACHES, completion_hidden, generate_groups, head_logprobs

# -----------------------------------------------------------------------------
# config: every knob with the value a tiny-world run uses; REAL_MODEL below changes a few for real models


@dataclass
class Config:
    # model and data
    model: str = "tiny"                 # tiny | tiny-long | tiny-weak (offline, tiny.py) | Qwen2.5-0.5B | a hub id | a folder
    dataset: str = "tiny"               # training prompts: gsm8k | math | ... | a .jsonl path (a tiny world: its own)
    eval_dataset: str = ""              # held-out prompts, their test split ("": the dataset's own)
    data_dir: str = ""                  # local copies laid out as NAME/SPLIT.jsonl, e.g. gsm8k/train.jsonl ("": the hub)
    # the method (docs/algorithm.md, "Named methods") and its loss
    method: str = "d3s"                 # grpo | pods | d1s | d1s-cross | d2s | d3s | d3s-i | entropy
    loss: str = "grpo"                  # grpo (a ratio per token) | gspo (per sequence, GSPO-token form)
    scale: str = "group"                # advantage scale: group (GRPO) | none (Dr. GRPO)
    # the schedule of the keep ratios: rho(p) = (1 - p) * init + p * final, p = step / (steps - 1)
    s_init: float = 0.25                # rho_s at the first step: share of rollouts kept [ours]
    s_final: float = 0.75               # rho_s at the last step [ours]
    t_init: float = 0.2                 # rho_t at the first step: share of the kept rollouts' tokens kept [ours]
    t_final: float = 0.6                # rho_t at the last step [ours]
    # the batch
    steps: int = 100                    # rollout batches; the schedule counts these
    prompts_per_step: int = 16          # P prompts per step
    group_size: int = 8                 # G rollouts per prompt (B = P * G)
    max_new_tokens: int = 32            # completion budget (tiny-long: 64); a truncated rollout scores only an explicit answer
    temperature: float = 1.0            # sampling temperature; log-probs and entropy use softmax(logits / T)
    top_p: float = 1.0                  # must be 1 for training: the loss scores the full softmax (eval.py may differ)
    # the update
    updates_per_batch: int = 4          # K optimizer steps per rollout batch, one per mini-batch (K > 1: the clip acts)
    optimizer: str = "adamw"            # adamw | sgd (with momentum)
    lr: float = 5e-5                    # learning rate, constant (tiny: K and lr tuned in docs/study.md)
    momentum: float = 0.9               # SGD momentum (--optimizer sgd only)
    weight_decay: float = 0.0           # weight decay
    grad_clip: float = 1.0              # clip the gradient norm to this (0: off)
    clip_eps_low: float = 0.2           # ratio clip 1 - eps_low (--loss gspo: GSPO's 3e-4 unless set)
    clip_eps_high: float = 0.2          # ratio clip 1 + eps_high (--loss gspo: GSPO's 4e-4 unless set)
    beta: float = 0.0                   # k3 KL to the initial model (0: no reference model is kept)
    # speed and memory: none of these changes what is computed
    micro_batch_size: int = 128         # kept rollouts per forward/backward
    gen_batch_size: int = 0             # rollouts per generate call (0: all at once)
    generation: str = "prefix"          # KV cache: prefix (a prompt's cache computed once for its G samples) | plain | static
    logprob_chunk: int = 4096           # token positions per lm_head chunk: never the (B, T, V) float32 logits
    gradient_checkpointing: bool = False  # trade compute for activation memory on big models
    dtype: str = "auto"                 # auto: fp32 weights, bf16 autocast on a GPU | float32 | bfloat16
    # evaluation, logging, checkpoints
    eval_size: int = 200                # held-out prompts, greedy, the same subset every time
    eval_every: int = 25                # steps between evaluations (also at step 0 and at the end; 0: only those)
    save_every: int = 25                # steps between checkpoints (also at the end and on a signal; 0: only those)
    out_dir: str = ""                   # the run folder ("": out/<method>-<model>)
    seed: int = 0                       # prompt order, sampling, random selection, mini-batch shuffle
    device: str = "auto"                # auto | cpu | cuda | cuda:1 ...
    resume: str = ""                    # a run folder to continue from its last checkpoint
    progress: bool = True               # a progress bar over the steps
    wandb: bool = False                 # also log every step to Weights & Biases (pip install wandb)
    wandb_project: str = "nanod3s"      # the W&B project (--wandb true)


# A real model (--model not a tiny world): these replace the values above for every knob you did not
# set yourself. [ours] A reasonable single-GPU start for Qwen2.5-0.5B on GSM8K, not tuned; K = 4 is
# GSPO's and verl's usual split of a rollout batch.
REAL_MODEL = dict(dataset="gsm8k", steps=200, prompts_per_step=32, max_new_tokens=512, lr=1e-6, micro_batch_size=16,
                  eval_size=500, updates_per_batch=4)
# --loss gspo: GSPO's own clip range (the GSPO paper), for the clip knobs you did not set.
GSPO_CLIP = dict(clip_eps_low=3e-4, clip_eps_high=4e-4)
# Knobs that may change when a run is resumed: none of them changes what the run computes.
RESUME_SAFE = ("resume", "device", "progress", "eval_every", "save_every", "wandb", "wandb_project")


def is_tiny(model):
    """A tiny world: a name in tiny.WORLDS, or a folder that tiny.pretrained wrote (it holds tiny.json)."""
    return tiny.world_of(model) is not None


def resolve(cfg, given=None):
    """The config a run uses: the presets applied to the knobs not `given` (the knobs the user set;
    None: those that differ from Config's defaults), every knob checked, and the keep ratios as the
    method applies them (1 where it keeps everything): config.json records what ran."""
    given = given_knobs(cfg) if given is None else set(given)
    world = tiny.world_of(cfg.model)
    # a tiny world trains on its own questions, with its own token budget (tiny.WORLDS)
    presets = dict(REAL_MODEL) if world is None else {"dataset": world, "max_new_tokens": tiny.world(world)["max_new_tokens"]}
    if cfg.loss == "gspo":
        presets.update(GSPO_CLIP)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in presets.items() if k not in given})
    cfg.eval_dataset = cfg.eval_dataset or cfg.dataset
    cfg.out_dir = cfg.out_dir or os.path.join("out", f"{cfg.method}-{os.path.basename(cfg.model.rstrip('/'))}")
    check(cfg)
    for name, (value, why) in applied_ratios(cfg).items():  # a ratio the method would ignore is refused
        if getattr(cfg, name) != value and name in given:
            raise ValueError(f"--{name} {getattr(cfg, name)} does not apply to --method {cfg.method}: {why}; leave it out")
        setattr(cfg, name, value)
    return cfg


def given_knobs(cfg):
    return {f.name for f in dataclasses.fields(Config) if getattr(cfg, f.name) != f.default}


def applied_ratios(cfg):
    """{knob: (the value the method applies, why)} for the four keep ratios: 1 where the method keeps
    every rollout or token, the 80/20 baseline's fixed share, and init = final without a schedule."""
    method = d3s.METHODS[cfg.method]
    s_init, s_final, t_init, t_final = cfg.s_init, cfg.s_final, cfg.t_init, cfg.t_final
    out = {}
    if method["schedule"] == "constant":
        s_final, t_final = s_init, t_init
        out.update(s_final=(s_final, "it has no schedule, rho_s stays at --s_init"),
                   t_final=(t_final, "it has no schedule, rho_t stays at --t_init"))
    if method["sample"] == "none":
        out.update(s_init=(1.0, "it keeps every rollout"), s_final=(1.0, "it keeps every rollout"))
    if method["token"] == "none":
        out.update(t_init=(1.0, "it keeps every token"), t_final=(1.0, "it keeps every token"))
    elif "t_keep" in method:
        why = f"the 80/20 baseline keeps a fixed {method['t_keep']:.0%} of tokens"
        out.update(t_init=(method["t_keep"], why), t_final=(method["t_keep"], why))
    return {name: out.get(name, (value, "")) for name, value in
            (("s_init", s_init), ("s_final", s_final), ("t_init", t_init), ("t_final", t_final))}


def check(cfg):
    """Bad knobs are one-line ValueErrors that say what is allowed."""
    def must(ok, msg):
        if not ok:
            raise ValueError(msg)
    must(cfg.method in d3s.METHODS, f"--method {cfg.method!r} is unknown; choose one of {', '.join(d3s.METHODS)}")
    must(cfg.loss in d3s.LOSSES, f"--loss {cfg.loss!r} is unknown; choose one of {', '.join(d3s.LOSSES)}")
    must(cfg.scale in d3s.SCALES, f"--scale {cfg.scale!r} is unknown; choose one of {', '.join(d3s.SCALES)}")
    for name in ("s_init", "s_final", "t_init", "t_final"):
        value = getattr(cfg, name)
        must(0 < value <= 1, f"--{name} must be in (0, 1], got {value}")
    must(cfg.group_size >= 2, f"--group_size must be at least 2 (advantages compare rollouts of a prompt), got {cfg.group_size}")
    for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch_size", "eval_size", "logprob_chunk"):
        must(getattr(cfg, name) >= 1, f"--{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("eval_every", "save_every"):
        must(getattr(cfg, name) >= 0, f"--{name} must be at least 0 (0: only at the end), got {getattr(cfg, name)}")
    must(cfg.gen_batch_size >= 0, f"--gen_batch_size must be at least 0 (0: all at once), got {cfg.gen_batch_size}")
    must(cfg.temperature > 0, f"--temperature must be > 0 for RL sampling, got {cfg.temperature}")
    must(cfg.top_p == 1, f"--top_p {cfg.top_p}: training scores every sample with the full softmax(logits / T), so "
                         f"nucleus sampling would make the gradient not the sampler's; use 1 (eval.py --top_p may differ)")
    must(cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}")
    must(cfg.generation in CACHES, f"--generation must be one of {', '.join(CACHES)}, got {cfg.generation!r}")
    must(cfg.optimizer in ("adamw", "sgd"), f"--optimizer must be adamw or sgd, got {cfg.optimizer!r}")
    must(cfg.updates_per_batch >= 1, f"--updates_per_batch must be at least 1, got {cfg.updates_per_batch}")
    must(cfg.beta >= 0, f"--beta must be >= 0, got {cfg.beta}")
    must(cfg.dtype in ("auto", "float32", "bfloat16"), f"--dtype must be auto, float32 or bfloat16, got {cfg.dtype!r}")
    must(cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
         f"--device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")


# -----------------------------------------------------------------------------
# the step's helpers, in the order the step calls them


def batch_at(problems, step, size, seed):
    """The prompts of a step: a fixed shuffle per epoch, so a resumed run sees the same prompts."""
    out, epoch_seen = [], None
    for pos in range(step * size, (step + 1) * size):  # the data position is step * size
        epoch, i = divmod(pos, len(problems))
        if epoch != epoch_seen:
            order, epoch_seen = list(range(len(problems))), epoch
            random.Random(seed * 1000003 + epoch).shuffle(order)
        out.append(problems[order[i]])
    return out


def pop_var(x):
    """Population variance of a 1-D tensor (0 for fewer than 2 values)."""
    return x.var(unbiased=False).item() if x.numel() > 1 else 0.0


@dataclass
class Piece:
    """A micro-batch of kept rollouts, cut to its own span (Rollouts.piece)."""
    rows: torch.Tensor                     # (n,) indices into the kept rollouts
    input_ids: torch.Tensor                # (n, L)
    attention_mask: torch.Tensor           # (n, L)
    start: int                             # first completion column of input_ids
    width: int                             # completion columns: the (n, width) slice of every (N, T) tensor
    hidden: Optional[torch.Tensor] = None  # (n, width, H) with grad, when step 5 already ran this forward


def micro_batches(kept, rows, size):
    """The kept rollouts `rows` in micro-batches of at most `size`, longest first: sorted by length,
    each cut to its own span, so a short rollout never pays for a long one's padding. [ours]"""
    lengths = kept.prompt_mask[rows].sum(dim=1) + kept.completion_mask[rows].sum(dim=1)
    order = rows[torch.argsort(lengths, descending=True, stable=True)]
    return [Piece(r, *kept.piece(r)) for r in order.split(size)]


def minibatch_rows(n, k, generator):
    """The K mini-batches of a rollout batch: its n kept rollouts shuffled with the run's seed and
    split into k parts of near-equal size (docs/algorithm.md, "Several updates per rollout batch"). K = 1 keeps
    them in order and draws no random number, so a K = 1 run is exactly the plain on-policy step."""
    if k == 1:
        return [torch.arange(n)]
    return [part for part in torch.randperm(n, generator=generator).tensor_split(k) if len(part)]


@torch.no_grad()
def old_logprobs(model, kept, parts, cfg, precision, with_entropy):
    """Step 5 with K > 1: one no-grad forward of the kept rollouts, before any update: logp_old (N, T)
    of every valid token, and the entropy (N, T) (or None) of the policy that sampled."""
    valid = kept.completion_mask
    logp = torch.zeros(valid.shape, device=valid.device)
    entropy = torch.zeros(valid.shape, device=valid.device) if with_entropy else None
    for p in parts:
        with precision():
            hidden = completion_hidden(model, p.input_ids, p.attention_mask, p.start)
            lp, ent = head_logprobs(model, hidden, p.input_ids[:, p.start:], valid[p.rows, :p.width],
                                    cfg.temperature, with_entropy, cfg.logprob_chunk)
        logp[p.rows, :p.width] = lp
        if with_entropy:
            entropy[p.rows, :p.width] = ent
    return logp, entropy


def first_forward_entropy(model, kept, piece, cfg, precision):
    """Step 5 with K = 1 and one micro-batch: the gradient forward runs now (kept on the piece for
    step 7) and the entropy comes from its hidden states, no gradient, no extra pass."""
    with precision():
        piece.hidden = completion_hidden(model, piece.input_ids, piece.attention_mask, piece.start)
        with torch.no_grad():
            _, ent = head_logprobs(model, piece.hidden, piece.input_ids[:, piece.start:],
                                   kept.completion_mask[piece.rows, :piece.width], cfg.temperature, True,
                                   cfg.logprob_chunk)
    entropy = torch.zeros(kept.completion_mask.shape, device=ent.device)
    entropy[piece.rows, :piece.width] = ent
    return entropy


def entropy_and_old_logp(model, kept, parts, cfg, precision, token_mode):
    """Step 5: (logp_old, entropy) of the kept rollouts' tokens, (N, T) each or None, from the policy
    that sampled, computed with as few extra passes as possible (docs/algorithm.md):
      K > 1                      one no-grad forward gives both (docs/algorithm.md, several updates per batch)
      K = 1, one micro-batch     no logp_old (the ratio is 1); the entropy from the gradient forward
                                 itself, which runs now and is kept on the piece for step 7
      K = 1, several             [ours] the entropy recorded while sampling (rollout.Sampler)
    The entropy is needed only for token selection."""
    select = token_mode != "none"
    if cfg.updates_per_batch > 1:
        return old_logprobs(model, kept, parts, cfg, precision, select)
    if not select:
        return None, None
    if len(parts) == 1:
        return None, first_forward_entropy(model, kept, parts[0], cfg, precision)
    return None, kept.entropy


def backward(model, kept, parts, adv, token_mask, old_logp, cfg, precision, ref_model=None):
    """Step 7 for one mini-batch (`parts`, its micro-batches): the loss summed over its kept tokens,
    divided by their number, and its gradient, accumulated micro-batch by micro-batch. old_logp None:
    on-policy, the ratio is 1. Returns the statistics, or None when the mini-batch kept no token."""
    valid = kept.completion_mask
    num_tokens = sum(int(token_mask[p.rows, :p.width].sum()) for p in parts)  # this update's divisor
    if num_tokens == 0:
        return None  # [ours] nothing to learn from: no optimizer step (AdamW would still move the weights)
    stats = {"loss": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "kl": 0.0, "ratio_min": math.inf,
             "ratio_max": -math.inf, "tokens": num_tokens}
    for p in parts:
        keep, seq, targets = token_mask[p.rows, :p.width], valid[p.rows, :p.width], p.input_ids[:, p.start:]
        if not keep.any():
            continue  # no kept token in this micro-batch: no loss term, no forward
        with precision():
            hidden = p.hidden if p.hidden is not None else completion_hidden(model, p.input_ids, p.attention_mask, p.start)
            p.hidden = None  # the graph is used once
            # the lm_head runs only on the kept tokens: the loss has no other term with a gradient
            logp, _ = head_logprobs(model, hidden, targets, keep, cfg.temperature, False, cfg.logprob_chunk)
            if old_logp is None:  # on-policy, one update per batch: logp_old = logp, the ratio is 1
                old = logp.detach()
            else:
                old = old_logp[p.rows, :p.width]
                if cfg.loss == "gspo":  # s_i averages over every valid token; no gradient off the kept ones
                    with torch.no_grad():
                        rest, _ = head_logprobs(model, hidden, targets, seq & ~keep, cfg.temperature, False,
                                                cfg.logprob_chunk)
                    logp = logp + rest
            ref_logp = None
            if ref_model is not None:  # the frozen initial policy, for the k3 KL term
                with torch.no_grad():
                    ref_hidden = completion_hidden(ref_model, p.input_ids, p.attention_mask, p.start)
                    ref_logp, _ = head_logprobs(ref_model, ref_hidden, targets, keep, cfg.temperature, False,
                                                cfg.logprob_chunk)
        loss, st = d3s.policy_loss(logp, old, adv[p.rows], keep, num_tokens, loss=cfg.loss, eps_low=cfg.clip_eps_low,
                                   eps_high=cfg.clip_eps_high, ref_logp=ref_logp, beta=cfg.beta, seq_mask=seq)
        loss.backward()
        share = int(keep.sum()) / num_tokens  # policy_loss's stats are means over its own kept tokens
        stats["loss"] += loss.item()
        for k in ("clip_frac", "ratio_mean", "kl"):
            stats[k] += st.get(k, 0.0) * share
        stats["ratio_min"], stats["ratio_max"] = min(stats["ratio_min"], st["ratio_min"]), max(stats["ratio_max"], st["ratio_max"])
    return stats


def optimizer_step(model, optimizer, grad_clip, loss):
    """Clip the gradient norm and step; a NaN/inf loss or gradient is not applied. -> (grad_norm, skipped)"""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    skipped = not (math.isfinite(loss) and torch.isfinite(grad_norm))
    if skipped:  # counted in the log
        tqdm.write("warning: a non-finite loss or gradient; this update is skipped")
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm.item(), "skipped": int(skipped)}


def step_stats(updates, num_tokens):
    """The step's statistics over its updates: means weighted by each update's kept tokens."""
    done = updates
    if not done:
        return {"loss": 0.0, "losses": [], "grad_norm": 0.0, "clip_frac": 0.0, "ratio": 1.0, "ratio_min": 1.0,
                "ratio_max": 1.0, "kl": 0.0, "updates": 0, "skipped": 0}

    def mean(key):
        return sum(u[key] * u["tokens"] for u in done) / max(num_tokens, 1)
    return {"loss": sum(u["loss"] for u in done) / len(done), "losses": [u["loss"] for u in done],
            "grad_norm": sum(u["grad_norm"] for u in done) / len(done), "clip_frac": mean("clip_frac"),
            "ratio": mean("ratio_mean"), "ratio_min": min(u["ratio_min"] for u in done),
            "ratio_max": max(u["ratio_max"] for u in done), "kl": mean("kl"), "updates": len(done),
            "skipped": sum(u["skipped"] for u in done)}


class Stopwatch:
    """Seconds spent inside `with stopwatch:` blocks, added up (the forward and backward time)."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self.t0 = time.time()

    def __exit__(self, *exc):
        self.seconds += time.time() - self.t0


def step_record(step, G, rollouts, rewards, adv, kept, adv_kept, token_mask, reward_stats, updates, **extra):
    """The step's statistics: one row of log.jsonl (and of the step line, and of wandb)."""
    valid = kept.completion_mask
    return {
        "step": step, "reward": rewards.mean().item(), "zero_var": (rewards.view(-1, G).std(dim=1) == 0).float().mean().item(),
        "kept": len(kept.texts), "rollouts": len(rewards), "tokens": int(token_mask.sum()), "valid": int(valid.sum()),
        "valid_all": int(rollouts.completion_mask.sum()), "var_adv": pop_var(adv), "var_kept": pop_var(adv_kept),
        "entropy": kept.entropy[valid].mean().item(), "length": rollouts.lengths.float().mean().item(),
        "truncated": rollouts.truncated.float().mean().item(), "no_answer": reward_stats["no_answer"],
        **step_stats(updates, int(token_mask.sum())), **extra,
    }


def step_line(r, K):
    """The one greppable line per step."""
    return (f"step {r['step']:4d} | reward {r['reward']:.2f} | zero-var {r['zero_var']:.2f} | kept {r['kept']}/{r['rollouts']} | "
            f"tokens {r['tokens']}/{r['valid']} | var(A) {r['var_adv']:.2f}->{r['var_kept']:.2f} | entropy {r['entropy']:.2f} | "
            f"len {r['length']:.0f} | trunc {r['truncated']:.2f} | grad {r['grad_norm']:.2f}"
            + (f" | clip {r['clip_frac']:.3f} ratio {r['ratio_min']:.3f}-{r['ratio_max']:.3f}" if K > 1 else "")
            + f" | gen {r['t_gen']:.1f}s upd {r['t_upd']:.1f}s")


def held_out(model, tokenizer, eval_set, cfg, precision):
    """Greedy accuracy on the held-out prompts (eval.evaluate, the same as eval.py's)."""
    with precision():
        return evaluate(model, tokenizer, eval_set, n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                        batch_size=cfg.gen_batch_size or 256)["accuracy"]


def start_wandb(cfg):
    """A Weights & Biases run (nanoGPT's wandb_log), or None. Imported only when asked for."""
    if not cfg.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise ValueError("--wandb true needs the wandb package: pip install wandb (or leave --wandb out)") from None
    return wandb.init(project=cfg.wandb_project, name=os.path.basename(os.path.normpath(cfg.out_dir)),
                      config=dataclasses.asdict(cfg))


class Signals:
    """Ctrl-C (SIGINT) and SIGTERM (what a job scheduler, a container runtime or `kill` sends) both end
    the run with a checkpoint. Between a batch's first optimizer step and its log line they wait
    (`hold`), so that a checkpoint always falls on a rollout-batch boundary; a second signal then
    quits at once, without saving. Installed only in the main thread (Python's rule for signals)."""

    def __init__(self):
        self.received, self.hold, self.old = None, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def handler(self, signum, frame):
        first = self.received is None
        self.received = signum
        if self.hold and first:
            tqdm.write("stopping after this batch's updates (signal again to quit without saving)")
            return
        raise KeyboardInterrupt

    def release(self):
        """End of a batch: a signal that came during it ends the run now."""
        self.hold = False
        if self.received is not None:
            raise KeyboardInterrupt


# -----------------------------------------------------------------------------
# checkpoints


def rng_state(generator):
    """Every random state the loop draws from: sampling (torch), the `random` control, Python."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "select": generator.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def save_checkpoint(run_dir, model, tokenizer, optimizer, step, rng, history, tokens_trained):
    """Model + tokenizer as an HF folder (RUN/checkpoint), plus trainer.pt with what resuming needs.

    Crash-safe: written to checkpoint.tmp, whose trainer.pt comes last (so a tmp with a trainer.pt is
    complete), then swapped in: checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint, remove
    checkpoint.old. At every instant one complete checkpoint exists, and finish_swap (called by
    --resume and before every save) completes a swap that a crash cut short.
    """
    finish_swap(run_dir)
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({
        "step": step,                                   # the next step to run
        "data_position": step,                          # batch_at(step) draws prompts step*P .. (step+1)*P-1
        "optimizer": optimizer.state_dict(),
        "rng": rng,                                     # as at the start of `step`
        "history": history,                             # held-out evaluations so far
        "tokens_trained": tokens_trained,
    }, os.path.join(tmp, "trainer.pt.part"))
    os.replace(os.path.join(tmp, "trainer.pt.part"), os.path.join(tmp, "trainer.pt"))  # tmp is complete
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def finish_swap(run_dir):
    """Complete a checkpoint swap that a crash interrupted: afterwards RUN/checkpoint is the newest
    complete checkpoint (if there is any), and no .tmp or .old folder is left."""
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    if os.path.isfile(os.path.join(tmp, "trainer.pt")):  # a finished save: newer than anything else here
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
    elif not os.path.isdir(final) and os.path.isfile(os.path.join(old, "trainer.pt")):
        os.replace(old, final)  # the crash came between the two renames, before tmp was complete
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def load_resume(run_dir):
    """The saved config and trainer state of a run folder, or a one-line error."""
    ckpt = os.path.join(run_dir, "checkpoint")
    if not os.path.isdir(run_dir):
        raise ValueError(f"--resume {run_dir}: no such folder; pass the run folder of an earlier train.py run")
    finish_swap(run_dir)
    for need in (os.path.join(run_dir, "config.json"), os.path.join(ckpt, "trainer.pt"), os.path.join(ckpt, "config.json")):
        if not os.path.isfile(need):
            raise ValueError(f"--resume {run_dir}: incomplete run folder, {need} is missing (it has no finished "
                             f"checkpoint yet); start a fresh run instead")
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)
    try:
        state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
    except Exception as e:
        raise ValueError(f"--resume {run_dir}: {ckpt}/trainer.pt is corrupt ({str(e).splitlines()[0]}); "
                         f"start a fresh run") from None
    return saved, state


# -----------------------------------------------------------------------------
# the training loop


# setup and the training loop


def resumed(cfg, given):
    """(config, given, trainer state) of --resume RUN: the run continues with its saved config, in the
    folder given (it may have been moved); only the RESUME_SAFE knobs may change."""
    saved, state = load_resume(cfg.resume)
    refused = sorted(given - set(RESUME_SAFE))
    if refused:
        raise ValueError(f"--resume continues a run with its saved config; {', '.join('--' + n for n in refused)} "
                         f"cannot change now (only {', '.join('--' + n for n in RESUME_SAFE[1:])} can); start a "
                         f"new run to change them")
    saved.update({n: getattr(cfg, n) for n in given}, resume=cfg.resume, out_dir=cfg.resume)
    return Config(**saved), {f.name for f in dataclasses.fields(Config)}, state  # the saved config is complete


def setup(cfg, state, log):
    """Data, model, optimizer, random states and the run folder of a fresh run, or of a resumed one
    (state: its trainer.pt)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    train_set = load_problems(cfg.dataset, "train", data_dir=cfg.data_dir or None)  # data first: a typo fails fast
    eval_set = load_problems(cfg.eval_dataset, "test", data_dir=cfg.data_dir or None)[:cfg.eval_size]
    # [ours] --dtype auto: fp32 master weights, forward passes in bf16 autocast on a GPU (model.py):
    # pure bf16 weights (8-bit mantissa) round away most updates of size lr * 1 = 1e-6
    model, tokenizer = load_model(cfg.model, device=device, dtype=weight_dtype(cfg.dtype))
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 else None  # the initial policy
    if state is not None:  # the policy continues from the checkpoint; the reference stays the initial model
        model, tokenizer = load_model(os.path.join(cfg.out_dir, "checkpoint"), device=device, dtype=weight_dtype(cfg.dtype))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    # fused: one kernel over all parameters (6x faster than the per-tensor loop for a 135M model on a CPU)
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                    fused=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # after loading: a run that first builds out/tiny samples what later runs do
    generator = torch.Generator().manual_seed(cfg.seed)  # the `random` control and the mini-batch shuffle
    history, tokens_trained = [], 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        generator.set_state(state["rng"]["select"])
        history, tokens_trained = state["history"], state["tokens_trained"]
        log(f"resuming {cfg.out_dir} at step {state['step']}")
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    if state is None and os.path.exists(os.path.join(cfg.out_dir, "log.jsonl")):
        os.remove(os.path.join(cfg.out_dir, "log.jsonl"))  # a fresh run in an old folder starts a fresh log
    start = state["step"] if state is not None else 0
    method = d3s.METHODS[cfg.method]
    log(f"run {cfg.out_dir} | {cfg.model} on {device} | {cfg.method} ({method['sample']} samples, {method['token']} "
        f"tokens, {method['schedule']} schedule) + {cfg.loss}, K={cfg.updates_per_batch} | {len(train_set)} train / "
        f"{len(eval_set)} eval prompts")
    return device, train_set, eval_set, model, tokenizer, ref_model, optimizer, generator, start, history, tokens_trained


def train(cfg, log=print, given=None):
    """Run (or resume) one training run. Returns the held-out evaluations [{step, tokens, accuracy}].

    given: the knobs the user set (the command line's flags); None: those that differ from Config's defaults.
    """
    given, state = given_knobs(cfg) if given is None else set(given), None
    if cfg.resume:
        cfg, given, state = resumed(cfg, given)
    cfg = resolve(cfg, given)
    (device, train_set, eval_set, model, tokenizer, ref_model, optimizer, generator, start, history,
     tokens_trained) = setup(cfg, state, log)
    method, K, G, run_dir = d3s.METHODS[cfg.method], cfg.updates_per_batch, cfg.group_size, cfg.out_dir

    def precision():
        return autocast(device, cfg.dtype)

    def evaluate_and_plot(step):
        history.append({"step": step, "tokens": tokens_trained, "accuracy": held_out(model, tokenizer, eval_set, cfg,
                                                                                     precision)})
        log(f"eval step {step} | held-out accuracy {history[-1]['accuracy']:.3f} ({len(eval_set)} {cfg.eval_dataset} "
            f"test prompts, greedy)")
        plot_run(run_dir, history)  # run_dir/curves.png
        if wandb_run:
            wandb_run.log({"accuracy": history[-1]["accuracy"]}, step=step)

    wandb_run = start_wandb(cfg)
    if not history:
        evaluate_and_plot(0)
    completed, step, rng = start, start, rng_state(generator)  # completed: steps fully applied to the model
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not cfg.progress, dynamic_ncols=True)
    with Signals() as signals:
        try:
            for step in bar:
                rng = rng_state(generator)  # a signal inside this step replays it from here, exactly
                rho_s, rho_t = d3s.keep_ratios(step, cfg.steps, method["schedule"], cfg.s_init, cfg.s_final,
                                               cfg.t_init, cfg.t_final)  # the schedule: aggressive early, relaxed late
                t0, fb = time.time(), Stopwatch()

                # 1. rollout: G samples per prompt, group by group (and the sampler's entropy)
                batch = batch_at(train_set, step, cfg.prompts_per_step, cfg.seed)
                with precision():
                    rollouts = generate_groups(model, tokenizer, [format_prompt(tokenizer, r["prompt"]) for r in batch], G,
                                               cfg.max_new_tokens, temperature=cfg.temperature, cache=cfg.generation,
                                               batch_size=cfg.gen_batch_size or None, record_entropy=True)
                t_gen, t0 = time.time() - t0, time.time()

                # 2. reward: 1 when the final answer is right; no answer scores 0 and is counted
                rewards, reward_stats = score(rollouts.texts, [r["answer"] for r in batch for _ in range(G)],
                                              truncated=rollouts.truncated.tolist())
                rewards = torch.tensor(rewards)  # (B,)

                # 3. advantages on the full group (GRPO)
                adv = d3s.group_advantages(rewards, G, scale=cfg.scale)  # (B,)

                # 4. sample-level down-sampling: the max-variance subset, not re-normalised (pods re-normalises)
                idx, adv_kept = d3s.select_samples(rewards, adv, G, rho_s, method["sample"], generator=generator,
                                                   scale=cfg.scale)
                kept, adv_kept = rollouts.select(idx.to(device)), adv_kept.to(device)  # the others never reach the model
                N, valid = len(idx), kept.completion_mask  # (N, T)

                # 5. the entropy for token selection, and logp_old when K > 1: the only forward without gradient
                parts = micro_batches(kept, torch.arange(N, device=device), cfg.micro_batch_size)
                with fb:
                    old_logp, entropy = entropy_and_old_logp(model, kept, parts, cfg, precision, method["token"])

                # 6. token-level down-sampling: the top rho_t of |A| * H, pooled over every kept token of the step
                token_mask = valid if method["token"] == "none" else d3s.select_tokens(
                    d3s.token_scores(adv_kept, entropy, method["token"]), valid, rho_t)  # (N, T) bool

                # 7. K optimizer steps: the kept rollouts shuffled into K mini-batches, each divided by its kept tokens
                minibatches = [parts] if K == 1 else [micro_batches(kept, rows.to(device), cfg.micro_batch_size)
                                                      for rows in minibatch_rows(N, K, generator)]
                updates = []
                for mb in minibatches:
                    with fb:
                        u = backward(model, kept, mb, adv_kept, token_mask, old_logp, cfg, precision, ref_model)
                    if u is not None:
                        signals.hold = True  # the weights move now: a signal waits for the batch to finish
                        updates.append({**u, **optimizer_step(model, optimizer, cfg.grad_clip, u["loss"])})
                completed, tokens_trained = step + 1, tokens_trained + int(token_mask.sum())

                # log: one line per step; every field in log.jsonl (and wandb)
                row = step_record(step, G, rollouts, rewards, adv, kept, adv_kept, token_mask, reward_stats, updates,
                                  rho_s=rho_s, rho_t=rho_t, t_gen=t_gen, t_upd=time.time() - t0, t_fb=fb.seconds,
                                  tokens_trained=tokens_trained)
                with open(os.path.join(run_dir, "log.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
                tqdm.write(step_line(row, K)) if cfg.progress else log(step_line(row, K))
                if wandb_run:
                    wandb_run.log(row, step=step)
                signals.release()

                # evaluate, plot and checkpoint
                if (cfg.eval_every and completed % cfg.eval_every == 0) or completed == cfg.steps:
                    evaluate_and_plot(completed)
                if (cfg.save_every and completed % cfg.save_every == 0) or completed == cfg.steps:
                    save_checkpoint(run_dir, model, tokenizer, optimizer, completed, rng_state(generator), history,
                                    tokens_trained)
        except KeyboardInterrupt:
            bar.close()
            if signals.hold and completed == step:  # a second signal between two updates: the weights are mid-batch
                log(f"\nquit without saving; continue from the last checkpoint: python train.py --resume {run_dir}")
                raise
            rng = rng_state(generator) if completed == step + 1 else rng  # an unfinished step is replayed
            save_checkpoint(run_dir, model, tokenizer, optimizer, completed, rng,
                            [h for h in history if h["step"] <= completed], tokens_trained)
            log(f"\ninterrupted: checkpoint saved after step {completed}; continue with: python train.py --resume {run_dir}")
            raise KeyboardInterrupt(signals.received or signal.SIGINT)
    bar.close()
    if wandb_run:
        wandb_run.finish()
    log(f"done: held-out accuracy {history[0]['accuracy']:.3f} -> {history[-1]['accuracy']:.3f} ({cfg.eval_dataset}, "
        f"{len(eval_set)} prompts, greedy); run folder {run_dir}")
    return history


# -----------------------------------------------------------------------------
# command line: every field of Config is a flag, --name value or --name=value


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2, like every other bad input."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_bool(text):
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; use true or false")
    return value


def knob_comments():
    """{knob: its comment in the config block above}, for --help."""
    lines = inspect.getsource(Config).splitlines()
    return {m.group(1): m.group(2) for m in map(re.compile(r"\s+(\w+): \w+ = .*?  # (.*)").fullmatch, lines) if m}


def parse_args(argv):
    """(Config, the names of the flags given)."""
    parser = OneLineParser(description=__doc__.split("\n")[1], epilog="Defaults are the tiny world's; with a real model "
                           "REAL_MODEL changes the knobs marked 'real model', unless you set them.")
    comments = knob_comments()
    for f in dataclasses.fields(Config):
        default = f"default {f.default!r}" + (f"; real model {REAL_MODEL[f.name]!r}" if f.name in REAL_MODEL else "")
        parser.add_argument(f"--{f.name}", type=parse_bool if f.type is bool else f.type, default=argparse.SUPPRESS,
                            metavar=f.type.__name__.upper(), help=f"{comments.get(f.name, '')} ({default})".replace("%", "%%"))
    given = vars(parser.parse_args(argv))
    return Config(**given), set(given)


def main(argv=None):
    cfg, given = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        train(cfg, given=given)
    except ValueError as e:  # bad input: one line, exit code 2, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # saved a checkpoint; 130 for Ctrl-C, 143 for SIGTERM (128 + the signal)
        sys.exit(128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT))


if __name__ == "__main__":
    main()
