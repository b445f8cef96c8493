"""
What a training run leaves besides its checkpoints: one row of RUN/log.jsonl and one line on the
terminal per step, and optionally the same rows in Weights & Biases.

The step line (README, "What you see", explains each column):

    step   12 | reward 0.41 | zero-var 0.19 | kept 45/128 | tokens 316/1129 | fwd+bwd 6270 | ...

log.jsonl has every field of step_record, one JSON object per step; machinery/plots.py draws
curves.png from it.
"""
import dataclasses
import math
import os
import time

import d3s


def step_record(step, G, rollouts, rewards, adv, kept, adv_kept, reward_stats, updates,
                forward=None, **extra):
    """The step's statistics: one row of log.jsonl (and of the step line, and of wandb). `updates`
    are the mini-batches that had something to learn; `updates` in the row counts those applied as
    optimizer steps (not those with an exactly-zero or non-finite gradient: zero_grad, nonfinite;
    nor, under float16, those float16's gradient scaler skipped: scaler_skips), and `tokens` their
    kept tokens. clip_frac is the clipped share of the step's kept tokens with a
    gradient (A != 0), counted over all its updates; the ratio and KL means are weighted by each
    update's kept tokens; grad_norm is null when no gradient was measured (no_signal: the update was
    skipped)."""
    from machinery.sampling import counters  # the decode step's compiles, CUDA graphs, caches
    valid, applied = kept.completion_mask, [u for u in updates if u["applied"]]
    forward = forward or {}  # step 7's no-grad pass (train.old_logprobs)
    real = forward.get("nograd_tokens", 0) + sum(u["fwd_bwd_tokens"] for u in updates)
    positions = forward.get("nograd_positions", 0) + sum(u["fwd_bwd_positions"] for u in updates)
    n = max(sum(u["tokens"] for u in updates), 1)
    norms = [u["grad_norm"] for u in updates if math.isfinite(u["grad_norm"])]
    # the batch's first mini-batch: ratio exactly 1
    first = next((u for u in updates if u["on_policy"]), None)

    def mean(key, empty):
        return sum(u[key] * u["tokens"] for u in updates) / n if updates else empty
    return {
        "step": step, "reward": rewards.mean().item(),
        "zero_var": (rewards.view(-1, G).std(dim=1) == 0).float().mean().item(),
        "kept": len(kept.texts), "rollouts": len(rewards),
        "tokens": sum(u["tokens"] for u in applied),  # trained: in the loss
        # the compute, in tokens (prompt and completion, no padding) forwarded: with a gradient
        # (summed over the updates; the step line's fwd+bwd), without (logp_old, the KL's reference:
        # no-grad), and the positions the lm_head ran on (head_rows); the update's padding share
        "fwd_bwd_tokens": sum(u["fwd_bwd_tokens"] for u in updates),
        "nograd_tokens": forward.get("nograd_tokens", 0) + sum(u["nograd_tokens"] for u in updates),
        "head_rows": forward.get("head_rows", 0) + sum(u["head_rows"] for u in updates),
        "upd_pad_share": 1 - real / positions if positions else None,  # None: nothing forwarded
        "valid": int(valid.sum()), "valid_all": int(rollouts.completion_mask.sum()),
        "var_adv": d3s.population_variance(adv), "var_kept": d3s.population_variance(adv_kept),
        "entropy": kept.entropy[valid].mean().item() if valid.any() else None,  # none kept
        "length": rollouts.lengths.float().mean().item(),
        "truncated": rollouts.truncated.float().mean().item(),
        # the longest row's tax: the share of decoded row-positions (rows x decode steps) that came
        # after their row had stopped (None: a Rollouts that does not say what it decoded)
        "pad_share": (1 - int(rollouts.completion_mask.sum()) / rollouts.decoded
                      if rollouts.decoded else None),
        "no_answer": reward_stats["no_answer"], "hedge": reward_stats["hedge"],  # both score 0
        "loss": sum(u["loss"] for u in updates) / len(updates) if updates else 0.0,
        "losses": [u["loss"] for u in updates], "updates": len(applied),
        "no_signal": not updates,  # the update was skipped: nothing to learn (NO_SIGNAL)
        "zero_grad": sum(u["zero_grad"] for u in updates),
        "nonfinite": sum(u["nonfinite"] for u in updates),
        "scaler_skips": sum(u["scaler_skip"] for u in updates),  # float16: an inf gradient
        "grad_norm": sum(norms) / len(norms) if norms else None,
        "clip_frac": sum(u["clipped"] for u in updates) / max(sum(u["signal"] for u in updates), 1),
        "ratio": mean("ratio_mean", 1.0), "kl": mean("kl", 0.0),
        "ratio_min": min((u["ratio_min"] for u in updates), default=1.0),
        "ratio_max": max((u["ratio_max"] for u in updates), default=1.0),
        # [1.0, 1.0] on any device
        "ratio_first": [first["ratio_min"], first["ratio_max"]] if first else None,
        "clip_first": first["clip_frac"] if first else None, **counters(), **extra,
    }


NO_SIGNAL = ("no kept token has a nonzero advantage and there is no KL term: nothing to learn, "
             "no update")


def step_line(r, K):
    """The one greppable line per step."""
    if r["no_signal"]:
        update = "upd skipped: no signal"  # NO_SIGNAL
    else:
        # the mini-batches: K, or one a rollout when fewer were kept; K = 0: --minibatch_size's
        parts = r.get("minibatches", min(K, r["kept"]))
        why = {"no signal": parts - len(r["losses"]), "zero grad": r["zero_grad"],
               "non-finite": r["nonfinite"], "scaler skip": r["scaler_skips"]}
        why = ", ".join(f"{n} {w}" for w, n in why.items() if n)
        grad = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.2f}"
        update = f"grad {grad}" + (f" | updates {r['updates']}/{parts}" + f" ({why})" * bool(why)
                                   if r["updates"] < parts or K == 0 else "")
        update += (f" | clip {r['clip_frac']:.3f} ratio {r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
                   if K != 1 else "")
    entropy = "-" if r["entropy"] is None else f"{r['entropy']:.2f}"  # None: no rollout kept
    return (f"step {r['step']:4d} | reward {r['reward']:.2f} | zero-var {r['zero_var']:.2f} | "
            f"kept {r['kept']}/{r['rollouts']} | tokens {r['tokens']}/{r['valid']} | "
            f"fwd+bwd {r['fwd_bwd_tokens']} no-grad {r.get('nograd_tokens', 0)} | "
            f"var(A) {r['var_adv']:.2f}->{r['var_kept']:.2f} | entropy {entropy} | "
            f"len {r['length']:.0f} | trunc {r['truncated']:.2f} | {update} | "
            f"gen {r['t_gen']:.1f}s upd {r['t_upd']:.1f}s")


class Stopwatch:
    """Seconds spent inside `with stopwatch:` blocks, added up (the forward and backward time)."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self.t0 = time.time()

    def __exit__(self, *exc):
        self.seconds += time.time() - self.t0


def start_wandb(cfg):
    """A Weights & Biases run (nanoGPT's wandb_log), or None. Imported only when asked for."""
    if not cfg.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise ValueError("--wandb needs the wandb package: pip install wandb "
                         "(or leave --wandb out)") from None
    return wandb.init(project=cfg.wandb, name=os.path.basename(os.path.normpath(cfg.out_dir)),
                      config=dataclasses.asdict(cfg))
