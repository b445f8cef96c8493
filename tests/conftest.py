"""Shared test setup: everything offline, CPU-only, and deterministic; every test independent of
the others: each starts with the signals as a terminal gives them, and the suite runs in a new
shuffled order each time (--shuffle SEED replays one, --shuffle off keeps the files' order)."""
import json
import os
import random
import signal
import threading
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

try:
    import fcntl  # POSIX: a lock around building the tiny model
except ImportError:
    fcntl = None

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
requires_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared is absent")


def world_dir(name):
    """A tiny world's warmed-up model as an HF folder: out/NAME, the folder that
    `python train.py --model NAME` builds and uses, so it is built once for the tests and the runs
    alike. tiny.pretrained rebuilds it when it is missing, incomplete or from another version of
    tiny.py. Tests read it, never write it."""
    from machinery import tiny
    (ROOT / "out").mkdir(exist_ok=True)
    # pytest's two processes (-n 2) build it once, in turn
    with open(ROOT / "out" / f"{name}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        return tiny.pretrained(str(ROOT / "out" / name), log=lambda *a: None, name=name)


@pytest.fixture(scope="session")
def tiny_dir():
    """out/tiny, the default world (about 100 s on 2 cores to build)."""
    return world_dir("tiny")


@pytest.fixture(scope="session")
def fork_dir():
    """out/tiny-fork, the world with a real model's forks (about 75 s on one thread to build)."""
    return world_dir("tiny-fork")


# -----------------------------------------------------------------------------
# what a train.py run left, and its one-line errors


def rows(run_dir):
    """The rows of a run's log.jsonl."""
    with open(run_dir / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def weights(folder):
    """The weights of an HF folder, as a state dict."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def exit_2(argv, capsys):
    """`python train.py ARGV` in-process must exit with 2 and one line on stderr; returns that
    line."""
    from machinery import config
    import train
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def in_a_child(fn, limit, thread=False):
    """fn() in a forked child (what fn reads is made once, in this process), in a worker thread of
    it with thread=True (where no alarm can stop sympy, as in a training worker): its result, or
    inf when the child ran past `limit` seconds, killed (a catastrophic backtrack takes minutes)."""
    import multiprocessing
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child():
        result = []
        if thread:
            worker = threading.Thread(target=lambda: result.append(fn()))
            worker.start()
            worker.join()
        else:
            result.append(fn())
        send.send(result[0])

    process = context.Process(target=child)
    process.start()
    result = receive.recv() if receive.poll(limit) else float("inf")
    if process.is_alive():
        process.kill()
    process.join()
    return result


def seconds_in_a_child(fn, limit):
    """The seconds fn() took, timed inside a forked child (in_a_child), or inf past `limit`."""
    import time

    def timed():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return in_a_child(timed, limit)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a second thread only adds synchronisation, which is slow on a shared 2-core
    box."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -----------------------------------------------------------------------------
# independence: the signals as a terminal gives them, and a shuffled order


HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                if hasattr(signal, name))


@pytest.fixture(autouse=True)
def terminal_signals():
    """Every test starts with SIGINT, SIGTERM and SIGHUP as a terminal gives them (Python's Ctrl-C
    handler, the defaults, none blocked), whatever started pytest and whatever ran before: a
    background job of a script has SIGINT ignored, nohup SIGHUP, and a process a test starts
    inherits an ignored or a blocked signal, so that a Ctrl-C sent to it did nothing. What the
    test leaves is put back as it was found; a test that changed them is warned about."""
    if threading.current_thread() is not threading.main_thread():  # signals: the main thread's
        yield
        return
    found = {s: signal.getsignal(s) for s in HANDLED}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
    terminal = {s: signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL
                for s in HANDLED}
    for s, handler in terminal.items():
        signal.signal(s, handler)
    yield
    left = [signal.Signals(s).name for s in HANDLED if signal.getsignal(s) != terminal[s]]
    left += [f"{signal.Signals(s).name} blocked"
             for s in signal.pthread_sigmask(signal.SIG_SETMASK, mask) if s in HANDLED]
    for s, handler in found.items():
        signal.signal(s, handler)
    if left:
        warnings.warn(f"the test left {', '.join(left)} changed (put back)")


def pytest_addoption(parser):
    parser.addoption("--shuffle", default="random", metavar="SEED|random|off",
                     help="the order the tests run in: the files, and the tests in each, shuffled "
                          "(random: a new seed, printed at the end; SEED: that order again; "
                          "off: as written)")


def pytest_configure(config):
    """The seed: the controller's, which each pytest-xdist worker is given, so that all of them
    collect the same order (xdist requires it)."""
    value = (config.workerinput["shuffle"] if hasattr(config, "workerinput")
             else config.getoption("shuffle"))
    if value not in ("random", "off") and not value.isdigit():
        raise pytest.UsageError(f"--shuffle {value}: give a seed (a number), random or off")
    config.shuffle = str(random.randrange(1_000_000)) if value == "random" else value


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["shuffle"] = node.config.shuffle


@pytest.hookimpl(tryfirst=True)  # pytest then groups the tests of a parametrized fixture
def pytest_collection_modifyitems(config, items):
    """Shuffle the files, then the tests within each file (a file's module fixtures are built once,
    and --dist loadfile sends a file to one worker); a test marked `last` (a check of what the
    file's other tests reached) stays after them."""
    if config.shuffle == "off":
        return
    rng, files = random.Random(int(config.shuffle)), {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    order = list(files)
    rng.shuffle(order)
    for path in order:
        rng.shuffle(files[path])
        files[path].sort(key=lambda item: item.get_closest_marker("last") is not None)
    items[:] = [item for path in order for item in files[path]]


def pytest_report_header(config):
    return f"test order: shuffled, --shuffle {config.shuffle}" if config.shuffle != "off" else None


def pytest_terminal_summary(terminalreporter, config):
    if config.shuffle != "off":
        terminalreporter.write_line(f"the tests ran in a shuffled order; --shuffle "
                                    f"{config.shuffle} runs them in that order again")
