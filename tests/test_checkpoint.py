"""checkpoint.py: a run stopped at any moment resumes exactly. Each window a run can stop in (a signal
at a step's start, inside a batch's updates, during an evaluation; a hard crash after a periodic save;
a crash or power cut during the save) is forced, the run is resumed, and it is compared with the
uninterrupted run row by row (rewards, counts, losses, evaluations) and in the final weights."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from machinery import checkpoint
from machinery import config
import train
from conftest import ROOT, exit_2, rows, weights
from machinery.model import load_model

# K = 2 (the mini-batch shuffle draws random numbers), an evaluation after every step, a checkpoint every 2
KW = dict(steps=3, prompts_per_step=4, group_size=4, eval_size=4, eval_every=1, save_every=2, updates_per_batch=2,
          lr=1e-4, method="d3s")
COMPARED = ("step", "reward", "kept", "tokens", "valid", "losses", "grad_norm", "tokens_trained", "rho_s", "rho_t")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def trained(run_dir):
    """What a run left: its rows (the compared fields), its evaluations and its final weights."""
    history = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["history"]
    return [{k: r[k] for k in COMPARED} for r in rows(run_dir)], history, weights(run_dir / "checkpoint")


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW), log=lambda *a: None)
    return trained(run_dir)


def stop_and_resume(tmp_path, tiny_dir, monkeypatch, name, when, stop=KeyboardInterrupt):
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
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), **KW), log=lambda *a: None)
    monkeypatch.undo()
    stopped_at = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"]
    train.train(train.Config(resume=str(run_dir)), log=lambda *a: None)
    return trained(run_dir), stopped_at, run_dir


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


def test_two_sigterms_exit_with_sigterms_code(tmp_path, tiny_dir, monkeypatch):
    """A second SIGTERM while the first waits for the batch quits without saving, with SIGTERM's 143."""
    real = train.optimizer_step

    def twice(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    monkeypatch.setattr(train, "optimizer_step", twice)
    argv = ["--model", tiny_dir, "--out_dir", str(tmp_path / "run"), "--steps", "2", "--prompts_per_step", "4",
            "--group_size", "4", "--eval_size", "2", "--updates_per_batch", "2"]
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv)
    assert e.value.code == 143 and not (tmp_path / "run" / "checkpoint").exists()


def test_out_of_memory_saves_what_it_can_and_resumes_with_less_memory(tmp_path, tiny_dir, monkeypatch, capsys,
                                                                       uninterrupted):
    """An out-of-memory stop before any weight of its batch moved saves the steps applied and names the
    knobs to lower and the resume command; the resume takes a smaller micro-batch, records the change, and
    computes the same run (micro-batches change only the float rounding)."""
    real, calls = train.backward, []

    def oom_at_step_1(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # step 1's first mini-batch (step 0 had two)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*a, **k)
    monkeypatch.setattr(train, "backward", oom_at_step_1)
    run_dir = tmp_path / "oom"
    argv = ["--model", tiny_dir, "--out_dir", str(run_dir)] + [f"--{k}={v}" for k, v in KW.items()]
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0] == (f"error: out of memory at step 1; the checkpoint holds the steps before 1; continue with less "
                      f"memory per pass: python train.py --resume {run_dir} --micro_batch_size 64 (or --gen_batch_size "
                      f"8, --logprob_chunk 2048, --gradient_checkpointing true; experiments/speed.md has settings by GPU "
                      f"memory)")
    monkeypatch.undo()
    config.main(train.Config, train.train, ["--resume", str(run_dir), "--micro_batch_size", "1",
                                            "--gradient_checkpointing", "true"])
    assert json.loads((run_dir / "resumes.jsonl").read_text()) == {
        "step": 1, "changed": {"gradient_checkpointing": [False, True], "micro_batch_size": [128, 1]}}
    assert json.load(open(run_dir / "config.json"))["micro_batch_size"] == 1
    (rows_a, hist_a, w_a), (rows_b, hist_b, w_b) = trained(run_dir), uninterrupted
    assert [{k: r[k] for k in ("step", "reward", "kept", "tokens")} for r in rows_a] == \
           [{k: r[k] for k in ("step", "reward", "kept", "tokens")} for r in rows_b]
    assert all(torch.allclose(w_a[k], w_b[k], atol=1e-5) for k in w_a)
    assert [h["step"] for h in hist_a] == [h["step"] for h in hist_b] == [0, 1, 2, 3]  # no evaluation lost


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
    assert e.value.code == 1 and err.startswith("error: out of memory at step 0, before any checkpoint; start again")
    assert not (tmp_path / "run" / "checkpoint").exists()  # half a batch is never saved


def test_a_checkpoint_saved_on_a_gpu_resumes_on_the_cpu(tmp_path, tiny_dir, monkeypatch):
    """trainer.pt written with every tensor tagged as CUDA memory (as a GPU run saves its AdamW state):
    without map_location torch.load refuses it on a machine without a GPU; --resume continues."""
    def stop_after_step_0(line):
        if line.startswith("step    0 "):
            raise KeyboardInterrupt
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
    def stop_after_step_0(line):
        if line.startswith("step    0 "):
            raise KeyboardInterrupt
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
    lines = []
    for line in proc.stdout:  # wait for two step lines, then send what a scheduler sends
        lines.append(line)
        if line.startswith("step    1 "):
            proc.send_signal(signal.SIGTERM)
            break
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

    def stop_after_step_0(line):
        if line.startswith("step    0 "):
            raise KeyboardInterrupt
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


def test_a_signal_during_the_interrupts_own_save_waits_for_it(tmp_path, tiny_dir, monkeypatch):
    """SIGTERM at the start of step 1, then a second SIGTERM while that interrupt's checkpoint is being
    written: the save finishes and the exit code is SIGTERM's."""
    real_batch, real_fsync, sent = train.batch_at, checkpoint.fsync, []

    def first_signal(*a, **k):
        if a[1] == 1 and not sent:  # step 1
            sent.append("first")
            os.kill(os.getpid(), signal.SIGTERM)
        return real_batch(*a, **k)

    def second_signal(path):
        if sent == ["first"]:  # the interrupt's own save
            sent.append("second")
            os.kill(os.getpid(), signal.SIGTERM)
        return real_fsync(path)
    monkeypatch.setattr(train, "batch_at", first_signal)
    monkeypatch.setattr(checkpoint, "fsync", second_signal)
    argv = ["--model", tiny_dir, "--out_dir", str(tmp_path / "run")] + [f"--{k}={v}" for k, v in KW.items()]
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv + ["--save_every=0", "--eval_every=0"])
    assert e.value.code == 143 and sent == ["first", "second"]
    assert torch.load(tmp_path / "run" / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 1
    assert not (tmp_path / "run" / "checkpoint.tmp").exists()


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
