"""
Models: turn the --model argument of train.py and eval.py into (model, tokenizer). One function,
load_model, so that training and evaluation can never load a checkpoint in two different ways.

    load_model("tiny")                       # machinery/tiny.py's offline world, in out/tiny
    load_model("out/d3s-tiny/checkpoint")    # a folder written by save_pretrained
    load_model("Qwen2.5-Math-1.5B")          # a short name -> the hub id Qwen/Qwen2.5-Math-1.5B
    load_model("Qwen/Qwen2.5-0.5B-Instruct") # a hub id, as is
    disable_dropout(model)                   # [ours] a forward is a function of the weights alone

The argument is read in this order: "tiny"; an existing folder; a short name from ALIASES; a hub id
("org/name"). Anything that cannot be loaded is a one-line ValueError that says what to do instead.

--dtype means the same in train.py and eval.py, through the two helpers below:

    model, tok = load_model(name, device, dtype)  # weights: weight_dtype(dtype), "auto" is float32
    with autocast(device, dtype):                 # bf16 forward passes where "auto" allows them
        ...generate, score, evaluate...

"auto" [ours]: float32 weights everywhere, and forward passes under bfloat16 autocast on a CUDA GPU
with bf16 hardware, compute capability 8.0 or more (A100, A10, L4, RTX 30xx/40xx, H100; float32 on
a CPU, and on a T4 or V100, which have no bf16 tensor cores: bf16_capable). Training needs the
float32 weights: bf16 has an 8-bit mantissa and rounds away most updates of size lr * grad ~ 1e-6.
Evaluation uses the same, so that eval.py and train.py's held-out accuracy run the same arithmetic
and give the same number (bit for bit on a CPU; on a GPU under bf16 only up to the rounding that
changes with batch shape). "float32", "bfloat16" and "float16" load the weights in that dtype and
never autocast (bf16 weights halve the memory of a big model, at the cost of that rounding).
"""
import contextlib
import os

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

# The CUDA caching allocator's variables, in the order torch 2.13 reads them (the first set wins).
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def set_allocator_defaults(environ):
    """[ours] expandable_segments for the CUDA allocator, unless the user configured the allocator.
    Why: a step allocates tensors of ever-changing shapes (rollouts of every length, LM-head chunks
    of (chunk, V) floats); the default allocator keeps fixed-size segments, and the reserved memory
    grows well past what is allocated until a card runs out of memory with gigabytes free but
    fragmented. Expandable segments grow and shrink one mapping instead (PyTorch's CUDA notes
    recommend them for varying sizes). torch reads the variable at the first CUDA allocation, so
    setting it here, at import, before any model is loaded, is in time. A user's own setting, under
    any of the names torch reads, is left alone: writing PYTORCH_CUDA_ALLOC_CONF beside a user's
    PYTORCH_ALLOC_CONF would override it, since torch reads the CUDA name first."""
    if not any(name in environ for name in ALLOC_CONF):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


set_allocator_defaults(os.environ)

# Short names -> hub organisation, by prefix: "Qwen2.5-0.5B" -> "Qwen/Qwen2.5-0.5B".
# [ours] Only the two families the D3S paper trains (Qwen2.5(-Math), Llama 3.1); for anything else
# pass the full hub id ("org/name") or a local folder.
ALIASES = {
    "Qwen": "Qwen",          # Qwen2.5-0.5B, Qwen2.5-Math-1.5B, Qwen2.5-1.5B-Instruct, ...
    "Llama-": "meta-llama",  # Llama-3.1-8B, Llama-3.1-8B-Instruct
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hub_id(name):
    """The hub id of a short name ("Qwen2.5-0.5B" -> "Qwen/Qwen2.5-0.5B"), or None if it has no
    alias."""
    for prefix, org in ALIASES.items():
        if name.startswith(prefix):
            return f"{org}/{name}"
    return None


def load_model(name_or_path, device="auto", dtype="auto", cache_dir="out"):
    """(model, tokenizer) for "tiny", a local folder, a short name or a hub id, on `device` in
    `dtype`.

    device: "auto" (cuda if available, else cpu) or any torch device string ("cpu", "cuda:1").
    dtype: the weights' dtype, weight_dtype(dtype): "auto" (float32; run forward passes inside
    autocast(device, "auto") for bf16 speed on a GPU), "float32", "bfloat16", "float16" or a
    torch.dtype. cache_dir: where "tiny" builds its model folder (cache_dir/tiny).
    """
    # per-shard "Loading weights" bars: noise on stderr, and around one-line errors
    hf_logging.disable_progress_bar()
    device = _device(device)
    dtype = weight_dtype(dtype, device)
    source, is_folder = _resolve(str(name_or_path), cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as e:  # most transformers/hub failures: OSError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if is_folder:
            raise ValueError(f"model folder {source} is corrupt or incomplete: {first}") from None
        raise ValueError(_hub_failure(source, first)) from None
    if tokenizer.pad_token is None:
        # Llama has no pad token. Padding is found by position (rollout.completion_mask), never by
        # comparing with the pad id, so padding with EOS is harmless.
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def _resolve(name, cache_dir):
    """(folder or hub id to load from, whether it is a local folder)."""
    # a tiny world by name (tiny.WORLDS), built once
    if name == "tiny" or (name.startswith("tiny-") and not os.path.isdir(name)):
        from machinery import tiny  # imported here: only the tiny world needs it
        tiny.world(name)  # an unknown world is a one-line error
        return tiny.pretrained(os.path.join(cache_dir, name), name=name), True
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"model folder {name} has no config.json; pass a folder written by "
                             f"save_pretrained (config.json, weights, tokenizer files)")
        return name, True
    if "/" not in name:
        alias = hub_id(name)
        if alias is None:
            known = ", ".join(f"{p}* -> {org}/{p}*" for p, org in ALIASES.items())
            raise ValueError(f"model {name!r} is not a folder, not 'tiny' and not a known short "
                             f"name ({known}); pass a local folder or a hub id (org/name)")
        return alias, False
    # A hub id is exactly "org/name"; anything else with a slash can only have been meant as a path.
    org, _, rest = name.partition("/")
    if name.startswith((".", "~")) or not org or not rest or "/" in rest:
        raise ValueError(f"model folder {name} does not exist; pass an existing folder written by "
                         f"save_pretrained, or a hub id (org/name)")
    return name, False


def _hub_failure(hub, why):
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    if offline:
        return (f"cannot fetch {hub} from the hub: HF_HUB_OFFLINE is set and it is not in the "
                f"local cache; download it where there is network (huggingface-cli download {hub} "
                f"--local-dir DIR) and pass --model DIR")
    return (f"cannot fetch {hub} from the hub ({why}); check the id and the network (no network: "
            f"download it elsewhere with huggingface-cli download {hub} --local-dir DIR and pass "
            f"--model DIR)")


def _device(device):
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; "
                         f"use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but torch sees no CUDA GPU; "
                         f"use --device cpu or auto")
    return device


def disable_dropout(model):
    """[ours] No dropout in the policy (TRL's disable_dropout does the same): the ratio and the KL
    compare the policy with itself, so a forward must be a function of the weights alone. With
    dropout the first mini-batch's ratio is not 1, and dropout's draws from torch's global generator
    make two runs with one seed differ and a resume inexact. Qwen2 and Llama keep their attention
    dropout as a float on each attention module (and in the config, saved with every checkpoint),
    not as an nn.Dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for key, value in vars(model.config).items():
        if "dropout" in key and isinstance(value, float):
            setattr(model.config, key, 0.0)
    return model


# -----------------------------------------------------------------------------
# What --dtype means: the weights' dtype, and whether forward passes autocast to bf16


def weight_dtype(dtype, device=None):
    """The torch dtype to load the weights in for --dtype: "auto" is float32 on every device.

    device is accepted so that callers can pass what they pass to autocast(); it does not change
    the answer (on a GPU, "auto" gets its bf16 speed from autocast, not from bf16 weights).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def bf16_capable(capability):
    """Does a CUDA GPU of compute capability (major, minor) compute in bf16 in hardware? 8.0 and
    above (Ampere: A100, A10, RTX 30xx; Ada, Hopper). Below it (T4 7.5, V100 7.0) the tensor cores
    have no bf16, so bf16 autocast buys no speed there, yet torch.cuda.is_bf16_supported() says
    True: by default it counts emulation."""
    return tuple(capability) >= (8, 0)


def autocast_enabled(device, dtype, capability=None):
    """True when forward passes should run under bf16 autocast: --dtype auto on a CUDA device with
    bf16 hardware (bf16_capable). capability: the device's (major, minor); None asks torch for the
    requested device's (torch.device("cuda") is the current one), so that tests can decide without a
    GPU."""
    device = torch.device(device)
    if dtype != "auto" or device.type != "cuda":
        return False
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return bf16_capable(capability)


def autocast(device, dtype):
    """The context to run forward passes in for --dtype on device: bf16 autocast where
    autocast_enabled says so, else nothing (weights and activations stay in the weights' dtype)."""
    if autocast_enabled(device, dtype):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
