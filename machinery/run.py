"""
A run's folder, and every way a run can stop: what train.py's loop does that is not the algorithm.

    with Run(cfg, given, log) as run:         # its values; its folder, fresh or resumed, locked
        ... load the data, the model, the optimizer ...
        run.begin(model, tokenizer, optimizer, train_set, eval_set)   # config.json, the first lines
        for step in range(run.start, cfg.steps + 1):
            if run.eval_due(step): run.evaluated(step, accuracy)      # the eval line, curves.png
            if run.save_due(step): run.save(step)                     # RUN/checkpoint
            ... the step, its passes through run.fit(kind, fn) ...
            run.end_step(row, selection)      # log.jsonl, the step line, the selection page
        return run.finish()                   # the last line

One run per folder: RUN/run.lock is held for the run's life (checkpoint.lock). Nothing is written
into the folder before everything that can refuse (the values, the device, the data, the model,
wandb) has said yes, in begin(); a refused start leaves the folder as it found it. How a run stops
(docs/checkpoints.md has the table):
  - Ctrl-C or SIGTERM sets a flag (machinery/stops.py) that the run reads at points it owns: a step
    whose weights have not moved is abandoned, one whose weights moved is finished; then a
    checkpoint of the steps applied, the command to continue, and exit 130 or 143. Once the last
    evaluation is recorded, nothing is left to stop: the run ends as it would have. Every line
    names the command that works in the state the folder is in (status).
  - out of memory in a pass is retried in place by run.fit, with what bears on that pass lowered
    (memory.halve); it stops the run (with a checkpoint when no weight of the step had moved) only
    when nothing is left to lower, with a line that says what would help.
  - NaN or inf logits: no checkpoint (these weights are what went wrong); one line names the step.
  - a write into the folder that fails (a full disk, a file size limit, a read-only folder): the
    last checkpoint stands; one line says what could not be written and what goes on from there.
"""
import dataclasses
import errno
import json
import os
import re
import sys
import traceback

import torch
from safetensors import SafetensorError
from tqdm import tqdm

import d3s
from machinery import checkpoint, config, memory, plots, stops, tiny
from machinery.data import describe, format_prompt
from machinery.logs import NO_SIGNAL, start_wandb, step_line
from machinery.model import resolve_device
from machinery.sampling import NonFiniteLogits


class Stopped(Exception):
    """Raised by the run itself, at a point it owns, when a signal asked it to stop."""


class SaveFailed(OSError):
    """A checkpoint's save that failed in a library's own error (Run.save)."""


class Run:
    """One training run's folder and bookkeeping: the values it runs with, where it starts, its
    held-out evaluations, the tokens trained so far, its checkpoints, log and pages."""
    # what size() chose ({knob: ["auto", value]}, its line); the pass fit() could not lower; has
    # config.json this run's values
    sized, oom_pass, configured = None, None, False

    def __init__(self, cfg, given=None, log=print):
        self.cfg, self.given, self.log = cfg, given, log
        self.state, self.lock, self.created, self.model, self.bar, self.wandb = \
            None, None, False, None, None, None
        # a signal's flag, which asks the run where it is; has a weight of this step moved (an
        # optimizer's step hook says)
        self.stop, self.moving, self.redone = stops.Stop(), False, False
        self.stop.status = self.status
        # the run's own command (_open), its steps applied and evaluations, before _open sets them
        self.again, self.completed, self.history = {}, 0, []
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
        # the command that starts this run again (status): the knobs given, as given (--overwrite
        # true too: a start interrupted before it wrote anything has deleted nothing yet)
        self.again = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                      if f.name in given and f.name != "resume"
                      and (f.name != "overwrite" or cfg.overwrite)}
        self.stop.install()
        if cfg.resume:  # locked before anything reads it: a live run may be saving into it
            if not os.path.isdir(cfg.resume):
                raise ValueError(f"--resume {cfg.resume}: no such folder; pass the run folder of "
                                 f"an earlier train.py run")
            self.lock = checkpoint.lock(cfg.resume, resuming=True,
                                        then=f"continue with: {self.given_command()}")
            cfg, given, self.state = checkpoint.resume(cfg, given, config.resolve)
        cfg = self.cfg = config.resolve(cfg, given)  # each knob's value for this run, checked
        # config.json's picked: the pick() lines' values where no flag set the knob (a resume
        # keeps the run's)
        self.picked = (self.state["picked"] or {}) if self.state else {
            k: v for k, v in config_json(cfg, tiny.world_of(cfg.model))["picked"].items()
            if k not in given}
        run_dir = cfg.out_dir
        if self.state is None:
            self.created = not os.path.exists(run_dir)
            try:
                os.makedirs(run_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cannot make the run folder {run_dir}: {e.strerror}; pass "
                                 f"another --out_dir") from None
            self.lock = checkpoint.lock(run_dir, then=f"start it again with: "
                                                      f"{self.given_command()}")
            checkpoint.check_fresh(run_dir, cfg.overwrite)  # a folder with another run is refused
            self._check_source(cfg)
            # a tiny world (by name or folder), else None: a real model
            self.world = tiny.world_of(cfg.model)
            self.weights, self.start, self.history, self.tokens_trained = cfg.model, 0, [], 0
        else:
            self.weights = os.path.join(run_dir, "checkpoint")
            # the run's own world
            self.world = tiny.world_of(self.weights) or tiny.world_of(cfg.model)
            self.start, self.history = self.state["step"], self.state["history"]
            self.tokens_trained, self.saved = self.state["tokens_trained"], self.state["step"]
            self.saved_history = len(self.history)  # what RUN/checkpoint holds already
        self.completed = self.start  # the steps applied to the model
        self.device = resolve_device(cfg.device)  # named once: a CUDA one with its index

    def given_command(self):
        """`python train.py ...` as this run was started: its flags as given."""
        return checkpoint.command({**({"resume": self.cfg.resume} if self.cfg.resume else {}),
                                   **self.again})

    def _check_source(self, cfg):
        """--model RUN/checkpoint while RUN is live, or inside the folder --overwrite empties, is
        refused. [ours] Refused, not copied: a live run replaces its checkpoint at every save, so a
        new run could read half a swap, and a LoRA run, whose base stays that folder, would lose it
        at the next save; a copy of a real model is gigabytes, the user's to place."""
        source = os.path.abspath(cfg.model)
        if not os.path.isdir(source):
            return
        run = os.path.dirname(source)
        if cfg.overwrite and os.path.samefile(run, cfg.out_dir):
            raise ValueError(f"--model {cfg.model} is in --out_dir {cfg.out_dir}, which "
                             f"--overwrite true would delete before the run ends; pass another "
                             f"--out_dir")
        pid = checkpoint.live(run)
        if pid is not None:
            raise ValueError(f"--model {cfg.model}: {run} is in use by a train.py that is still "
                             f"running (pid {pid}), which replaces its checkpoint at each save; "
                             f"wait for it to stop, or copy {cfg.model} between its saves and pass "
                             f"the copy to --model")

    def begin(self, model, tokenizer, optimizer, train_set, eval_set):
        """The values, the device, the data and the model are accepted, and now wandb: only then is
        the folder written (a fresh run's emptied of the run it replaces; a resume's changes
        recorded and a crashed run's log cut back; config.json), and the run says what it is."""
        cfg, state = self.cfg, self.state
        self._check()  # a signal while loading: nothing is written
        if state is not None:
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, TypeError, IndexError) as e:  # another model's state
                raise ValueError(checkpoint.damaged(cfg.out_dir, "trainer.pt",
                                                    f"optimizer: {checkpoint.first_line(e)}",
                                                    type(cfg))) from None
        self.wandb = start_wandb(cfg)  # the last that may refuse
        self.model, self.tokenizer, self.optimizer, self.eval_size = \
            model, tokenizer, optimizer, len(eval_set)
        if state is None:
            checkpoint.fresh(cfg.out_dir, cfg.overwrite)
        else:
            checkpoint.trim_log(cfg.out_dir, state["step"])
        self._write_config()  # then resumes.jsonl: it never records a change config.json lacks
        self.configured = True
        if state is not None:
            checkpoint.record_resume(cfg.out_dir, state["step"], state["changed"])
        if self.sized:  # the auto knobs (size): recorded as a change the run made, and why
            checkpoint.record_resume(cfg.out_dir, self.start, *self.sized)
        optimizer.register_step_post_hook(lambda *a: setattr(self, "moving", True))
        for line in first_lines(cfg, self.world, self.device, state, len(train_set), len(eval_set)):
            self.log(line)
        if self.sized:
            self.log(self.sized[1])
        self.bar = tqdm(total=cfg.steps, initial=self.start, disable=not sys.stderr.isatty(),
                        dynamic_ncols=True)
        self.say = tqdm.write if not self.bar.disable else self.log  # the bar on a terminal only

    # -------------------------------------------------------------------------- the loop's calls

    def eval_due(self, step):
        """At step 0, every eval_every steps and at the end; again if a stop cut that one short."""
        return (due(step, self.cfg.eval_every, self.cfg.steps)
                and step not in [h["step"] for h in self.history])

    def evaluated(self, step, accuracy):
        """Record a held-out accuracy: the eval line, curves.png (from the first step on), wandb.
        After a signal it is not recorded (a signal cuts the generation short) and the run stops."""
        self._check()
        self.history.append({"step": step, "tokens": self.tokens_trained, "accuracy": accuracy})
        self.redone = step == self.start > 0  # a resumed run redid a missing evaluation: save it
        self.say(f"eval step {step} | held-out accuracy {accuracy:.3f} ({self.eval_size} held-out "
                 f"{data_name(self.cfg, self.world)} prompts, greedy)")
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
        """RUN/checkpoint after `step` steps (checkpoint.save), with a copy of config.json."""
        try:
            self.saved = checkpoint.save(self.cfg.out_dir, self.model, self.tokenizer,
                                         self.optimizer, step, self.history, self.tokens_trained,
                                         self.world, config_json(self.cfg, self.world, self.picked))
        except (RuntimeError, SafetensorError) as e:  # torch.save's and safetensors' own errors
            if memory.is_out_of_memory(e):            # for a failed write (__exit__ says so)
                raise
            raise SaveFailed(*os_error(e), os.path.join(self.cfg.out_dir, "checkpoint.tmp")) from e
        self.saved_history = len(self.history)

    def size(self, model, tokenizer, *datasets):
        """The memory knobs still "auto" (a GPU's default: machinery/config.py), sized to the memory
        free at the start for this model, the datasets' longest prompt, max_new_tokens and the
        method (memory.choose); a number given wins. When nothing fits, a one-line error says what
        would. begin() says the choice among the first lines and records it."""
        cfg = self.cfg
        auto = [k for k in memory.KNOBS if getattr(cfg, k) == "auto"]
        if not auto:
            return
        prompts = [format_prompt(tokenizer, r["prompt"]) for rows in datasets for r in rows]
        longest = max(map(len, tokenizer(prompts, add_special_tokens=False)["input_ids"]))
        try:
            shape = memory.shape_of(model.config)
        except KeyError as e:
            raise ValueError(f"--{auto[0]} auto counts Qwen2 and Llama shapes, and {cfg.model}'s "
                             f"config has no {e}; give a number for each of "
                             f"{', '.join('--' + k for k in auto)}") from None
        job, free = memory.job_of(cfg, longest), memory.free_bytes(self.device)
        given = {k: getattr(cfg, k) for k in memory.KNOBS if k not in auto}
        micro = next(f for f in dataclasses.fields(cfg) if f.name == "micro_batch_size")
        ceiling = config.picked(micro, self.world, cfg.loss, cfg.method)  # auto only lowers it
        got = memory.choose(shape, job, free, given, ceiling)
        if got is None:
            raise ValueError(f"--model {cfg.model}, --max_new_tokens {cfg.max_new_tokens}: "
                             + memory.nothing_fits(shape, job, free, given, ceiling))
        for k in auto:
            setattr(cfg, k, got[k])
        self.sized = {k: ["auto", got[k]] for k in auto}, memory.describe(got, free, auto)

    def fit(self, kind, fn, split=None):
        """fn() in the memory there is, for a pass of `kind` (PASSES), fn reading its settings from
        cfg at each call. Out of memory (memory.is_out_of_memory: torch's error, or a CUDA
        library's failed allocation) lowers, in cfg, what bears on that pass (memory.halve: the
        rows of a generation call; the micro-batch, then the log-prob chunk, then
        gradient checkpointing), so every later pass uses it too: `split`, the step's mini-batches,
        is re-split in place at a new micro-batch size. One line says so, config.json and
        resumes.jsonl record it once (a resume keeps it), gradients are zeroed and fn runs again.
        Nothing computed changes (beyond float rounding): the sampler draws the same samples at any
        batch size and engine, and no weight moves within a pass. With nothing left to lower, the
        stop's line says what would help (out_of_memory). Before and after, a signal stops a step
        whose weights have not moved."""
        self._check()
        while True:
            try:
                out = fn()
                break
            except RuntimeError as e:  # out of the except first: its traceback holds the tensors
                if not memory.is_out_of_memory(e):
                    raise
            self.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()  # the failed pass's blocks (a no-op while CUDA is unused)
            self._lower(kind, split)
        self._check()
        return out

    def _lower(self, kind, split):
        """Apply and record what memory.halve lowers after a pass of `kind` ran out of memory."""
        cfg, G, pieces = self.cfg, self.cfg.group_size, [p for mb in split or [] for p in mb]
        B = cfg.prompts_per_step * G
        rows = {"generation": min(cfg.gen_batch_size or B, B),
                "evaluation": min(cfg.gen_batch_size or memory.EVAL_ROWS, self.eval_size)}.get(
                    kind, max((len(p.rows) for p in pieces), default=1))
        positions = max((len(p.rows) * p.width for p in pieces), default=0)
        now = {k: getattr(cfg, k) for k in memory.KNOBS + ("generation",)}
        lower = {k: v for k, v in memory.halve(kind, now, rows, positions).items()
                 if v != now[k]}
        if not lower:  # the stop's line (__exit__) says what would help
            self.oom_pass = kind
            raise torch.OutOfMemoryError(f"out of memory in {PASSES[kind]}, nothing left to lower")
        self.say("out of memory: " + ", ".join(f"--{k} {now[k]} -> {v}" for k, v in lower.items())
                 + f", the pass redone ({PASSES[kind]}; nothing computed changes)")
        for k, v in lower.items():
            setattr(cfg, k, v)
        self._write_config()
        checkpoint.record_resume(cfg.out_dir, self.completed,
                                 {k: [now[k], v] for k, v in lower.items()}, "out of memory")
        if lower.get("gradient_checkpointing"):
            self.model.activation_checkpointing_enable()  # as train.py turns it on
        size = lower.get("micro_batch_size")
        for mb in (split or []) if size else []:  # in place: the caller's lists go on
            mb[:] = [dataclasses.replace(p, rows=p.rows[i:i + size],
                                         input_ids=p.input_ids[i:i + size],
                                         attention_mask=p.attention_mask[i:i + size])
                     for p in mb for i in range(0, len(p.rows), size)]

    def _check(self):
        """After a signal, a step whose weights have not moved (or no step) stops here."""
        if self.stop.first is not None and not self.moving:
            raise Stopped

    def _write_config(self):
        """RUN/config.json, replaced whole (a kill or a full disk leaves the old one)."""
        saved = config_json(self.cfg, self.world, self.picked)
        checkpoint.write_atomic(os.path.join(self.cfg.out_dir, "config.json"),
                                json.dumps(saved, indent=2))

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
        self._check()  # a signal that came during the step stops the run now

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
                 f"({data_name(cfg, self.world)}, {self.eval_size} prompts, greedy); {idle} of "
                 f"{cfg.steps - self.start} steps had nothing to learn (no update); "
                 f"run folder {cfg.out_dir}")
        return h

    # -------------------------------------------------------------------------- the stops

    def __exit__(self, kind, error, tb):
        try:
            try:
                if kind is not None and issubclass(kind, Stopped):
                    self._interrupted()
                # no checkpoint: these weights went wrong
                if kind is not None and issubclass(kind, NonFiniteLogits):
                    raise config.Stop(f"step {self.completed}: {error}; no checkpoint saved; "
                                      f"start a new run with a lower --lr "
                                      f"(from --model {self.cfg.out_dir}/checkpoint "
                                      f"if its weights are still sound)") from None
                if kind is not None and memory.is_out_of_memory(error):
                    # the failed step's tensors go before anything else is tried
                    traceback.clear_frames(tb)
                    raise config.Stop(self._out_of_memory()) from None
            except OSError as e:  # the save a stop makes could not be written
                raise config.Stop(self._unwritten(e)) from None
            if self.model is not None and unwritten(error):  # the run's own writes, from begin()
                raise config.Stop(self._unwritten(error)) from None
        finally:
            self._close()
        return False

    def _interrupted(self):
        """A signal stopped the run at a safe point: save the steps applied, say how to go on, and
        leave with the signal's code (config.main exits with 128 + it)."""
        code = self.stop.first
        if self.model is None:
            self._last(f"\ninterrupted before step {self.start}: nothing new to save; "
                       f"{self.status()[2]}")
            raise KeyboardInterrupt(code) from None
        self.optimizer.zero_grad(set_to_none=True)  # an abandoned step's gradients
        if (self.saved, self.saved_history) != (self.completed, len(self.history)):
            self.save(self.completed)
        done = (f"checkpoint saved after step {self.completed - 1} "
                f"(it resumes at step {self.completed})" if self.completed > 0 else
                "no step had finished; the checkpoint holds the starting model "
                "(it resumes at step 0)")
        self._last(f"\ninterrupted: {done}; continue with: "
                   f"python train.py --resume {self.cfg.out_dir}")
        raise KeyboardInterrupt(code) from None

    def _last(self, line):
        """A stop's last line, with the command that goes on: also on stderr where stdout has gone
        (`python train.py | head -2`), so that it is never lost with it."""
        self.log(line)
        if stops.stdout_gone():
            stops.say(line.strip())

    def status(self):
        """Where the run is, for a signal (machinery/stops.py): ("running", or "finishing" once its
        last evaluation is recorded, or "complete" once that is saved too; what the folder holds;
        the command that goes on from it as it is now): --resume once it holds a finished
        checkpoint of this run; before that, this run's own command, with --overwrite true once
        the run has written into the folder."""
        cfg = self.cfg
        if self.saved == cfg.steps and self.saved_history == len(self.history):
            return "complete", f"the run is complete in {cfg.out_dir}", ""
        last = self.completed == cfg.steps and cfg.steps in [h["step"] for h in self.history]
        state = "finishing" if last else "running"
        if cfg.resume and not self.configured:  # config.json lacks the flags it was given
            return state, "the last checkpoint stands", f"continue with: {self.given_command()}"
        if cfg.resume or self.saved is not None:
            return state, "the last checkpoint stands", \
                f"continue with: python train.py --resume {cfg.resume or cfg.out_dir}"
        if self.model is None:  # nothing written yet: the folder is as this run found it
            return state, "nothing was saved", \
                f"start it again with: {checkpoint.command(self.again)}"
        return state, "no checkpoint was saved yet", \
            f"start it again with: {checkpoint.command({**self.again, 'overwrite': True})}"

    def _unwritten(self, error):
        """The line for a write into the run folder that failed (a full disk, a file size limit, a
        read-only folder; a save that failed): what, why, what the folder holds and what then
        goes on from it (status)."""
        _, held, then = self.status()
        fix = checkpoint.remedy(error.errno, self.cfg.out_dir)
        return (f"cannot write {error.filename or self.cfg.out_dir}: {error.strerror}; {held}"
                + (f"; {fix}, then {then}" if then else ""))

    def _out_of_memory(self):
        """The out-of-memory line, after saving what can be saved: the steps applied, when no weight
        of the step in progress had moved yet (half a step is never saved)."""
        if self.model is not None and not self.moving:
            self.optimizer.zero_grad(set_to_none=True)
            self.save(self.completed)
        return out_of_memory(self.cfg, self.completed, self.saved, self.oom_pass, self.again)

    def _close(self):
        if self.bar is not None:
            self.bar.close()
        self.stop.restore()
        if self.lock is not None:
            checkpoint.unlock(self.lock)
            self.lock = None
        if self.created and self.model is None:  # a refused start leaves nothing
            try:
                os.rmdir(self.cfg.out_dir)  # only when empty: another run may have come meanwhile
            except OSError:
                pass


def unwritten(error):
    """Is `error` a write into the run folder that failed: a full disk or quota, over the file size
    limit, a read-only folder, or a save?"""
    return isinstance(error, SaveFailed) or isinstance(error, OSError) and error.errno in (
        errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def os_error(error):
    """(errno, reason) of a library's failed write: the OSError under torch.save's error (it writes
    into a file of checkpoint.save's), the OS error that safetensors names ("os error 28"), else
    (None, its first line)."""
    inner = error.__context__
    if isinstance(inner, OSError) and inner.errno:
        return inner.errno, inner.strerror
    code = re.search(r"os error (\d+)", str(error))
    return (int(code[1]), os.strerror(int(code[1]))) if code else \
        (None, checkpoint.first_line(error))


def due(step, every, steps, first=True):
    """Is an evaluation (first: also at step 0) or a checkpoint due at `step`? Every `every` steps
    (0: never) and at the end."""
    return (first and step == 0) or step == steps or (every > 0 and step % every == 0)


def config_json(cfg, world, picked=None):
    """What RUN/config.json holds: every knob as the run uses it, then (checkpoint.RECORDED) what
    d3s.METHODS says its method is, and `picked`, the value each pick() line gave this run (None:
    every pick() knob's), for the knobs that hold it still (not one a flag set, nor one sized for a
    GPU or lowered on out of memory), so that an edit of either shows (and a resume refuses one of
    d3s.py)."""
    if picked is None:
        picked = {f.name: config.picked(f, world, cfg.loss, cfg.method, cfg.lora_rank > 0,
                                        config.on_gpu(cfg))
                  for f in dataclasses.fields(cfg) if "pick" in f.metadata}
    return {**dataclasses.asdict(cfg), "method_spec": checkpoint.method_spec(cfg.method),
            "picked": {k: v for k, v in picked.items() if getattr(cfg, k) == v}}


def data_name(cfg, world):
    """The data set as the run's lines name it: a tiny world's run on its own questions names its
    world (--dataset picks tiny for every tiny world, and tiny-fork's questions are tiny's)."""
    same = tiny.WORLDS.get(cfg.dataset, {}).get("terms") == tiny.WORLDS.get(world, {}).get("terms")
    return world if world and same else cfg.dataset


def first_lines(cfg, world, device, state, n_train, n_eval):
    """What the run is: where, on what, and the values a learner edits most, so that an edit of the
    config block shows in the run's first lines."""
    m = d3s.METHODS[cfg.method]
    where = f"the {world} world's values" if world else "a real model's values"
    resumed = "" if state is None else f" | resuming at step {state['step']}" + "".join(
        f"; --{k} {a} -> {b}" for k, (a, b) in state["changed"].items()) + (
        f" ({state['recovered']}: its checkpoint's copy goes on)" if "recovered" in state else "")
    ends = [d3s.applied_ratios(cfg.method, *d3s.keep_ratios(step, cfg.steps, m["schedule"],
            cfg.s_init, cfg.s_final, cfg.t_init, cfg.t_final)) for step in (0, cfg.steps - 1)]
    keep = ", ".join(f"{n} {a:g}" + (f"->{b:g}" if b != a else "") for n, a, b in
                     zip(("rho_s", "rho_t"), *ends)) + (" (fixed)" if ends[0] == ends[1] else "")
    return [f"run {cfg.out_dir} | {cfg.model} on {device}, {where}{resumed}",
            f"data {n_train} train / {n_eval} held-out: "
            f"{describe(data_name(cfg, world), 'test', cfg.data_dir or None)}",
            f"method {cfg.method} ({m['sample']} samples, {m['token']} tokens, "
            f"{m['schedule']} schedule) + {cfg.loss} loss, divisor {cfg.divisor} | keep {keep}",
            f"steps {cfg.steps} of {cfg.prompts_per_step} prompts x {cfg.group_size} = "
            f"{cfg.prompts_per_step * cfg.group_size} rollouts, "
            f"max_new_tokens {cfg.max_new_tokens}, temperature {cfg.temperature:g} | "
            + (f"M {cfg.minibatch_size} rollouts per update" if cfg.minibatch_size > 0 else
               f"K {cfg.updates_per_batch} updates per step") + f", {cfg.optimizer} lr {cfg.lr:g}"]


# the passes run.fit sizes, as its lines name them
PASSES = {"generation": "generation", "evaluation": "the held-out evaluation",
          "no_grad": "logp_old's no-grad pass", "update": "an update"}


def out_of_memory(cfg, step, saved, kind=None, again=None):
    """The line an out-of-memory stop prints: where the run continues from, and what would help.
    kind: the pass in which run.fit had nothing left to lower; then only a new run that holds less
    helps (LoRA, a shorter max_new_tokens). None: the error came outside those passes (the
    optimizer's step, say): the knobs that lower memory and change nothing computed (RESUME_SAFE),
    halved, or the same new run. saved: the checkpoint's step, or None; again: the knobs the run
    was given (Run.again), for the command that starts it again."""
    new_run = ("--lora_rank 16 (LoRA: adapters train, the base is frozen in bf16) or "
               if getattr(cfg, "lora_rank", None) == 0 else "") + \
        "a shorter --max_new_tokens, or a GPU with more memory"
    if kind is not None:
        held = {"generation": ("generation", "gen_batch_size"), "evaluation": ("gen_batch_size",),
                "no_grad": ("micro_batch_size", "logprob_chunk"),
                "update": ("micro_batch_size", "logprob_chunk", "gradient_checkpointing")}[kind]
        at = " ".join(f"--{k} {str(getattr(cfg, k)).lower()}" for k in held)
        where = ("no checkpoint yet" if saved is None else
                 f"the checkpoint holds the steps before {saved} (--model {cfg.out_dir}/checkpoint "
                 f"starts a new run from them)")
        return (f"out of memory at step {step} in {PASSES[kind]}, even at {at}; {where}; "
                f"what would help: a new run with {new_run}")
    gen = cfg.gen_batch_size or cfg.prompts_per_step * cfg.group_size
    knobs = (("micro_batch_size", cfg.micro_batch_size), ("gen_batch_size", gen),
             ("logprob_chunk", cfg.logprob_chunk))
    lower = {**{k: v // 2 for k, v in knobs if v > 1}, "gradient_checkpointing": True}
    more = f" (experiments/speed.md has settings by GPU memory); or a new run with {new_run}"
    if saved is None:
        again = {**(again or {}), **lower, "out_dir": cfg.out_dir, "overwrite": True}
        return (f"out of memory at step {step}, before any checkpoint; start it again with less "
                f"memory per pass: {checkpoint.command(again)}{more}")
    return (f"out of memory at step {step}; the checkpoint holds the steps before {saved}; "
            f"continue with less memory per pass: "
            f"{checkpoint.command({'resume': cfg.out_dir, **lower})}{more}")
