"""
What the update costs, method by method, on one fixed batch: train.py's own step (its steps 2-7)
for GRPO, the filter baseline and D3S at three keep ratios, side by side in one process, against
another checkout of train.py (before a change) in the same process.

    python experiments/bench_update.py --world tiny-fork                 # (a) a tiny world
    python experiments/bench_update.py --world real \
        --tokenizer ../shared/tokenizers/qwen2.5 --data ../shared/data/gsm8k/train.jsonl   # (b)
    git worktree add /tmp/before 92c92a1                                # the code before
    python experiments/bench_update.py --world real ... --before /tmp/before

Each configuration is `train.train` itself, its rollout batch fixed: generation is replaced by one
batch built once (train.generate_groups returns it; train.score its rewards), the held-out
evaluation and the checkpoint are off, and the keep ratios are constant (s_init = s_final = rho_s,
t_init = t_final = rho_t). A run takes --steps steps of that same batch at lr 1e-9 (the weights
barely move, so every step computes the same thing); its first step warms up and is not counted.
The configurations run in an ABBA order (every one, then every one in reverse, for --rounds), so a
host that slows down over the minutes slows every configuration alike; the figure is the median
of the counted steps' t_upd (everything after generation: rewards, selection, every forward and
backward pass, the optimizer steps). Beside it, log.jsonl's counts: tokens trained (in the loss),
tokens forwarded with a gradient and without (the no-grad pass of logp_old, and before: of the
entropy), lm_head rows, the update's padding share, and what the trained tokens need: each
forwarded row's prompt plus its completion up to its last trained token (the fewest tokens a
forward can read and still give every trained token its log-prob, under causal attention).

The worlds:
  tiny, tiny-fork, tiny-weak   the world's model (out/WORLD, built on first use) and P x G of its
             own rollouts at its defaults (16 x 8, 32 new tokens), sampled once, graded
  real       a Qwen2 of Qwen2.5's tokenizer and vocabulary (151,936 tokens, tied embeddings,
             --hidden, --layers), random weights; P GSM8K prompts in the chat template, G rollouts
             each, whose lengths are the token lengths of G random GSM8K reference answers (cut at
             --max_new_tokens: truncated), tokens at random; the sampler's entropy drawn from a
             heavy-tailed law (most tokens near 0, a few forks); round(--zero_var x P) of the groups
             all right or all wrong, the others a random count of successes in 1..G-1.
K = 4 (train.py's default) and --micro_batch_size rollouts a forward. A tiny world's batch is
sampled --gen_rounds times, timed (step 1 and its rewards, as train.py runs them), for generation's
share of GRPO's step on this machine: a device's share as experiments/budget.py takes it, beside
the update ratios of the table. Prints a markdown table per checkout and writes every number to
--json.
"""
import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root
MODULES = ("train", "d3s", "rollout", "reward", "eval", "machinery")
RATIOS = "0.25/0.2,0.5/0.4,0.75/0.6"  # D3S's (rho_s, rho_t): the schedule's ends and middle

# -----------------------------------------------------------------------------
# two checkouts of train.py in one process


def load_tree(path):
    """The modules of the checkout at `path` (train.py and what it imports), imported fresh; the
    modules already loaded under those names are put back afterwards."""
    saved = {k: m for k, m in sys.modules.items() if k.split(".")[0] in MODULES}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, path)
    try:
        importlib.import_module("train")
        tree = {k: m for k, m in sys.modules.items() if k.split(".")[0] in MODULES}
    finally:
        sys.path.remove(path)
        for k in [k for k in sys.modules if k.split(".")[0] in MODULES]:
            del sys.modules[k]
        sys.modules.update(saved)
    return tree


@contextlib.contextmanager
def using(tree):
    """sys.modules as `tree` imported them, for the imports a function makes when it runs."""
    saved = {k: m for k, m in sys.modules.items() if k.split(".")[0] in MODULES}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(tree)
    try:
        yield tree["train"]
    finally:
        for k in tree:
            sys.modules.pop(k, None)
        sys.modules.update(saved)


# -----------------------------------------------------------------------------
# the fixed batch


@dataclasses.dataclass
class Batch:
    fields: dict       # rollout.Rollouts' fields: each checkout builds its own Rollouts from them
    rewards: list      # B floats, 0/1
    prompts: int       # P
    model: str         # the folder every configuration loads
    gen_s: float = None  # step 1's seconds for this batch (median of --gen_rounds; None: not run)


def world_batch(args):
    """(a): a tiny world's own rollouts at its defaults (tiny-fork: P x G = 16 x 8), graded."""
    import rollout
    from machinery import tiny
    from machinery.data import batch_at, format_prompt, load_problems
    from machinery.model import load_model
    from reward import score
    folder = tiny.pretrained(os.path.join(ROOT, "out", args.world), name=args.world)
    model, tok = load_model(folder, device="cpu", dtype="float32")
    rows = batch_at(load_problems(args.world, "train"), 0, args.prompts, args.seed)
    seconds = []
    for _ in range(args.gen_rounds):  # step 1 as train.py runs it (model.train(): generate_groups
        t0 = time.perf_counter()      # puts it in eval mode itself), its rewards included
        ro = rollout.generate_groups(model.train(), tok, [format_prompt(tok, r["prompt"])
                                                          for r in rows], args.group_size,
                                     args.max_new_tokens or 32, seed=args.seed,
                                     record_entropy=True)
        rewards, _ = score(ro.texts, [r["answer"] for r in rows for _ in range(args.group_size)],
                           ro.truncated.tolist())
        seconds.append(time.perf_counter() - t0)
    return Batch(fields_of(ro), rewards, args.prompts, folder, statistics.median(seconds))


def real_batch(args):
    """(b): Qwen2.5's vocabulary, GSM8K's prompts and its answers' lengths (module docstring)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from machinery.data import format_prompt, load_problems
    from machinery.sampling import encode_left_padded
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    folder = os.path.join(args.out, f"qwen2-h{args.hidden}-l{args.layers}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        config = Qwen2Config(vocab_size=len(tok), hidden_size=args.hidden,
                             intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
        tok.save_pretrained(folder)
    problems = load_problems(args.data, "train")
    g, P, G, N = torch.Generator().manual_seed(0), args.prompts, args.group_size, \
        args.max_new_tokens or 512
    pick = torch.randperm(len(problems), generator=g)
    prompts = [format_prompt(tok, problems[i]["prompt"]) for i in pick[:P].tolist()]
    with open(args.data) as f:  # the reference solutions, as written (GSM8K: `answer`)
        raw = [json.loads(line) for line in f if line.strip()]
    pool = [len(tok(raw[i].get("solution") or raw[i]["answer"])["input_ids"]) + 1  # + the stop
            for i in pick[P:P + 2000].tolist()]
    lengths = torch.tensor([pool[i] for i in torch.randint(len(pool), (P * G,), generator=g)])
    stop, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    prompt_ids, prompt_mask = encode_left_padded(tok, prompts, pad)
    T = int(lengths.clamp(max=N).max())
    cols = torch.arange(T)
    mask = cols < lengths.clamp(max=N)[:, None]  # (B, T)
    ids = torch.randint(0, 150_000, (P * G, T), generator=g).masked_fill(~mask, pad)
    truncated = lengths > N
    last = (lengths.clamp(max=N) - 1)[:, None]
    ids = torch.where((cols == last) & ~truncated[:, None], stop, ids)
    entropy = (torch.distributions.Exponential(2.0).sample((P * G, T)) ** 2) * mask
    rewards, flat = [], set(torch.randperm(P, generator=g)[:round(args.zero_var * P)].tolist())
    for i in range(P):
        if i in flat:  # all right or all wrong, alternately
            rewards += [float(len(rewards) // G % 2)] * G
        else:
            k = int(torch.randint(1, G, (), generator=g))
            rewards += [1.0] * k + [0.0] * (G - k)
    group = torch.arange(P).repeat_interleave(G)
    fields = dict(prompt_ids=prompt_ids[group], prompt_mask=prompt_mask[group],
                  completion_ids=ids, completion_mask=mask, truncated=truncated, group=group,
                  texts=[""] * (P * G), entropy=entropy.float(), decoded=int(mask.numel()))
    return Batch(fields, rewards, P, folder)


def fields_of(ro):
    return {f.name: getattr(ro, f.name) for f in dataclasses.fields(ro)}


# -----------------------------------------------------------------------------
# one configuration, as train.py runs it


def measure(train, batch, method, rho_s, rho_t, args):
    """train.train on the fixed batch: -> its log rows after the first (the warm-up)."""
    rollout = sys.modules["rollout"]
    names = {f.name for f in dataclasses.fields(rollout.Rollouts)}
    ro = rollout.Rollouts(**{k: v for k, v in batch.fields.items() if k in names})
    G = len(ro.texts) // batch.prompts
    patches = {"generate_groups": lambda *a, **k: ro, "held_out": lambda *a, **k: 0.0,
               "score": lambda texts, answers, truncated=None: (
                   list(batch.rewards), {"no_answer": 0, "hedge": 0})}
    run_mod = sys.modules["machinery.run"]
    saved = {k: getattr(train, k) for k in patches}
    save = run_mod.Run.save
    with tempfile.TemporaryDirectory() as out:
        cfg = train.Config(model=batch.model, method=method, steps=args.steps + 1,
                           prompts_per_step=batch.prompts, group_size=G, s_init=rho_s,
                           s_final=rho_s, t_init=rho_t, t_final=rho_t, lr=1e-9,
                           micro_batch_size=args.micro_batch_size, eval_every=0, save_every=0,
                           eval_size=1, dataset=args.dataset, out_dir=os.path.join(out, "run"),
                           max_new_tokens=int(ro.completion_ids.shape[1]))
        given = {"model", "method", "steps", "prompts_per_step", "group_size", "s_init",
                 "s_final", "t_init", "t_final", "lr", "micro_batch_size", "eval_every",
                 "save_every", "eval_size", "dataset", "out_dir", "max_new_tokens"}
        try:
            for k, v in patches.items():
                setattr(train, k, v)
            run_mod.Run.save = lambda self, step: None
            train.train(cfg, log=lambda *a: None, given=given)
        finally:
            for k, v in saved.items():
                setattr(train, k, v)
            run_mod.Run.save = save
        with open(os.path.join(out, "run", "log.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    return rows[1:]


def selection(batch, method, rho_s, rho_t):
    """Steps 4 and 6 as train.py runs them on the batch (token selection on its sampler entropy):
    -> each kept rollout's prompt tokens, completion tokens, and needed columns (0: not read)."""
    import d3s
    m, rewards = d3s.METHODS[method], torch.tensor(batch.rewards)
    G = len(rewards) // batch.prompts
    adv = d3s.group_advantages(rewards, G)
    idx, adv_kept = d3s.select_samples(rewards, adv, G, rho_s, m["sample"])
    mask, entropy = batch.fields["completion_mask"][idx], batch.fields["entropy"][idx]
    if m["token"] != "none":
        mask = d3s.select_tokens(d3s.token_scores(adv_kept, entropy, m["token"]), mask, rho_t)
    return (batch.fields["prompt_mask"][idx].sum(dim=1), batch.fields["completion_mask"][idx]
            .sum(dim=1), d3s.needed_columns(mask, adv_kept), m["token"] not in ("none", "random"))


def needed(batch, method, rho_s, rho_t):
    """The tokens the step's trained tokens need in its gradient pass: each rollout with a trained
    token and A != 0, its prompt plus its completion up to its last trained token, summed (d3s.py's
    own functions: only train.py's cutting and micro-batching are under test here)."""
    prompt, _, cols, _ = selection(batch, method, rho_s, rho_t)
    return int((prompt + cols)[cols > 0].sum())


def what_each_bought(batch, method, rho_s, rho_t, K=4):
    """Decoder tokens of the gradient and the no-grad passes, by count, as each change of the
    update added on the one before: [(change, grad tokens, no-grad tokens)]. The no-grad pass
    covers K - 1 of K mini-batches (logp_old), or every row (the entropy, before it came from the
    sampler); a mini-batch's rows taken as (K - 1) / K of them."""
    prompt, length, cols, scores = selection(batch, method, rho_s, rho_t)
    full, live = prompt + length, cols > 0
    share = (K - 1) / K
    rows = [("before", full.sum(), full.sum() if scores else share * full.sum()),
            ("no pass for A = 0", full[live].sum(), (1 if scores else share) * full[live].sum()),
            ("cut after the last trained token", (prompt + cols)[live].sum(),
             full[live].sum() if scores else share * (prompt + cols)[live].sum()),
            ("the sampler's entropy (now)", (prompt + cols)[live].sum(),
             share * (prompt + cols)[live].sum())]
    return [(name, int(g), int(n)) for name, g, n in rows]


def table(results, name):
    head = ["configuration", "upd s (median)", "vs grpo", "tokens trained", "fwd+bwd tokens",
            "needed", "fwd+bwd / needed", "no-grad tokens", "lm_head rows", "update padding",
            "steps"]
    lines = [f"### {name}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    base = results["grpo"]["upd_s"]
    for label, r in results.items():
        pad = r["upd_pad_share"]
        lines.append("| " + " | ".join([
            label, f"{r['upd_s']:.3f}", f"{r['upd_s'] / base:.2f}", str(r["tokens"]),
            str(r["fwd_bwd_tokens"]), str(r["needed"]), f"{r['forwarded'] / r['needed']:.2f}",
            "-" if r["nograd_tokens"] is None else str(r["nograd_tokens"]),
            "-" if r["head_rows"] is None else str(r["head_rows"]),
            "-" if pad is None else f"{100 * pad:.1f}%", str(r["steps"])]) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--world", default="tiny-fork",
                   choices=("tiny", "tiny-fork", "tiny-weak", "real"))
    p.add_argument("--seed", type=int, default=0, help="a tiny world's prompts and samples")
    p.add_argument("--before", default="", help="another checkout's root: its train.py as well")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "..", "shared", "tokenizers",
                                                       "qwen2.5"))
    p.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data", "gsm8k",
                                                  "train.jsonl"))
    p.add_argument("--prompts", type=int, default=16, help="P (real: 8 is plenty on a CPU)")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=0, help="0: the world's (32; real 512)")
    p.add_argument("--zero_var", type=float, default=0.4, help="real: zero-variance groups' share")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--ratios", default=RATIOS, help="D3S's rho_s/rho_t, comma-separated")
    p.add_argument("--steps", type=int, default=2, help="counted steps a run (after a warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    p.add_argument("--gen_rounds", type=int, default=3, help="a tiny world: step 1 timed so often")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "bench_update"))
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    args.dataset = args.data if args.world == "real" else args.world
    batch = (real_batch if args.world == "real" else world_batch)(args)
    trees = {"now": load_tree(ROOT)}
    if args.before:
        trees["before"] = load_tree(os.path.abspath(args.before))
    configs = [("grpo", 1.0, 1.0), ("grpo-filter", 1.0, 1.0)] + [
        ("d3s", *map(float, r.split("/"))) for r in args.ratios.split(",")]
    order = [(t, c) for t in trees for c in configs]
    rows = {k: [] for k in order}
    for r in range(args.rounds):
        for t, c in (order + order[::-1]):
            with using(trees[t]) as train:
                rows[(t, c)] += measure(train, batch, *c, args)
            print(f"round {r}: {t} {c[0]} {c[1]}/{c[2]}: "
                  f"{statistics.median(x['t_upd'] for x in rows[(t, c)]):.3f} s", flush=True)
    results = {}
    for t in trees:
        out = results[t] = {}
        for c in configs:
            rs = rows[(t, c)]
            label = c[0] if c[0] != "d3s" else f"d3s {c[1]}/{c[2]}"
            last = rs[-1]
            out[label] = {"upd_s": statistics.median(x["t_upd"] for x in rs),
                          "fb_s": statistics.median(x["t_fb"] for x in rs), "steps": len(rs),
                          "tokens": last["tokens"], "fwd_bwd_tokens": last["fwd_bwd_tokens"],
                          "nograd_tokens": last.get("nograd_tokens"),
                          "head_rows": last.get("head_rows"),
                          "upd_pad_share": last.get("upd_pad_share"), "kept": last["kept"],
                          "zero_var": last["zero_var"], "needed": needed(batch, *c),
                          # positions of the gradient pass, padding included (its share: the
                          # update's, the same pieces run both passes)
                          "forwarded": last["fwd_bwd_tokens"] / (1 - (last.get("upd_pad_share")
                                                                      or 0.0))}
        print(table(out, f"{args.world}, {t}") + "\n")
        if batch.gen_s is not None:  # generation's share of GRPO's step, as budget.py takes it
            out["share"] = batch.gen_s / (batch.gen_s + out["grpo"]["upd_s"])
            print(f"step 1 on this batch: {batch.gen_s:.3f} s (median of {args.gen_rounds}); "
                  f"generation's share of GRPO's step: {out['share']:.3f}\n")
    print("### What each change bought, by count (decoder tokens: with a gradient / without)\n")
    for c in configs:
        steps = what_each_bought(batch, *c)
        print(f"- {c[0]} {c[1]}/{c[2]}: " + "; ".join(f"{n}: {g} / {ng}" for n, g, ng in steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
