"""checkpoint.py: a run stopped at any moment resumes exactly. Each window a run can stop in (a signal
at a step's start, inside a batch's updates, during an evaluation; a hard crash after a periodic save;
a crash or power cut during the save) is forced, the run is resumed, and it is compared with the
uninterrupted run row by row (rewards, counts, losses, evaluations) and in the final weights."""
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from machinery import checkpoint, config, plots
import train
from conftest import ROOT, exit_2, rows, weights
from machinery.model import load_model

# K = 2 (the mini-batch shuffle draws random numbers), an evaluation after every step, a checkpoint every 2
KW = dict(steps=3, prompts_per_step=4, group_size=4, eval_size=4, eval_every=1, save_every=2, updates_per_batch=2,
          lr=1e-4, method="d3s")
COMPARED = ("step", "reward", "kept", "tokens", "valid", "losses", "grad_norm", "tokens_trained", "rho_s", "rho_t")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def trained(run_dir):
    """What a run left: its rows (the compared fields), its evaluations and its final weights (a LoRA run's:
    its adapters)."""
    history = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["history"]
    ckpt = run_dir / "checkpoint"
    final = load_file(ckpt / "adapter_model.safetensors") if (ckpt / "adapter_config.json").exists() else \
        weights(ckpt)
    return [{k: r[k] for k in COMPARED} for r in rows(run_dir)], history, final


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW), log=lambda *a: None)
    return trained(run_dir)


def stop_and_resume(tmp_path, tiny_dir, monkeypatch, name, when, stop=KeyboardInterrupt, kw=KW):
    """Run KW with train.<fn> wrapped: on its call number `when` (1-based), send this process SIGINT (a real
    signal, through the run's handler) or raise `stop` (an exception nothing catches: a hard crash). Then
    resume and return what the run left, and the step of the checkpoint the stop left."""
    real, calls = getattr(train, name), []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == when:
            if stop is KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise stop("simulated crash")
        return real(*a, **k)
    run_dir = tmp_path / "cut"
    monkeypatch.setattr(train, name, wrapped)
    with pytest.raises((KeyboardInterrupt, RuntimeError)):
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **kw), log=lambda *a: None)
    monkeypatch.undo()
    stopped_at = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"]
    train.train(train.Config(resume=str(run_dir)), log=lambda *a: None)
    return trained(run_dir), stopped_at, run_dir


def signal_at(proc, step, sig):
    """Read a train.py process's lines up to its line for `step`, then send it sig: those lines."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {step:4d} "):
            proc.send_signal(sig)
            break
    return lines


def same_run(got, want):
    (rows_a, hist_a, w_a), (rows_b, hist_b, w_b) = got, want
    assert rows_a == rows_b  # every step once, with the same numbers
    assert hist_a == hist_b  # the same evaluations, none missing
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def test_a_signal_at_the_start_of_a_step(tmp_path, tiny_dir, monkeypatch, uninterrupted):
    # batch_at is the first thing a step does: its third call is step 2, before any of its random numbers
    got, stopped_at, _ = stop_and_resume(tmp_path, tiny_dir, monkeypatch, "batch_at", 3)
    assert stopped_at == 2
    same_run(got, uninterrupted)


def test_a_signal_inside_a_batchs_updates_waits_for_the_batch(tmp_path, tiny_dir, monkeypatch, uninterrupted):
    # the first optimizer update of the run: the signal waits for that batch's second update and its log line
    first = next(r["step"] for r in uninterrupted[0] if r["losses"])
    got, stopped_at, _ = stop_and_resume(tmp_path, tiny_dir, monkeypatch, "optimizer_step", 1)
    assert stopped_at == first + 1 and len(uninterrupted[0][first]["losses"]) == 2
    same_run(got, uninterrupted)


def test_a_signal_during_an_evaluation_is_redone_on_resume(tmp_path, tiny_dir, monkeypatch, uninterrupted):
    got, stopped_at, _ = stop_and_resume(tmp_path, tiny_dir, monkeypatch, "held_out", 2)  # the one after step 0
    assert stopped_at == 1
    same_run(got, uninterrupted)
    assert [h["step"] for h in got[1]] == [0, 1, 2, 3]


def test_a_hard_crash_after_a_periodic_save_logs_each_step_once(tmp_path, tiny_dir, monkeypatch, uninterrupted):
    # checkpoint at step 2, step 2 logged, then the process dies in the evaluation of step 3 (no handler runs)
    got, stopped_at, run_dir = stop_and_resume(tmp_path, tiny_dir, monkeypatch, "held_out", 4, stop=RuntimeError)
    assert stopped_at == 2
    same_run(got, uninterrupted)
    cut = [json.loads(line)["step"] for line in (run_dir / "log.jsonl.cut").read_text().splitlines()]
    assert cut == [2]  # what the crashed run had logged past its checkpoint, kept aside


def test_a_signal_during_the_final_evaluation_is_recorded_on_resume(tmp_path, tiny_dir, monkeypatch, uninterrupted):
    """The last evaluation cut short: the resumed run redoes it and saves it, so trainer.pt's history has the
    final point, and a second --resume has nothing left to do."""
    got, stopped_at, run_dir = stop_and_resume(tmp_path, tiny_dir, monkeypatch, "held_out", 4)  # step 3 of 3
    assert stopped_at == 3
    same_run(got, uninterrupted)
    lines = []
    train.train(train.Config(resume=str(run_dir)), log=lines.append)
    assert not any(line.startswith("eval step") for line in lines)  # recorded: not evaluated again


def exit_now(code):
    raise SystemExit(code)


@pytest.fixture
def quit_now(monkeypatch):
    """A second signal quits with os._exit, which would end pytest too: here it raises
    SystemExit(code) from the handler instead, which nothing in the run catches. Returns how to
    do it again after a monkeypatch.undo()."""
    monkeypatch.setattr(os, "_exit", exit_now)
    return lambda mp: mp.setattr(os, "_exit", exit_now)


def test_two_sigterms_exit_with_sigterms_code(tmp_path, tiny_dir, monkeypatch, quit_now, capfd):
    """A second SIGTERM while the first waits for the step's updates quits at once, without saving,
    with SIGTERM's 143, and offers the fresh start that replaces the run, not --resume."""
    real = train.optimizer_step

    def twice(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    monkeypatch.setattr(train, "optimizer_step", twice)
    argv = ["--model", tiny_dir, "--out_dir", str(tmp_path / "run"), "--steps", "2",
            "--prompts_per_step", "4", "--group_size", "4", "--eval_size", "2",
            "--updates_per_batch", "2"]
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv)
    assert e.value.code == 143 and not (tmp_path / "run" / "checkpoint").exists()
    said = capfd.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("quit at once; no checkpoint was saved yet; start it again with: "), said
    offered = shlex.split(said.split("start it again with: ")[1])
    assert config.parse_args(train.Config, offered[2:]) == \
        config.parse_args(train.Config, argv + ["--overwrite", "true"])


def small_memory(monkeypatch, rows_that_fit):
    """train.py's model raises CUDA's out-of-memory error, from a hook on its decoder, on any
    forward of more than `rows_that_fit` rows: generation, the no-grad pass, the update alike."""
    real = train.load_model

    def load(*a, **k):
        model, tokenizer = real(*a, **k)

        def check(module, args, kwargs):
            if kwargs["input_ids"].shape[0] > rows_that_fit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        model.get_decoder().register_forward_pre_hook(check, with_kwargs=True)
        return model, tokenizer
    monkeypatch.setattr(train, "load_model", load)


def test_out_of_memory_is_retried_in_place_with_half_the_batch(tmp_path, tiny_dir, monkeypatch,
                                                                capsys):
    """Out of memory halves the generation batch or the micro-batches and redoes that pass, says so
    and records it: the run ends with the same rewards and evaluations and, up to float rounding,
    the same weights as a run started with the smaller setting."""
    small_memory(monkeypatch, 4)
    run_dir = tmp_path / "oom"
    argv = ["--model", tiny_dir, "--out_dir", str(run_dir)] + [f"--{k}={v}" for k, v in KW.items()]
    config.main(train.Config, train.train, argv)
    out = capsys.readouterr().out
    assert "out of memory: --gen_batch_size 0 -> 8, the pass redone" in out
    assert "out of memory: --gen_batch_size 8 -> 4, the pass redone" in out
    assert "out of memory: --micro_batch_size 128 -> " in out
    saved = json.load(open(run_dir / "config.json"))  # what a resume goes on with
    assert saved["gen_batch_size"] == 4 and saved["micro_batch_size"] <= 4
    changes = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert changes[0] == {"step": 0, "changed": {"gen_batch_size": [0, 8]}, "why": "out of memory"}
    monkeypatch.undo()
    smaller = tmp_path / "smaller"
    train.train(train.Config(model=tiny_dir, out_dir=str(smaller), gen_batch_size=4,
                             micro_batch_size=saved["micro_batch_size"], **KW), log=lambda *a: None)
    (rows_a, hist_a, w_a), (rows_b, hist_b, w_b) = trained(run_dir), trained(smaller)
    picked = ("step", "reward", "kept", "tokens", "valid")
    assert [[r[k] for k in picked] for r in rows_a] == [[r[k] for k in picked] for r in rows_b]
    assert hist_a == hist_b
    assert all(torch.allclose(w_a[k], w_b[k], atol=1e-5) for k in w_a)


def test_out_of_memory_with_a_batch_of_1_stops_with_a_checkpoint(tmp_path, tiny_dir, monkeypatch,
                                                                  capsys):
    small_memory(monkeypatch, 0)
    run_dir = tmp_path / "oom"
    argv = ["--model", tiny_dir, "--out_dir", str(run_dir)] + [f"--{k}={v}" for k, v in KW.items()]
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err  # the evaluation's halvings are on stdout
    assert err[-1].startswith("error: out of memory at step 0 in the held-out evaluation, even at "
                              "--gen_batch_size 1; the checkpoint holds the steps before 0 "
                              f"(--model {run_dir}/checkpoint starts a new run from them); "
                              "what would help: a new run with")


def test_out_of_memory_after_the_weights_moved_keeps_the_last_checkpoint(tmp_path, tiny_dir, monkeypatch, capsys):
    real, calls = train.optimizer_step, []

    def oom_in_the_second_update(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(*a, **k)
    monkeypatch.setattr(train, "optimizer_step", oom_in_the_second_update)
    argv = ["--model", tiny_dir, "--out_dir", str(tmp_path / "run")] + [f"--{k}={v}" for k, v in KW.items()]
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error: out of memory at step 0, before any checkpoint; start it "
                                                "again with less memory per pass: python train.py "), err
    assert not (tmp_path / "run" / "checkpoint").exists()  # half a batch is never saved
    # the command it offers: this run's flags, each memory knob halved, replacing the run
    offered = shlex.split(err.split("less memory per pass: ")[1].split(" (experiments/speed.md")[0])
    lower = ["--micro_batch_size", "64", "--gen_batch_size", "8", "--logprob_chunk", "2048",
             "--gradient_checkpointing", "true", "--overwrite", "true"]
    assert config.parse_args(train.Config, offered[2:]) == config.parse_args(train.Config, argv + lower)


def test_a_checkpoint_saved_on_a_gpu_resumes_on_the_cpu(tmp_path, tiny_dir, monkeypatch):
    """trainer.pt written with every tensor tagged as CUDA memory (as a GPU run saves its AdamW state):
    without map_location torch.load refuses it on a machine without a GPU; --resume continues."""
    def stop_after_step_0(line):  # a real Ctrl-C: the run stops at the step's end
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        with pytest.raises(KeyboardInterrupt):
            train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "gpu"), **KW), log=stop_after_step_0)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tmp_path / "gpu" / "checkpoint" / "trainer.pt", weights_only=False)
    train.train(train.Config(resume=str(tmp_path / "gpu"), device="cpu"), log=lambda *a: None)
    assert torch.load(tmp_path / "gpu" / "checkpoint" / "trainer.pt", weights_only=False)["step"] == KW["steps"]


def test_trim_log_keeps_the_checkpoints_steps(tmp_path):
    lines = [json.dumps({"step": s}) + "\n" for s in range(5)] + ['{"step": 5, "rew']  # cut off mid-line
    (tmp_path / "log.jsonl").write_text("".join(lines))
    checkpoint.trim_log(str(tmp_path), 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "log.jsonl").read_text().splitlines()] == [0, 1]
    assert (tmp_path / "log.jsonl.cut").read_text().splitlines() == [x.strip() for x in lines[2:]]
    checkpoint.trim_log(str(tmp_path), 2)  # nothing more to cut: unchanged
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2


# ----------------------------------------------------------------------------- the save itself


@pytest.fixture(scope="module")
def saved_parts(tiny_dir):
    model, tok = load_model(tiny_dir, device="cpu", dtype="float32")
    return model, tok, torch.optim.AdamW(model.parameters(), lr=1e-4)


def test_a_crash_at_any_point_of_the_checkpoint_swap_leaves_a_checkpoint(tmp_path, saved_parts, monkeypatch):
    """A crash at every filesystem operation of the swap: --resume must always find a complete
    checkpoint, the new one once it was completely written, else the previous one."""
    model, tok, opt = saved_parts
    (tmp_path / "config.json").write_text("{}")
    real_replace, real_rmtree, calls = os.replace, shutil.rmtree, []

    def crash_at(n):
        def counted(real):
            def op(*a, **k):
                calls.append(a[0])
                if len(calls) == n:
                    raise OSError("simulated crash")
                return real(*a, **k)
            return op
        monkeypatch.setattr(checkpoint.os, "replace", counted(real_replace))
        monkeypatch.setattr(checkpoint.shutil, "rmtree", counted(real_rmtree))

    for n in range(1, 20):
        real_rmtree(tmp_path / "checkpoint", ignore_errors=True)
        monkeypatch.undo()
        checkpoint.save(str(tmp_path), model, tok, opt, 1, [], 0)  # the previous checkpoint, step 1
        calls.clear()
        crash_at(n)
        try:
            checkpoint.save(str(tmp_path), model, tok, opt, 2, [], 0)
            crashed = False
        except OSError:
            crashed = True
        monkeypatch.undo()
        complete_new = crashed and len(calls) >= 1 and any(
            (tmp_path / d / "trainer.pt").is_file() and
            torch.load(tmp_path / d / "trainer.pt", weights_only=False)["step"] == 2
            for d in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
        _, state = checkpoint.load(str(tmp_path))
        assert state["step"] in (1, 2)
        if not crashed or complete_new:
            assert state["step"] == 2, n
        assert not (tmp_path / "checkpoint.tmp").exists() and not (tmp_path / "checkpoint.old").exists()
        if not crashed:
            break
    assert not crashed and n > 4  # every operation of the swap was crashed once


def test_the_new_checkpoint_is_on_disk_before_the_old_one_goes(tmp_path, saved_parts, monkeypatch):
    """Power loss: a rename can reach the disk before the data it names. Every file of the new checkpoint
    and its folder are flushed before trainer.pt, the marker that it is complete, is renamed into place;
    the marker's rename is flushed before the swap, the log before the swap, and the swap itself before
    checkpoint.old is removed."""
    model, tok, opt = saved_parts
    checkpoint.save(str(tmp_path), model, tok, opt, 1, [], 0)
    (tmp_path / "log.jsonl").write_text('{"step": 0}\n')
    events = []
    real_fsync, real_replace, real_rmtree = checkpoint.fsync, os.replace, shutil.rmtree
    rel = lambda p: os.path.relpath(p, tmp_path)  # noqa: E731
    monkeypatch.setattr(checkpoint, "fsync", lambda p: (events.append(("fsync", rel(p))), real_fsync(p)))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (events.append(("replace", rel(a), rel(b))),
                                                                 real_replace(a, b)))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda p, **k: (events.append(("rmtree", rel(p))),
                                                                     real_rmtree(p, **k)))
    checkpoint.save(str(tmp_path), model, tok, opt, 2, [], 0, world="tiny")
    marker = events.index(("replace", os.path.join("checkpoint.tmp", "trainer.pt.part"),
                           os.path.join("checkpoint.tmp", "trainer.pt")))
    swap = events.index(("replace", "checkpoint.tmp", "checkpoint"))
    before_marker = {e[1] for e in events[:marker] if e[0] == "fsync"}
    files = {os.path.join("checkpoint.tmp", f) for f in os.listdir(tmp_path / "checkpoint") if f != "trainer.pt"}
    assert "tiny.json" in os.listdir(tmp_path / "checkpoint")  # the run's world travels with its checkpoint
    assert files | {os.path.join("checkpoint.tmp", "trainer.pt.part"), "checkpoint.tmp"} <= before_marker
    assert ("fsync", "checkpoint.tmp") in events[marker:swap] and ("fsync", "log.jsonl") in events[:swap]
    drop = len(events) - 1 - events[::-1].index(("rmtree", "checkpoint.old"))  # the last: after the swap
    assert ("fsync", ".") in events[swap:drop]  # the renames are on disk before the old checkpoint goes


def test_a_power_cut_before_the_marker_keeps_the_good_checkpoint(tmp_path, saved_parts):
    """The state a power cut can leave mid-save: checkpoint.tmp with its files but no trainer.pt yet (the
    marker comes last). finish_swap must keep the good checkpoint and drop the half-written one."""
    model, tok, opt = saved_parts
    (tmp_path / "config.json").write_text("{}")
    checkpoint.save(str(tmp_path), model, tok, opt, 1, [], 0)
    shutil.copytree(tmp_path / "checkpoint", tmp_path / "checkpoint.tmp")
    (tmp_path / "checkpoint.tmp" / "trainer.pt").rename(tmp_path / "checkpoint.tmp" / "trainer.pt.part")
    (tmp_path / "checkpoint.tmp" / "model.safetensors").write_bytes(b"")  # its data never reached the disk
    _, state = checkpoint.load(str(tmp_path))
    assert state["step"] == 1 and not (tmp_path / "checkpoint.tmp").exists()
    assert (tmp_path / "checkpoint" / "model.safetensors").stat().st_size > 0


# ----------------------------------------------------------------------------- resuming: what may change


def test_resume_refuses_flags_that_would_change_the_run(tmp_path, tiny_dir, capsys):
    run_dir = tmp_path / "done"
    train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **{**KW, "steps": 1, "eval_every": 0}),
                log=lambda *a: None)
    err = exit_2(["--resume", str(run_dir), "--steps", "400", "--lr", "5e-4"], capsys)
    assert "--lr, --steps cannot change now" in err
    with pytest.raises(ValueError, match="--method cannot change now"):  # the API too
        train.train(train.Config(resume=str(run_dir), method="grpo"), log=lambda *a: None)
    # the safe ones are taken, even at their default values
    config.main(train.Config, train.train, ["--resume", str(run_dir), "--eval_every", "25", "--device", "cpu"])
    assert json.load(open(run_dir / "config.json"))["eval_every"] == 25


def test_a_copied_run_folder_resumes_in_itself(tmp_path, tiny_dir, capsys, uninterrupted):
    def stop_after_step_0(line):  # a real Ctrl-C: the run stops at the step's end
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "orig"), **KW), log=stop_after_step_0)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    before = sorted(p.name for p in (tmp_path / "orig").rglob("*"))
    train.train(train.Config(resume=str(tmp_path / "copy")), log=lambda *a: None)
    assert sorted(p.name for p in (tmp_path / "orig").rglob("*")) == before  # the original is untouched
    assert json.load(open(tmp_path / "copy" / "config.json"))["out_dir"] == str(tmp_path / "copy")
    same_run(trained(tmp_path / "copy"), uninterrupted)
    # a broken copy names the copy, not the original
    (tmp_path / "copy" / "checkpoint" / "trainer.pt").unlink()
    err = exit_2(["--resume", str(tmp_path / "copy")], capsys)
    assert str(tmp_path / "copy") in err and str(tmp_path / "orig") not in err


def test_an_incomplete_or_corrupt_run_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    assert "incomplete run folder" in exit_2(["--resume", str(tmp_path / "half")], capsys)
    (tmp_path / "half" / "checkpoint").mkdir()
    (tmp_path / "half" / "checkpoint" / "config.json").write_text("{}")
    (tmp_path / "half" / "checkpoint" / "trainer.pt").write_bytes(b"not a checkpoint")
    assert "is corrupt" in exit_2(["--resume", str(tmp_path / "half")], capsys)
    torch.save({"step": 1, "rng": {}}, tmp_path / "half" / "checkpoint" / "trainer.pt")  # the previous version's
    assert "written by another version" in exit_2(["--resume", str(tmp_path / "half")], capsys)


def test_real_processes_sigterm_saves_and_exits_143_bad_input_is_one_line(tmp_path, tiny_dir):
    """Two real `python train.py` processes, side by side (each mostly imports): one is stopped by SIGTERM
    after two steps; the other gets a bad flag and must print one line on stderr and nothing else."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    bad = subprocess.Popen([sys.executable, "train.py", "--s_final=2"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    out = tmp_path / "term"
    proc = subprocess.Popen([sys.executable, "train.py", "--model", tiny_dir, "--out_dir", str(out), "--steps", "500",
                             "--save_every", "1000", "--eval_every", "0", "--eval_size", "4", "--prompts_per_step", "2",
                             "--group_size", "4"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines = signal_at(proc, 1, signal.SIGTERM)  # two step lines, then what a scheduler sends
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, lines + [rest]
    assert "checkpoint saved after step" in rest and f"python train.py --resume {out}" in rest
    done = int(rest.split("checkpoint saved after step ")[1].split()[0])
    assert not any("\r" in line for line in lines)  # piped: plain lines, no progress bar
    step = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["step"]
    assert step >= 2 and len(rows(out)) == step and done == step - 1  # the last step logged is the last saved
    stdout, stderr = bad.communicate(timeout=120)
    assert (bad.returncode, stderr.strip(), stdout) == (2, "error: --s_final must be in (0, 1], got 2.0", "")


# ----------------------------------------------------------------------------- one run per folder, and its stops


def test_a_folder_in_use_is_refused_at_once_and_a_killed_runs_lock_is_taken_over(tmp_path, tiny_dir, capsys,
                                                                                 monkeypatch):
    """A second train.py into the folder of a run still in its step-0 evaluation (the folder holds only
    config.json then) is refused at once, with one line, even with --overwrite true, and leaves the
    first run whole. A lock file whose process is gone is taken over. (The second run opens the lock
    file anew, so its flock meets the first's as another process's would: flocks belong to open
    files, not to processes.)"""
    run_dir, real, tried = tmp_path / "live", train.held_out, []

    def second_run_meanwhile(*a, **k):
        if not tried:  # the first evaluation of the first run: a second run starts into its folder
            tried.append(exit_2(["--model", tiny_dir, "--out_dir", str(run_dir), "--seed", "1", "--steps", "1",
                                 "--overwrite", "true"], capsys))
        return real(*a, **k)
    monkeypatch.setattr(train, "held_out", second_run_meanwhile)
    train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **{**KW, "steps": 1, "eval_every": 0}),
                log=lambda *a: None)
    assert "is in use by a train.py that is still running" in tried[0] and f"pid {os.getpid()}" in tried[0]
    assert json.load(open(run_dir / "config.json"))["seed"] == 0 and [r["step"] for r in rows(run_dir)] == [0]
    assert not (run_dir / "run.lock").exists()  # released on exit
    # a folder with only another run's config.json holds a run
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds another run"):
        checkpoint.check_fresh(str(tmp_path / "half"))
    # the lock file a killed run leaves (no process holds it) is taken over
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "run.lock").write_text("999999999\n")
    train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "stale"), **{**KW, "steps": 1, "eval_every": 0}),
                log=lambda *a: None)
    assert not (tmp_path / "stale" / "run.lock").exists()


def test_a_resumed_run_keeps_its_world_when_its_source_folder_is_gone(tmp_path, tiny_dir):
    source = tmp_path / "source"
    shutil.copytree(tiny_dir, source)

    def stop_after_step_0(line):  # a real Ctrl-C: the run stops at the step's end
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=str(source), out_dir=str(tmp_path / "run"),
                                 **{**KW, "steps": 2, "eval_every": 0, "eval_size": 2}), log=stop_after_step_0)
    shutil.rmtree(source)
    lines = []
    train.train(train.Config(resume=str(tmp_path / "run")), log=lines.append)
    assert "the tiny world's values" in lines[0]
    assert json.load(open(tmp_path / "run" / "checkpoint" / "tiny.json"))["world"] == "tiny"
    picked = config.resolve(train.Config(model=str(tmp_path / "run" / "checkpoint")), given={"model"})
    assert (picked.dataset, picked.lr, picked.max_new_tokens) == ("tiny", 5e-5, 32)


def test_a_refused_resume_records_no_change(tmp_path, tiny_dir, capsys):
    run_dir = tmp_path / "done"
    train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **{**KW, "steps": 1, "eval_every": 0}),
                log=lambda *a: None)
    assert "--micro_batch_size must be at least 1" in exit_2(["--resume", str(run_dir), "--micro_batch_size", "0"],
                                                             capsys)
    assert "--generation must be one of" in exit_2(["--resume", str(run_dir), "--generation", "bogus"], capsys)
    assert not (run_dir / "resumes.jsonl").exists()


def test_a_second_signal_during_a_save_quits_and_leaves_the_last_checkpoint(tmp_path, tiny_dir,
                                                                           monkeypatch, quit_now,
                                                                           uninterrupted):
    """SIGTERM inside step 1's updates: the step finishes and its checkpoint is written; a second
    SIGTERM during that save quits at once with SIGTERM's code, and the checkpoint of step 1 (a
    periodic one) stands: the half-written one is dropped on resume, which completes the run."""
    real_step, real_fsync, sent = train.optimizer_step, checkpoint.fsync, []

    def first_signal(*a, **k):
        if not sent and len(train_calls) == 1:
            sent.append("first")
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*a, **k)
    train_calls = []

    def count_steps(line):
        if line.startswith("step "):
            train_calls.append(line)

    def second_signal(path):
        if sent == ["first"]:  # the interrupt's own save
            sent.append("second")
            os.kill(os.getpid(), signal.SIGTERM)
        return real_fsync(path)
    monkeypatch.setattr(train, "optimizer_step", first_signal)
    monkeypatch.setattr(checkpoint, "fsync", second_signal)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **{**KW, "save_every": 1}),
                    log=count_steps)
    assert e.value.code == 143 and sent == ["first", "second"]
    monkeypatch.undo()
    assert checkpoint.load(str(run_dir))[1]["step"] == 1  # the last checkpoint, as it was
    assert not (run_dir / "checkpoint.tmp").exists()
    train.train(train.Config(resume=str(run_dir)), log=lambda *a: None)
    same_run(trained(run_dir), uninterrupted)


def test_a_signal_before_any_step_says_what_was_saved(tmp_path, tiny_dir, monkeypatch):
    real, lines = train.held_out, []

    def signal_in_the_first_evaluation(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    monkeypatch.setattr(train, "held_out", signal_in_the_first_evaluation)
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "run"), **KW), log=lines.append)
    said = lines[-1].strip()
    assert "step -1" not in said and "no step had finished" in said and "it resumes at step 0" in said, said
    assert torch.load(tmp_path / "run" / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 0


# ----------------------------------------------------------------------------- every stop safe


def argv_of(run_dir, tiny_dir, **kw):
    return ["--model", tiny_dir, "--out_dir", str(run_dir)] + \
        [f"--{k}={v}" for k, v in {**KW, **kw}.items()]


def test_a_signal_inside_a_library_never_loses_the_run(tmp_path, tiny_dir, monkeypatch,
                                                       uninterrupted):
    """SIGTERM while curves.png is drawn after step 1's evaluation. matplotlib's C++ turns a
    KeyboardInterrupt raised inside it into "ValueError: Invalid bounding box" (the wrapper does the
    same here): a handler that raises lost the run. A flag lets the drawing finish; the run stops at
    the next step's start with a checkpoint, exits 143, and resumes into the uninterrupted run."""
    real, sent = plots.plot_run, []

    def drawing(*a, **k):
        try:
            if not sent:
                sent.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)
        except KeyboardInterrupt:
            raise ValueError("Invalid bounding box") from None
    monkeypatch.setattr(plots, "plot_run", drawing)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv_of(run_dir, tiny_dir))
    assert e.value.code == 143
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 1
    monkeypatch.undo()
    train.train(train.Config(resume=str(run_dir)), log=lambda *a: None)
    same_run(trained(run_dir), uninterrupted)


def test_a_filesystem_without_flock_locks_by_pid(tmp_path, tiny_dir, monkeypatch, capsys):
    """flock refused by the filesystem (ENOLCK; EOPNOTSUPP on some NFS, CIFS and FUSE mounts): the
    run locks its folder with the pid file instead; only a live process's pid is "in use"."""
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    run_dir, one = tmp_path / "nfs", {"steps": 1, "eval_every": 0}
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, **one))
    assert [r["step"] for r in rows(run_dir)] == [0] and not (run_dir / "run.lock").exists()
    live = tmp_path / "live"
    live.mkdir()
    (live / "run.lock").write_text(f"{os.getppid()}\n")  # a live process that is not this one
    err = exit_2(argv_of(live, tiny_dir, **one), capsys)
    assert f"in use by a train.py that is still running (pid {os.getppid()})" in err
    assert (live / "run.lock").read_text() == f"{os.getppid()}\n"  # left to its holder
    (live / "run.lock").write_text("999999999\n")  # a dead one's: taken over
    config.main(train.Config, train.train, argv_of(live, tiny_dir, **one))
    assert [r["step"] for r in rows(live)] == [0] and not (live / "run.lock").exists()
    # a start refused after the lock leaves no folder it created, no run.lock
    exit_2(argv_of(tmp_path / "new", tiny_dir, dataset=str(tmp_path / "none.jsonl")), capsys)
    assert not (tmp_path / "new").exists()


def test_a_refused_start_leaves_the_folder_as_it_found_it(tmp_path, tiny_dir, monkeypatch, capsys):
    """--wandb without the wandb package is refused after the model loaded: a fresh folder is
    removed again (the same command without --wandb then runs), and --overwrite true keeps the run
    it would have replaced."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is missing
    run_dir, one = tmp_path / "run", {"steps": 1, "eval_every": 0}
    assert "pip install wandb" in exit_2(argv_of(run_dir, tiny_dir, wandb="proj", **one), capsys)
    assert not run_dir.exists()
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, **one))
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    exit_2(argv_of(run_dir, tiny_dir, wandb="proj", overwrite="true", seed=1, **one), capsys)
    assert {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_refused_resume_records_nothing(tmp_path, tiny_dir, monkeypatch, capsys):
    """A resume refused by the device or by wandb leaves resumes.jsonl and config.json as they were,
    so a plain --resume then runs."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    run_dir = tmp_path / "run"
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, steps=1, eval_every=0))
    saved = (run_dir / "config.json").read_text()
    refused = [["--wandb", "proj"]] + [["--device", "cuda"]] * (not torch.cuda.is_available())
    for flags in refused:
        exit_2(["--resume", str(run_dir), *flags], capsys)
        assert (run_dir / "config.json").read_text() == saved, flags
        assert not (run_dir / "resumes.jsonl").exists(), flags
    config.main(train.Config, train.train, ["--resume", str(run_dir)])


def test_a_second_signal_quits_at_once_without_saving(tmp_path, tiny_dir, monkeypatch, quit_now):
    """A second signal after the step's log line quits without saving (docs/checkpoints.md), with
    the first signal's code; so does one just after the interrupt's save (next test), not with 130,
    and it says how to continue."""
    real_step = train.optimizer_step

    def first_signal(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*a, **k)

    def second_at_the_step_line(line):
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(train, "optimizer_step", first_signal)
    run_dir = tmp_path / "line"
    with pytest.raises(BaseException) as e:  # a quit, not an interrupt's KeyboardInterrupt
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW),
                    log=second_at_the_step_line)
    assert e.type is SystemExit and e.value.code == 143 and not (run_dir / "checkpoint").exists()


def test_a_second_signal_after_the_interrupts_save_exits_with_the_first_signals_code(
        tmp_path, tiny_dir, monkeypatch, capfd, quit_now):
    """SIGTERM at step 0's start, its checkpoint saved, and SIGINT as the run says so: the exit
    code is SIGTERM's, and the command to continue is said."""
    real_batch, said = train.batch_at, []

    def first_at_the_step_start(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_batch(*a, **k)

    def second_after_the_save(line):
        if line.lstrip().startswith("interrupted"):
            os.kill(os.getpid(), signal.SIGINT)
        said.append(line)
    monkeypatch.setattr(train, "batch_at", first_at_the_step_start)
    run_dir = tmp_path / "save"
    capfd.readouterr()
    with pytest.raises(BaseException) as e:
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW),
                    log=second_after_the_save)
    assert e.type is SystemExit and e.value.code == 143  # SIGTERM's, the first
    assert f"python train.py --resume {run_dir}" in capfd.readouterr().err + "".join(said)
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 0


# ----------------------------------------------------------------------------- LoRA and float16 resume exactly


@pytest.mark.parametrize("extra", [dict(lora_rank=4), dict(dtype="float16"), dict(lora_rank=4, beta=0.1)],
                         ids=["lora", "float16", "lora-kl"])
@pytest.mark.parametrize("name, when, stop", [("optimizer_step", 1, KeyboardInterrupt),
                                              ("held_out", 4, RuntimeError)], ids=["signal", "crash"])
def test_a_lora_or_float16_run_resumes_bit_for_bit(tmp_path, tiny_dir, monkeypatch, extra, name, when, stop):
    """A LoRA run (its adapters, their AdamW moments; with a KL term, the base under them as the reference) and
    a float16 run (its gradient scale, in trainer.pt) stopped inside a batch's updates, or crashed after the
    checkpoint of step 2 and resumed from it: every row, evaluation and weight as the run never stopped."""
    kw = {**KW, **extra}
    full = tmp_path / "full"
    train.train(train.Config(model=tiny_dir, out_dir=str(full), **kw), log=lambda *a: None)
    got, stopped_at, run_dir = stop_and_resume(tmp_path, tiny_dir, monkeypatch, name, when, stop, kw)
    assert stopped_at == (2 if stop is RuntimeError else next(r["step"] for r in rows(full) if r["losses"]) + 1)
    same_run(got, trained(full))
    assert any(r["updates"] for r in rows(full))
    scales = [torch.load(d / "checkpoint" / "trainer.pt", weights_only=False)["optimizer"].get("scaler")
              for d in (full, run_dir)]
    assert scales[0] == scales[1] and (scales[0] is not None) == (extra.get("dtype") == "float16")


# ----------------------------------------------------------------------------- what a stop says

# `python train.py ARGV` with a hook set first, so that a signal comes at one exact moment: the
# hook's code runs in the process before train.py, with `checkpoint` and `run` imported, and
# train.py then runs as `python train.py` runs it.
HOOKED = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
from machinery import checkpoint, run
{hook}
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train_process(argv, hook="", **popen):
    """A real train.py process (with a hook: HOOKED), its output as text."""
    command = [sys.executable] + (["-c", HOOKED.format(hook=hook)] if hook else ["train.py"])
    return subprocess.Popen(command + argv, cwd=ROOT, text=True, env=ENV,
                            **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen})


def small_run(run_dir, tiny_dir, steps):
    return ["--model", tiny_dir, "--out_dir", str(run_dir), "--steps", str(steps),
            "--eval_every", "0", "--eval_size", "2", "--prompts_per_step", "2", "--group_size", "4",
            "--save_every", "1000"]


def test_a_signal_with_stderr_closed_still_saves_and_exits_130(tmp_path, tiny_dir):
    """stderr a pipe whose reader has gone (a log collector that died): the first signal's line
    cannot be written (EPIPE), and that loses the line, not the run: the steps done are saved and
    the exit is SIGINT's 130."""
    read, write = os.pipe()
    proc = train_process(small_run(tmp_path / "run", tiny_dir, 50), stderr=write)
    os.close(write)
    os.close(read)  # nobody reads stderr any more
    lines = signal_at(proc, 2, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, lines + [rest]
    step = torch.load(tmp_path / "run" / "checkpoint" / "trainer.pt", weights_only=False)["step"]
    assert step >= 3 and len(rows(tmp_path / "run")) == step  # every step logged is saved
    assert f"checkpoint saved after step {step - 1}" in rest


def test_every_command_a_stop_offers_works_in_the_state_the_folder_is_in(tmp_path, tiny_dir):
    """Two SIGTERMs before the first checkpoint, the second during the interrupt's own save: the
    quit leaves a folder with no finished checkpoint, so its line offers the fresh start that
    replaces it (the run's own flags and --overwrite true), not --resume; --resume and a plain start
    into that folder say so too, and the command offered runs the run to its end."""
    run_dir = tmp_path / "run"
    argv = small_run(run_dir, tiny_dir, 2)
    hook = """
real = checkpoint.fsync
def fsync(path):  # the interrupt's own save: a second SIGTERM
    if "checkpoint.tmp" in str(path) and not getattr(fsync, "sent", False):
        fsync.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return real(path)
checkpoint.fsync = fsync
"""
    proc = train_process(argv, hook)
    signal_at(proc, 0, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out, err)
    quit_line = err.strip().splitlines()[-1]
    assert quit_line.startswith("quit at once; no checkpoint was saved yet; start it again with: "
                                "python train.py "), err
    assert not (run_dir / "checkpoint" / "trainer.pt").exists()
    offered = shlex.split(quit_line.split("start it again with: ")[1])
    assert offered[:2] == ["python", "train.py"]
    want = config.parse_args(train.Config, argv + ["--overwrite", "true"])
    assert config.parse_args(train.Config, offered[2:]) == want  # the same run, replacing it
    resumed = train_process(["--resume", str(run_dir)])  # one after the other: one run.lock
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 2 and f"--resume {run_dir}: incomplete run folder" in err, err
    by_resume = shlex.split(err.split("start it again with: ")[1])
    assert config.parse_args(train.Config, by_resume[2:]) == want, err
    plain = train_process(argv)  # the folder as --resume left it: checkpoint.tmp dropped
    _, err = plain.communicate(timeout=120)
    assert plain.returncode == 2 and err == (f"error: {run_dir} holds another run (config.json, "
                                             f"log.jsonl): it has no finished checkpoint to "
                                             f"continue; replace it with --overwrite true, or "
                                             f"pass another --out_dir\n"), err
    done = subprocess.run([sys.executable, *offered[1:]], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in rows(run_dir)] == [0, 1]


def test_a_signal_once_the_run_is_complete_says_so_and_exits_0(tmp_path, tiny_dir):
    """SIGINT during the final save: nothing is left to stop, so the line says the run ends once
    that save is done (not "stopping at the next safe point"), and it does, with exit 0. Two
    SIGINTs in finish(), the run saved: the first says it is complete, the second quits with 0."""
    final_save = """
real = checkpoint.save
def save(run_dir, model, tokenizer, optimizer, step, *a, **k):
    if step == 2:  # the final save
        os.kill(os.getpid(), signal.SIGINT)
    return real(run_dir, model, tokenizer, optimizer, step, *a, **k)
checkpoint.save = save
"""
    in_finish = """
real = run.Run.finish
def finish(self):
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    return real(self)
run.Run.finish = finish
"""
    saving = train_process(small_run(tmp_path / "save", tiny_dir, 2), final_save)
    finishing = train_process(small_run(tmp_path / "finish", tiny_dir, 2), in_finish)
    out, err = saving.communicate(timeout=120)
    assert saving.returncode == 0 and "stopping at the next safe point" not in err, err
    assert err.strip() == ("the run's steps and evaluations are done: it ends once its last "
                           "checkpoint is saved"), err
    assert out.splitlines()[-1].startswith("done: held-out accuracy")
    state = torch.load(tmp_path / "save" / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["step"] == 2
    out, err = finishing.communicate(timeout=120)
    assert finishing.returncode == 0 and "stopping at the next safe point" not in err, err
    assert err.split() == ("the run is complete: it ends now quit at once; the run is complete in "
                           f"{tmp_path / 'finish'}").split(), err


def test_a_refused_start_offers_resume_only_where_a_finished_checkpoint_is(tmp_path):
    """check_fresh names --resume only for a folder that --resume can continue: a finished
    checkpoint, also one a crash left in checkpoint.tmp with its marker (finish_swap completes it);
    a folder with a config.json alone, or a checkpoint.tmp without its marker, is offered
    --overwrite true. A corrupt or unreadable config.json still offers a start that works."""
    (tmp_path / "config.json").write_text('{"seed": 1, "steps": 3}')
    (tmp_path / "checkpoint.tmp").mkdir()
    (tmp_path / "checkpoint.tmp" / "trainer.pt.part").write_bytes(b"")  # a save cut short
    with pytest.raises(ValueError) as e:
        checkpoint.check_fresh(str(tmp_path))
    assert "no finished checkpoint to continue; replace it with --overwrite true" in str(e.value)
    assert "--resume" not in str(e.value)
    with pytest.raises(ValueError) as e:
        checkpoint.load(str(tmp_path), train.Config)
    assert str(e.value).endswith(f"start it again with: python train.py --steps 3 --seed 1 "
                                 f"--out_dir {tmp_path} --overwrite true"), e.value
    assert not (tmp_path / "checkpoint.tmp").exists()  # load dropped the save cut short
    (tmp_path / "checkpoint.tmp").mkdir()
    (tmp_path / "checkpoint.tmp" / "trainer.pt").write_bytes(b"")  # a save complete but not swapped
    assert checkpoint.resumable(str(tmp_path))
    with pytest.raises(ValueError, match=f"continue it with python train.py --resume {tmp_path}, "):
        checkpoint.check_fresh(str(tmp_path))
    with pytest.raises(ValueError, match=r"replace it with --overwrite true \(its checkpoint deleted\)"):
        checkpoint.check_fresh(str(tmp_path))  # a whole checkpoint: the line says it goes
    (tmp_path / "config.json").write_text("{not json")  # the run's flags are lost: it says so
    said = checkpoint.start_again(str(tmp_path), train.Config)
    assert said == (f"its flags went with its config.json; start a run there (adding the flags you "
                    f"want) with: python train.py --out_dir {tmp_path} --overwrite true"), said
    offered = shlex.split(said.split("with: ")[1])
    config.resolve(*config.parse_args(train.Config, offered[2:]))  # a command that runs
    knobs = {"data_dir": "", "model": "my runs/x", "wandb": "", "overwrite": True}
    assert checkpoint.command(knobs) == ("python train.py --data_dir '' --model 'my runs/x' "
                                         "--wandb '' --overwrite true")


def test_config_json_records_the_method_spec_and_a_resume_refuses_an_edit(tmp_path, tiny_dir,
                                                                         monkeypatch, capsys):
    """config.json records d3s.METHODS[method] (method_spec) and each pick() line's value for the
    run (picked) where no flag set the knob, beside the knobs; a resume reads them as no knob. A
    method edited in d3s.py since the run started is refused with one line that names the change;
    a config.json from before method_spec resumes."""
    run_dir = tmp_path / "run"
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, steps=1, eval_every=0))
    saved = json.load(open(run_dir / "config.json"))
    assert saved["method_spec"] == {"sample": "cross", "token": "adv_entropy", "schedule": "linear"}
    assert saved["picked"]["divisor"] == "kept" and saved["picked"]["max_new_tokens"] == 32
    # KW's lr and steps, given: the knobs as they ran, and no line's value beside them to contradict
    assert saved["lr"] == 1e-4 and saved["steps"] == 1
    assert "lr" not in saved["picked"] and "steps" not in saved["picked"]
    assert all(saved[k] == v for k, v in saved["picked"].items())
    config.main(train.Config, train.train, ["--resume", str(run_dir)])  # as it was: it resumes
    edited = {**train.d3s.METHODS["d3s"], "schedule": "constant"}
    monkeypatch.setitem(train.d3s.METHODS, "d3s", edited)
    err = exit_2(["--resume", str(run_dir)], capsys)
    assert err.startswith(f"error: --resume {run_dir}: d3s.METHODS['d3s'] has changed since the "
                          f"run started (schedule linear -> constant), so it would not continue "
                          f"exactly; put it back in d3s.py, or start it again, deleting its "
                          f"checkpoint, with: python train.py --model {tiny_dir} "), err
    monkeypatch.undo()
    del saved["method_spec"], saved["picked"]
    (run_dir / "config.json").write_text(json.dumps(saved))
    config.main(train.Config, train.train, ["--resume", str(run_dir)])


# ----------------------------------------------------------------------------- config.json, whole or lost


def test_config_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """write_atomic, config.json's writer: the new file is flushed to disk, renamed over the old
    one, and the rename flushed; a crash at each of these leaves the old file or the new one, whole,
    and no part file."""
    path, events = tmp_path / "config.json", []
    real_fsync, real_replace = os.fsync, os.replace
    for n in range(1, 5):
        path.write_text('{"old": 1}')
        events.clear()

        def op(name, real):
            def run(*a):
                events.append(name)
                if len(events) == n:
                    raise OSError(errno.EIO, "simulated crash")
                return real(*a)
            return run
        monkeypatch.setattr(os, "fsync", op("fsync", real_fsync))
        monkeypatch.setattr(os, "replace", op("replace", real_replace))
        try:
            checkpoint.write_atomic(str(path), '{"new": 2}')
        except OSError:
            assert n < 4
        monkeypatch.undo()
        assert json.loads(path.read_text()) == ({"old": 1} if n < 3 else {"new": 2}), n
        assert os.listdir(tmp_path) == ["config.json"], n
    assert events == ["fsync", "replace", "fsync"]  # the file, the rename, the folder


def test_a_kill_while_config_json_is_written_leaves_a_run_that_resumes(tmp_path, tiny_dir, uninterrupted):
    """A resume rewrites config.json (its changes, the run's out_dir). A kill at that moment, with
    half the file written, must leave the old config.json whole beside the checkpoint, so that
    --resume then continues exactly."""
    def stop_after_step_0(line):  # a real Ctrl-C: the run stops at the step's end
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW), log=stop_after_step_0)
    before = (run_dir / "config.json").read_text()
    cut_off = """
import builtins
real_open = builtins.open
class Half:  # writes a bit of config.json, then the process is killed
    def __init__(self, f):
        self.f = f
    def write(self, text):
        self.f.write(text[:10])
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *a):
        self.f.close()
def half_open(file, mode="r", *a, **k):
    f = real_open(file, mode, *a, **k)
    return Half(f) if os.path.basename(str(file)).startswith("config.json") and "w" in mode else f
builtins.open = half_open
"""
    killed = train_process(["--resume", str(run_dir)], cut_off)
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err
    assert (run_dir / "config.json").read_text() == before  # the old one, whole
    train.train(train.Config(resume=str(run_dir)), log=lambda *a: None)
    same_run(trained(run_dir), uninterrupted)


@pytest.mark.parametrize("broken", ["", "null", '"steps": "twelve"', '"lr": "abc"', '"steps": -5',
                                    '"loss": "bogus"', '"eval_size": 0', '"device": "tpu"'],
                         ids=["empty", "null", "steps", "lr", "steps<1", "loss", "eval_size", "device"])
def test_a_resume_without_a_readable_config_json_goes_on_from_the_checkpoints_copy(
        tmp_path, tiny_dir, broken, uninterrupted):
    """config.json empty (a kill mid-write, before it was written whole), not an object, with a
    value of the wrong type, or of the right type that train.py refuses (it would have named a flag
    that --resume refuses): the checkpoint holds a copy of it, so --resume goes on from that copy,
    says so in its first line, writes config.json back whole, and continues exactly."""
    def stop_after_step_0(line):
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW), log=stop_after_step_0)
    good = json.loads((run_dir / "config.json").read_text())
    key, _, value = broken.partition(": ")
    (run_dir / "config.json").write_text(
        json.dumps({**good, key.strip('"'): json.loads(value)}) if value else broken)
    lines = []
    train.train(train.Config(resume=str(run_dir)), log=lines.append)
    assert lines[0].endswith(": its checkpoint's copy goes on)") and "resuming at step 1 (config.json " in lines[0]
    assert json.loads((run_dir / "config.json").read_text()) == {**good, "resume": str(run_dir)}
    same_run(trained(run_dir), uninterrupted)


def test_a_run_this_train_py_cannot_continue_offers_its_weights_and_never_a_broken_command(
        tmp_path, tiny_dir, monkeypatch, capsys):
    """A whole checkpoint that --resume cannot continue: config.json broken and no copy in the
    checkpoint (one saved before checkpoints held one), or a method d3s.py no longer has. The line
    offers a new run from its weights, a command that runs and leaves the run as it is, never
    --overwrite (which deletes it) nor a --method that is gone; every line is one line, exit 2."""
    run_dir = tmp_path / "run"
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, steps=1, eval_every=0, method="d2s"))
    state = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["config"] == json.loads((run_dir / "config.json").read_text())
    with monkeypatch.context() as m:  # a new dict: METHODS's order stays as it is for other tests
        m.setattr(train.d3s, "METHODS", {k: v for k, v in train.d3s.METHODS.items() if k != "d2s"})
        gone = exit_2(["--resume", str(run_dir)], capsys)
    del state["config"]  # a checkpoint from before the copy
    torch.save(state, run_dir / "checkpoint" / "trainer.pt")
    (run_dir / "config.json").write_text("")
    lost = exit_2(["--resume", str(run_dir)], capsys)
    assert "it ran --method d2s, which d3s.METHODS no longer has" in gone, gone
    assert "config.json is unreadable" in lost and "holds no copy of the run's knobs" in lost, lost
    for line in (gone, lost):
        assert "--overwrite" not in line and "--method" not in line.split("with: ")[1], line
        offered = shlex.split(line.split("with: ")[1])
        assert offered[:2] == ["python", "train.py"], line
        cfg = config.resolve(*config.parse_args(train.Config, offered[2:]))  # it runs
        assert cfg.model == str(run_dir / "checkpoint") and cfg.out_dir != str(run_dir)


# ----------------------------------------------------------------------------- a closed pipe, the end, Ctrl-C early


def test_a_stdout_nobody_reads_loses_its_lines_not_the_run(tmp_path, tiny_dir):
    """`python train.py | head -2`: once head has gone, print meets a closed pipe (EPIPE). The
    lines are lost, the run goes on to its end and exits 0, without a traceback, whether stdout is
    unbuffered (each line fails at once) or buffered (it fails at a flush, or at the exit)."""
    procs = {}
    for buffered in (False, True):
        run_dir = tmp_path / f"buffered={buffered}"
        env = {k: v for k, v in ENV.items() if not (buffered and k == "PYTHONUNBUFFERED")}
        argv = " ".join(shlex.quote(a) for a in small_run(run_dir, tiny_dir, 2))
        procs[run_dir] = subprocess.Popen(
            ["bash", "-c", f"{shlex.quote(sys.executable)} train.py {argv} | head -2; "
                           "exit ${PIPESTATUS[0]}"],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for run_dir, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert (proc.returncode, err) == (0, ""), (run_dir, err)
        assert out.splitlines()[0].startswith(f"run {run_dir} | ") and len(out.splitlines()) == 2
        state = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)
        assert state["step"] == 2 and [r["step"] for r in rows(run_dir)] == [0, 1]


def test_a_signal_as_a_complete_run_closes_changes_nothing(tmp_path, tiny_dir):
    """SIGINT and SIGTERM just after the run's handlers are put back (its folder closed, the `done:`
    line printed): a complete run still exits 0, without a traceback."""
    as_it_closes = """
from machinery import stops
real = stops.Stop.restore
def restore(self):
    real(self)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
stops.Stop.restore = restore
"""
    proc = train_process(small_run(tmp_path / "run", tiny_dir, 1), as_it_closes)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (0, ""), (proc.returncode, err)
    assert out.splitlines()[-1].startswith("done: held-out accuracy")


# `python PROGRAM --help` with SIGINT sent to itself as it first imports torch
INTERRUPTED_IMPORT = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
class Interrupt:  # a finder asked first for every import: Ctrl-C as torch's import begins
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = [sys.argv[1], "--help"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_while_starting_is_one_line_and_exit_130():
    """Ctrl-C while train.py or eval.py imports torch (seconds, before a run has handlers): one
    line, exit 130, no traceback."""
    procs = [subprocess.Popen([sys.executable, "-c", INTERRUPTED_IMPORT, program], cwd=ROOT, env=ENV,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for program in ("train.py", "eval.py")]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out, err) == (130, "", "\ninterrupted (Ctrl-C) while starting: nothing was "
                                                        "written\n"), (proc.args[-1], proc.returncode, err)


# ----------------------------------------------------------------------------- a full disk, a read-only folder


@pytest.mark.parametrize("limit", [500_000, 5_000_000], ids=["safetensors", "torch.save"])
def test_a_full_disk_is_one_line_whose_command_runs(tmp_path, tiny_dir, limit):
    """A real file size limit (RLIMIT_FSIZE, as `prlimit --fsize` sets) that the checkpoint cannot
    fit: the save fails inside safetensors (the model is 3.3 MB), or inside torch.save (trainer.pt,
    AdamW's two moments, 6.6 MB). One line on stderr, exit 1, saying what could not be written and
    why in the OS's words (not a line of torch's C++), what the folder holds and what to do; the
    part written is gone; its command, run once the limit is gone, completes the run."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    run_dir = tmp_path / "run"
    argv = small_run(run_dir, tiny_dir, 2)
    argv[argv.index("--save_every") + 1] = "1"
    full = train_process(argv, preexec_fn=small_files)
    _, err = full.communicate(timeout=120)
    assert full.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: cannot write {run_dir}/checkpoint.tmp: File too large; "), err
    assert "; raise the file size limit (ulimit -f), then " in err, err
    assert not (run_dir / "checkpoint.tmp").exists()  # its megabytes went with the failed save
    offered = shlex.split(err.split(" with: ")[1])
    done = subprocess.run([sys.executable, *offered[1:]], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 2
    sizes = [os.path.getsize(run_dir / "checkpoint" / name) for name in ("model.safetensors", "trainer.pt")]
    assert sizes[0] > limit if limit < 1e6 else sizes[0] < limit < sizes[1]  # which write failed


def test_no_space_at_a_save_keeps_the_last_checkpoint_and_says_so(tmp_path, tiny_dir, monkeypatch, capsys,
                                                                 uninterrupted):
    """ENOSPC while a periodic checkpoint is written: one line, exit 1, the previous checkpoint
    stands, and the command it names continues into the uninterrupted run."""
    def stop_after_step_0(line):
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW), log=stop_after_step_0)
    real = torch.save

    def full(obj, f, *a, **k):
        if str(getattr(f, "name", f)).endswith("trainer.pt.part"):
            raise OSError(errno.ENOSPC, "No space left on device", f.name)
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, ["--resume", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err == [
        f"error: cannot write {run_dir}/checkpoint.tmp/trainer.pt.part: No space left on device; the last "
        f"checkpoint stands; free some disk space, then continue with: python train.py --resume {run_dir}"], err
    assert not (run_dir / "checkpoint.tmp").exists()
    monkeypatch.undo()
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 1
    train.train(train.Config(resume=str(run_dir)), log=lambda *a: None)
    same_run(trained(run_dir), uninterrupted)


def test_a_read_only_run_folder_is_one_line_and_no_second_error(tmp_path, tiny_dir, monkeypatch, capsys):
    """A folder that became read-only (EROFS; these tests run as root, whom chmod does not stop, so
    the filesystem's answer is simulated at open and remove): a resume that cannot write config.json
    stops with one line that says what to do, and removing run.lock, which fails the same way,
    adds no second error. Where even run.lock cannot be made, a resume is told to copy the folder,
    not to pass another --out_dir (which --resume refuses)."""
    def stop_after_step_0(line):
        if line.startswith("step    0 "):
            os.kill(os.getpid(), signal.SIGINT)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW), log=stop_after_step_0)
    before = (run_dir / "config.json").read_text()
    real_open, real_remove = open, os.remove

    def read_only(file, mode="r", *a, **k):
        if str(file).startswith(str(run_dir)) and "w" in mode and "run.lock" not in str(file):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *a, **k)

    def no_remove(path, *a, **k):
        if str(path).startswith(str(run_dir)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_remove(path, *a, **k)
    monkeypatch.setattr("builtins.open", read_only)
    monkeypatch.setattr(os, "remove", no_remove)
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, ["--resume", str(run_dir)])
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: cannot write {run_dir}/config.json") and err[0].endswith(
        f": Read-only file system; the last checkpoint stands; make {run_dir} writable, then continue with: "
        f"python train.py --resume {run_dir}"), err
    assert (run_dir / "config.json").read_text() == before
    real_os_open = os.open

    def no_lock(path, *a, **k):
        if str(path).endswith("run.lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_os_open(path, *a, **k)
    monkeypatch.setattr(checkpoint.os, "open", no_lock)
    err = exit_2(["--resume", str(run_dir)], capsys)
    assert err == (f"error: cannot write {run_dir}/run.lock: Read-only file system; copy the folder where you "
                   f"can write and pass the copy to --resume"), err



# ----------------------------------------------------------------------------- nothing lost, every command works


def stopped_after(run_dir, tiny_dir, step, **kw):
    """KW's run into run_dir, stopped by a real Ctrl-C at the end of `step`: its checkpoint holds
    the steps up to it."""
    def stop(line):
        if line.startswith(f"step {step:4d} "):
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **{**KW, **kw}), log=stop)
    return run_dir


def files_of(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_run_from_a_live_runs_checkpoint_is_refused(tmp_path, tiny_dir, monkeypatch, capsys):
    """--model RUN/checkpoint while RUN is live: RUN replaces that folder at its next save, and a
    LoRA run on it (its base) was lost then, its --resume and eval.py failing for good. Refused
    with one line that says what to do, leaving nothing; the same command runs once RUN has
    stopped. A --model inside the --out_dir that --overwrite true empties is refused too."""
    live, new, real, tried = tmp_path / "live", tmp_path / "new", train.held_out, []
    argv = ["--model", str(live / "checkpoint"), "--lora_rank", "4", "--out_dir", str(new),
            "--steps", "1", "--eval_every", "0", "--eval_size", "2", "--prompts_per_step", "2",
            "--group_size", "4"]

    def a_new_run_meanwhile(*a, **k):
        if len(tried) == 2:  # the evaluation of step 2: the checkpoint of step 1 is there
            tried.append(exit_2(argv, capsys))
        tried.append(None)
        return real(*a, **k)
    monkeypatch.setattr(train, "held_out", a_new_run_meanwhile)
    train.train(train.Config(model=tiny_dir, out_dir=str(live), **{**KW, "save_every": 1}),
                log=lambda *a: None)
    monkeypatch.undo()
    said = tried[2]
    assert said == (f"error: --model {live}/checkpoint: {live} is in use by a train.py that is still "
                    f"running (pid {os.getpid()}), which replaces its checkpoint at each save; wait "
                    f"for it to stop, or copy {live}/checkpoint between its saves and pass the copy "
                    f"to --model"), said
    assert not new.exists()
    config.main(train.Config, train.train, argv)  # stopped: the same command runs
    assert load_model(str(new / "checkpoint"), device="cpu")[0] is not None
    before = files_of(live)
    err = exit_2(["--model", str(live / "checkpoint"), "--lora_rank", "4", "--out_dir", str(live),
                  "--overwrite", "true"], capsys)
    assert err == (f"error: --model {live}/checkpoint is in --out_dir {live}, which --overwrite true "
                   f"would delete before the run ends; pass another --out_dir"), err
    assert files_of(live) == before


def test_a_start_on_a_full_disk_is_one_line_whose_command_runs(tmp_path, tiny_dir, monkeypatch, capsys):
    """The command a full disk's line offered, run on a disk still full: run.lock's pid cannot be
    written (ENOSPC, as the OS says it). One line, exit 2, the folder as it was, and a command that,
    once there is room, runs: for --resume and for --overwrite true alike."""
    run_dir = stopped_after(tmp_path / "run", tiny_dir, 0)
    real, before = os.write, files_of(run_dir)

    def full(fd, data):
        if data == f"{os.getpid()}\n".encode():  # the lock's pid
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    fresh = argv_of(run_dir, tiny_dir, steps=1, eval_every=0) + ["--overwrite", "true"]
    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        resumed = exit_2(["--resume", str(run_dir), "--device", "cpu"], capsys)
        replaced = exit_2(fresh, capsys)
    assert resumed == (f"error: cannot write {run_dir}/run.lock: No space left on device; nothing was "
                       f"written; free some disk space, then continue with: python train.py --resume "
                       f"{run_dir} --device cpu"), resumed
    assert replaced.startswith(f"error: cannot write {run_dir}/run.lock: No space left on device; "
                               f"nothing was written; free some disk space, then start it again with: "
                               f"python train.py "), replaced
    assert files_of(run_dir) == before
    offered = shlex.split(replaced.split("start it again with: ")[1])
    assert config.parse_args(train.Config, offered[2:]) == config.parse_args(train.Config, fresh)
    config.main(train.Config, train.train, shlex.split(resumed.split("continue with: ")[1])[2:])
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == KW["steps"]


def test_a_signal_while_an_overwrite_loads_offers_the_overwrite(tmp_path, tiny_dir, monkeypatch, capsys):
    """Ctrl-C while a start with --overwrite true loads its model: nothing is written, and the
    command offered is that start, --overwrite true included (without it, it is refused), which
    then replaces the run."""
    run_dir = tmp_path / "run"
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, steps=1, eval_every=0))
    before, real = files_of(run_dir), train.load_model

    def ctrl_c_while_loading(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)
    monkeypatch.setattr(train, "load_model", ctrl_c_while_loading)
    again = argv_of(run_dir, tiny_dir, steps=1, eval_every=0, seed=1) + ["--overwrite", "true"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, again)
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert e.value.code == 130 and files_of(run_dir) == before
    assert said.startswith("interrupted before step 0: nothing new to save; start it again with: "
                           "python train.py "), said
    offered = shlex.split(said.split("start it again with: ")[1])
    assert config.parse_args(train.Config, offered[2:]) == config.parse_args(train.Config, again)
    monkeypatch.undo()
    config.main(train.Config, train.train, offered[2:])
    assert json.load(open(run_dir / "config.json"))["seed"] == 1


def test_a_config_json_behind_its_checkpoint_goes_on_from_the_copy(tmp_path, tiny_dir, uninterrupted):
    """config.json's steps (3) edited to 1 with its checkpoint at step 2: not a run that is done
    ("0 of -2 steps", no final evaluation or save) but one that goes on from the checkpoint's copy,
    says so, and ends as the uninterrupted run."""
    run_dir = stopped_after(tmp_path / "run", tiny_dir, 1)
    good = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**good, "steps": 1}))
    lines = []
    train.train(train.Config(resume=str(run_dir)), log=lines.append)
    assert lines[0].endswith("resuming at step 2 (config.json holds steps 1, fewer than the 2 its "
                             "checkpoint has run: its checkpoint's copy goes on)"), lines[0]
    same_run(trained(run_dir), uninterrupted)


@pytest.fixture(scope="module")
def stopped_run(tiny_dir, tmp_path_factory):
    """KW's run stopped after step 0 (its checkpoint: step 1), to be copied and broken."""
    return stopped_after(tmp_path_factory.mktemp("stopped") / "run", tiny_dir, 0)


def another_models_optimizer(state):
    state["optimizer"] = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).state_dict()


BREAKS = {"no history": lambda st: st.pop("history"),
          "step a string": lambda st: st.update(step="5"),
          "history None": lambda st: st.update(history=None),
          "optimizer None": lambda st: st.update(optimizer=None),
          "tokens_trained a string": lambda st: st.update(tokens_trained="x"),
          "an evaluation without its step": lambda st: st["history"][0].pop("step"),
          "another model's optimizer": another_models_optimizer}


@pytest.mark.parametrize("broken", [*BREAKS, "model.safetensors cut"])
def test_a_damaged_checkpoint_is_one_line_whose_commands_run(tmp_path, stopped_run, broken, capsys):
    """trainer.pt of this version but not as save() writes it (a key missing, a value of another
    kind, another model's optimizer state), or model.safetensors cut short: one line, exit 2 (not a
    traceback, now or after a step), naming the file and what is wrong, and offering what works: a
    new run from the weights where they are whole, or the fresh start that replaces the run, which
    runs."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_run, run_dir)
    if broken in BREAKS:
        state = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)
        BREAKS[broken](state)
        torch.save(state, run_dir / "checkpoint" / "trainer.pt")
    else:
        weights = run_dir / "checkpoint" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100_000])
    err = exit_2(["--resume", str(run_dir)], capsys)
    name = "trainer.pt" if broken in BREAKS else "model.safetensors"
    assert err.startswith(f"error: --resume {run_dir}: its checkpoint/{name} is corrupt ("), err
    new_run = (f"start a new run from its weights (its weights are whole) with: python train.py "
               f"--model {run_dir}/checkpoint, or ")
    assert (new_run in err) == (broken in BREAKS), err
    assert "start it again, deleting its checkpoint, with: python train.py " in err, err
    for offered in err.split(" with: ")[1:]:
        argv = shlex.split(offered.split(", or ")[0])[2:]
        config.resolve(*config.parse_args(train.Config, argv))  # a command that runs
    replace = shlex.split(err.split("deleting its checkpoint, with: ")[1])[2:]
    config.main(train.Config, train.train, replace)
    assert [r["step"] for r in rows(run_dir)] == list(range(KW["steps"]))


def test_a_stop_with_stdout_gone_says_its_command_on_stderr(tmp_path, tiny_dir):
    """`python train.py | head -2`, then Ctrl-C: the line with the command that continues went to
    the closed stdout and was lost. It now reaches stderr as well, buffered stdout or not."""
    procs = {}
    for buffered in (False, True):
        run_dir = tmp_path / f"buffered={buffered}"
        env = {k: v for k, v in ENV.items() if not (buffered and k == "PYTHONUNBUFFERED")}
        procs[run_dir] = subprocess.Popen([sys.executable, "train.py", *small_run(run_dir, tiny_dir, 200)],
                                          cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE)
    for run_dir, proc in procs.items():
        head = [proc.stdout.readline(), proc.stdout.readline()]
        proc.stdout.close()  # head -2 has what it wanted, and exits
        while not (run_dir / "log.jsonl").exists() or (run_dir / "log.jsonl").read_text().count("\n") < 2:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 130 and head[0].startswith(f"run {run_dir} | "), err
        step = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"]
        assert err.strip().splitlines()[-1] == (f"interrupted: checkpoint saved after step {step - 1} (it "
                                                f"resumes at step {step}); continue with: python train.py "
                                                f"--resume {run_dir}"), err


def test_an_overwrite_leaves_nothing_of_the_run_it_replaces(tmp_path, tiny_dir, monkeypatch):
    """--overwrite true deletes the run it replaces whole: its curves.png and selection.html (which
    linked to pages it deleted) too, before the new run writes anything of its own."""
    run_dir = tmp_path / "run"
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, steps=1))
    assert (run_dir / "curves.png").exists() and (run_dir / "selection.html").exists()
    real, seen = train.held_out, []

    def look(*a, **k):
        seen.append(sorted(p.name for p in run_dir.iterdir()))
        return real(*a, **k)
    monkeypatch.setattr(train, "held_out", look)
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, steps=1, seed=1) + ["--overwrite", "true"])
    assert seen[0] == ["config.json", "run.lock"], seen[0]  # the new run's step-0 evaluation


def test_a_kill_during_an_overwrites_deletion_leaves_no_run_to_resume(tmp_path, tiny_dir, monkeypatch, capsys):
    """--overwrite true killed at each of its deletions: the old run's checkpoint never stands
    without its log.jsonl or config.json (a --resume then went on with no log): --resume refuses the
    folder, a plain start offers --overwrite true, and that command, run again, replaces the run."""
    run_dir = tmp_path / "run"
    config.main(train.Config, train.train, argv_of(run_dir, tiny_dir, steps=1))
    (run_dir / "log.jsonl.cut").write_text("")
    template, again = tmp_path / "template", argv_of(run_dir, tiny_dir, steps=1, seed=1) + ["--overwrite", "true"]
    shutil.copytree(run_dir, template)
    real_remove, real_rmtree = os.remove, shutil.rmtree
    for n in range(1, 30):
        shutil.rmtree(run_dir)
        shutil.copytree(template, run_dir)
        calls = []

        def killed(real):
            def op(path, *a, **k):
                if str(path).startswith(str(run_dir)) and not str(path).endswith("run.lock"):
                    calls.append(path)
                    if len(calls) == n:
                        raise SystemExit("killed")
                return real(path, *a, **k)
            return op
        with monkeypatch.context() as m:
            m.setattr(os, "remove", killed(real_remove))
            m.setattr(shutil, "rmtree", killed(real_rmtree))
            try:
                checkpoint.fresh(str(run_dir), overwrite=True)
                break
            except SystemExit:
                pass
        assert not checkpoint.resumable(str(run_dir)) or \
            {"log.jsonl", "config.json"} <= {p.name for p in run_dir.iterdir()}, (n, calls)
        if not checkpoint.resumable(str(run_dir)) and (run_dir / "log.jsonl").exists():
            assert "it has no finished checkpoint to continue; replace it with --overwrite true" in \
                exit_2(argv_of(run_dir, tiny_dir, steps=1), capsys)
    assert n > 5  # every deletion was killed once
    shutil.rmtree(run_dir)
    shutil.copytree(template, run_dir)
    os.remove(run_dir / "checkpoint" / "trainer.pt")  # the state the first kill leaves
    config.main(train.Config, train.train, again)
    assert json.load(open(run_dir / "config.json"))["seed"] == 1


def test_a_refused_config_json_records_no_change(tmp_path, tiny_dir, monkeypatch, capsys):
    """A resume with --micro_batch_size 2 whose config.json cannot be written (a full disk): the
    change never ran, so resumes.jsonl does not record it, and the line offers the command with it."""
    run_dir = stopped_after(tmp_path / "run", tiny_dir, 0)
    real = checkpoint.write_atomic

    def full(path, text):
        if path.endswith("config.json"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, text)
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "write_atomic", full)
        with pytest.raises(SystemExit) as e:
            config.main(train.Config, train.train, ["--resume", str(run_dir), "--micro_batch_size", "2"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and not (run_dir / "resumes.jsonl").exists(), err
    assert err.endswith(f"free some disk space, then continue with: python train.py --resume {run_dir} "
                        f"--micro_batch_size 2"), err


def test_killed_resumes_cut_each_row_once(tmp_path, monkeypatch):
    """A resume killed between keeping log.jsonl.cut and cutting log.jsonl back: the next resume
    cuts the same rows again, and log.jsonl.cut holds each of them once."""
    lines = [json.dumps({"step": s, "t_gen": 0.1 * s}) + "\n" for s in range(5)]
    (tmp_path / "log.jsonl").write_text("".join(lines))
    real = checkpoint.write_atomic

    def killed(path, text):
        if path.endswith("log.jsonl"):
            raise SystemExit("killed")
        return real(path, text)
    for _ in range(2):
        with monkeypatch.context() as m:
            m.setattr(checkpoint, "write_atomic", killed)
            with pytest.raises(SystemExit):
                checkpoint.trim_log(str(tmp_path), 2)
    checkpoint.trim_log(str(tmp_path), 2)
    assert (tmp_path / "log.jsonl.cut").read_text() == "".join(lines[2:])
    assert (tmp_path / "log.jsonl").read_text() == "".join(lines[:2])


def test_sighup_stops_a_run_as_sigterm_does_and_nohup_keeps_it(tmp_path, tiny_dir):
    """A closed terminal (SIGHUP) ended a run without a save: it now stops it at the next safe
    point, with a checkpoint, the command to continue and exit 129 (128 + SIGHUP). Under nohup
    (SIGHUP ignored from the start) the run goes on to its end."""
    hup = subprocess.Popen([sys.executable, "train.py", *small_run(tmp_path / "hup", tiny_dir, 200)], cwd=ROOT,
                           env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    nohup = subprocess.Popen([sys.executable, "train.py", *small_run(tmp_path / "nohup", tiny_dir, 3)], cwd=ROOT,
                             env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    lines = signal_at(hup, 1, signal.SIGHUP)
    rest, _ = hup.communicate(timeout=120)
    assert hup.returncode == 129, lines + [rest]
    step = torch.load(tmp_path / "hup" / "checkpoint" / "trainer.pt", weights_only=False)["step"]
    assert step >= 2 and len(rows(tmp_path / "hup")) == step
    assert f"continue with: python train.py --resume {tmp_path / 'hup'}" in rest
    signal_at(nohup, 0, signal.SIGHUP)
    rest = nohup.stdout.read()  # (communicate would skip the lines read ahead)
    assert nohup.wait(timeout=120) == 0 and rest.splitlines()[-1].startswith("done: "), rest
    assert [r["step"] for r in rows(tmp_path / "nohup")] == [0, 1, 2]


# `python PROGRAM --help` with SIGINT sent to itself at the first import of a module not loaded yet
# once machinery/ctrl_c.py's import has begun: what is left before its hook is that import alone
CTRL_C_AT = """
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
PATH, AT = ("machinery", "machinery.config", "machinery.ctrl_c"), sys.argv[2]  # to the hook
class Interrupt:
    armed = False
    def find_spec(self, name, path=None, target=None):
        if self.armed and name not in PATH:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        self.armed = self.armed or name == AT
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = [sys.argv[1], "--help"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("program, armed_at", [
    ("eval.py", "machinery.ctrl_c"),
    ("train.py", "math")])
def test_ctrl_c_at_the_first_import_after_the_hook_begins_is_one_line(program, armed_at):
    """Ctrl-C as early as a script can answer it (the first 50 ms were a traceback): at the first
    import after machinery/ctrl_c.py's began (which imported traceback before setting its hook), or
    for train.py at its first import at all."""
    proc = subprocess.run([sys.executable, "-c", CTRL_C_AT, program, armed_at], cwd=ROOT, env=ENV,
                          text=True, capture_output=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        130, "", "\ninterrupted (Ctrl-C) while starting: nothing was written\n"), proc.stderr[-600:]


def test_the_suite_passes_when_whoever_started_it_ignores_ctrl_c(tmp_path):
    """What made test_ctrl_c_while_starting_is_one_line_and_exit_130 fail in a fresh clone: pytest
    started with SIGINT ignored (`python -m pytest -q &` in a script: a background job of a shell
    without job control) hands that to its workers and to every process a test starts, whose Ctrl-C
    then does nothing. conftest.py's terminal_signals gives each test a terminal's signals."""
    test = "tests/test_checkpoint.py::test_ctrl_c_while_starting_is_one_line_and_exit_130"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test],
                          cwd=ROOT, env=ENV, text=True, capture_output=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stdout[-2000:]
