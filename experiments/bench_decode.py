"""
How fast is step 1? rollout.py's decode loop against transformers' generate (the hf engine), in one
process, on the same prompts, seed and rows, alternating, so that both meet the same machine.

    python experiments/bench_decode.py --tokenizer ../shared/tokenizers/qwen2.5 \\
        --data_dir ../shared/data                 # both worlds below, 3 rounds, 2 threads
    python experiments/bench_decode.py --world tiny --rounds 5 --threads 1
    python experiments/bench_decode.py --world real --compile inductor ...   # the loop compiled

Two worlds:
  real  a Qwen2 of the real vocabulary (the tokenizer's 151,936 tokens) with 2 layers of width 64
        and random weights (seed 0), the real Qwen2.5 tokenizer, the first --prompts GSM8K training
        prompts (data.format_prompt) x --group_size rows, --max_new_tokens tokens at temperature 1:
        the lm_head and the sampler over 151,936 tokens are nearly all of a decode step here, as
        for a 0.5B model on a GPU. Random weights rarely stop: most rows run to the budget.
  tiny  the offline tiny world's model (out/tiny) and prompts at train.py's tiny defaults (16
        prompts x 8 rows, 32 new tokens), where rows stop early.
Each round runs the loop, then hf (or the reverse, alternating), after one warm-up call of each;
the table has the medians: seconds, generated tokens per second (completion tokens, the stop
included, over the seconds), the loop's seconds over hf's, and the padding share (decoded
row-positions after a row had stopped over all decoded: rows x decode steps; the loop and hf
decode the same steps on a CPU). The samples are compared too: the rows whose tokens are the same
from both engines. (On the real world's random model the distribution over 151,936 tokens is nearly
flat, each token ~7e-6 wide, so the two engines' float32 rounding of the logits, a few ulps apart,
moves a uniform across a token's edge now and then; the tests compare the engines on models whose
distributions are not flat, where every token agrees.) --compile BACKEND compiles the loop's step
with that torch.compile backend (machinery/sampling.COMPILE; the warm-up round pays the compile).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from machinery import data, sampling  # noqa: E402
from rollout import generate_groups  # noqa: E402


def real_world(args):
    """(model, tokenizer, prompts) of the real world: see the module docstring."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"),
                                            tok.convert_tokens_to_ids("<|endoftext|>")]
    rows = data.load_problems("gsm8k", "train", limit=args.prompts, data_dir=args.data_dir)
    return model, tok, [data.format_prompt(tok, r["prompt"]) for r in rows]


def tiny_world(args):
    from machinery.model import load_model
    model, tok = load_model("tiny", device="cpu", dtype="float32")
    rows = data.load_problems("tiny", "train", limit=16)
    return model, tok, [data.format_prompt(tok, r["prompt"]) for r in rows]


def measure(model, tok, prompts, G, N, rounds):
    """{engine: [(seconds, tokens, padding share)] per round}, and the rows (over all rounds) whose
    tokens agreed, of how many."""
    times, same, rows = {"loop": [], "hf": []}, 0, 0
    for r in range(rounds + 1):  # round 0 warms up
        order = ("loop", "hf") if r % 2 == 0 else ("hf", "loop")
        got = {}
        for engine in order:
            t0 = time.perf_counter()
            got[engine] = out = generate_groups(model, tok, prompts, G, N, seed=r, engine=engine)
            seconds = time.perf_counter() - t0
            tokens = int(out.completion_mask.sum())
            if r:
                times[engine].append((seconds, tokens, 1 - tokens / out.decoded))
        a, b = got["loop"], got["hf"]
        T = max(a.completion_ids.shape[1], b.completion_ids.shape[1])
        a, b = (torch.nn.functional.pad(x.completion_ids, (0, T - x.completion_ids.shape[1]))
                for x in (a, b))
        same, rows = same + int((a == b).all(dim=1).sum()), rows + len(a)
    return times, (same, rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--world", default="both", choices=("both", "real", "tiny"))
    p.add_argument("--tokenizer", default="Qwen/Qwen2.5-0.5B")
    p.add_argument("--data_dir", default=None, help="gsm8k/train.jsonl inside (default: the hub)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", default="off", help="the loop's step: off, or a torch.compile "
                                                    "backend (inductor, eager)")
    args = p.parse_args(argv)
    sampling.COMPILE = args.compile
    torch.set_num_threads(args.threads)
    worlds = ("real", "tiny") if args.world == "both" else (args.world,)
    print(f"torch threads {args.threads}, {args.rounds} rounds (medians), the loop's step compiled: "
          f"{args.compile}, torch {torch.__version__}")
    print("world | rows x tokens | engine | seconds | tokens/s | loop/hf | padding")
    for world in worlds:
        model, tok, prompts = real_world(args) if world == "real" else tiny_world(args)
        G, N = (args.group_size, args.max_new_tokens) if world == "real" else (8, 32)
        times, same = measure(model, tok, prompts, G, N, args.rounds)
        med = {e: [statistics.median(x[i] for x in v) for i in range(3)]
               for e, v in times.items()}
        for engine in ("loop", "hf"):
            s, n, pad = med[engine]
            print(f"{world} | {len(prompts) * G} x {N} | {engine} | {s:.2f} | {n / s:,.0f} | "
                  f"{med['loop'][0] / med['hf'][0]:.2f} | {pad:.3f}")
        print(f"{world}: rows with the same tokens from both engines: {same[0]} of {same[1]}")


if __name__ == "__main__":
    main()
