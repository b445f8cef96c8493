"""
Models: turn the --model argument of train.py and eval.py into (model, tokenizer). One function,
load_model, so that training and evaluation can never load a checkpoint in two different ways.

    load_model("tiny")                       # machinery/tiny.py's offline world, in out/tiny
    load_model("out/d3s-tiny/checkpoint")    # a folder by save_pretrained (or LoRA's adapters)
    load_model("Qwen2.5-Math-1.5B")          # a short name -> the hub id Qwen/Qwen2.5-Math-1.5B
    load_model("Qwen/Qwen2.5-0.5B-Instruct") # a hub id, as is
    disable_dropout(model)                   # [ours] a forward is a function of the weights alone
    with_lora(model, 16, "Qwen2.5-1.5B")     # --lora_rank 16: PEFT's LoRA adapters, the base frozen

The argument is read in this order: "tiny"; an existing folder; a short name from ALIASES; a hub id
("org/name"). Anything that cannot be loaded is a one-line ValueError that says what to do instead.

--dtype means the same in train.py and eval.py, through the helpers below:

    device = resolve_device("cuda")              # cuda:N: a CUDA device always with its index
    model, tok = load_model(name, device, dtype, lora=lora)  # weights in load_dtype(...)
    with autocast(device, dtype):                 # bf16 or float16 forward passes where they help
        ...generate, score, evaluate...
    scaler = grad_scaler(optimizer, device, dtype)  # float16 only: the gradient scaler

"auto" [ours]: float32 weights everywhere, and forward passes under autocast on a CUDA GPU: bf16 on
a GPU with bf16 hardware, compute capability 8.0 or more (A100, A10, L4, RTX 30xx/40xx, H100);
float16 on one without (a T4 or V100, which have float16 tensor cores but no bf16: bf16_capable),
with a gradient scaler; float32 on a CPU. "float16": float16 autocast and its scaler on any device,
the CPU included (where it is slow: it exists to test the T4's path). Training needs the float32
weights: bf16 has an 8-bit mantissa and rounds away most updates of size lr * grad ~ 1e-6.
Evaluation uses the same, so that eval.py and train.py's held-out accuracy run the same arithmetic
and give the same number (bit for bit on a CPU; on a GPU under autocast only up to the rounding
that changes with batch shape). "float32" and "bfloat16" load the weights in that dtype and never
autocast (bf16 weights halve the memory of a big model, at the cost of that rounding).

LoRA (--lora_rank r > 0, Hu et al. 2021): PEFT's adapters of rank r on every
linear layer of each decoder layer (LORA_TARGETS), the rest frozen. The frozen base never trains,
so on a GPU it is held in the autocast dtype (bf16, or float16 without bf16: what autocast would
cast it to at every forward anyway), in float32 on a CPU; the adapters, their gradients and AdamW's
moments in float32. The model stays PEFT's PeftModel: rollout.py, the sampler and eval.py use it as
any model. A LoRA checkpoint holds the adapters (adapter_config.json, adapter_model.safetensors)
and names its base, with a hash of a local base's files (pin_of), checked at every load; load_model
loads that base and puts the adapters on it, in the dtype train.py's run held it in (load_dtype).
A new LoRA run from a LoRA checkpoint keeps its adapters, frozen and on, under FROZEN names.
"""
import contextlib
import copy
import hashlib
import json
import os
import sys
import warnings

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


def load_model(name_or_path, device="auto", dtype="auto", cache_dir="out", lora=None):
    """(model, tokenizer) for "tiny", a local folder, a short name or a hub id, on `device` in
    `dtype`.

    device: resolve_device's ("auto", "cpu", "cuda", "cuda:1", ...). dtype: --dtype; the weights
    in load_dtype(...): "auto" and "float16" float32 (run forward passes inside autocast(device,
    dtype) for speed on a GPU), but the frozen base of LoRA adapters on a GPU in the autocast
    dtype; "float32", "bfloat16" or a torch.dtype as is. lora: will adapters sit on these weights
    (train.py: --lora_rank > 0)? None (eval.py): as the folder says. cache_dir: where "tiny"
    builds its model folder (cache_dir/tiny).
    """
    # per-shard "Loading weights" bars: noise on stderr, and around one-line errors
    hf_logging.disable_progress_bar()
    device = resolve_device(device)
    dtype = load_dtype(name_or_path, device, dtype, lora, cache_dir)
    source, is_folder = _resolve(str(name_or_path), cache_dir)
    if is_folder and os.path.isfile(os.path.join(source, ADAPTERS)):
        return _load_adapters(source, device, dtype, cache_dir)
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


def load_dtype(name_or_path, device="auto", dtype="auto", lora=None, cache_dir="out"):
    """The dtype load_model loads name_or_path's weights in, for train.py and eval.py alike:
    weight_dtype(dtype, device, lora), where lora None means "as the folder is": a LoRA checkpoint's
    base stays under its adapters (its autocast dtype on a GPU, as the run that trained it held it),
    and lora=False that they are merged into a base that trains (float32)."""
    if lora is None:
        source, is_folder = _resolve(str(name_or_path), cache_dir)
        lora = is_folder and os.path.isfile(os.path.join(source, ADAPTERS))
    return weight_dtype(dtype, resolve_device(device), lora)


def _resolve(name, cache_dir):
    """(folder or hub id to load from, whether it is a local folder)."""
    # a tiny world by name (tiny.WORLDS), built once
    if name == "tiny" or (name.startswith("tiny-") and not os.path.isdir(name)):
        from machinery import tiny  # imported here: only the tiny world needs it
        tiny.world(name)  # an unknown world is a one-line error
        return tiny.pretrained(os.path.join(cache_dir, name), name=name), True
    if os.path.isdir(name):
        if not any(os.path.isfile(os.path.join(name, f)) for f in ("config.json", ADAPTERS)):
            raise ValueError(f"model folder {name} has no config.json; pass a folder written by "
                             f"save_pretrained (config.json, weights, tokenizer files; or LoRA's "
                             f"{ADAPTERS}, its weights and tokenizer files)")
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


def as_device(device):
    """A torch.device of a device string, a torch.device or a CUDA index (torch.device(0) names
    the current accelerator, and there is none in a CPU build of torch)."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def resolve_device(device="auto"):
    """The torch.device of --device: "auto" (cuda if there is one, else cpu), "cpu", "cuda",
    "cuda:1", a torch.device or a CUDA index. A CUDA device always comes with its index ("cuda" is
    the current one, cuda:N): torch.cuda's functions refuse one without
    (get_per_process_memory_fraction), so the run names its device once, here. One that is not
    there is a one-line ValueError."""
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = as_device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; "
                         f"use auto, cpu, cuda or cuda:N") from None
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but torch sees no CUDA GPU; "
                         f"use --device cpu or auto")
    index, count = (torch.cuda.current_device() if device.index is None else device.index,
                    torch.cuda.device_count())
    if index >= count:
        raise ValueError(f"device={str(device)!r} but torch sees {count} CUDA GPU(s), cuda:0 to "
                         f"cuda:{count - 1}; pass one of them")
    return torch.device("cuda", index)


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
# LoRA: adapters on the frozen base, through PEFT (imported only when a run asks for them)

ADAPTERS = "adapter_config.json"  # what marks a folder of LoRA adapters (PEFT's save_pretrained)
# every linear layer of a decoder layer (Qwen2, Llama): LoRA Without Regret (Schulman et al. 2025)
# found attention-only adapters behind full fine-tuning, all layers level with it
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# [ours] LoRA Without Regret's fixed alpha = 32, PEFT's scale alpha / r: the best lr barely moves
# with the rank, so one --lr serves every --lora_rank
LORA_ALPHA = 32


def _peft(why):
    try:
        import peft
    except ImportError:
        raise ValueError(f"{why} needs peft: pip install peft") from None
    return peft


def is_lora(model):
    """Is the model PEFT's, with adapters? (No PeftModel exists before peft is imported.)"""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def with_lora(model, rank, base, seed=0):
    """The model a fresh run trains. rank 0: every weight trains, and a LoRA checkpoint passed as
    --model has its adapters merged into its base first (loaded in float32 for this: lora=False).
    rank > 0: fresh adapters of that rank, the rest frozen; a LoRA checkpoint's own adapters stay
    on, frozen, renamed FROZEN + n [ours: the run starts from that policy, and its KL reference is
    that policy too]. Why not merged: its base is held in bf16 on a GPU, which keeps 8 bits of a
    weight, and a trained update of W is far smaller than its rounding step, so most of it would
    round away; a float32 copy of the base to merge into would double its memory, and a new run
    should fit the card its checkpoint was trained on. base: the --model argument; a checkpoint's
    adapter_config.json names the base its adapters belong to (a LoRA checkpoint's own base), with
    the pin of a local one (pin_of, as `revision`). PEFT initialises B = 0, so the policy starts
    exactly as the model given, and A at random: [ours] from `seed` (--seed), not from whatever
    torch's generator holds, so that one seed gives one run."""
    if is_lora(model) and rank == 0:  # W + (alpha / r) B A, once; every weight trains again
        return model.merge_and_unload().requires_grad_(True)
    if rank == 0:
        return model
    peft = _peft("--lora_rank")
    # task_type: PEFT's causal-LM wrapper, whose generate hands it the generation_config that the
    # sampler sets (machinery/sampling.py), not the checkpoint's
    config = peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                             target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    if is_lora(model):  # the base and pin its adapters were trained on
        named = model.peft_config["default"]
        base, pin = named.base_model_name_or_path, named.revision
    else:
        source, is_folder = _resolve(str(base), "out")
        base, pin = (os.path.abspath(source), pin_of(source)) if is_folder else (source, None)
    with quiet(), torch.random.fork_rng(devices=[]):  # PEFT draws A on the CPU, then moves it
        if is_lora(model):
            frozen = _freeze(model)
            torch.manual_seed(seed)
            model.add_adapter("default", config)  # float32, on the base's device
            _stack(model, frozen)
        else:
            torch.manual_seed(seed)
            model = peft.get_peft_model(model, config)  # the adapters in float32 on a bf16 base
    model.peft_config["default"].base_model_name_or_path = base  # absolute: a run folder moves
    model.peft_config["default"].revision = pin
    return model


# [ours] The adapters of a LoRA checkpoint that a new LoRA run keeps on, frozen: frozen1, frozen2...
# (PEFT saves each beside the trainable "default" ones, in a folder of its name).
FROZEN = "frozen"


def _frozen(model):
    """The FROZEN adapters' names, in the order they were frozen."""
    names = [n for n in model.peft_config if n.startswith(FROZEN) and n[len(FROZEN):].isdigit()]
    return sorted(names, key=lambda n: int(n[len(FROZEN):]))


def _freeze(model):
    """Rename the trainable adapters ("default") to the next FROZEN name, bit for bit; -> every
    FROZEN name."""
    peft = sys.modules["peft"]
    name = f"{FROZEN}{len(_frozen(model)) + 1}"
    weights = peft.get_peft_model_state_dict(model, adapter_name="default")
    model.add_adapter(name, copy.deepcopy(model.peft_config["default"]))
    peft.set_peft_model_state_dict(model, weights, adapter_name=name)
    model.delete_adapter("default")
    return _frozen(model)


def _stack(model, frozen):
    """Every adapter on, the FROZEN ones first (one order of the sums, on every load); only
    "default" trains."""
    if frozen:
        model.base_model.set_adapter([*frozen, "default"])
        model.set_requires_grad(frozen, False)


@contextlib.contextmanager
def quiet():
    """[ours] PEFT 0.21 asks transformers 5 a question it deprecated (is_gradient_checkpointing):
    a FutureWarning on every run, noise to whoever runs it; and _freeze deletes the active adapter
    on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        warnings.filterwarnings("ignore", "Adapter default was active which is now deleted")
        yield


def pin_of(folder):
    """[ours] A local model folder's content, as "sha256:HEX" of its config and weight files (names
    and bytes): a LoRA checkpoint records its base's, and every load checks it, because a folder can
    change under the adapters (a run folder's checkpoint, resumed or overwritten) and adapters on
    other weights load without an error. Hashing reads the weights once more, at each load;
    a hub id is not pinned."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name in ("config.json", ADAPTERS) or name.endswith((".safetensors", ".bin")):
            digest.update(name.encode() + b"\0")
            with open(os.path.join(folder, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
    return "sha256:" + digest.hexdigest()


def _load_adapters(folder, device, dtype, cache_dir):
    """A folder of LoRA adapters: the base it names (loaded as --model would be, its own adapters
    merged in, if it is a LoRA checkpoint too; checked against its pin), then these adapters on it,
    trainable (a resumed run trains them on), and the FROZEN ones it keeps, on and frozen."""
    peft = _peft(f"{folder} holds LoRA adapters: loading them")
    with open(os.path.join(folder, ADAPTERS)) as f:
        saved = json.load(f)
    base, pin = saved.get("base_model_name_or_path"), saved.get("revision")
    if not base:
        raise ValueError(f"{folder}/{ADAPTERS} names no base model (base_model_name_or_path); "
                         f"set it to the folder or hub id the adapters were trained on")
    try:
        model = with_lora(load_model(base, device, dtype, cache_dir)[0], 0, base)
        source, is_folder = _resolve(base, cache_dir)
    except ValueError as e:
        raise ValueError(f"the base model of the LoRA adapters in {folder}: {e}") from None
    if pin and is_folder and pin_of(source) != pin:
        raise ValueError(f"the LoRA adapters in {folder} were trained on {base}, whose weights "
                         f"have changed since ({pin[:19]}... in {ADAPTERS}, "
                         f"{pin_of(source)[:19]}... now); put those weights back there, or point "
                         f"base_model_name_or_path at a copy of them")
    frozen = [n for n in sorted(os.listdir(folder)) if n.startswith(FROZEN)
              and os.path.isfile(os.path.join(folder, n, ADAPTERS))]
    with quiet():  # onto the run's device (else PEFT's guess: the current CUDA device)
        model = peft.PeftModel.from_pretrained(model, folder, is_trainable=True,
                                               torch_device=str(device))
        for name in frozen:
            model.load_adapter(os.path.join(folder, name), adapter_name=name,
                               torch_device=str(device))
    _stack(model, _frozen(model))
    return model.to(device), AutoTokenizer.from_pretrained(folder)


def reference_model(model, cfg, device):
    """The frozen initial policy of the KL term, or None without one (--beta 0). With LoRA the
    policy itself: train.backward runs it inside adapters_off, which leaves the model it started
    from, with no second copy. Else a second copy of --model, loaded as the policy was (a LoRA
    checkpoint's adapters merged into its float32 base)."""
    if cfg.beta == 0:
        return None
    if is_lora(model):
        return model
    ref = with_lora(load_model(cfg.model, device, cfg.dtype, lora=False)[0], 0, cfg.model)
    return ref.eval().requires_grad_(False)


@contextlib.contextmanager
def adapters_off(model):
    """The context in which a LoRA policy computes as the model its run started from: its base
    (PEFT's disable_adapter), with any FROZEN adapters still on; nothing for any other model."""
    frozen = _frozen(model) if is_lora(model) else []
    if not is_lora(model):
        yield
    elif not frozen:
        with model.disable_adapter():
            yield
    else:  # only the trainable ones off; their requires_grad comes back before any backward
        model.base_model.set_adapter(frozen, inference_mode=True)
        try:
            yield
        finally:
            _stack(model, frozen)


# -----------------------------------------------------------------------------
# What --dtype means: the weights' dtype, the autocast dtype of forward passes, the gradient scaler


def weight_dtype(dtype, device=None, lora=False):
    """The torch dtype to load the weights in for --dtype on device: "auto" and "float16" are
    float32 (the master weights that train: autocast gets the speed), except a LoRA base on a GPU
    (lora=True), which never trains: the autocast dtype (bf16, or float16 on a GPU without bf16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype={dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    if dtype in ("auto", "float16"):
        if lora and device is not None and as_device(device).type == "cuda":
            return autocast_dtype(device, dtype)
        return torch.float32
    return DTYPES[dtype]


def bf16_capable(capability):
    """Does a CUDA GPU of compute capability (major, minor) compute in bf16 in hardware? 8.0 and
    above (Ampere: A100, A10, RTX 30xx; Ada, Hopper). Below it (T4 7.5, V100 7.0) the tensor cores
    have no bf16, so bf16 autocast buys no speed there, yet torch.cuda.is_bf16_supported() says
    True: by default it counts emulation."""
    return tuple(capability) >= (8, 0)


def autocast_dtype(device, dtype, capability=None):
    """The dtype forward passes autocast to for --dtype on device, or None: "float16" anywhere;
    "auto" on a CUDA device, bf16 with bf16 hardware (bf16_capable), else float16. capability: the
    device's (major, minor); None asks torch for the requested device's (torch.device("cuda") is the
    current one), so that tests can decide without a GPU."""
    device = as_device(device)
    if dtype == "float16":
        return torch.float16
    if dtype != "auto" or device.type != "cuda":
        return None
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if bf16_capable(capability) else torch.float16


def autocast_enabled(device, dtype, capability=None):
    """True when forward passes run under autocast (autocast_dtype is not None)."""
    return autocast_dtype(device, dtype, capability) is not None


def autocast(device, dtype):
    """The context to run forward passes in for --dtype on device: autocast to autocast_dtype, or
    nothing (weights and activations stay in the weights' dtype)."""
    cast = autocast_dtype(device, dtype)
    if cast is None:
        return contextlib.nullcontext()
    return torch.autocast(as_device(device).type, dtype=cast)


def grad_scaler(optimizer, device, dtype):
    """torch.amp.GradScaler for float16 autocast; off (every call a no-op) otherwise. float16's
    5-bit exponent flushes a gradient below 6e-8 to 0, so backward runs on the loss times a scale
    (2**16 at first), train.optimizer_step divides it out before the clip, and a step whose scaled
    gradient overflowed to inf or NaN is skipped and the scale halved (torch's AMP recipe; bf16 has
    float32's exponent and needs none). [ours] The scale rides in the optimizer's state_dict, so
    trainer.pt holds it and a resumed run continues with the same scale."""
    device = as_device(device)
    scaler = torch.amp.GradScaler(device.type,
                                  enabled=autocast_dtype(device, dtype) == torch.float16)
    if scaler.is_enabled():
        def load_scale(opt, state):  # a copy of trainer.pt's: the scale is taken off it
            if "scaler" in state:  # (a checkpoint of a run without float16 has none)
                scaler.load_state_dict(state.pop("scaler"))
        optimizer.register_state_dict_post_hook(
            lambda opt, state: {**state, "scaler": scaler.state_dict()})
        optimizer.register_load_state_dict_pre_hook(load_scale)
    return scaler
