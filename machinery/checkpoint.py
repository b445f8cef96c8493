"""
Crash-safe checkpoints and exact resume: what RUN/checkpoint holds, and how a run folder is checked.

    checkpoint.check_fresh(run_dir, overwrite)         # refuses a folder that holds another run
    checkpoint.save(run_dir, model, tokenizer, optimizer, step, history, tokens_trained, world)
    cfg, given, state = checkpoint.resume(cfg, given)  # --resume RUN: its config and trainer state
    held = checkpoint.lock(run_dir)                    # RUN/run.lock: one run per folder
    checkpoint.resumable(run_dir)                      # does --resume RUN work now?

RUN/checkpoint/ is a Hugging Face folder (AutoModelForCausalLM.from_pretrained loads it; a LoRA
run's holds PEFT's adapters, adapter_config.json naming their base, which model.load_model loads)
plus trainer.pt: the next step to run, the optimizer state (with float16's gradient scale), the
held-out evaluations so far and the count of trained tokens (and tiny.json for a tiny-world run).
There is no random state in it: every random number of step s (the samples, the `random` control,
the mini-batch shuffle) is drawn from seeds derived from (--seed, s) (train.py), so a resumed step s
draws exactly what the uninterrupted one drew, whatever moment the run stopped at (bit for bit on a
CPU in float32).
The save is written to checkpoint.tmp, flushed to disk, only then marked complete (trainer.pt) and
swapped in through checkpoint.old: one complete checkpoint exists at every instant, also across a
power cut. A hard crash after a periodic save may leave log.jsonl ahead of the checkpoint: trim_log
cuts it back on resume. machinery/run.py decides when each of these runs (docs/checkpoints.md).
Every refusal names the command that works in the state the folder is in: --resume RUN once it
holds a finished checkpoint, else the fresh start that replaces it (`command`).
"""
import dataclasses
import json
import os
import shlex
import shutil

import torch

import d3s
from machinery.model import is_lora

try:
    import fcntl  # POSIX
except ImportError:
    fcntl = None

LOCK = "run.lock"
VERSION = 2  # of trainer.pt: 2 has no random state (version 1, before per-step seeds, had one)
# Knobs that may change when a run is resumed: none of them changes what the run computes (the last
# five only how it fits in memory, beyond float rounding: what an out-of-memory stop asks to lower).
RESUME_SAFE = ("resume", "device", "eval_every", "save_every", "wandb",
               "micro_batch_size", "gen_batch_size", "logprob_chunk", "gradient_checkpointing",
               "generation")
# What config.json records beside the knobs, so that an edit outside the config block shows:
# d3s.METHODS[method] as the run ran it, and the value each pick() line gave this run.
RECORDED = ("method_spec", "picked")


def save(run_dir, model, tokenizer, optimizer, step, history, tokens_trained, world=None):
    """Model + tokenizer as an HF folder (RUN/checkpoint), plus trainer.pt with what resuming needs,
    and for a tiny-world run tiny.json naming its world, so that `--model RUN/checkpoint` continues
    in that world with its values (tiny.world_of reads it).

    Crash-safe: written to checkpoint.tmp, every file and the folder flushed to disk, and only then
    trainer.pt renamed into place, the marker that the folder is complete (finish_swap trusts it),
    then swapped in: checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint, remove
    checkpoint.old. log.jsonl is flushed too, so the log on disk reaches the checkpoint's step.
    """
    finish_swap(run_dir)
    final, tmp, old = (os.path.join(run_dir, name)
                       for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    # LoRA: the adapters alone (their embeddings never train: PEFT need not look for a vocabulary)
    model.save_pretrained(tmp, **({"save_embedding_layers": False} if is_lora(model) else {}))
    tokenizer.save_pretrained(tmp)
    if world is not None:
        with open(os.path.join(tmp, "tiny.json"), "w") as f:
            json.dump({"world": world, "trained_by": "train.py", "step": step}, f)
    # step: the next step to run; its prompts are batch_at(step)
    state = {"version": VERSION, "step": step, "optimizer": optimizer.state_dict(),
             "history": history, "tokens_trained": tokens_trained}
    torch.save(state, os.path.join(tmp, "trainer.pt.part"))
    # [ours] A rename can reach the disk before the data it names: every file and the folder are
    # flushed first, and only then does the marker appear, so a tmp folder with a trainer.pt is
    # complete on disk even across a power cut, and finish_swap may trust it.
    for name in os.listdir(tmp):
        fsync(os.path.join(tmp, name))
    fsync(tmp)
    # the marker: tmp is complete
    os.replace(os.path.join(tmp, "trainer.pt.part"), os.path.join(tmp, "trainer.pt"))
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


RUN_FILES = ("config.json", "log.jsonl", "log.jsonl.cut", "resumes.jsonl", "selection",
             "checkpoint", "checkpoint.tmp", "checkpoint.old")


def check_fresh(run_dir, overwrite=False):
    """A fresh run may start in run_dir: a ValueError if it holds another run (its config.json, log
    or checkpoint: a run that has not logged its first step yet is a run too) and `overwrite` is
    off. A second run never destroys a first one that the user did not ask to replace."""
    held = [name for name in ("config.json", "log.jsonl", "checkpoint", "checkpoint.tmp",
                              "checkpoint.old")
            if os.path.exists(os.path.join(run_dir, name))]
    if held and not overwrite:
        go_on = (f"continue it with python train.py --resume {run_dir}, or " if
                 resumable(run_dir) else "it has no finished checkpoint to continue; ")
        raise ValueError(f"{run_dir} holds another run ({', '.join(held)}): {go_on}replace it "
                         f"with --overwrite true, or pass another --out_dir")


def resumable(run_dir):
    """Does `--resume run_dir` find a run to continue: its config.json and a finished checkpoint
    (trainer.pt, its marker), also one that finish_swap completes from checkpoint.tmp or .old?"""
    return os.path.isfile(os.path.join(run_dir, "config.json")) and any(
        os.path.isfile(os.path.join(run_dir, name, "trainer.pt"))
        for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))


def command(knobs):
    """`python train.py --knob value ...` for {knob: value}, each value as the command line reads
    it back (a bool as true / false, a path quoted where the shell would split it)."""
    def flag(value):
        return str(value).lower() if isinstance(value, bool) else shlex.quote(str(value))
    return " ".join(["python train.py"] + [f"--{k} {flag(v)}" for k, v in knobs.items()])


def start_again(run_dir, config_class=None):
    """The fresh start that replaces the run in run_dir by the same run: the knobs of its
    config.json that differ from config_class's values (a pick(): the value it gave that run; a
    size for the card, as sized), its folder and --overwrite true."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = {}
    saved = saved if isinstance(saved, dict) else {}
    fields = dataclasses.fields(config_class) if config_class is not None else ()
    picks = saved.get("picked") if isinstance(saved.get("picked"), dict) else {}
    own = {f.name: saved[f.name] for f in fields if f.name in saved  # the values not by default
           and saved[f.name] != picks.get(f.name, f.default)
           and f.name not in ("resume", "out_dir", "overwrite")}
    return command({**own, "out_dir": run_dir, "overwrite": True}) + \
        ("" if saved and fields else " and the flags it ran with")  # a config.json not read


def fresh(run_dir, overwrite=False):
    """The folder of a fresh run (check_fresh first): created, or emptied of what another run left
    there (its log, pages and checkpoint), so that nothing of it is ever resumed or plotted as this
    run's."""
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
    final, tmp, old = (os.path.join(run_dir, name)
                       for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    # a finished save: newer than anything else here
    if os.path.isfile(os.path.join(tmp, "trainer.pt")):
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
    elif not os.path.isdir(final) and os.path.isfile(os.path.join(old, "trainer.pt")):
        os.replace(old, final)  # the crash came between the two renames, before tmp was complete
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def load(run_dir, config_class=None):
    """The saved config (a dict: its knobs and RECORDED) and trainer state of a run folder, or a
    one-line ValueError; config_class (train.Config) names the fresh start that replaces a run
    that cannot be resumed."""
    ckpt = os.path.join(run_dir, "checkpoint")
    if not os.path.isdir(run_dir):
        raise ValueError(f"--resume {run_dir}: no such folder; pass the run folder of an earlier "
                         f"train.py run")
    finish_swap(run_dir)
    weights = "adapter_config.json" if os.path.isfile(os.path.join(ckpt, "adapter_config.json")) \
        else "config.json"  # LoRA's adapters, or a whole model
    again = f"start it again with: {start_again(run_dir, config_class)}"
    for need in (os.path.join(run_dir, "config.json"), os.path.join(ckpt, "trainer.pt"),
                 os.path.join(ckpt, weights)):
        if not os.path.isfile(need):
            raise ValueError(f"--resume {run_dir}: incomplete run folder, {need} is missing "
                             f"(it has no finished checkpoint yet); {again}")
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
        # map_location: a checkpoint saved on a GPU loads on any machine; load_state_dict then moves
        # the optimizer state to wherever the parameters are (--device may change on resume)
        state = torch.load(os.path.join(ckpt, "trainer.pt"), map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"--resume {run_dir}: its config.json or checkpoint/trainer.pt is corrupt "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                         f"{again}") from None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"--resume {run_dir}: its checkpoint was written by another version of "
                         f"train.py; {again}")
    return saved, state


def resume(cfg, given):
    """(saved config, trainer state) of --resume RUN: the run continues with its saved config, in
    the folder given (it may have been moved), and only the RESUME_SAFE knobs may change:
    state["changed"] holds {knob: [saved, new]}, for the caller to record once the new values are
    accepted. Every knob of the saved config counts as given. A run whose method d3s.py now
    defines otherwise (config.json's method_spec) is refused: it would not continue exactly."""
    saved, state = load(cfg.resume, type(cfg))
    refused = sorted(set(given) - set(RESUME_SAFE))
    if refused:
        raise ValueError(f"--resume continues a run with its saved config; "
                         f"{', '.join('--' + n for n in refused)} cannot change now "
                         f"(only {', '.join('--' + n for n in RESUME_SAFE[1:])} can); "
                         f"start a new run to change them")
    recorded = {k: saved.pop(k) for k in RECORDED if k in saved}
    known = {f.name for f in dataclasses.fields(cfg)}
    if set(saved) != known:
        raise ValueError(f"--resume {cfg.resume}: its config.json has other knobs than this "
                         f"train.py ({', '.join(sorted(set(saved) ^ known))}); start it again "
                         f"with: {start_again(cfg.resume, type(cfg))}")
    edited = spec_changes(saved["method"], recorded.get("method_spec"))
    if edited:
        raise ValueError(f"--resume {cfg.resume}: d3s.METHODS[{saved['method']!r}] has changed "
                         f"since the run started ({edited}), so it would not continue exactly; "
                         f"put it back in d3s.py, or start it again with: "
                         f"{start_again(cfg.resume, type(cfg))}")
    changed = {n: [saved[n], getattr(cfg, n)] for n in sorted(given)
               if n != "resume" and saved[n] != getattr(cfg, n)}
    saved.update({n: getattr(cfg, n) for n in given}, resume=cfg.resume, out_dir=cfg.resume)
    return type(cfg)(**saved), known, {**state, "changed": changed}


def method_spec(method):
    """d3s.METHODS[method] as config.json records it (its modes, schedule and any other entry)."""
    return json.loads(json.dumps(d3s.METHODS.get(method), default=str))


def spec_changes(method, recorded):
    """How d3s.METHODS[method] now differs from the spec a run recorded ("schedule linear ->
    constant"), or "" (also for a config.json from before method_spec was recorded)."""
    now = method_spec(method)
    if recorded is None or recorded == now:
        return ""
    if now is None:
        return "it is no longer there"
    return ", ".join(f"{k} {recorded.get(k, 'absent')} -> {now.get(k, 'absent')}"
                     for k in dict.fromkeys([*recorded, *now])
                     if recorded.get(k, "absent") != now.get(k, "absent"))


def record_resume(run_dir, step, changed, why=None):
    """A resume's accepted changes, or those a run made itself (why: "out of memory"), appended to
    RUN/resumes.jsonl."""
    if changed:
        with open(os.path.join(run_dir, "resumes.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "changed": changed, **({"why": why} if why else {})})
                    + "\n")


def trim_log(run_dir, step):
    """Keep the rows of log.jsonl before `step` (the checkpoint's next step); append the others,
    logged after the checkpoint by a run that then crashed, to log.jsonl.cut."""
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


# -----------------------------------------------------------------------------
# the folder's lock: one run per folder


def lock(run_dir):
    """Take RUN/run.lock for this process, or a one-line ValueError when a live run holds it. An
    flock is dropped by the kernel when its process dies, so a lock file left by a killed run is
    taken over. Where flock is missing (no fcntl) or refused by the filesystem (ENOLCK, or
    EOPNOTSUPP on some NFS, CIFS and FUSE mounts): the file holds the pid, stale once it is gone."""
    path = os.path.join(run_dir, LOCK)
    while fcntl is not None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a folder this user may not write into
            raise ValueError(f"cannot write {path}: {e.strerror}; pass another --out_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another open file holds it: a live process
            os.close(fd)
            raise ValueError(_in_use(run_dir, path)) from None
        except OSError:  # this filesystem has no flock: the pid file below
            os.close(fd)
            break
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return fd, path  # ours, and still the file at that path
        except FileNotFoundError:
            pass
        os.close(fd)  # the run that held it removed it as we took it: take the new one
    part = f"{path}.{os.getpid()}"  # the pid, written before the file appears under its name
    try:
        with open(part, "w") as f:
            f.write(f"{os.getpid()}\n")
        while True:
            try:
                os.link(part, path)  # atomic: fails when the file exists
                return os.open(path, os.O_RDONLY), path
            except FileExistsError:
                holder = _holder(path)
                if holder is not None and _alive(holder):
                    raise ValueError(_in_use(run_dir, path)) from None
            try:
                os.remove(path)  # a dead process's lock, or an empty file
            except FileNotFoundError:
                pass
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror}; pass another --out_dir") from None
    finally:
        if os.path.exists(part):
            os.remove(part)


def _in_use(run_dir, path):
    return (f"{run_dir} is in use by a train.py that is still running "
            f"(pid {_holder(path) or '?'}); wait for it to stop, or pass another --out_dir")


def unlock(held):
    """Release what lock() took: the file goes first, then the flock with its descriptor."""
    fd, path = held
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    os.close(fd)


def _holder(path):
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
