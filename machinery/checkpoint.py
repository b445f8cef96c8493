"""
Crash-safe checkpoints and exact resume: what RUN/checkpoint holds, and how a run folder is checked.

    checkpoint.check_fresh(run_dir, overwrite)         # refuses a folder that holds another run
    checkpoint.save(run_dir, model, tokenizer, optimizer, step, history, tokens_trained, world,
                    config)                            # RUN/checkpoint, with a copy of config.json
    cfg, given, state = checkpoint.resume(cfg, given)  # --resume RUN: its config and trainer state
    held = checkpoint.lock(run_dir)                    # RUN/run.lock: one run per folder
    checkpoint.live(run_dir)                           # the pid of a live run there, or None
    checkpoint.resumable(run_dir)                      # does --resume RUN work now?

RUN/checkpoint/ is a Hugging Face folder (AutoModelForCausalLM.from_pretrained loads it; a LoRA
run's holds PEFT's adapters, adapter_config.json naming their base, which model.load_model loads)
plus trainer.pt: the next step to run, the optimizer state (with float16's gradient scale), the
held-out evaluations so far, the count of trained tokens and a copy of config.json (and tiny.json
for a tiny-world run), so that a config.json lost or broken since does not lose the run. There is
no random state in it: every random number of step s (the samples, the `random` control, the
mini-batch shuffle) is drawn from seeds derived from (--seed, s) (train.py), so a resumed step s
draws exactly what the uninterrupted one drew, whatever moment the run stopped at (bit for bit on a
CPU in float32).
The save is written to checkpoint.tmp (removed if the save fails: a full disk is not kept full),
flushed to disk, only then marked complete (trainer.pt) and swapped in through checkpoint.old: one
complete checkpoint exists at every instant, also across a power cut; config.json is replaced whole
in the same way (write_atomic). A hard crash after a
periodic save may leave log.jsonl ahead of the checkpoint: trim_log cuts it back on resume.
machinery/run.py decides when each of these runs (docs/checkpoints.md).
Every refusal names the command that works in the state the folder is in: --resume RUN once it
holds a finished checkpoint, else the fresh start that replaces it (`command`); where this train.py
cannot continue a whole checkpoint, a new run from its weights, and a start that would delete it
says so. A resume checks what it reads before it runs a step: config.json's values as train.py
checks flags (else the checkpoint's copy goes on), trainer.pt whole, the weights' headers.
"""
import dataclasses
import errno
import json
import os
import shlex
import shutil

import torch
from safetensors import safe_open

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


def save(run_dir, model, tokenizer, optimizer, step, history, tokens_trained, world=None,
         config=None):
    """Model + tokenizer as an HF folder (RUN/checkpoint), plus trainer.pt with what resuming needs
    (and `config`, what config.json holds, so that the checkpoint alone can be resumed), and for a
    tiny-world run tiny.json naming its world, so that `--model RUN/checkpoint` continues in that
    world with its values (tiny.world_of reads it).

    Crash-safe: written to checkpoint.tmp, every file and the folder flushed to disk, and only then
    trainer.pt renamed into place, the marker that the folder is complete (finish_swap trusts it),
    then swapped in: checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint, remove
    checkpoint.old. log.jsonl is flushed too, so the log on disk reaches the checkpoint's step.
    """
    finish_swap(run_dir)
    final, tmp, old = (os.path.join(run_dir, name)
                       for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # LoRA: the adapters alone (their embeddings never train: PEFT need not look for a
        # vocabulary)
        model.save_pretrained(tmp, **({"save_embedding_layers": False} if is_lora(model) else {}))
        tokenizer.save_pretrained(tmp)
        if world is not None:
            with open(os.path.join(tmp, "tiny.json"), "w") as f:
                json.dump({"world": world, "trained_by": "train.py", "step": step}, f)
        # step: the next step to run; its prompts are batch_at(step)
        state = {"version": VERSION, "step": step, "optimizer": optimizer.state_dict(),
                 "history": history, "tokens_trained": tokens_trained,
                 **({"config": config} if config is not None else {})}
        # into a file of ours: a failed write is then an OSError under torch's error, which names
        # only a line of its C++
        with open(os.path.join(tmp, "trainer.pt.part"), "wb") as f:
            torch.save(state, f)
        # [ours] A rename can reach the disk before the data it names: every file and the folder
        # are flushed first, and only then does the marker appear, so a tmp folder with a
        # trainer.pt is complete on disk even across a power cut, and finish_swap may trust it.
        for name in os.listdir(tmp):
            fsync(os.path.join(tmp, name))
        fsync(tmp)
        # the marker: tmp is complete
        os.replace(os.path.join(tmp, "trainer.pt.part"), os.path.join(tmp, "trainer.pt"))
    except BaseException:  # a full disk, say: the part written goes now, not at the next start
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


CHECKPOINTS = ("checkpoint", "checkpoint.tmp", "checkpoint.old")
RUN_FILES = ("config.json", "config.json.part", "log.jsonl", "log.jsonl.part", "log.jsonl.cut",
             "resumes.jsonl", "curves.png", "selection.html", "selection.html.tmp", "selection",
             *CHECKPOINTS)


def check_fresh(run_dir, overwrite=False):
    """A fresh run may start in run_dir: a ValueError if it holds another run (its config.json, log
    or checkpoint: a run that has not logged its first step yet is a run too) and `overwrite` is
    off. A second run never destroys a first one that the user did not ask to replace."""
    held = [name for name in ("config.json", "log.jsonl", *CHECKPOINTS)
            if os.path.exists(os.path.join(run_dir, name))]
    if held and not overwrite:
        whole = resumable(run_dir)
        go_on = (f"continue it with python train.py --resume {shlex.quote(run_dir)}, or " if whole
                 else "it has no finished checkpoint to continue; ")
        raise ValueError(f"{run_dir} holds another run ({', '.join(held)}): {go_on}replace it "
                         f"with --overwrite true{' (its checkpoint deleted)' * whole}, or pass "
                         f"another --out_dir")


def resumable(run_dir):
    """Does `--resume run_dir` find a run to continue: a finished checkpoint (trainer.pt, its
    marker), also one that finish_swap completes from checkpoint.tmp or .old? (Its config.json, or
    the copy the checkpoint holds, says how the run goes on: load.)"""
    return any(os.path.isfile(os.path.join(run_dir, name, "trainer.pt")) for name in CHECKPOINTS)


def command(knobs):
    """`python train.py --knob value ...` for {knob: value}, each value as the command line reads
    it back (a bool as true / false, a path quoted where the shell would split it)."""
    def flag(value):
        return str(value).lower() if isinstance(value, bool) else shlex.quote(str(value))
    return " ".join(["python train.py"] + [f"--{k} {flag(v)}" for k, v in knobs.items()])


def read_config(run_dir, config_class=None):
    """(RUN/config.json as a dict, "") or (None, what is wrong with it): unreadable, not JSON, or
    (config_class given) not the knobs config_class has, each of its type (wrong_knobs)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            saved = json.load(f)
    except FileNotFoundError:
        return None, "is missing"
    except (OSError, ValueError) as e:  # ValueError: not JSON (an empty file, a cut-off one)
        return None, f"is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    wrong = wrong_knobs(saved, config_class)
    return (None, wrong) if wrong else (saved, "")


TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def wrong_knobs(saved, config_class=None):
    """What is wrong with a saved config (config.json's dict) for config_class, or "": not a JSON
    object, other knobs than config_class has (beside RECORDED), or a value of another type than
    its knob's (an int for a float is a float; "auto" where a pick() has a gpu value)."""
    if not isinstance(saved, dict):
        return f"is not a JSON object of knobs (it holds {json.dumps(saved)[:40]})"
    if not all(isinstance(saved.get(k, {}), (dict, type(None))) for k in RECORDED):
        return f"holds a {' or '.join(RECORDED)} that is not a JSON object"
    if config_class is None:
        return ""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    other = sorted(set(saved) - set(RECORDED) ^ set(fields))
    if other:
        return f"has other knobs than this train.py ({', '.join(other)})"
    for name, f in fields.items():
        if not fits(f, saved[name]):
            return (f"holds {name} {json.dumps(saved[name])}, where train.py needs "
                    f"{TYPES.get(f.type, f.type.__name__)}")
    return ""


def fits(field, value):
    """Is `value` of the knob's type (an int for a float is a float; "auto" where a pick() has a
    gpu value)?"""
    return type(value) is field.type or (field.type is float and type(value) is int) or \
        (value == "auto" and "gpu" in field.metadata.get("pick", {}))


def start_again(run_dir, config_class=None, saved=None, deleting=False):
    """The fresh start that replaces the run in run_dir by the same run, as "start it again with:
    python train.py ..." (deleting: saying that it deletes a whole checkpoint): the knobs of its
    config.json (or `saved`) that a fresh run would not take by itself (a pick() knob unless
    config.json's picked has it: a flag, or a size for the card as sized; any other knob that
    differs from config_class's value), its folder and --overwrite true. Without a readable
    config.json the run's flags are lost, and the line says so."""
    if saved is None:  # as much of it as this train.py can read: its knobs of the right type
        saved, _ = read_config(run_dir)
    note = ", deleting its checkpoint," if deleting else ""
    if saved is None or config_class is None:
        return (f"its flags went with its config.json; start a run there{note} (adding the flags "
                f"you want) with: {command({'out_dir': run_dir, 'overwrite': True})}")
    picks = saved.get("picked") or {}
    own = {f.name: saved[f.name] for f in dataclasses.fields(config_class)
           if f.name in saved and fits(f, saved[f.name])
           and f.name not in ("resume", "out_dir", "overwrite")
           and (saved[f.name] != picks[f.name] if f.name in picks else
                "pick" in f.metadata or saved[f.name] != f.default)}
    return f"start it again{note} with: {command({**own, 'out_dir': run_dir, 'overwrite': True})}"


def from_weights(run_dir, whole="its checkpoint is whole"):
    """The line for a run whose weights are whole but that this train.py cannot continue: its
    weights start a new run, in another folder, and the run is left as it is."""
    return (f"start a new run from its weights ({whole}) with: "
            f"{command({'model': os.path.join(run_dir, 'checkpoint')})}")


def fresh(run_dir, overwrite=False):
    """The folder of a fresh run (check_fresh first): created, or emptied of what another run left
    there (its log, pages and checkpoint), so that nothing of it is ever resumed or plotted as this
    run's. The checkpoints' markers go first: a kill during the deletion leaves a folder that
    --resume refuses and the same --overwrite true empties, never a checkpoint without its log."""
    check_fresh(run_dir, overwrite)
    os.makedirs(run_dir, exist_ok=True)
    for name in CHECKPOINTS:
        if os.path.isfile(os.path.join(run_dir, name, "trainer.pt")):
            os.remove(os.path.join(run_dir, name, "trainer.pt"))
            fsync(os.path.join(run_dir, name))
    for name in RUN_FILES:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def write_atomic(path, text):
    """Write a small file of the run folder (config.json) as a checkpoint is written: to PATH.part,
    flushed to disk, renamed over PATH, the rename flushed. A crash or a full disk at any moment
    leaves the old file or the new one whole, never an empty or cut-off one."""
    part = path + ".part"
    try:
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        try:
            os.remove(part)
        except OSError:  # never written, or a read-only folder: the error above says it
            pass
        raise
    fsync(os.path.dirname(path) or ".")


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


def load(run_dir, config_class=None, check=None):
    """The saved config (a dict: its knobs and RECORDED) and trainer state of a run folder, or a
    one-line ValueError that says how to go on; config_class (train.Config) checks the config's
    knobs, and check (config.resolve) their values. A config.json that cannot be read, or holds what
    this train.py cannot run (usable), gives way to the copy the checkpoint holds
    (state["recovered"] says why). trainer.pt is checked whole (malformed) and the weights' files
    as far as their headers, so that a damaged checkpoint is this line, never a traceback later."""
    ckpt = os.path.join(run_dir, "checkpoint")
    if not os.path.isdir(run_dir):
        raise ValueError(f"--resume {run_dir}: no such folder; pass the run folder of an earlier "
                         f"train.py run")
    finish_swap(run_dir)
    weights = "adapter_config.json" if os.path.isfile(os.path.join(ckpt, "adapter_config.json")) \
        else "config.json"  # LoRA's adapters, or a whole model
    for need in (os.path.join(ckpt, "trainer.pt"), os.path.join(ckpt, weights)):
        if not os.path.isfile(need):
            raise ValueError(f"--resume {run_dir}: incomplete run folder, {need} is missing "
                             f"(it has no finished checkpoint yet); "
                             f"{start_again(run_dir, config_class)}")
    try:
        # map_location: a checkpoint saved on a GPU loads on any machine; load_state_dict then moves
        # the optimizer state to wherever the parameters are (--device may change on resume)
        state = torch.load(os.path.join(ckpt, "trainer.pt"), map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(damaged(run_dir, "trainer.pt", first_line(e), config_class)) from None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"--resume {run_dir}: its checkpoint was written by another version of "
                         f"train.py; {from_weights(run_dir)}, or "
                         f"{start_again(run_dir, config_class, deleting=True)}")
    why = malformed(state)
    if why:
        raise ValueError(damaged(run_dir, "trainer.pt", why, config_class))
    for name, why in unreadable_weights(ckpt):
        raise ValueError(damaged(run_dir, name, why, config_class, weights=False))
    saved, wrong = read_config(run_dir, config_class)
    wrong = wrong or (usable(saved, state["step"], config_class, check) if saved else "")
    if wrong:  # [ours] the checkpoint's own copy, from the moment it was saved
        copy = state.get("config")
        theirs = copy is not None and usable(copy, state["step"], config_class, check)
        if copy is None or theirs:
            held = ("holds no copy of the run's knobs (it is older than such copies)"
                    if copy is None else "holds the same copy" if theirs == wrong
                    else f"holds a copy that {theirs}")
            raise ValueError(f"--resume {run_dir}: its config.json {wrong}, and its checkpoint "
                             f"{held}; {from_weights(run_dir)}")
        saved, state["recovered"] = dict(copy), f"config.json {wrong}"
    return saved, state


def usable(saved, step, config_class=None, check=None):
    """What keeps a saved config (config.json's dict, or the checkpoint's copy) from going on at
    `step`, or "": the wrong knobs (wrong_knobs), a value check refuses (config.resolve: "--steps
    must be at least 1, got -5"), or fewer steps than the checkpoint has run. A method d3s.py no
    longer has, or has changed, is left to resume, which names it."""
    wrong = wrong_knobs(saved, config_class)
    if wrong or config_class is None:
        return wrong
    if saved["steps"] < step:
        return f"holds steps {saved['steps']}, fewer than the {step} its checkpoint has run"
    if check is None or saved["method"] not in d3s.METHODS or \
            spec_changes(saved["method"], saved.get("method_spec")):
        return ""
    knobs = {k: v for k, v in saved.items() if k not in RECORDED}
    try:
        check(config_class(**knobs), set(knobs))
    except ValueError as e:
        return f"holds what train.py refuses ({e})"
    return ""


# what save() writes into trainer.pt, beside its version (and config, which load() checks)
STATE = {"step": int, "optimizer": dict, "history": list, "tokens_trained": int}
KINDS = {int: "an integer", dict: "a dict", list: "a list"}


def malformed(state):
    """What is wrong with a trainer.pt of this VERSION, or "": a value save() writes that is missing
    or of another kind (an int for the step and the tokens, the optimizer's state_dict, a list of
    {step, tokens, accuracy})."""
    for key, kind in STATE.items():
        if key not in state:
            return f"it has no {key}"
        if type(state[key]) is not kind:
            return f"its {key} is {short(state[key])}, not {KINDS[kind]}"
    if state["step"] < 0 or state["tokens_trained"] < 0:
        return f"its step {state['step']} or tokens_trained {state['tokens_trained']} is negative"
    if not (isinstance(state["optimizer"].get("state"), dict)
            and isinstance(state["optimizer"].get("param_groups"), list)):
        return "its optimizer is not an optimizer's state_dict (state, param_groups)"
    for h in state["history"]:
        if not (isinstance(h, dict) and type(h.get("step")) is int and type(h.get("tokens")) is int
                and type(h.get("accuracy")) in (int, float) and 0 <= h["step"] <= state["step"]):
            return (f"its history holds {short(h)}, not an evaluation ({{step, tokens, accuracy}}) "
                    f"up to step {state['step']}")
    return ""


def short(value):
    return json.dumps(value, default=repr)[:40]


def unreadable_weights(ckpt):
    """[(the file under RUN/checkpoint, why)] of its weights' files whose header is cut or broken
    (what safetensors checks on opening one: the JSON of the tensors and the file's length)."""
    for folder, _, names in sorted(os.walk(ckpt)):
        for name in sorted(n for n in names if n.endswith(".safetensors")):
            try:
                with safe_open(os.path.join(folder, name), "pt"):
                    pass
            except Exception as e:
                yield os.path.relpath(os.path.join(folder, name), ckpt), first_line(e)


def damaged(run_dir, name, why, config_class=None, weights=True):
    """The line for a checkpoint whose RUN/checkpoint/NAME is damaged: a new run from its weights,
    where they are whole, or the fresh start that replaces it."""
    return (f"--resume {run_dir}: its checkpoint/{name} is corrupt ({why}); "
            + (f"{from_weights(run_dir, 'its weights are whole')}, or " if weights else "")
            + start_again(run_dir, config_class, deleting=True))


def first_line(error):
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def resume(cfg, given, check=None):
    """(saved config, trainer state) of --resume RUN (check: load's): the run continues with its
    saved config, in the folder given (it may have been moved), and only the RESUME_SAFE knobs may
    change:
    state["changed"] holds {knob: [saved, new]}, for the caller to record once the new values are
    accepted, and state["picked"] the saved config's picked. Every knob of the saved config counts
    as given. A run whose method d3s.py no longer defines, or now defines otherwise (config.json's
    method_spec), is refused: it would not continue exactly."""
    saved, state = load(cfg.resume, type(cfg), check)
    refused = sorted(set(given) - set(RESUME_SAFE))
    if refused:
        raise ValueError(f"--resume continues a run with its saved config; "
                         f"{', '.join('--' + n for n in refused)} cannot change now "
                         f"(only {', '.join('--' + n for n in RESUME_SAFE[1:])} can); "
                         f"start a new run to change them")
    recorded = {k: saved.pop(k) for k in RECORDED if k in saved}
    known = {f.name for f in dataclasses.fields(cfg)}
    if saved["method"] not in d3s.METHODS:
        raise ValueError(f"--resume {cfg.resume}: it ran --method {saved['method']}, which "
                         f"d3s.METHODS no longer has, so this train.py cannot continue it; put the "
                         f"method back in d3s.py, or {from_weights(cfg.resume)}")
    edited = spec_changes(saved["method"], recorded.get("method_spec"))
    if edited:
        raise ValueError(f"--resume {cfg.resume}: d3s.METHODS[{saved['method']!r}] has changed "
                         f"since the run started ({edited}), so it would not continue exactly; "
                         f"put it back in d3s.py, or "
                         f"{start_again(cfg.resume, type(cfg), {**saved, **recorded}, True)}")
    changed = {n: [saved[n], getattr(cfg, n)] for n in sorted(given)
               if n != "resume" and saved[n] != getattr(cfg, n)}
    saved.update({n: getattr(cfg, n) for n in given}, resume=cfg.resume, out_dir=cfg.resume)
    return type(cfg)(**saved), known, {**state, "changed": changed,
                                       "picked": recorded.get("picked")}


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
    """Keep the rows of log.jsonl before `step` (the checkpoint's next step); add the others,
    logged after the checkpoint by a run that then crashed, to log.jsonl.cut, each once: a resume
    killed between the two writes cuts the same rows again, and they are there already."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
    keep, cut = [], []
    for line in lines:
        try:
            (keep if json.loads(line)["step"] < step else cut).append(line)
        except (ValueError, KeyError, TypeError):  # a line cut off by the crash
            cut.append(line)
    if cut:
        had = []
        if os.path.isfile(path + ".cut"):
            with open(path + ".cut") as f:
                had = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
        seen = set(had)
        new = [line for line in cut if line not in seen]  # a row's timings make it unique
        if new:
            write_atomic(path + ".cut", "".join(had + new))
        write_atomic(path, "".join(keep))


# -----------------------------------------------------------------------------
# the folder's lock: one run per folder


def lock(run_dir, resuming=False, then=""):
    """Take RUN/run.lock for this process, or a one-line ValueError when a live run holds it or the
    folder cannot be written (what helps: another --out_dir, or for a resume a copy; on a full disk
    or a file size limit, room, then `then`: "continue with: python train.py ..."). An flock is
    dropped by the kernel when its process dies, so a lock file left by a killed run is taken
    over. Where flock is missing (no fcntl) or refused by the filesystem (ENOLCK, or EOPNOTSUPP on
    some NFS, CIFS and FUSE mounts): the file holds the pid, stale once it is gone."""
    path = os.path.join(run_dir, LOCK)

    def unwritable(e):
        denied = e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        how = (("copy the folder where you can write and pass the copy to --resume" if resuming
                else "pass another --out_dir") if denied
               else f"nothing was written; {remedy(e.errno, run_dir)}, then "
                    f"{then or 'run it again'}")
        return ValueError(f"cannot write {path}: {e.strerror}; {how}")
    while fcntl is not None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a folder this user may not write into, a full disk
            raise unwritable(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another open file holds it: a live process
            os.close(fd)
            raise ValueError(_in_use(run_dir, path, resuming)) from None
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
        except OSError as e:  # the pid cannot be written (a full disk): the folder stays as it was
            try:
                os.remove(path)
            except OSError:
                pass
            os.close(fd)
            raise unwritable(e) from None
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
                    raise ValueError(_in_use(run_dir, path, resuming)) from None
            try:
                os.remove(path)  # a dead process's lock, or an empty file
            except FileNotFoundError:
                pass
    except OSError as e:
        raise unwritable(e) from None
    finally:
        if os.path.exists(part):
            os.remove(part)


def remedy(code, run_dir):
    """What lets a write into run_dir that failed with errno `code` go through."""
    return ("free some disk space" if code in (errno.ENOSPC, errno.EDQUOT)
            else "raise the file size limit (ulimit -f)" if code == errno.EFBIG
            else f"make {run_dir} writable" if code in (errno.EROFS, errno.EACCES, errno.EPERM)
            else "see that the disk has space and the folder is writable")


def live(run_dir):
    """The pid of a train.py that holds run_dir's lock now ("?" where unknown), or None. [ours] A
    shared flock taken and let go at once: a run that starts in that instant is refused as in
    use."""
    path = os.path.join(run_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file: no run
        return None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return None
            except BlockingIOError:
                return _holder(path) or "?"
            except OSError:  # no flock on this filesystem: the pid file
                pass
    finally:
        os.close(fd)  # and the shared flock with it
    holder = _holder(path)
    return holder if holder is not None and _alive(holder) else None


def _in_use(run_dir, path, resuming=False):
    return (f"{run_dir} is in use by a train.py that is still running "
            f"(pid {_holder(path) or '?'}); wait for it to stop"
            + ("" if resuming else ", or pass another --out_dir"))


def unlock(held):
    """Release what lock() took: the file goes first, then the flock with its descriptor."""
    fd, path = held
    try:
        os.remove(path)
    except OSError:  # gone, or a folder that became read-only: the next run takes the file over
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
