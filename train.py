"""
Train a language model on math with GRPO and D3S (Dynamic Dual-Level Down-Sampling, 2509.22115).

    python train.py                          # D3S on the offline tiny world: a few minutes on a CPU
    python train.py --method grpo            # the baseline, same world
    python train.py --model Qwen2.5-0.5B     # GSM8K on one GPU (each knob's `real` value)
    python train.py --resume out/d3s-tiny    # continue an interrupted run
    python train.py --help                   # every knob, its value(s) and what it does

A step is one rollout batch, in seven parts (docs/algorithm.md has every equation, [ours] choices):
1 rollout: G samples per prompt -> 2 reward (0/1) -> 3 group advantages -> 4 sample selection (the
rollouts whose advantages have maximal variance) -> 5 their tokens' entropy (the sampler's) -> 6
token selection (top |A| * entropy, pooled over the step) -> 7 K updates, forwarding what they use.
"""
from machinery.config import main, pick  # first: a Ctrl-C while anything loads is one line
import math
import time
from dataclasses import dataclass
from functools import partial

import torch
import d3s
from eval import evaluate
from machinery.data import batch_at, format_prompt, load_problems
from machinery.logs import Stopwatch, step_record
from machinery.model import (adapters_off, autocast, disable_dropout, grad_scaler, load_model,
                             reference_model, with_lora)
from machinery.run import Run
from reward import score
from rollout import completion_hidden, generate_groups, head_logprobs, micro_batches

# -----------------------------------------------------------------------------
# config: every knob with its value; edit it here or pass --name value (config.json records it).
# pick(...) holds a value per kind of run, the first that applies wins: gpu= on a GPU, lora_* with
# --lora_rank, a world's (tiny_long=), tiny=/real=, the loss's, the method's, else the first one.


@dataclass
class Config:
    # model and data
    model: str = "tiny"             # tiny[-long|-weak|-fork] | Qwen2.5-0.5B | hub id | folder
    dataset: str = pick(tiny="tiny", tiny_long="tiny-long", real="gsm8k")  # gsm8k | math | a .jsonl
    data_dir: str = ""              # local copies as NAME/SPLIT.jsonl: gsm8k/train.jsonl ("": hub)
    # the method (docs/algorithm.md, "Named methods"), its loss and their divisor (d3s.divisors)
    method: str = "d3s"             # grpo | grpo-filter | pods | d1s | d1s-cross | d2s | d3s
                                    # | d3s-i | entropy | the controls d3s-entropy | d3s-random
                                    # | d3s-random-nonzero | d1s-cross-random
    loss: str = "grpo"              # grpo (a ratio per token) | gspo (a ratio per sequence)
    divisor: str = pick(default="kept", method_entropy="valid", gspo="seq")  # kept [ours] |
                                                                             # valid (80/20, DAPO)
                                                                             # | seq (GRPO, GSPO)
    # the schedule of the keep ratios: rho(p) = (1 - p) * init + p * final, p = step / (steps - 1)
    s_init: float = 0.25            # rho_s at the first step: the share of rollouts kept [ours]
    s_final: float = 0.75           # rho_s at the last step [ours]
    t_init: float = 0.2             # rho_t at the first step: the share of their tokens kept [ours]
    t_final: float = 0.6            # rho_t at the last step [ours]
    # a step: P prompts, G rollouts each, then K updates (or ceil(kept / M))
    steps: int = pick(tiny=100, real=200)           # steps; the schedule counts these
    prompts_per_step: int = pick(tiny=16, real=32)  # P prompts per step
    group_size: int = 8             # G rollouts per prompt (B = P * G)
    max_new_tokens: int = pick(tiny=32, tiny_long=64, real=512)  # cut-off rollouts: docs/grading.md
    temperature: float = 1.0        # sampling; log-probs and entropy use softmax(logits / T) too
    # the update (lora_: LoRA's lr, ~10x full fine-tuning's: LoRA Without Regret, Schulman 2025)
    updates_per_batch: int = 4      # K updates per step, one per mini-batch (K > 1: the clip acts)
    minibatch_size: int = 0         # or M rollouts per update, ceil(kept / M) updates (0: K)
    optimizer: str = "adamw"        # adamw | sgd (momentum 0.9)
    lr: float = pick(tiny=5e-5, real=1e-6, lora_tiny=5e-4, lora_real=1e-5)  # constant (tiny: tuned)
    grad_clip: float = 1.0          # clip the gradient norm to this (0: off)
    clip_eps_low: float = pick(grpo=0.2, gspo=3e-4)   # ratio clip 1 - eps_low (gspo: GSPO's own)
    clip_eps_high: float = pick(grpo=0.2, gspo=4e-4)  # ratio clip 1 + eps_high (gspo: GSPO's own)
    beta: float = 0.0               # k3 KL to the initial model (0: no reference model is kept)
    lora_rank: int = 0              # LoRA's rank: only its adapters train (0: every weight trains)
    # speed and memory, none changes what is computed; on a GPU "auto" fits them to its memory
    micro_batch_size: int = pick(gpu="auto", tiny=128, real=16)  # kept rollouts per fwd/backward
    gen_batch_size: int = pick(gpu="auto", default=0)  # rollouts per generate call (0: all at once)
    generation: str = "loop"        # loop (rollout.decode: compiled on a GPU) | hf (HF generate)
    logprob_chunk: int = pick(gpu="auto", default=4096)  # positions per lm_head chunk, never all
    gradient_checkpointing: bool = pick(gpu="auto", default=False)  # less activation memory, slower
    dtype: str = "auto"             # auto (autocast on a GPU) | float16 | float32 | bfloat16
    # evaluation, logging, checkpoints
    eval_size: int = pick(tiny=200, real=500)  # held-out test prompts, greedy, the same every time
    eval_every: int = 25  # steps between evaluations (also at step 0 and the end; 0: only those)
    save_every: int = 25  # steps between checkpoints (also at the end, on a signal; 0: only those)
    out_dir: str = ""               # the run folder ("": out/<method>-<model>-<knob>=<value>...)
    overwrite: bool = False         # let a fresh run replace another run in out_dir (else refused)
    seed: int = 0                   # prompt order, and every random number of every step
    device: str = "auto"            # auto | cpu | cuda | cuda:1 ...
    resume: str = ""                # a run folder to continue from its last checkpoint
    wandb: str = ""  # a Weights & Biases project to log every step to ("": off; pip install wandb)


def train(cfg, log=print, given=None):
    """Run (or resume) one run; returns its held-out evaluations [{step, tokens, accuracy}]. given:
    the knobs the user set (the flags); None: those that differ from Config's values."""
    with Run(cfg, given, log) as run:  # the values, the run folder, how it stops: machinery/run.py
        cfg, device = run.cfg, run.device
        method, G = d3s.METHODS[cfg.method], cfg.group_size

        ctx = partial(autocast, device, cfg.dtype)  # [ours] --dtype auto: autocast on a GPU
        train_set = load_problems(cfg.dataset, "train", data_dir=cfg.data_dir or None)
        eval_set = load_problems(cfg.dataset, "test", data_dir=cfg.data_dir or None)[:cfg.eval_size]
        model, tokenizer = load_model(run.weights, device, cfg.dtype, lora=cfg.lora_rank > 0)
        if run.state is None:  # fresh: LoRA's adapters (rank 0: none), a LoRA --model merged first
            model = with_lora(model, cfg.lora_rank, cfg.model, cfg.seed)
        ref_model = reference_model(model, cfg, device)  # the KL term's frozen initial model
        run.size(model, tokenizer, train_set, eval_set)  # on a GPU, "auto": machinery/memory.py
        if cfg.gradient_checkpointing:
            model.activation_checkpointing_enable()
        disable_dropout(model).train()  # [ours] no dropout: the ratio compares the policy to itself
        optimizer = make_optimizer(model, cfg)
        scaler = grad_scaler(optimizer, device, cfg.dtype)  # float16's gradient scaler, else off
        run.begin(model, tokenizer, optimizer, train_set, eval_set)  # config.json, the first lines

        for step in range(run.start, cfg.steps + 1):
            if run.eval_due(step):  # step 0, every eval_every steps, the end
                run.evaluated(step, held_out(model, tokenizer, eval_set, cfg, ctx, run))
            if run.save_due(step):  # every save_every steps, the end
                run.save(step)
            if step == cfg.steps:
                break
            rho_s, rho_t = d3s.keep_ratios(step, cfg.steps, method["schedule"], cfg.s_init,
                                           cfg.s_final, cfg.t_init, cfg.t_final)  # relaxed late
            seed = cfg.seed * 1_000_003 + step  # [ours] the step's random numbers: exact replays
            generator = torch.Generator().manual_seed(seed)  # `random` control, mini-batch shuffle
            t0, fb = time.time(), Stopwatch()

            # 1. rollout: G samples per prompt, group by group (and the sampler's entropy)
            batch = batch_at(train_set, step, cfg.prompts_per_step, cfg.seed)
            prompts = [format_prompt(tokenizer, r["prompt"]) for r in batch]
            with ctx():  # run.fit: out of memory lowers a knob in cfg and calls again; a signal
                rollouts = run.fit("generation", lambda: generate_groups(  # stops the step here
                    model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature, seed=seed,
                    engine=cfg.generation, batch_size=cfg.gen_batch_size or None,
                    record_entropy=True, stop=run.stop))
            t_gen, t0 = time.time() - t0, time.time()

            # 2. reward: 1 when the final answer is right; no answer scores 0 and is counted
            answers = [r["answer"] for r in batch for _ in range(G)]
            rewards, reward_stats = score(rollouts.texts, answers, rollouts.truncated.tolist())
            rewards = torch.tensor(rewards)  # (B,)

            # 3. advantages on the full group (GRPO); a zero-variance group has A = 0
            adv = d3s.group_advantages(rewards, G)  # (B,)

            # 4. sample level: the max-variance subset, not re-normalised; the rest never go on
            idx, adv_kept = d3s.select_samples(rewards, adv, G, rho_s, method["sample"], generator)
            kept, adv_kept = rollouts.select(idx.to(model.device)), adv_kept.to(model.device)
            valid, updates, forward = kept.completion_mask, [], {}  # (N, T)
            parts = minibatch_rows(len(idx), cfg, generator)  # step 7's mini-batches, drawn first
            # 5. the entropy H of every kept token: [ours] the sampler's, recorded at step 1 (the
            #    same distribution), so that no forward runs for token selection alone
            # 6. token level: the top rho_t of |A| * H, pooled over every kept token of the step
            token_mask, scores = valid, None
            if method["token"] != "none" and len(idx):  # random: no score, a uniform draw
                scores = d3s.token_scores(adv_kept, kept.entropy, method["token"])  # or None
                count = None if scores is not None else d3s.d3s_token_count(  # D3S's count
                    rewards, adv, rollouts.lengths, G, rho_s, rho_t)
                token_mask = d3s.select_tokens(scores, valid, rho_t, generator, count)

            # 7. K updates (or ceil(N / M)), one per mini-batch; the first's ratio is 1. [ours] Only
            #    what the loss reads is forwarded: a rollout up to its last kept token (causal),
            #    none whose every term is 0 (A = 0, beta = 0); GSPO off-policy reads all, for s_i
            reads = valid if cfg.loss == "gspo" else None
            minibatches = [micro_batches(kept, rows.to(model.device), cfg.micro_batch_size,
                                         d3s.needed_columns(token_mask, adv_kept, cfg.beta,
                                                            reads if i else None))
                           for i, rows in enumerate(parts)]
            if any(minibatches):  # [ours] else every term is exactly 0: no pass, no update
                with fb:  # logp_old of mini-batches 2..K: one no-grad pass (a halving re-splits)
                    old_logp, forward = run.fit("no_grad", lambda: old_logprobs(
                        model, kept, minibatches[1:], token_mask, cfg, ctx), minibatches)
                for i, (rows, mb) in enumerate(zip(parts, minibatches)):
                    with fb:
                        u = run.fit("update", lambda: backward(
                            model, kept, rows, mb, adv_kept, token_mask, old_logp if i else None,
                            cfg, ctx, ref_model, scaler), minibatches)
                    if u is not None:  # None: nothing to learn; once a weight moves, signals wait
                        updates.append({**u, **optimizer_step(model, optimizer, cfg.grad_clip,
                                                              u["loss"], scaler)})
            run.tokens_trained += sum(u["tokens"] for u in updates if u["applied"])

            # log: the step line, RUN/log.jsonl (and wandb), the selection page before an evaluation
            row = step_record(step, G, rollouts, rewards, adv, kept, adv_kept, reward_stats,
                              updates, rho_s=rho_s, rho_t=rho_t, t_gen=t_gen, t_fb=fb.seconds,
                              t_upd=time.time() - t0, tokens_trained=run.tokens_trained,
                              minibatches=len(parts), forward=forward)
            run.end_step(row, selection=(rollouts, batch, rewards, adv, idx, token_mask, scores))
        return run.finish()


# -----------------------------------------------------------------------------
# the step's helpers, in the order the step calls them


def minibatch_rows(n, cfg, generator):
    """The mini-batches of a step: its n kept rollouts shuffled and split into K parts of near-equal
    size, or with M = --minibatch_size into ceil(n / M) [ours] near-equal parts, not M each and a
    remainder (docs/algorithm.md, "Several updates per step"). One part: in order, no draw."""
    k = -(-n // cfg.minibatch_size) if cfg.minibatch_size > 0 else cfg.updates_per_batch
    if k == 1:
        return [torch.arange(n)]
    return [part for part in torch.randperm(n, generator=generator).tensor_split(k) if len(part)]


def old_logprobs(model, kept, minibatches, token_mask, cfg, ctx):
    """logp_old (N, T) of the policy that sampled, where mini-batches 2..K (`minibatches`) read it:
    their kept tokens (GSPO: every valid one, for s_i), in one no-grad forward at step 7's shapes.
    -> (logp_old or None without such a mini-batch, the pass's counts)."""
    pieces = [p for mb in minibatches for p in mb]
    if not pieces:  # K = 1, or nothing to learn: the first mini-batch's ratio is exactly 1
        return None, {}
    reads = kept.completion_mask if cfg.loss == "gspo" else token_mask  # (N, T)
    logp, counts = torch.zeros(reads.shape, device=reads.device), []
    for p in pieces:
        with ctx(), torch.no_grad():
            hidden = completion_hidden(model, p.input_ids, p.attention_mask, p.start)
            logp[p.rows, :p.width] = head_logprobs(model, hidden, p.input_ids[:, p.start:],
                                                   reads[p.rows, :p.width], cfg.temperature,
                                                   False, cfg.logprob_chunk)[0]
        counts.append(torch.stack([p.attention_mask.sum(), torch.tensor(p.attention_mask.numel()),
                                   reads[p.rows, :p.width].sum()]))
    tokens, positions, head = torch.stack(counts).sum(dim=0).tolist()
    return logp, {"nograd_tokens": tokens, "nograd_positions": positions, "head_rows": head}


def backward(model, kept, rows, parts, adv, token_mask, old_logp, cfg, ctx, ref_model=None,
             scaler=None):
    """Step 7 for one mini-batch, the kept rollouts `rows`: the loss summed over their kept tokens
    over --divisor's d_i, and its gradient, forwarded micro-batch by micro-batch (`parts`: the rows
    whose terms are not all 0, each cut after the last column the loss reads). old_logp None: the
    policy that sampled (K = 1, or the first mini-batch): ratio exactly 1. -> statistics or None."""
    if not parts:  # [ours] no kept token with A != 0 (and beta = 0): the gradient is exactly 0
        return None
    valid, head = kept.completion_mask, (cfg.temperature, False, cfg.logprob_chunk)
    div = torch.ones_like(valid[:, 0], dtype=torch.long)
    div[rows] = d3s.divisors(token_mask[rows], valid[rows], cfg.divisor)  # every row of the update
    pieces = []  # per micro-batch, as tensors: read once, after the last one
    for p in parts:
        keep, seq = token_mask[p.rows, :p.width], valid[p.rows, :p.width]  # (n, width)
        targets, n_keep, ref_logp = p.input_ids[:, p.start:], keep.sum(), None
        with ctx():
            hidden = completion_hidden(model, p.input_ids, p.attention_mask, p.start)
            logp, _ = head_logprobs(model, hidden, targets, keep, *head)  # the kept tokens only
            old, heads = logp.detach(), n_keep  # the policy that sampled: logp_old = logp, exactly
            if old_logp is not None:
                old = old_logp[p.rows, :p.width]
                if cfg.loss == "gspo":  # s_i: the mean over every valid token; gradient: kept only
                    with torch.no_grad():
                        rest = head_logprobs(model, hidden, targets, seq & ~keep, *head)[0]
                    logp, heads = logp + rest, seq.sum()
            if ref_model is not None:  # the frozen initial policy, for the k3 KL term
                with torch.no_grad(), adapters_off(ref_model):  # LoRA: the base (model.py)
                    ref = completion_hidden(ref_model, p.input_ids, p.attention_mask, p.start)
                    ref_logp = head_logprobs(ref_model, ref, targets, keep, *head)[0]
        loss, st = d3s.policy_loss(logp, old, adv[p.rows], keep, div[p.rows], loss=cfg.loss,
                                   eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
                                   ref_logp=ref_logp, beta=cfg.beta, seq_mask=seq)
        (scaler.scale(loss) if scaler else loss).backward()  # float16: scaled, none underflows
        real = p.attention_mask.sum()  # the compute: prompt and completion tokens, no padding
        row = (loss.detach(), st["clipped"], st["signal"], st["ratio_mean"] * n_keep,
               st.get("kl", loss.new_zeros(())) * n_keep, n_keep, real, p.attention_mask.numel(),
               heads + n_keep * (ref_logp is not None), real * (ref_logp is not None),
               st["ratio_min"], st["ratio_max"])
        pieces.append(torch.stack([torch.as_tensor(v).double() for v in row]))
    table = torch.stack(pieces)  # (micro-batches, 12)
    (loss, clipped, signal, ratio, kl, computed, tokens, positions, heads, ref, ratio_min,
     ratio_max, kept_tokens) = torch.cat([table[:, :10].sum(dim=0), table[:, 10].min()[None],
                                          table[:, 11].max()[None],
                                          token_mask[rows].sum()[None].double()]).tolist()
    return {"loss": loss, "clipped": int(clipped), "signal": int(signal),
            "clip_frac": clipped / max(signal, 1), "ratio_mean": ratio / computed,
            "kl": kl / computed, "ratio_min": ratio_min, "ratio_max": ratio_max,
            "tokens": int(kept_tokens), "fwd_bwd_tokens": int(tokens),
            "fwd_bwd_positions": int(positions), "head_rows": int(heads),
            "nograd_tokens": int(ref), "on_policy": old_logp is None}


def make_optimizer(model, cfg):
    """AdamW (no weight decay) or SGD with momentum 0.9, fused, over the weights that train."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, fused=True)


def optimizer_step(model, optimizer, grad_clip, loss, scaler):
    """Clip the gradient norm and step. Not applied, and not counted as an update: a NaN/inf loss or
    gradient (float16: an inf one of a finite loss is the scaler's skip), or [ours] a gradient of
    exactly 0 (all its tokens clipped), on which AdamW's moments would still move the weights."""
    scaler.unscale_(optimizer)  # float16: the true gradient, before the clip (else a no-op)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf).item()
    nonfinite, zero = not (math.isfinite(loss) and math.isfinite(norm)), norm == 0.0
    skip = nonfinite and math.isfinite(loss) and scaler.is_enabled()  # float16: scale too high
    if nonfinite and not skip:  # the step line counts these too
        print(f"warning: a non-finite loss ({loss}) or gradient; this update is not applied")
    elif not (nonfinite or zero):
        optimizer.step()
    scaler.update()  # float16: halved after a skip, doubled after 2000 steps without one
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": norm, "applied": not (nonfinite or zero), "zero_grad": int(zero),
            "nonfinite": int(nonfinite and not skip), "scaler_skip": int(skip)}  # in the step line


def held_out(model, tokenizer, eval_set, cfg, ctx, run):
    """Greedy accuracy (evaluate's default) on the held-out prompts, as eval.py's, in run.fit."""
    with ctx():
        return run.fit("evaluation", lambda: evaluate(
            model, tokenizer, eval_set, max_new_tokens=cfg.max_new_tokens, engine=cfg.generation,
            batch_size=cfg.gen_batch_size or 256, stop=run.stop, halve=False))["accuracy"]


if __name__ == "__main__":
    main(Config, train, description=__doc__.split("\n")[1])
