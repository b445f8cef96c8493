"""experiments/gpu_check.py on a CPU. The dry run of every part, end to end, in a subprocess with
one thread: the summary's shape (every part done, each run's warm-up step apart from its steady
ones, the fields each part reports) and the counts the check makes itself against train.py's own
log. In this process: a crash in a run shown with its traceback while the next part goes on, the
budget that starts no part whose estimate does not fit, the one-line errors, the FLOP count and
the card table by hand, and the docstring's estimates against the ones the budget uses. (Its calls
into torch.cuda: tests/test_cuda.py, under the strict fake.)"""
import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT, SHARED, requires_shared
from experiments import gpu_check
from machinery import sampling
import train

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
DATA = ["--tokenizer", str(SHARED / "tokenizers" / "qwen2.5"), "--data_dir", str(SHARED / "data")]
STEP = {"step", "seconds", "generation_s", "update_s", "fwd_bwd_s", "generation_share",
        "generated_tokens", "generated_tokens_per_s", "pad_share", "truncated", "rho_s", "rho_t",
        "kept", "rollouts", "fwd_bwd_tokens", "tokens_trained", "decoder_tokens_grad",
        "decoder_tokens_no_grad", "head_positions_grad", "head_positions_no_grad", "compiles",
        "cudagraph_records", "cudagraph_skips", "caches", "updates", "ratio_first", "ratio_min",
        "ratio_max", "clip_frac"}
HEADLINE = {"step_s", "generation_s", "update_s", "generation_share", "generated_tokens_per_s",
            "pad_share", "steady_steps", "warm_up_step_s", "compiles_first_step",
            "recompiles_after_first_step", "cudagraph_records_first_step",
            "rerecords_after_first_step", "caches_built_after_first_step", "cudagraph_skips",
            "evaluation_s", "compile", "auto", "predicted_gib", "peak_gib",
            "reserved_over_predicted", "out_of_memory_retries", "fits"}


@requires_shared
def test_the_dry_run_of_every_part(tmp_path):
    """Every part, 2 steps a run (one warm-up, one steady), 2 prompts x 4 rollouts of 16 tokens, on
    a 2-layer model of Qwen2.5's vocabulary: about 40 s on one thread."""
    out = tmp_path / "check"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "experiments/gpu_check.py", "--dry_run", *DATA,
                           "--out", str(out), "--steps", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    parts, runs = summary["parts"], summary["runs"]
    assert {k: v["status"] for k, v in parts.items()} == {p: "done" for p in gpu_check.PARTS}
    assert set(runs) == set(gpu_check.RUNS)
    assert any("every rollout runs to max_new_tokens" in n for n in summary["notes"])
    for label, r in runs.items():
        assert r["status"] == "done" and r["compile"]["failed"] == []
        assert r["warm_up"]["step"] == 0 and [s["step"] for s in r["steady"]] == [1]
        for s in [r["warm_up"]] + r["steady"]:
            assert set(s) == STEP
            # what the check counts itself is what train.py logs: the tokens forwarded with a
            # gradient, and the LM head's positions in the loss (train.py counts those of the
            # updates applied: float16's gradient scaler skips its first, an inf gradient)
            assert s["decoder_tokens_grad"] == s["fwd_bwd_tokens"] > 0
            assert s["head_positions_grad"] >= s["tokens_trained"] > 0
            assert s["head_positions_grad"] == s["tokens_trained"] or label == "float16"
            assert s["generated_tokens"] == 8 * 16 and s["rollouts"] == 8
        assert r["steady_median"]["update_s"] == gpu_check.sig(r["steady"][0]["update_s"], 4)
        assert r["command"].startswith("python train.py --model ")
    for name in ("loop", "hf", "grpo", "gib24", "gib16", "lora", "float16"):
        assert HEADLINE <= set(parts[name]), name
    assert set(parts["loop"]["targets"]) == {"generated_tokens_per_s >= 80000",
                                             "no recompile after the first step",
                                             "no CUDA-graph re-record after the first step"}
    # the loop's run evaluates (at its steps 0 and 2, the end), the others do not
    assert len(runs["d3s"]["evaluation_s"]) == 2 and runs["d3s-hf"]["evaluation_s"] == []
    assert set(parts["loop"]["targets"].values()) == {None}  # a dry run judges no target
    loop, hf = (runs[k]["steady_median"]["generation_s"] for k in ("d3s", "d3s-hf"))
    assert parts["hf"]["loop_over_hf_generation_s"] == round(loop / hf, 3)
    assert runs["d3s-hf"]["settings"]["generation"] == "hf"
    assert runs["d3s"]["settings"]["generation"] == "loop"
    # like for like: one micro-batch given; D3S at fixed ratios keeps round(rho_s x 8) rollouts
    rows = parts["compare"]["rows"]
    assert {k: v["kept"] for k, v in rows.items()} == {"grpo": 8, "d3s 0.25/0.2": 2,
                                                       "d3s 0.75/0.6": 6}
    assert rows["grpo"]["update_over_grpo"] == 1.0
    assert all(runs[k]["settings"]["micro_batch_size"] == 2
               for k in ("grpo", "d3s-0.25", "d3s-0.75", "grpo-tf32"))
    assert (runs["d3s-0.75"]["steady"][0]["rho_s"], runs["d3s-0.75"]["steady"][0]["rho_t"]) == \
        (0.75, 0.6)
    assert {k: runs[k]["card_gib"] for k in ("gib24", "gib16", "lora")} == \
        {"gib24": 24, "gib16": 16, "lora": 24}
    assert runs["lora"]["settings"]["lora_rank"] == 16
    assert runs["float16"]["settings"]["dtype"] == "float16"
    assert parts["float16"]["first_ratio_exactly_1"] is True
    cost = parts["update_cost"]
    assert set(cost["flops"]) == {"grpo", "d3s-0.25", "d3s-0.75", "grpo-tf32"}
    assert cost["bf16_peak_tflops"] == "unknown card"  # a CPU
    assert runs["grpo-tf32"]["tf32"] and not runs["grpo"]["tf32"]
    assert cost["tf32"]["with"]["first_ratio_exactly_1"] is True
    log = (out / "gpu_check.log").read_text()
    assert all(f"== {p}: " in log for p in gpu_check.PARTS) and "step    1 |" in log


@requires_shared
def test_a_crash_is_shown_with_its_traceback_and_the_next_part_goes_on(tmp_path, monkeypatch,
                                                                       capsys):
    """A run that crashes (here the first optimizer step, as a device-side assert would) is the
    part's error, with its type, message and traceback, in the log and summary.json; never a
    skip; and the next part runs. The decode step compiled (with the eager backend, as on a CPU
    the tests trace it): the next run compiles it again, as a new process would, in its first step
    and not after."""
    monkeypatch.setattr(sampling, "COMPILE", "eager")
    real, calls = train.optimizer_step, []

    def crash_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return real(*args)
    monkeypatch.setattr(train, "optimizer_step", crash_once)
    out = tmp_path / "check"
    assert gpu_check.main(["--dry_run", *DATA, "--out", str(out), "--steps", "2", "--parts",
                           "grpo,float16"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    error = summary["parts"]["grpo"]["runs_failed"]["grpo"]
    assert summary["parts"]["grpo"]["status"] == "error"
    assert (error["type"], error["message"]) == ("RuntimeError",
                                                 "CUDA error: device-side assert triggered")
    assert "optimizer_step" in "".join(error["traceback"])
    float16 = summary["parts"]["float16"]
    assert float16["status"] == "done" and float16["compile"] == {"mode": "eager", "failed": []}
    assert (float16["compiles_first_step"], float16["recompiles_after_first_step"]) == (1, 0)
    assert summary["parts"]["loop"] == {"status": "not selected"}
    log = (out / "gpu_check.log").read_text()
    assert "run grpo: ERROR RuntimeError: CUDA error: device-side assert triggered" in log
    assert "run grpo: ERROR RuntimeError" in capsys.readouterr().out
    assert train.score.__module__ == "reward"  # train.py's names are its own again


@requires_shared
def test_the_loop_part_counts_what_evaluations_cost_the_decode_step(tmp_path, monkeypatch):
    """The loop's run with the decode step compiled (the eager backend, as on a CPU), 3 steps,
    evaluating at steps 0 and 2 and at its end: its two graphs (greedy, sampled) are compiled and
    its two caches (4 evaluation rows, 8 rollouts) built in the first step, its evaluation
    included, and nothing after, the evaluation at step 2 included. No CUDA graph on a CPU."""
    monkeypatch.setattr(sampling, "COMPILE", "eager")
    out = tmp_path / "check"
    assert gpu_check.main(["--dry_run", *DATA, "--out", str(out), "--steps", "3", "--parts",
                           "loop"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    loop, run = summary["parts"]["loop"], summary["runs"]["d3s"]
    assert loop["status"] == "done" and len(loop["evaluation_s"]) == 3
    assert (loop["compiles_first_step"], loop["recompiles_after_first_step"],
            loop["caches_built_after_first_step"]) == (2, 0, 0)
    assert (run["warm_up"]["caches"], [s["caches"] for s in run["steady"]]) == (2, [0, 0])
    assert (loop["cudagraph_records_first_step"], loop["rerecords_after_first_step"],
            loop["cudagraph_skips"]) == (0, 0, 0)


@requires_shared
def test_no_part_starts_past_the_budget(tmp_path):
    """Without --dry_run, on a CPU: with 50 s of budget no part's estimate fits (the smallest is 55
    s), so none starts (nor builds a model), each saying why; --dry_run --budget 0 the same."""
    out = tmp_path / "check"
    assert gpu_check.main([*DATA, "--out", str(out), "--budget", "50"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for name, part in summary["parts"].items():
        need = gpu_check.estimate(name, {}, {})
        assert part["status"] == "not started" and summary["estimate_s"][name] == need
        assert re.fullmatch(rf"--budget 50 s: \d+ s spent, its estimate {need} s more",
                            part["why"])
    assert summary["runs"] == {} and sorted(os.listdir(out)) == ["gpu_check.log", "summary.json"]
    assert gpu_check.main(["--dry_run", *DATA, "--out", str(out), "--budget", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {p["status"] for p in summary["parts"].values()} == {"not started"}


@pytest.mark.parametrize("argv, line", [
    (["--parts", "loop,gpu"], "error: --parts gpu: no such part; use some of loop, hf, grpo, "
                              "compare, gib24, gib16, lora, float16, update_cost"),
    (["--steps", "1"], "error: --steps 1: at least 2 (the first is warm-up)"),
    (["--lr", "x"], "error: argument --lr: invalid float value: 'x'")])
def test_bad_arguments_are_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [line]


@requires_shared
def test_a_tokenizer_that_is_not_there_is_one_line(tmp_path, capsys):
    assert gpu_check.main(["--tokenizer", str(tmp_path / "none"), "--data_dir",
                           str(SHARED / "data"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_the_update_flops_by_hand():
    """A 1-layer Qwen2 of V = 10, H = 4, I = 8, 2 heads of 2, 1 KV head: its layer has q 16, k and v
    8 each, their biases 4 + 2 + 2, o 16, the MLP 3 x 32, two norms 4 each (160), and the final
    norm 4: 164 weights; the head 40. 6 x 164 x 100 tokens with a gradient + 2 x 164 x 50 without
    + 6 x 40 x 20 head positions with + 2 x 40 x 30 without."""
    s = dict(vocab=10, hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, tied=True)
    fig = {"fwd_bwd_tokens": 100, "decoder_tokens_no_grad": 50, "head_positions_grad": 20,
           "head_positions_no_grad": 30}
    assert gpu_check.update_flops(s, fig) == (6 * 164 * 100 + 2 * 164 * 50
                                              + 6 * 40 * 20 + 2 * 40 * 30)
    untied = gpu_check.update_flops(dict(s, tied=False), fig)
    assert untied == gpu_check.update_flops(s, fig)  # an untied head is counted as the head


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", None), ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", None)])
def test_the_bf16_peak_by_name(name, peak):
    assert gpu_check.bf16_peak(name) == peak


def test_the_docstring_says_the_estimates_the_budget_uses():
    """Each part's seconds in the module docstring are estimate()'s, with the parts before it
    done, in PARTS' order; and their sum."""
    said = {m[1]: int(m[2]) for m in re.finditer(r"^  (\w+)\s.*?(\d+)$", gpu_check.__doc__, re.M)
            if m[1] in gpu_check.PARTS}
    done, built, need = set(), set(), {}
    for name, (runs, _) in gpu_check.PARTS.items():
        need[name] = gpu_check.estimate(name, done, built)
        done |= set(runs)
        built |= {gpu_check.RUNS[r][0] for r in runs}
    assert said == need
    assert f"All parts: about {sum(need.values())} s." in gpu_check.__doc__
    first_four = sum(need[p] for p in ("loop", "hf", "grpo", "compare"))
    assert f"the first four parts take {first_four} s" in " ".join(gpu_check.__doc__.split())
    assert gpu_check.median([1, None, 3, 2.5]) == 2.5 == statistics.median([1, 3, 2.5])
