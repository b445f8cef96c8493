"""
The math of D3S (Dynamic Dual-Level Down-Sampling, arXiv 2509.22115) as pure tensor functions.

No model, no I/O, no global state: tensors in, tensors out, so any trainer can import this file
(train.py and trl_d3s.py both do). The equations are those of docs/algorithm.md; every choice the
paper leaves open is marked [ours], here, there and in the code below.

  group_advantages   A_i = (r_i - mean_g(r)) / (std_g(r) + eps), std unbiased (torch.std), eps 1e-6;
                     scale="none" (Dr. GRPO) drops the division. A group with equal rewards has A = 0.
  num_keep           how many of n to keep for a ratio rho: round(rho * n), at least 1.
                     [ours] "round" is round half up, int(rho * n + 0.5), then clamped to [1, n]
                     (Python's round() rounds half to even: 0.25 * 10 -> 2). Used by both levels.
  max_variance_subset  argmax over k-subsets of Var(v_S). A best subset is always the i largest plus
                     the k - i smallest values for some i in 0..k: sort once, prefix sums of v and v^2,
                     score every i at once, O(n log n). [ours] among candidates of equal variance we
                     take the one with the fewest values exactly 0, then the fewest from the top; the
                     sums run in float64 on the CPU, after centring, to keep cancellation harmless.
  select_samples     step 4, sample level. Modes (docs/algorithm.md table):
                       none   keep all B.
                       cross  N = round(rho_s * B) of maximal variance of the pooled group-normalised A
                              (the D3S default); kept A are NOT re-normalised. Zero-A groups are
                              taken only when nothing else is left (proof in the code).
                       intra  n = max(2, round(rho_s * G)) per group (capped at G), max variance of A
                              inside each group (D1S, D3S-I); not re-normalised.
                       pods   n per group as intra, max variance of the raw rewards r inside each group,
                              then the kept n rewards are re-normalised (PODS). [ours] with the same
                              formula as group_advantages (unbiased std + eps, or scale="none").
                       random N = round(rho_s * B) uniformly at random (a control).
                     Indices come back sorted ascending.
  token_scores       step 6: s_{i,t} = |A_i| * H_{i,t} (adv_entropy, D3S) or H_{i,t} (entropy, 80/20).
  select_tokens      step 6: keep the top round(rho_t * valid) scores (at least 1), pooled over every
                     valid token of the step, never a masked one. [ours] equal scores are split
                     arbitrarily (torch.topk), but the count is always exact.
  keep_ratios        the schedule: p = step / (total_steps - 1),
                     rho(p) = (1 - p) * rho_init + p * rho_final (linear), rho_init (constant).
                     [ours] p = 0 when total_steps == 1. The four default ratios live in train.py.
  applied_ratios     the ratios a method applies at a step, given the schedule's: rho_s = 1 where it keeps
                     every rollout (sample "none"), rho_t = 1 where it keeps every token (token "none"),
                     the 80/20 baseline's fixed t_keep; what a trainer logs, so that a log never shows
                     a ratio the method did not use.
  policy_loss        step 7, per kept token with w_t = exp(logp_t - logp_old_t):
                       l_t = -min(w_t * A_i, clip(w_t, 1 - eps_low, 1 + eps_high) * A_i)     (GRPO)
                     GSPO: s_i = exp(mean_t(logp_t - logp_old_t)), in the GSPO-token form
                       w_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], clipped the same way.
                     [ours] s_i averages over all valid completion tokens of the rollout (`seq_mask`),
                     not only the kept ones (see policy_loss). GSPO's own small eps (3e-4 / 4e-4 in
                     the GSPO paper) is the caller's to pass.
                     Optional KL to a reference, k3: exp(ref - logp) - (ref - logp) - 1, times beta,
                     added to each kept token's loss. [ours] the sum over kept tokens is divided by
                     num_tokens, the kept tokens of the whole update, so micro-batches give the
                     same gradient as one batch. [ours] clip_frac counts the kept tokens whose
                     gradient the clip removes (ratio out of range on the side that A pushes).
  population_variance  Var(x) = mean((x - mean x)^2) of a 1-D tensor, 0 for fewer than 2 values: the
                     var(A) of the logs, over all rollouts and over the kept ones.
  METHODS            the named methods (docs/algorithm.md) -> dict(sample=..., token=..., schedule=...);
                     `entropy` (80/20) also carries its fixed token ratio t_keep=0.2.
                     [ours] grpo's schedule is "-" in the table; we store "constant" (it keeps
                     nothing away, so the ratios are never used) so the loop can always call keep_ratios.
"""

import math

import torch

SAMPLE_MODES = ("none", "cross", "intra", "pods", "random")
TOKEN_MODES = ("none", "adv_entropy", "entropy")
SCHEDULES = ("linear", "constant")
LOSSES = ("grpo", "gspo")
SCALES = ("group", "none")

# The named methods (docs/algorithm.md): the paper's ablations plus the baselines it compares to.
# Each runs on GRPO or GSPO (`loss`), chosen separately.
METHODS = {
    "grpo":      dict(sample="none",  token="none",        schedule="constant"),  # [ours] table: "-"
    "pods":      dict(sample="pods",  token="none",        schedule="constant"),
    "d1s":       dict(sample="intra", token="none",        schedule="constant"),
    "d1s-cross": dict(sample="cross", token="none",        schedule="constant"),
    "d2s":       dict(sample="cross", token="adv_entropy", schedule="constant"),
    "d3s":       dict(sample="cross", token="adv_entropy", schedule="linear"),
    "d3s-i":     dict(sample="intra", token="adv_entropy", schedule="linear"),
    "entropy":   dict(sample="none",  token="entropy",     schedule="constant", t_keep=0.2),  # 80/20
}

# -----------------------------------------------------------------------------
# checks: every bad input a caller can pass is a ValueError with a one-line message. They sit here,
# out of the way, so that each function below reads as its equation, one line of checks, then the math.


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _check_ratio(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")


def _check_shape(name, tensor, shape, other):
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, must match {other} {tuple(shape)}")


def _check_dim(name, tensor, dim, what):
    if tensor.dim() != dim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(tensor.shape)}")


def _check_groups(rewards, group_size):
    _check_dim("rewards", rewards, 1, "1-D (B,)")
    _check_int("group_size", group_size, 2)
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} elements, "
                         f"not a positive multiple of group_size={group_size}")


def _check_bool(name, tensor):
    if tensor.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got {tensor.dtype}; pass {name}.bool()")


def _check_finite(name, tensor):
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name} must be finite, got NaN or inf")


def _check_k(k, n):
    if isinstance(k, bool) or not isinstance(k, int) or not (1 <= k <= n):
        raise ValueError(f"k must be an integer in [1, {n}] (the number of values), got {k}")


def _check_rows(entropy, advantages):
    if entropy.shape[0] != advantages.shape[0]:
        raise ValueError(f"entropy has {entropy.shape[0]} rows, must match advantages ({advantages.shape[0]})")


def _check_some_valid(mask):
    if not mask.any():
        raise ValueError("mask has no valid position; there is no token to keep")


def _check_finite_at(scores, mask):
    if not torch.isfinite(scores[mask]).all():
        raise ValueError("scores must be finite at valid positions, got NaN or inf")


def _check_step(step, total_steps):
    if isinstance(step, bool) or not isinstance(step, int) or not (0 <= step < total_steps):
        raise ValueError(f"step must be an integer in [0, {total_steps - 1}], got {step}")


def _check_loss_args(logp, old_logp, advantages, token_mask, seq_mask, num_tokens, loss, eps_low, eps_high, ref_logp,
                     beta):
    """policy_loss's arguments, each a mistake a caller can make; returns num_tokens as an int."""
    _check_choice("loss", loss, LOSSES)
    _check_dim("logp", logp, 2, "2-D (N, T)")
    _check_shape("old_logp", old_logp, logp.shape, "logp")
    _check_bool("token_mask", token_mask)
    _check_shape("token_mask", token_mask, logp.shape, "logp")
    _check_shape("advantages", advantages, logp.shape[:1], "the rows of logp")
    _check_bool("seq_mask", seq_mask)
    _check_shape("seq_mask", seq_mask, logp.shape, "logp")
    if (token_mask & ~seq_mask).any():
        raise ValueError("token_mask keeps a position that seq_mask marks invalid; kept tokens must be valid")
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not (0 <= value < 1):
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    if not (beta >= 0):
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (N, T); pass it or set beta=0")
    if ref_logp is not None:
        _check_shape("ref_logp", ref_logp, logp.shape, "logp")
    kept = int(token_mask.sum())
    if isinstance(num_tokens, torch.Tensor) and num_tokens.numel() == 1 and not num_tokens.is_floating_point():
        num_tokens = int(num_tokens)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < max(1, kept):
        raise ValueError(f"num_tokens must be the step's total of kept tokens, an integer >= {max(1, kept)} "
                         f"(the tokens kept in this call), got {num_tokens}")
    return num_tokens

# -----------------------------------------------------------------------------
# step 3: advantages


def group_advantages(rewards, group_size, scale="group", eps=1e-6):
    """Step 3, GRPO's advantages on the full group: A_i = (r_i - mean_g(r)) / (std_g(r) + eps), the
    unbiased std; scale="none" (Dr. GRPO) drops the division. rewards (B,), prompt 0's G first -> (B,)."""
    _check_groups(rewards, group_size)
    _check_choice("scale", scale, SCALES)
    r = rewards.float() if not rewards.is_floating_point() else rewards
    r = r.view(-1, group_size)  # (P, G)
    a = r - r.mean(dim=1, keepdim=True)  # exactly 0 in a group of equal rewards
    if scale == "group":
        a = a / (r.std(dim=1, keepdim=True) + eps)  # unbiased std, as torch.std
    return a.view(-1)

# -----------------------------------------------------------------------------
# step 4: sample-level down-sampling


def num_keep(ratio, n):
    """How many of n to keep for a ratio in (0, 1]: round(ratio * n), half up, at least 1, at most n. [ours]"""
    _check_ratio("keep", ratio)
    _check_int("n", n, 1)
    return min(n, max(1, int(ratio * n + 0.5)))


def _max_variance_rows(values, k):
    """values (R, n), 1 <= k <= n -> (R, k) column indices of a max-variance k-subset of each row."""
    R, n = values.shape
    # The selection is over a few thousand scalars at most: float64 on the CPU costs nothing, works on
    # every backend, and with the values centred the prefix-sum differences below lose no precision.
    v = values.detach().to("cpu", torch.float64)
    is_zero = (v == 0).to(torch.float64)  # tie-breaker, on the values as given
    v = v - v.mean(dim=1, keepdim=True)  # variance does not change under a shift
    sv, order = torch.sort(v, dim=1, stable=True)  # (R, n) ascending
    sz = is_zero.gather(1, order)
    pad = torch.zeros(R, 1, dtype=torch.float64)
    P = torch.cat([pad, sv.cumsum(1)], 1)  # (R, n+1): P[:, j] = sum of the j smallest
    Q = torch.cat([pad, (sv * sv).cumsum(1)], 1)  # same for v^2
    Z = torch.cat([pad, sz.cumsum(1)], 1)  # same for the count of zeros
    # Candidate i = the k - i smallest (sorted positions < k - i) plus the i largest (>= n - i).
    i = torch.arange(k + 1)
    lo, hi = k - i, n - i
    S = P[:, lo] + P[:, n:] - P[:, hi]  # (R, k+1) sum of the candidate
    SS = Q[:, lo] + Q[:, n:] - Q[:, hi]  # (R, k+1) sum of squares
    zeros = Z[:, lo] + Z[:, n:] - Z[:, hi]  # (R, k+1) how many exact zeros it takes
    score = k * SS - S * S  # = k^2 * (population variance); same argmax, no division
    # [ours] Ties: several i may reach the same variance (up to rounding). Take the one with the
    # fewest zeros (in `cross` a zero advantage is a group with nothing to learn), then the smallest i.
    best = score.amax(dim=1, keepdim=True)
    tol = 1e-9 * (k * SS).amax(dim=1, keepdim=True)  # far above float64 rounding of the sums
    tied = score >= best - tol
    pick = torch.where(tied, zeros, math.inf).argmin(dim=1)  # argmin returns the first minimum
    pos = torch.arange(n)
    take = (pos < (k - pick)[:, None]) | (pos >= (n - pick)[:, None])  # (R, n), k true per row
    return order[take].view(R, k).sort(dim=1).values


def max_variance_subset(values, k):
    """argmax over k-subsets S of Var(values[S]): indices (k,) into values (n,), sorted ascending.
    A best S is the i largest plus the k - i smallest for some i in 0..k (_max_variance_rows)."""
    _check_dim("values", values, 1, "1-D (n,)")
    _check_k(k, values.numel())
    _check_finite("values", values)
    return _max_variance_rows(values[None], k)[0].to(values.device)


def select_samples(rewards, advantages, group_size, keep, mode, generator=None, scale="group"):
    """
    Step 4: which rollouts go on to the policy forward. For cross: the N = round(keep * B) of maximal
    Var(A) over the whole batch; intra / pods: n = max(2, round(keep * G)) per group, on A / on r.
    rewards, advantages (B,), laid out group by group; keep = rho_s. Returns (indices (N,) sorted
    ascending, advantages of the kept rollouts (N,)). Only `pods` changes the advantages (it
    re-normalises with `scale`, as group_advantages does); the others return advantages[indices] as
    given: D3S keeps the full group's normalisation.
    """
    _check_groups(rewards, group_size)
    _check_shape("advantages", advantages, rewards.shape, "rewards")
    _check_ratio("keep", keep)
    _check_choice("mode", mode, SAMPLE_MODES)
    _check_choice("scale", scale, SCALES)
    B, device = rewards.numel(), advantages.device
    if mode == "none":
        idx = torch.arange(B, device=device)
    elif mode == "cross":
        # Pooled over the batch. Zero-advantage groups (all correct or all wrong) sit in the middle
        # of the sorted order and are taken only when nothing else is left. Why: every group's A sums
        # to 0, so the pooled A does too. A best subset with a 0 in it while a nonzero is left out
        # must hold all positives (or all negatives), so its mean m >= 0 (<= 0). Swapping the 0 for a
        # left-out -a (a > 0) changes the variance by (a/k)(a(1 - 1/k) + 2m) > 0 for k >= 2: a
        # contradiction. For k = 1 every subset ties at 0 and the zeros-last tie-break decides.
        idx = max_variance_subset(advantages, num_keep(keep, B))
    elif mode == "random":
        gen_device = generator.device if generator is not None else "cpu"
        perm = torch.randperm(B, generator=generator, device=gen_device)
        idx = perm[: num_keep(keep, B)].sort().values.to(device)
    else:  # intra, pods: the same count n in every group, at least 2 so a group keeps a contrast
        n = min(group_size, max(2, num_keep(keep, group_size)))
        on = advantages if mode == "intra" else rewards  # PODS selects on the raw rewards
        _check_finite("advantages" if mode == "intra" else "rewards", on)
        cols = _max_variance_rows(on.view(-1, group_size), n)  # (P, n) positions within each group
        offsets = torch.arange(0, B, group_size)[:, None]  # (P, 1) start of each group
        idx = (cols + offsets).view(-1).to(device)  # ascending: groups in order, columns sorted
        if mode == "pods":  # PODS re-normalises the kept n rewards of each group
            return idx, group_advantages(rewards[idx], n, scale=scale).to(advantages.dtype)
    return idx, advantages[idx]

# -----------------------------------------------------------------------------
# step 6: token-level down-sampling


def token_scores(advantages, entropy, mode):
    """Step 6: s_{i,t} = |A_i| * H_{i,t} (adv_entropy, D3S) or H_{i,t} (entropy, 80/20). (N,), (N, T) -> (N, T)."""
    _check_choice("mode", mode, TOKEN_MODES[1:])  # "none" keeps every token: nothing to score
    _check_dim("advantages", advantages, 1, "1-D (N,)")
    _check_dim("entropy", entropy, 2, "2-D (N, T)")
    _check_rows(entropy, advantages)
    h = entropy.detach()  # scores only choose tokens: no gradient through H (step 5)
    if mode == "entropy":
        return h
    # A_i is constant within a sequence; pooling over the step (select_tokens) is what lets |A| matter
    return advantages.detach().abs()[:, None] * h


def select_tokens(scores, mask, keep):
    """Step 6: the top round(keep * valid) scores (at least 1), pooled over every valid position of
    the step, never a masked one. scores (N, T), mask (N, T) bool -> the kept tokens, bool (N, T)."""
    _check_dim("scores", scores, 2, "2-D (N, T)")
    _check_bool("mask", mask)
    _check_ratio("keep", keep)
    _check_shape("mask", mask, scores.shape, "scores")
    _check_some_valid(mask)
    _check_finite_at(scores, mask)
    valid = int(mask.sum())
    flat = scores.detach().flatten().masked_fill(~mask.flatten(), -math.inf)  # (N*T,)
    top = flat.topk(num_keep(keep, valid)).indices  # exact count; equal scores split arbitrarily
    kept = torch.zeros_like(mask).flatten()
    kept[top] = True
    return kept.view(mask.shape)

# -----------------------------------------------------------------------------
# the schedule: aggressive early, relaxed late


def keep_ratios(step, total_steps, schedule, s_init, s_final, t_init, t_final):
    """(rho_s, rho_t) for this step: rho(p) = (1 - p) * init + p * final with p = step / (total_steps - 1)
    (linear), or the init values throughout (constant)."""
    _check_int("total_steps", total_steps, 1)
    _check_step(step, total_steps)
    _check_choice("schedule", schedule, SCHEDULES)
    for name, value in (("s_init", s_init), ("s_final", s_final), ("t_init", t_init), ("t_final", t_final)):
        _check_ratio(name, value)
    if schedule == "constant":
        return float(s_init), float(t_init)
    p = step / (total_steps - 1) if total_steps > 1 else 0.0  # progress in [0, 1]
    return (1 - p) * s_init + p * s_final, (1 - p) * t_init + p * t_final


def applied_ratios(method, rho_s, rho_t):
    """(rho_s, rho_t) as `method` (a name of METHODS) applies them at a step whose scheduled ratios
    (keep_ratios) are rho_s, rho_t: 1 where it keeps every rollout or every token, the 80/20 baseline's
    fixed t_keep. (A constant schedule already holds the init values: keep_ratios returns them.)"""
    _check_choice("method", method, tuple(METHODS))
    _check_ratio("rho_s", rho_s)
    _check_ratio("rho_t", rho_t)
    m = METHODS[method]
    if m["sample"] == "none":
        rho_s = 1.0  # every rollout goes on
    if m["token"] == "none":
        rho_t = 1.0  # every token of a kept rollout is trained
    return float(rho_s), float(m.get("t_keep", rho_t))

# -----------------------------------------------------------------------------
# step 7: the loss


def policy_loss(logp, old_logp, advantages, token_mask, num_tokens, loss="grpo",
                eps_low=0.2, eps_high=0.2, ref_logp=None, beta=0.0, seq_mask=None):
    """
    Step 7, the clipped policy-gradient loss on the kept tokens of one update:

        w_t = exp(logp_t - logp_old_t)                                   GRPO: a ratio per token
        w_t = sg[s_i] * pi(y_t) / sg[pi(y_t)],  s_i = exp(mean over the rollout's valid tokens of
                                                (logp - logp_old))       GSPO, in the GSPO-token form
        l_t = -min(w_t * A_i, clip(w_t, 1 - eps_low, 1 + eps_high) * A_i)
              + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)      (the k3 KL, when beta > 0)
        loss = sum of l_t over the kept tokens / num_tokens

    logp (N, T) with grad; old_logp, ref_logp (N, T); advantages (N,); token_mask (N, T) bool, the kept
    tokens; seq_mask (N, T) bool, every valid completion token (default token_mask), used only by
    GSPO's s_i; num_tokens: the kept tokens of the whole update, so that several micro-batches add up
    to the gradient of one batch. For GSPO pass GSPO's own small eps (its paper: 3e-4 and 4e-4).
    Returns (loss scalar, stats): 0-dim tensors over this call's kept tokens, so that the caller decides
    when to wait for the device (train.py reads them once per update): ratio_mean, ratio_min,
    ratio_max (1 with no kept token), kl (beta > 0), and the clip's share, clip_frac = clipped / signal
    [ours]: `signal` counts the kept tokens that carry a policy gradient (A != 0; an A = 0 token has
    none to clip), `clipped` those among them whose gradient the clip removes (ratio out of range on
    the side A pushes). No kept token gives loss 0, clip_frac 0, ratios 1, kl 0.
    """
    seq_mask = token_mask if seq_mask is None else seq_mask
    num_tokens = _check_loss_args(logp, old_logp, advantages, token_mask, seq_mask, num_tokens, loss, eps_low, eps_high,
                                  ref_logp, beta)
    kept = token_mask.sum()  # a tensor: nothing here waits for the device

    # masked_fill, not multiplication: padding may hold any value and must not reach the gradient
    delta = (logp - old_logp.detach()).masked_fill(~seq_mask, 0.0)  # (N, T) log-ratio per token
    if loss == "grpo":
        # token-level ratio; only kept tokens enter the loss, and a caller may compute logp only there
        log_w = delta.masked_fill(~token_mask, 0.0)
    else:
        # [ours] GSPO's ratio is the geometric mean over the completion's tokens. We average over all
        # valid tokens (seq_mask), not only the kept ones: s_i is the likelihood ratio of the sampled
        # sequence, a property of the whole rollout; averaging over the top-entropy kept tokens would
        # pick exactly the tokens whose ratio moves most, and clip more. The forward has computed logp
        # for every token of a kept rollout anyway. Gradient still flows only through kept tokens.
        lengths = seq_mask.sum(dim=1).clamp(min=1)  # (N,)
        log_s = delta.sum(dim=1) / lengths  # (N,) log s_i
        # GSPO-token: w_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]: value s_i, gradient s_i * grad logp_t
        log_w = log_s.detach()[:, None] + delta - delta.detach()
    w = torch.exp(log_w)  # (N, T)
    a = advantages.detach()[:, None]  # (N, 1)
    unclipped = w * a
    clipped = w.clamp(1 - eps_low, 1 + eps_high) * a
    per_token = -torch.minimum(unclipped, clipped)  # (N, T)
    stats = {}
    if beta > 0:
        d = (ref_logp.detach() - logp).masked_fill(~token_mask, 0.0)  # only kept tokens enter the loss
        kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || ref), >= 0 per token
        per_token = per_token + beta * kl
        stats["kl"] = kl.detach().masked_fill(~token_mask, 0.0).sum() / kept.clamp(min=1)
    loss_value = per_token.masked_fill(~token_mask, 0.0).sum() / num_tokens
    # clipped tokens are those where the min picks the clipped term, so their gradient is zero
    with torch.no_grad():
        signal = token_mask & (a != 0)  # (N, T) the kept tokens with a policy gradient to lose
        was_clipped = (((w < 1 - eps_low) & (a < 0)) | ((w > 1 + eps_high) & (a > 0))) & signal
        stats["clipped"], stats["signal"] = was_clipped.sum(), signal.sum()
        stats["clip_frac"] = stats["clipped"] / stats["signal"].clamp(min=1)
        some, one = kept > 0, w.new_ones(())
        stats["ratio_mean"] = torch.where(some, w.masked_fill(~token_mask, 0.0).sum() / kept.clamp(min=1), one)
        stats["ratio_min"] = torch.where(some, w.masked_fill(~token_mask, math.inf).min(), one)
        stats["ratio_max"] = torch.where(some, w.masked_fill(~token_mask, -math.inf).max(), one)
    return loss_value, stats

# -----------------------------------------------------------------------------
# logs


def population_variance(x):
    """Var(x) = mean((x - mean x)^2), the population variance of a 1-D tensor (n,), as a float; 0 for
    fewer than 2 values. The logs' var(A): all rollouts' advantages, then the kept ones'."""
    _check_dim("x", x, 1, "1-D (n,)")
    return x.detach().double().var(correction=0).item() if x.numel() > 1 else 0.0
