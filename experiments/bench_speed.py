"""
How fast is one training step? train.py (grpo, d3s) and TRL's GRPOTrainer on exactly the same model,
prompts and settings, one after the other, in one run.

    python experiments/bench_speed.py                # speed.md's table (GSM8K, Qwen2.5 tokenizer)
    python experiments/bench_speed.py --data_dir DATA --tokenizer FOLDER      # offline copies
    python experiments/bench_speed.py --model tiny --dataset tiny --steps 3   # the tiny world
    python experiments/bench_speed.py --model Qwen/Qwen2.5-0.5B --device cuda # a real model, a GPU

--model smollm2-135m-random (the default) is SmolLM2-135M's shape (a Llama: 30 layers, hidden 576, 9
heads, 3 KV heads, MLP 1536, tied embeddings) with random weights and the vocabulary of --tokenizer,
saved once to OUT/model so that every configuration loads the same weights from disk. Any other
--model is a folder, "tiny" or a hub id, as in train.py. The settings are one step of the same
batch for everyone: --prompts_per_step GSM8K prompts (data.format_prompt) x --group_size rollouts,
--max_new_tokens, temperature 1, learning rate 1e-6, --steps steps; seconds per step are the median
over steps 2.. (the first warms up allocators and caches).

Every configuration trains on the same seeded coin-flip rewards (coin_flips): a model with random
weights never answers right, and a step with nothing to learn skips its update in train.py.

Each configuration runs in its own process, so that its peak memory is its own (RSS on a CPU,
torch.cuda.max_memory_allocated on a GPU) and nothing is shared or cached between them:
  train.py grpo, train.py d3s  train.train() at the real-model defaults (--generation loop),
                               but one update per step (--updates_per_batch 1, TRL's default),
                               timed from log.jsonl: t_gen, t_fb (every forward and backward pass,
                               the no-grad one included) and t_upd (everything after generation)
  train.py grpo (hf generate)  the same with --generation hf (transformers' generate): what the
                               decode loop saves
  TRL GRPOTrainer              trl's GRPOTrainer, per_device_train_batch_size = P x G,
                               num_generations G, the same prompts and rewards, loss_type dapo,
                               beta 0, no gradient checkpointing; timed by wrapping model.generate,
                               _prepare_inputs and training_step, and a callback around each
                               optimizer step
Columns: gen (generation), fwd+bwd (forward and backward passes), rest (rewards, selection, the
optimizer step, logging), total, total as a ratio to TRL's, update (everything after generation) as
a ratio to train.py grpo's, peak memory. Writes OUT/speed.json and OUT/speed.md.
"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
CONFIGS = ("train.py grpo", "train.py d3s", "train.py grpo (hf generate)", "TRL GRPOTrainer")

# -----------------------------------------------------------------------------
# the model and the prompts every configuration shares


def build_model(args):
    """The folder every configuration loads: --model itself, or SmolLM2-135M's shape, random, built
    once."""
    if args.model != "smollm2-135m-random":
        return args.model
    folder = os.path.join(args.out, "model")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    # SmolLM2-135M's config.json, with this tokenizer's vocabulary and special tokens
    config = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, initializer_range=0.041666666666666664,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def resolved_device(device):
    """--device as the run names it: "cpu", or a CUDA device with its index ("cuda:0")."""
    from machinery.model import resolve_device
    return str(resolve_device(device))


def median_after_first(xs):
    return statistics.median(xs[1:]) if len(xs) > 1 else xs[0]


def peak_memory(device):
    """GiB: the peak GPU memory allocated on a CUDA device, else the process's peak RSS."""
    from machinery.model import resolve_device
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: kilobytes

# -----------------------------------------------------------------------------
# one configuration, in its own process


def coin_flips(n, call):
    """[ours] The rewards every configuration trains on: n seeded coin flips (0/1) for its call-th
    batch. A model with random weights never answers right, so with the real grader every reward
    would be 0, every advantage 0, and train.py would skip each update as having nothing to learn
    (TRL would run it on zeros): the speed of a step with informative groups is what is measured,
    whatever the model knows."""
    rng = random.Random(call)
    return [float(rng.random() < 0.5) for _ in range(n)]


def coin_flip_score():
    """A stand-in for reward.score (its signature and stats) that gives coin_flips, batch after
    batch."""
    calls = []

    def score(texts, references, truncated=None):
        calls.append(1)
        return coin_flips(len(texts), len(calls)), {"n": len(texts), "correct": 0, "no_answer": 0,
                                                    "hedge": 0, "timeout": 0, "error": 0,
                                                    "accuracy": 0.0}
    return score


def run_train(args, folder, method, generation):
    import train
    train.score = coin_flip_score()
    knobs = dict(model=folder, dataset=args.dataset, data_dir=args.data_dir or "", method=method,
                 steps=args.steps, prompts_per_step=args.prompts_per_step,
                 group_size=args.group_size, max_new_tokens=args.max_new_tokens, lr=1e-6,
                 updates_per_batch=1, eval_size=1, eval_every=0, save_every=0,
                 generation=generation, device=args.device,
                 out_dir=os.path.join(args.out, "runs", f"{method}-{generation}"),
                 overwrite=True)  # the benchmark's own folder: a second one replaces its runs
    # the knobs set here are the run's (K = 1: one update per step, TRL's default); the rest are
    # train.py's values for the model (a real model: its `real` micro-batch of 16)
    train.train(train.Config(**knobs), log=lambda *a: None, given=knobs)
    with open(os.path.join(knobs["out_dir"], "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"gen": [r["t_gen"] for r in rows], "fb": [r["t_fb"] for r in rows],
            "upd": [r["t_upd"] for r in rows], "rho_s": [r["rho_s"] for r in rows]}


def run_trl(args, folder):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from machinery.data import format_prompt, load_problems
    from machinery.model import load_model
    from rollout import stop_token_ids
    device = resolved_device(args.device)
    model, tok = load_model(folder, device="cpu", dtype="float32")
    model.generation_config.eos_token_id = stop_token_ids(model, tok)  # the stop tokens of train.py
    import train  # the same prompts as train.py's first steps
    rows = [row for step in range(args.steps)
            for row in train.batch_at(load_problems(args.dataset, "train", data_dir=args.data_dir),
                                      step, args.prompts_per_step, 0)]
    dataset = Dataset.from_list([{"prompt": format_prompt(tok, r["prompt"]),
                                  "answer": str(r["answer"])} for r in rows])

    calls = []

    def correctness(completions, answer, **kw):  # the same coin flips as train.py's runs
        calls.append(1)
        return coin_flips(len(completions), len(calls))

    times = {"gen": [], "prepare": [], "train_step": [], "step": []}

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            times[key][-1] += time.perf_counter() - t0
            return out
        return wrapper

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            for key in times:
                times[key].append(0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step"][-1] = time.perf_counter() - self.t0

    config = GRPOConfig(output_dir=os.path.join(args.out, "runs", "trl"),
                        per_device_train_batch_size=args.prompts_per_step * args.group_size,
                        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
                        learning_rate=1e-6, lr_scheduler_type="constant", max_steps=args.steps,
                        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo",
                        gradient_checkpointing=False, use_cpu=device == "cpu", bf16=device != "cpu",
                        logging_steps=1, report_to=[], save_strategy="no", shuffle_dataset=False,
                        seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepTimer()])
    trainer.model.generate = timed(trainer.model.generate, "gen")
    trainer._prepare_inputs = timed(trainer._prepare_inputs, "prepare")
    trainer.training_step = timed(trainer.training_step, "train_step")
    trainer.train()
    return {"gen": times["gen"],
            "fb": [t - p for t, p in zip(times["train_step"], times["prepare"])],
            "upd": [s - g for s, g in zip(times["step"], times["gen"])],
            "rho_s": [1.0] * len(times["step"])}


def worker(args):
    folder = build_model(args)
    name = args.worker
    t0 = time.time()
    if name == "TRL GRPOTrainer":
        res = run_trl(args, folder)
    else:
        method = name.split()[1]
        res = run_train(args, folder, method, "hf" if "hf generate" in name else "loop")
    device = resolved_device(args.device)
    res.update(config=name, peak_gb=peak_memory(device), wall=time.time() - t0, device=device,
               threads=torch.get_num_threads())
    with open(args.result, "w") as f:
        json.dump(res, f)

# -----------------------------------------------------------------------------
# the table


def summarize(results):
    """One row per configuration: medians over steps 2.., and the ratios. -> list of dicts."""
    rows = []
    for r in results:
        gen, fb, upd = (median_after_first(r[k]) for k in ("gen", "fb", "upd"))
        rows.append({"config": r["config"], "gen": gen, "fb": fb, "rest": upd - fb, "upd": upd,
                     "total": gen + upd, "rho_s": statistics.mean(r["rho_s"][1:] or r["rho_s"]),
                     "peak_gb": r["peak_gb"]})
    trl = next((r for r in rows if r["config"] == "TRL GRPOTrainer"), None)
    grpo = next((r for r in rows if r["config"] == "train.py grpo"), None)
    for r in rows:
        r["vs_trl"] = r["total"] / trl["total"] if trl else None
        r["upd_vs_grpo"] = r["upd"] / grpo["upd"] if grpo else None
    return rows


def format_table(rows, memory):
    def ratio(x):
        return "-" if x is None else f"{x:.2f}"
    lines = ["| configuration | gen s | fwd+bwd s | rest s | total s/step | vs TRL "
             f"| update vs grpo | mean rho_s | peak {memory} GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['gen']:.2f} | {r['fb']:.2f} | {r['rest']:.2f} "
                     f"| {r['total']:.2f} | {ratio(r['vs_trl'])} | {ratio(r['upd_vs_grpo'])} "
                     f"| {r['rho_s']:.2f} | {r['peak_gb']:.2f} |")
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-random",
                   help="smollm2-135m-random, tiny, a folder or a hub id")
    p.add_argument("--tokenizer", default="Qwen/Qwen2.5-0.5B",
                   help="for smollm2-135m-random: a tokenizer folder or hub id")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--data_dir", default=None,
                   help="local copies laid out as NAME/SPLIT.jsonl (gsm8k/train.jsonl)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated, from: " + ", ".join(CONFIGS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts_per_step", type=int, default=2)
    p.add_argument("--group_size", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=os.path.join("out", "speed"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one configuration
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or args.steps < 2:
        what = f"unknown --configs {unknown[0]!r}" if unknown else "--steps must be at least 2"
        print(f"error: {what}; configurations: {', '.join(CONFIGS)}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    build_model(args)  # once, here, so that every worker loads the same weights
    results = []
    for i, name in enumerate(configs):
        result = os.path.join(args.out, f"result-{i}.json")
        print(f"{name} ...", flush=True)
        worker_argv = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name,
                       "--result", result]
        out = subprocess.run(worker_argv, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"error: {name} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            sys.exit(1)
        with open(result) as f:
            results.append(json.load(f))
    rows = summarize(results)
    memory = "GPU" if results[0]["device"].startswith("cuda") else "RSS"
    table = format_table(rows, memory)
    command = "python experiments/bench_speed.py " + " ".join(argv)
    print(table)
    print(f"{command.strip()} | {results[0]['device']}, {results[0]['threads']} torch threads | "
          f"median s/step over steps 2..{args.steps}")
    with open(os.path.join(args.out, "speed.md"), "w") as f:
        f.write(f"`{command.strip()}`\n\n{table}\n")
    with open(os.path.join(args.out, "speed.json"), "w") as f:
        json.dump({"command": command.strip(), "table": rows, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
