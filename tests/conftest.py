"""Shared test setup: everything offline, CPU-only, and deterministic."""
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
requires_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared is absent")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny world's warmed-up model as an HF folder, built once per test session (~30 s)."""
    import tiny
    return tiny.pretrained(str(tmp_path_factory.mktemp("tiny") / "tiny"), log=lambda *a: None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a second thread only adds synchronisation, which is slow on a shared 2-core box."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
