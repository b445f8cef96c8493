"""Tests for d3s.py: brute force over all subsets, hand-computed tensors, gradient identities."""
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import d3s

ROOT = Path(__file__).resolve().parent.parent


def brute_max_variance(V, k):
    """V (R, n) float64 -> (R,) the largest population variance over all k-subsets of each row."""
    combos = torch.tensor(list(itertools.combinations(range(V.shape[1]), k)))  # (C, k)
    return V[:, combos].var(dim=-1, unbiased=False).amax(dim=-1)


def pop_var(x):
    return x.double().var(unbiased=False).item()

# -----------------------------------------------------------------------------
# counting and advantages


def test_num_keep_rounds_half_up_and_clamps():
    assert d3s.num_keep(0.25, 10) == 3  # 2.5 -> 3 (Python's round would give 2)
    assert d3s.num_keep(0.35, 10) == 4  # 3.5 -> 4 (round-half-even would also give 4)
    assert d3s.num_keep(0.24, 10) == 2
    assert d3s.num_keep(0.01, 10) == 1  # at least one
    assert d3s.num_keep(1.0, 10) == 10
    assert d3s.num_keep(0.5, 1) == 1


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group 1: all equal -> 0
    a = d3s.group_advantages(r, 4)
    s = 0.5 + 1e-6
    torch.testing.assert_close(a, torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s,
                                                0, 0, 0, 0]))
    assert (a[4:] == 0).all()  # exactly zero, which the zeros-last tie-break relies on
    torch.testing.assert_close(d3s.group_advantages(r, 4, scale="none"),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    # integer rewards are accepted; two groups of two
    torch.testing.assert_close(d3s.group_advantages(torch.tensor([1, 0, 0, 0]), 2),
                               torch.tensor([0.5, -0.5, 0, 0]) / (math.sqrt(0.5) + 1e-6))

# -----------------------------------------------------------------------------
# max-variance subset


def random_vectors(gen):
    """A few hundred vectors with n <= 12: continuous, many ties, binary, constant, with zeros."""
    out = []
    for n in range(1, 13):
        for _ in range(6):
            out.append(torch.randn(n, generator=gen, dtype=torch.float64))
            out.append(torch.randint(-2, 3, (n,), generator=gen).double())  # many ties and zeros
            out.append(torch.randint(0, 2, (n,), generator=gen).double())  # binary rewards
            out.append(torch.randint(0, 2, (n,), generator=gen).double() * 3 + 100)  # offset, ties
        out.append(torch.full((n,), 0.7, dtype=torch.float64))  # constant
        out.append(torch.zeros(n, dtype=torch.float64))
    return out


def test_max_variance_subset_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    vectors = random_vectors(gen)
    assert len(vectors) >= 300
    for n in range(1, 13):
        V = torch.stack([v for v in vectors if v.numel() == n])  # (R, n)
        for k in range(1, n + 1):
            best = brute_max_variance(V, k)
            for v, b in zip(V, best):
                idx = d3s.max_variance_subset(v, k)
                assert idx.dtype == torch.long and idx.shape == (k,)
                assert (idx[1:] > idx[:-1]).all()  # sorted ascending, distinct
                assert abs(pop_var(v[idx]) - b.item()) <= 1e-9 * (1 + b.item()), (v, k, idx)


def test_max_variance_subset_float32_and_large_offset():
    # cancellation: values around 1e4 with spread 1; float64 centred sums still find the optimum
    v = torch.tensor([10000.0, 10001.0, 10000.5, 10003.0, 9999.0, 10002.0], dtype=torch.float32)
    idx = d3s.max_variance_subset(v, 2)
    assert idx.tolist() == [3, 4]  # the largest and the smallest
    assert d3s.max_variance_subset(v, 6).tolist() == list(range(6))  # k = n takes all


def test_max_variance_ties_prefer_fewest_zeros():
    # sorted [-1, 0, 2, 3], k=3: {-1, 0, 3} and {-1, 2, 3} both have variance 26/9; a plain argmax
    # over the candidates takes the first, with the 0. We keep the zeros last.
    v = torch.tensor([-1.0, 0.0, 2.0, 3.0])
    assert pop_var(v[[0, 1, 3]]) == pytest.approx(pop_var(v[[0, 2, 3]]))
    assert d3s.max_variance_subset(v, 3).tolist() == [0, 2, 3]
    # k = 1: every singleton has variance 0; take a nonzero
    assert d3s.max_variance_subset(torch.tensor([0.0, 0.0, 5.0]), 1).tolist() == [2]
    assert d3s.max_variance_subset(torch.tensor([0.0, -4.0, 0.0]), 1).tolist() == [1]

# -----------------------------------------------------------------------------
# sample selection


def binary_batch(gen, P, G):
    """Rewards (P*G,) with all-correct, all-wrong and mixed groups in random order."""
    rows = []
    for _ in range(P):
        kind = torch.randint(0, 3, (1,), generator=gen).item()
        if kind == 0:
            rows.append(torch.ones(G))
        elif kind == 1:
            rows.append(torch.zeros(G))
        else:
            row = torch.zeros(G)
            c = torch.randint(1, G, (1,), generator=gen).item()
            row[torch.randperm(G, generator=gen)[:c]] = 1
            rows.append(row)
    return torch.cat(rows)


def test_cross_zero_groups_last_brute_force():
    """Every max-variance k-subset (k >= 2) of pooled group-normalised binary advantages holds zeros
    only when the nonzeros are used up; `cross` reaches that optimum with the same zero count."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(P, 2) for P in range(2, 7)] + [(P, 3) for P in range(2, 5)]
    shapes += [(2, 4), (3, 4), (2, 6)]
    checked = 0
    for P, G in shapes * 4:
        r = binary_batch(gen, P, G)
        a = d3s.group_advantages(r, G)
        B, nonzero = r.numel(), int((a != 0).sum())
        A = a.double()[None]
        for k in range(1, B + 1):
            idx, kept = d3s.select_samples(r, a, G, k / B, "cross")
            assert idx.numel() == k
            assert torch.equal(kept, a[idx])  # not re-normalised
            assert int((kept == 0).sum()) == max(0, k - nonzero)
            combos = torch.tensor(list(itertools.combinations(range(B), k)))
            var = A[:, combos].var(dim=-1, unbiased=False)[0]  # (C,)
            assert pop_var(kept) == pytest.approx(var.max().item(), abs=1e-9)
            if k >= 2:
                optimal = combos[var >= var.max() - 1e-9]
                zeros = (a[optimal] == 0).sum(dim=1)
                assert (zeros == max(0, k - nonzero)).all()
            checked += 1
    assert checked > 100


def test_cross_large_batch_counts_and_zeros():
    gen = torch.Generator().manual_seed(2)
    r = binary_batch(gen, 16, 8)
    a = d3s.group_advantages(r, 8)
    nonzero = int((a != 0).sum())
    for keep in (0.1, 0.25, 0.5, 0.75, 1.0):
        idx, kept = d3s.select_samples(r, a, 8, keep, "cross")
        assert idx.numel() == int(keep * 128 + 0.5)
        assert (idx[1:] > idx[:-1]).all()
        assert torch.equal(kept, a[idx])
        assert int((kept == 0).sum()) == max(0, idx.numel() - nonzero)


def test_none_keeps_everything():
    r = torch.tensor([1.0, 0, 1, 1])
    a = d3s.group_advantages(r, 2)
    idx, kept = d3s.select_samples(r, a, 2, 0.3, "none")
    assert idx.tolist() == [0, 1, 2, 3] and torch.equal(kept, a)


def test_intra_same_count_per_group_and_max_variance():
    gen = torch.Generator().manual_seed(3)
    G = 6
    r = torch.rand(5 * G, generator=gen).round()
    r[:G] = 1  # one all-correct group
    a = d3s.group_advantages(r, G) + 0.01 * torch.randn(5 * G, generator=gen)  # break ties a bit
    for keep, n in ((0.1, 2), (0.5, 3), (0.6, 4), (1.0, 6)):  # n = max(2, round(keep * G))
        idx, kept = d3s.select_samples(r, a, G, keep, "intra")
        assert torch.equal(kept, a[idx])
        assert (idx[1:] > idx[:-1]).all()
        groups = idx // G
        assert torch.bincount(groups, minlength=5).tolist() == [n] * 5
        best = brute_max_variance(a.double().view(5, G), n)
        for g in range(5):
            assert pop_var(a[idx[groups == g]]) == pytest.approx(best[g].item(), abs=1e-9)


def test_pods_renormalises_kept_rewards():
    r = torch.tensor([1.0, 1, 1, 0, 0, 0, 0, 0,   0, 0, 0, 0, 0, 0, 0, 0])
    a = d3s.group_advantages(r, 8)
    idx, kept = d3s.select_samples(r, a, 8, 0.5, "pods")  # n = 4 per group
    # group 0: max variance of 4 binary rewards is 2 ones + 2 zeros; the stable sort takes the
    # first zeros and the last ones: rewards [1, 1, 0, 0] at indices 1, 2 (ones) and 3, 4 (zeros)
    assert idx.tolist() == [1, 2, 3, 4, 8, 9, 10, 11]
    # re-normalised on the kept 4: mean 0.5, unbiased std sqrt(4/3 * 0.25) = 0.57735
    s = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(kept, torch.tensor([0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0]) / s)
    assert not torch.allclose(kept[:4], a[idx[:4]])  # D3S's A would be different: this is PODS
    torch.testing.assert_close(kept[:4].std(), torch.tensor(1.0), atol=1e-5, rtol=0)
    # scale="none" only re-centres
    _, kept0 = d3s.select_samples(r, a, 8, 0.5, "pods", scale="none")
    torch.testing.assert_close(kept0, torch.tensor([0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0]))


def test_random_reproducible_with_generator():
    r = torch.zeros(40)
    a = torch.zeros(40)
    runs = [d3s.select_samples(r, a, 4, 0.25, "random", torch.Generator().manual_seed(s))[0]
            for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    for idx in runs:
        assert idx.numel() == 10 and (idx[1:] > idx[:-1]).all() and idx.max() < 40


def chi_square(counts, expected):
    return ((counts - expected) ** 2 / expected).sum().item()


def test_random_rollouts_match_cross_counts_and_are_uniform():
    """The d3s-random control: as many rollouts as cross keeps at the same ratio, and over many
    draws every rollout as likely (a chi-square a biased draw, e.g. the first rollouts, fails)."""
    gen = torch.Generator().manual_seed(11)
    r = torch.randint(0, 2, (32,), generator=gen).float()
    a = d3s.group_advantages(r, 8)
    for keep in (0.1, 0.25, 0.5, 0.75, 1.0):
        cross = d3s.select_samples(r, a, 8, keep, "cross")[0]
        rand, kept_a = d3s.select_samples(r, a, 8, keep, "random", gen)
        assert len(rand) == len(cross) and torch.equal(kept_a, a[rand])  # A as it is
    draws = 4000
    counts = torch.zeros(32)
    for _ in range(draws):
        counts[d3s.select_samples(r, a, 8, 0.25, "random", gen)[0]] += 1  # 8 of 32 per draw
    expected = draws * 8 / 32
    # df 31: the 1e-6 tail starts near 85; the first 8 rollouts every time would score 96000
    assert chi_square(counts, torch.full((32,), expected)) < 85
    assert chi_square(torch.tensor([draws] * 8 + [0.0] * 24), torch.full((32,), expected)) > 1e4

def test_filter_keeps_exactly_the_rollouts_with_nonzero_advantage():
    """grpo-filter (DAPO's filter, no oversampling): every rollout with A != 0 and no other, in
    order, A as it is; a step of zero-variance groups only keeps none."""
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0])  # G = 4: mixed, all right, mixed
    a = d3s.group_advantages(r, 4)
    idx, kept_a = d3s.select_samples(r, a, 4, 0.3, "nonzero")
    assert idx.tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and torch.equal(kept_a, a[idx])
    assert d3s.select_samples(torch.zeros(8), torch.zeros(8), 4, 1.0, "nonzero")[0].numel() == 0
    assert d3s.applied_ratios("grpo-filter", 0.3, 0.4) == (1.0, 1.0)  # no ratio: all with A != 0


def test_random_nonzero_draws_d3s_count_from_the_informative_first():
    """d3s-random-nonzero: D3S's N, drawn uniformly among the rollouts with A != 0 while there are
    enough (every one as likely: a chi-square), then all of those plus zeros drawn at random."""
    r = torch.tensor([1.0, 0, 0, 0] + [1.0] * 4 + [0.0, 1, 1, 0] + [0.0] * 4)  # 8 of 16: A != 0
    a = d3s.group_advantages(r, 4)
    nonzero = set((a != 0).nonzero().view(-1).tolist())
    gen, counts, draws = torch.Generator().manual_seed(2), torch.zeros(16), 3000
    for _ in range(draws):
        idx, kept_a = d3s.select_samples(r, a, 4, 0.25, "random-nonzero", gen)  # N = 4 of 8
        assert len(idx) == 4 and set(idx.tolist()) <= nonzero and torch.equal(kept_a, a[idx])
        counts[idx] += 1
    # df 7: the 1e-6 tail starts near 40; always the same 4 would score 3000
    assert chi_square(counts[sorted(nonzero)], torch.full((8,), draws / 2)) < 40
    idx = d3s.select_samples(r, a, 4, 0.75, "random-nonzero", gen)[0]  # N = 12: all 8, 4 zeros
    assert len(idx) == 12 and nonzero <= set(idx.tolist())


def test_d3s_token_count_is_what_d3s_trains_hand_computed():
    """The random controls train D3S's count: round(rho_t * valid tokens of D3S's rollouts)."""
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])  # A = 1.5, -0.5 x3, then 0 x4
    a = d3s.group_advantages(r, 4)
    lengths = torch.tensor([10, 20, 30, 40, 50, 60, 70, 80])
    # rho_s 0.25: N = 2, the max-variance pair 1.5 and a -0.5: rollout 0 and the first of 1-3
    idx = d3s.select_samples(r, a, 4, 0.25, "cross")[0]
    assert idx.tolist()[0] == 0 and len(idx) == 2
    expected = int(0.5 * (10 + lengths[idx[1]].item()) + 0.5)
    assert d3s.d3s_token_count(r, a, lengths, 4, 0.25, 0.5) == expected
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert d3s.select_tokens(None, mask, 0.1, torch.Generator().manual_seed(0), 7).sum() == 7
    assert d3s.select_tokens(None, mask, 0.1, torch.Generator().manual_seed(0), 99).sum() == 15
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        d3s.select_tokens(None, mask, 0.1, None, 0)


def test_d3s_entropy_ranks_tokens_by_h_not_by_a_times_h():
    """d3s-entropy: D3S's rollouts, its ratios, tokens by H alone. Two rollouts whose |A| differ
    by 4: |A| H keeps the large-|A| rollout's tokens, H the most uncertain tokens."""
    assert d3s.METHODS["d3s-entropy"] == dict(sample="cross", token="entropy", schedule="linear")
    A = torch.tensor([2.0, -0.5])
    H = torch.tensor([[0.3, 0.25, 0.1], [0.9, 0.8, 0.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    by_ah = d3s.select_tokens(d3s.token_scores(A, H, "adv_entropy"), mask, 1 / 3)  # 2 of 6
    by_h = d3s.select_tokens(d3s.token_scores(A, H, "entropy"), mask, 1 / 3)
    assert by_ah.tolist() == [[True, True, False], [False, False, False]]  # 0.6, 0.5 > 0.45
    assert by_h.tolist() == [[False, False, False], [True, True, False]]   # 0.9, 0.8


# -----------------------------------------------------------------------------
# token selection


def test_token_scores_hand_computed():
    A = torch.tensor([-2.0, 0.5])
    H = torch.tensor([[1.0, 0.1, 3.0], [2.0, 4.0, 0.0]])
    torch.testing.assert_close(d3s.token_scores(A, H, "adv_entropy"),
                               torch.tensor([[2.0, 0.2, 6.0], [1.0, 2.0, 0.0]]))
    torch.testing.assert_close(d3s.token_scores(A, H, "entropy"), H)
    assert d3s.token_scores(A, None, "random") is None  # the control scores nothing, needs no H


def test_random_tokens_match_d3s_counts_are_uniform_and_replay():
    """The random token mode: exactly D3S's count, round(rho_t * valid) pooled over the step, never
    a masked position; every valid token equally likely over many draws; one generator state, one
    draw."""
    mask = torch.tensor([[True, True, True, False, False, False],
                         [True, True, True, True, True, True]])  # 9 valid of 12
    scores = torch.arange(12.0).view(2, 6)
    gen = torch.Generator().manual_seed(3)
    for keep in (0.01, 0.2, 1 / 3, 0.6, 1.0):
        d3s_kept = d3s.select_tokens(scores, mask, keep)
        rand = d3s.select_tokens(None, mask, keep, gen)
        assert rand.sum() == d3s_kept.sum() == max(1, int(keep * 9 + 0.5))
        assert not (rand & ~mask).any() and rand.dtype == torch.bool and rand.shape == mask.shape
    draws, counts = 3000, torch.zeros(2, 6)
    for _ in range(draws):
        counts += d3s.select_tokens(None, mask, 1 / 3, gen)  # 3 of 9 per draw
    assert (counts[~mask] == 0).all()
    # df 8: the 1e-6 tail starts near 44; the top-3 scores every time would score 6000
    assert chi_square(counts[mask], torch.full((9,), draws / 3)) < 44
    assert chi_square(draws * d3s.select_tokens(scores, mask, 1 / 3)[mask].float(),
                      torch.full((9,), draws / 3)) > 1e3
    again = [d3s.select_tokens(None, mask, 0.5, torch.Generator().manual_seed(s)) for s in (5, 5)]
    assert torch.equal(*again)
    assert len({tuple(d3s.select_tokens(None, mask, 0.5, torch.Generator().manual_seed(s))
                      .flatten().tolist()) for s in range(10)}) > 1


def test_select_tokens_pooled_masked_exact():
    scores = torch.tensor([[5.0, 4.0, 9.0, 3.0], [1.0, 2.0, 0.5, 100.0]])
    mask = torch.tensor([[True, True, False, True], [True, True, True, False]])  # 6 valid
    kept = d3s.select_tokens(scores, mask, 0.5)  # 3 of 6, pooled: all from row 0
    assert kept.tolist() == [[True, True, False, True], [False, False, False, False]]
    # the masked 9.0 and 100.0 are never taken, even when everything valid is kept
    assert d3s.select_tokens(scores, mask, 1.0).tolist() == mask.tolist()
    # at least one token
    assert d3s.select_tokens(scores, mask, 0.01).tolist() == [[True] + [False] * 3, [False] * 4]


def test_select_tokens_exact_counts_with_ties():
    gen = torch.Generator().manual_seed(4)
    for trial in range(50):
        N, T = 3, 7
        scores = torch.randint(0, 3, (N, T), generator=gen).float()  # heavy ties
        if trial % 5 == 0:
            scores.zero_()
        mask = torch.rand(N, T, generator=gen) < 0.6
        mask[0, 0] = True
        scores[~mask] = 10.0  # masked positions score highest: must still be skipped
        valid = int(mask.sum())
        for keep in (0.05, 0.3, 0.5, 0.77, 1.0):
            kept = d3s.select_tokens(scores, mask, keep)
            assert int(kept.sum()) == max(1, int(keep * valid + 0.5))
            assert not (kept & ~mask).any()
            left_out = mask & ~kept
            if left_out.any():  # kept scores are a top set: no left-out valid one beats a kept one
                assert scores[kept].min() >= scores[left_out].max()

# -----------------------------------------------------------------------------
# schedule


def test_keep_ratios_linear_and_constant():
    total = 11
    seq = [d3s.keep_ratios(s, total, "linear", 0.25, 0.75, 0.6, 0.2) for s in range(total)]
    assert seq[0] == (0.25, 0.6) and seq[-1] == (0.75, 0.2)
    assert seq[5] == pytest.approx((0.5, 0.4))
    rho_s, rho_t = zip(*seq)
    assert all(x < y for x, y in zip(rho_s, rho_s[1:]))  # rising
    assert all(x > y for x, y in zip(rho_t, rho_t[1:]))  # falling
    constant = {d3s.keep_ratios(s, total, "constant", 0.25, 0.75, 0.2, 0.6) for s in range(total)}
    assert constant == {(0.25, 0.2)}
    assert d3s.keep_ratios(0, 1, "linear", 0.25, 0.75, 0.2, 0.6) == (0.25, 0.2)  # one step: init


def test_applied_ratios_by_hand():
    # what each method trains with when the schedule says (0.4, 0.3): 1 where it keeps everything,
    # the 80/20 baseline's fixed 0.2 of tokens, the scheduled value where the method selects
    want = {"grpo": (1.0, 1.0), "pods": (0.4, 1.0), "d1s": (0.4, 1.0), "d1s-cross": (0.4, 1.0),
            "d2s": (0.4, 0.3), "d3s": (0.4, 0.3), "d3s-i": (0.4, 0.3), "entropy": (1.0, 0.2),
            "d3s-random": (0.4, 0.3), "d1s-cross-random": (0.4, 1.0),  # their twins' ratios
            "grpo-filter": (1.0, 1.0), "d3s-entropy": (0.4, 0.3), "d3s-random-nonzero": (0.4, 0.3)}
    assert {m: d3s.applied_ratios(m, 0.4, 0.3) for m in d3s.METHODS} == want
    assert d3s.applied_ratios("entropy", 0.4, 0.9) == (1.0, 0.2)  # fixed, whatever the schedule
    assert d3s.applied_ratios("d3s", 1, 1) == (1.0, 1.0)
    assert type(d3s.applied_ratios("d3s", 1, 1)[0]) is float

# -----------------------------------------------------------------------------
# loss


def test_policy_loss_clipping_hand_computed():
    # ratios (old_logp = 0, logp = log ratio), A = [+1, -2], position (1, 1) not kept
    ratios = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.1, 1.5]])
    logp = ratios.log().requires_grad_()
    mask = torch.tensor([[True, True, True], [True, False, True]])
    loss, stats = d3s.policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask, 5)
    # per token -min(w A, clip(w, 0.8, 1.2) A):
    #   row 0, A=+1: -0.5, -1.0, -1.2 (clipped high)
    #   row 1, A=-2: +1.6 (clipped low), [not kept: 2.2], +3.0 (w=1.5 with A<0: unclipped)
    assert loss.item() == pytest.approx((-0.5 - 1.0 - 1.2 + 1.6 + 3.0) / 5)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx((0.5 + 1.0 + 1.5 + 0.5 + 1.5) / 5)
    loss.backward()
    # d l / d logp = -A w where unclipped, 0 where clipped or not kept; then / 5
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -1.0, 0.0], [0.0, 0.0, 3.0]]) / 5)
    # clip-higher (DAPO-style asymmetric eps): w = 1.5 with A=+1 now clips at 1.28
    loss, _ = d3s.policy_loss(ratios.log(), torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask, 5,
                              eps_high=0.28)
    assert loss.item() == pytest.approx((-0.5 - 1.0 - 1.28 + 1.6 + 3.0) / 5)


def test_policy_loss_k3_kl_hand_computed():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[math.log(2.0), 0.0]])  # k3 = 2 - ln 2 - 1 and 0
    A = torch.tensor([0.0])  # no policy term, only KL
    mask = torch.tensor([[True, True]])
    loss, stats = d3s.policy_loss(logp, logp.detach(), A, mask, 2, ref_logp=ref, beta=0.5)
    assert loss.item() == pytest.approx(0.5 * (1 - math.log(2)) / 2)
    assert stats["kl"] == pytest.approx((1 - math.log(2)) / 2)
    loss.backward()
    # d/dlogp [e^(ref-logp) - (ref-logp) - 1] = -e^(ref-logp) + 1 -> -1 and 0; times beta / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 0.0]]))
    _, stats = d3s.policy_loss(logp, logp.detach(), A, mask, 2)
    assert "kl" not in stats


def random_batch(gen, N=6, T=5):
    logits = torch.randn(N, T, generator=gen, dtype=torch.float64)
    old = logits - 0.3 * torch.randn(N, T, generator=gen, dtype=torch.float64)  # off policy
    A = torch.randn(N, generator=gen, dtype=torch.float64)
    seq_mask = torch.rand(N, T, generator=gen) < 0.8
    seq_mask[:, 0] = True
    token_mask = seq_mask & (torch.rand(N, T, generator=gen) < 0.6)
    return logits, old, A, token_mask, seq_mask


@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
@pytest.mark.parametrize("divisor", [None, *d3s.DIVISORS])  # None: the count, one number
def test_policy_loss_micro_batches_sum_to_full_batch(loss_type, divisor):
    gen = torch.Generator().manual_seed(5)
    theta, old, A, tmask, smask = random_batch(gen)
    tmask[4] = False  # a rollout with no kept token: no term, and not one of seq's S
    eps = (dict(eps_low=0.2, eps_high=0.2) if loss_type == "grpo"
           else dict(eps_low=0.03, eps_high=0.04))
    ref = old + 0.1
    num = int(tmask.sum()) if divisor is None else d3s.divisors(tmask, smask, divisor)
    full = theta.clone().requires_grad_()
    loss, _ = d3s.policy_loss(full, old, A, tmask, num, loss=loss_type, seq_mask=smask,
                              ref_logp=ref, beta=0.1, **eps)
    loss.backward()
    micro = theta.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        d = num if divisor is None else num[rows]  # the whole update's d_i, each micro-batch's own
        part, _ = d3s.policy_loss(micro[rows], old[rows], A[rows], tmask[rows], d, loss=loss_type,
                                  seq_mask=smask[rows], ref_logp=ref[rows], beta=0.1, **eps)
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item())
    torch.testing.assert_close(micro.grad, full.grad)
    assert full.grad.abs().sum() > 0


def test_divisors_hand_computed_2x6():
    """Each divisor on one on-policy update (ratio 1, l_t = -A_i), by hand. Row 0: 4 valid tokens,
    2 kept, A = 1; row 1: 6 valid, 3 kept, A = -2. So 5 kept, 10 valid, S = 2 rollouts with a kept
    token; the kept tokens' terms sum to -1 * 2 + 2 * 3 = 4 and d l / d logp_t = -A_i / d_i."""
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    kept = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 1, 0, 1, 0, 1]], dtype=torch.bool)
    A = torch.tensor([1.0, -2.0])
    want = {  # divisor: (d_i, loss, gradient of a kept token in row 0, in row 1)
        "kept": ([5, 5], 4 / 5, -1 / 5, 2 / 5),  # [ours]: sum / the update's 5 kept tokens
        "valid": ([10, 10], 4 / 10, -1 / 10, 2 / 10),  # 80/20, DAPO: / the 10 valid tokens
        "seq": ([4, 6], -2 / 4 + 6 / 6, -1 / 4, 2 / 6),  # GRPO, GSPO: (mean_0 + mean_1) / S
    }
    for divisor, (d, value, g0, g1) in want.items():
        assert d3s.divisors(kept, valid, divisor).tolist() == d
        for loss_type in d3s.LOSSES:  # on-policy, GSPO's gradient is GRPO's under each divisor
            logp = torch.zeros(2, 6, requires_grad=True)
            d_i = d3s.divisors(kept, valid, divisor)
            loss, _ = d3s.policy_loss(logp, logp.detach(), A, kept, d_i, loss=loss_type,
                                      seq_mask=valid)
            loss.backward()
            assert loss.item() == pytest.approx(value), (divisor, loss_type)
            grad = torch.zeros(2, 6)
            grad[0, kept[0]], grad[1, kept[1]] = g0, g1
            torch.testing.assert_close(logp.grad, grad)
    # a third rollout with valid tokens but none kept: no term, not one of S, yet `valid` counts it
    valid3, kept3 = torch.cat([valid, valid[1:]]), torch.cat([kept, torch.zeros(1, 6).bool()])
    assert d3s.divisors(kept3, valid3, "seq").tolist() == [4, 6, 1]  # 1: its sum is 0 anyway
    assert d3s.divisors(kept3, valid3, "kept").tolist() == [5, 5, 5]
    assert d3s.divisors(kept3, valid3, "valid").tolist() == [16, 16, 16]


def test_gspo_seq_weighs_every_sequence_equally():
    """The GSPO paper's objective, (1/G) sum_i min(s_i A_i, clip(s_i) A_i): sequences of 2 and 8
    tokens with equal advantages get equal total weight (the gradient w.r.t. each sequence's logp,
    summed over its tokens); the kept-token mean gives the long one 4 times the weight."""
    valid = torch.zeros(2, 8, dtype=torch.bool)
    valid[0, :2], valid[1, :] = True, True
    A = torch.tensor([0.5, 0.5])
    totals = {}
    for divisor in ("seq", "kept"):
        logp = torch.zeros(2, 8, requires_grad=True)
        d_i = d3s.divisors(valid, valid, divisor)
        loss, _ = d3s.policy_loss(logp, logp.detach(), A, valid, d_i, loss="gspo", eps_low=3e-4,
                                  eps_high=4e-4)
        loss.backward()
        totals[divisor] = logp.grad.sum(dim=1).tolist()
    assert totals["seq"] == pytest.approx([-0.25, -0.25])  # 2 * -A / (2 * 2) = 8 * -A / (8 * 2)
    assert totals["kept"] == pytest.approx([-0.1, -0.4])  # -A n_i / 10: weighted by length


@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_on_policy_gradient_is_reinforce(loss_type):
    gen = torch.Generator().manual_seed(6)
    theta, _, A, tmask, smask = random_batch(gen)
    num = int(tmask.sum()) + 3  # micro-batch style divisor: the step's total, not this call's
    logp = theta.clone().requires_grad_()
    loss, stats = d3s.policy_loss(logp, logp.detach(), A, tmask, num, loss=loss_type,
                                  seq_mask=smask)
    loss.backward()
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0
    ref = theta.clone().requires_grad_()
    (-(A[:, None] * ref * tmask).sum() / num).backward()
    torch.testing.assert_close(logp.grad, ref.grad)


def test_gspo_token_with_all_tokens_kept_is_sequence_gspo():
    gen = torch.Generator().manual_seed(7)
    theta, old, A, _, mask = random_batch(gen)
    A[0], A[1] = 1.0, -1.0
    old[0, mask[0]] = theta[0, mask[0]] - 0.5  # s_0 = e^0.5 > 1 + eps, A > 0: clipped
    old[1, mask[1]] = theta[1, mask[1]] + 0.5  # s_1 = e^-0.5 < 1 - eps, A < 0: clipped
    eps_low, eps_high = 3e-4, 4e-4  # GSPO's own eps
    num = int(mask.sum())
    logp = theta.clone().requires_grad_()
    loss, stats = d3s.policy_loss(logp, old, A, mask, num, loss="gspo", eps_low=eps_low,
                                  eps_high=eps_high)
    loss.backward()
    # sequence-level GSPO by hand: s_i = exp(mean over the completion of (logp - old)), one clipped
    # term per sequence; with the step's token-mean each sequence weighs its length |y_i|
    ref = theta.clone().requires_grad_()
    lengths = mask.sum(dim=1)
    s = torch.exp(((ref - old) * mask).sum(dim=1) / lengths)
    per_seq = -torch.minimum(s * A, s.clamp(1 - eps_low, 1 + eps_high) * A)
    ref_loss = (lengths * per_seq).sum() / num
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item())
    torch.testing.assert_close(logp.grad, ref.grad)
    assert (logp.grad[:2] == 0).all() and logp.grad[2:].abs().sum() > 0  # clipped rows give nothing
    assert stats["ratio_mean"] == pytest.approx(((s.detach() * lengths).sum() / num).item())
    # with equal lengths this is the GSPO paper's (1/G) sum_i min(s_i A_i, clip(s_i) A_i)
    full = torch.ones(4, 3, dtype=torch.bool)
    th, ol, a = theta[:4, :3], old[:4, :3], A[:4]
    loss_eq, _ = d3s.policy_loss(th, ol, a, full, 12, loss="gspo", eps_low=eps_low,
                                 eps_high=eps_high)
    s4 = torch.exp((th - ol).mean(dim=1))
    paper = -torch.minimum(s4 * a, s4.clamp(1 - eps_low, 1 + eps_high) * a).mean()
    assert loss_eq.item() == pytest.approx(paper.item())


def test_gspo_ratio_uses_all_valid_tokens():
    # [ours] s_i averages over seq_mask (every valid token), not over the kept ones
    logp = torch.tensor([[0.2, 0.0, 0.4]], requires_grad=True)
    old = torch.zeros(1, 3)
    kept = torch.tensor([[True, False, False]])
    valid = torch.tensor([[True, True, True]])
    _, stats = d3s.policy_loss(logp, old, torch.tensor([1.0]), kept, 1, loss="gspo", seq_mask=valid,
                               eps_low=0.5, eps_high=0.5)
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.2))  # mean(0.2, 0, 0.4), not 0.2 alone
    _, stats = d3s.policy_loss(logp, old, torch.tensor([1.0]), kept, 1, loss="gspo", eps_low=0.5,
                               eps_high=0.5)
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.2))  # default seq_mask = token_mask


def test_policy_loss_padding_values_do_not_leak():
    logp = torch.tensor([[-1.0, float("nan")], [-2.0, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.0, 0.0], [-2.0, 0.0]])
    mask = torch.tensor([[True, False], [True, False]])
    for loss_type in d3s.LOSSES:
        loss, _ = d3s.policy_loss(logp, old, torch.tensor([1.0, 2.0]), mask, 2, loss=loss_type)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        logp.grad = None

# -----------------------------------------------------------------------------
# logs


def test_population_variance_hand_computed():
    # [1, 2, 3, 6]: mean 3, squared deviations 4, 1, 0, 9, their mean 14 / 4 = 3.5 (unbiased 14 / 3)
    assert d3s.population_variance(torch.tensor([1.0, 2.0, 3.0, 6.0])) == 3.5
    # integers: mean 3/4, (3 / 16 + 9 / 16) / 4
    assert d3s.population_variance(torch.tensor([1, 0, 1, 1])) == 0.1875
    assert d3s.population_variance(torch.tensor([5.0])) == 0.0  # fewer than 2 values
    assert d3s.population_variance(torch.zeros(0)) == 0.0  # not the NaN of an empty mean
    x = torch.tensor([0.5, -0.5, 1.5], requires_grad=True)  # with grad, as advantages may carry one
    assert d3s.population_variance(x) == pytest.approx(2 / 3)  # mean 0.5, deviations 0, -1, 1


# -----------------------------------------------------------------------------
# methods, imports, errors


def test_methods_table():
    expected = {
        "grpo": ("none", "none"), "pods": ("pods", "none"), "d1s": ("intra", "none"),
        "d1s-cross": ("cross", "none"), "d2s": ("cross", "adv_entropy"),
        "d3s": ("cross", "adv_entropy"),
        "d3s-i": ("intra", "adv_entropy"), "entropy": ("none", "entropy"),
        "d3s-random": ("random", "random"), "d1s-cross-random": ("random", "none"),
        "grpo-filter": ("nonzero", "none"), "d3s-entropy": ("cross", "entropy"),
        "d3s-random-nonzero": ("random-nonzero", "random"),
    }
    assert {m: (c["sample"], c["token"]) for m, c in d3s.METHODS.items()} == expected
    schedules = {m: c["schedule"] for m, c in d3s.METHODS.items()}
    linear = ("d3s", "d3s-i", "d3s-random", "d3s-entropy", "d3s-random-nonzero")
    assert schedules == {m: ("linear" if m in linear else "constant") for m in expected}
    assert d3s.METHODS["entropy"]["t_keep"] == 0.2
    for c in d3s.METHODS.values():
        assert c["sample"] in d3s.SAMPLE_MODES and c["token"] in d3s.TOKEN_MODES
        assert c["schedule"] in d3s.SCHEDULES
    assert d3s.LOSSES == ("grpo", "gspo")


def test_import_pulls_in_only_torch_and_stdlib():
    code = ("import sys; import torch; before = set(sys.modules); import d3s; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new - set(sys.stdlib_module_names) - {'d3s', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
    imports = [line.split()[1] for line in (ROOT / "d3s.py").read_text().splitlines()
               if line.startswith(("import ", "from "))]
    assert imports == ["math", "torch"]


R4 = torch.tensor([1.0, 0.0, 1.0, 1.0])
A4 = d3s.group_advantages(R4, 2)
LP = torch.zeros(2, 3)
M = torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize("call, match", [
    (lambda: d3s.num_keep(1.5, 4), r"keep must be in \(0, 1\], got 1.5"),
    (lambda: d3s.num_keep(0, 4), r"keep must be in \(0, 1\], got 0"),
    (lambda: d3s.num_keep(0.5, 0), r"n must be an integer >= 1, got 0"),
    (lambda: d3s.group_advantages(R4, 1), r"group_size must be an integer >= 2, got 1"),
    (lambda: d3s.group_advantages(R4, 3),
     r"rewards has 4 elements, not a positive multiple of group_size=3"),
    (lambda: d3s.group_advantages(torch.zeros(0), 2), r"rewards has 0 elements"),
    (lambda: d3s.group_advantages(R4.view(2, 2), 2),
     r"rewards must be 1-D \(B,\), got shape \(2, 2\)"),
    (lambda: d3s.group_advantages(R4, 2, scale="std"),
     r"scale must be one of group, none; got 'std'"),
    (lambda: d3s.max_variance_subset(R4, 0),
     r"k must be an integer in \[1, 4\] \(the number of values\), got 0"),
    (lambda: d3s.max_variance_subset(R4, 5), r"k must be an integer in \[1, 4\].*got 5"),
    (lambda: d3s.max_variance_subset(R4.view(2, 2), 1),
     r"values must be 1-D \(n,\), got shape \(2, 2\)"),
    (lambda: d3s.max_variance_subset(torch.tensor([1.0, math.nan]), 1), r"values must be finite"),
    (lambda: d3s.select_samples(R4, A4, 2, 1.5, "cross"), r"keep must be in \(0, 1\], got 1.5"),
    (lambda: d3s.select_samples(R4, A4, 2, -0.1, "intra"), r"keep must be in \(0, 1\], got -0.1"),
    (lambda: d3s.select_samples(R4, A4, 1, 0.5, "cross"),
     r"group_size must be an integer >= 2, got 1"),
    (lambda: d3s.select_samples(R4, A4, 3, 0.5, "cross"),
     r"not a positive multiple of group_size=3"),
    (lambda: d3s.select_samples(R4, A4, 2, 0.5, "top"),
     r"mode must be one of none, cross, intra, pods, nonzero, random, random-nonzero; got 'top'"),
    (lambda: d3s.select_samples(R4, A4[:3], 2, 0.5, "cross"),
     r"advantages has shape \(3,\), must match rewards \(4,\)"),
    (lambda: d3s.select_samples(R4, A4, 2, 0.5, "pods", scale="x"),
     r"scale must be one of group, none"),
    (lambda: d3s.token_scores(A4[:2], LP, "none"),
     r"mode must be one of adv_entropy, entropy, random; got 'none'"),
    (lambda: d3s.token_scores(A4, LP, "entropy"),
     r"entropy has 2 rows, must match advantages \(4\)"),
    (lambda: d3s.token_scores(A4[:2], LP[0], "entropy"),
     r"entropy must be 2-D \(N, T\), got shape \(3,\)"),
    (lambda: d3s.select_tokens(LP, M, 0.0), r"keep must be in \(0, 1\], got 0.0"),
    (lambda: d3s.select_tokens(LP, M[:, :2], 0.5),
     r"mask has shape \(2, 2\), must match scores \(2, 3\)"),
    (lambda: d3s.select_tokens(LP, M.long(), 0.5), r"mask must be a bool tensor, got torch.int64"),
    (lambda: d3s.select_tokens(LP, ~M, 0.5), r"mask has no valid position"),
    (lambda: d3s.select_tokens(LP + math.nan, M, 0.5), r"scores must be finite at valid positions"),
    (lambda: d3s.keep_ratios(5, 5, "linear", 0.2, 0.8, 0.2, 0.6),
     r"step must be an integer in \[0, 4\], got 5"),
    (lambda: d3s.keep_ratios(-1, 5, "linear", 0.2, 0.8, 0.2, 0.6),
     r"step must be an integer in \[0, 4\], got -1"),
    (lambda: d3s.keep_ratios(0, 0, "linear", 0.2, 0.8, 0.2, 0.6),
     r"total_steps must be an integer >= 1, got 0"),
    (lambda: d3s.keep_ratios(0, 5, "cosine", 0.2, 0.8, 0.2, 0.6),
     r"schedule must be one of linear, constant; got 'cosine'"),
    (lambda: d3s.keep_ratios(0, 5, "linear", 0.0, 0.8, 0.2, 0.6),
     r"s_init must be in \(0, 1\], got 0.0"),
    (lambda: d3s.keep_ratios(0, 5, "linear", 0.2, 1.2, 0.2, 0.6),
     r"s_final must be in \(0, 1\], got 1.2"),
    (lambda: d3s.keep_ratios(0, 5, "linear", 0.2, 0.8, 2, 0.6),
     r"t_init must be in \(0, 1\], got 2"),
    (lambda: d3s.keep_ratios(0, 5, "linear", 0.2, 0.8, 0.2, -1),
     r"t_final must be in \(0, 1\], got -1"),
    (lambda: d3s.applied_ratios("d4s", 0.5, 0.5),
     r"method must be one of grpo, grpo-filter, pods, .*, d1s-cross-random; got 'd4s'"),
    (lambda: d3s.applied_ratios("d3s", 0.0, 0.5), r"rho_s must be in \(0, 1\], got 0.0"),
    (lambda: d3s.applied_ratios("grpo", 0.5, 1.5), r"rho_t must be in \(0, 1\], got 1.5"),
    (lambda: d3s.population_variance(A4.view(2, 2)), r"x must be 1-D \(n,\), got shape \(2, 2\)"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6, loss="ppo"),
     r"loss must be one of grpo, gspo; got 'ppo'"),
    (lambda: d3s.policy_loss(LP, LP[:1], A4[:2], M, 6),
     r"old_logp has shape \(1, 3\), must match logp \(2, 3\)"),
    (lambda: d3s.policy_loss(LP, LP, A4, M, 6),
     r"advantages has shape \(4,\), must match the rows of logp \(2,\)"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M[:, :2], 6),
     r"token_mask has shape \(2, 2\), must match logp"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M.float(), 6),
     r"token_mask must be a bool tensor, got torch.float32"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6, seq_mask=~M),
     r"token_mask keeps a position that seq_mask marks invalid"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 5), r"divisor must be an integer >= 6 .*got 5"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6.0), r"divisor must be an integer .*got 6.0"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, "kept"), r"divisor must be .*got kept"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, torch.tensor([3, 2])),
     r"divisor must be an integer >= 3 .*got tensor\(\[3, 2\]\)"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, torch.tensor([6, 6, 6])), r"divisor must be"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, torch.tensor([6.0, 6.0])), r"divisor must be"),
    (lambda: d3s.divisors(M, M, "mean"), r"divisor must be one of kept, valid, seq; got 'mean'"),
    (lambda: d3s.divisors(M, M[:, :2], "kept"),
     r"token_mask has shape \(2, 3\), must match seq_mask \(2, 2\)"),
    (lambda: d3s.select_tokens(None, M[0], 0.5), r"mask must be 2-D \(N, T\), got shape \(3,\)"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6, eps_low=1.0),
     r"eps_low must be in \[0, 1\), got 1.0"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6, eps_high=-0.1),
     r"eps_high must be in \[0, 1\), got -0.1"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6, beta=-1.0), r"beta must be >= 0, got -1.0"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6, beta=0.1), r"beta=0.1 > 0 needs ref_logp"),
    (lambda: d3s.policy_loss(LP, LP, A4[:2], M, 6, ref_logp=LP[0], beta=0.1),
     r"ref_logp has shape \(3,\), must match logp \(2, 3\)"),
])
def test_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
