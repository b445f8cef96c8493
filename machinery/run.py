"""
A run's folder, and every way a run can stop: what train.py's loop does that is not the algorithm.

    with Run(cfg, given, log) as run:         # its values; its folder, fresh or resumed, locked
        ... load the data, the model, the optimizer ...
        run.begin(model, tokenizer, optimizer, train_set, eval_set)   # config.json, the first lines
        for step in range(run.start, cfg.steps + 1):
            if run.eval_due(step): run.evaluated(step, accuracy)      # the eval line, curves.png
            if run.save_due(step): run.save(step)                     # RUN/checkpoint
            ... the step; run.hold_signals() before its first update ...
            run.end_step(row, selection)      # log.jsonl, the step line, the selection page
        return run.finish()                   # the last line

One run per folder: RUN/run.lock is held for the run's life, so a second train.py into a folder in
use is refused at once, and a lock left by a killed run (the kernel drops an flock with its process)
is taken over. On leaving the `with`, whatever stopped the run (docs/checkpoints.md has the table):
  - Ctrl-C or SIGTERM: a checkpoint of the steps fully applied, then exit 130 or 143. From a step's
    first update to its log line a signal waits for the step's end, so a checkpoint never holds half
    a step; a second signal then quits without saving. A signal during a save waits for the save.
  - out of memory: when no weight of the step had moved, a checkpoint of the steps before it; one
    line names the knobs that lower memory and the resume command (exit 1).
  - NaN or inf logits: no checkpoint (these weights are what went wrong); one line names the step.
  - a refused start (a bad --dataset, say): a folder this run created is removed again.
"""
import dataclasses
import json
import os
import signal
import sys
import threading
import traceback

import torch
from tqdm import tqdm

import d3s
from machinery import checkpoint, config, plots, tiny
from machinery.data import describe
from machinery.logs import NO_SIGNAL, start_wandb, step_line
from machinery.sampling import NonFiniteLogits

try:
    import fcntl  # POSIX
except ImportError:
    fcntl = None

LOCK = "run.lock"


class Run:
    """One training run's folder and bookkeeping: the values it runs with, where it starts, its
    held-out evaluations, the tokens trained so far, its checkpoints, log and pages."""

    def __init__(self, cfg, given=None, log=print):
        self.cfg, self.given, self.log = cfg, given, log
        self.state, self.lock, self.created, self.model, self.bar, self.wandb = \
            None, None, False, None, None, None
        self.signals, self.moving, self.redone, self.stopping = Signals(), False, False, False
        # the step and the evaluations of the last checkpoint
        self.saved, self.saved_history = None, None

    # -------------------------------------------------------------------------- the start

    def __enter__(self):
        try:
            self._open()
        except BaseException:
            self._close()
            raise
        return self

    def _open(self):
        """The values, then the folder: a resume's saved config and state, or a fresh folder,
        locked."""
        cfg = self.cfg
        given = config.given_knobs(cfg) if self.given is None else set(self.given)
        self.signals.install()
        if cfg.resume:  # locked before anything reads it: a live run may be saving into it
            if not os.path.isdir(cfg.resume):
                raise ValueError(f"--resume {cfg.resume}: no such folder; pass the run folder of "
                                 f"an earlier train.py run")
            self.lock = lock(cfg.resume)
            cfg, given, self.state = checkpoint.resume(cfg, given)
        cfg = self.cfg = config.resolve(cfg, given)  # each knob's value for this run, checked
        run_dir = cfg.out_dir
        if self.state is None:
            self.created = not os.path.exists(run_dir)
            try:
                os.makedirs(run_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cannot make the run folder {run_dir}: {e.strerror}; pass "
                                 f"another --out_dir") from None
            self.lock = lock(run_dir)
            checkpoint.check_fresh(run_dir, cfg.overwrite)  # a folder with another run is refused
            # a tiny world (by name or folder), else None: a real model
            self.world = tiny.world_of(cfg.model)
            self.weights, self.start, self.history, self.tokens_trained = cfg.model, 0, [], 0
        else:  # the changes are accepted now: record them, and cut a crashed run's log back
            checkpoint.record_resume(run_dir, self.state["step"], self.state["changed"])
            checkpoint.trim_log(run_dir, self.state["step"])
            self.weights = os.path.join(run_dir, "checkpoint")
            # the run's own world
            self.world = tiny.world_of(self.weights) or tiny.world_of(cfg.model)
            self.start, self.history = self.state["step"], self.state["history"]
            self.tokens_trained, self.saved = self.state["tokens_trained"], self.state["step"]
            self.saved_history = len(self.history)  # what RUN/checkpoint holds already
        self.completed = self.start  # the steps applied to the model
        self.device = (("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto"
                       else cfg.device)

    def begin(self, model, tokenizer, optimizer, train_set, eval_set):
        """The model is loaded: the folder gets this run's config.json, and the run says what it
        is."""
        cfg, state = self.cfg, self.state
        self.model, self.tokenizer, self.optimizer, self.eval_size = \
            model, tokenizer, optimizer, len(eval_set)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
        else:
            checkpoint.fresh(cfg.out_dir, cfg.overwrite)  # emptied of the run it replaces, if any
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        for line in first_lines(cfg, self.world, self.device, state, len(train_set), len(eval_set)):
            self.log(line)
        self.wandb = start_wandb(cfg)
        self.bar = tqdm(total=cfg.steps, initial=self.start, disable=not sys.stderr.isatty(),
                        dynamic_ncols=True)
        self.say = tqdm.write if not self.bar.disable else self.log  # the bar on a terminal only

    # -------------------------------------------------------------------------- the loop's calls

    def eval_due(self, step):
        """At step 0, every eval_every steps and at the end; again if a stop cut that one short."""
        return (due(step, self.cfg.eval_every, self.cfg.steps)
                and step not in [h["step"] for h in self.history])

    def evaluated(self, step, accuracy):
        """Record a held-out accuracy: the eval line, curves.png (from the first step on), wandb."""
        self.history.append({"step": step, "tokens": self.tokens_trained, "accuracy": accuracy})
        self.redone = step == self.start > 0  # a resumed run redid a missing evaluation: save it
        self.say(f"eval step {step} | held-out accuracy {accuracy:.3f} ({self.eval_size} held-out "
                 f"{self.cfg.dataset} prompts, greedy)")
        if step > 0:  # before the first step there is nothing to draw
            plots.plot_run(self.cfg.out_dir, self.history)
        if self.wandb:
            self.wandb.log({"accuracy": accuracy}, step=step)

    def save_due(self, step):
        """Every save_every steps and at the end; and where a resumed run redid an evaluation."""
        return (step > self.start
                and due(step, self.cfg.save_every, self.cfg.steps, first=False)) or \
            (step == self.start and self.redone)

    def save(self, step):
        """RUN/checkpoint after `step` steps (checkpoint.save). A signal meanwhile waits for the
        save."""
        self.signals.saving = True
        self.saved = checkpoint.save(self.cfg.out_dir, self.model, self.tokenizer, self.optimizer,
                                     step, self.history, self.tokens_trained, self.world)
        self.saved_history = len(self.history)
        self.signals.saving = False
        if not (self.signals.hold or self.stopping):
            self.signals.release()  # a signal that came during the save stops the run now

    def hold_signals(self):
        """The step's weights move: a signal waits for the step's end (end_step)."""
        self.signals.hold = self.moving = True

    def end_step(self, row, selection):
        """The step is applied: its row in RUN/log.jsonl (and wandb), its line, and when an
        evaluation follows, its selection page. selection: (rollouts, batch, rewards, adv, idx,
        token_mask, scores)."""
        with open(os.path.join(self.cfg.out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb:
            self.wandb.log(row, step=row["step"])
        self.completed, self.moving = row["step"] + 1, False
        self.say(step_line(row, self.cfg.updates_per_batch))
        self.bar.update(1)
        # the page of what this step kept
        if due(self.completed, self.cfg.eval_every, self.cfg.steps):
            plots.write_selection(self.cfg.out_dir, self.selection_record(row, *selection))
        self.signals.release()  # a signal that came during the step stops the run now

    def selection_record(self, row, rollouts, batch, rewards, adv, idx, token_mask, scores):
        """plots.selection_record of a step: its groups, what each level kept, why a skipped step
        was skipped."""
        why = {"skipped_reason": NO_SIGNAL} if row["no_signal"] else {}
        return plots.selection_record(self.tokenizer, rollouts, [r["prompt"] for r in batch],
                                      [r["answer"] for r in batch], rewards, adv, idx, token_mask,
                                      scores, {**row, "method": self.cfg.method, **why})

    def finish(self):
        """The run's last line; returns the held-out evaluations [{step, tokens, accuracy}]."""
        self.bar.close()
        if self.wandb:
            self.wandb.finish()
        cfg, h = self.cfg, self.history
        idle = sum(r["no_signal"] for r in plots.read_log(cfg.out_dir) if r["step"] >= self.start)
        self.log(f"done: held-out accuracy {h[0]['accuracy']:.3f} -> {h[-1]['accuracy']:.3f} "
                 f"({cfg.dataset}, {self.eval_size} prompts, greedy); {idle} of "
                 f"{cfg.steps - self.start} steps had nothing to learn (no update); "
                 f"run folder {cfg.out_dir}")
        return h

    # -------------------------------------------------------------------------- the stops

    def __exit__(self, kind, error, tb):
        try:
            if kind is not None and issubclass(kind, KeyboardInterrupt):
                self._interrupted()
            # no checkpoint: these weights went wrong
            if kind is not None and issubclass(kind, NonFiniteLogits):
                raise config.Stop(f"step {self.completed}: {error}; no checkpoint saved; "
                                  f"start a new run with a lower --lr "
                                  f"(from --model {self.cfg.out_dir}/checkpoint "
                                  f"if its weights are still sound)") from None
            if kind is not None and issubclass(kind, torch.OutOfMemoryError):
                # the failed step's tensors go before anything else is tried
                traceback.clear_frames(tb)
                raise config.Stop(self._out_of_memory()) from None
        finally:
            self._close()
        return False

    def _interrupted(self):
        """Ctrl-C or SIGTERM: save the steps fully applied, say how to go on, exit with the signal's
        code."""
        code = self.signals.first or signal.SIGINT
        if self.model is None:
            self.log(f"\ninterrupted before step {self.start}: nothing new to save")
            raise KeyboardInterrupt(code) from None
        # a second signal while the step's weights were moving: this state is half a step
        if self.moving:
            self.log(f"\nquit without saving; continue from the last checkpoint: "
                     f"python train.py --resume {self.cfg.out_dir}")
            raise KeyboardInterrupt(code) from None
        self.stopping = True  # a signal during this save waits for it
        if (self.saved, self.saved_history) != (self.completed, len(self.history)):
            self.save(self.completed)
        done = (f"checkpoint saved after step {self.completed - 1} "
                f"(it resumes at step {self.completed})" if self.completed > 0 else
                "no step had finished; the checkpoint holds the starting model "
                "(it resumes at step 0)")
        self.log(f"\ninterrupted: {done}; continue with: "
                 f"python train.py --resume {self.cfg.out_dir}")
        raise KeyboardInterrupt(code) from None  # config.main exits with 128 + code

    def _out_of_memory(self):
        """The out-of-memory line, after saving what can be saved: the steps applied, when no weight
        of the step in progress had moved yet (half a step is never saved)."""
        if self.model is not None and not self.moving:
            self.optimizer.zero_grad(set_to_none=True)
            self.stopping = True
            self.save(self.completed)
        return out_of_memory(self.cfg, self.completed, self.saved)

    def _close(self):
        if self.bar is not None:
            self.bar.close()
        self.signals.restore()
        if self.lock is not None:
            unlock(self.lock)
            self.lock = None
            if self.created and not os.listdir(self.cfg.out_dir):  # a refused start leaves nothing
                os.rmdir(self.cfg.out_dir)


def due(step, every, steps, first=True):
    """Is an evaluation (first: also at step 0) or a checkpoint due at `step`? Every `every` steps
    (0: never) and at the end."""
    return (first and step == 0) or step == steps or (every > 0 and step % every == 0)


def first_lines(cfg, world, device, state, n_train, n_eval):
    """What the run is: where, on what, and the values a learner edits most, so that an edit of the
    config block shows in the run's first lines."""
    m = d3s.METHODS[cfg.method]
    where = f"the {world} world's values" if world else "a real model's values"
    resumed = "" if state is None else f" | resuming at step {state['step']}" + "".join(
        f"; --{k} {a} -> {b}" for k, (a, b) in state["changed"].items())
    ends = [d3s.applied_ratios(cfg.method, *d3s.keep_ratios(step, cfg.steps, m["schedule"],
            cfg.s_init, cfg.s_final, cfg.t_init, cfg.t_final)) for step in (0, cfg.steps - 1)]
    keep = ", ".join(f"{n} {a:g}" + (f"->{b:g}" if b != a else "") for n, a, b in
                     zip(("rho_s", "rho_t"), *ends)) + (" (fixed)" if ends[0] == ends[1] else "")
    return [f"run {cfg.out_dir} | {cfg.model} on {device}, {where}{resumed}",
            f"data {n_train} train / {n_eval} held-out: "
            f"{describe(cfg.dataset, 'test', cfg.data_dir or None)}",
            f"method {cfg.method} ({m['sample']} samples, {m['token']} tokens, "
            f"{m['schedule']} schedule) + {cfg.loss} loss, divisor {cfg.divisor} | keep {keep}",
            f"steps {cfg.steps} of {cfg.prompts_per_step} prompts x {cfg.group_size} = "
            f"{cfg.prompts_per_step * cfg.group_size} rollouts, "
            f"max_new_tokens {cfg.max_new_tokens}, temperature {cfg.temperature:g} | "
            + (f"M {cfg.minibatch_size} rollouts per update" if cfg.minibatch_size > 0 else
               f"K {cfg.updates_per_batch} updates per step") + f", {cfg.optimizer} lr {cfg.lr:g}"]


def out_of_memory(cfg, step, saved):
    """The line an out-of-memory stop prints: where the run continues from, and with which of the
    knobs that change memory and nothing computed (RESUME_SAFE) set lower. saved: the checkpoint's
    step, or None."""
    gen = cfg.gen_batch_size or cfg.prompts_per_step * cfg.group_size
    lower = (f"--micro_batch_size {max(1, cfg.micro_batch_size // 2)} "
             f"(or --gen_batch_size {max(1, gen // 2)}, "
             f"--logprob_chunk {max(1, cfg.logprob_chunk // 2)}, --gradient_checkpointing true; "
             f"experiments/speed.md has settings by GPU memory)")
    if saved is None:
        return (f"out of memory at step {step}, before any checkpoint; "
                f"start again with less memory per pass: {lower}")
    return (f"out of memory at step {step}; the checkpoint holds the steps before {saved}; "
            f"continue with less memory per pass: python train.py --resume {cfg.out_dir} {lower}")


# -----------------------------------------------------------------------------
# signals


class Signals:
    """Ctrl-C (SIGINT) and SIGTERM (what a job scheduler, a container runtime or `kill` sends) both
    end the run with a checkpoint. While `hold` is set (from a step's first update to its log line)
    they wait, so that a checkpoint always falls on a step boundary; a second one then quits at
    once, without saving. While `saving`, every signal waits for the checkpoint being written. The
    exit code is the first signal's. Installed only in the main thread (Python's rule for
    signals)."""

    def __init__(self):
        self.first, self.hold, self.saving, self.old = None, False, False, {}

    def install(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}

    def handler(self, signum, frame):
        again, self.first = self.first is not None, self.first or signum
        if self.saving:
            return  # the checkpoint being written finishes first
        if self.hold and not again:
            tqdm.write("stopping after this step's updates (signal again to quit without saving)")
            return
        raise KeyboardInterrupt

    def release(self):
        """The end of a step or of a save: a signal that came meanwhile stops the run now."""
        self.hold = False
        if self.first is not None:
            raise KeyboardInterrupt


# -----------------------------------------------------------------------------
# the folder's lock


def lock(run_dir):
    """Take RUN/run.lock for this process, or a one-line ValueError when a live run holds it. An
    flock is dropped by the kernel when its process dies, so a lock file left by a killed run is
    taken over. (Without fcntl: a file created with O_EXCL holding the pid, stale once that pid is
    gone.)"""
    path = os.path.join(run_dir, LOCK)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if fcntl else os.O_EXCL), 0o644)
        except FileExistsError:  # without fcntl only
            if _alive(_holder(path)):
                raise ValueError(_in_use(run_dir, path)) from None
            os.remove(path)  # a dead process's lock
            continue
        except OSError as e:  # a folder this user may not write into
            raise ValueError(f"cannot write {path}: {e.strerror}; pass another --out_dir") from None
        try:
            if fcntl:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(_in_use(run_dir, path)) from None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break  # ours, and still the file at that path
        except FileNotFoundError:
            pass
        os.close(fd)  # the run that held it removed it as we took it: take the new one
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, path


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
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
