"""
GPU check: train.py's real command on a card, to measure what only a GPU shows. The model is
Qwen2.5-0.5B's architecture built from its config with random weights and the real Qwen2.5
tokenizer (there is no hub on the GPU machine). A random model never writes a stop token, so every
completion runs to max_new_tokens (generation's slowest case, and the memory prediction's worst),
and never answers right, so the rewards are bench_speed.py's seeded coin flips (with the real
grader every advantage would be 0 and train.py would skip every update, measuring nothing). In
order of need, each part said in a few lines as it ends and written to OUT/summary.json:

  auto      `python train.py --model Qwen2.5-0.5B` (D3S, 32 x 8 rollouts, 512 new tokens, K = 4) on
            the whole card, its memory knobs `auto`: what Run.size chose, the predicted peak of each
            phase (machinery/memory.py) against the peak GPU memory allocated and reserved, seconds
            per step (generation / update), whether an out-of-memory retry was needed
  24 GiB,   the same on a card of that size, simulated by torch.cuda.set_per_process_memory_fraction
  16 GiB
  lora      LoRA (--lora_rank 16) on the largest Qwen2.5 the memory table says fits --lora_gib free
            (7B on 80), on a card of that size; where this train.py has the knob
  float16   --dtype float16 forced, a T4's path (float16 autocast, a gradient scaler); where this
            train.py has it
  methods   --method grpo, grpo-filter (where d3s.METHODS has it) and d3s (the auto part): seconds
            per step split into generation and update, generation's share, generated tokens per
            second, each step's ratio and clip share over its first mini-batch (ratio_first,
            clip_first: exactly 1 and 0 by construction) and over all (how far bf16 moves 2..K)
  generation  each --generation mode (prefix, plain, static) on the real batch at 128 new tokens:
            seconds (static after its compilation, which the first call pays) and tokens per
            second, and the KV cache's dtypes under the run's autocast

Only the auto part evaluates (64 held-out prompts, greedy); the others skip train.py's evaluation
to save time. Expected duration on one H200, by estimate from the shapes (no GPU run yet): about
6-7 minutes, LoRA on 7B (its random weights built and saved: 15 GB) the longest part; no part
starts after --budget seconds, so it ends inside a 10-minute limit.

    python experiments/gpu_check.py --tokenizer TOKENIZER_FOLDER --data_dir DATA
    # a 2-layer, 64-wide model of the same vocabulary and a small batch, on a CPU, in minutes
    python experiments/gpu_check.py --dry_run --tokenizer ../shared/tokenizers/qwen2.5 \\
        --data_dir ../shared/data
Extra arguments go to every train.py run (e.g. --generation static).
"""
import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import types

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import bench_speed  # noqa: E402
import d3s  # noqa: E402
from machinery import config, memory  # noqa: E402
from machinery import model as models  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from machinery.data import format_prompt, load_problems  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--tokenizer", default="Qwen/Qwen2.5-0.5B",
                    help="a tokenizer folder or hub id (Qwen2.5's)")
parser.add_argument("--data_dir", default="",
                    help="local copies laid out as NAME/SPLIT.jsonl ('': the hub)")
parser.add_argument("--out", default="out/gpu_check")
parser.add_argument("--steps", type=int, default=2, help="steps of the auto and method parts")
parser.add_argument("--budget", type=float, default=420,
                    help="seconds after which no part starts (each takes up to two minutes)")
parser.add_argument("--lora_gib", type=float, default=80, help="the card the LoRA part simulates")
parser.add_argument("--dry_run", action="store_true",
                    help="a 2-layer, 64-wide model of the same vocabulary and a small batch: "
                         "this script on a CPU")
args, rest = parser.parse_known_args()
cuda, started = torch.cuda.is_available(), time.time()
device = "cuda" if cuda else "cpu"
tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
SMALL = ["--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "16",
         "--eval_size", "4"]  # --dry_run


def build(name, folder, dtype=torch.float32):
    """Qwen2.5 `name`'s architecture (its published config.json; --dry_run: 2 layers, 64 wide),
    random weights in `dtype`, saved with the real tokenizer -> the folder."""
    s = memory.SHAPES[name]
    if args.dry_run:
        s = dict(s, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
    torch.manual_seed(0)
    with torch.device(device):  # 7B's weights are made in seconds on a GPU
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"], tie_word_embeddings=s["tied"],
            max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
            bos_token_id=151643, eos_token_id=151643)).to(dtype)
    model.generation_config.eos_token_id = [151645, 151643]  # <|im_end|>, <|endoftext|>
    model.generation_config.pad_token_id = 151643
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, random, "
          f"saved to {folder}", flush=True)
    del model
    gc.collect()
    return folder


def longest_prompt(eval_size):
    """Tokens of the longest GSM8K prompt a run meets (train and held-out), as Run.size counts."""
    rows = (load_problems("gsm8k", "train", data_dir=args.data_dir or None)
            + load_problems("gsm8k", "test", data_dir=args.data_dir or None)[:eval_size])
    prompts = [format_prompt(tokenizer, r["prompt"]) for r in rows]
    return max(map(len, tokenizer(prompts, add_special_tokens=False)["input_ids"]))


def gib(x):
    return None if x is None else round(x / memory.GiB, 2)


def run(name, folder, knobs, card=None, evaluate=False):
    """train.train on `folder` with the check's knobs (and card GiB simulated) -> what it chose,
    predicted and measured; {"skipped": why} when this train.py refuses a knob."""
    out, argv = os.path.join(args.out, name), ["--model", folder, "--data_dir", args.data_dir,
                                               "--save_every", "1000", "--eval_size", "64",
                                               "--overwrite", "true"] + knobs
    argv += ["--out_dir", out] + (SMALL if args.dry_run else []) + rest
    real_held_out, lines = train.held_out, []
    if not evaluate:
        train.held_out = lambda *a, **k: 0.0  # no evaluation: the time goes to the steps
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, card * memory.GiB / total)
                                                   if card else 1.0)
    try:
        cfg, given = config.parse_args(train.Config, argv)
        t0 = time.time()
        train.train(cfg, given=given, log=lambda line: (lines.append(line), print(line)))
        wall = time.time() - t0
    except (ValueError, config.Stop) as e:
        return {"skipped": f"{type(e).__name__}: {e}", "lines": lines}
    finally:
        train.held_out = real_held_out
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    with open(os.path.join(out, "log.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    changes = os.path.join(out, "resumes.jsonl")
    changes = [json.loads(x) for x in open(changes)] if os.path.exists(changes) else []
    with open(os.path.join(folder, "config.json")) as f:
        shape = memory.shape_of(json.load(f))
    job = memory.job_of(types.SimpleNamespace(**saved), longest)
    predicted = memory.predict(shape, {k: saved[k] for k in memory.KNOBS}, job)
    return {"settings": {k: saved[k] for k in memory.KNOBS + ("generation", "dtype")},
            "auto_line": next((x for x in lines if x.startswith("memory auto")), None),
            "predicted_gib": {k: gib(predicted[k]) for k in ("generate", "no_grad", "update",
                                                              "peak")},
            "peak_allocated_gib": gib(torch.cuda.max_memory_allocated()) if cuda else None,
            "peak_reserved_gib": gib(torch.cuda.max_memory_reserved()) if cuda else None,
            "card_gib": card, "out_of_memory_retries": [c["changed"] for c in changes
                                                        if c.get("why") == "out of memory"],
            "steps": [step_figures(r) for r in steps], "wall_seconds": wall}


def step_figures(r):
    """A step's seconds, generation's share and speed, and its ratios."""
    seconds = r["t_gen"] + r["t_upd"]
    return {"step": r["step"], "seconds": round(seconds, 2), "generation": round(r["t_gen"], 2),
            "update": round(r["t_upd"], 2), "generation_share": round(r["t_gen"] / seconds, 3),
            "generated_tokens_per_s": round(r["valid_all"] / r["t_gen"]), "kept": r["kept"],
            "rollouts": r["rollouts"], "tokens_trained": r["tokens"],
            "ratio_first": r["ratio_first"], "clip_first": r["clip_first"],
            "ratio_min": r["ratio_min"], "ratio_max": r["ratio_max"], "clip_frac": r["clip_frac"]}


def generation_modes():
    """Each --generation mode on the real batch (32 prompts x 8, 128 new tokens; --dry_run 2 x 4,
    16) twice under the run's autocast: the second call's seconds and tokens per second, and the KV
    cache's dtypes at its last decode step."""
    policy, tok = models.load_model(base, device=device)
    rows = load_problems("gsm8k", "train", limit=2 if args.dry_run else 32,
                         data_dir=args.data_dir or None)
    prompts, G, T = [format_prompt(tok, r["prompt"]) for r in rows], 4 if args.dry_run else 8, \
        16 if args.dry_run else 128
    seen, report = [], {}

    def record(module, args_, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layer = next((x for x in getattr(cache, "layers", []) if getattr(x, "keys", None)
                      is not None), None)
        seen.append([str(layer.keys.dtype), str(layer.values.dtype)] if layer else None)
    hook = policy.get_decoder().register_forward_hook(record, with_kwargs=True)
    for mode in ("loop", "hf"):
        seconds = []
        for call in range(2):  # the first pays warm-up (and static's compilation)
            t0 = time.time()
            with models.autocast(device, "auto"):
                got = rollout.generate_groups(policy, tok, prompts, G, T, seed=call, engine=mode)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.time() - t0)
        report[mode] = {"seconds": round(seconds[1], 2), "first_call_seconds": round(seconds[0], 2),
                        "generated_tokens_per_s": round(int(got.completion_mask.sum())
                                                        / seconds[1]),
                        "kv_keys_values": seen[-1]}
    hook.remove()
    del policy
    return report


def say(part, r):
    """A part's figures in a few lines."""
    if "skipped" in r:
        print(f"{part}: skipped ({r['skipped']})", flush=True)
        return
    if part == "generation":
        for mode, m in r.items():
            print(f"generation {mode}: {m['seconds']} s (first call {m['first_call_seconds']}), "
                  f"{m['generated_tokens_per_s']} tokens/s, KV cache {m['kv_keys_values']}",
                  flush=True)
        return
    print(f"{part}: {r['settings']} | predicted {r['predicted_gib']} GiB | peak allocated "
          f"{r['peak_allocated_gib']}, reserved {r['peak_reserved_gib']} GiB"
          + (f" of {r['card_gib']}" if r["card_gib"] else "")
          + f" | out-of-memory retries {r['out_of_memory_retries'] or 'none'}", flush=True)
    for s in r["steps"]:
        print(f"  step {s['step']}: {s['seconds']} s (generation {s['generation']}, update "
              f"{s['update']}; share {s['generation_share']}), {s['generated_tokens_per_s']} "
              f"generated tokens/s, kept {s['kept']}/{s['rollouts']} | ratio first mini-batch "
              f"{s['ratio_first']} clip {s['clip_first']} | all {s['ratio_min']}-"
              f"{s['ratio_max']} clip {s['clip_frac']}", flush=True)


def part(name, work):
    """Run a part unless the budget is spent; say it and write summary.json as it stands, so a
    check cut short still leaves what it measured."""
    if time.time() - started > args.budget:
        summary[name] = {"skipped": f"--budget {args.budget:g} s spent"}
    else:
        summary[name] = work()
    say(name, summary[name])
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


os.makedirs(args.out, exist_ok=True)
train.score = bench_speed.coin_flip_score()  # see the docstring
summary = {"gpu": torch.cuda.get_device_name() if cuda else "none (CPU)",
           "torch": torch.__version__,
           "capability": list(torch.cuda.get_device_capability()) if cuda else None,
           "bf16_autocast": models.autocast_enabled(device, "auto"),  # --dtype auto here
           "allocator_settings": torch._C._accelerator_getAllocatorSettings(),
           "free_gib": gib(memory.free_bytes(device)) if cuda else None}
print(summary, flush=True)
base = build("Qwen2.5-0.5B", os.path.join(args.out, "qwen2.5-0.5b-random"))
longest = longest_prompt(4 if args.dry_run else 64)
print(f"the longest GSM8K prompt: {longest} tokens", flush=True)
steps = ["--steps", str(args.steps)]
part("auto", lambda: run("auto", base, steps + ["--eval_every", str(args.steps)], evaluate=True))
for card in (24, 16):
    part(f"{card} GiB", lambda: run(f"gib{card}", base, ["--steps", "1"], card))


def lora():
    """The largest Qwen2.5 whose LoRA the memory table fits in --lora_gib, on that card."""
    if "lora_rank" not in {f.name for f in dataclasses.fields(train.Config)}:
        return {"skipped": "this train.py has no --lora_rank"}
    job = dataclasses.replace(memory.Job(prompt_len=longest), lora_rank=16, weight_bytes=2)
    name = max((n for n, s in memory.SHAPES.items()
                if memory.choose(s, job, args.lora_gib * memory.GiB)),
               key=lambda n: memory.param_count(memory.SHAPES[n]))
    folder = build(name, os.path.join(args.out, name.lower() + "-random"), torch.bfloat16)
    return {"model": name, **run("lora", folder, ["--steps", "1", "--lora_rank", "16"],
                                 args.lora_gib)}


part("lora", lora)
part("float16", lambda: run("float16", base, ["--steps", "1", "--dtype", "float16"]))
for method in ("grpo", "grpo-filter"):
    part(method, lambda: run(method, base, steps + ["--method", method])
         if method in d3s.METHODS else {"skipped": f"d3s.METHODS has no {method}"})
part("generation", generation_modes)
print(f"{time.time() - started:.0f} s; summary: {os.path.join(args.out, 'summary.json')}")
