"""
A tiny world's starting figures, the columns of tiny.py's table, measured on its warmed-up model:

    python experiments/world_figures.py --world tiny-weak  # builds out/tiny-weak once, measures
    python experiments/world_figures.py --terms 4 --warmup_steps 200 --noise 0.85  # a candidate
    # after RL
    python experiments/world_figures.py --world tiny-weak --model out/grpo-tiny-weak/checkpoint

  greedy      held-out accuracy, greedy, on the world's whole test split (what train.py's
              evaluation and bench.py --eval_size all measure)
  sampled     accuracy at T = 1 of 8 answers to each of the first 256 training questions (seed 0):
              the groups of a GRPO step
  all-wrong   share of those 256 groups of 8 with no right answer (their advantages are all 0)
  all-right   share with every answer right (the same); mixed: the rest, the groups RL learns from
  forks       the entropy profile of those same 256 groups of 8 (generate_groups, T = 1, seed 0): of
              all their completion tokens (the stop token too), the share sampled with an entropy
              H > 0.672 nats (the 80/20 paper's forking threshold, plots.FORK_ENTROPY), the mean
              and the median H, and the share of all their entropy held by the top 20% of tokens.
              A real 0.5B instruct model on GSM8K: 17.1%, 0.281, 0.022, 78%.
  p(step)     teacher-forced on the test split's clean solutions: the mean probability the model
              puts on the right result digit of a step, for steps that do not wrap past 9 and for
              steps that do; and on a wrapping step, the probability of the sloppy teacher's digit
              (the right one + 1, a forgotten carry). A model that has the skill but applies it with
              low probability is near 1 on plain steps and near 1 - noise / noise on wrapping ones;
              a model that has not learned the arithmetic is low on both, and its right answers are
              luck.
  by wraps    greedy accuracy on the test questions with 0, 1, 2, ... wrapping steps (the clean
              solution's), and the share of questions with that many: a question with no wrapping
              step is answered right by any model that adds.

A candidate world (--terms, --warmup_steps, --noise; --shuffle: tiny-fork's teacher) is built
under out/explore/ and is not added to tiny.WORLDS. One thread (the machine's cores are shared):
torch.set_num_threads(1).
"""
import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train  # noqa: E402
from machinery import config, tiny  # noqa: E402
from machinery.data import format_prompt  # noqa: E402
from eval import evaluate  # noqa: E402
from machinery.model import load_model  # noqa: E402
from machinery.plots import FORK_ENTROPY  # noqa: E402
from rollout import generate_groups  # noqa: E402

GROUP, GROUPS = 8, 256  # the sampled figures: 8 answers to each of 256 training questions


def wraps(digits):
    """The wrapping steps of the clean solution: [(acc, d, right result)] with acc + d >= 10."""
    acc, out = digits[0], []
    for d in digits[1:]:
        if acc + d >= 10:
            out.append((acc, d, (acc + d) % 10))
        acc = (acc + d) % 10
    return out


@torch.no_grad()
def step_probabilities(model, tokenizer, rows):
    """Teacher-forced on the clean solutions of `rows`: mean p(right digit) on plain and on wrapping
    steps, and mean p(right digit + 1) on wrapping steps. One token per character (tiny's
    tokenizer)."""
    sums, counts = collections.Counter(), collections.Counter()
    digit_id = {d: tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    for i in range(0, len(rows), 256):
        chunk = rows[i:i + 256]
        texts, marks = [], []
        for r in chunk:
            digits = [int(c) for c in r["prompt"].split("+")]
            prompt, solution = format_prompt(tokenizer, r["prompt"]), tiny.solve(digits)
            texts.append(prompt + solution)
            at, mark = len(prompt) + 1, []  # solution = " " + lines joined by newlines
            for line in solution[1:].split("\n")[:-1]:  # "a+b=c" lines; the last is "#### d"
                a, rest = line.split("+")
                d, s = map(int, rest.split("="))
                mark.append((at + len(line) - 1, s, int(a) + d >= 10))  # the result digit
                at += len(line) + 1
            marks.append(mark)
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
        probs = model(**enc).logits.float().softmax(-1)  # (B, L, V)
        for b, mark in enumerate(marks):
            for at, s, wrap in mark:
                p = probs[b, at - 1]  # the prediction of character `at`
                kind = "wrap" if wrap else "plain"
                sums[kind] += p[digit_id[s]].item()
                counts[kind] += 1
                if wrap:
                    sums["carry forgotten"] += p[digit_id[(s + 1) % 10]].item()
    return {"p(right | plain step)": sums["plain"] / max(counts["plain"], 1),
            "p(right | wrapping step)": sums["wrap"] / max(counts["wrap"], 1),
            "p(right + 1 | wrapping step)": sums["carry forgotten"] / max(counts["wrap"], 1)}


def entropy_profile(model, tokenizer, rows, max_new_tokens, group_size=GROUP, seed=0):
    """The sampler's entropy H_t (in float32, within float rounding of the one D3S scores, which
    comes from a training forward) at every completion token of `group_size` answers at T = 1 to
    each row's question: the forking share (H > FORK_ENTROPY), mean and median H, and the share of
    all the entropy that the top 20% of tokens hold."""
    prompts = [format_prompt(tokenizer, r["prompt"]) for r in rows]
    out = generate_groups(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0,
                          batch_size=256, record_entropy=True, seed=seed)
    h = out.entropy[out.completion_mask].float().sort(descending=True).values  # (tokens,)
    top = h[:max(1, round(0.2 * len(h)))]
    return {"forking share": (h > FORK_ENTROPY).float().mean().item(), "mean H": h.mean().item(),
            "median H": h.median().item(), "top 20% hold": (top.sum() / h.sum()).item()}


def figures(model, tokenizer, terms, max_new_tokens):
    """Every figure of the module docstring, as a dict."""
    test = tiny.problems("test", terms=terms)
    t0 = time.time()
    greedy = evaluate(model, tokenizer, test, n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                      batch_size=256)
    train = tiny.problems("train", terms=terms)[:GROUPS]
    sampled = evaluate(model, tokenizer, train, n=GROUP, temperature=1.0,
                       max_new_tokens=max_new_tokens, batch_size=256, seed=0)
    right = [0] * GROUPS
    for r in sampled["records"]:
        right[r["problem"]] += r["correct"] == 1.0
    by = collections.defaultdict(list)  # greedy correctness by the number of wrapping steps
    for row, rec in zip(test, greedy["records"]):
        by[len(wraps([int(c) for c in row["prompt"].split("+")]))].append(rec["correct"] == 1.0)
    return {"greedy": greedy["accuracy"], "test questions": len(test),
            "sampled": sampled["accuracy"],
            "all-wrong groups": sum(c == 0 for c in right) / GROUPS,
            "all-right groups": sum(c == GROUP for c in right) / GROUPS,
            "mixed groups": sum(0 < c < GROUP for c in right) / GROUPS,
            **entropy_profile(model, tokenizer, train, max_new_tokens),
            **step_probabilities(model, tokenizer, test),
            "greedy by wraps": {w: [round(sum(v) / len(v), 3), round(len(v) / len(test), 3)]
                                for w, v in sorted(by.items())},
            "seconds": round(time.time() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--world", default=None,
                   help="a world of tiny.WORLDS (built into out/NAME once)")
    p.add_argument("--model", default=None,
                   help="with --world: measure this folder (a run's checkpoint) instead")
    p.add_argument("--terms", type=int, default=None, help="a candidate world: digits per question")
    p.add_argument("--warmup_steps", type=int, default=None,
                   help="a candidate world: supervised warm-up steps")
    p.add_argument("--noise", type=float, default=None,
                   help="a candidate world: the teacher's forgotten-carry rate")
    p.add_argument("--shuffle", action="store_true",
                   help="a candidate world: the teacher adds in any order (tiny-fork's)")
    p.add_argument("--seed", type=int, default=0, help="a candidate world: the warm-up's seed")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    candidate = (args.terms, args.warmup_steps, args.noise)
    if (args.world is None) == all(x is None for x in candidate) or \
            (args.world is None and None in candidate):
        sys.exit("error: give --world NAME, or all three of --terms, --warmup_steps and --noise "
                 "for a candidate")
    if args.model is not None and args.world is None:
        sys.exit("error: --model needs --world, the world whose questions the folder's model "
                 "answers")
    if args.world is not None:  # the budget train.py gives the world (its max_new_tokens knob)
        spec, name = tiny.world(args.world), args.world
        budget = config.resolve(train.Config(model=name)).max_new_tokens
        model, tokenizer = load_model(args.model or name, device="cpu")
    else:
        spec, budget = dict(terms=args.terms, warmup_steps=args.warmup_steps, noise=args.noise,
                            shuffle=args.shuffle), 6 * args.terms + 8
        name = f"try-{args.terms}-{args.warmup_steps}-{args.noise:g}{'-shuffle' * args.shuffle}" \
               f"-s{args.seed}"
        tiny.WORLDS[name] = spec  # this process only: tiny.pretrained builds from WORLDS
        path = tiny.pretrained(os.path.join("out", "explore", name), seed=args.seed, name=name)
        model, tokenizer = load_model(path, device="cpu")
    model.eval()
    out = {"world": name, **({"model": args.model} if args.model else {}), **spec,
           "max_new_tokens": budget, **figures(model, tokenizer, spec["terms"], budget)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
