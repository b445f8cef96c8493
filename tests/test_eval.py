"""eval.py: the pass@j estimator against brute force, evaluate() against grading by hand, and the
command line end to end on the tiny world's warmed-up model (in-process: main(argv); one real process
for the exit status)."""
import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from machinery import data
from machinery import tiny
from conftest import ROOT, SHARED, requires_shared
from eval import BENCHMARKS, evaluate, main, pass_at_k, pass_ks
from machinery.model import load_model
from reward import extract_answer, grade, score
from rollout import generate_groups

BUDGET = 32  # train.py's max_new_tokens for the tiny world: pick(tiny=32, ...)
FIELDS = {"problem", "sample", "prompt", "completion", "answer", "reference", "correct", "length", "truncated"}


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return load_model(tiny_dir, device="cpu")

# -----------------------------------------------------------------------------
# pass@j


def test_pass_at_k_is_the_average_over_all_k_subsets():
    # every n <= 8, every c, every k, and every arrangement's subsets counted by brute force
    for n in range(1, 9):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert math.isclose(pass_at_k(n, c, k), brute, abs_tol=1e-12), (n, c, k)
    assert pass_at_k(8, 1, 1) == 1 / 8 and pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0


def test_pass_ks():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(20) == [1, 2, 4, 8, 16, 20]


def _brute_pass(records, n, k):
    """pass@k of a benchmark from its records, by enumerating all k-subsets of each problem's samples."""
    by_problem = {}
    for r in records:
        by_problem.setdefault(r["problem"], []).append(r["correct"] == 1.0)
    values = []
    for samples in by_problem.values():
        assert len(samples) == n
        subsets = list(itertools.combinations(samples, k))
        values.append(sum(any(s) for s in subsets) / len(subsets))
    return sum(values) / len(values)

# -----------------------------------------------------------------------------
# evaluate()


def test_evaluate_greedy_equals_grading_by_hand(tiny_model):
    model, tokenizer = tiny_model
    problems = tiny.problems("test", limit=64)
    model.train()
    res = evaluate(model, tokenizer, problems, n=1, temperature=0.0, max_new_tokens=BUDGET)
    assert model.training  # restored

    prompts = [data.format_prompt(tokenizer, p["prompt"]) for p in problems]
    by_hand = generate_groups(model, tokenizer, prompts, 1, BUDGET, temperature=0.0)
    cut = by_hand.truncated.tolist()
    grades = [grade(text, p["answer"], c) for text, p, c in zip(by_hand.texts, problems, cut)]
    accuracy = sum(grades) / len(grades)

    assert res["accuracy"] == accuracy and res["pass@1"] == accuracy
    assert 0 < accuracy < 1  # the warmed-up tiny model is right 15-35% of the time greedily
    assert res["problems"] == res["generations"] == 64 and res["n"] == 1
    assert [r["completion"] for r in res["records"]] == by_hand.texts
    assert [r["correct"] for r in res["records"]] == grades
    assert [r["reference"] for r in res["records"]] == [p["answer"] for p in problems]
    assert [r["answer"] for r in res["records"]] == [extract_answer(t, c) for t, c in zip(by_hand.texts, cut)]
    assert res["mean_length"] == by_hand.lengths.float().mean().item()
    assert res["truncated"] == by_hand.truncated.float().mean().item()
    assert res["no_answer"] == sum(extract_answer(t, c) is None for t, c in zip(by_hand.texts, cut)) / 64
    assert res["seconds"] > 0
    assert all(set(r) == FIELDS for r in res["records"])


def test_evaluate_with_the_loop_equals_generate(tiny_model):
    """eval.py's numbers do not depend on the engine: greedy pass@1 and sampled pass@k (n = 4,
    batches that split a problem's samples) give the same records with rollout.py's decode loop
    and with transformers' generate, on the CPU in float32."""
    model, tokenizer = tiny_model
    problems = tiny.problems("test", limit=24)
    for kwargs in (dict(n=1, temperature=0.0, batch_size=64), dict(n=4, temperature=1.0, seed=2,
                                                                   batch_size=6)):
        got = {engine: evaluate(model, tokenizer, problems, max_new_tokens=BUDGET, engine=engine,
                                **kwargs) for engine in ("loop", "hf")}
        assert got["loop"]["records"] == got["hf"]["records"]
        assert {k: v for k, v in got["loop"].items() if k not in ("records", "seconds")} == \
            {k: v for k, v in got["hf"].items() if k not in ("records", "seconds")}
        assert 0 < got["loop"]["accuracy"] < 1  # precondition: some right, some wrong


def test_evaluate_keeps_problem_order_across_sorted_batches(tiny_model):
    model, tokenizer = tiny_model
    # different prompt lengths, so the longest-first order differs from the given one
    problems = [{"prompt": q, "answer": str(sum(map(int, q.split("+"))) % 10)}
                for q in ["1+2", "3+8+5+9", "4+4", "1+2+3", "9+9+9+9+9", "7"]]
    res = evaluate(model, tokenizer, problems, n=2, temperature=1.0, max_new_tokens=BUDGET,
                   batch_size=4, seed=0)
    records = res["records"]
    assert [(r["problem"], r["sample"]) for r in records] == [(i, s) for i in range(6) for s in range(2)]
    for r in records:
        assert r["prompt"] == data.format_prompt(tokenizer, problems[r["problem"]]["prompt"])
        assert r["reference"] == problems[r["problem"]]["answer"]
        assert r["correct"] == grade(r["completion"], r["reference"], r["truncated"])


def test_sampled_evaluate_is_reproducible_and_leaves_the_callers_rng_alone(tiny_model):
    """A seed gives the same samples at any batch size (sampling.sample: 32 completions in one call, or
    12, three problems, per call) without touching torch's generator; seed=None follows
    torch.manual_seed (one seed for the whole evaluation, so again any batch size); top_p < 1
    (generate's own sampler) reproduces from a forked generator state."""
    model, tokenizer = tiny_model
    problems = tiny.problems("test", limit=8)

    def completions(**kwargs):
        res = evaluate(model, tokenizer, problems, n=4, temperature=1.0, max_new_tokens=BUDGET, **kwargs)
        return res, [r["completion"] for r in res["records"]]

    state = torch.random.get_rng_state()
    runs = [completions(batch_size=b, seed=1) for b in (32, 12)]
    nucleus = [completions(batch_size=32, seed=1, top_p=0.9)[1] for _ in range(2)]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert runs[0][1] == runs[1][1]
    assert nucleus[0] == nucleus[1] and len(set(nucleus[0])) > 8
    unseeded = []
    for b in (32, 12):
        torch.manual_seed(0)
        unseeded.append(completions(batch_size=b)[1])
    assert unseeded[0] == unseeded[1] != runs[0][1]
    res = runs[0][0]
    assert res["accuracy"] == res["pass@1"] == sum(r["correct"] for r in res["records"]) / 32
    for k in (1, 2, 4):
        assert math.isclose(res[f"pass@{k}"], _brute_pass(res["records"], 4, k), abs_tol=1e-12)
    assert len({r["completion"] for r in res["records"]}) > 8  # really sampled: not one completion per problem


def test_evaluate_grades_truncated_completions_as_training_does(tiny_model):
    # Cut off after 8 tokens ("3+8=1\n1+5"), a completion has numbers but no "#### N" line yet: the
    # last number is an intermediate result, not an answer, and must not be graded as one.
    model, tokenizer = tiny_model
    problems = tiny.problems("test", limit=16)
    res = evaluate(model, tokenizer, problems, n=1, temperature=0.0, max_new_tokens=8)
    cut = [r for r in res["records"] if r["truncated"]]
    assert len(cut) >= 8
    assert all(r["answer"] is None and r["correct"] == 0.0 for r in cut if "####" not in r["completion"])
    assert res["no_answer"] >= len(cut) / 16
    _, stats = score([r["completion"] for r in res["records"]], [p["answer"] for p in problems],
                     truncated=[r["truncated"] for r in res["records"]])
    assert stats["accuracy"] == res["accuracy"] and stats["no_answer"] / 16 == res["no_answer"]


def test_evaluate_rejects_bad_arguments(tiny_model):
    model, tokenizer = tiny_model
    problems = tiny.problems("test", limit=2)
    with pytest.raises(ValueError, match="temperature=0 repeats"):
        evaluate(model, tokenizer, problems, n=4, temperature=0.0)
    with pytest.raises(ValueError, match="n=0"):
        evaluate(model, tokenizer, problems, n=0)
    with pytest.raises(ValueError, match="problems is empty"):
        evaluate(model, tokenizer, [], n=1)

# -----------------------------------------------------------------------------
# the command line


def _read(out):
    with open(out) as f:
        lines = [json.loads(line) for line in f]
    with open(os.path.splitext(out)[0] + ".json") as f:
        table = json.load(f)
    return lines, table


def _check_table_against_jsonl(lines, table, n):
    """Every number of the table recomputed from the JSONL lines."""
    for name, row in table["results"].items():
        records = [r for r in lines if r["benchmark"] == name]
        assert len(records) == row["generations"] == row["problems"] * n
        assert row["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / len(records))
        assert row["no_answer"] == pytest.approx(sum(r["answer"] is None for r in records) / len(records))
        assert row["mean_length"] == pytest.approx(sum(r["length"] for r in records) / len(records))
        assert row["truncated"] == pytest.approx(sum(r["truncated"] for r in records) / len(records))
        for k in pass_ks(n):
            assert row[f"pass@{k}"] == pytest.approx(_brute_pass(records, n, k))
        for r in records:
            assert set(r) == FIELDS | {"benchmark"}
            assert r["answer"] == extract_answer(r["completion"], r["truncated"])
            assert r["correct"] == grade(r["completion"], r["reference"], r["truncated"])


def test_cli_greedy_end_to_end(tiny_dir, tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    assert main(["--model", tiny_dir, "--benchmarks", "tiny", "--limit", "16", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    lines, table = _read(out)
    assert len(lines) == 16 and [r["problem"] for r in lines] == list(range(16))
    assert [r["reference"] for r in lines] == [p["answer"] for p in tiny.problems("test", limit=16)]
    _check_table_against_jsonl(lines, table, n=1)
    row = table["results"]["tiny"]
    assert row["truncated"] == 0  # max_new_tokens 1024, but every completion stops at <eos>
    assert table["settings"]["n"] == 1 and table["settings"]["model"] == tiny_dir
    printed = [line for line in stdout.splitlines() if line.startswith("tiny ")]
    assert len(printed) == 1 and f"{100 * row['accuracy']:.1f}" in printed[0]
    assert "pass@1" in stdout and "pass@2" not in stdout


def test_cli_sampled_columns(tiny_dir, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert main(["--model", tiny_dir, "--benchmarks", "tiny", "--limit", "6", "--n", "4", "--temperature", "1",
                 "--max_new_tokens", str(BUDGET), "--batch_size", "8", "--out", str(out)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("benchmark"))
    assert [c.strip() for c in header.split("|")][2:5] == ["pass@1", "pass@2", "pass@4"]
    lines, table = _read(out)
    assert len(lines) == 24
    _check_table_against_jsonl(lines, table, n=4)
    assert {"pass@1", "pass@2", "pass@4"} <= set(table["results"]["tiny"])


def test_an_interrupted_run_leaves_the_last_runs_results_whole(tiny_dir, tmp_path, capsys, monkeypatch):
    """A rerun with other settings, interrupted (Ctrl-C) in its second benchmark: the generations and
    the table of the run before are left as they were, byte for byte, and agree; the interrupted
    run's first benchmark is in the .part files; a run that ends replaces both."""
    import eval as eval_py
    out = tmp_path / "x.jsonl"
    table = tmp_path / "x.json"
    first = ["--model", tiny_dir, "--limit", "4", "--out", str(out), "--max_new_tokens", str(BUDGET)]
    assert main(first + ["--benchmarks", "tiny"]) == 0
    before = out.read_bytes(), table.read_bytes()
    bench = tmp_path / "bench_test.jsonl"  # a second benchmark: the whole file, 3 problems
    bench.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n"
                             for r in tiny.problems("test", limit=3)))
    two = ["--benchmarks", f"tiny,{bench}", "--n", "2", "--temperature", "1"]
    real, calls = eval_py.evaluate, []

    def ctrl_c_in_the_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(eval_py, "evaluate", ctrl_c_in_the_second)
    capsys.readouterr()
    with pytest.raises((SystemExit, KeyboardInterrupt)) as e:
        main(first + two)
    assert (out.read_bytes(), table.read_bytes()) == before
    assert e.type is SystemExit and e.value.code == 130  # 128 + SIGINT, one line
    assert capsys.readouterr().err.splitlines()[-1] == (f"interrupted: {out} and {table} are as they were; this "
                                              f"run's results so far are in {out}.part and {table}.part")
    lines, kept = _read(out)
    _check_table_against_jsonl(lines, kept, n=1)
    part = [json.loads(line) for line in open(f"{out}.part")]
    assert {r["benchmark"] for r in part} == {"tiny"} and len(part) == 8
    monkeypatch.undo()
    assert main(first + two) == 0
    lines, now = _read(out)
    _check_table_against_jsonl(lines, now, n=2)
    assert set(now["results"]) == {"tiny", str(bench)} and len(lines) == 14
    assert not os.path.exists(f"{out}.part") and not os.path.exists(f"{table}.part")


@requires_shared
def test_cli_every_shared_benchmark(tiny_dir, tmp_path):
    out = tmp_path / "all.jsonl"
    assert main(["--model", tiny_dir, "--benchmarks", "all", "--limit", "4", "--data_dir", str(SHARED / "data"),
                 "--max_new_tokens", "4", "--out", str(out)]) == 0  # the plumbing, not the answers
    lines, table = _read(out)
    # all seven of the paper's benchmarks (MATH-500 for MATH), with one command
    assert list(table["results"]) == list(BENCHMARKS) == ["gsm8k", "math500", "aime24", "aime25", "amc23",
                                                          "minerva", "olympiadbench"]
    _check_table_against_jsonl(lines, table, n=1)
    for name in BENCHMARKS:
        refs = [r["reference"] for r in lines if r["benchmark"] == name]
        assert refs == [p["answer"] for p in data.load_problems(name, "test", limit=4, data_dir=SHARED / "data")]


def test_cli_a_jsonl_benchmark_is_the_split_train_py_holds_out(tiny_dir, tiny_model, tmp_path, capsys):
    """A .jsonl benchmark is its test split, load_problems(FILE, "test"): the rows train.py's held-out
    accuracy uses for --dataset FILE, never one of its training rows; a file named as a test set is
    evaluated whole. The line before the table and the table's "data" say which rows each one is."""
    _, tokenizer = tiny_model
    mine, bench = tmp_path / "mine.jsonl", tmp_path / "bench_test.jsonl"
    for path, rows in ((mine, tiny.problems("train", limit=40)), (bench, tiny.problems("test", limit=5))):
        path.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    out = tmp_path / "j.jsonl"
    assert main(["--model", tiny_dir, "--benchmarks", f"{mine},{bench}", "--max_new_tokens", str(BUDGET),
                 "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    lines, table = _read(out)
    _check_table_against_jsonl(lines, table, n=1)
    held_out, trained = data.load_problems(mine, "test"), data.load_problems(mine, "train")
    evaluated = [r["prompt"] for r in lines if r["benchmark"] == str(mine)]
    assert 0 < len(evaluated) == len(held_out) < 40  # the held-out slice, not the whole file
    assert evaluated == [data.format_prompt(tokenizer, r["prompt"]) for r in held_out]
    assert not set(evaluated) & {data.format_prompt(tokenizer, r["prompt"]) for r in trained}
    assert [r["reference"] for r in lines if r["benchmark"] == str(bench)] == [r["answer"] for r in
                                                                               tiny.problems("test", limit=5)]
    for path, count in ((mine, len(held_out)), (bench, 5)):
        said = data.describe(path, "test")
        assert table["data"][str(path)] == said and f"data {path} | {count} problems | {said}" in stdout
    assert "held out by question hash" in table["data"][str(mine)]
    assert "named as a test set" in table["data"][str(bench)]


@pytest.mark.parametrize("argv, says", [
    (["--benchmarks", "gsm9k"], "unknown benchmark 'gsm9k'"),
    (["--benchmarks", "nowhere/problems.jsonl"], "no file 'nowhere/problems.jsonl'"),
    (["--n", "0"], "--n=0"),
    (["--n", "4"], "--temperature 0 repeats"),
    (["--model", "gpt2"], "pass a local folder or a hub id"),
    (["--model", "nowhere/at/all"], "does not exist"),
    (["--data_dir", "nowhere"], "--data_dir='nowhere' is not a folder"),
])
def test_cli_bad_input_is_one_line_and_exit_code_2(argv, says, tiny_dir, capsys):
    argv = (["--model", tiny_dir] if "--model" not in argv else []) + argv
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err and "Traceback" not in err


def test_cli_unparsable_flag_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--n", "two"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "invalid int value: 'two'" in err and "Traceback" not in err  # argparse's own error


def test_cli_bad_input_as_a_process(tmp_path):
    """The one real `python eval.py` process: what only a process shows is its exit status and that
    nothing else reaches stderr (no traceback, no warning from an import) around the one-line error.
    --n 0 fails in run(), before the data and the model are loaded (the messages of every bad input
    are checked in-process above)."""
    proc = subprocess.run([sys.executable, "eval.py", "--n", "0", "--out", str(tmp_path / "x.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == "error: --n=0 must be >= 1 (completions per problem)\n"
