"""
Train a language model on math with GRPO and D3S (Dynamic Dual-Level Down-Sampling, 2509.22115).

    python train.py                          # D3S on the offline tiny world: a few minutes on a CPU
    python train.py --method grpo            # the baseline, same world
    python train.py --model Qwen2.5-0.5B     # GSM8K on one GPU (each knob's `real` value)
    python train.py --resume out/d3s-tiny    # continue an interrupted run
    python train.py --help                   # every knob, its value(s) and what it does

A step is one rollout batch, in seven parts (docs/algorithm.md has every equation, [ours] choices):
1 rollout: G samples per prompt -> 2 reward (0/1) -> 3 group advantages -> 4 sample selection (the
rollouts whose advantages have maximal variance) -> 5 forward of the kept rollouts only -> 6 token
selection (top |A| * entropy, pooled over the step) -> 7 K updates on the kept tokens.
"""
import math
import time
from dataclasses import dataclass
from functools import partial

import torch

import d3s
from eval import evaluate
from machinery.config import main, pick
from machinery.data import batch_at, format_prompt, load_problems
from machinery.logs import Stopwatch, step_record
from machinery.model import autocast, disable_dropout, load_model, weight_dtype
from machinery.run import Run
from reward import score
from rollout import completion_hidden, generate_groups, head_logprobs, micro_batches

# -----------------------------------------------------------------------------
# config: every knob with its value; pick(...) holds one value per kind of run, the first that
# applies wins: a world's own (tiny_long=...), tiny= or real=, the loss's (gspo=...), the method's
# (method_entropy=...), else the first. Edit it here or pass --name value; config.json records it.


@dataclass
class Config:
    # model and data
    model: str = "tiny"             # tiny[-long|-weak|-fork] | Qwen2.5-0.5B | hub id | folder
    dataset: str = pick(tiny="tiny", tiny_long="tiny-long", real="gsm8k")  # gsm8k | math | a .jsonl
    data_dir: str = ""              # local copies as NAME/SPLIT.jsonl: gsm8k/train.jsonl ("": hub)
    # the method (docs/algorithm.md, "Named methods"), its loss and their divisor (d3s.divisors)
    method: str = "d3s"             # grpo | pods | d1s | d1s-cross | d2s | d3s | d3s-i | entropy
                                    # | the random controls d3s-random | d1s-cross-random
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
    # the update
    updates_per_batch: int = 4      # K updates per step, one per mini-batch (K > 1: the clip acts)
    minibatch_size: int = 0         # or M rollouts per update, ceil(kept / M) updates (0: K)
    optimizer: str = "adamw"        # adamw | sgd (momentum 0.9)
    lr: float = pick(tiny=5e-5, real=1e-6)  # constant (tiny: tuned in the study; real: a start)
    grad_clip: float = 1.0          # clip the gradient norm to this (0: off)
    clip_eps_low: float = pick(grpo=0.2, gspo=3e-4)   # ratio clip 1 - eps_low (gspo: GSPO's own)
    clip_eps_high: float = pick(grpo=0.2, gspo=4e-4)  # ratio clip 1 + eps_high (gspo: GSPO's own)
    beta: float = 0.0               # k3 KL to the initial model (0: no reference model is kept)
    # speed and memory: none of these changes what is computed (beyond float rounding)
    micro_batch_size: int = pick(tiny=128, real=16)  # kept rollouts per forward/backward
    gen_batch_size: int = 0         # rollouts per generate call (0: all at once)
    generation: str = "prefix"      # KV cache: prefix (a prompt's, once for its G) | plain | static
    logprob_chunk: int = 4096       # positions per lm_head chunk: never all (B, T, V) logits
    gradient_checkpointing: bool = False  # trade compute for activation memory on big models
    dtype: str = "auto"             # auto (bf16 autocast on a GPU of 8.0+) | float32 | bfloat16
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

        ctx = partial(autocast, device, cfg.dtype)  # [ours] --dtype auto: bf16 autocast on a GPU
        train_set = load_problems(cfg.dataset, "train", data_dir=cfg.data_dir or None)
        eval_set = load_problems(cfg.dataset, "test", data_dir=cfg.data_dir or None)[:cfg.eval_size]
        model, tokenizer = load_model(run.weights, device=device, dtype=weight_dtype(cfg.dtype))
        ref_model = None  # the frozen initial model, for the KL term
        if cfg.beta > 0:
            ref_model = load_model(cfg.model, device=device, dtype=weight_dtype(cfg.dtype))[0]
            ref_model.eval().requires_grad_(False)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        disable_dropout(model).train()  # [ours] no dropout: the ratio compares the policy to itself
        optimizer = make_optimizer(model, cfg)
        run.begin(model, tokenizer, optimizer, train_set, eval_set)  # config.json, the first lines

        for step in range(run.start, cfg.steps + 1):
            if run.eval_due(step):  # step 0, every eval_every steps, the end
                run.evaluated(step, held_out(model, tokenizer, eval_set, cfg, ctx, run.stop))
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
            with ctx():  # run.fit: out of memory halves the batch; a signal stops the step here
                rollouts = run.fit(generate_groups, model, tokenizer, prompts, G,
                                   cfg.max_new_tokens, cfg.temperature, seed=seed,
                                   cache=cfg.generation, batch_size=cfg.gen_batch_size or None,
                                   record_entropy=True, stop=run.stop)
            t_gen, t0 = time.time() - t0, time.time()

            # 2. reward: 1 when the final answer is right; no answer scores 0 and is counted
            answers = [r["answer"] for r in batch for _ in range(G)]
            rewards, reward_stats = score(rollouts.texts, answers, rollouts.truncated.tolist())
            rewards = torch.tensor(rewards)  # (B,)

            # 3. advantages on the full group (GRPO); a zero-variance group has A = 0
            adv = d3s.group_advantages(rewards, G)  # (B,)

            # 4. sample level: the max-variance subset, not re-normalised; the rest never go on
            idx, adv_kept = d3s.select_samples(rewards, adv, G, rho_s, method["sample"], generator)
            kept, adv_kept = rollouts.select(idx.to(device)), adv_kept.to(device)
            valid = kept.completion_mask  # (N, T)
            token_mask, scores, updates, minibatches = torch.zeros_like(valid), None, [], []
            if cfg.beta > 0 or bool((adv_kept != 0).any()):  # [ours] else the gradient is exactly 0
                # 5. one no-grad forward of the kept rollouts: entropy for step 6, logp_old if K > 1
                minibatches = [micro_batches(kept, rows.to(device), cfg.micro_batch_size)
                               for rows in minibatch_rows(len(idx), cfg, generator)]
                with fb:
                    old_logp, entropy = run.fit(entropy_and_old_logp, model, kept, minibatches,
                                                cfg, ctx, method["token"])

                # 6. token level: the top rho_t of |A| * H, pooled over every kept token of the step
                token_mask = valid
                if method["token"] != "none":  # random: no score, a uniform draw from `generator`
                    scores = d3s.token_scores(adv_kept, entropy, method["token"])  # (N, T) or None
                    token_mask = d3s.select_tokens(scores, valid, rho_t, generator)  # (N, T) bool

                # 7. K updates (or ceil(N / M)), one per mini-batch of the kept rollouts, shuffled;
                # the first runs on the policy that sampled: ratio exactly 1 (logp_old = logp)
                for i, mb in enumerate(minibatches):
                    with fb:
                        u = run.fit(backward, model, kept, mb, adv_kept, token_mask,
                                    old_logp if i else None, cfg, ctx, ref_model)
                    if u is not None:  # None: nothing to learn in this mini-batch, no update
                        # once a weight moves, a signal waits for the step's end (run.end_step)
                        u.update(optimizer_step(model, optimizer, cfg.grad_clip, u["loss"]))
                        updates.append(u)
            run.tokens_trained += sum(u["tokens"] for u in updates if u["applied"])

            # log: the step line, RUN/log.jsonl (and wandb), the selection page before an evaluation
            row = step_record(step, G, rollouts, rewards, adv, kept, adv_kept, reward_stats,
                              updates, rho_s=rho_s, rho_t=rho_t, t_gen=t_gen, t_fb=fb.seconds,
                              t_upd=time.time() - t0, tokens_trained=run.tokens_trained,
                              minibatches=len(minibatches))
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


def entropy_and_old_logp(model, kept, minibatches, cfg, ctx, token_mode):
    """Step 5: (logp_old, entropy) of the kept rollouts' tokens, (N, T) each or None, from the
    policy that sampled, with as few extra passes as possible (docs/algorithm.md):
      K > 1                   one no-grad forward gives both, on step 7's micro-batches; logp_old
                              only for mini-batches 2..K (the first takes logp_old = logp itself)
      K = 1, one micro-batch  no logp_old (the ratio is 1); the entropy from the gradient forward
                              itself, which runs now and is kept on the piece for step 7
      K = 1, several          [ours] the entropy recorded while sampling (machinery/sampling.py)
    The entropy is needed only for token selection by a score (not by the random control)."""
    select, valid, K = token_mode not in ("none", "random"), kept.completion_mask, len(minibatches)
    parts = [p for mb in (minibatches if select else minibatches[1:]) for p in mb]
    if K == 1 and (not select or len(parts) > 1):
        return None, kept.entropy if select else None
    logp, entropy = (torch.zeros(valid.shape, device=valid.device) for _ in range(2))
    for p in parts:
        with ctx(), torch.set_grad_enabled(K == 1):
            hidden = completion_hidden(model, p.input_ids, p.attention_mask, p.start)
            with torch.no_grad():
                lp, ent = head_logprobs(model, hidden, p.input_ids[:, p.start:],
                                        valid[p.rows, :p.width], cfg.temperature, select,
                                        cfg.logprob_chunk)
        logp[p.rows, :p.width] = lp
        if select:
            entropy[p.rows, :p.width] = ent
        if K == 1:
            p.hidden = hidden  # the gradient forward of step 7, already done
    return (logp if K > 1 else None), (entropy if select else None)


def backward(model, kept, parts, adv, token_mask, old_logp, cfg, ctx, ref_model=None):
    """Step 7 for one mini-batch (`parts`, its micro-batches): the loss summed over its kept tokens,
    divided by --divisor's d_i, and its gradient, accumulated micro-batch by micro-batch. old_logp
    None: the policy has not moved since it sampled (K = 1, or the step's first mini-batch), so the
    ratio is exactly 1. Returns the statistics, or None when the mini-batch has nothing to learn."""
    valid, head = kept.completion_mask, (cfg.temperature, False, cfg.logprob_chunk)
    # [ours] no kept token with A != 0 (and beta = 0): the gradient is exactly 0, so no update
    learn = token_mask if cfg.beta > 0 else token_mask & (adv != 0)[:, None]
    counts = torch.stack([torch.stack([token_mask[p.rows, :p.width].sum(),
                                       learn[p.rows, :p.width].sum()]) for p in parts])
    counts = counts.tolist()  # [[kept, learnable] per micro-batch]: one wait for the device
    if not any(n_learn for _, n_learn in counts):
        return None
    num_tokens = sum(n_keep for n_keep, _ in counts)  # this update's kept tokens
    rows, div = torch.cat([p.rows for p in parts]), torch.ones_like(valid[:, 0], dtype=torch.long)
    div[rows] = d3s.divisors(token_mask[rows], valid[rows], cfg.divisor)  # once for the update
    pieces = []  # per micro-batch, as tensors: read once, after the last one
    for p, (n_keep, _) in zip(parts, counts):
        keep, seq = token_mask[p.rows, :p.width], valid[p.rows, :p.width]  # (n, width)
        targets = p.input_ids[:, p.start:]
        if n_keep == 0:
            continue  # no kept token in this micro-batch: no loss term, no forward
        with ctx():
            hidden = p.hidden if p.hidden is not None else \
                completion_hidden(model, p.input_ids, p.attention_mask, p.start)
            p.hidden = None  # the graph is used once
            logp, _ = head_logprobs(model, hidden, targets, keep, *head)  # the kept tokens only
            old = logp.detach()  # the policy that sampled: logp_old = logp, exactly, on any device
            if old_logp is not None:
                old = old_logp[p.rows, :p.width]
                if cfg.loss == "gspo":  # s_i: the mean over every valid token; gradient: kept only
                    with torch.no_grad():
                        rest = head_logprobs(model, hidden, targets, seq & ~keep, *head)[0]
                    logp = logp + rest
            ref_logp = None
            if ref_model is not None:  # the frozen initial policy, for the k3 KL term
                with torch.no_grad():
                    ref = completion_hidden(ref_model, p.input_ids, p.attention_mask, p.start)
                    ref_logp = head_logprobs(ref_model, ref, targets, keep, *head)[0]
        loss, st = d3s.policy_loss(logp, old, adv[p.rows], keep, div[p.rows], loss=cfg.loss,
                                   eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
                                   ref_logp=ref_logp, beta=cfg.beta, seq_mask=seq)
        loss.backward()
        share = n_keep / num_tokens  # policy_loss's means are over its own kept tokens
        row = (loss.detach(), st["clipped"], st["signal"], st["ratio_mean"] * share,
               st.get("kl", loss.new_zeros(())) * share, st["ratio_min"], st["ratio_max"])
        pieces.append(torch.stack([v.double() for v in row]))
    table = torch.stack(pieces)  # (micro-batches, 7)
    loss, clipped, signal, ratio_mean, kl, ratio_min, ratio_max = torch.cat(
        [table[:, :5].sum(dim=0), table[:, 5].min()[None], table[:, 6].max()[None]]).tolist()
    return {"loss": loss, "clipped": int(clipped), "signal": int(signal),
            "clip_frac": clipped / max(signal, 1), "ratio_mean": ratio_mean, "kl": kl,
            "ratio_min": ratio_min, "ratio_max": ratio_max, "tokens": num_tokens,
            "on_policy": old_logp is None}


def make_optimizer(model, cfg):
    """AdamW (no weight decay) or SGD with momentum 0.9, fused: one kernel over all parameters."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, fused=True)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, fused=True)


def optimizer_step(model, optimizer, grad_clip, loss):
    """Clip the gradient norm and step. Not applied, and not counted as an update: a NaN/inf loss or
    gradient, or [ours] a gradient of exactly 0 (every token with a gradient was clipped), on which
    AdamW's moments would still move the weights. -> {grad_norm, applied, nonfinite, zero_grad}"""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                          grad_clip if grad_clip > 0 else math.inf).item()
    nonfinite, zero = not (math.isfinite(loss) and math.isfinite(norm)), norm == 0.0
    if nonfinite:  # the step line counts these too
        print(f"warning: a non-finite loss ({loss}) or gradient; this update is not applied")
    elif not zero:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": norm, "applied": not (nonfinite or zero), "nonfinite": int(nonfinite),
            "zero_grad": int(zero)}  # the step line counts the updates not applied, and says why


def held_out(model, tokenizer, eval_set, cfg, ctx, stop=None):
    """Greedy accuracy on the held-out prompts (eval.evaluate, the same as eval.py's)."""
    with ctx():
        out = evaluate(model, tokenizer, eval_set, n=1, temperature=0.0,
                       max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size or 256,
                       stop=stop)
    return out["accuracy"]


if __name__ == "__main__":
    main(Config, train, description=__doc__.split("\n")[1])
