"""
GPU check: a few D3S steps of train.py on a Qwen2.5-0.5B-shaped model, at the README's real-run
defaults, to measure seconds per step (generate / update) and peak GPU memory.

There is no hub on the GPU machine either, so the model is Qwen2.5-0.5B's architecture built from
its config with random weights, and the tokenizer is the real Qwen2.5 one from a local folder. A
random model never writes a stop token: every completion runs to max_new_tokens, which makes this
the slowest case for generation (a trained model stops earlier). It never answers right either, so
the rewards are bench_speed.py's seeded coin flips: with the real grader every advantage would be 0
and train.py would skip every update, measuring nothing.

    python scripts/gpu_check.py --tokenizer Qwen/Qwen2.5-0.5B                  # with a hub
    python scripts/gpu_check.py --tokenizer TOKENIZER_FOLDER --data_dir DATA     # offline: local copies
    python scripts/gpu_check.py --dry_run --tokenizer ../shared/tokenizers/qwen2.5 --data_dir ../shared/data
                                                    # a 2-layer model and a small batch, on a CPU, in a minute
"""
import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_speed  # noqa: E402
import config  # noqa: E402
import train  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--tokenizer", default="Qwen/Qwen2.5-0.5B", help="a tokenizer folder or hub id (Qwen2.5's)")
parser.add_argument("--data_dir", default="", help="local copies laid out as NAME/SPLIT.jsonl ('': the hub)")
parser.add_argument("--out", default="out/gpu_check")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--dry_run", action="store_true",
                    help="a 2-layer, 64-wide model of the same vocabulary and a small batch: this script on a CPU")
args, rest = parser.parse_known_args()

# Qwen2.5-0.5B's config.json, as published (24 layers, 896 wide, GQA 14/2 heads, tied embeddings)
shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2)
if args.dry_run:
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
qwen_config = Qwen2Config(
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643, **shape,
)
folder = os.path.join(args.out, "qwen2.5-0.5b-random")
tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
torch.manual_seed(0)
model = Qwen2ForCausalLM(qwen_config)
model.generation_config.eos_token_id = [151645, 151643]  # <|im_end|>, <|endoftext|> as in the instruct models
model.generation_config.pad_token_id = 151643
model.save_pretrained(folder)
tokenizer.save_pretrained(folder)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, saved to {folder}", flush=True)
del model

if torch.cuda.is_available():
    torch.cuda.reset_peak_memory_stats()
train.score = bench_speed.coin_flip_score()  # see the docstring
small = ["--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "16", "--eval_size", "4"]
argv = ["--model", folder, "--data_dir", args.data_dir, "--steps", str(args.steps), "--eval_every", str(args.steps),
        "--eval_size", "64", "--save_every", "1000", "--out_dir", os.path.join(args.out, "run")]
cfg, given = config.parse_args(train.Config, argv + (small if args.dry_run else []) + rest)
t0 = time.time()
train.train(cfg, given=given)
wall = time.time() - t0
with open(os.path.join(args.out, "run", "log.jsonl")) as f:
    rows = [json.loads(line) for line in f]
summary = {
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)", "torch": torch.__version__,
    "config": json.load(open(os.path.join(args.out, "run", "config.json"))),
    "steps": [{k: r[k] for k in ("step", "kept", "rollouts", "tokens", "valid", "length", "t_gen", "t_upd")}
              for r in rows],
    "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None,
    "wall_seconds_with_evals_and_save": wall,
}
print(json.dumps(summary, indent=1))
with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
