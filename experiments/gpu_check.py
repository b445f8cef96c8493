"""
GPU check: a few D3S steps of train.py on a Qwen2.5-0.5B-shaped model, at the README's real-run
defaults, then one step with --loss gspo, to measure what only a GPU shows:
  - seconds per step (generate / update);
  - peak GPU memory, allocated and reserved: the reserved peak (what the caching allocator held) is
    what decides whether a card fits; the allocated peak is what the tensors needed;
  - each step's ratio over its first mini-batch (ratio_first, clip_first in log.jsonl: exactly 1 and
    0 by construction) and over all mini-batches (ratio_min, ratio_max, clip_frac): how far bf16
    autocast moves the ratio of mini-batches 2..K, against GRPO's clip of 0.2 and GSPO's 3e-4 /
    4e-4;
  - the KV cache's key and value dtypes in each cache mode (prefix, plain, static) under the run's
    autocast, and the seconds each mode takes (static includes its compilation on a GPU).

There is no hub on the GPU machine either, so the model is Qwen2.5-0.5B's architecture built from
its config with random weights, and the tokenizer is the real Qwen2.5 one from a local folder. A
random model never writes a stop token: every completion runs to max_new_tokens, which makes this
the slowest case for generation (a trained model stops earlier). It never answers right either, so
the rewards are bench_speed.py's seeded coin flips: with the real grader every advantage would be 0
and train.py would skip every update, measuring nothing.

    python experiments/gpu_check.py --tokenizer Qwen/Qwen2.5-0.5B                  # with a hub
    python experiments/gpu_check.py --tokenizer TOKENIZER_FOLDER --data_dir DATA  # offline copies
    # a 2-layer model and a small batch, on a CPU, in a minute
    python experiments/gpu_check.py --dry_run --tokenizer ../shared/tokenizers/qwen2.5 \
        --data_dir ../shared/data
Extra arguments go to train.py (e.g. --generation static --micro_batch_size 8).
"""
import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import bench_speed  # noqa: E402
from machinery import config  # noqa: E402
from machinery import model as models  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from machinery.data import format_prompt  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--tokenizer", default="Qwen/Qwen2.5-0.5B",
                    help="a tokenizer folder or hub id (Qwen2.5's)")
parser.add_argument("--data_dir", default="",
                    help="local copies laid out as NAME/SPLIT.jsonl ('': the hub)")
parser.add_argument("--out", default="out/gpu_check")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--dry_run", action="store_true",
                    help="a 2-layer, 64-wide model of the same vocabulary and a small batch: "
                         "this script on a CPU")
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
# <|im_end|>, <|endoftext|> as in the instruct models
model.generation_config.eos_token_id = [151645, 151643]
model.generation_config.pad_token_id = 151643
model.save_pretrained(folder)
tokenizer.save_pretrained(folder)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, saved to {folder}",
      flush=True)
del model

cuda = torch.cuda.is_available()


def peaks():
    """(allocated, reserved) peak GiB since the last reset, or (None, None) on a CPU."""
    if not cuda:
        return None, None
    return torch.cuda.max_memory_allocated() / 2 ** 30, torch.cuda.max_memory_reserved() / 2 ** 30


STEP_FIELDS = ("step", "kept", "rollouts", "tokens", "valid", "length", "t_gen", "t_upd", "updates",
               "zero_grad", "nonfinite", "grad_norm", "ratio_first", "clip_first", "ratio_min",
               "ratio_max", "clip_frac")


def run(name, extra):
    """train.train on the saved model with the check's arguments + extra; its log rows and peak
    memory."""
    out = os.path.join(args.out, name)
    argv = ["--model", folder, "--data_dir", args.data_dir, "--eval_size", "64",
            "--save_every", "1000", "--out_dir", out,
            "--overwrite", "true"] + extra  # the check's own folder: a rerun replaces it
    cfg, given = config.parse_args(train.Config, argv + (small if args.dry_run else []) + rest)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    train.train(cfg, given=given)
    wall = time.time() - t0
    allocated, reserved = peaks()
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"config": json.load(open(os.path.join(out, "config.json"))),
            "steps": [{k: r.get(k) for k in STEP_FIELDS} for r in rows],
            "peak_allocated_gib": allocated, "peak_reserved_gib": reserved,
            "wall_seconds_with_evals_and_save": wall}


def cache_dtypes(device):
    """The KV cache's (key dtypes, value dtypes) at the last decoder call of generate_groups in each
    cache mode, under the run's autocast (--dtype auto), and the seconds each took."""
    policy, tok = models.load_model(folder, device=device)
    records, report = [], {}

    def record(module, args_, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layers = [x for x in getattr(cache, "layers", []) if getattr(x, "keys", None) is not None]
        records.append(([str(x.keys.dtype) for x in layers[:1]],
                        [str(x.values.dtype) for x in layers[:1]]))
    handle = policy.get_decoder().register_forward_hook(record, with_kwargs=True)
    prompts = [format_prompt(tok, q) for q in ("What is 2 + 3?",
                                               "Tom has 7 apples and eats 2. How many are left?")]
    for mode in rollout.CACHES:
        records.clear()
        t0 = time.time()
        with models.autocast(device, "auto"):
            rollout.generate_groups(policy, tok, prompts, 2, 16, seed=0, cache=mode)
        if cuda:
            torch.cuda.synchronize()
        report[mode] = {"keys": records[-1][0], "values": records[-1][1],
                        "seconds": time.time() - t0}
    handle.remove()
    del policy
    return report


def report(summary, part):
    """Write summary.json as it stands and print `part`'s figures in a few lines: a check cut short
    by a time limit still leaves what it measured."""
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    r = summary[part]
    if part == "kv_cache":
        caches = {m: (v["keys"], v["values"], round(v["seconds"], 1)) for m, v in r.items()}
        print("kv cache (keys, values, seconds):", caches, flush=True)
        return
    print(f"{part}: peak GPU memory allocated {r['peak_allocated_gib']} GiB, reserved "
          f"{r['peak_reserved_gib']} GiB; {r['wall_seconds_with_evals_and_save']:.0f} s with "
          "evaluations", flush=True)
    for row in r["steps"]:
        print(f"  step {row['step']}: ratio first mini-batch {row['ratio_first']} clip "
              f"{row['clip_first']} | all mini-batches {row['ratio_min']}-{row['ratio_max']} clip "
              f"{row['clip_frac']} | gen {row['t_gen']:.1f}s upd {row['t_upd']:.1f}s", flush=True)


small = ["--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "16",
         "--eval_size", "4"]
train.score = bench_speed.coin_flip_score()  # see the docstring
device = "cuda" if cuda else "cpu"
summary = {
    "gpu": torch.cuda.get_device_name() if cuda else "none (CPU)", "torch": torch.__version__,
    "capability": list(torch.cuda.get_device_capability()) if cuda else None,
    "bf16_autocast": models.autocast_enabled(device, "auto"),  # --dtype auto on this device
    "allocator_settings": torch._C._accelerator_getAllocatorSettings(),  # expandable_segments
}
print({k: summary[k] for k in ("gpu", "capability", "bf16_autocast", "allocator_settings")},
      flush=True)
summary["d3s"] = run("run", ["--steps", str(args.steps), "--eval_every", str(args.steps)])
report(summary, "d3s")
# one GSPO step: its clip range (3e-4 / 4e-4) is where a ratio that drifts from 1 under bf16 clips
summary["gspo"] = run("run_gspo", ["--steps", "1", "--loss", "gspo", "--eval_size", "4"])
report(summary, "gspo")
summary["kv_cache"] = cache_dtypes(device)
report(summary, "kv_cache")
print(f"summary: {os.path.join(args.out, 'summary.json')}")
