"""
Ctrl-C, SIGTERM and SIGHUP: a flag that the run reads at points it owns, never an exception raised
inside other code.

A handler that raises KeyboardInterrupt raises it wherever the main thread happens to be: inside
matplotlib's C++ (which turns it into "ValueError: Invalid bounding box"), inside a save, between a
step's updates; every such place then needs its own guard. So the first signal only sets the flag
and says so in one line. machinery/run.py reads it between decode steps (a Stop is also a
transformers StoppingCriteria, which `generate` asks after every token), after a step's generation,
before a step's first update and at a step's end, then saves the steps applied and exits with 130
(SIGINT), 143 (SIGTERM) or 129 (SIGHUP: a closed terminal; not under nohup). Once the run's last
evaluation is recorded there is nothing left to stop: the signal says so and the run ends as it
would have. A second signal quits at once with the first signal's code (0 once the run is
complete), leaving the last checkpoint as it was: its writes are atomic (machinery/checkpoint.py).
What each line offers is the command that works in the state the folder is in at that moment (the
run's `status`). Before the run installs these handlers and once it has put them back, `python
train.py` ignores them (machinery/config.py), and its stdout and stderr lose their lines, never the
run, once nobody reads them (Lossy); a stop's last line then goes to stderr too (stdout_gone).
"""
import errno
import os
import signal
import sys
import threading

import torch
from transformers import StoppingCriteria


class Stop(StoppingCriteria):
    """The flag: `first` is the first signal's number, or None while no signal came. As a stopping
    criterion, every row of a `generate` call ends at its next token once a signal came (the run
    then throws those rows away). `status()`, set by the run, says where it is when a signal comes:
    ("running" | "finishing" | "complete", what a quit leaves, the command that goes on)."""

    def __init__(self):
        super().__init__()
        self.first, self.old = None, {}
        self.status = lambda: ("running", "the last checkpoint stands", "")

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.first is not None, dtype=torch.bool,
                          device=input_ids.device)

    def install(self):
        """Handle SIGINT, SIGTERM and SIGHUP (a closed terminal, unless the process started with it
        ignored: nohup), in the main thread only (Python's rule for signals)."""
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self.handler) for s in handled()}

    def restore(self):
        for s, handler in self.old.items():
            signal.signal(s, handler)
        self.old = {}

    def handler(self, signum, frame):
        try:  # a handler raises nothing into the code it interrupted
            state, *then = self.status()
        except Exception:
            state, then = "running", ["the last checkpoint stands"]
        if self.first is None:
            self.first = signum
            say({"running": "stopping at the next safe point; signal again to quit now",
                 "finishing": "the run's steps and evaluations are done: it ends once its last "
                              "checkpoint is saved",
                 "complete": "the run is complete: it ends now"}[state])
            return
        say("; ".join(["quit at once", *filter(None, then)]))
        try:
            sys.stdout.flush()  # the lines printed so far
        except Exception:  # a flush this handler interrupted, a closed pipe: those lines are lost
            pass
        # no cleanup runs: a save cut short is dropped on resume
        os._exit(0 if state == "complete" else 128 + self.first)


# SIGHUP as SIGTERM: a terminal that closes ends the run with a checkpoint. None: the process is
# not train.py's own (a test, a notebook), which handles it unless it is ignored there.
HANGUP = None


def handled():
    """The signals a run stops on: SIGINT, SIGTERM, and SIGHUP where it is not ignored (nohup)."""
    hup = getattr(signal, "SIGHUP", None)  # POSIX only
    keep = hup is not None and (HANGUP if HANGUP is not None else
                                signal.getsignal(hup) != signal.SIG_IGN)
    return (signal.SIGINT, signal.SIGTERM) + ((hup,) if keep else ())


def say(line):
    """One line on stderr. os.write, not print: a handler may run inside a print, and a buffered
    stream refuses a reentrant call with an exception, which is what this design avoids. A stderr
    nobody reads any more (a pipe whose reader has gone: EPIPE) loses the line, not the run."""
    try:
        os.write(2, f"\n{line}\n".encode())
    except OSError:
        pass


def stdout_gone():
    """Is stdout's reader gone (Lossy found its pipe closed, or its terminal hung up)? Its buffer
    is flushed first, so that a line just printed finds out."""
    try:
        sys.stdout.flush()
    except Exception:  # a stdout that is not Lossy's (a caller's): it says nothing of a reader
        return False
    return getattr(sys.stdout, "lost", False)


class Lossy:
    """stdout or stderr for a process whose reader may go (`python train.py | head -2`, a log
    collector that died, a terminal closed): once a write or a flush meets a closed pipe (EPIPE) or
    a hung-up terminal (EIO), its descriptor is pointed at /dev/null, so the lines are lost and the
    run goes on, as say() does for a stop's line. Everything else is the stream's."""

    def __init__(self, stream):
        self.stream, self.lost = stream, False

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as e:
            if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:
                raise
            self.gone()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError as e:
            if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:
                raise
            self.gone()

    def gone(self):
        """What the stream still holds, and every later line, go to /dev/null."""
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self.stream.fileno())
        os.close(null)
        self.lost = True

    def __getattr__(self, name):
        return getattr(self.stream, name)
