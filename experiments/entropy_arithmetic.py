"""
Token selection scores |A| x the sampler's entropy (train.py's step 5): how many of the tokens it
selects move if the entropy came from a training forward instead, in float32 and under bf16
autocast (a GPU's --dtype auto, run here on the CPU).

    python experiments/entropy_arithmetic.py --model tiny-fork
    python experiments/entropy_arithmetic.py --model qwen2-random \
        --tokenizer ../shared/tokenizers/qwen2.5 --max_new_tokens 64

For one batch of P prompts x G rollouts sampled by rollout.generate_groups (the decode loop, its
sampler recording the entropy of softmax(logits / T) at every drawn token) and a forward of the same
tokens as step 7 runs it (rollout.completion_hidden under the same autocast, the lm_head in float32
by rollout.head_logprobs), each with the advantages of seeded coin-flip rewards: the tokens
d3s.select_tokens keeps at rho_t (pooled over the batch, |A| H), from each entropy, and the share
of the kept tokens that one keeps and the other does not. Prints the largest entropy gap too.

--model: a tiny world (its trained model: a real model's share of forks, a small vocabulary), or
qwen2-random: a Qwen2 of Qwen2.5's 151,936-token vocabulary and Qwen2.5-0.5B's width (896, 14 heads,
2 KV heads, 4 layers here), random weights: the real vocabulary's rounding, but a random model's
near-uniform distributions (its entropies sit near log V, so nearly every score is a near-tie:
the worst case for how many selected tokens move). No pretrained real-vocabulary model is reachable
offline; the two bracket one.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import d3s  # noqa: E402
import rollout  # noqa: E402
from machinery.data import format_prompt, load_problems  # noqa: E402
from machinery.model import load_model  # noqa: E402


def model_and_prompts(args):
    if args.model != "qwen2-random":
        from machinery import tiny
        folder = tiny.pretrained(os.path.join("out", args.model), name=args.model)
        model, tok = load_model(folder, device="cpu", dtype="float32")
        return model, tok, [r["prompt"] for r in load_problems(args.model, "test")[:args.prompts]]
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    return model, tok, [r["prompt"] for r in load_problems(args.data, "test")[:args.prompts]]


def measure(model, tok, prompts, args, dtype):
    """-> (share of the selected tokens that move, max |H_sampler - H_forward|, mean H)."""
    on = dtype == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
        ro = rollout.generate_groups(model, tok, [format_prompt(tok, p) for p in prompts],
                                     args.group_size, args.max_new_tokens, seed=args.seed,
                                     record_entropy=True)
        with torch.no_grad():
            hidden = rollout.completion_hidden(model, ro.input_ids, ro.attention_mask,
                                               ro.completion_start)
            _, forward = rollout.head_logprobs(model, hidden, ro.completion_ids,
                                               ro.completion_mask, 1.0, True)
    g = torch.Generator().manual_seed(args.seed)
    rewards = (torch.rand(len(ro.texts), generator=g) < 0.5).float()
    adv = d3s.group_advantages(rewards, args.group_size)
    valid = ro.completion_mask & (adv != 0)[:, None]  # rows with A = 0 score 0 either way
    kept = [d3s.select_tokens(d3s.token_scores(adv, h, "adv_entropy"), ro.completion_mask,
                              args.rho_t) for h in (ro.entropy, forward)]
    moved = int((kept[0] & ~kept[1]).sum())
    gap = (ro.entropy - forward)[ro.completion_mask].abs().max().item()
    return moved / max(int(kept[0].sum()), 1), moved, int(kept[0].sum()), gap, \
        forward[valid].mean().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default="tiny-fork")
    p.add_argument("--tokenizer", default=os.path.join("..", "shared", "tokenizers", "qwen2.5"))
    p.add_argument("--data", default=os.path.join("..", "shared", "data", "gsm8k", "test.jsonl"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--rho_t", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model, tok, prompts = model_and_prompts(args)
    print(f"{args.model}: {args.prompts} prompts x {args.group_size}, {args.max_new_tokens} new "
          f"tokens, rho_t {args.rho_t}, seed {args.seed}")
    for dtype in ("float32", "bfloat16"):
        share, moved, kept, gap, mean_h = measure(model, tok, prompts, args, dtype)
        print(f"{dtype}: {moved} of {kept} selected tokens move ({100 * share:.1f}%); "
              f"max |H gap| {gap:.2e}; mean H {mean_h:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
