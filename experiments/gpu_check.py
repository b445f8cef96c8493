"""
GPU check: train.py's own command on one GPU, to measure what only a GPU shows, in one process that
ends inside 8 minutes on one H200 (by estimate). The model is Qwen2.5-0.5B's architecture (its
published shape) with random weights and the real Qwen2.5 tokenizer (the GPU machine has no hub),
the prompts GSM8K's. A random model never writes a stop token, so every rollout runs to
max_new_tokens (generation's slowest case, the memory prediction's worst), and never answers
right, so the rewards are bench_speed.py's seeded coin flips (with the real grader every advantage
would be 0 and train.py would skip every update). Each run is train.train in this process, 4
steps, no checkpoint, the held-out evaluation off (train.held_out gives 0) but in the loop's run,
which evaluates 300 held-out prompts (greedy; calls of 256 and 44 rows, the second filling the
kept cache's rows) at steps 0 and 2 and at its end, so that what evaluations cost the decode step
is counted: graphs compiled, CUDA graphs recorded (a re-record when a cache moved), runs without
CUDA graphs, caches built (train.py's log row: sampling.counters). Before a run the compiler, the
decode loop's kept caches and its counts are reset, as in a new process. The first step of a run
is reported apart as warm-up (CUDA's, and the decode step's compiles and recordings, its
evaluation's included); the other three are its steady steps.

The parts, most needed first. Each part's seconds on one H200 are an ESTIMATE, not a measurement:
from the last GPU run (experiments/speed.md: HF generate ~11k tokens/s at 256 rows x 512 tokens,
the first step ~25 s of warm-up, a GRPO update ~6.6 s at micro-batch 16) and the decode loop's
target (~80k tokens/s, its compile perhaps 30-60 s in a run's first step); a part counts only the
runs the parts before it have not done, and building a random model.

  part         what it runs and measures                                              est. s
  loop         `python train.py --model Qwen2.5-0.5B`, --generation loop (compiled       115
               with CUDA graphs), evaluating at steps 0 and 2: generated tokens/s
               (target >= 80,000 at 256 x 512), compiles and CUDA-graph recordings per
               step (target: none after the first, evaluations included), seconds per
               step split into generation and update, generation's share, pad_share, the
               evaluations' seconds, peak memory against machinery/memory.py's
               prediction, auto's choice, any OOM retry
  hf           the same with --generation hf: the loop's over hf's generation seconds    100
  grpo         --method grpo --micro_batch_size 16: steady step seconds (target <= 9)     55
  compare      D3S at fixed ratios 0.25/0.2 and 0.75/0.6, micro-batch 16, against        95
               grpo's: update seconds, tokens forwarded and trained
  gib24        the loop's command on a 24 GiB card (set_per_process_memory_fraction):     70
               it fits, auto's choice, peak against prediction, generation speed
  gib16        the same on 16 GiB (micro-batch 2, generation all at once)                80
  lora         --lora_rank 16 on Qwen2.5-1.5B's shape (random, bf16), 24 GiB             170
  float16      --dtype float16 (a T4's path): it fits, the first ratio of every step 1    80
  update_cost  the update's FLOPs by count against the card's bf16 peak (grpo and         55
               compare's runs), and grpo again with TF32 matmuls for the float32 LM
               head: update seconds, and whether each step's first ratio stays 1

All parts: about 820 s. No part starts unless its estimate fits in what is left of --budget
(400 s by default): by estimate the first four parts take 365 s and no later one fits after
them, so the later ones run only where the first come in under their estimates, or in another
run with --parts. OUT/summary.json is rewritten after every run and part (the part running says so),
OUT/gpu_check.log holds all that is printed; an error is shown with its type, message and the
traceback's last lines, and the parts after it go on.

    python experiments/gpu_check.py --tokenizer TOKENIZER_FOLDER --data_dir DATA --out OUT
    python experiments/gpu_check.py --dry_run --tokenizer ../shared/tokenizers/qwen2.5 \\
        --data_dir ../shared/data      # a 2-layer, 64-wide model, a small batch: on a CPU
    experiments/device_run.sh          # the command a GPU machine runs
Arguments it does not know go to every train.py run (e.g. --max_new_tokens 256).
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager

import torch
import transformers
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from experiments.bench_speed import coin_flip_score  # noqa: E402
from machinery import config, memory, sampling  # noqa: E402
from machinery.data import format_prompt, load_problems  # noqa: E402
from machinery.model import resolve_device  # noqa: E402
from machinery.run import Run  # noqa: E402
import train  # noqa: E402

GiB = memory.GiB
# label: (model, train.py's flags beyond the check's, card GiB simulated (None: all of it), TF32
# matmuls, estimated seconds on one H200); {mb}: --micro_batch_size, given
GRPO = ["--method", "grpo", "--micro_batch_size", "{mb}"]


def fixed(rho_s, rho_t):
    """D3S at fixed keep ratios (its schedule's two ends the same), the micro-batch given."""
    return ["--s_init", rho_s, "--s_final", rho_s, "--t_init", rho_t, "--t_final", rho_t,
            "--micro_batch_size", "{mb}"]


EVALUATED = ["--eval_every", "2", "--eval_size", "300"]  # the loop's run evaluates (train.held_out)
RUNS = {
    "d3s": ("Qwen2.5-0.5B", EVALUATED, None, False, 100),
    "d3s-hf": ("Qwen2.5-0.5B", ["--generation", "hf"], None, False, 100),
    "grpo": ("Qwen2.5-0.5B", GRPO, None, False, 55),
    "d3s-0.25": ("Qwen2.5-0.5B", fixed("0.25", "0.2"), None, False, 40),
    "d3s-0.75": ("Qwen2.5-0.5B", fixed("0.75", "0.6"), None, False, 55),
    "gib24": ("Qwen2.5-0.5B", [], 24, False, 70),
    "gib16": ("Qwen2.5-0.5B", [], 16, False, 80),
    "lora": ("Qwen2.5-1.5B", ["--lora_rank", "16"], 24, False, 150),
    "float16": ("Qwen2.5-0.5B", ["--dtype", "float16"], None, False, 80),
    "grpo-tf32": ("Qwen2.5-0.5B", GRPO, None, True, 55),
}
BUILD = {"Qwen2.5-0.5B": 15, "Qwen2.5-1.5B": 20}  # seconds to build and save it (estimated)
SMALL = ["--prompts_per_step", "2", "--group_size", "4", "--max_new_tokens", "16",
         "--eval_size", "4"]  # --dry_run
# Dense bf16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets (half the sparse figure); the
# first name contained in the device's wins. NVL cards: not listed (another clock), "unknown card".
BF16_PEAK = [("NVL", None), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12),
             ("A100", 312e12)]
TARGETS = {"generated_tokens_per_s": 80_000, "grpo_step_s": 9.0}
STEADY = ("seconds", "generation_s", "update_s", "fwd_bwd_s", "generation_share",
          "generated_tokens_per_s", "pad_share", "kept", "fwd_bwd_tokens", "tokens_trained")
DECODE = ("compiles", "cudagraph_records", "cudagraph_skips", "caches")  # sampling.counters()

# -----------------------------------------------------------------------------
# the card: every torch.cuda call of this check (tests/test_cuda.py runs each under a strict fake)


def card(device):
    """The GPU as torch sees it: name, compute capability, memory, its dense bf16 peak."""
    device = resolve_device(device)
    name = torch.cuda.get_device_name(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = bf16_peak(name)
    return {"name": name, "capability": list(torch.cuda.get_device_capability(device)),
            "total_gib": gib(total), "free_gib": gib(free),
            "bf16_peak_tflops": peak / 1e12 if peak else "unknown card"}


def bf16_peak(name):
    """The card's dense bf16 FLOP/s by its name (BF16_PEAK), or None."""
    return next((peak for key, peak in BF16_PEAK if key in name), None)


def simulate_card(device, card_gib=None):
    """Let this process use at most card_gib GiB of the device, as on a card of that size (None:
    all of it): what memory.free_bytes, and so `auto`, then sees."""
    device = resolve_device(device)
    total = torch.cuda.mem_get_info(device)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, card_gib * GiB / total) if card_gib
                                               else 1.0, device)


def empty(device):
    """The cache's free blocks back to the device, and the peaks counted from now."""
    device = resolve_device(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def peaks(device):
    """The peak bytes allocated by tensors and reserved by the caching allocator since empty()."""
    device = resolve_device(device)
    return {"allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.max_memory_reserved(device)}


def gib(x):
    return None if x is None else round(x / GiB, 2)

# -----------------------------------------------------------------------------
# one train.py run, watched


class Watch:
    """What one train.train run does, through the names train.py calls, patched for the run and put
    back after (watched): the Run (at begin: auto's choice and the memory prediction; at each
    end_step: the step's row, whose decode counts it takes apart step by step; no checkpoint: a
    check keeps no weights), the rewards (coin flips), the held-out evaluation (off, or timed),
    and the tokens the update forwards with and without a gradient (completion_hidden) and the
    LM head's positions (head_logprobs)."""
    longest = {}  # the data's longest prompt, by (dataset, data_dir, rows): Run.size's count

    def __init__(self):
        self.rows, self.counts, self.begun, self.evaluations = [], [], None, []
        self.pending, self.mark = {}, decode_counts(sampling.counters())

    def begin(self, run, model, tokenizer, train_set, eval_set):
        cfg = run.cfg
        key = (cfg.dataset, cfg.data_dir, len(train_set), len(eval_set))
        if key not in Watch.longest:
            prompts = [format_prompt(tokenizer, r["prompt"]) for r in train_set + eval_set]
            Watch.longest[key] = max(map(len, tokenizer(prompts, add_special_tokens=False)
                                         ["input_ids"]))
        settings = {k: getattr(cfg, k) for k in memory.KNOBS}
        predicted = memory.predict(memory.shape_of(model.config), settings,
                                   memory.job_of(cfg, Watch.longest[key]))
        self.begun = {"settings": {**settings, **{k: getattr(cfg, k) for k in (
                          "method", "generation", "dtype", "lora_rank", "prompts_per_step",
                          "group_size", "max_new_tokens", "updates_per_batch")}},
                      "auto": run.sized[1] if run.sized else None,
                      "longest_prompt": Watch.longest[key],
                      "predicted_gib": {k: gib(predicted[k]) for k in ("generate", "no_grad",
                                                                        "update", "peak")}}
        self.mark = decode_counts(sampling.counters())

    def count(self, key, n):
        """n (a tensor on the device) under key, with or without a gradient; read once a step, at
        its end_step, so that counting adds no wait for the device."""
        key += "_grad" if torch.is_grad_enabled() else "_no_grad"
        self.pending.setdefault(key, []).append(n)

    def decoder(self, completion_hidden):
        """completion_hidden, counting the tokens the decoder runs on."""
        def call(model, input_ids, attention_mask, completion_start):
            self.count("decoder", attention_mask.sum())
            return completion_hidden(model, input_ids, attention_mask, completion_start)
        return call

    def head(self, head_logprobs):
        """head_logprobs, counting the positions the LM head runs on."""
        def call(model, hidden, targets, positions=None, *args, **kwargs):
            self.count("head", positions.sum() if positions is not None
                       else torch.tensor(targets.numel()))
            return head_logprobs(model, hidden, targets, positions, *args, **kwargs)
        return call

    def evaluation(self, held_out):
        """train.held_out, timed (seconds a held-out evaluation took)."""
        def call(*args, **kwargs):
            t0 = time.time()
            accuracy = held_out(*args, **kwargs)
            self.evaluations.append(round(time.time() - t0, 2))
            return accuracy
        return call

    def end_step(self, row):
        now = decode_counts(row)
        counts = {k: int(sum(x.item() for x in v)) for k, v in self.pending.items()}
        self.counts.append({**{k: None if now[k] is None else now[k] - self.mark[k]
                               for k in DECODE}, **counts})
        self.rows.append(row)
        self.pending, self.mark = {}, now


def decode_counts(row):
    """The decode step's counts so far (sampling.counters), from them or a log row."""
    return {k: row["decode_" + k] for k in DECODE}


@contextmanager
def watched(watch, evaluate=False):
    """train.py's names patched for one run (Watch), put back after, even after an error;
    evaluate: the held-out evaluation runs, timed."""
    class Watched(Run):
        def begin(self, model, tokenizer, optimizer, train_set, eval_set):
            super().begin(model, tokenizer, optimizer, train_set, eval_set)
            watch.begin(self, model, tokenizer, train_set, eval_set)

        def save(self, step):
            pass  # a check keeps no checkpoint (seconds, and gigabytes, per run)

        def end_step(self, row, selection):
            watch.end_step(row)
            super().end_step(row, selection)
    names = {"Run": Watched, "score": coin_flip_score(),
             "held_out": watch.evaluation(train.held_out) if evaluate else lambda *a, **k: 0.0,
             "completion_hidden": watch.decoder(train.completion_hidden),
             "head_logprobs": watch.head(train.head_logprobs)}
    saved = {k: getattr(train, k) for k in names}
    try:
        for k, v in names.items():
            setattr(train, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(train, k, v)


@contextmanager
def tf32(on):
    """TF32 matmuls allowed for float32 (the LM head of head_logprobs) while on, else as they
    were."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = before or on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def train_run(check, label):
    """`python train.py` for RUNS[label] in this process, watched -> its record: the command,
    auto's choice, the prediction and the peaks, each step's figures (the first apart), or its
    error."""
    name, knobs, card_gib, tf32_on, _ = RUNS[label]
    out = os.path.join(check.out, label)
    argv = (["--model", check.model(name), "--data_dir", check.data_dir, "--device",
             str(check.device), "--steps", str(check.steps), "--eval_every", "0", "--save_every",
             "0", "--out_dir", out, "--overwrite", "true"]
            + [k.format(mb=check.micro_batch_size) for k in knobs]
            + (SMALL if check.dry_run else []) + check.rest)
    record = {"command": "python train.py " + " ".join(argv), "card_gib": card_gib,
              "simulated": card_gib is not None and check.cuda, "tf32": tf32_on}
    watch, lines, t0 = Watch(), [], time.time()
    # a new process's state: the decode step compiles again (inductor's cache on disk helps), or
    # tries to where it failed before (each run says whether it did); its kept KV cache is gone
    sampling.reset()
    gc.collect()
    if check.cuda:
        empty(check.device)
        simulate_card(check.device, card_gib)
    try:
        cfg, given = config.parse_args(train.Config, argv)
        with watched(watch, evaluate=EVALUATED[0] in knobs), tf32(tf32_on):
            train.train(cfg, given=given, log=lambda line: (lines.append(line), print(line)))
        record["status"] = "done"
    except Exception as e:  # shown and recorded, never taken for a skip; the next run goes on
        record.update(status="error", error=error_record(e), last_lines=lines[-5:])
    record["wall_s"] = round(time.time() - t0, 1)
    record.update(watch.begun or {})
    # machinery.sampling.COMPILE: "auto" compiles the decode step on a GPU; after a failure to
    # compile, the run decodes eagerly
    record["compile"] = {"mode": sampling.COMPILE,
                         "failed": [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                                    for e in sampling.compile_failures()]}
    resumes = os.path.join(out, "resumes.jsonl")
    changes = [json.loads(x) for x in open(resumes)] if os.path.exists(resumes) else []
    record["out_of_memory_retries"] = [c["changed"] for c in changes
                                       if c.get("why") == "out of memory"]
    if check.cuda:  # after a device's error these fail too; the run's own error is the one kept
        try:
            simulate_card(check.device, None)
            p = peaks(check.device)
            record["peak_gib"] = {k: gib(v) for k, v in p.items()}
            if watch.begun:
                record["reserved_over_predicted"] = round(
                    p["reserved"] / (watch.begun["predicted_gib"]["peak"] * GiB), 3)
        except Exception as e:
            record.setdefault("error", error_record(e))
            record["status"] = "error"
    steps = [step_figures(r, c) for r, c in zip(watch.rows, watch.counts)]
    record["warm_up"], record["steady"] = (steps[0] if steps else None), steps[1:]
    record["steady_median"] = {k: median([s[k] for s in steps[1:]]) for k in STEADY}
    record["evaluation_s"] = watch.evaluations
    return record


def step_figures(row, counts):
    """A step's figures from its log.jsonl row and what the Watch counted."""
    gen, upd = row["t_gen"], row["t_upd"]
    return {"step": row["step"], "seconds": round(gen + upd, 3), "generation_s": round(gen, 3),
            "update_s": round(upd, 3), "fwd_bwd_s": round(row["t_fb"], 3),
            "generation_share": round(gen / (gen + upd), 3),
            "generated_tokens": row["valid_all"],
            "generated_tokens_per_s": round(row["valid_all"] / gen),
            "pad_share": row["pad_share"], "truncated": row["truncated"],
            "rho_s": round(row["rho_s"], 4), "rho_t": round(row["rho_t"], 4),
            "kept": row["kept"], "rollouts": row["rollouts"],
            "fwd_bwd_tokens": row["fwd_bwd_tokens"], "tokens_trained": row["tokens"],
            "decoder_tokens_grad": counts.get("decoder_grad", 0),
            "decoder_tokens_no_grad": counts.get("decoder_no_grad", 0),
            "head_positions_grad": counts.get("head_grad", 0),
            "head_positions_no_grad": counts.get("head_no_grad", 0),
            **{k: counts[k] for k in DECODE}, "updates": row["updates"],
            "ratio_first": row["ratio_first"], "ratio_min": row["ratio_min"],
            "ratio_max": row["ratio_max"], "clip_frac": row["clip_frac"]}


def sig(x, digits=3):
    return float(f"{x:.{digits}g}")


def median(xs):
    """The median of the numbers in xs (None: not measured), to 4 significant figures."""
    xs = [x for x in xs if x is not None]
    return sig(statistics.median(xs), 4) if xs else None


def error_record(e):
    """An exception as the summary keeps it: type, message, the traceback's last lines."""
    return {"type": type(e).__name__, "message": str(e)[:2000],
            "traceback": traceback.format_exception(e)[-6:]}


def build(name, folder, tokenizer, device, dry_run):
    """Qwen2.5 `name`'s architecture (memory.SHAPES, its published config.json; dry run: 2 layers,
    64 wide) with random weights, made on the device (1.5B's in seconds on a GPU), float32 (1.5B:
    bf16, the dtype a LoRA base is held in), saved with the tokenizer -> the folder."""
    s = memory.SHAPES[name]
    if dry_run:
        s = dict(s, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
    dtype = torch.bfloat16 if name != "Qwen2.5-0.5B" and device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"], tie_word_embeddings=s["tied"],
            max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
            bos_token_id=151643, eos_token_id=151643)).to(dtype)
    model.generation_config.eos_token_id = [151645, 151643]  # <|im_end|>, <|endoftext|>
    model.generation_config.pad_token_id = 151643
    transformers.utils.logging.disable_progress_bar()  # its bar of one shard: noise in the log
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, random, "
          f"{dtype}, saved to {folder}", flush=True)
    return folder

# -----------------------------------------------------------------------------
# the parts: what each concludes from its runs


def headline(r):
    """A run's figures every part reports: steady medians, the warm-up step, compiles, memory."""
    s, w = r["steady_median"], r["warm_up"] or {}
    return {"run": r["command"], "step_s": s["seconds"], "generation_s": s["generation_s"],
            "update_s": s["update_s"], "generation_share": s["generation_share"],
            "generated_tokens_per_s": s["generated_tokens_per_s"], "pad_share": s["pad_share"],
            "steady_steps": len(r["steady"]), "warm_up_step_s": w.get("seconds"),
            "warm_up_generation_s": w.get("generation_s"),
            "compiles_first_step": w.get("compiles"),
            "recompiles_after_first_step": after(r, "compiles"),
            "cudagraph_records_first_step": w.get("cudagraph_records"),
            "rerecords_after_first_step": after(r, "cudagraph_records"),
            "caches_built_after_first_step": after(r, "caches"),
            "cudagraph_skips": after(r, "cudagraph_skips", first=True),
            "evaluation_s": r.get("evaluation_s"),
            "compile": r["compile"], "auto": r.get("auto"), "settings": r.get("settings"),
            "predicted_gib": r.get("predicted_gib"), "peak_gib": r.get("peak_gib"),
            "reserved_over_predicted": r.get("reserved_over_predicted"),
            "out_of_memory_retries": r["out_of_memory_retries"],
            "fits": not r["out_of_memory_retries"]}


def after(r, key, first=False):
    """A decode count summed over a run's steady steps (and its first), None where not counted."""
    counts = [s[key] for s in ([r["warm_up"]] if first and r["warm_up"] else []) + r["steady"]]
    return None if None in counts else sum(counts)


def part_loop(check):
    r = check.runs["d3s"]
    h = headline(r)
    rerecords = h["rerecords_after_first_step"]
    return {**h, "targets": {
        "generated_tokens_per_s >= 80000": check.met(h["generated_tokens_per_s"]
                                                     >= TARGETS["generated_tokens_per_s"]),
        "no recompile after the first step": check.met(h["recompiles_after_first_step"] == 0),
        "no CUDA-graph re-record after the first step": None if rerecords is None or not
        check.cuda else check.met(rerecords == 0)}}


def part_hf(check):
    loop, hf = (check.runs[k]["steady_median"]["generation_s"] for k in ("d3s", "d3s-hf"))
    return {**headline(check.runs["d3s-hf"]), "loop_generation_s": loop,
            "loop_over_hf_generation_s": round(loop / hf, 3)}


def part_grpo(check):
    h = headline(check.runs["grpo"])
    return {**h, "targets": {"step_s <= 9": check.met(h["step_s"] <= TARGETS["grpo_step_s"])}}


def part_compare(check):
    """GRPO's update and D3S's at fixed ratios, one micro-batch given, in one process."""
    rows = {}
    for label, key in (("grpo", "grpo"), ("d3s 0.25/0.2", "d3s-0.25"),
                       ("d3s 0.75/0.6", "d3s-0.75")):
        s = check.runs[key]["steady_median"]
        rows[label] = {k: s[k] for k in ("update_s", "fwd_bwd_s", "kept", "fwd_bwd_tokens",
                                         "tokens_trained")}
    base = rows["grpo"]["update_s"]
    for row in rows.values():
        row["update_over_grpo"] = round(row["update_s"] / base, 3)
    return {"micro_batch_size": check.micro_batch_size, "rows": rows}


def part_card(label):
    def conclude(check):
        return headline(check.runs[label])
    return conclude


def part_float16(check):
    r = check.runs["float16"]
    return {**headline(r), **first_ratios(r)}


def first_ratios(r):
    """Each step's ratio over its first mini-batch, [min, max] (None: that mini-batch had nothing
    to learn, no update), and whether every one is exactly 1."""
    ratios = [s["ratio_first"] for s in [r["warm_up"]] + r["steady"]]
    return {"ratio_first": ratios,
            "first_ratio_exactly_1": all(x == [1.0, 1.0] for x in ratios if x is not None)}


def update_flops(s, fig):
    """The FLOPs of a step's update by count, for model shape s and a step's figures [ours]: 6 per
    weight per token forwarded and back-propagated (2 forward, 4 backward), 2 per weight per token
    of the no-grad forward (logp_old), the LM head's V x H weights the same at the positions it runs
    on; attention's T^2 terms, the head's recomputation in backward and the optimizer left out."""
    head = s["vocab"] * s["hidden"]
    body = memory.param_count(s) - head * (1 if s["tied"] else 2)  # the embedding is a lookup
    return (6 * body * fig["fwd_bwd_tokens"] + 2 * body * fig["decoder_tokens_no_grad"]
            + 6 * head * fig["head_positions_grad"] + 2 * head * fig["head_positions_no_grad"])


def part_update_cost(check):
    """The update's share of the card's bf16 peak; TF32 for the float32 LM head, with and
    without."""
    peak, out = bf16_peak(check.card.get("name", "")), {}
    shape = check.shape("Qwen2.5-0.5B")
    for key in ("grpo", "d3s-0.25", "d3s-0.75", "grpo-tf32"):
        steps = check.runs[key]["steady"]
        rate = median([update_flops(shape, f) / f["update_s"] for f in steps])
        out[key] = {"tflop_per_step": sig(median([update_flops(shape, f) for f in steps]) / 1e12),
                    "tflop_per_s": sig(rate / 1e12),
                    "share_of_bf16_peak": round(rate / peak, 4) if peak else "unknown card"}
    without, with_ = check.runs["grpo"], check.runs["grpo-tf32"]
    return {"flops": out, "bf16_peak_tflops": peak / 1e12 if peak else "unknown card",
            "tf32": {"update_s_without": without["steady_median"]["update_s"],
                     "update_s_with": with_["steady_median"]["update_s"],
                     "with_over_without": round(with_["steady_median"]["update_s"]
                                                / without["steady_median"]["update_s"], 3),
                     "without": first_ratios(without), "with": first_ratios(with_),
                     "ratio_range_with": [min(s["ratio_min"] for s in with_["steady"]),
                                          max(s["ratio_max"] for s in with_["steady"])]}}


# part: (the runs it needs, what it concludes from them)
PARTS = {
    "loop": (["d3s"], part_loop),
    "hf": (["d3s", "d3s-hf"], part_hf),
    "grpo": (["grpo"], part_grpo),
    "compare": (["grpo", "d3s-0.25", "d3s-0.75"], part_compare),
    "gib24": (["gib24"], part_card("gib24")),
    "gib16": (["gib16"], part_card("gib16")),
    "lora": (["lora"], part_card("lora")),
    "float16": (["float16"], part_float16),
    "update_cost": (["grpo", "d3s-0.25", "d3s-0.75", "grpo-tf32"], part_update_cost),
}


def estimate(part, done, built):
    """A part's estimated seconds on one H200: its runs not done yet, and the models they build."""
    todo = [r for r in PARTS[part][0] if r not in done]
    models = {RUNS[r][0] for r in todo} - set(built)
    return sum(RUNS[r][4] for r in todo) + sum(BUILD[m] for m in models)

# -----------------------------------------------------------------------------
# the check


class Check:
    """The check's state: its arguments, the device, the models built, the runs, the summary."""

    def __init__(self, args, rest):
        self.args, self.rest, self.started = args, rest, time.time()
        self.out, self.data_dir, self.dry_run = args.out, args.data_dir, args.dry_run
        self.steps, self.device = args.steps, resolve_device(args.device)
        self.cuda = self.device.type == "cuda"
        self.micro_batch_size = args.micro_batch_size or (2 if args.dry_run else 16)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        self.models, self.runs = args.models, {}
        self.built = {}
        self.card = card(self.device) if self.cuda else {"name": "none (CPU)"}
        self.summary = {
            "card": self.card, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "dry_run": self.dry_run,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "argv": sys.argv[1:], "budget_s": args.budget, "steps_per_run": self.steps,
            "notes": [
                "random weights never write a stop token: every rollout runs to max_new_tokens",
                "rewards are seeded coin flips; evaluation off but in the loop's run (d3s); each "
                "run's first step is warm-up",
                "estimates in estimate_s are guesses from the last GPU run, not measurements"]
            + (["dry run: a 2-layer, 64-wide model on " + str(self.device)
                + ": its seconds are no figures, its targets not judged"] if self.dry_run else []),
            "estimate_s": {}, "parts": {p: {"status": "not selected"} for p in PARTS},
            "runs": self.runs}

    def model(self, name):
        if name not in self.built:
            self.built[name] = build(name, os.path.join(self.models, name.lower() + "-random"),
                                     self.tokenizer, self.device, self.dry_run)
            gc.collect()
        return self.built[name]

    def shape(self, name):
        with open(os.path.join(self.model(name), "config.json")) as f:
            return memory.shape_of(json.load(f))

    def met(self, ok):
        return None if self.dry_run else bool(ok)

    def elapsed(self):
        return time.time() - self.started

    def write(self):
        self.summary["elapsed_s"] = round(self.elapsed(), 1)
        path = os.path.join(self.out, "summary.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.summary, f, indent=1)
        os.replace(path + ".tmp", path)  # whole, even if the check is killed while writing

    def part(self, name):
        """Run a part: its runs not done yet, then what it concludes; not started when its estimate
        does not fit in what is left of the budget; an error is shown and recorded."""
        parts, runs = self.summary["parts"], PARTS[name][0]
        need = 0 if self.dry_run else estimate(name, self.runs, self.built)
        self.summary["estimate_s"][name] = need
        if self.elapsed() + need > self.args.budget:
            parts[name] = {"status": "not started",
                           "why": f"--budget {self.args.budget:g} s: {self.elapsed():.0f} s spent, "
                                  f"its estimate {need} s more"}
            return say(name, parts[name])
        print(f"\n== {name} (estimate {need} s, at {self.elapsed():.0f} s)", flush=True)
        for label in runs:
            if label not in self.runs:
                parts[name] = {"status": "running", "run": label, "since_s": round(self.elapsed())}
                self.write()
                try:
                    self.runs[label] = train_run(self, label)
                except Exception as e:  # before train.py started (building its model, say)
                    self.runs[label] = {"status": "error", "error": error_record(e)}
                say_run(label, self.runs[label])
        failed = {r: self.runs[r]["error"] for r in runs if self.runs[r]["status"] != "done"}
        if failed:
            parts[name] = {"status": "error", "runs_failed": failed}
        else:
            try:
                parts[name] = {"status": "done", **PARTS[name][1](self)}
            except Exception as e:
                parts[name] = {"status": "error", "error": error_record(e)}
        say(name, parts[name])


def say_run(label, r):
    if r["status"] != "done":
        e = r["error"]
        print(f"run {label}: ERROR {e['type']}: {e['message']}\n" + "".join(e["traceback"]),
              flush=True)
        return
    s = r["steady_median"]
    print(f"run {label}: {r['wall_s']} s | {r.get('auto')} | predicted {r.get('predicted_gib')} "
          f"GiB, peak {r.get('peak_gib')} | warm-up step {r['warm_up']['seconds']} s, steady "
          f"{s['seconds']} s (generation {s['generation_s']}, update {s['update_s']}), "
          f"{s['generated_tokens_per_s']} tokens/s | compiles {r['warm_up']['compiles']}, then "
          f"{after(r, 'compiles')}; CUDA graphs recorded {r['warm_up']['cudagraph_records']}, then "
          f"{after(r, 'cudagraph_records')} | evaluations {r['evaluation_s']} s | OOM retries "
          f"{r['out_of_memory_retries'] or 'none'}", flush=True)


def say(name, result):
    """A part's result in a few lines."""
    short = {k: v for k, v in result.items() if k not in ("run", "compile", "settings")}
    print(f"== {name}: " + json.dumps(short), flush=True)


# the figures of a part's one line in the digest, each where the part has it
DIGEST = ("step_s", "generation_s", "update_s", "generation_share", "generated_tokens_per_s",
          "pad_share", "compiles_first_step", "recompiles_after_first_step",
          "rerecords_after_first_step", "cudagraph_skips", "evaluation_s",
          "loop_over_hf_generation_s", "predicted_gib", "peak_gib", "fits", "targets",
          "first_ratio_exactly_1", "rows", "flops", "tf32")


def digest(summary):
    """One line a part, at the end: what the last lines of the output should show."""
    print("\ndigest (steady medians; the first step of each run apart as warm-up):")
    for name, r in summary["parts"].items():
        if r["status"] != "done":
            why = r.get("why") or r.get("error") or r.get("runs_failed")
            print(f"  {name}: {r['status']}" + (f" {json.dumps(why)[:300]}" if why else ""))
            continue
        peaks = {"predicted_gib": ("predicted_peak_gib", "peak"),  # reserved: None on a CPU
                 "peak_gib": ("peak_reserved_gib", "reserved")}
        figures = {peaks[k][0] if k in peaks else k: (r[k] or {}).get(peaks[k][1]) if k in peaks
                   else r[k] for k in DIGEST if k in r}
        print(f"  {name}: " + " | ".join(f"{k} {json.dumps(v)}" for k, v in figures.items()))


class Tee:
    """A stream written to two: the terminal's and the log file (not a terminal itself: train.py's
    progress bar stays off and its lines go through the log)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text)
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def isatty(self):
        return False

    def __getattr__(self, name):
        return getattr(self.stream, name)


def parse_args(argv):
    p = config.OneLineParser(description=__doc__.split("\n")[1], allow_abbrev=False)
    p.add_argument("--tokenizer", default="Qwen/Qwen2.5-0.5B",
                   help="Qwen2.5's tokenizer: a folder (or hub id)")
    p.add_argument("--data_dir", default="", help="local copies as NAME/SPLIT.jsonl ('': the hub)")
    p.add_argument("--out", default="out/gpu_check",
                   help="summary.json, the log, each run's folder")
    p.add_argument("--models", default="",
                   help="where the random models are saved ('': a temporary folder, removed)")
    p.add_argument("--budget", type=float, default=400,
                   help="seconds: no part starts unless its estimate fits in what is left")
    p.add_argument("--steps", type=int, default=4, help="steps of each run; the first is warm-up")
    p.add_argument("--micro_batch_size", type=int, default=0,
                   help="the one given to grpo and D3S at fixed ratios (0: 16; dry run: 2)")
    p.add_argument("--parts", default=",".join(PARTS), help="which, from " + ", ".join(PARTS))
    p.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    p.add_argument("--dry_run", action="store_true",
                   help="a 2-layer, 64-wide model of the same vocabulary, a small batch: a CPU")
    args, rest = p.parse_known_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"--parts {','.join(unknown)}: no such part; use some of {', '.join(PARTS)}")
    if args.steps < 2:
        p.error(f"--steps {args.steps}: at least 2 (the first is warm-up)")
    return args, rest


def main(argv=None):
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    config.parse_args(train.Config, rest)  # what goes to train.py: a wrong flag is one line now
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.log"), "w", buffering=1) as log, \
            tempfile.TemporaryDirectory(prefix="gpu_check_models_") as temporary:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = Tee(stdout, log), Tee(stderr, log)
        try:
            args.models = args.models or temporary
            try:
                load_problems("gsm8k", "train", limit=1, data_dir=args.data_dir or None)
                check = Check(args, rest)
            except (OSError, ValueError) as e:  # bad input: one line
                print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
                return 2
            print(json.dumps({k: check.summary[k] for k in ("card", "torch", "cuda",
                                                            "transformers", "dry_run")}))
            check.write()
            for name in args.parts:
                try:
                    check.part(name)
                except KeyboardInterrupt as e:  # a signal (timeout): what was measured stays
                    check.summary["parts"][name] = {"status": "interrupted by a signal"}
                    check.write()
                    digest(check.summary)
                    return 128 + (e.args[0] if e.args and isinstance(e.args[0], int) else 2)
                check.write()
            digest(check.summary)
            print(f"\n{check.elapsed():.0f} s; summary: {os.path.join(args.out, 'summary.json')}")
            return 0
        finally:
            sys.stdout, sys.stderr = stdout, stderr


if __name__ == "__main__":
    sys.exit(main())
