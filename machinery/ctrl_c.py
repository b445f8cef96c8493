"""
Ctrl-C before a run has its own handlers (machinery/stops.py): one line and exit 130, not a
traceback. Importing torch takes seconds, and a KeyboardInterrupt there reaches the top level
uncaught; so train.py's first import (machinery/config.py) and eval.py's import this module first,
and it sets its hook before anything else, importing nothing that is not loaded already (os and
sys are, at Python's start): what is left uncovered is Python's own start, a few milliseconds.
It changes only what an uncaught KeyboardInterrupt does at the top level of a script (not at an
interactive prompt: sys.excepthook), so importing it from tests or a notebook changes nothing.
"""
import os
import sys


def one_line(kind, error, tb, plain=sys.excepthook):
    """sys.excepthook: a KeyboardInterrupt says where it came, every other error as before."""
    if not issubclass(kind, KeyboardInterrupt) or hasattr(sys, "ps1"):  # ps1: a prompt goes on
        return plain(kind, error, tb)
    starting = False  # in an import's frames, or a module's body other than the script's
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
        starting = starting or frame.f_code.co_filename.startswith("<frozen importlib") or (
            frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") != "__main__")
    for stream, text in ((sys.stdout, ""), (sys.stderr, "\ninterrupted (Ctrl-C)" + (
            " while starting: nothing was written" if starting else "") + "\n")):
        try:
            stream.write(text)
            stream.flush()  # os._exit does not
        except Exception:  # a stream nobody reads any more
            pass
    os._exit(130)  # 128 + SIGINT, as an interrupted run exits (machinery/config.py)


sys.excepthook = one_line
