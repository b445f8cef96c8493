"""
Evaluate a model on the paper's math benchmarks: greedy pass@1, or avg@n and pass@j with sampling.

    python eval.py --model tiny --benchmarks tiny                                 # offline, seconds
    python eval.py --model out/d3s-Qwen2.5-0.5B/checkpoint --benchmarks all       # greedy pass@1
    python eval.py --model Qwen2.5-Math-1.5B --benchmarks aime24,amc23 --n 8 --temperature 0.6
    python eval.py --model Qwen2.5-0.5B --benchmarks gsm8k --limit 200 --data_dir data

The D3S paper reports Pass@1 and Pass@8 on AIME24, AIME25, AMC23, GSM8K, MATH, Minerva and
OlympiadBench; `--benchmarks all` is all seven (MATH-500 for MATH). The model argument goes through
model.load_model and --dtype through model.autocast, exactly as in train.py ("auto": float32
weights, autocast on a GPU: bf16 from compute capability 8.0, else float16), and train.py's held-out
accuracy is evaluate() below: on the same rows (--limit = train.py's --eval_size) and
--max_new_tokens, eval.py's accuracy equals train.py's up to the rounding of the logits: exactly
on a CPU in float32 for the tests' models. Results change with batch shape where that rounding
moves a token (on a GPU under bf16 autocast, often), and train.py generates in batches of its
--gen_batch_size (256 when 0), eval.py in --batch_size: the two can differ by a few completions.

A benchmark is always a test split, data.load_problems(name, "test"), and the line printed before
the table says what each one's rows are (data.describe). A .jsonl file is no exception: eval.py
evaluates the same test split that train.py's held-out accuracy uses for `--dataset FILE`, never a
training row:
  mine.jsonl        the 1 question in 10 held out by a hash of its text (never trained on), not the
                    whole file: the other 9 in 10 are what `train.py --dataset mine.jsonl` trains on
  mine_train.jsonl  the test file beside it, mine_test.jsonl, minus questions also in
                    mine_train.jsonl
  mine_test.jsonl   the whole file (a file named as a test set is never trained on), minus the
                    questions of mine_train.jsonl if that file is beside it
So to evaluate every row of a file of your own, name it as a test set (test.jsonl, *_test.jsonl).

What is measured, per benchmark (n samples for each of its problems, c of them correct):
  accuracy    greedy (n = 1, temperature 0): pass@1. Sampled: avg@n, the mean accuracy over all
              n samples, which is also the unbiased pass@1.
  pass@j      j = 1, 2, 4, ..., n (and n itself): the chance that at least one of j samples drawn
              without replacement from the n is correct, 1 - C(n-c, j) / C(n, j), averaged over
              problems (Chen et al. 2021's unbiased estimator; it uses all n samples, not just j).
  no_answer   share of completions with no final answer in the asked format, a closed \\boxed{} or
              a #### line (reward.extract_answer; when truncated, only a finished one, as train.py
              grades): a model that has not learned the format shows here, not as lenient grades.
  mean_length completion tokens, the stop token included (Rollouts.lengths).
  truncated   share of completions that hit max_new_tokens without a stop token.
  seconds     wall time: generation plus grading.

Writes every generation (benchmark, problem, sample, prompt, completion, extracted answer,
reference, correct, length, truncated) as one JSON line to --out (default out/eval/<model>.jsonl),
and the table as JSON beside it (<out stem>.json), both replaced only once every benchmark is done
(an interrupted run leaves the earlier files whole, its own so far in <file>.part). Prompts are
sorted by length, longest first, and generated in batches; out of memory lowers the batch as
train.py's generation does and redoes it.
Sampling is seeded per benchmark by --seed; with --top_p 1 the samples do not depend on --batch_size
or on a halving (rollout.py draws each row's random numbers from the seed, the row and the
position alone), up to the rounding of the logits: the tests' models agree token for token on a
CPU in float32; under bf16 autocast on a GPU the logits change with batch shape, so --batch_size or
a halving can change a sample (or a greedy completion) there.
"""
import machinery.ctrl_c  # noqa: F401  first: a Ctrl-C while torch loads is one line, exit 130
import argparse
import json
import math
import os
import signal
import sys
import threading
import time

import torch
from tqdm import tqdm

from machinery import data, memory
from reward import extract_answer, grade
from rollout import draw_seed, generate_groups

# Every benchmark machinery/data.py knows with a test split. [ours] "math" is left out: its test
# split is MATH-500 itself, already in the list as "math500".
BENCHMARKS = tuple(name for name, splits in data.SPLITS.items()
                   if "test" in splits and name != "math")

# -----------------------------------------------------------------------------
# pass@j


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    The chance that a random k-subset of the n samples holds at least one correct one. Exact
    integer binomials (math.comb): no overflow or cancellation even for n in the hundreds.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n):
    """The j of the pass@j columns: 1, 2, 4, ... up to n, and n itself if it is not a power of
    two."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else ks + [n]

# -----------------------------------------------------------------------------
# evaluate: the function train.py calls


def evaluate(model, tokenizer, problems, n=1, temperature=0.0, max_new_tokens=512, batch_size=64,
             top_p=1.0, progress=False, desc="eval", seed=None, stop=None, halve=True,
             engine="loop"):
    """Generate n completions for each problem ({"prompt", "answer"} rows of machinery/data.py),
    grade them.

    batch_size: completions per generation call. Out of memory halves it (machinery/memory.halve)
    and redoes the batch; halve=False leaves the error to the caller (train.py: run.fit lowers and
    records --gen_batch_size). stop: machinery/stops.Stop, whose flag ends generation early
    (train.py's, on a signal: it then discards the result). engine: rollout.generate_groups' (loop,
    or hf: transformers' generate), the same completions either way.
    seed (sampling only; greedy decoding ignores it): with top_p == 1 (sampling.sample) one seed
    gives the same samples whatever batch_size, an out-of-memory halving or other random draws (bit
    for bit on a CPU in float32; under bf16 autocast on a GPU the logits change with batch shape,
    and so can the samples), and torch's generator is not touched; seed=None draws one seed from
    torch's generator for the whole evaluation. With top_p < 1, generate's own sampler draws from
    torch's generator: the seed seeds a forked generator state (the caller's RNG is left as it was),
    so a run reproduces at the same batch_size. Returns a dict with problems, generations, n,
    temperature, metric, accuracy, pass@j for j in pass_ks(n), no_answer, mean_length, truncated,
    seconds, and records (one dict per generation, in problem order; see the module docstring).
    The model's train/eval mode is restored (generate_groups switches to eval for generating).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an integer >= 1 (completions per problem)")
    if n > 1 and temperature == 0:
        raise ValueError(f"n={n} with temperature=0 repeats one greedy completion {n} times; use "
                         f"n=1 for greedy, or a temperature > 0 (e.g. 0.6) to sample")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
    if len(problems) == 0:
        raise ValueError("problems is empty; nothing to evaluate (check --limit and the data set)")

    t0 = time.time()
    prompts = [data.format_prompt(tokenizer, p["prompt"]) for p in problems]
    # Longest prompts first [ours]: batches of similar length waste little on padding, and if memory
    # runs out, it does so in the first batch, not an hour in.
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    order = sorted(range(len(problems)), key=lambda i: -lengths[i])

    device = next(model.parameters()).device
    devices = [device.index or 0] if device.type == "cuda" else []
    records = [None] * (len(problems) * n)
    own_sampler = temperature > 0 and top_p == 1
    if own_sampler and seed is None:
        seed = draw_seed()  # one for the whole evaluation, so that batching changes no sample
    # generate's own sampler: torch's generator
    nucleus = temperature > 0 and top_p < 1 and seed is not None
    bar = tqdm(total=len(problems), desc=desc, unit="problem", disable=not progress,
               dynamic_ncols=True)
    with torch.random.fork_rng(devices=devices, enabled=nucleus):
        if nucleus:
            torch.manual_seed(seed)
        done = 0
        while done < len(order):
            chunk = order[done:done + max(1, batch_size // n)]  # problems in this batch
            # rows are numbered over the whole evaluation (longest prompt first, n per problem), so
            # each sample's random numbers are the same whatever the batch: first_row = done * n
            try:
                rollouts = generate_groups(model, tokenizer, [prompts[i] for i in chunk], n,
                                           max_new_tokens, temperature=temperature, top_p=top_p,
                                           batch_size=batch_size, engine=engine,
                                           first_row=done * n,
                                           seed=seed if own_sampler else None, stop=stop)
            except RuntimeError as e:  # torch's out of memory, or a CUDA library's (memory.py)
                if not (halve and memory.is_out_of_memory(e)):
                    raise
                rollouts = None  # out of the except first: its traceback holds the batch's tensors
            if rollouts is None:  # out of memory: this batch again, with less
                lower = memory.halve("evaluation", {"gen_batch_size": batch_size},
                                     min(batch_size, len(chunk) * n))
                if not lower:
                    raise torch.OutOfMemoryError(f"{desc}: out of memory with --batch_size 1")
                torch.cuda.empty_cache()  # the failed batch's blocks (a no-op while CUDA is unused)
                tqdm.write(f"{desc}: out of memory: --batch_size {batch_size} -> "
                           f"{lower['gen_batch_size']}, the batch redone", file=sys.stderr)
                batch_size = lower["gen_batch_size"]
                continue
            lens = rollouts.lengths.tolist()
            cut = rollouts.truncated.tolist()
            for row, text in enumerate(rollouts.texts):  # rows are group by group: n per problem
                i, sample = chunk[row // n], row % n
                reference = problems[i]["answer"]
                records[i * n + sample] = {  # graded as train.py grades rollouts: truncation counts
                    "problem": i, "sample": sample, "prompt": prompts[i], "completion": text,
                    "answer": extract_answer(text, cut[row]), "reference": reference,
                    "correct": grade(text, reference, cut[row]), "length": lens[row],
                    "truncated": cut[row],
                }
            done += len(chunk)
            bar.update(len(chunk))
    bar.close()
    return {**summarize(records, n), "temperature": temperature, "seconds": time.time() - t0,
            "records": records}


def summarize(records, n):
    """The table row of a list of records: every number in it is recomputed from the records
    alone."""
    problems = len(records) // n
    correct = [0] * problems  # c of each problem
    for r in records:
        correct[r["problem"]] += r["correct"] == 1.0
    row = {"problems": problems, "generations": len(records), "n": n,
           "metric": "pass@1 (greedy)" if n == 1 else f"avg@{n} (mean over {n} samples)",
           "accuracy": sum(r["correct"] for r in records) / len(records)}
    for k in pass_ks(n):
        row[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / problems
    row["no_answer"] = sum(r["answer"] is None for r in records) / len(records)
    row["mean_length"] = sum(r["length"] for r in records) / len(records)
    row["truncated"] = sum(r["truncated"] for r in records) / len(records)
    return row

# -----------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help="'tiny', a local folder, a short name (Qwen2.5-0.5B) or a hub id")
    p.add_argument("--benchmarks", default="tiny",
                   help=f"comma list of {', '.join(BENCHMARKS)}, tiny, .jsonl files (their test "
                        f"split, the rows train.py holds out: see above); or 'all' "
                        f"(= {','.join(BENCHMARKS)})")
    p.add_argument("--n", type=int, default=1,
                   help="completions per problem (> 1 needs --temperature > 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=1024,
                   help="generation stops earlier at EOS")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    p.add_argument("--data_dir", default=None,
                   help="folder of local copies: NAME/test.jsonl (gsm8k/test.jsonl, "
                        "math500/test.jsonl, ...)")
    p.add_argument("--batch_size", type=int, default=64,
                   help="completions per generate call (lowered on out of memory, as train.py's)")
    p.add_argument("--out", default=None,
                   help="JSONL of every generation (default out/eval/<model>.jsonl); "
                        "the table goes to the same stem + .json")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 weights, autocast on a GPU: bf16 on compute capability "
                        "8.0+, else float16; as in train.py), float32, bfloat16, float16")
    p.add_argument("--seed", type=int, default=0, help="seeds sampling, per benchmark")
    return p.parse_args(argv)


def benchmark_names(arg):
    """--benchmarks -> list of names (or .jsonl paths); 'all' expands to BENCHMARKS."""
    names = [b.strip() for b in arg.split(",") if b.strip()]
    if names == ["all"]:
        return list(BENCHMARKS)
    if not names:
        raise ValueError(f"--benchmarks={arg!r} names no benchmark; use all or a comma list of "
                         f"{', '.join(data.NAMES)}")
    for b in names:
        if b not in data.NAMES and not b.endswith(".jsonl"):
            raise ValueError(f"--benchmarks: unknown benchmark {b!r}; known: "
                             f"{', '.join(data.NAMES)}, all, or a .jsonl file")
    return names


def default_out(model_arg):
    """out/eval/<model>.jsonl, the model argument made into a file name: out/run/checkpoint ->
    out_run_checkpoint."""
    parts = [p for p in os.path.normpath(model_arg).replace("\\", "/").split("/")
             if p not in ("", ".", "..")]
    return os.path.join("out", "eval", "_".join(parts) + ".jsonl")


def format_table(results, n):
    """One row per benchmark, in percent, plus the settings under which they were measured."""
    ks = pass_ks(n)
    cols = ["benchmark", "problems"] + (["pass@1"] if n == 1 else [f"pass@{k}" for k in ks])
    cols += ["no_answer", "length", "truncated", "seconds"]
    rows = []
    for name, r in results.items():
        scores = [r["accuracy"]] if n == 1 else [r[f"pass@{k}"] for k in ks]
        rows.append([name, str(r["problems"])] + [f"{100 * s:.1f}" for s in scores]
                    + [f"{100 * r['no_answer']:.1f}", f"{r['mean_length']:.0f}",
                       f"{100 * r['truncated']:.1f}", f"{r['seconds']:.0f}"])
    width = [max(len(c), *(len(row[j]) for row in rows)) for j, c in enumerate(cols)]

    def line(cells):  # the benchmark name left-aligned, numbers right-aligned
        return " | ".join(c.ljust(w) if j == 0 else c.rjust(w)
                          for j, (c, w) in enumerate(zip(cells, width)))
    note = ("greedy pass@1" if n == 1
            else f"pass@1 = avg@{n}, the mean accuracy over the {n} samples") + \
        "; all numbers in percent except problems, length (tokens) and seconds"
    return "\n".join([line(cols), "-+-".join("-" * w for w in width)] + [line(r) for r in rows]
                     + [note])


def run(args):
    if args.n < 1:
        raise ValueError(f"--n={args.n} must be >= 1 (completions per problem)")
    if args.n > 1 and args.temperature == 0:
        raise ValueError(f"--n={args.n} with --temperature 0 repeats one greedy completion "
                         f"{args.n} times; use --n 1 for greedy, or sample with e.g. "
                         f"--temperature 0.6")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise ValueError(f"--max_new_tokens={args.max_new_tokens} and "
                         f"--batch_size={args.batch_size} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit={args.limit} must be >= 1 (or left out for every problem)")
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        raise ValueError(f"--data_dir={args.data_dir!r} is not a folder; pass a folder laid out "
                         f"like NAME/test.jsonl (gsm8k/test.jsonl, math500/test.jsonl, ...)")

    # Data before the model: a missing file should fail in a second, not after loading 15 GB.
    benchmarks = {b: data.load_problems(b, "test", limit=args.limit, data_dir=args.data_dir)
                  for b in benchmark_names(args.benchmarks)}
    for b, rows in benchmarks.items():
        if not rows:
            raise ValueError(f"--benchmarks: {b} has no problems; check the file")
    # what each benchmark's rows are: a .jsonl's held-out slice must not pass for the whole file
    splits = {b: data.describe(b, "test", data_dir=args.data_dir) for b in benchmarks}

    from machinery import model as models  # imported here: it pulls in transformers' model classes
    device = models.resolve_device(args.device)  # named once: a CUDA one with its index
    # in train.py's dtype for the same checkpoint (a LoRA checkpoint's base: models.load_dtype)
    model, tokenizer = models.load_model(args.model, device=device, dtype=args.dtype)
    out = args.out or default_out(args.model)
    table_path = os.path.splitext(out)[0] + ".json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    settings = {k: getattr(args, k)
                for k in ("model", "n", "temperature", "top_p", "max_new_tokens", "limit", "seed",
                          "batch_size", "dtype")}
    cast = models.autocast_dtype(device, args.dtype)  # the dtype forward passes run in, or None
    print(f"model {args.model} | {device} {model.dtype}{f' + {cast} autocast' if cast else ''} | "
          f"n {args.n} | temperature {args.temperature} | max_new_tokens {args.max_new_tokens}",
          flush=True)
    for b, rows in benchmarks.items():
        limited = f" (--limit {args.limit})" if args.limit is not None else ""
        print(f"data {b} | {len(rows)} problems{limited} | {splits[b]}", flush=True)

    # [ours] Written beside the files they replace (.part), which they replace only once every
    # benchmark is done: an interrupted run leaves the last run's generations and table as they
    # were, and its own so far in the .part files (the table rewritten after each benchmark).
    results, parts = {}, (out + ".part", table_path + ".part")
    try:
        with open(parts[0], "w", encoding="utf-8") as f:
            for name, problems in benchmarks.items():
                # seeded per benchmark [ours]: its samples do not depend on which ran before it
                with models.autocast(device, args.dtype):  # the arithmetic train.py's eval runs in
                    res = evaluate(model, tokenizer, problems, n=args.n,
                                   temperature=args.temperature,
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   top_p=args.top_p, progress=True, desc=name,
                                   seed=args.seed if args.temperature > 0 else None)
                for r in res.pop("records"):
                    f.write(json.dumps({"benchmark": name, **r}) + "\n")
                f.flush()
                results[name] = res
                with open(parts[1], "w", encoding="utf-8") as t:
                    json.dump({"settings": settings, "data": splits, "results": results}, t,
                              indent=2)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {out} and {table_path} are as they were; this run's results so far "
              f"are in {parts[0]} and {parts[1]}", file=sys.stderr)
        raise SystemExit(130) from None  # 128 + SIGINT, as train.py exits
    replace_together(parts, (out, table_path))
    print(format_table(results, args.n))
    print(f"generations: {out}\ntable: {table_path}")
    return results


def replace_together(parts, paths):
    """Rename each part over its path, with Ctrl-C and SIGTERM held until both are done, so that
    the generations and the table beside them are always one run's."""
    held = {signal.SIGINT, signal.SIGTERM}
    hold = hasattr(signal, "pthread_sigmask") and \
        threading.current_thread() is threading.main_thread()
    if hold:
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        for part, path in zip(parts, paths):
            os.replace(part, path)
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
