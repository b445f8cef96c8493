"""
The machinery beneath rollout.py's decode loop (step 1), in the order a token flows: the random
numbers; the decode step (each prompt prefilled once into a static KV cache, then one token at a
time through the decoder, an attention that reads each cached key and value once, the lm_head and
the sampler); the weights it reads; what only a GPU needs (the step compiled with CUDA graphs over
caches kept for the run); and transformers' `generate`, the reference engine the loop is tested
against. rollout.py reads as the algorithm; this file is why its samples are the policy's, the
same however they are batched, and fast.

[ours] Sampling is exactly softmax(logits / T), whatever the checkpoint's generation_config.json
says. The loop calls the decoder and the lm_head itself, so nothing of a checkpoint's configuration
can reach it. `generate` (the hf engine) runs from a configuration built here that holds only what
rollouts need (the token budget, the stop and pad ids, greedy or not); transformers fills every
field we leave unset from model.generation_config (GenerationMixin._prepare_generation_config), so
while generating (generation_mode), model.generation_config is a blank GenerationConfig: nothing of
the checkpoint's (Qwen2.5 instruct ships top_k=20 and repetition_penalty=1.05; others suppress
tokens, force an EOS at the last position, set a min_length, a max_time, stop strings, beams...) can
reach the logits or the stopping rule (a test checks the exact processor list generate builds).
This matters because the policy gradient scores the samples with softmax(logits / T) alone
(rollout.head_logprobs): a different sampler would make the rollouts off-policy without saying so,
and a forced EOS would put a token the policy never sampled into the loss and hide a truncation.
Greedy decoding (temperature 0) is the argmax of the raw logits. eval.py's top_p < 1 uses
generate's own sampler with our temperature and top_p and nothing else (top_k=0: transformers' own
default is 50). NaN or inf logits are an error in every mode but that one (NonFiniteLogits).

[ours] What is exact, and what is equal up to rounding. Exact, on any device: the random numbers
(the uniform of row r of a call, counted over all its rows group by group, at decode position t is
a counter-based hash, splitmix64, of (seed, r, t), so it is the same whatever batch_size splits the
rows, whatever the engine, whatever else draws random numbers; seed=None draws one seed from
torch's global generator per call, so torch.manual_seed still makes a run reproducible), and the
sampler as a function of the logits (a row's token and entropy depend on its logits and its key
alone). Equal up to rounding: the logits, and so the tokens. Another engine, batch or cache length
sums the forward in another order, a few ulps apart, and a token differs where its uniform falls
within that rounding of an edge of the cumulative distribution (the rest of its row with it). The
tests' tiny models, in float32 on a CPU, put no uniform that close, and the engines agree token for
token there; a pretrained model's flat tail or a random model of the real vocabulary (each token
~7e-6 of the mass) meets an edge now and then; bf16 kernels on a GPU, which change with the batch's
shape, more often.

[ours] The sampler (sample) records, at every decode step, the entropy of the distribution it
samples from, softmax(logits / T) over the full vocabulary: the step line logs it, and token
selection scores it (train.py's step 5: no forward runs for selection alone). The cached decode
computes the same function as the training forward in another order of floating-point operations
(tests/test_updates.py bounds the gap in float32). Under bf16 autocast (--dtype auto on a GPU) they
differ by more: the decode runs in bf16, and so does its lm_head, where head_logprobs runs the head
in float32 (docs/algorithm.md, "The entropy's arithmetic", counts the selected tokens it moves).
"""
import math
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import (AttentionInterface, DynamicCache, GenerationConfig, LogitsProcessor,
                          LogitsProcessorList, StaticCache, StoppingCriteriaList)

from machinery.memory import is_out_of_memory

ENGINES = ("loop", "hf")  # --generation: rollout.py's decode loop, transformers' generate

# -----------------------------------------------------------------------------
# random numbers: one uniform per (seed, row, decode position)

# [ours] splitmix64 (Steele, Lea and Flood 2014; the generator behind Java's SplittableRandom) in
# int64 tensor arithmetic, so one call hashes every row at once on the CPU or a GPU. torch's int64 +
# and * wrap modulo 2**64 exactly like the uint64 original; constants above 2**63 are written as the
# int64 with the same bits.
GOLDEN = 0x9E3779B97F4A7C15 - 2 ** 64  # the stream's increment (2**64 / golden ratio, odd)
MIX1 = 0xBF58476D1CE4E5B9 - 2 ** 64
MIX2 = 0x94D049BB133111EB - 2 ** 64


def _int64(n):
    """The Python int n reduced modulo 2**64 to the int64 with the same low 64 bits."""
    n %= 2 ** 64
    return n - 2 ** 64 if n >= 2 ** 63 else n


def _shr(x, s):
    """Logical right shift of an int64 tensor: torch's >> is arithmetic (it copies the sign bit), so
    the top s bits are masked off."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x):
    """The splitmix64 finaliser of every int64 in x: a bijection of 64-bit words in which every
    output bit depends on every input bit."""
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def row_keys(seed, rows):
    """(b,) int64: the key of each row in rows (b,) long, hashed from (seed, row): the start of the
    row's splitmix64 stream, built once per call of either engine."""
    # a copy to the device
    seed = splitmix64(torch.tensor(_int64(seed), dtype=torch.long, device=rows.device))
    return splitmix64(seed + rows * GOLDEN)


def stream_uniforms(keys, t):
    """(b,) float64 in [0, 1): the t-th number of each row's stream (keys from row_keys), with
    53 random bits, as many as a float64 holds. t: a Python int (no copy to the device) or an int64
    tensor (the compiled step's, so that a new t is no new graph), which wraps the same way."""
    step = _int64((t + 1) * GOLDEN) if isinstance(t, int) else (t + 1) * GOLDEN
    bits = splitmix64(keys + step)  # (b,) the row's stream at position t
    return _shr(bits, 11).double() * 2.0 ** -53  # top 53 bits: an exact float64, never 1.0


def uniforms(seed, rows, t):
    """(b,) float64 in [0, 1): the uniform number of each row in rows (b,) long at decode position
    t, a pure function of (seed, row, t): the t-th number of the splitmix64 stream started at a key
    hashed from (seed, row)."""
    return stream_uniforms(row_keys(seed, rows), t)


def draw_seed():
    """A seed drawn from torch's global generator (CPU): torch.manual_seed makes it reproducible."""
    return int(torch.randint(2 ** 63 - 1, ()))


# -----------------------------------------------------------------------------
# the decode step, in the order a token flows (rollout.decode is the loop around it)

def prefill(model, prompt_ids, prompt_mask, prompt_of, cache, new_tokens):
    """Each prompt of (n, P) once through the decoder, its keys and values copied to its rows
    prompt_of (R,) of the static `cache`, at the right end of the cache's first L - new_tokens
    columns (a kept cache's may be more than P: masked). -> pad (R, L) bool, the columns a row may
    attend to but for causality (its prompt's real tokens, every new one); last (R,), each row's
    last prompt position; hidden (R, H), its last hidden state, from which token 0 is drawn."""
    P, L = prompt_ids.shape[1], cache.layers[0].max_cache_len
    W = L - new_tokens  # the first new token's column
    positions = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (n, P) as generate derives them
    kv = DynamicCache(config=model.config)
    hidden = model.get_decoder()(input_ids=prompt_ids, attention_mask=prompt_mask,
                                 position_ids=positions, cache=kv, use_cache=True)
    for static, layer in zip(cache.layers, kv.layers):
        static.keys[:, :, W - P:W] = layer.keys[prompt_of]  # (R, kv_heads, P, head_dim)
        static.values[:, :, W - P:W] = layer.values[prompt_of]
        static.cumulative_length.fill_(W)  # where the next key goes
    mask = prompt_mask[prompt_of].bool()  # (R, P)
    pad = torch.cat([mask.new_zeros(len(mask), W - P), mask, mask.new_ones(len(mask), new_tokens)],
                    dim=1)  # (R, L)
    return pad, positions[prompt_of, -1], hidden.last_hidden_state[prompt_of, -1]


def one_token(model, cache, pad, token, last, keys, t, temperature):
    """Decode position t: the tokens (R,) drawn at t - 1 through the decoder, their keys and values
    written to the cache's next column, then the lm_head and the sampler -> (token, entropy, bad)
    at t. The function a GPU compiles whole; run inside gqa_decoding (its attention)."""
    column = cache.layers[0].cumulative_length  # () the new token's column
    mask = pad & (torch.arange(pad.shape[1], device=pad.device) <= column)  # (R, L) pad, causality
    hidden = model.get_decoder()(input_ids=token[:, None], attention_mask=mask[:, None, None],
                                 position_ids=(last + t)[:, None], cache=cache, use_cache=True)
    return sample(head_logits(model, hidden.last_hidden_state[:, -1]), keys, t, temperature)


def gqa_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Each row's one new query (R, heads, 1, d) against the cache's keys and values (R, kv_heads,
    L, d) under attention_mask (R, 1, 1, L) bool -> (R, 1, heads, d). [ours] The g = heads /
    kv_heads query heads that share a KV head are taken as its g queries, so every cached key and
    value is read once (transformers' SDPA does the same eagerly but under torch.compile repeats K
    and V g times over all L columns: 7x the cache's traffic for Qwen2.5-0.5B)."""
    R, heads, _, d = query.shape
    out = F.scaled_dot_product_attention(query.reshape(R, key.shape[1], -1, d), key, value,
                                         attn_mask=attention_mask, scale=scaling)  # (R, kv, g, d)
    return out.reshape(R, 1, heads, d), None


AttentionInterface.register("gqa_decode", gqa_attention)


@contextmanager
def gqa_decoding(model):
    """The model's attention is gqa_attention while the loop decodes (the prefill keeps its own)."""
    config, before = model.config, model.config._attn_implementation
    config._attn_implementation = "gqa_decode"
    try:
        yield
    finally:
        config._attn_implementation = before


def head_logits(model, hidden):
    """The logits (R, V) of the last hidden states (R, H), by the lm_head in its compute dtype
    (under autocast its weight's copy in that dtype: decode_weights). On a CPU, eagerly, into one
    (R, V) buffer kept while generating: there a fresh tensor of that size cost as much in page
    faults as the matmul itself."""
    head = model.get_output_embeddings()
    weight = getattr(head, "decode_weight", head.weight)  # (V, H)
    hidden = hidden.to(weight.dtype)
    if head.bias is not None or hidden.device.type != "cpu" or torch.compiler.is_compiling() \
            or torch.is_autocast_enabled("cpu"):
        return F.linear(hidden, weight, head.bias)
    shape = (hidden.shape[0], weight.shape[0])
    if _buffer.get("logits") is None or _buffer["logits"].shape != shape:
        _buffer["logits"] = hidden.new_empty(shape)
    return torch.mm(hidden, weight.t(), out=_buffer["logits"])


BLOCK = 128  # [ours] tokens per block of the two-level inverse CDF
CHUNK_VALUES = 2 ** 20  # [ours] on a CPU, rows x V per pass: a chunk's float32 temporaries (4 MB)
                        # stay in the cache, where the (256, 151,936) ones went to memory each time
FLOOR = -200.0  # a -inf logit becomes this: exp() is 0 in float32 from -104 on, and 0 * FLOOR is
                # 0 where 0 * -inf would be NaN in the entropy's sum


def sample(logits, keys, t, temperature):
    """Each row's next token, drawn from exactly softmax(logits / T), a pure function of the logits
    (b, V) and (row key, t), which it overwrites (both engines own theirs: no copy of (b, V)): ->
    token (b,) long, entropy (b,) float32 of that distribution, bad (b,) bool, True where the
    logits hold a NaN or +inf or are all -inf (no distribution: the token is then meaningless).
    temperature 0 is the argmax (entropy 0, bad the same way).
    [ours] The draw is an inverse CDF in two levels: a block of BLOCK tokens by the float64
    cumulative sum of the block sums, then a token by the float64 cumulative sum within that block,
    where one float64 cumulative sum over all V tokens cost most of a decode step on a CPU. The
    uniform u of (key, t) picks the token whose cumulative mass first exceeds u times the total:
    the same distribution, and a token may differ from a one-level search where u falls within a
    float rounding of a block's edge. The entropy is log Z - E[z - max z], with z = logits / T and
    Z = sum exp(z - max z): H = -sum p log p from one pass of exp."""
    (b, V), u = logits.shape, stream_uniforms(keys, t) if temperature > 0 else None
    if logits.device.type != "cpu" or torch.compiler.is_compiling():  # a compiler fuses the passes
        return _draw(logits.float(), u, temperature)
    rows = max(1, CHUNK_VALUES // V)  # an eager CPU: chunks of rows
    parts = [_draw(logits[s:s + rows].float(), None if u is None else u[s:s + rows], temperature)
             for s in range(0, b, rows)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _draw(z, u, temperature):
    """sample on one chunk of rows: logits z (c, V) float32 (overwritten), uniforms u (c,)."""
    c, V = z.shape
    if temperature == 0:  # greedy; no distribution where the max is NaN, +inf or -inf
        return z.argmax(dim=-1), z.new_zeros(c), ~torch.isfinite(z.amax(dim=-1))
    d = z.sub_(z.amax(dim=-1, keepdim=True))  # (c, V) <= 0: NaN if a logit is NaN or +inf, or all
    if temperature != 1:                      # are -inf
        d.div_(temperature)
    d = d.clamp_(min=FLOOR)  # NaN stays NaN
    if V % BLOCK:
        d = F.pad(d, (0, -V % BLOCK), value=FLOOR)  # (c, nb * BLOCK)
    e = d.exp()  # (c, nb * BLOCK) exp(z - max z): the probabilities times Z
    blocks = e.view(c, -1, BLOCK)  # (c, nb, BLOCK)
    sums = blocks.sum(dim=-1)  # (c, nb) float32
    total = sums.sum(dim=-1)  # (c,) Z
    entropy = total.log() - d.mul_(e).sum(dim=-1) / total  # (c,) log Z - E[z - max z]
    mass = F.pad(sums.double().cumsum(dim=-1), (1, 0))  # (c, nb + 1) the mass before block j
    target = u * mass[:, -1]  # (c,) in [0, Z): u never reaches 1
    j = torch.searchsorted(mass[:, 1:].contiguous(), target[:, None], side="right")
    j = j.clamp_(max=blocks.shape[1] - 1)  # (c, 1) the block whose mass first exceeds the target
    lo, hi = mass.gather(1, j), mass.gather(1, j + 1)  # (c, 1)
    w = ((target[:, None] - lo) / (hi - lo)).clamp_(0, 1 - 2 ** -53)  # (c, 1) where in that block
    inner = blocks.gather(1, j[:, :, None].expand(c, 1, BLOCK))[:, 0].double().cumsum(dim=-1)
    last = inner[:, -1:].contiguous()  # (c, 1) the block's mass, in its own rounding
    k = torch.minimum(torch.searchsorted(inner, w * last, side="right"),  # never past the block's
                      torch.searchsorted(inner, last, side="left"))  # last token of p > 0
    token = (j * BLOCK + k)[:, 0].clamp_(max=V - 1)  # (c,)
    return token, entropy, ~torch.isfinite(total)


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or inf logits while generating: its weights have most likely
    diverged."""


def first_bad(first, bad, t):
    """(b,) long: each row's first decode position with no distribution (sample's bad), -1 if none
    yet; updated on the device, read once after the call (check_finite)."""
    return torch.where(bad & (first < 0), t, first)


def check_finite(first, first_row):
    """Raise NonFiniteLogits if a row had NaN or inf logits at some decode step (first: first_bad's
    marks of the rows first_row, first_row + 1, ...): one read from the device, after the call."""
    bad = [(t, first_row + i) for i, t in enumerate(first.tolist()) if t >= 0]
    if bad:
        t, row = min(bad)
        raise NonFiniteLogits(
            f"the model produced NaN or inf logits while generating (in {len(bad)} of "
            f"{len(first)} rows; first at decode position {t} of row {row}): its weights have "
            f"probably diverged")


# -----------------------------------------------------------------------------
# the weights the decode reads: under autocast, a copy in the compute dtype held for the run

_copies = WeakIdKeyDictionary()  # parameter -> its copy in the autocast dtype
_buffer = {}  # head_logits' (R, V) logits on a CPU, while generating


def decode_weights(model, device):
    """Under autocast (--dtype auto on a GPU: float32 master weights), the weights of every
    nn.Linear (LoRA's adapters included) as copies in the autocast dtype, refreshed from the
    masters once per generation call and swapped in for it (a Parameter's .data), the lm_head's as
    head.decode_weight (tied, its Parameter is also the embedding's, which stays float32): the
    decode then reads each weight once per token, where autocast casts every one at every step of
    a compiled graph (its cache does not reach into one). The same bf16 values autocast's casts
    give, so the same tokens. The copies are kept at fixed addresses for the run (CUDA graphs replay
    on them; machinery/memory.py counts them). -> a function that swaps the masters back."""
    if not torch.is_autocast_enabled(device.type):
        return lambda: None
    dtype, head = torch.get_autocast_dtype(device.type), model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = [p for m in linears for p in m.parameters(recurse=False)
              if p.dtype != dtype]  # a LoRA base is held in the compute dtype already
    for p in params:  # every copy first: out of memory here has swapped nothing
        if p not in _copies:
            _copies[p] = torch.empty_like(p, dtype=dtype, requires_grad=False)
            torch._dynamo.mark_static_address(_copies[p])
        _copies[p].copy_(p.detach())
    masters = {p: p.data for p in params if p is not head.weight}
    for p in masters:
        p.data = _copies[p]
    if any(p is head.weight for p in params):
        head.decode_weight = _copies[head.weight]

    def restore():
        for p, master in masters.items():
            p.data = master
        if "decode_weight" in vars(head):
            del head.decode_weight
    return restore


# -----------------------------------------------------------------------------
# on a GPU: the step compiled with CUDA graphs, over KV caches kept for the run

# How the decode step is compiled: "auto" on a GPU only (mode "reduce-overhead": CUDA graphs, as
# gpt-fast), "off" never, or a torch.compile backend ("eager", "aot_eager") on any device: the tests
# trace it on a CPU. [ours] Nothing is compiled on a CPU by default: with "inductor" there, the step
# of experiments/bench_decode.py's real world took 200 s to compile and decoded 2.5x slower
# (experiments/speed.md).
COMPILE = "auto"
SYNC_EVERY = 32  # on a GPU, decode steps between the loop's "all stopped?" checks (a host sync)
MIN_WIDTH = 64  # [ours] a kept cache's prompt columns: the widest prompt so far rounded up to a
                # power of two, at least this (GSM8K's prompts, 240 tokens at most, all fit 256)
# What that costs. dynamo compiles one graph for greedy decoding and one for sampling, each at its
# kept cache's shape; a cache rebuilt at another shape is one more compile, with the sizes that
# changed made symbolic (automatic dynamic shapes), whose graph then serves every later size. A GPU
# records a CUDA graph of each, and records again whenever a static input (a weight, a cache)
# moves or a size changes: here only a new cache does. counters() has each count.
_kept = {}  # "greedy" (evaluation) and "sampled" (step 1) calls' caches: one object if alike
_compiled, _failed, _recording = {}, [], []
COUNTS = {"compiles": 0, "cudagraph_records": 0, "caches": 0, "skips_before": 0}


def static_cache(model, rows, width, new_tokens, greedy):
    """The static KV cache for a call of `rows` rows, prompts of `width` columns and new_tokens, in
    the dtype of the keys and values: a new one of width + new_tokens columns, or with the step
    compiled, the one kept for greedy (evaluation) or sampled (step 1) calls, zeroed. A kept cache
    holds at least the call's rows (fill_rows copies its last row into the others) and its prompt
    width, rounded up to a power of two; greedy and sampled calls of as many rows share one. A call
    that needs more builds a larger one (counted); out of memory drops them (generation_mode)."""
    device = next(model.parameters()).device
    dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
             else model.get_output_embeddings().weight.dtype)  # what k_proj and v_proj give
    need = (rows, width + new_tokens, dtype, device)
    if _backend(device) is None:
        return _static_cache(model, *need)
    name, other = ("greedy", "sampled") if greedy else ("sampled", "greedy")
    if not _holds(_kept.get(name), *need):
        if _holds(_kept.get(other), *need) and _rows(_kept[other]) == rows:
            _kept[name] = _kept[other]
        else:  # a larger one; the old goes first, so that two are never held at once
            old = _kept.pop(name, None)
            rows = max(rows, 0 if old is None else _rows(old))
            width = max(width, 0 if old is None else old.layers[0].max_cache_len - new_tokens,
                        MIN_WIDTH)
            shared = old is not None and _kept.get(other) is old and _rows(old) == rows
            if shared:  # the other kind's calls move to the new one with this one
                del _kept[other]
            del old
            _kept[name] = _static_cache(model, rows, 2 ** math.ceil(math.log2(width)) + new_tokens,
                                        dtype, device)
            _kept.update({other: _kept[name]} if shared else {})
            COUNTS["caches"] += 1
    _kept[name].reset()  # zeros: a masked column must hold no NaN of an earlier call
    return _kept[name]


def _static_cache(model, rows, columns, dtype, device):
    """A new StaticCache of rows x columns, every layer's keys and values allocated (zeros) and
    marked as static addresses (transformers does, for CUDA graphs)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = StaticCache(config=c, max_cache_len=columns)
    cache.early_initialization(rows, c.num_key_value_heads, head_dim, dtype, device)
    return cache


def _rows(cache):
    return cache.layers[0].keys.shape[0]


def _holds(cache, rows, columns, dtype, device):
    keys = None if cache is None else cache.layers[0].keys
    return keys is not None and keys.shape[0] >= rows and keys.shape[2] >= columns and \
        keys.dtype == dtype and keys.device == device


def fill_rows(x, cache):
    """x (b, ...) followed by copies of its last row up to the cache's rows (None stays None): a
    kept cache's rows beyond a call's decode copies of its last, which stop when it does."""
    extra = 0 if x is None else _rows(cache) - len(x)
    return x if not extra else torch.cat([x, x[-1:].expand(extra, *x.shape[1:])])


def decode_step(model, new_tokens):
    """one_token as the loop calls it: eager, or compiled (COMPILE; on a GPU with CUDA graphs) with
    its compiles counted; should compiling fail, one line says so and the run decodes on eagerly."""
    device = next(model.parameters()).device
    backend = _backend(device)
    if backend is None:
        return one_token
    clock = torch.zeros((), dtype=torch.long, device=device)  # t, filled in place: no graph per t

    def step(model, cache, pad, token, last, keys, t, temperature):
        args = (model, cache, pad, token, last, keys, clock.fill_(t), temperature)
        if _failed:
            return one_token(*args)
        before, t0 = _graphs(), time.time()
        try:
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are read
            out = tuple(x.clone() for x in _compiled_step(backend)(*args))  # a replay reuses them
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # the run goes on, eager
            _failed.append(e)
            print(f"decode step: compiling failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                  f"decoding on without compiling", file=sys.stderr, flush=True)
            for layer in cache.layers:  # a failed call may have written its column
                layer.cumulative_length.fill_(cache.layers[0].max_cache_len - new_tokens + t - 1)
            return one_token(*args)
        if _graphs() > before:
            COUNTS["compiles"] += _graphs() - before
            print(f"decode step: compiled for {len(token)} rows x {pad.shape[1]} columns in "
                  f"{time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        return out
    return step


def _backend(device):
    """The torch.compile backend of the decode step on device, or None: eager."""
    if _failed or COMPILE == "off" or COMPILE == "auto" and device.type != "cuda":
        return None
    return "reduce-overhead" if COMPILE == "auto" else COMPILE


def _compiled_step(backend):
    """one_token compiled whole (fullgraph: a graph break is an error), once per backend."""
    if backend not in _compiled:
        how = {"mode": backend} if backend == "reduce-overhead" else {"backend": backend}
        _compiled[backend] = torch.compile(one_token, fullgraph=True, **how)
        if backend == "reduce-overhead" and not _recording:
            _count_recordings()
    return _compiled[backend]


def _count_recordings():
    """Count each CUDA-graph recording (a graph's first, and every re-record) from dynamo's compile
    callbacks, once a process; a torch without them leaves the count None (not reported)."""
    _recording.append(True)
    try:
        from torch._dynamo.callback import CallbackTrigger, on_compile_start
    except ImportError:
        COUNTS["cudagraph_records"] = None
        return

    def count(args):
        if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
            COUNTS["cudagraph_records"] += 1
    on_compile_start(count)


def _graphs():
    """torch's count of the graphs dynamo has compiled in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _skips():
    """torch's count of the times inductor ran a graph without CUDA graphs, in this process."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def counters():
    """What the decode step has cost in this process (since reset()), for the step's log row:
    graphs dynamo compiled, CUDA-graph recordings (None: this torch does not report them), graphs
    run without CUDA graphs (torch's cudagraph_skips), KV caches built to keep."""
    return {"decode_compiles": COUNTS["compiles"],
            "decode_cudagraph_records": COUNTS["cudagraph_records"],
            "decode_cudagraph_skips": _skips() - COUNTS["skips_before"],
            "decode_caches": COUNTS["caches"]}


def compile_failures():
    """The errors that turned compiling the decode step off in this process (one line said each)."""
    return list(_failed)


def reset():
    """The decode step as a new process has it: nothing compiled, no failure, no kept cache or
    weight copy, counts from 0 (for a script that runs several train.py runs in one process:
    experiments/gpu_check.py)."""
    if _compiled or _failed:
        torch.compiler.reset()
    COUNTS.update(compiles=0, caches=0, skips_before=_skips(),
                  cudagraph_records=None if COUNTS["cudagraph_records"] is None else 0)
    for kept in (_kept, _compiled, _copies, _buffer):
        kept.clear()
    _failed.clear()


# -----------------------------------------------------------------------------
# the reference engine: transformers' generate, with the same sampler

class Sampler(LogitsProcessor):
    """sample() as generate's logits processor: it draws the token, records the entropy and marks
    the rows with no distribution (check_finite() reads the marks once, after generate), and returns
    0 at the drawn token and -inf elsewhere, over which generate then decodes greedily. It runs with
    the blank configuration of generation_mode, so no processor of its own runs before this one and
    the scores here are the raw logits. Row i of the call is row first_row + i of the whole batch;
    its stream key is built at the first decode step, on the logits' device. Greedy (temperature 0)
    is its argmax, so that NaN or inf logits are an error there too."""

    def __init__(self, temperature, seed, first_row=0):
        self.temperature, self.seed, self.first_row = temperature, seed, first_row
        self.t, self.entropy = 0, []  # decode steps so far; (b,) entropy of each
        self.keys = self.first_nonfinite = None  # (b,) int64 row_keys; (b,) long first_bad

    def __call__(self, input_ids, scores):
        if self.first_nonfinite is None:  # once per generate call, on the logits' device
            b, device = scores.shape[0], scores.device
            rows = torch.arange(self.first_row, self.first_row + b, device=device)
            self.keys = row_keys(self.seed, rows) if self.temperature > 0 else None
            self.first_nonfinite = torch.full((b,), -1, dtype=torch.long, device=device)
        if self.first_nonfinite.shape[0] != scores.shape[0]:
            raise RuntimeError(f"Sampler: {scores.shape[0]} rows at decode step {self.t}, "
                               f"{self.first_nonfinite.shape[0]} at the first: use one Sampler "
                               f"per generate call")
        token, entropy, bad = sample(scores, self.keys, self.t, self.temperature)
        self.entropy.append(entropy)
        self.first_nonfinite = first_bad(self.first_nonfinite, bad, self.t)
        self.t += 1
        return scores.fill_(-math.inf).scatter_(-1, token[:, None], 0.0)

    def check_finite(self):
        if self.first_nonfinite is not None:
            check_finite(self.first_nonfinite, self.first_row)


def hf_generate(model, prompt_ids, prompt_mask, max_new_tokens, stop_ids, pad_id, temperature,
                top_p, seed, first_row, stop=None):
    """The hf engine: transformers' generate on the rows (b, P), plain (every row prefilled on its
    own, its dynamic cache), sampling or greedy with Sampler (top_p = 1), or with its own nucleus
    sampler (top_p < 1, from torch's generator). -> tokens (b, t), t <= max_new_tokens (less when
    every row stopped), and the entropy (b, t) or None."""
    sampler = Sampler(temperature, seed, first_row) if top_p == 1 else None
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                         generation_config=clean_generation_config(max_new_tokens, stop_ids,
                                                                   pad_id, temperature, top_p),
                         logits_processor=LogitsProcessorList([sampler] if sampler else []),
                         stopping_criteria=StoppingCriteriaList([stop] if stop else []))
    if sampler is None:
        return out[:, prompt_ids.shape[1]:], None
    sampler.check_finite()  # NaN or inf logits are an error, not samples
    return out[:, prompt_ids.shape[1]:], torch.stack(sampler.entropy, dim=1)


def clean_generation_config(max_new_tokens, stop_ids, pad_id, temperature, top_p):
    """Everything `generate` is told, as a GenerationConfig. generation_mode blanks
    model.generation_config while generating (see the module docstring), so what is not set here is
    transformers' library default (GenerationConfig._get_default_generation_params), never the
    checkpoint's."""
    if temperature > 0 and top_p < 1:
        # nucleus sampling (eval.py): generate's own sampler, softmax(logits / T) cut to top_p,
        # nothing else (transformers' default top_k is 50)
        sampling = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
    else:
        sampling = dict(do_sample=False)  # our Sampler, then greedy over its one-hot scores
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                            pad_token_id=pad_id, **sampling)


@contextmanager
def generation_mode(model, device):
    """The model as generate_groups samples from it, restored afterwards even on an error: eval
    mode, no gradient, a blank model.generation_config (generate fills every field the configuration
    it is given leaves unset from it), and under autocast the hooks of _rotary_in_autocast_dtype and
    the weights of decode_weights. Out of memory drops the kept caches: the retry, with fewer rows,
    builds its own."""
    hooks = _rotary_in_autocast_dtype(model, device)
    was_training, checkpoint_config = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()
    restore = []
    try:
        restore.append(decode_weights(model, device))
        with torch.no_grad():
            yield
    except BaseException as e:
        if is_out_of_memory(e):
            _kept.clear()
        raise
    finally:
        for swap_back in restore:
            swap_back()
        _buffer.clear()
        for hook in hooks:
            hook.remove()
        model.generation_config = checkpoint_config
        model.train(was_training)


def _rotary_in_autocast_dtype(model, device):
    """Forward hooks, to remove after generating, that cast the rotary embedding's cos and sin to
    the autocast dtype (none when autocast is off on device).

    Why: under --dtype auto the weights and the residual stream are float32, and the rotary
    embedding returns cos and sin in the dtype of the residual stream (float32), while q_proj,
    k_proj and v_proj return the autocast dtype (bf16). q * cos then promotes the queries and keys
    to float32, so the KV cache would hold float32 keys beside bf16 values (1.5x the memory of a
    bf16 cache) and every decode step would cast them back for attention. In bf16, cos and sin are
    what a model with bf16 weights uses (transformers casts them to the weights' dtype), and the
    cache is all bf16. Only generation is hooked: the training forward (rollout.completion_hidden)
    keeps no cache and is unchanged."""
    if not torch.is_autocast_enabled(device.type):
        return []
    dtype = torch.get_autocast_dtype(device.type)

    def cast(module, args, out):  # (cos, sin)
        return tuple(x.to(dtype) for x in out)
    return [m.register_forward_hook(cast) for m in model.modules()
            if type(m).__name__.endswith("RotaryEmbedding")]


# -----------------------------------------------------------------------------
# generate_groups' prompts and arguments

def encode_left_padded(tokenizer, prompts, pad_id):
    """Token ids of each prompt, left-padded by hand: independent of tokenizer.padding_side."""
    # Prompts are complete strings (data.format_prompt). Add the tokenizer's special tokens (a BOS
    # for Llama) only when the prompt does not already start with them, as a chat template's does.
    bos = tokenizer.bos_token
    add_special = not (bos and all(p.startswith(bos) for p in prompts))
    ids = tokenizer(prompts, add_special_tokens=add_special)["input_ids"]
    P = max(len(x) for x in ids)
    prompt_ids = torch.full((len(ids), P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(ids), P), dtype=torch.long)
    for i, x in enumerate(ids):
        if len(x) == 0:
            raise ValueError(f"prompts[{i}]={prompts[i]!r} encodes to no tokens; "
                             f"give a non-empty prompt")
        prompt_ids[i, P - len(x):] = torch.tensor(x, dtype=torch.long)
        prompt_mask[i, P - len(x):] = 1
    return prompt_ids, prompt_mask  # (n, P), (n, P)


def check_generate_args(model, tokenizer, prompts, group_size, max_new_tokens, temperature, top_p,
                        batch_size, record_entropy, engine, seed, first_row, stop=None):
    """Raise ValueError on an argument of rollout.generate_groups that it cannot honour."""
    if isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an integer >= 1")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 or None "
                         f"(all rows at once)")
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} must be one of {', '.join(ENGINES)}")
    if record_entropy and not (temperature > 0 and top_p == 1):
        raise ValueError("record_entropy needs plain sampling (temperature > 0, top_p = 1): it "
                         "records the entropy of softmax(logits / T)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed={seed!r} must be an integer or None "
                         f"(draw one from torch's generator)")
    if seed is not None and temperature > 0 and top_p < 1:
        raise ValueError(f"seed={seed} with top_p={top_p}: nucleus sampling uses generate's own "
                         f"sampler, which draws from torch's global generator; leave seed=None and "
                         f"seed torch (eval.evaluate(seed=...) does)")
    if isinstance(first_row, bool) or not isinstance(first_row, int) or first_row < 0:
        raise ValueError(f"first_row={first_row!r} must be an integer >= 0")
