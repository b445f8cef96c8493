"""
Ctrl-C before a run has its own handlers (machinery/stops.py): one line and exit 130, not a
traceback. Importing torch takes seconds, and a KeyboardInterrupt there reaches the top level
uncaught; so train.py's first import (machinery/config.py) and eval.py's import this module first.
It changes only what an uncaught KeyboardInterrupt does at the top level of a script (not at an
interactive prompt: sys.excepthook), so importing it from tests or a notebook changes nothing.
"""
import os
import sys
import traceback


def one_line(kind, error, tb, plain=sys.excepthook):
    """sys.excepthook: a KeyboardInterrupt says where it came, every other error as before."""
    if not issubclass(kind, KeyboardInterrupt) or hasattr(sys, "ps1"):  # ps1: a prompt goes on
        return plain(kind, error, tb)
    starting = any(frame.f_code.co_filename.startswith("<frozen importlib") or  # an import's,
                   frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__")
                   != "__main__" for frame, _ in traceback.walk_tb(tb))  # or a module's body
    for stream, text in ((sys.stdout, ""), (sys.stderr, "\ninterrupted (Ctrl-C)" + (
            " while starting: nothing was written" if starting else "") + "\n")):
        try:
            stream.write(text)
            stream.flush()  # os._exit does not
        except Exception:  # a stream nobody reads any more
            pass
    os._exit(130)  # 128 + SIGINT, as an interrupted run exits (machinery/config.py)


sys.excepthook = one_line
