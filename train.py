"""
Train a language model on math with GRPO and D3S (Dynamic Dual-Level Down-Sampling, arXiv 2509.22115).

    python train.py                                  # the offline tiny world, CPU, about a minute
    python train.py --method grpo                    # the baseline, same world
    python train.py --model Qwen2.5-0.5B             # GSM8K on one GPU (each knob's `real` value)
    python train.py --model Qwen2.5-0.5B --loss gspo # GSPO's sequence ratio and clip range
    python train.py --resume out/d3s-tiny            # continue an interrupted run
    python train.py --help                           # every knob, its value(s) and what it does

One step (docs/algorithm.md has every equation and every [ours] choice):
    1 rollout: G samples per prompt -> 2 reward (0/1) -> 3 group advantages -> 4 sample selection (the
    rollouts whose advantages have maximal variance) -> 5 forward of the kept rollouts only -> 6 token
    selection (top |A| * entropy, pooled over the step) -> 7 K optimizer steps on the kept tokens.
"""
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from machinery import checkpoint
from machinery import config
import d3s
from machinery import plots
from machinery import tiny
from machinery.config import pick
from machinery.data import describe, format_prompt, load_problems
from eval import evaluate
from machinery.logs import NO_SIGNAL, Stopwatch, start_wandb, step_line, step_record
from machinery.model import autocast, load_model, weight_dtype
from reward import score
from rollout import NonFiniteLogits, completion_hidden, generate_groups, head_logprobs

# -----------------------------------------------------------------------------
# config: every knob with the value a run uses. pick(tiny=..., real=...) holds both values on the knob's
# line: the tiny worlds' and a real model's (the clip's by --loss). Edit any value here; --name value
# overrides it (config.py). The run folder's config.json records every knob as it ran.


@dataclass
class Config:
    # model and data
    model: str = "tiny"                 # tiny | tiny-long | tiny-weak (offline: tiny.py) | Qwen2.5-0.5B | hub id | dir
    dataset: str = pick(tiny="tiny", tiny_long="tiny-long", real="gsm8k")  # gsm8k | math | a .jsonl; held out: test
    data_dir: str = ""                  # local copies laid out as NAME/SPLIT.jsonl, e.g. gsm8k/train.jsonl ("": hub)
    # the method (docs/algorithm.md, "Named methods") and its loss
    method: str = "d3s"                 # grpo | pods | d1s | d1s-cross | d2s | d3s | d3s-i | entropy
    loss: str = "grpo"                  # grpo (a ratio per token) | gspo (per sequence, GSPO-token form)
    # the schedule of the keep ratios: rho(p) = (1 - p) * init + p * final, p = step / (steps - 1)
    s_init: float = 0.25                # rho_s at the first step: share of rollouts kept [ours]
    s_final: float = 0.75               # rho_s at the last step [ours]
    t_init: float = 0.2                 # rho_t at the first step: share of the kept rollouts' tokens kept [ours]
    t_final: float = 0.6                # rho_t at the last step [ours]
    # the batch
    steps: int = pick(tiny=100, real=200)           # rollout batches; the schedule counts these
    prompts_per_step: int = pick(tiny=16, real=32)  # P prompts per step
    group_size: int = 8                 # G rollouts per prompt (B = P * G)
    max_new_tokens: int = pick(tiny=32, tiny_long=64, real=512)  # completion budget; a cut-off rollout: grading.md
    temperature: float = 1.0            # sampling temperature; log-probs and entropy use softmax(logits / T)
    # the update
    updates_per_batch: int = 4          # K optimizer steps per rollout batch, one per mini-batch (K > 1: the clip acts)
    optimizer: str = "adamw"            # adamw | sgd (momentum 0.9)
    lr: float = pick(tiny=5e-5, real=1e-6)  # constant (tiny: tuned in experiments/study.md; real: a start, not tuned [ours])
    grad_clip: float = 1.0              # clip the gradient norm to this (0: off)
    clip_eps_low: float = pick(grpo=0.2, gspo=3e-4)   # ratio clip 1 - eps_low, by --loss (gspo: GSPO's own)
    clip_eps_high: float = pick(grpo=0.2, gspo=4e-4)  # ratio clip 1 + eps_high, by --loss
    beta: float = 0.0                   # k3 KL to the initial model (0: no reference model is kept)
    # speed and memory: none of these changes what is computed (beyond float rounding)
    micro_batch_size: int = pick(tiny=128, real=16)  # kept rollouts per forward/backward
    gen_batch_size: int = 0             # rollouts per generate call (0: all at once)
    generation: str = "prefix"          # KV cache: prefix (a prompt's cache once for its G samples) | plain | static
    logprob_chunk: int = 4096           # token positions per lm_head chunk: never the (B, T, V) float32 logits
    gradient_checkpointing: bool = False  # trade compute for activation memory on big models
    dtype: str = "auto"                 # auto: fp32 weights, bf16 autocast on a bf16 GPU (8.0+) | float32 | bfloat16
    # evaluation, logging, checkpoints
    eval_size: int = pick(tiny=200, real=500)  # held-out test prompts, greedy, the same ones every time
    eval_every: int = 25                # steps between evaluations (also at step 0 and at the end; 0: only those)
    save_every: int = 25                # steps between checkpoints (also at the end and on a signal; 0: only those)
    out_dir: str = ""                   # the run folder ("": out/<method>-<model>-<knob>=<value> of each flag given)
    overwrite: bool = False             # let a fresh run replace what another run left in out_dir (else it refuses)
    seed: int = 0                       # prompt order, and the seed of every random number of every step
    device: str = "auto"                # auto | cpu | cuda | cuda:1 ...
    resume: str = ""                    # a run folder to continue from its last checkpoint
    wandb: str = ""                     # a Weights & Biases project to log every step to ("": off; pip install wandb)


def train(cfg, log=print, given=None):
    """Run (or resume) one training run. Returns the held-out evaluations [{step, tokens, accuracy}].
    given: the knobs the user set (the command line's flags); None: those that differ from Config's first values."""
    given, state = config.given_knobs(cfg) if given is None else set(given), None
    if cfg.resume:  # the run's saved config and trainer state (checkpoint.py)
        cfg, given, state = checkpoint.resume(cfg, given)
    cfg = config.resolve(cfg, given)  # each knob's value for this run, checked
    method, K, G, run_dir = d3s.METHODS[cfg.method], cfg.updates_per_batch, cfg.group_size, cfg.out_dir
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    world = tiny.world_of(cfg.model)  # a tiny world (by name, or a folder that says so), else None: a real model

    def ctx():  # [ours] --dtype auto: fp32 master weights, forward passes in bf16 autocast on a GPU (model.py)
        return autocast(device, cfg.dtype)

    train_set = load_problems(cfg.dataset, "train", data_dir=cfg.data_dir or None)  # data first: a typo fails fast
    eval_set = load_problems(cfg.dataset, "test", data_dir=cfg.data_dir or None)[:cfg.eval_size]
    if state is None:  # a folder that holds another run is refused before any work, unless --overwrite true
        checkpoint.check_fresh(run_dir, cfg.overwrite)
    # the policy (from the checkpoint when resuming), and for the KL term the frozen initial model
    source = os.path.join(run_dir, "checkpoint") if state is not None else cfg.model
    model, tokenizer = load_model(source, device=device, dtype=weight_dtype(cfg.dtype))
    ref_model = None
    if cfg.beta > 0:
        ref_model = load_model(cfg.model, device=device, dtype=weight_dtype(cfg.dtype))[0].eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    disable_dropout(model).train()  # train mode for gradient checkpointing; no dropout: the ratio needs it
    optimizer = make_optimizer(model, cfg)
    start, history, tokens_trained = 0, [], 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        start, history, tokens_trained = state["step"], state["history"], state["tokens_trained"]
        log(f"resuming {run_dir} at step {start}" + "".join(f"; --{k} {a} -> {b}" for k, (a, b) in
                                                             state["changed"].items()))
    else:
        checkpoint.fresh(run_dir, cfg.overwrite)  # created, or emptied of the run it held
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    log(f"run {run_dir} | {cfg.model} on {device}, {f'the {world} world' if world else 'a real model'}'s values | "
        f"{cfg.method} ({method['sample']} samples, {method['token']} tokens, {method['schedule']} schedule) + "
        f"{cfg.loss}, K={K} | {len(train_set)} train / {len(eval_set)} held-out: "
        f"{describe(cfg.dataset, 'test', cfg.data_dir or None)}")
    wandb_run = start_wandb(cfg)
    bar = tqdm(total=cfg.steps, initial=start, disable=not sys.stderr.isatty(), dynamic_ncols=True)  # a terminal only
    say = tqdm.write if not bar.disable else log
    completed, saved, oom = start, start if state else None, False  # completed: the steps applied to the model
    with checkpoint.Signals() as signals:
        try:
            for step in range(start, cfg.steps + 1):
                # evaluate (step 0, every eval_every, the end; again if a stop cut it short) and checkpoint
                evaluate_now = due(step, cfg.eval_every, cfg.steps) and step not in [h["step"] for h in history]
                if evaluate_now:
                    history.append({"step": step, "tokens": tokens_trained,
                                    "accuracy": held_out(model, tokenizer, eval_set, cfg, ctx)})
                    report_eval(run_dir, history, len(eval_set), cfg, say, wandb_run)
                # a checkpoint when due, and when a resumed run redid a missing evaluation, so it is recorded
                if (step > start and due(step, cfg.save_every, cfg.steps, first=False)) or (evaluate_now and step
                                                                                             == start > 0):
                    saved = checkpoint.save(run_dir, model, tokenizer, optimizer, step, history, tokens_trained, world)
                if step == cfg.steps:
                    break
                rho_s, rho_t = d3s.keep_ratios(step, cfg.steps, method["schedule"], cfg.s_init, cfg.s_final,
                                               cfg.t_init, cfg.t_final)  # the schedule: aggressive early, relaxed late
                seed = cfg.seed * 1_000_003 + step  # [ours] every random number of this step, so a replay is exact
                generator = torch.Generator().manual_seed(seed)  # the `random` control and the mini-batch shuffle
                t0, fb = time.time(), Stopwatch()

                # 1. rollout: G samples per prompt, group by group (and the sampler's entropy)
                batch = batch_at(train_set, step, cfg.prompts_per_step, cfg.seed)
                with ctx():
                    rollouts = generate_groups(model, tokenizer, [format_prompt(tokenizer, r["prompt"]) for r in batch],
                                               G, cfg.max_new_tokens, temperature=cfg.temperature, seed=seed,
                                               cache=cfg.generation, batch_size=cfg.gen_batch_size or None,
                                               record_entropy=True)
                t_gen, t0 = time.time() - t0, time.time()

                # 2. reward: 1 when the final answer is right; no answer scores 0 and is counted
                rewards, reward_stats = score(rollouts.texts, [r["answer"] for r in batch for _ in range(G)],
                                              truncated=rollouts.truncated.tolist())
                rewards = torch.tensor(rewards)  # (B,)

                # 3. advantages on the full group (GRPO)
                adv = d3s.group_advantages(rewards, G)  # (B,)

                # 4. sample-level down-sampling: the max-variance subset, not re-normalised (pods re-normalises);
                # the other rollouts never reach the model again
                idx, adv_kept = d3s.select_samples(rewards, adv, G, rho_s, method["sample"], generator=generator)
                kept, adv_kept = rollouts.select(idx.to(device)), adv_kept.to(device)
                N, valid = len(idx), kept.completion_mask  # (N, T)
                token_mask, scores, updates = torch.zeros_like(valid), None, []
                # [ours] with no advantage and no KL there is nothing to learn: the loss and its gradient are exactly 0
                if cfg.beta > 0 or bool((adv_kept != 0).any()):
                    # 5. the kept rollouts' entropy for step 6, and logp_old when K > 1: one forward, no gradient,
                    # cut into step 7's mini-batches and micro-batches (the same shapes give the same numbers)
                    minibatches = [micro_batches(kept, rows.to(device), cfg.micro_batch_size)
                                   for rows in minibatch_rows(N, K, generator)]
                    with fb:
                        old_logp, entropy = entropy_and_old_logp(model, kept, minibatches, cfg, ctx, method["token"])

                    # 6. token-level down-sampling: the top rho_t of |A| * H, pooled over every kept token of the step
                    token_mask = valid
                    if method["token"] != "none":
                        scores = d3s.token_scores(adv_kept, entropy, method["token"])  # (N, T)
                        token_mask = d3s.select_tokens(scores, valid, rho_t)  # (N, T) bool

                    # 7. K optimizer steps: the kept rollouts shuffled into K mini-batches, each its own token mean;
                    # the first runs on the policy that sampled, so its ratio is exactly 1 (logp_old = logp)
                    for i, mb in enumerate(minibatches):
                        with fb:
                            u = backward(model, kept, mb, adv_kept, token_mask, old_logp if i else None, cfg, ctx,
                                         ref_model)
                        if u is not None:  # None: nothing to learn in this mini-batch, no optimizer step
                            signals.hold = True  # the weights move: a signal waits for the end of the batch
                            updates.append({**u, **optimizer_step(model, optimizer, cfg.grad_clip, u["loss"])})
                tokens_trained += sum(u["tokens"] for u in updates if u["applied"])

                # log: one line per step; every field in log.jsonl (and wandb); what the step kept (plots.py)
                row = step_record(step, G, rollouts, rewards, adv, kept, adv_kept, reward_stats, updates,
                                  rho_s=rho_s, rho_t=rho_t, t_gen=t_gen, t_upd=time.time() - t0, t_fb=fb.seconds,
                                  tokens_trained=tokens_trained)
                write_row(run_dir, row, wandb_run)
                completed = step + 1
                say(step_line(row, K))
                bar.update(1)
                if due(completed, cfg.eval_every, cfg.steps):  # the page of what this step kept (plots.py)
                    plots.write_selection(run_dir, selection_record(tokenizer, rollouts, batch, rewards, adv, idx,
                                                                    token_mask, scores, row, cfg.method))
                signals.release()
        except KeyboardInterrupt:
            bar.close()
            if signals.hold and completed == step:  # a second signal while the batch's weights were moving
                log(f"\nquit without saving; continue from the last checkpoint: python train.py --resume {run_dir}")
                raise KeyboardInterrupt(signals.received or 2) from None
            checkpoint.save(run_dir, model, tokenizer, optimizer, completed,
                            [h for h in history if h["step"] <= completed], tokens_trained, world)
            log(f"\ninterrupted: checkpoint saved after step {completed - 1} (it resumes at step {completed}); "
                f"continue with: python train.py --resume {run_dir}")
            raise KeyboardInterrupt(signals.received or 2) from None  # 2: SIGINT, for the exit code
        except NonFiniteLogits as e:  # no checkpoint: these weights are what went wrong
            raise config.Stop(f"step {step}: {e}; no checkpoint saved; start a new run with a lower --lr (from "
                              f"--model {run_dir}/checkpoint if its weights are still sound)") from None
        except torch.OutOfMemoryError:
            oom = True  # handled below, once the exception's frames (and their tensors) are released
    if oom:
        bar.close()
        if not signals.hold:  # no weight of this batch moved yet: the steps applied so far are saved
            optimizer.zero_grad(set_to_none=True)
            saved = checkpoint.save(run_dir, model, tokenizer, optimizer, completed,
                                    [h for h in history if h["step"] <= completed], tokens_trained, world)
        raise config.Stop(checkpoint.out_of_memory(cfg, step, saved))
    bar.close()
    if wandb_run:
        wandb_run.finish()
    idle = sum(r["no_signal"] for r in read_rows(run_dir) if r["step"] >= start)
    log(f"done: held-out accuracy {history[0]['accuracy']:.3f} -> {history[-1]['accuracy']:.3f} ({cfg.dataset}, "
        f"{len(eval_set)} prompts, greedy); {idle} of {cfg.steps - start} steps had nothing to learn "
        f"(no update); run folder {run_dir}")
    return history


def due(step, every, steps, first=True):
    """Is an evaluation (first: also at step 0) or a checkpoint due at `step`? Every `every` steps (0:
    never) and at the end."""
    return (first and step == 0) or step == steps or (every > 0 and step % every == 0)


def write_row(run_dir, row, wandb_run):
    """The step's row: appended to RUN/log.jsonl (and sent to wandb)."""
    with open(os.path.join(run_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if wandb_run:
        wandb_run.log(row, step=row["step"])


def read_rows(run_dir):
    """The rows of RUN/log.jsonl ([] when there is none)."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def selection_record(tokenizer, rollouts, batch, rewards, adv, idx, token_mask, scores, row, method):
    """plots.selection_record of this step: its groups, what each level kept, and why a skipped step was skipped."""
    why = {"skipped_reason": NO_SIGNAL} if row["no_signal"] else {}
    return plots.selection_record(tokenizer, rollouts, [r["prompt"] for r in batch], [r["answer"] for r in batch],
                                  rewards, adv, idx, token_mask, scores, {**row, "method": method, **why})


def report_eval(run_dir, history, n, cfg, say, wandb_run):
    """The evaluation just appended to history: its line, RUN/curves.png (from the first step on) and wandb."""
    h = history[-1]
    say(f"eval step {h['step']} | held-out accuracy {h['accuracy']:.3f} ({n} held-out {cfg.dataset} prompts, greedy)")
    if h["step"] > 0:  # before the first step there is nothing to draw
        plots.plot_run(run_dir, history)
    if wandb_run:
        wandb_run.log({"accuracy": h["accuracy"]}, step=h["step"])


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
    """The K mini-batches of a rollout batch: its n kept rollouts shuffled and split into k parts of
    near-equal size (docs/algorithm.md, "Several updates per rollout batch"). K = 1: one part, in order."""
    if k == 1:
        return [torch.arange(n)]
    return [part for part in torch.randperm(n, generator=generator).tensor_split(k) if len(part)]


def entropy_and_old_logp(model, kept, minibatches, cfg, ctx, token_mode):
    """Step 5: (logp_old, entropy) of the kept rollouts' tokens, (N, T) each or None, from the policy
    that sampled, with as few extra passes as possible (docs/algorithm.md):
      K > 1                      one no-grad forward gives both, on step 7's micro-batches; logp_old
                                 only for mini-batches 2..K (the first takes logp_old = logp itself)
      K = 1, one micro-batch     no logp_old (the ratio is 1); the entropy from the gradient forward
                                 itself, which runs now and is kept on the piece for step 7
      K = 1, several             [ours] the entropy recorded while sampling (rollout.Sampler)
    The entropy is needed only for token selection."""
    select, valid, K = token_mode != "none", kept.completion_mask, cfg.updates_per_batch
    parts = [p for mb in (minibatches if select else minibatches[1:]) for p in mb]
    if K == 1 and (not select or len(parts) > 1):
        return None, kept.entropy if select else None
    logp, entropy = torch.zeros(valid.shape, device=valid.device), torch.zeros(valid.shape, device=valid.device)
    for p in parts:
        with ctx(), torch.set_grad_enabled(K == 1):
            hidden = completion_hidden(model, p.input_ids, p.attention_mask, p.start)
            with torch.no_grad():
                lp, ent = head_logprobs(model, hidden, p.input_ids[:, p.start:], valid[p.rows, :p.width],
                                        cfg.temperature, select, cfg.logprob_chunk)
        logp[p.rows, :p.width] = lp
        if select:
            entropy[p.rows, :p.width] = ent
        if K == 1:
            p.hidden = hidden  # the gradient forward of step 7, already done
    return (logp if K > 1 else None), (entropy if select else None)


def backward(model, kept, parts, adv, token_mask, old_logp, cfg, ctx, ref_model=None):
    """Step 7 for one mini-batch (`parts`, its micro-batches): the loss summed over its kept tokens,
    divided by their number, and its gradient, accumulated micro-batch by micro-batch. old_logp None:
    the policy has not moved since it sampled (K = 1, or the batch's first mini-batch), so the ratio is
    exactly 1. Returns the statistics, or None when the mini-batch has nothing to learn."""
    valid = kept.completion_mask
    # [ours] no kept token, or (beta = 0) none with a nonzero advantage: the gradient is exactly 0, so no
    # optimizer step either (AdamW's moments would still move the weights)
    learn = token_mask if cfg.beta > 0 else token_mask & (adv != 0)[:, None]
    counts = torch.stack([torch.stack([token_mask[p.rows, :p.width].sum(), learn[p.rows, :p.width].sum()])
                          for p in parts]).tolist()  # [[kept, learnable] per micro-batch]: one wait for the device
    if not any(n_learn for _, n_learn in counts):
        return None
    num_tokens = sum(n_keep for n_keep, _ in counts)  # this update's divisor
    pieces = []  # per micro-batch, as tensors: read once, after the last one
    for p, (n_keep, _) in zip(parts, counts):
        keep, seq, targets = token_mask[p.rows, :p.width], valid[p.rows, :p.width], p.input_ids[:, p.start:]
        if n_keep == 0:
            continue  # no kept token in this micro-batch: no loss term, no forward
        with ctx():
            hidden = p.hidden if p.hidden is not None else completion_hidden(model, p.input_ids, p.attention_mask,
                                                                              p.start)
            p.hidden = None  # the graph is used once
            # the lm_head runs only on the kept tokens: the loss has no other term with a gradient
            logp, _ = head_logprobs(model, hidden, targets, keep, cfg.temperature, False, cfg.logprob_chunk)
            if old_logp is None:  # the policy that sampled: logp_old = logp, exactly, on any device and dtype
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
        share = n_keep / num_tokens  # policy_loss's means are over its own kept tokens
        row = (loss.detach(), st["clipped"], st["signal"], st["ratio_mean"] * share,
               st.get("kl", loss.new_zeros(())) * share, st["ratio_min"], st["ratio_max"])
        pieces.append(torch.stack([v.double() for v in row]))
    table = torch.stack(pieces)  # (micro-batches, 7)
    loss, clipped, signal, ratio_mean, kl, ratio_min, ratio_max = torch.cat(
        [table[:, :5].sum(dim=0), table[:, 5].min()[None], table[:, 6].max()[None]]).tolist()
    return {"loss": loss, "clip_frac": clipped / max(signal, 1), "ratio_mean": ratio_mean, "kl": kl,
            "ratio_min": ratio_min, "ratio_max": ratio_max, "tokens": num_tokens, "on_policy": old_logp is None}


def disable_dropout(model):
    """[ours] No dropout in the policy (TRL's disable_dropout does the same): the ratio and the KL compare
    the policy with itself, so a forward must be a function of the weights alone. With dropout the first
    mini-batch's ratio is not 1, and dropout's draws from torch's global generator make two runs with one
    seed differ and a resume inexact. Qwen2 and Llama keep their attention dropout as a float on each
    attention module (and in the config, saved with every checkpoint), not as an nn.Dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for key, value in vars(model.config).items():
        if "dropout" in key and isinstance(value, float):
            setattr(model.config, key, 0.0)
    return model


def make_optimizer(model, cfg):
    """AdamW (no weight decay) or SGD with momentum 0.9, fused: one kernel over all parameters (6x faster
    than the per-tensor loop for a 135M model on a CPU)."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, fused=True)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, fused=True)


def optimizer_step(model, optimizer, grad_clip, loss):
    """Clip the gradient norm and step. Not applied, and not counted as an update: a NaN/inf loss or
    gradient, or [ours] a gradient of exactly 0 (every token with a gradient was clipped), on which
    AdamW's moments would still move the weights. -> {grad_norm, applied, nonfinite, zero_grad}"""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf).item()
    nonfinite, zero = not (math.isfinite(loss) and math.isfinite(grad_norm)), grad_norm == 0.0
    if nonfinite:  # counted in the log
        tqdm.write("warning: a non-finite loss or gradient; this update is not applied")
    elif not zero:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "applied": not (nonfinite or zero), "nonfinite": int(nonfinite),
            "zero_grad": int(zero)}


def held_out(model, tokenizer, eval_set, cfg, ctx):
    """Greedy accuracy on the held-out prompts (eval.evaluate, the same as eval.py's)."""
    with ctx():
        return evaluate(model, tokenizer, eval_set, n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                        batch_size=cfg.gen_batch_size or 256)["accuracy"]


if __name__ == "__main__":
    config.main(Config, train, description=__doc__.split("\n")[1])
