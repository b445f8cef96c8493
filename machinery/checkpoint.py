"""
Nothing lost on any crash: crash-safe checkpoints, exact resume, Ctrl-C / SIGTERM, a second run's folder.

    checkpoint.check_fresh(run_dir, overwrite)          # a new run refuses a folder that holds another run
    checkpoint.save(run_dir, model, tokenizer, optimizer, step, history, tokens_trained, world)
    cfg, given, state = checkpoint.resume(cfg, given)   # --resume RUN: its saved config and trainer state
    with checkpoint.Signals() as signals: ...           # a signal ends the run with a checkpoint

RUN/checkpoint/ is a Hugging Face folder (AutoModelForCausalLM.from_pretrained loads it) plus
trainer.pt: the next step to run, the optimizer state, the held-out evaluations so far and the count
of trained tokens (and tiny.json for a tiny-world run: its world). There is no random state in it:
every random number of step s (the samples, the `random` control, the mini-batch shuffle) is drawn
from seeds derived from (--seed, s) (train.py), so a resumed step s draws exactly what the
uninterrupted one drew, whatever moment the run stopped at (bit for bit on a CPU in float32).

The windows a run can stop in, and what resuming does about each (docs/checkpoints.md has the table):
  - between or inside steps (a signal): the checkpoint holds the steps fully applied; an unfinished
    step is replayed. Once a step's first optimizer update has run, a signal waits for the end of
    its batch (Signals.hold), so a checkpoint never holds half a batch; a second signal quits at once.
  - during a held-out evaluation, the final one included: the checkpoint says which evaluations were
    recorded; train.py redoes one that was due and is missing, and saves it.
  - out of memory: train.py saves the steps applied when no weight of the batch moved yet, and names
    the knobs to lower on resume (out_of_memory); resume accepts them (RESUME_SAFE).
  - a hard crash (SIGKILL, power) after a periodic save: log.jsonl may hold steps the checkpoint does
    not; resume cuts it back to the checkpoint's step, keeping what it cut in log.jsonl.cut, so the
    log holds each step once.
  - during the save itself: written to checkpoint.tmp, flushed to disk, and only then marked complete
    (trainer.pt), then swapped in through checkpoint.old; finish_swap completes a swap that a crash cut
    short. One complete checkpoint exists at every instant, also across a power cut.
"""
import dataclasses
import json
import os
import shutil
import signal
import threading

import torch
from tqdm import tqdm

VERSION = 2  # of trainer.pt: 2 has no random state (version 1, before per-step seeds, had one)
# Knobs that may change when a run is resumed: none of them changes what the run computes (the last five
# only how it fits in memory, beyond float rounding: what an out-of-memory stop asks to lower).
RESUME_SAFE = ("resume", "device", "eval_every", "save_every", "wandb",
               "micro_batch_size", "gen_batch_size", "logprob_chunk", "gradient_checkpointing", "generation")


def save(run_dir, model, tokenizer, optimizer, step, history, tokens_trained, world=None):
    """Model + tokenizer as an HF folder (RUN/checkpoint), plus trainer.pt with what resuming needs, and
    for a tiny-world run tiny.json naming its world, so that `--model RUN/checkpoint` continues in that
    world with its values (tiny.world_of reads it).

    Crash-safe: written to checkpoint.tmp, every file and the folder flushed to disk, and only then
    trainer.pt renamed into place, the marker that the folder is complete (finish_swap trusts it), then
    swapped in: checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint, remove checkpoint.old.
    log.jsonl is flushed too, so the log on disk reaches the checkpoint's step.
    """
    finish_swap(run_dir)
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if world is not None:
        with open(os.path.join(tmp, "tiny.json"), "w") as f:
            json.dump({"world": world, "trained_by": "train.py", "step": step}, f)
    state = {"version": VERSION, "step": step, "optimizer": optimizer.state_dict(), "history": history,
             "tokens_trained": tokens_trained}  # step: the next step to run; its prompts are batch_at(step)
    torch.save(state, os.path.join(tmp, "trainer.pt.part"))
    # [ours] A rename can reach the disk before the data it names: every file and the folder are flushed
    # first, and only then does the marker appear, so a tmp folder with a trainer.pt is complete on disk
    # even across a power cut, and finish_swap may trust it.
    for name in os.listdir(tmp):
        fsync(os.path.join(tmp, name))
    fsync(tmp)
    os.replace(os.path.join(tmp, "trainer.pt.part"), os.path.join(tmp, "trainer.pt"))  # the marker: tmp is complete
    fsync(tmp)  # the marker's rename
    for name in ("log.jsonl", "config.json"):
        if os.path.isfile(os.path.join(run_dir, name)):
            fsync(os.path.join(run_dir, name))
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(tmp, final)
    fsync(run_dir)  # the renames themselves
    shutil.rmtree(old, ignore_errors=True)
    return step


RUN_FILES = ("log.jsonl", "log.jsonl.cut", "resumes.jsonl", "selection", "checkpoint", "checkpoint.tmp",
             "checkpoint.old")


def check_fresh(run_dir, overwrite=False):
    """A fresh run may start in run_dir: a ValueError if it holds another run (its log or its checkpoint)
    and `overwrite` is off. A second run never destroys a first one that the user did not ask to replace."""
    held = [name for name in ("log.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old")
            if os.path.exists(os.path.join(run_dir, name))]
    if held and not overwrite:
        raise ValueError(f"{run_dir} holds another run ({', '.join(held)}): continue it with python train.py "
                         f"--resume {run_dir}, or replace it with --overwrite true, or pass another --out_dir")


def fresh(run_dir, overwrite=False):
    """The folder of a fresh run (check_fresh first): created, or emptied of what another run left there
    (its log, pages and checkpoint), so that nothing of it is ever resumed or plotted as this run's."""
    check_fresh(run_dir, overwrite)
    os.makedirs(run_dir, exist_ok=True)
    for name in RUN_FILES:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def fsync(path):
    """Flush a file, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish_swap(run_dir):
    """Complete a checkpoint swap that a crash interrupted: afterwards RUN/checkpoint is the newest
    complete checkpoint (if there is any), and no .tmp or .old folder is left."""
    final, tmp, old = (os.path.join(run_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    if os.path.isfile(os.path.join(tmp, "trainer.pt")):  # a finished save: newer than anything else here
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
    elif not os.path.isdir(final) and os.path.isfile(os.path.join(old, "trainer.pt")):
        os.replace(old, final)  # the crash came between the two renames, before tmp was complete
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def load(run_dir):
    """The saved config (a dict) and trainer state of a run folder, or a one-line ValueError."""
    ckpt = os.path.join(run_dir, "checkpoint")
    if not os.path.isdir(run_dir):
        raise ValueError(f"--resume {run_dir}: no such folder; pass the run folder of an earlier train.py run")
    finish_swap(run_dir)
    for need in (os.path.join(run_dir, "config.json"), os.path.join(ckpt, "trainer.pt"),
                 os.path.join(ckpt, "config.json")):
        if not os.path.isfile(need):
            raise ValueError(f"--resume {run_dir}: incomplete run folder, {need} is missing (it has no finished "
                             f"checkpoint yet); start a fresh run instead")
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
        # map_location: a checkpoint saved on a GPU loads on any machine; load_state_dict then moves the
        # optimizer state to wherever the parameters are (--device may change on resume)
        state = torch.load(os.path.join(ckpt, "trainer.pt"), map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"--resume {run_dir}: its config.json or checkpoint/trainer.pt is corrupt "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); start a fresh run") from None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"--resume {run_dir}: its checkpoint was written by another version of train.py; start a "
                         f"fresh run")
    return saved, state


def resume(cfg, given):
    """(config, given, trainer state) of --resume RUN: the run continues with its saved config, in the
    folder given (it may have been moved), and only the RESUME_SAFE knobs may change; a change is
    recorded in RUN/resumes.jsonl. log.jsonl is cut back to the checkpoint's step."""
    saved, state = load(cfg.resume)
    refused = sorted(set(given) - set(RESUME_SAFE))
    if refused:
        raise ValueError(f"--resume continues a run with its saved config; {', '.join('--' + n for n in refused)} "
                         f"cannot change now (only {', '.join('--' + n for n in RESUME_SAFE[1:])} can); start a "
                         f"new run to change them")
    known = {f.name for f in dataclasses.fields(cfg)}
    if set(saved) != known:
        raise ValueError(f"--resume {cfg.resume}: its config.json has other knobs than this train.py "
                         f"({', '.join(sorted(set(saved) ^ known))}); start a fresh run")
    changed = {n: [saved[n], getattr(cfg, n)] for n in sorted(given) if n != "resume" and saved[n] != getattr(cfg, n)}
    if changed:
        with open(os.path.join(cfg.resume, "resumes.jsonl"), "a") as f:
            f.write(json.dumps({"step": state["step"], "changed": changed}) + "\n")
    saved.update({n: getattr(cfg, n) for n in given}, resume=cfg.resume, out_dir=cfg.resume)
    trim_log(cfg.resume, state["step"])
    return type(cfg)(**saved), known, {**state, "changed": changed}  # every knob of a saved config counts as given


def trim_log(run_dir, step):
    """Keep the rows of log.jsonl before `step` (the checkpoint's next step); append the others, logged
    after the checkpoint by a run that then crashed, to log.jsonl.cut."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep, cut = [], []
    for line in lines:
        try:
            (keep if json.loads(line)["step"] < step else cut).append(line)
        except (ValueError, KeyError):  # a line cut off by the crash
            cut.append(line)
    if cut:
        with open(path + ".cut", "a") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in cut)
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def out_of_memory(cfg, step, saved):
    """The line an out-of-memory stop prints: where the run continues from, and with which of the knobs
    that change memory and nothing computed (RESUME_SAFE) set lower. saved: the checkpoint's step, or None."""
    gen = cfg.gen_batch_size or cfg.prompts_per_step * cfg.group_size
    lower = (f"--micro_batch_size {max(1, cfg.micro_batch_size // 2)} (or --gen_batch_size {max(1, gen // 2)}, "
             f"--logprob_chunk {max(1, cfg.logprob_chunk // 2)}, --gradient_checkpointing true; experiments/speed.md has "
             f"settings by GPU memory)")
    if saved is None:
        return f"out of memory at step {step}, before any checkpoint; start again with less memory per pass: {lower}"
    return (f"out of memory at step {step}; the checkpoint holds the steps before {saved}; continue with less memory "
            f"per pass: python train.py --resume {cfg.out_dir} {lower}")


class Signals:
    """Ctrl-C (SIGINT) and SIGTERM (what a job scheduler, a container runtime or `kill` sends) both end
    the run with a checkpoint. While `hold` is set (from a batch's first update to its log line) they
    wait, so that a checkpoint always falls on a rollout-batch boundary; a second signal then quits at
    once, without saving. Installed only in the main thread (Python's rule for signals)."""

    def __init__(self):
        self.received, self.hold, self.old = None, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def handler(self, signum, frame):
        first = self.received is None
        self.received = signum
        if self.hold and first:
            tqdm.write("stopping after this batch's updates (signal again to quit without saving)")
            return
        raise KeyboardInterrupt

    def release(self):
        """End of a batch: a signal that came during it ends the run now."""
        self.hold = False
        if self.received is not None:
            raise KeyboardInterrupt
