"""Memory: run.fit's halvings when a pass runs out of memory (raised from a hook on the tiny world's
model, as a CUDA card raises it), and the `auto` knobs that size a run to a GPU before it starts
(machinery/memory.py's choice, simulated on the CPU through the free memory it is given)."""
import json

import pytest
import torch

import train
from conftest import exit_2, rows, weights
from machinery import config, memory
from machinery.data import format_prompt, load_problems
from machinery.run import Run, out_of_memory
from rollout import generate_groups

SMALL = dict(steps=2, prompts_per_step=2, group_size=4, eval_size=2, eval_every=0, save_every=0,
             lr=1e-4)
PICKED = ("step", "reward", "kept", "tokens", "valid")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def run(tmp_path, name, model, **kw):
    lines = []
    train.train(train.Config(model=model, out_dir=str(tmp_path / name), **{**SMALL, **kw}),
                log=lines.append)
    return lines, tmp_path / name


def recorded(run_dir):
    """What RUN/resumes.jsonl holds: each change the run made, and why."""
    path = run_dir / "resumes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def memory_of(monkeypatch, too_big, error="CUDA out of memory. Tried to allocate 20.00 GiB"):
    """train.py's model raises CUDA's out-of-memory error (or, for another message, the RuntimeError
    a CUDA library raises) from a hook on its decoder wherever too_big(decoder, rows) says so;
    returns the list of the forwards it refused."""
    real, refused = train.load_model, []

    def load(*a, **k):
        model, tokenizer = real(*a, **k)

        def check(module, args, kwargs):
            if too_big(module, kwargs["input_ids"].shape[0]):
                refused.append(kwargs["input_ids"].shape[0])
                raise (torch.OutOfMemoryError if error.startswith("CUDA out of memory")
                       else RuntimeError)(error)
        model.get_decoder().register_forward_pre_hook(check, with_kwargs=True)
        return model, tokenizer
    monkeypatch.setattr(train, "load_model", load)
    return refused


def same_run(a, b):
    """Two runs computed the same: their steps' counts and, up to float rounding, their weights."""
    assert [[r[k] for k in PICKED] for r in rows(a)] == [[r[k] for k in PICKED] for r in rows(b)]
    w_a, w_b = weights(a / "checkpoint"), weights(b / "checkpoint")
    assert all(torch.allclose(w_a[k], w_b[k], atol=1e-5) for k in w_a)


# ----------------------------------------------------------------------------- out of memory


def test_generation_halves_its_rows_even_within_a_group(tmp_path, tiny_dir, monkeypatch):
    """A card that holds 2 rows of generation, under G = 4: 8 rollouts a call go to 4 (one group),
    then to 2 (half a group: the loop still prefills that prompt once), and the run finishes;
    each change is recorded once, and the run computes what one given --gen_batch_size 2 (or the
    hf engine) computes."""
    refused = memory_of(monkeypatch, lambda m, n: n > 2 and not torch.is_grad_enabled())
    lines, run_dir = run(tmp_path, "oom", tiny_dir, updates_per_batch=1)
    assert recorded(run_dir) == [
        {"step": 0, "changed": {"gen_batch_size": [0, 4]}, "why": "out of memory"},
        {"step": 0, "changed": {"gen_batch_size": [4, 2]}, "why": "out of memory"}]
    assert refused == [8, 4]  # the decode step of 8 rows (its prefill: 2 prompts), then of 4
    assert "out of memory: --gen_batch_size 4 -> 2, the pass redone (generation; nothing " \
           "computed changes)" in lines
    saved = json.load(open(run_dir / "config.json"))
    assert (saved["generation"], saved["gen_batch_size"]) == ("loop", 2)
    monkeypatch.undo()
    for name, engine in (("smaller", "loop"), ("hf", "hf")):
        _, other = run(tmp_path, name, tiny_dir, updates_per_batch=1, generation=engine,
                       gen_batch_size=2)
        same_run(run_dir, other)  # the sampler draws the same samples at any batch and engine


def test_a_lower_micro_batch_re_splits_every_later_mini_batch(tmp_path, tiny_dir, monkeypatch):
    """K = 2 mini-batches of 4 rollouts each, 3 of the first with A != 0 (the one with A = 0 is not
    forwarded), a card that holds 2 rows in a gradient pass: the first mini-batch's pass goes
    3 -> 1 row, and the second and every later step are split at 1 from the setting, so no pass
    runs out twice and the record only goes down."""
    refused = memory_of(monkeypatch, lambda m, n: n > 2 and torch.is_grad_enabled())
    lines, run_dir = run(tmp_path, "oom", tiny_dir, method="grpo", updates_per_batch=2)
    assert [(r["changed"], r["why"]) for r in recorded(run_dir)] == [
        ({"micro_batch_size": [128, 1]}, "out of memory")]  # at the first step with an update
    assert refused == [3]
    assert json.load(open(run_dir / "config.json"))["micro_batch_size"] == 1
    monkeypatch.undo()
    _, smaller = run(tmp_path, "smaller", tiny_dir, method="grpo", updates_per_batch=2,
                     micro_batch_size=1)
    same_run(run_dir, smaller)


def test_the_chunk_halves_at_a_micro_batch_of_1_then_checkpointing_turns_on(tmp_path, tiny_dir,
                                                                            monkeypatch):
    """A card on which a gradient pass fits only with gradient checkpointing: the micro-batch
    halves to 1, then the log-prob chunk to memory.MIN_CHUNK positions, then checkpointing turns
    on, in that order, each recorded once; the run ends as one started with those settings."""
    memory_of(monkeypatch, lambda m, n: torch.is_grad_enabled() and not m.gradient_checkpointing)
    lines, run_dir = run(tmp_path, "oom", tiny_dir, method="grpo", updates_per_batch=2)
    changes = [r["changed"] for r in recorded(run_dir)]
    knobs = [k for c in changes for k in c]
    micro = [c["micro_batch_size"] for c in changes if "micro_batch_size" in c]
    chunk = [c["logprob_chunk"] for c in changes if "logprob_chunk" in c]
    assert knobs == sorted(knobs, key=["micro_batch_size", "logprob_chunk",
                                       "gradient_checkpointing"].index)
    assert micro[0][0] == 128 and micro[-1][1] == 1
    assert all(a[1] == b[0] and a[1] < a[0] for a, b in zip(micro, micro[1:]))  # only down
    assert chunk[0][0] == 4096 and chunk[-1][1] == memory.MIN_CHUNK
    assert changes[-1] == {"gradient_checkpointing": [False, True]}
    saved = json.load(open(run_dir / "config.json"))
    assert (saved["micro_batch_size"], saved["logprob_chunk"], saved["gradient_checkpointing"]) \
        == (1, memory.MIN_CHUNK, True)
    monkeypatch.undo()
    _, smaller = run(tmp_path, "smaller", tiny_dir, method="grpo", updates_per_batch=2,
                     micro_batch_size=1, logprob_chunk=memory.MIN_CHUNK,
                     gradient_checkpointing=True)
    same_run(run_dir, smaller)


def test_the_held_out_evaluation_halves_through_run_fit_and_keeps_it(tmp_path, tiny_dir,
                                                                     monkeypatch):
    """An evaluation that runs out of memory lowers --gen_batch_size through run.fit: recorded,
    and every later evaluation starts from it, so it runs out once, not at every evaluation."""
    real, evaluating = train.evaluate, []

    def evaluate(*a, **k):
        evaluating.append(1)
        try:
            return real(*a, **k)
        finally:
            evaluating.pop()
    monkeypatch.setattr(train, "evaluate", evaluate)
    refused = memory_of(monkeypatch, lambda m, n: n > 2 and evaluating)
    lines, run_dir = run(tmp_path, "oom", tiny_dir, eval_size=4, eval_every=1)
    assert refused == [4]  # three evaluations, one halving
    assert recorded(run_dir) == [
        {"step": 0, "changed": {"gen_batch_size": [0, 2]}, "why": "out of memory"}]
    assert "out of memory: --gen_batch_size 0 -> 2, the pass redone (the held-out evaluation; " \
           "nothing computed changes)" in lines
    monkeypatch.undo()
    _, smaller = run(tmp_path, "smaller", tiny_dir, eval_size=4, eval_every=1, gen_batch_size=2)
    history = [torch.load(d / "checkpoint" / "trainer.pt", weights_only=False)["history"]
               for d in (run_dir, smaller)]
    assert history[0] == history[1] and len(history[0]) == 3


def test_eval_py_lowers_its_batch_by_the_same_rule(tiny_dir, capsys):
    """eval.py keeps its own --batch_size and lowers it by memory.halve: 16 rows (two problems' 8
    samples) on a card that holds 4 go to 8, then to 4 (half a problem's samples a call), with the
    same samples."""
    from eval import evaluate
    model, tokenizer = train.load_model(tiny_dir, device="cpu")
    problems = load_problems("tiny", "test")[:3]
    want = evaluate(model, tokenizer, problems, n=8, temperature=1.0, max_new_tokens=16, seed=0,
                    batch_size=4)["records"]
    refused = []

    def check(module, args, kwargs):
        if kwargs["input_ids"].shape[0] > 4:
            refused.append(kwargs["input_ids"].shape[0])
            raise torch.OutOfMemoryError("CUDA out of memory")
    model.get_decoder().register_forward_pre_hook(check, with_kwargs=True)
    got = evaluate(model, tokenizer, problems, n=8, temperature=1.0, max_new_tokens=16, seed=0,
                   batch_size=16)["records"]
    assert got == want and refused == [16, 8]
    assert capsys.readouterr().err.splitlines() == [
        "eval: out of memory: --batch_size 16 -> 8, the batch redone",
        "eval: out of memory: --batch_size 8 -> 4, the batch redone"]


def test_fit_is_told_the_pass_and_never_hides_the_error(tmp_path, tiny_dir):
    """run.fit takes the pass by name and calls fn again with the setting lowered in cfg: a
    generate call that passes its batch size positionally is halved like any other (it was taken
    for micro-batch pieces, and an AttributeError hid the out-of-memory error). When nothing is
    left to lower, the out-of-memory error itself ends the run, with the stop's line."""
    cfg = train.Config(model=tiny_dir, out_dir=str(tmp_path / "run"), steps=1,
                       prompts_per_step=4, group_size=4)
    asked = []
    with pytest.raises(config.Stop) as stop:
        with Run(cfg, None, lambda *a: None) as run:
            model, tokenizer = train.load_model(run.weights, device="cpu")
            problems = load_problems(run.cfg.dataset, "train")[:4]
            run.begin(model, tokenizer, train.make_optimizer(model, run.cfg), problems, problems)
            prompts = [format_prompt(tokenizer, r["prompt"]) for r in problems]

            def generate():
                asked.append(run.cfg.gen_batch_size)
                if len(asked) < 3:
                    raise torch.OutOfMemoryError("CUDA out of memory")
                return generate_groups(model, tokenizer, prompts, 4, 8, 1.0, 1.0,
                                       run.cfg.gen_batch_size)
            out = run.fit("generation", lambda: generate())
            assert asked == [0, 8, 4] and len(out.texts) == 16  # 16 rows -> 8 -> 4

            def never():
                raise torch.OutOfMemoryError("CUDA out of memory")
            run.fit("evaluation", never)  # 4 held-out rows -> 2 -> 1 -> nothing left
    assert str(stop.value).startswith("out of memory at step 0 in the held-out evaluation, even at "
                                      "--gen_batch_size 1; ")


def test_the_stop_names_the_knob_that_would_help():
    """The out-of-memory stop: in a pass with nothing left to lower, what it ran at and what a new
    run would need (LoRA where the knob exists, a shorter max_new_tokens); outside the passes
    run.fit sizes, the knobs that change nothing computed, halved."""
    cfg = config.resolve(train.Config(model="Qwen2.5-0.5B", generation="hf", gen_batch_size=1,
                                      micro_batch_size=1, logprob_chunk=16, lora_rank=16,
                                      out_dir="out/d3s-Qwen2.5-0.5B",
                                      gradient_checkpointing=True, device="cpu"))
    line = out_of_memory(cfg, 3, 2, "generation")
    assert line.startswith("out of memory at step 3 in generation, even at --generation hf "
                           "--gen_batch_size 1; the checkpoint holds the steps before 2 (--model "
                           "out/d3s-Qwen2.5-0.5B/checkpoint starts a new run from them); what "
                           "would help: a new run with ")
    assert "a shorter --max_new_tokens" in line and "--lora_rank" not in line  # LoRA already
    cfg.lora_rank = 0  # every weight trains: LoRA would help
    assert "--lora_rank 16" in out_of_memory(cfg, 3, 2, "generation")
    line = out_of_memory(cfg, 3, None, "update")
    assert "in an update, even at --micro_batch_size 1 --logprob_chunk 16 " \
           "--gradient_checkpointing true; no checkpoint yet;" in line
    outside = out_of_memory(config.resolve(train.Config(model="Qwen2.5-0.5B", device="cpu")), 3, 2)
    assert ("continue with less memory per pass: python train.py --resume out/d3s-Qwen2.5-0.5B "
            "--micro_batch_size 8 --gen_batch_size 128 --logprob_chunk 2048 "
            "--gradient_checkpointing true") in outside


@pytest.mark.filterwarnings("error::FutureWarning")
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_checkpointing_turns_on_without_a_deprecation_warning(tmp_path, tiny_dir, monkeypatch, lora_rank):
    """transformers 5.24 deprecates gradient_checkpointing_enable (removed in v6) for
    activation_checkpointing_enable, which train.py and an out-of-memory halving call, on a model and
    on PEFT's LoRA model alike: no FutureWarning (an error here)."""
    memory_of(monkeypatch, lambda m, n: torch.is_grad_enabled() and not m.gradient_checkpointing)
    lines, run_dir = run(tmp_path, "oom", tiny_dir, method="grpo", lora_rank=lora_rank,
                         micro_batch_size=1, logprob_chunk=memory.MIN_CHUNK)
    assert recorded(run_dir)[-1]["changed"] == {"gradient_checkpointing": [False, True]}
    monkeypatch.undo()
    run(tmp_path, "on", tiny_dir, lora_rank=lora_rank, steps=1, gradient_checkpointing=True)


# ----------------------------------------------------------------------------- auto


def test_a_cuda_less_run_keeps_todays_values(tmp_path, tiny_dir):
    """Without CUDA, auto is the CPU's value: tiny 128 / real 16, 0, 4096, false, as before; a
    tiny run records exactly these, says nothing about memory and records no change."""
    want = dict(gen_batch_size=0, logprob_chunk=4096, gradient_checkpointing=False)
    for model, micro in (("tiny", 128), ("Qwen2.5-0.5B", 16)):
        for given in ({"model"}, {"model", "micro_batch_size", "gradient_checkpointing"}):
            got = config.resolve(train.Config(model=model), given)  # unset, or "auto" given
            assert {k: getattr(got, k) for k in memory.KNOBS} == dict(want, micro_batch_size=micro)
    lines, run_dir = run(tmp_path, "cpu", tiny_dir, steps=1)
    saved = json.load(open(run_dir / "config.json"))
    assert {k: saved[k] for k in memory.KNOBS} == dict(want, micro_batch_size=128)
    assert not any("memory auto" in line for line in lines) and recorded(run_dir) == []


def gpu(monkeypatch, free):
    """A CUDA run simulated on the CPU: the knobs stay `auto` and memory.free_bytes says `free`."""
    monkeypatch.setattr(config, "on_gpu", lambda cfg: True)
    monkeypatch.setattr(memory, "free_bytes", lambda device: free)


def test_auto_sizes_the_knobs_says_so_and_records_it(tmp_path, tiny_dir, monkeypatch):
    """On a GPU the four knobs are sized before the run starts, for its model, its longest prompt,
    max_new_tokens and method: the run uses what memory.choose picks for the memory free, says it
    in one of its first lines and records it, and a number given wins."""
    shape = memory.shape_of(train.load_model(tiny_dir, device="cpu")[0].config)
    probe = config.resolve(train.Config(model=tiny_dir, device="cpu", **SMALL))
    tok = train.load_model(tiny_dir, device="cpu")[1]
    longest = max(len(tok(format_prompt(tok, r["prompt"]), add_special_tokens=False)["input_ids"])
                  for split in ("train", "test") for r in load_problems("tiny", split)
                  [:None if split == "train" else SMALL["eval_size"]])
    job = memory.job_of(probe, longest)
    need = {micro: memory.predict(shape, dict(micro_batch_size=micro, gen_batch_size=0,
                                              logprob_chunk=4096, gradient_checkpointing=False),
                                  job)["peak"] for micro in (128, 64)}
    assert need[64] < need[128]
    free = memory.RESERVE_GIB * memory.GiB + (1 + memory.HEADROOM) * need[64] + 1  # 64 fits
    want = memory.choose(shape, job, free, ceiling=128)
    assert want["micro_batch_size"] < 128  # 128 does not fit at any chunk or generation size
    gpu(monkeypatch, free)
    lines, run_dir = run(tmp_path, "gpu", tiny_dir, steps=1)
    saved = json.load(open(run_dir / "config.json"))
    assert {k: saved[k] for k in memory.KNOBS} == {k: want[k] for k in memory.KNOBS}
    line = memory.describe(want, free, memory.KNOBS)
    assert line in lines[:6] and line.startswith(f"memory auto: micro-batch "
                                                 f"{want['micro_batch_size']}, ")
    assert recorded(run_dir) == [{"step": 0, "why": line,
                                  "changed": {k: ["auto", want[k]] for k in memory.KNOBS}}]
    lines, run_dir = run(tmp_path, "given", tiny_dir, steps=1, micro_batch_size=128)
    saved = json.load(open(run_dir / "config.json"))
    assert saved["micro_batch_size"] == 128 and "(micro-batch 128, given)" in "".join(lines[:6])


def test_nothing_that_fits_is_one_line_before_any_step(tmp_path, tiny_dir, monkeypatch, capsys):
    gpu(monkeypatch, memory.GiB // 2)  # less than the reserve
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, ["--model", tiny_dir, "--out_dir",
                                                str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --model {tiny_dir}, --max_new_tokens 32: the model does not "
                             "fit the 0.5 GiB free: even micro-batch 1 with gradient "
                             "checkpointing needs")
    assert not (tmp_path / "run").exists()  # a refused start leaves nothing


def test_help_reads_plainly(capsys):
    """--help shows auto beside the CPU's values; a flag takes a number or auto, else one line."""
    with pytest.raises(SystemExit):
        config.parse_args(train.Config, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--micro_batch_size INT|auto" in text and "--gradient_checkpointing BOOL|auto" in text
    assert "(gpu 'auto', tiny 128, real 16)" in text and "(gpu 'auto', default 4096)" in text
    cfg, given = config.parse_args(train.Config, ["--micro_batch_size", "auto",
                                                  "--gen_batch_size", "64"])
    assert (cfg.micro_batch_size, cfg.gen_batch_size) == ("auto", 64)
    assert "'foo' is not an integer; use one or auto" in exit_2(["--micro_batch_size", "foo"],
                                                               capsys)
    assert "'maybe' is not a boolean; use true, false or auto" in exit_2(
        ["--gradient_checkpointing", "maybe"], capsys)


# ----------------------------------------------------------------------------- what a halving keeps


def selected(monkeypatch):
    """Every step's token selection (d3s.select_tokens' masks), as train.py makes them."""
    real, masks = train.d3s.select_tokens, []
    monkeypatch.setattr(train.d3s, "select_tokens",
                        lambda *a, **k: masks.append(real(*a, **k)) or masks[-1])
    return masks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_halving_in_step_7_keeps_the_tokens_step_6_selects(tmp_path, tiny_dir, monkeypatch, dtype):
    """Token selection reads the sampler's entropy, recorded at step 1, before any forward of the
    update: out of memory in step 7 re-splits the micro-batches, and the same tokens are selected,
    in float32 and under bf16 weights alike. Two steps: beyond, bf16 weights updated from other
    micro-batches can round apart."""
    masks = selected(monkeypatch)
    refused = memory_of(monkeypatch, lambda m, n: n > 2 and torch.is_grad_enabled())
    lines, _ = run(tmp_path, "oom", tiny_dir, updates_per_batch=1, prompts_per_step=4, dtype=dtype)
    assert refused and any(line.startswith("out of memory: --micro_batch_size") for line in lines)
    monkeypatch.undo()
    plain = selected(monkeypatch)
    run(tmp_path, "plain", tiny_dir, updates_per_batch=1, prompts_per_step=4, dtype=dtype)
    assert len(masks) == len(plain) == 2 and sum(int(m.sum()) for m in masks) > 50
    assert all(torch.equal(a, b) for a, b in zip(masks, plain))


# ----------------------------------------------------------------------------- a CUDA library's failure

CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


def test_what_counts_as_out_of_memory():
    """torch's own error, and a CUDA library's failed allocation, which torch raises as a RuntimeError;
    no other error."""
    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    for message in (CUBLAS, "CUDA error: out of memory", "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
                    "cuDNN Frontend error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"):
        assert memory.is_out_of_memory(RuntimeError(message)), message
    for error in (RuntimeError("CUDA error: device-side assert triggered"), ValueError("CUDA out of memory"),
                  RuntimeError("mat1 and mat2 shapes cannot be multiplied")):
        assert not memory.is_out_of_memory(error), error


def test_a_cublas_failure_is_retried_and_any_other_error_is_not(tmp_path, tiny_dir, monkeypatch):
    """run.fit and eval.py's halving take a cuBLAS allocation failure for what it is, out of memory (it
    ended the run without a checkpoint); an error that is not one goes through at once."""
    refused = memory_of(monkeypatch, lambda m, n: n > 2 and torch.is_grad_enabled(), CUBLAS)
    lines, run_dir = run(tmp_path, "cublas", tiny_dir, method="grpo", updates_per_batch=2)
    assert refused == [3] and [(r["changed"], r["why"]) for r in recorded(run_dir)] == [
        ({"micro_batch_size": [128, 1]}, "out of memory")]
    monkeypatch.undo()
    from eval import evaluate
    model, tokenizer = train.load_model(tiny_dir, device="cpu")
    problems = load_problems("tiny", "test")[:2]
    want = evaluate(model, tokenizer, problems, max_new_tokens=8, batch_size=1)["records"]
    model.get_decoder().register_forward_pre_hook(
        lambda m, a, k: (_ for _ in ()).throw(RuntimeError(CUBLAS)) if k["input_ids"].shape[0] > 1
        else None, with_kwargs=True)
    assert evaluate(model, tokenizer, problems, max_new_tokens=8, batch_size=2)["records"] == want
    memory_of(monkeypatch, lambda m, n: True, "CUDA error: device-side assert triggered")
    with pytest.raises(RuntimeError, match="^CUDA error: device-side assert triggered$"):
        run(tmp_path, "other", tiny_dir)


def test_a_cublas_failure_outside_the_passes_stops_with_a_checkpoint(tmp_path, tiny_dir, monkeypatch):
    """Out of memory where nothing can be lowered (the optimizer's step), as cuBLAS says it: the run
    stops as after torch's own error, the steps applied saved, with the line that says what helps."""
    def optimizer_step(*a):
        raise RuntimeError(CUBLAS)
    monkeypatch.setattr(train, "optimizer_step", optimizer_step)
    with pytest.raises(config.Stop) as stop:
        run(tmp_path, "stop", tiny_dir, method="grpo", updates_per_batch=2)
    step = torch.load(tmp_path / "stop" / "checkpoint" / "trainer.pt", weights_only=False)["step"]
    assert step in (0, 1) and str(stop.value).startswith(f"out of memory at step {step}; the checkpoint holds the steps "
                                      f"before {step}; continue with less memory per pass: ")
