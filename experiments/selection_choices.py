"""
Two choices of D3S's sample level that the paper leaves open, measured on simulated batches
(docs/algorithm.md, "Sample-selection modes"): what `cross` keeps against the alternatives.

    python experiments/selection_choices.py                     # tiny-like: 16 x 8, 35% all wrong
    python experiments/selection_choices.py --groups 32 --all_wrong 0.5 --rho_s 0.5

1. The objective. `cross` keeps the rollouts whose advantages have maximal variance around the kept
   subset's own mean (d3s.select_samples). The paper motivates it by the gradient's norm, which
   points as much to the largest sum of A^2 (top-|A|: the N largest |A|). Printed: the share of
   batches in which the two keep different rollouts.
2. Ties. With 0/1 rewards most advantages tie, and `cross` breaks ties by batch order (a stable
   sort): a group's success can be kept without its failures. Printed: the mean of the kept
   advantages (0 would be baseline-centred, as each group's are), the share of kept tokens (each
   rollout's length drawn from 10..40) from rollouts with A > 0, and the same with ties broken at
   random (the advantages shuffled before selection, then mapped back), and the share of kept
   rollouts whose group also keeps one of the other sign (a success trained with a failure of its
   own group).

Each batch: --groups groups of --group_size rollouts; a share --all_wrong of the groups all wrong,
the rest mixed, each rollout right with probability --success (redrawn until 1..G-1 are right);
--batches batches. "Different" compares the kept advantages as values, so that two subsets equal
up to a tie count as the same.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import d3s  # noqa: E402


def batch(g, groups, G, all_wrong, p):
    rewards = []
    for _ in range(groups):
        k = 0
        while not torch.rand((), generator=g) < all_wrong and not 0 < k < G:  # 1..G-1 successes
            k = int((torch.rand(G, generator=g) < p).sum())
        rewards += [1.0] * k + [0.0] * (G - k)
    return torch.tensor(rewards)


def top_abs(adv, n):
    """The n largest |A|, ties by batch order."""
    return torch.sort(torch.argsort(adv.abs(), descending=True, stable=True)[:n]).values


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--all_wrong", type=float, default=0.35)
    p.add_argument("--success", type=float, default=0.3, help="a mixed group's success rate")
    p.add_argument("--rho_s", type=float, default=0.25)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    g, G = torch.Generator().manual_seed(args.seed), args.group_size
    differ, means, shares, off = 0, {"order": [], "random": []}, {"order": [], "random": []}, {
        "order": [], "random": []}
    paired = {"order": [], "random": []}
    for _ in range(args.batches):
        rewards = batch(g, args.groups, G, args.all_wrong, args.success)
        adv = d3s.group_advantages(rewards, G)
        lengths = torch.randint(10, 41, adv.shape, generator=g)
        n = d3s.num_keep(args.rho_s, len(adv))
        idx, kept = d3s.select_samples(rewards, adv, G, args.rho_s, "cross")
        differ += not torch.equal(kept.sort().values, adv[top_abs(adv, n)].sort().values)
        perm = torch.randperm(len(adv), generator=g)
        shuffled = perm[d3s.max_variance_subset(adv[perm], n)]
        for name, rows in (("order", idx), ("random", shuffled)):
            means[name].append(adv[rows].mean().item())
            off[name].append(abs(adv[rows].mean().item()))
            a, grp = adv[rows], rows // G  # kept, and its group keeps one of the other sign
            both = [(a[grp == k] > 0).any() and (a[grp == k] < 0).any() for k in grp.tolist()]
            paired[name].append(sum(both) / len(both))
            tok = lengths[rows]
            shares[name].append((tok * (adv[rows] > 0)).sum().item() / tok.sum().item())
    print(f"{args.batches} batches of {args.groups} x {G}, {args.all_wrong:.0%} of groups all "
          f"wrong, rho_s {args.rho_s}:")
    print(f"  cross and top-|A| keep different advantages in {differ / args.batches:.1%} of "
          f"batches")
    for name, what in (("order", "ties by batch order (d3s)"), ("random", "ties at random")):
        m, a, s, c = (sum(x) / len(x) for x in (means[name], off[name], shares[name], paired[name]))
        print(f"  {what}: kept A averages {m:+.3f} (|mean| {a:.3f} a batch); {s:.1%} of kept "
              f"tokens from A > 0; {c:.1%} of kept rollouts kept with one of the other sign from "
              f"their group")
    return 0


if __name__ == "__main__":
    sys.exit(main())
