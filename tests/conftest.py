"""Shared test setup: everything offline, CPU-only, and deterministic."""
import json
import os
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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a second thread only adds synchronisation, which is slow on a shared 2-core
    box."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
