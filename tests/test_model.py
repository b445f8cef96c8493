"""model.load_model: every kind of --model argument, and a one-line ValueError for each bad one."""
import os
import shutil
import time

import pytest
import torch

import tiny
from model import hub_id, load_model


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_local_folder(tiny_dir):
    model, tokenizer = load_model(tiny_dir, device="cpu")
    assert model.device.type == "cpu" and model.dtype == torch.float32  # "auto" on CPU is float32
    assert tokenizer.pad_token == tiny.PAD
    # the char tokenizer round-trips: it is the folder's tokenizer, not some default one
    assert tokenizer.decode(tokenizer("Question: 1+2\nAnswer:")["input_ids"]) == "Question: 1+2\nAnswer:"
    half, _ = load_model(tiny_dir, device="cpu", dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def test_tiny_reuses_the_cached_folder(tiny_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_dir, tmp_path / "tiny")
    weights = tmp_path / "tiny" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("load_model('tiny') rebuilt a model that was already in cache_dir")
    monkeypatch.setattr(tiny, "warmup", no_rebuild)

    model, _ = load_model("tiny", device="cpu", cache_dir=str(tmp_path))
    reference, _ = load_model(tiny_dir, device="cpu")
    assert _same_weights(model, reference)
    assert weights.stat().st_mtime_ns == stamp


def test_aliases():
    assert hub_id("Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert hub_id("Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"
    assert hub_id("Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert hub_id("gpt2") is None


def _error(arg, **kwargs):
    with pytest.raises(ValueError) as e:
        load_model(arg, device="cpu", **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_unknown_short_name():
    message = _error("gpt2")
    assert "'gpt2'" in message and "Qwen" in message and "meta-llama" in message
    assert "pass a local folder or a hub id" in message


def test_offline_hub_id_fails_fast_with_one_line():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by conftest
    t0 = time.time()
    for arg, hub in [("Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"), ("Qwen/Qwen2.5-Math-1.5B", "Qwen/Qwen2.5-Math-1.5B")]:
        message = _error(arg)
        assert f"cannot fetch {hub}" in message and "HF_HUB_OFFLINE" in message and "--model DIR" in message
    assert time.time() - t0 < 60  # no retry loop against an unreachable hub


def test_path_that_does_not_exist(tmp_path):
    message = _error(str(tmp_path / "nowhere" / "final"))
    assert "does not exist" in message and "nowhere" in message


def test_folder_without_config(tiny_dir, tmp_path):
    folder = tmp_path / "noconfig"
    shutil.copytree(tiny_dir, folder)
    os.remove(folder / "config.json")
    message = _error(str(folder))
    assert message.startswith(f"model folder {folder} has no config.json")


@pytest.mark.parametrize("keep", [100, 0.9])  # the header cut, or only the tensor data
def test_truncated_weights(tiny_dir, tmp_path, keep):
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_dir, folder)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, keep if isinstance(keep, int) else int(size * keep))
    message = _error(str(folder))
    assert message.startswith(f"model folder {folder} is corrupt or incomplete: ")
    assert len(message) > len(f"model folder {folder} is corrupt or incomplete: ")  # says why


def test_bad_device_and_dtype(tiny_dir):
    assert "dtype='float8'" in _error(tiny_dir, dtype="float8")
    with pytest.raises(ValueError, match="device='gpu'"):
        load_model(tiny_dir, device="gpu")
