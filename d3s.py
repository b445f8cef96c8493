"""
The math of D3S (Dynamic Dual-Level Down-Sampling, arXiv 2509.22115) as pure tensor functions, which
train.py and experiments/trl_d3s.py share; docs/algorithm.md is the spec. [ours] marks a choice the
paper leaves open, here and at the code.

  group_advantages     step 3: A_i = (r_i - mean_g r) / (std_g r + eps), the unbiased std
  select_samples       step 4: max Var(A_S) over the step (cross, D3S) or per group (intra), A not
                       re-normalised; pods: per group on r, re-normalised ([ours] as step 3);
                       nonzero: every A != 0 (DAPO's filter); random, random-nonzero (controls)
  max_variance_subset  the i largest and k - i smallest, O(n log n); [ours] ties go to the fewest
                       zeros, float64 on the CPU. num_keep: round(rho n), at least 1, [ours] half up
  token_scores         step 6: s_{i,t} = |A_i| H_{i,t} (adv_entropy) or H_{i,t} (entropy, 80/20)
  select_tokens        step 6: the top round(rho_t * valid), pooled over the step; [ours] any tie;
                       random (a control): drawn uniformly, no score, d3s_token_count of them
  needed_columns       step 7: [ours] each row forwarded up to its last kept token, none with A = 0
  keep_ratios          rho(p) = (1 - p) rho_init + p rho_final, p = step / (total_steps - 1), [ours]
                       0 in a one-step run; applied_ratios: the ratios a method really applies
  policy_loss          step 7: sum_i sum_t l_it / d_i, l = -min(w A, clip(w) A) + beta k3; [ours]
                       GSPO's s_i over all valid tokens, clip_frac; divisors: d_i (DIVISORS)
  population_variance  Var(x) = mean((x - mean x)^2); METHODS: [ours] grpo's "-" is "constant"
"""

import math

import torch

SAMPLE_MODES = {  # what sample selection keeps (step 4), in words: also the selection page's
    "none": "every rollout (no sample selection)",
    "cross": "the share rho_s of the step's rollouts whose advantages have maximal variance, "
             "pooled over the step, not re-normalised: zero-variance groups (all right or all "
             "wrong, so A = 0) are the first dropped",
    "intra": "inside each group, the rollouts whose advantages have maximal variance",
    "pods": "inside each group, the rollouts whose rewards have maximal variance, advantages "
            "re-normalised (PODS)",
    "nonzero": "every rollout whose advantage is not 0 (GRPO with DAPO's filter)",
    "random": "the share rho_s of the step's rollouts, at random (a control)",
    "random-nonzero": "the share rho_s of the step's rollouts, at random among those with A != 0 "
                      "while there are enough (a control)"}
TOKEN_MODES = {  # what token selection keeps (step 6) of the kept rollouts' tokens, in words
    "none": "every token of a kept rollout (no token selection)",
    "adv_entropy": "the share rho_t with the highest |A| * H, pooled over the step",
    "entropy": "the share rho_t with the highest entropy H (the 80/20 rule), pooled over the step",
    "random": "as many as D3S trains at this step, at random (a control)"}
SCHEDULES = ("linear", "constant")
LOSSES = ("grpo", "gspo")
SCALES = ("group", "none")
DIVISORS = ("kept", "valid", "seq")  # divisors(): [ours]; 80/20, DAPO, TRL; GRPO's, GSPO's papers
METHODS = {  # docs/algorithm.md's named methods, each on GRPO or GSPO (`loss`); entropy: 80/20
    "grpo":        dict(sample="none",    token="none",        schedule="constant"),  # [ours] "-"
    "grpo-filter": dict(sample="nonzero", token="none",        schedule="constant"),  # no A = 0
    "pods":        dict(sample="pods",    token="none",        schedule="constant"),
    "d1s":         dict(sample="intra",   token="none",        schedule="constant"),
    "d1s-cross":   dict(sample="cross",   token="none",        schedule="constant"),
    "d2s":         dict(sample="cross",   token="adv_entropy", schedule="constant"),
    "d3s":         dict(sample="cross",   token="adv_entropy", schedule="linear"),
    "d3s-i":       dict(sample="intra",   token="adv_entropy", schedule="linear"),
    "entropy":     dict(sample="none",    token="entropy",     schedule="constant", t_keep=0.2),
    "d3s-entropy": dict(sample="cross",   token="entropy",     schedule="linear"),  # H, not |A| H
    # [ours] controls: D3S's counts drawn at random, from all rollouts or from those with A != 0
    "d3s-random":         dict(sample="random",         token="random", schedule="linear"),
    "d3s-random-nonzero": dict(sample="random-nonzero", token="random", schedule="linear"),
    "d1s-cross-random":   dict(sample="random",         token="none",   schedule="constant"),
}


def group_advantages(rewards, group_size, scale="group", eps=1e-6):
    """Step 3: A_i = (r_i - mean_g(r)) / (std_g(r) + eps) on the full group, std unbiased as in
    torch.std; scale="none" (Dr. GRPO) drops the division. rewards (B,), group by group -> (B,)."""
    _check_groups(rewards, group_size, scale)
    r = (rewards if rewards.is_floating_point() else rewards.float()).view(-1, group_size)  # (P, G)
    a = r - r.mean(dim=1, keepdim=True)  # exactly 0 in a group of equal rewards
    return (a / (r.std(dim=1, keepdim=True) + eps) if scale == "group" else a).view(-1)


def num_keep(ratio, n):
    """round(ratio * n), at least 1, at most n: how many to keep, at both levels. [ours] Half up,
    int(ratio * n + 0.5), where Python's round() rounds half to even (0.25 * 10 -> 2)."""
    _check_count_args(ratio, n)
    return min(n, max(1, int(ratio * n + 0.5)))


def _max_variance_rows(values, k):
    """values (R, n), 1 <= k <= n -> (R, k) the columns of a max-variance k-subset of each row."""
    R, n = values.shape
    v = values.detach().to("cpu", torch.float64)  # [ours] float64 on the CPU, centred: exact sums
    sv, order = torch.sort(v - v.mean(dim=1, keepdim=True), dim=1, stable=True)  # (R, n) ascending
    sz = (v == 0).to(torch.float64).gather(1, order)  # the tie-break looks at the values as given
    sums = torch.stack([sv, sv * sv, sz], dim=2).cumsum(1)  # (R, n, 3): of v, v^2 and zeros
    C = torch.cat([torch.zeros(R, 1, 3, dtype=torch.float64), sums], 1)  # C[:, j]: the j smallest
    i = torch.arange(k + 1)  # candidate i: the sorted positions < k - i and >= n - i
    S, SS, zeros = (C[:, k - i] + C[:, n:] - C[:, n - i]).unbind(2)  # (R, k+1) each
    score = k * SS - S * S  # = k^2 * (population variance); same argmax, no division
    # [ours] ties (to rounding): the fewest zeros (zero-variance groups in `cross`), then least i;
    # equal values in batch order (the stable sort), not by group: docs/algorithm.md's example
    tol = 1e-9 * (k * SS).amax(dim=1, keepdim=True)  # far above float64 rounding of the sums
    tied = score >= score.amax(dim=1, keepdim=True) - tol
    pick = torch.where(tied, zeros, math.inf).argmin(dim=1)  # (R,) argmin: the first minimum
    pos = torch.arange(n)
    take = (pos < (k - pick)[:, None]) | (pos >= (n - pick)[:, None])  # (R, n), k true per row
    return order[take].view(R, k).sort(dim=1).values


def max_variance_subset(values, k):
    """argmax over k-subsets S of Var(values[S]), exactly in O(n log n): a best S is the i largest
    and the k - i smallest for some i (moving a middle value outwards never lowers the variance), so
    sort once and score each i from prefix sums. values (n,) -> indices (k,), ascending."""
    _check_subset_args(values, k)
    return _max_variance_rows(values[None], k)[0].to(values.device)


def select_samples(rewards, advantages, group_size, keep, mode, generator=None, scale="group"):
    """Step 4, the rollouts of maximal variance: of A over the step, N = round(keep * B) (cross,
    D3S), or per group, n = max(2, round(keep * G)), of A (intra) or r (pods). rewards, advantages
    (B,), group by group -> (indices (N,) ascending, their A, re-normalised by pods alone)."""
    _check_samples_args(rewards, advantages, group_size, keep, mode, scale)
    B, device = rewards.numel(), advantages.device
    if mode == "none":
        idx = torch.arange(B, device=device)
    elif mode == "cross":  # [ours] Var around the kept subset's own mean, not top-|A| (sum A^2)
        # Zero-variance groups (A = 0) sit mid-order, taken only when nothing else is left: each
        # group's A sums to 0, so the pooled A does. A best k-subset with a 0 while a nonzero is
        # left out holds all positives (or negatives), so its mean m >= 0 (<= 0); swapping the 0
        # for a left-out -a (a > 0) adds (a/k)(a(1 - 1/k) + 2m) > 0 to the variance for k >= 2, a
        # contradiction. For k = 1 all subsets tie at 0 and the tie-break takes a nonzero.
        idx = max_variance_subset(advantages, num_keep(keep, B))
    elif mode == "nonzero":  # DAPO's filter, without its oversampling: may keep none
        idx = (advantages != 0).nonzero().view(-1)
    elif mode in ("random", "random-nonzero"):  # D3S's N drawn uniformly (A != 0 first)
        perm = torch.randperm(B, generator=generator, device=getattr(generator, "device", "cpu"))
        if mode == "random-nonzero":  # a stable sort keeps each side's random order
            perm = perm[torch.argsort((advantages.to(perm.device)[perm] == 0).long(), stable=True)]
        idx = perm[: num_keep(keep, B)].sort().values.to(device)
    else:  # intra, pods: the same n in every group, [ours] at least 2 so a group keeps a contrast
        n = min(group_size, max(2, num_keep(keep, group_size)))
        on = advantages if mode == "intra" else rewards  # PODS selects on the raw rewards
        cols = _max_variance_rows(on.view(-1, group_size), n)  # (P, n) positions in each group
        idx = (cols + torch.arange(0, B, group_size)[:, None]).view(-1).to(device)  # ascending
        if mode == "pods":  # [ours] re-normalised with step 3's formula and `scale`
            return idx, group_advantages(rewards[idx], n, scale=scale).to(advantages.dtype)
    return idx, advantages[idx]


def token_scores(advantages, entropy, mode):
    """Step 6: s_{i,t} = |A_i| * H_{i,t} (adv_entropy, D3S) or H_{i,t} (entropy, 80/20), no gradient
    through H (|A_i| counts: the step is pooled). (N,), (N, T) -> (N, T); random: None, no score."""
    if mode == "random":
        return None
    _check_scores_args(advantages, entropy, mode)
    h = entropy.detach()
    return h if mode == "entropy" else advantages.detach().abs()[:, None] * h


def select_tokens(scores, mask, keep, generator=None, count=None):
    """Step 6: the top round(keep * valid) scores (at least 1), pooled over every valid position of
    the step ([ours] of kept rollouts with A = 0 too), never a masked one; scores None (random):
    every set as likely, drawn from `generator`. count: keep min(count, valid) instead. scores
    (N, T), mask (N, T) bool -> kept (N, T) bool."""
    _check_tokens_args(scores, mask, keep, count)
    if scores is None:  # i.i.d. uniform scores: every k-set of valid positions is as likely
        scores = torch.rand(mask.shape, generator=generator, dtype=torch.float64,
                            device=getattr(generator, "device", "cpu")).to(mask.device)
    flat = scores.detach().flatten().masked_fill(~mask.flatten(), -math.inf)  # (N*T,)
    k = num_keep(keep, int(mask.sum())) if count is None else min(count, int(mask.sum()))
    top = flat.topk(k).indices  # [ours] exact count, ties any way
    return torch.zeros_like(mask).flatten().index_fill(0, top, True).view(mask.shape)


def d3s_token_count(rewards, advantages, lengths, group_size, rho_s, rho_t):
    """[ours] D3S's count of tokens at this step, round(rho_t * valid tokens of its rollouts): what
    the random controls draw, not rho_t of their own rollouts'. lengths (B,): valid tokens each."""
    idx, _ = select_samples(rewards, advantages, group_size, rho_s, "cross")
    return num_keep(rho_t, max(1, int(lengths[idx.to(lengths.device)].sum())))


def needed_columns(token_mask, advantages, beta=0.0, seq_mask=None):
    """[ours] How many completion columns of each row step 7's loss reads: up to its last kept token
    (causal attention: no later token changes a kept token's log-prob), or with seq_mask its last
    valid one (GSPO's s_i off-policy); 0, not forwarded, where every term is exactly 0 (no kept
    token, or A = 0 with beta = 0). token_mask (N, T) bool, advantages (N,) -> (N,) long."""
    reads = token_mask if seq_mask is None else seq_mask
    last = (reads * torch.arange(1, reads.shape[1] + 1, device=reads.device)).amax(dim=1)
    return last * (token_mask.any(dim=1) & ((advantages != 0) | (beta > 0)))


def keep_ratios(step, total_steps, schedule, s_init, s_final, t_init, t_final):
    """The schedule: (rho_s, rho_t) at this step, each rho = (1 - p) * init + p * final with p =
    step / (total_steps - 1) ([ours] linear: the paper says only "aggressive, then relaxed"; p = 0
    in a one-step run) or init (constant)."""
    _check_schedule_args(step, total_steps, schedule, s_init, s_final, t_init, t_final)
    if schedule == "constant":
        return float(s_init), float(t_init)
    p = step / (total_steps - 1) if total_steps > 1 else 0.0  # progress in [0, 1]
    return (1 - p) * s_init + p * s_final, (1 - p) * t_init + p * t_final


def applied_ratios(method, rho_s, rho_t):
    """(rho_s, rho_t) as `method` applies the scheduled ones: 1 where it keeps every rollout or
    token, the 80/20 baseline's fixed t_keep. What a trainer logs: never a ratio left unused."""
    _check_applied_args(method, rho_s, rho_t)
    m = METHODS[method]
    rho_s = 1.0 if m["sample"] in ("none", "nonzero") else rho_s  # all (with A != 0) go on
    rho_t = 1.0 if m["token"] == "none" else rho_t  # every token of a kept rollout is trained
    return float(rho_s), float(m.get("t_keep", rho_t))


def divisors(token_mask, seq_mask, divisor):
    """Step 7's d_i in loss = sum_i sum_t l_it / d_i, once per update from its masks (N, T) -> (N,):
      kept   its kept tokens [ours];   valid  its valid tokens, masked ones too (80/20, DAPO, TRL)
      seq    n_i S: the mean over each rollout's n_i kept tokens, then over the S rollouts that
             have one (GRPO's and GSPO's papers; verl's seq-mean-token-mean)"""
    _check_choice("divisor", divisor, DIVISORS)
    _check_shape("token_mask", token_mask, seq_mask.shape, "seq_mask", is_bool=True)
    n = token_mask.sum(dim=1)  # (N,) kept tokens per rollout
    d = {"kept": n.sum(), "valid": seq_mask.sum(), "seq": n * (n > 0).sum()}[divisor]
    return d.expand(len(n)).clamp(min=1)  # [ours] 1 where nothing is kept: its sum is 0 anyway


def policy_loss(logp, old_logp, advantages, token_mask, divisor, loss="grpo",
                eps_low=0.2, eps_high=0.2, ref_logp=None, beta=0.0, seq_mask=None):
    """Step 7: loss = sum over the kept tokens of l_{i,t} / d_i, where

        l_t = -min(w_t A_i, clip(w_t, 1 - eps_low, 1 + eps_high) A_i) + beta k3_t
        w_t = exp(logp_t - old_t)  (GRPO)  or  sg[s_i] pi(y_t) / sg[pi(y_t)]  (GSPO-token)

    s_i = exp(mean of logp - old over the valid tokens, seq_mask, by default token_mask); k3 is the
    KL estimate exp(ref - logp) - (ref - logp) - 1. Tensors (N, T), advantages (N,), masks bool.
    d_i: divisors()'s (N,) or one count, over the whole update: micro-batches add up to one batch.
    GSPO's paper: eps 3e-4, 4e-4 and seq. stats, 0-dim: ratio_mean/min/max (1 if none is kept), kl,
    and [ours] clip_frac = clipped / signal: the counts of kept tokens with A != 0 (signal) and of
    those whose ratio is out of range on the side A pushes (clipped)."""
    seq_mask = token_mask if seq_mask is None else seq_mask
    divisor = _check_loss_args(logp, old_logp, advantages, token_mask, seq_mask, divisor, loss,
                               eps_low, eps_high, ref_logp, beta)
    kept, stats = token_mask.sum(), {}  # kept: a tensor, so nothing here waits for the device
    # masked_fill, not multiplication: padding may hold any value and must not reach the gradient
    delta = (logp - old_logp.detach()).masked_fill(~seq_mask, 0.0)  # (N, T) log-ratio per token
    if loss == "grpo":  # only kept tokens enter: a caller may compute logp only there
        log_w = delta.masked_fill(~token_mask, 0.0)
    else:  # [ours] s_i, the sampled sequence's likelihood ratio, over every valid token: over the
        # top-entropy kept ones it would pick exactly the tokens whose ratio moves most
        log_s = delta.sum(dim=1) / seq_mask.sum(dim=1).clamp(min=1)  # (N,) log s_i
        log_w = log_s.detach()[:, None] + delta - delta.detach()  # value s_i, grad s_i grad logp_t
    w, a = torch.exp(log_w), advantages.detach()[:, None]  # (N, T), (N, 1)
    per_token = -torch.minimum(w * a, w.clamp(1 - eps_low, 1 + eps_high) * a)  # (N, T)
    if beta > 0:
        d = (ref_logp.detach() - logp).masked_fill(~token_mask, 0.0)  # only kept tokens enter
        kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || ref), >= 0 per token
        per_token = per_token + beta * kl
        stats["kl"] = kl.detach().masked_fill(~token_mask, 0.0).sum() / kept.clamp(min=1)
    loss_value = (per_token.masked_fill(~token_mask, 0.0).sum(dim=1) / divisor).sum()
    with torch.no_grad():  # where the min picks the clipped term, the gradient is zero
        signal = token_mask & (a != 0)  # (N, T) the kept tokens with a policy gradient to lose
        was_clipped = (((w < 1 - eps_low) & (a < 0)) | ((w > 1 + eps_high) & (a > 0))) & signal
        stats["clipped"], stats["signal"] = was_clipped.sum(), signal.sum()
        stats["clip_frac"] = stats["clipped"] / stats["signal"].clamp(min=1)
        some, one = kept > 0, w.new_ones(())
        mean = w.masked_fill(~token_mask, 0.0).sum() / kept.clamp(min=1)
        stats["ratio_mean"] = torch.where(some, mean, one)
        stats["ratio_min"] = torch.where(some, w.masked_fill(~token_mask, math.inf).min(), one)
        stats["ratio_max"] = torch.where(some, w.masked_fill(~token_mask, -math.inf).max(), one)
    return loss_value, stats


def population_variance(x):
    """Var(x) = mean((x - mean x)^2) of x (n,), a float (0 below 2 values): the logs' var(A)."""
    _check_dim("x", x, 1, "1-D (n,)")
    return x.detach().double().var(correction=0).item() if x.numel() > 1 else 0.0

# -----------------------------------------------------------------------------
# input checks: each bad input a caller can pass is a ValueError with a one-line message

def _require(ok, message):
    if not ok:
        raise ValueError(message)

def _check_choice(name, value, allowed):
    _require(value in allowed, f"{name} must be one of {', '.join(allowed)}; got {value!r}")

def _check_ratios(**ratios):
    for name, x in ratios.items():
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1
        _require(ok, f"{name} must be in (0, 1], got {x}")

def _check_int(name, x, low, high=math.inf, what=None):
    ok = isinstance(x, int) and not isinstance(x, bool) and low <= x <= high
    _require(ok, f"{name} must be {what or f'an integer >= {low}'}, got {x}")

def _check_dim(name, x, dim, what):
    _require(x.dim() == dim, f"{name} must be {what}, got shape {tuple(x.shape)}")

def _check_shape(name, x, shape, other, is_bool=False):
    _require(not is_bool or x.dtype == torch.bool,
             f"{name} must be a bool tensor, got {x.dtype}; pass {name}.bool()")
    _require(tuple(x.shape) == tuple(shape),
             f"{name} has shape {tuple(x.shape)}, must match {other} {tuple(shape)}")

def _check_groups(rewards, group_size, scale):
    _check_dim("rewards", rewards, 1, "1-D (B,)")
    _check_int("group_size", group_size, 2)
    _require(rewards.numel() > 0 and rewards.numel() % group_size == 0, f"rewards has "
             f"{rewards.numel()} elements, not a positive multiple of group_size={group_size}")
    _check_choice("scale", scale, SCALES)

def _check_count_args(ratio, n):
    _check_ratios(keep=ratio)
    _check_int("n", n, 1)

def _check_subset_args(values, k):
    _check_dim("values", values, 1, "1-D (n,)")
    _check_int("k", k, 1, len(values), f"an integer in [1, {len(values)}] (the number of values)")
    _require(torch.isfinite(values).all(), "values must be finite, got NaN or inf")

def _check_samples_args(rewards, advantages, group_size, keep, mode, scale):
    _check_groups(rewards, group_size, scale)
    _check_shape("advantages", advantages, rewards.shape, "rewards")
    _check_ratios(keep=keep)
    _check_choice("mode", mode, SAMPLE_MODES)
    name, on = ("advantages", advantages) if mode == "intra" else ("rewards", rewards)
    _require(mode not in ("intra", "pods") or torch.isfinite(on).all(),  # cross: in the subset
             f"{name} must be finite, got NaN or inf")

def _check_scores_args(advantages, entropy, mode):
    _check_choice("mode", mode, list(TOKEN_MODES)[1:])  # "none" keeps every token: nothing to score
    _check_dim("advantages", advantages, 1, "1-D (N,)")
    _check_dim("entropy", entropy, 2, "2-D (N, T)")
    _require(len(entropy) == len(advantages),
             f"entropy has {len(entropy)} rows, must match advantages ({len(advantages)})")

def _check_tokens_args(scores, mask, keep, count):  # keep: num_keep checks it
    if count is not None:
        _check_int("count", count, 1)
    scores = mask if scores is None else scores  # random: no score, only the mask to check
    _check_dim("mask" if scores is mask else "scores", scores, 2, "2-D (N, T)")
    _check_shape("mask", mask, scores.shape, "scores", is_bool=True)
    _require(mask.any(), "mask has no valid position; there is no token to keep")
    _require(torch.isfinite(scores[mask]).all(),
             "scores must be finite at valid positions, got NaN or inf")

def _check_schedule_args(step, total_steps, schedule, s_init, s_final, t_init, t_final):
    _check_int("total_steps", total_steps, 1)
    _check_int("step", step, 0, total_steps - 1, f"an integer in [0, {total_steps - 1}]")
    _check_choice("schedule", schedule, SCHEDULES)
    _check_ratios(s_init=s_init, s_final=s_final, t_init=t_init, t_final=t_final)

def _check_applied_args(method, rho_s, rho_t):
    _check_choice("method", method, tuple(METHODS))
    _check_ratios(rho_s=rho_s, rho_t=rho_t)

def _check_loss_args(logp, old_logp, advantages, token_mask, seq_mask, divisor, loss, eps_low,
                     eps_high, ref_logp, beta):
    _check_choice("loss", loss, LOSSES)
    _check_dim("logp", logp, 2, "2-D (N, T)")
    _check_shape("old_logp", old_logp, logp.shape, "logp")
    _check_shape("token_mask", token_mask, logp.shape, "logp", is_bool=True)
    _check_shape("advantages", advantages, logp.shape[:1], "the rows of logp")
    _check_shape("seq_mask", seq_mask, logp.shape, "logp", is_bool=True)
    _require(not (token_mask & ~seq_mask).any(),
             "token_mask keeps a position that seq_mask marks invalid; kept tokens must be valid")
    _require(0 <= eps_low < 1, f"eps_low must be in [0, 1), got {eps_low}")
    _require(0 <= eps_high < 1, f"eps_high must be in [0, 1), got {eps_high}")
    _require(beta >= 0, f"beta must be >= 0, got {beta}")
    _require(not (beta > 0 and ref_logp is None),
             f"beta={beta} > 0 needs ref_logp (N, T); pass it or set beta=0")
    if ref_logp is not None:
        _check_shape("ref_logp", ref_logp, logp.shape, "logp")
    d = torch.as_tensor(divisor if isinstance(divisor, (int, torch.Tensor)) else -1).cpu()
    low = token_mask.sum(dim=1 if d.dim() else None).cpu().clamp(min=1)  # kept here (per row)
    _require(not d.is_floating_point() and d.shape in ((), low.shape) and bool((d >= low).all()),
             f"divisor must be an integer >= {int(low.max())} (d3s.divisors), got {divisor}")
    return d.to(logp.device)
