"""
The config block of train.py, from its lines to the config a run uses: per-model values, checks and
the command line. train.py says what each knob is; this file says how a value reaches the run.

    python train.py --model Qwen2.5-0.5B --lr 2e-6    # --name value or --name=value, for any knob
    python train.py --help                            # every knob, its value(s) and its comment

Where a value comes from, in this order:
  1. the command line (--lr 2e-6), or the knobs a caller of train.train() passes as `given`;
  2. the knob's line in train.py's Config. A knob written `pick(tiny=5e-5, real=1e-6)` holds one
     value per kind of run on that same line, the first of these keys it has: `gpu` on a CUDA GPU
     (the memory knobs' "auto", which Run.size sizes to its memory: machinery/memory.py; "auto"
     given on a CPU takes the CPU's value), under --lora_rank > 0 the kinds below with `lora_`
     before them (lora_tiny=5e-4, lora_real=1e-5), a tiny world's own (tiny_long=64), `tiny` for
     the tiny worlds or `real` for a real model, the loss (`grpo` / `gspo`, by --loss), the method
     (`method_` and its name, method_d1s_cross=...: the prefix keeps method grpo apart from loss
     grpo), else its first value besides `gpu` (named `default` where no kind of run owns it). So
     when the loss and the method both name a value, the loss wins: --method entropy --loss gspo
     divides by seq, GSPO's objective being a mean per sequence whatever tokens a method keeps.
     Edit the one you mean.
Nothing else decides a value: config.json in the run folder records every knob as it ran.

A knob a method would ignore is refused rather than silently dropped (--method grpo --s_init 0.5,
--minibatch_size 32 --updates_per_batch 4), and config.json records the keep ratios each method
applies (1 where it keeps everything) and updates_per_batch 0 when --minibatch_size sets the
updates. Bad values are one line on stderr and exit code 2 (main).

[ours] The command line is plain argparse over the dataclass, with each knob's help read from its
trailing comment in the config block. transformers' HfArgumentParser (what TRL's scripts use) would
need the help in field(metadata=...), off the knob's line, and prints usage before its error;
nanoGPT's configurator execs assignments, with no --help and no types. Neither knows a pick() knob.
"""
from machinery import ctrl_c  # noqa: F401  first: a Ctrl-C while torch loads is one line
import argparse
import dataclasses
import inspect
import os
import re
import signal
import sys
import threading

from machinery import checkpoint
import d3s
from machinery import tiny
from machinery.sampling import ENGINES
from machinery import stops


def pick(**values):
    """A knob with a value per kind of run, all on its line in the config block (see the
    docstring)."""
    return dataclasses.field(default=next(iter(values.values())), metadata={"pick": values})


def picked(field, world, loss, method, lora=False, gpu=False):
    """The value of a pick() knob for a run on tiny world `world` (None: a real model) with `loss`
    and `method`, with LoRA adapters or not, on a GPU or not (the docstring has the order)."""
    values = field.metadata["pick"]
    kinds = ((world or "").replace("-", "_"), "tiny" if world else "real")
    for key in ("gpu" if gpu else "", *(("lora_" + k for k in kinds) if lora else ()), *kinds,
                loss, "method_" + method.replace("-", "_")):
        if key in values:
            return values[key]
    return next(v for k, v in values.items() if k != "gpu")


def on_gpu(cfg):
    """Does the run go to a CUDA GPU (--device auto: when there is one)?"""
    import torch
    return torch.cuda.is_available() if cfg.device == "auto" else cfg.device.startswith("cuda")


def given_knobs(cfg):
    """The knobs a caller set: those that differ from the config block's first value."""
    return {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}


def resolve(cfg, given=None):
    """The config a run uses: each pick() knob not `given` takes its value for this run, every knob
    is checked, and the keep ratios become those the method applies (a given ratio it would ignore
    is an error)."""
    given = given_knobs(cfg) if given is None else set(given)
    world = tiny.world_of(cfg.model)
    if cfg.loss not in d3s.LOSSES:  # before the loss chooses the clip range
        raise ValueError(f"--loss {cfg.loss!r} is unknown; choose one of {', '.join(d3s.LOSSES)}")
    gpu = on_gpu(cfg)
    cfg = dataclasses.replace(cfg, **{f.name: picked(f, world, cfg.loss, cfg.method,
                                                     cfg.lora_rank > 0, gpu)
                                      for f in dataclasses.fields(cfg)
                                      if "pick" in f.metadata and f.name not in given})
    for f in dataclasses.fields(cfg):  # auto on a CPU: the CPU's value (on a GPU: Run.size's)
        if getattr(cfg, f.name) == "auto" and not gpu and "gpu" in f.metadata.get("pick", {}):
            setattr(cfg, f.name, picked(f, world, cfg.loss, cfg.method))
    if cfg.minibatch_size > 0:  # M rollouts per update set the updates: K is recorded as 0
        if "updates_per_batch" in given and cfg.updates_per_batch != 0:
            raise ValueError(f"--updates_per_batch {cfg.updates_per_batch} does not apply with "
                             f"--minibatch_size {cfg.minibatch_size}, which sets the updates per "
                             f"step (ceil(kept / M)); give one of the two")
        cfg.updates_per_batch = 0
    cfg.out_dir = cfg.out_dir or run_folder(cfg, given)
    check(cfg)
    for name, (value, why) in applied_ratios(cfg).items():
        if getattr(cfg, name) != value and name in given:
            raise ValueError(f"--{name} {getattr(cfg, name)} does not apply to --method "
                             f"{cfg.method}: {why}; leave it out")
        setattr(cfg, name, value)
    return cfg


# Knobs a run folder's default name leaves out: the method and the model open the name, the folder
# knobs and where the data lives say nothing of the run, and the knobs a resume may change
# (checkpoint.RESUME_SAFE) change nothing it computes.
UNNAMED = ("method", "model", "out_dir", "overwrite", "data_dir") + checkpoint.RESUME_SAFE


def run_folder(cfg, given):
    """The default run folder: out/<method>-<model>, then every other knob set on the command line,
    as knob=value, so that a second run never lands in the first one's folder [ours]:
        python train.py                        -> out/d3s-tiny
        python train.py --method grpo          -> out/grpo-tiny
        python train.py --seed 1 --lr 1e-4     -> out/d3s-tiny-lr=0.0001-seed=1
    A value that is a path names its file (--dataset data/mine.jsonl -> dataset=mine); a checkpoint
    folder is named by its run (--model out/d3s-tiny/checkpoint -> d3s-tiny-checkpoint)."""
    def short(value):
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, bool):
            return str(value).lower()
        return os.path.splitext(os.path.basename(str(value).rstrip("/")))[0] or str(value)
    model = cfg.model.rstrip("/")
    name = os.path.basename(model) if os.path.basename(model) != "checkpoint" else \
        f"{os.path.basename(os.path.dirname(model))}-checkpoint"
    knobs = [f"{f.name}={short(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)
             if f.name in given and f.name not in UNNAMED]
    return os.path.join("out", "-".join([f"{cfg.method}-{name}", *knobs]))


def applied_ratios(cfg):
    """{knob: (the value the method applies, why)} for the four keep ratios: the first and the last
    step's ratios as d3s.applied_ratios gives them (1 where the method keeps every rollout or token,
    the 80/20 baseline's fixed share), init = final without a schedule."""
    method = d3s.METHODS[cfg.method]
    constant = method["schedule"] == "constant"
    s_init, t_init = d3s.applied_ratios(cfg.method, cfg.s_init, cfg.t_init)
    s_final, t_final = d3s.applied_ratios(cfg.method, *((cfg.s_init, cfg.t_init) if constant else
                                                         (cfg.s_final, cfg.t_final)))
    why_s = ("it keeps every rollout" if method["sample"] == "none" else
             "it keeps every rollout with A != 0" if method["sample"] == "nonzero" else
             "it has no schedule, rho_s stays at --s_init")
    why_t = ("it keeps every token" if method["token"] == "none" else
             f"the 80/20 baseline keeps a fixed {method['t_keep']:.0%} of tokens"
             if "t_keep" in method else
             "it has no schedule, rho_t stays at --t_init")
    return dict(s_init=(s_init, why_s), s_final=(s_final, why_s), t_init=(t_init, why_t),
                t_final=(t_final, why_t))


def check(cfg):
    """Bad knobs are one-line ValueErrors that say what is allowed."""
    def must(ok, msg):
        if not ok:
            raise ValueError(msg)
    must(cfg.method in d3s.METHODS,
         f"--method {cfg.method!r} is unknown; choose one of {', '.join(d3s.METHODS)}")
    for name in ("s_init", "s_final", "t_init", "t_final"):
        must(0 < getattr(cfg, name) <= 1, f"--{name} must be in (0, 1], got {getattr(cfg, name)}")
    must(cfg.group_size >= 2,
         f"--group_size must be at least 2 (advantages compare rollouts of a prompt), "
         f"got {cfg.group_size}")
    auto = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) == "auto"
            and "gpu" in f.metadata.get("pick", {})}  # sized on the GPU (Run.size)
    for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch_size", "eval_size",
                 "logprob_chunk") + ("updates_per_batch",) * (cfg.minibatch_size <= 0):
        must(name in auto or getattr(cfg, name) >= 1,
             f"--{name} must be at least 1, got {getattr(cfg, name)}")
    must(cfg.minibatch_size >= 0, f"--minibatch_size must be at least 0 (0: --updates_per_batch "
         f"sets the updates), got {cfg.minibatch_size}")
    must(cfg.divisor in d3s.DIVISORS,
         f"--divisor must be one of {', '.join(d3s.DIVISORS)}, got {cfg.divisor!r}")
    for name in ("eval_every", "save_every"):
        must(getattr(cfg, name) >= 0,
             f"--{name} must be at least 0 (0: only at the end), got {getattr(cfg, name)}")
    must("gen_batch_size" in auto or cfg.gen_batch_size >= 0,
         f"--gen_batch_size must be at least 0 (0: all at once), got {cfg.gen_batch_size}")
    must(cfg.temperature > 0, f"--temperature must be > 0 for RL sampling, got {cfg.temperature}")
    must(cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}")
    must(cfg.grad_clip >= 0, f"--grad_clip must be at least 0 (0: off), got {cfg.grad_clip}")
    must(cfg.beta >= 0, f"--beta must be >= 0, got {cfg.beta}")
    for name in ("clip_eps_low", "clip_eps_high"):
        must(0 <= getattr(cfg, name) < 1, f"--{name} must be in [0, 1), got {getattr(cfg, name)}")
    must(cfg.generation in ENGINES,
         f"--generation must be one of {', '.join(ENGINES)}, got {cfg.generation!r}")
    must(cfg.optimizer in ("adamw", "sgd"),
         f"--optimizer must be adamw or sgd, got {cfg.optimizer!r}")
    must(cfg.dtype in ("auto", "float32", "bfloat16", "float16"),
         f"--dtype must be auto, float32, bfloat16 or float16, got {cfg.dtype!r}")
    must(cfg.lora_rank >= 0,
         f"--lora_rank must be at least 0 (0: every weight trains), got {cfg.lora_rank}")
    must(cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
         f"--device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")

# -----------------------------------------------------------------------------
# the command line: every knob of the config block is a flag


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2, like every other bad
    input."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def auto_or(parse):
    """A knob whose value may be `auto` (a pick() with gpu="auto"), else what parse reads."""
    def read(text):
        if text == "auto":
            return text
        try:
            return parse(text)
        except (ValueError, argparse.ArgumentTypeError):
            what = "a boolean; use true, false" if parse is parse_bool else "an integer; use one"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} or auto") from None
    return read


def parse_bool(text):
    value = {"true": True, "1": True, "yes": True,
             "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; use true or false")
    return value


def knob_comments(config_class):
    """{knob: its trailing comment in the config block}, for --help. A comment may go on in the
    lines below it, each a comment alone whose # stands under the knob's #."""
    comments, knob, column = {}, None, -1
    for line in inspect.getsource(config_class).splitlines():
        m = re.fullmatch(r"\s+(\w+): \w+ = .*?  # (.*)", line)
        if m:
            knob, column, comments[m.group(1)] = m.group(1), m.start(2) - 2, m.group(2)
        elif knob and line.find("# ") == column and not line[:column].strip():
            comments[knob] += " " + line[column + 2:]
        else:
            knob = None
    return comments


def parse_args(config_class, argv, description=""):
    """(a config, the names of the flags given) from the command line."""
    parser = OneLineParser(description=description)
    comments = knob_comments(config_class)
    for f in dataclasses.fields(config_class):
        values = f.metadata.get("pick", {"default": f.default})  # a pick() knob: each of its values
        value = ", ".join(f"{k} {v!r}" for k, v in values.items())
        parse, auto = parse_bool if f.type is bool else f.type, "gpu" in values
        parser.add_argument(f"--{f.name}", type=auto_or(parse) if auto else parse,
                            default=argparse.SUPPRESS,
                            metavar=f.type.__name__.upper() + "|auto" * auto,
                            help=f"{comments.get(f.name, '')} ({value})".replace("%", "%%"))
    given = vars(parser.parse_args(argv))
    return config_class(**given), set(given)


class Stop(Exception):
    """A run that cannot go on (out of memory, a model that produces NaN): one line, exit code 1."""


def main(config_class, train, argv=None, description=""):
    """`python train.py ...`: bad input is one line and exit code 2; a Stop is one line and exit
    code 1; Ctrl-C, SIGTERM and SIGHUP, after train has saved a checkpoint, exit with 130, 143 and
    129 (128 + the signal); a complete run exits 0 (own_process)."""
    cfg, given = parse_args(config_class, sys.argv[1:] if argv is None else argv, description)
    if argv is None:
        own_process()
    try:
        train(cfg, given=given)
    except (ValueError, Stop) as e:  # bad input, or a run that cannot go on: no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1 if isinstance(e, Stop) else 2)
    except KeyboardInterrupt as e:
        sys.exit(128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT))


def own_process():
    """`python train.py` in a process of its own (not a caller in this one, whose settings stay as
    they are). Signals are ignored but while the run's own handlers are installed (machinery/
    stops.py; they restore these): a signal after the run is over, as it closes its folder or as
    torch's teardown takes a moment, changes neither its exit code nor what is saved. SIGHUP is
    handled only where it was not ignored at the start (nohup). stdout and stderr lose their lines
    once nobody reads them (`| head`), never the run (stops.Lossy)."""
    if threading.current_thread() is threading.main_thread():
        hup = getattr(signal, "SIGHUP", None)
        stops.HANGUP = hup is not None and signal.getsignal(hup) != signal.SIG_IGN
        for s in stops.handled():
            signal.signal(s, signal.SIG_IGN)
    sys.stdout, sys.stderr = stops.Lossy(sys.stdout), stops.Lossy(sys.stderr)
