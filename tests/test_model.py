"""model.load_model: every kind of --model argument, and a one-line ValueError for each bad one."""
import os
import shutil
import time

import pytest
import torch

from machinery import tiny
from machinery import model
from machinery.model import autocast, autocast_enabled, bf16_capable, hub_id, load_model, weight_dtype


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


# -----------------------------------------------------------------------------
# --dtype: one meaning in train.py and eval.py


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", torch.device("cuda", 0)])
def test_auto_weights_are_float32_on_every_device(device):
    # bf16 weights would round away updates of 1e-6; "auto" gets bf16 speed from autocast instead
    assert weight_dtype("auto", device) == torch.float32
    assert weight_dtype("auto") == torch.float32
    assert weight_dtype("bfloat16", device) == torch.bfloat16
    assert weight_dtype("float16", device) == torch.float16
    assert weight_dtype("float32", device) == torch.float32
    assert weight_dtype(torch.bfloat16, device) == torch.bfloat16


@pytest.mark.parametrize("capability, expected", [
    ((7, 0), False),  # V100: torch.cuda.is_bf16_supported() says True (emulation), no bf16 tensor cores
    ((7, 5), False),  # T4, the free notebook GPU
    ((8, 0), True),   # A100
    ((8, 6), True),   # A10, RTX 30xx
    ((8, 9), True),   # L4, RTX 40xx
    ((9, 0), True),   # H100, H200
    ((12, 0), True),
    ([8, 0], True),   # a list, as some callers hold it
])
def test_bf16_capable_by_compute_capability(capability, expected):
    assert bf16_capable(capability) is expected


@pytest.mark.parametrize("device, dtype, capability, expected", [
    ("cuda", "auto", (8, 0), True),          # the one case: a GPU with bf16 hardware under auto
    ("cuda:1", "auto", (9, 0), True),
    (torch.device("cuda", 0), "auto", (8, 6), True),
    ("cuda", "auto", (7, 5), False),         # a GPU without it (T4, V100): plain float32
    ("cuda:1", "auto", (7, 0), False),
    ("cpu", "auto", (9, 0), False),          # never on a CPU
    ("cpu", "auto", None, False),            # and without asking torch.cuda
    ("cuda", "float32", (9, 0), False),      # an explicit dtype never autocasts
    ("cuda", "bfloat16", (9, 0), False),
    ("cuda", "float16", (9, 0), False),
])
def test_autocast_decision(device, dtype, capability, expected):
    assert autocast_enabled(device, dtype, capability=capability) is expected


def test_autocast_asks_the_requested_device(monkeypatch):
    """Without a capability, the one of the device asked for (cuda:1 here), not the current device's."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or {0: (7, 5), 1: (8, 0)}[device.index or 0])
    assert autocast_enabled("cuda:1", "auto") and not autocast_enabled("cuda:0", "auto")
    assert [str(d) for d in asked] == ["cuda:1", "cuda:0"]


def test_allocator_defaults_to_expandable_segments():
    """model.py sets expandable_segments for the CUDA allocator unless the user configured the allocator
    under any name torch reads; and it does so in time: torch reads the variable lazily, and reads here
    what the first name set says (importing model.py came before any allocation in this process)."""
    env = {}
    model.set_allocator_defaults(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in model.ALLOC_CONF:
        env = {name: "max_split_size_mb:64", "HOME": "/x"}
        model.set_allocator_defaults(env)
        assert env == {name: "max_split_size_mb:64", "HOME": "/x"}, name  # the user's own, alone
    first = next(name for name in model.ALLOC_CONF if name in os.environ)
    assert torch._C._accelerator_getAllocatorSettings() == os.environ[first]


def test_autocast_on_cpu_is_a_no_op(tiny_dir):
    model_, tokenizer = load_model(tiny_dir, device="cpu", dtype="auto")
    assert model_.dtype == torch.float32
    ids = tokenizer("Question: 1+2\nAnswer:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = model_(ids).logits
        with autocast("cpu", "auto"):
            assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
            cast = model_(ids).logits
    assert cast.dtype == torch.float32 and torch.equal(plain, cast)


def test_eval_runs_under_the_same_autocast(tiny_dir, tmp_path, monkeypatch):
    # eval.py loads the weights and wraps evaluate() exactly as train.py does, through model.py
    import eval as eval_py
    entered, loaded, inside = [], [], []

    class Recording:
        def __init__(self, device, dtype):
            entered.append((torch.device(device).type, dtype))

        def __enter__(self):
            inside.append(True)

        def __exit__(self, *exc):
            inside.append(False)

    real_load, real_evaluate = model.load_model, eval_py.evaluate

    def load(name, device="auto", dtype="auto"):
        loaded.append(dtype)
        return real_load(name, device=device, dtype=dtype)

    def evaluate(*args, **kwargs):
        assert inside and inside[-1], "evaluate() ran outside model.autocast"
        return real_evaluate(*args, **kwargs)
    monkeypatch.setattr(model, "autocast", Recording)
    monkeypatch.setattr(model, "load_model", load)
    monkeypatch.setattr(eval_py, "evaluate", evaluate)
    assert eval_py.main(["--model", tiny_dir, "--benchmarks", "tiny", "--limit", "2", "--device", "cpu",
                         "--max_new_tokens", "4", "--out", str(tmp_path / "e.jsonl")]) == 0
    assert loaded == ["auto"] and entered == [("cpu", "auto")] and inside == [True, False]
