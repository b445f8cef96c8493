"""model.load_model: every kind of --model argument, and a one-line ValueError for each bad one; what --dtype
means (float16 too); LoRA's adapters."""
import json
import math
import os
import shutil
import sys
import time

import pytest
import torch

from machinery import tiny
from machinery import model
from machinery.model import (adapters_off, autocast, autocast_dtype, autocast_enabled, bf16_capable,
                              grad_scaler, hub_id, load_model, weight_dtype, with_lora)


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
    # bf16 weights would round away updates of 1e-6; "auto" gets bf16 speed from autocast instead, and
    # "float16" float16's from autocast and a gradient scaler (float32 master weights, as on a T4)
    assert weight_dtype("auto", device) == torch.float32
    assert weight_dtype("auto") == torch.float32
    assert weight_dtype("bfloat16", device) == torch.bfloat16
    assert weight_dtype("float16", device) == torch.float32
    assert weight_dtype("float32", device) == torch.float32
    assert weight_dtype(torch.bfloat16, device) == torch.bfloat16


@pytest.mark.parametrize("device, dtype, capability, expected", [
    ("cuda", "auto", (8, 0), torch.bfloat16),   # the frozen base in the dtype autocast runs it in
    ("cuda", "auto", (7, 5), torch.float16),    # a T4
    ("cuda:1", "float16", (9, 0), torch.float16),
    ("cpu", "auto", None, torch.float32),        # a CPU: float32, as without LoRA
    ("cpu", "float16", None, torch.float32),
    ("cuda", "float32", (9, 0), torch.float32),  # an explicit dtype is the weights' dtype
    ("cuda", "bfloat16", (7, 5), torch.bfloat16),
])
def test_a_lora_base_is_held_in_the_autocast_dtype_on_a_gpu(monkeypatch, device, dtype, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert weight_dtype(dtype, device, lora=True) == expected
    assert weight_dtype(dtype, device) == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)


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
    ("cuda", "auto", (8, 0), torch.bfloat16),  # a GPU with bf16 hardware under auto
    ("cuda:1", "auto", (9, 0), torch.bfloat16),
    (torch.device("cuda", 0), "auto", (8, 6), torch.bfloat16),
    ("cuda", "auto", (7, 5), torch.float16),   # a GPU without it (T4, V100): float16, with a scaler
    ("cuda:1", "auto", (7, 0), torch.float16),
    ("cpu", "auto", (9, 0), None),             # auto never autocasts on a CPU
    ("cpu", "auto", None, None),               # and without asking torch.cuda
    ("cuda", "float32", (9, 0), None),         # float32 and bfloat16 weights never autocast
    ("cuda", "bfloat16", (9, 0), None),
    ("cuda", "float16", (9, 0), torch.float16),  # float16: the T4's path on any device
    ("cpu", "float16", None, torch.float16),
])
def test_autocast_decision(device, dtype, capability, expected):
    assert autocast_dtype(device, dtype, capability=capability) == expected
    assert autocast_enabled(device, dtype, capability=capability) is (expected is not None)


def test_autocast_asks_the_requested_device(monkeypatch):
    """Without a capability, the one of the device asked for (cuda:1 here), not the current device's."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or {0: (7, 5), 1: (8, 0)}[device.index or 0])
    assert autocast_dtype("cuda:1", "auto") == torch.bfloat16 and autocast_dtype("cuda:0", "auto") == torch.float16
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


# -----------------------------------------------------------------------------
# --dtype float16: the T4's path, on the CPU as far as torch allows


def test_float16_autocasts_on_the_cpu_over_float32_weights_and_only_it_has_a_scaler(tiny_dir):
    model_, tokenizer = load_model(tiny_dir, device="cpu", dtype="float16")
    assert model_.dtype == torch.float32  # the master weights
    ids = tokenizer("Question: 1+2\nAnswer:", return_tensors="pt")["input_ids"]
    with torch.no_grad(), autocast("cpu", "float16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        assert model_.model.layers[0].self_attn.q_proj(model_.model.embed_tokens(ids)).dtype == torch.float16
    optimizer = torch.optim.SGD(model_.parameters(), lr=0.1)
    assert grad_scaler(optimizer, "cpu", "float16").is_enabled()
    assert not any(grad_scaler(optimizer, "cpu", d).is_enabled() for d in ("auto", "float32", "bfloat16"))


def test_the_gradient_scale_rides_in_the_optimizers_state_dict():
    """trainer.pt holds optimizer.state_dict(): with float16 it carries the scaler's state, so a resumed run
    goes on with the scale the run had reached (here halved once by an inf gradient), not 2**16 again."""
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = grad_scaler(optimizer, "cpu", "float16")
    scaler.scale(w.sum()).backward()
    w.grad[0] = math.inf
    scaler.unscale_(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 15  # 2**16 halved: the step was the scaler's to skip
    state = optimizer.state_dict()
    assert state["scaler"]["scale"] == 2.0 ** 15
    again = torch.optim.SGD([w], lr=0.1)
    resumed = grad_scaler(again, "cpu", "float16")
    again.load_state_dict(state)
    assert resumed.get_scale() == 2.0 ** 15 and "scaler" in state  # the caller's dict is left whole
    plain = torch.optim.SGD([w], lr=0.1)  # resumed where float16 does not apply (a CPU under auto)
    assert not grad_scaler(plain, "cpu", "auto").is_enabled()
    plain.load_state_dict(state)
    assert "scaler" not in plain.state_dict()


# -----------------------------------------------------------------------------
# LoRA


def trained_lora(tiny_dir, rank=4, dtype="float32", seed=0, scale=0.05):
    """The tiny world's model with LoRA adapters of `rank`, their B drawn at random as if trained (PEFT
    starts B at 0), scale * N(0, 1) each."""
    policy, tokenizer = load_model(tiny_dir, device="cpu", dtype=dtype, lora=True)
    policy = with_lora(policy, rank, tiny_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return policy, tokenizer


def logits(model_, tokenizer, text="Question: 3+8+5\nAnswer:"):
    with torch.no_grad():
        return model_(tokenizer(text, return_tensors="pt")["input_ids"]).logits


def test_lora_trains_only_its_adapters_on_every_linear_layer_and_starts_as_the_base(tiny_dir):
    base, tokenizer = load_model(tiny_dir, device="cpu")
    policy = with_lora(load_model(tiny_dir, device="cpu")[0], 4, tiny_dir)
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    layers = base.config.num_hidden_layers
    # an A and a B on each of the seven projections of every decoder layer, and nothing else
    found = {(int(n.split(".layers.")[1].split(".")[0]), n.split(".lora_")[0].rsplit(".", 1)[1],
              n.split(".lora_")[1][0]) for n in trained}
    assert len(trained) == layers * 7 * 2
    assert found == {(i, t, ab) for i in range(layers) for t in model.LORA_TARGETS for ab in "AB"}
    # r (in + out) per projection, from the base's own shapes
    projections = [m for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in model.LORA_TARGETS]
    assert sum(p.numel() for p in trained.values()) == sum(4 * (m.in_features + m.out_features)
                                                           for m in projections)
    assert all(p.dtype == torch.float32 for p in trained.values())
    assert not policy.get_input_embeddings().weight.requires_grad
    assert not policy.get_output_embeddings().weight.requires_grad
    assert torch.equal(logits(policy, tokenizer), logits(base, tokenizer))  # B = 0: the base, bit for bit
    # A is drawn from --seed alone, whatever torch's generator holds: one seed, one run
    torch.manual_seed(123)
    same = with_lora(load_model(tiny_dir, device="cpu")[0], 4, tiny_dir)
    other = with_lora(load_model(tiny_dir, device="cpu")[0], 4, tiny_dir, seed=1)
    for (name, a), b, c in zip(policy.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c) == ("lora_A" not in name), name
    # a bf16 base (a GPU's), float32 adapters
    half = with_lora(load_model(tiny_dir, device="cpu", dtype="bfloat16")[0], 4, tiny_dir)
    assert {p.dtype for p in half.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in half.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_adapters_off_is_the_base_and_they_come_back_on(tiny_dir):
    """The KL term's reference under LoRA is the policy with its adapters off: the base's logits exactly."""
    base, tokenizer = load_model(tiny_dir, device="cpu")
    policy, _ = trained_lora(tiny_dir)
    on = logits(policy, tokenizer)
    assert not torch.allclose(on, logits(base, tokenizer), atol=1e-3)  # the adapters change the policy
    with adapters_off(policy):
        assert torch.equal(logits(policy, tokenizer), logits(base, tokenizer))
    assert torch.equal(logits(policy, tokenizer), on)
    with adapters_off(base):  # a model without adapters: nothing to turn off
        assert torch.equal(logits(base, tokenizer), logits(base, tokenizer))


def test_a_lora_folder_holds_the_adapters_names_its_base_and_loads_as_saved(tiny_dir, tmp_path):
    policy, tokenizer = trained_lora(tiny_dir)
    folder = tmp_path / "adapters"
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert not (folder / "model.safetensors").exists()  # the adapters, not a copy of the base
    saved = json.load(open(folder / model.ADAPTERS))
    assert saved["base_model_name_or_path"] == os.path.abspath(tiny_dir)
    assert (saved["r"], saved["lora_alpha"], saved["lora_dropout"]) == (4, 32, 0.0)
    assert set(saved["target_modules"]) == set(model.LORA_TARGETS)
    loaded, tok = load_model(str(folder), device="cpu")
    assert model.is_lora(loaded) and tok.decode(tok("1+2")["input_ids"]) == "1+2"
    assert torch.equal(logits(loaded, tok), logits(policy, tokenizer))
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == \
        {n for n, p in policy.named_parameters() if p.requires_grad}  # a resumed run trains them on
    # merged into the base (a new run from this policy): the same function, up to float rounding
    merged = with_lora(loaded, 0, str(folder))
    assert not model.is_lora(merged) and all(p.requires_grad for p in merged.parameters())
    assert torch.allclose(logits(merged, tok), logits(policy, tokenizer), atol=1e-4, rtol=1e-5)
    # a base that is gone, or none named: one line that says which
    saved["base_model_name_or_path"] = str(tmp_path / "nowhere")
    json.dump(saved, open(folder / model.ADAPTERS, "w"))
    message = _error(str(folder))
    assert message.startswith(f"the base model of the LoRA adapters in {folder}: ") and "nowhere" in message
    saved["base_model_name_or_path"] = None
    json.dump(saved, open(folder / model.ADAPTERS, "w"))
    assert "names no base model" in _error(str(folder))


def test_without_peft_lora_is_one_line_and_the_rest_runs(tiny_dir, tmp_path, monkeypatch):
    policy, tokenizer = trained_lora(tiny_dir)
    policy.save_pretrained(tmp_path / "adapters")
    tokenizer.save_pretrained(tmp_path / "adapters")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now fails, as when it is not installed
    base, _ = load_model(tiny_dir, device="cpu")
    with pytest.raises(ValueError, match=r"^--lora_rank needs peft: pip install peft$"):
        with_lora(base, 4, tiny_dir)
    assert with_lora(base, 0, tiny_dir) is base  # rank 0 never imports it
    assert _error(str(tmp_path / "adapters")).endswith("holds LoRA adapters: loading them needs peft: "
                                                      "pip install peft")


def test_a_lora_policy_samples_without_the_checkpoints_generation_config(tiny_dir, tmp_path):
    """The sampler blanks model.generation_config while generating (machinery/sampling.py). A LoRA policy is
    PEFT's wrapper, whose generate hands its own generation_config to the model inside: a checkpoint's
    repetition penalty must not reach the samples through it."""
    from machinery.data import format_prompt
    from rollout import generate_groups
    polluted = tmp_path / "polluted"
    shutil.copytree(tiny_dir, polluted)
    config = json.load(open(polluted / "generation_config.json"))
    json.dump({**config, "repetition_penalty": 50.0}, open(polluted / "generation_config.json", "w"))
    base, tokenizer = load_model(tiny_dir, device="cpu")
    dirty = load_model(str(polluted), device="cpu")[0]
    ids = tokenizer(format_prompt(tokenizer, "1+1+1+1"), return_tensors="pt")["input_ids"]
    with torch.no_grad():  # the penalty would change what is generated
        assert not torch.equal(dirty.generate(ids, max_new_tokens=12), base.generate(ids, max_new_tokens=12))
    policy = with_lora(dirty, 4, str(polluted))  # B = 0: the base's function
    prompts = [format_prompt(tokenizer, q) for q in ("1+1+1+1", "2+2+2+2")]
    for engine in ("loop", "hf"):  # the loop reads only the EOS ids; hf blanks the configuration
        for temperature in (0.0, 1.0):
            mine = generate_groups(policy, tokenizer, prompts, 2, 16, temperature, seed=3, engine=engine)
            clean = generate_groups(base, tokenizer, prompts, 2, 16, temperature, seed=3, engine=engine)
            assert torch.equal(mine.completion_ids, clean.completion_ids), (engine, temperature)
    assert policy.generation_config.repetition_penalty == 50.0  # restored afterwards


# -----------------------------------------------------------------------------
# a new LoRA run from a LoRA checkpoint; the base a checkpoint names, pinned


def saved_lora(tiny_dir, folder, scale):
    """trained_lora's policy saved as a LoRA checkpoint is (adapters, tokenizer)."""
    policy, tokenizer = trained_lora(tiny_dir, scale=scale)
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return policy, tokenizer


def test_a_new_lora_run_from_a_lora_checkpoint_keeps_its_trained_adapters_exactly(tiny_dir, tmp_path):
    """`train.py --model CKPT --lora_rank 2` from a LoRA checkpoint whose base a GPU holds in bf16 (load_dtype;
    the rounding is the CPU's too): the new run starts exactly as the checkpoint's policy, the trained
    adapters kept on and frozen beside the fresh ones. Merged into the bf16 base, most of their effect rounds
    away: at B ~ 5e-4 N(0, 1) (a few AdamW steps at LoRA's lr 5e-4), 83% of it here. The new checkpoint
    holds them itself: the first one can go."""
    ckpt = tmp_path / "first"
    saved_lora(tiny_dir, ckpt, scale=5e-4)
    assert model.load_dtype(str(ckpt), "cpu", "bfloat16", lora=True) == torch.bfloat16
    policy, tokenizer = load_model(str(ckpt), device="cpu", dtype="bfloat16", lora=True)  # train.py's load
    want, base = logits(policy, tokenizer), logits(load_model(tiny_dir, device="cpu", dtype="bfloat16")[0],
                                                  tokenizer)
    merged = logits(policy.merge_and_unload(), tokenizer)  # what a bf16 merge would start from
    assert (merged - want).float().norm() > 0.5 * (want - base).float().norm()
    start = with_lora(load_model(str(ckpt), device="cpu", dtype="bfloat16", lora=True)[0], 2, str(ckpt), seed=1)
    assert torch.equal(logits(start, tokenizer), want)
    trainable = {n for n, p in start.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)  # only the fresh adapters train
    assert start.peft_config["default"].r == 2 and start.peft_config["frozen1"].r == 4
    with adapters_off(start):  # the KL reference: the policy the run started from, not the base
        assert torch.equal(logits(start, tokenizer), want)
    assert {n for n, p in start.named_parameters() if p.requires_grad} == trainable
    ids = tokenizer("Question: 3+8+5\nAnswer:", return_tensors="pt")["input_ids"]
    grads = []
    for reference in (False, True):  # a reference pass between forward and backward, as train.py's
        loss = start(ids).logits.float().square().mean()
        if reference:
            with torch.no_grad(), adapters_off(start):
                start(ids)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in start.named_parameters() if p.grad is not None})
        start.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() == trainable
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in trainable)
    # trained a little, saved as train.py saves, loaded with the first checkpoint gone
    with torch.no_grad():
        for name, p in start.named_parameters():
            if "lora_B.default" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    now = logits(start, tokenizer)
    start.save_pretrained(tmp_path / "second", save_embedding_layers=False)
    tokenizer.save_pretrained(tmp_path / "second")
    shutil.rmtree(ckpt)
    saved = json.load(open(tmp_path / "second" / model.ADAPTERS))
    assert saved["base_model_name_or_path"] == os.path.abspath(tiny_dir)  # the base, not the checkpoint
    again, _ = load_model(str(tmp_path / "second"), device="cpu", dtype="bfloat16", lora=True)
    assert torch.equal(logits(again, tokenizer), now)
    assert {n for n, p in again.named_parameters() if p.requires_grad} == trainable
    with adapters_off(again):
        assert torch.equal(logits(again, tokenizer), want)
    # a third run from it keeps both; full fine-tuning from it merges both into the float32 base
    third = with_lora(load_model(str(tmp_path / "second"), device="cpu", dtype="bfloat16", lora=True)[0],
                      2, str(tmp_path / "second"))
    assert model._frozen(third) == ["frozen1", "frozen2"] and torch.equal(logits(third, tokenizer), now)
    full_policy = with_lora(load_model(str(tmp_path / "second"), device="cpu", lora=False)[0], 0, "x")
    assert full_policy.dtype == torch.float32 and all(p.requires_grad for p in full_policy.parameters())
    assert torch.allclose(logits(full_policy, tokenizer), logits(
        load_model(str(tmp_path / "second"), device="cpu")[0], tokenizer), atol=1e-4, rtol=1e-5)


def test_a_lora_checkpoint_refuses_a_base_that_changed(tiny_dir, tmp_path, capsys):
    """A LoRA run pins the local folder its adapters are trained on (model.pin_of, as `revision`): once
    that folder holds other weights (a run folder's checkpoint, resumed or overwritten), its resume and
    every load of its checkpoint are one line, not adapters on the wrong weights."""
    import train
    from conftest import exit_2
    base = tmp_path / "run" / "checkpoint"
    shutil.copytree(tiny_dir, base)
    lora = tmp_path / "lora"
    train.train(train.Config(model=str(base), out_dir=str(lora), lora_rank=4, steps=1, prompts_per_step=2,
                             group_size=4, eval_size=2, save_every=0), log=lambda *a: None)
    saved = json.load(open(lora / "checkpoint" / model.ADAPTERS))
    assert saved["revision"] == model.pin_of(str(base)) == model.pin_of(tiny_dir)
    assert saved["revision"].startswith("sha256:") and len(saved["revision"]) == 7 + 64
    load_model(str(lora / "checkpoint"), device="cpu")  # as it was: loads
    changed, _ = load_model(str(base), device="cpu")
    with torch.no_grad():
        changed.model.norm.weight.add_(1e-3)  # one step of a resumed run
    changed.save_pretrained(base)
    want = (f"the LoRA adapters in {lora / 'checkpoint'} were trained on {os.path.abspath(base)}, whose "
            f"weights have changed since (sha256:")
    message = _error(str(lora / "checkpoint"))
    assert message.startswith(want) and message.endswith(
        "put those weights back there, or point base_model_name_or_path at a copy of them")
    assert exit_2(["--resume", str(lora)], capsys).startswith("error: " + want)
    shutil.rmtree(base)
    shutil.copytree(tiny_dir, base)  # put back: loads again
    load_model(str(lora / "checkpoint"), device="cpu")
