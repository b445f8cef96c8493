"""
The sampling machinery beneath rollout.py's decode loop (step 1): the random numbers, the sampler
that both engines share, the loop's static KV cache with each prompt prefilled once and its
one-token step (compiled on a GPU), and transformers' `generate`, kept as the reference engine that
the loop is tested against. rollout.py reads as the algorithm; this file is why its samples are the
policy's, the same however they are batched, and fast.

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
default is 50).

[ours] The random numbers are a pure function of (seed, row, position): the uniform of row r of the
call (counted over all its rows, group by group) at decode position t is a counter-based hash
(splitmix64) of (seed, r, t), computed on the model's device for all rows at once. So the random
numbers are the same whatever batch_size splits the rows into calls, whatever the engine, and
whatever else draws random numbers in between; seed=None draws one seed from torch's global
generator per call, so torch.manual_seed still makes a run reproducible. The samples are then the
same bit for bit on a CPU in float32 (the tests compare them exactly): the batch and the engine
change only the floating-point rounding of the forward (a batch of another shape, or a cache of
another length, may sum in another order), which moves the recorded entropy by a few float32 ulps
and would flip a token only if a uniform fell within that rounding of a step of the cumulative
distribution. On a GPU under bf16 autocast the logits themselves change with the batch's shape and
the engine (bf16 matmuls and attention pick other kernels and summation orders, with an 8-bit
mantissa), so a token can flip now and then, and the rest of that rollout with it.

[ours] The sampler (sample) records, at every decode step, the entropy of the distribution it
samples from, softmax(logits / T) over the full vocabulary: the step line logs it (token selection
takes the entropy of a training forward instead: step 5 of train.py, so that its arithmetic never
changes with the memory knobs). The cached decode computes the same function as the training
forward in another order of floating-point operations (tests/test_updates.py bounds the gap in
float32). Under bf16 autocast (--dtype auto on a GPU) they differ by more: the decode runs in bf16,
and so does its lm_head, where head_logprobs runs the head in float32.
"""
import math
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList,
                          StaticCache, StoppingCriteriaList)

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


def draw_seed():
    """A seed drawn from torch's global generator (CPU): torch.manual_seed makes it reproducible."""
    return int(torch.randint(2 ** 63 - 1, ()))


# -----------------------------------------------------------------------------
# the sampler, shared by both engines

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
    temperature 0 is the argmax (entropy 0, never bad).
    [ours] The draw is an inverse CDF in two levels: a block of BLOCK tokens by the float64
    cumulative sum of the block sums, then a token by the float64 cumulative sum within that block,
    where one float64 cumulative sum over all V tokens cost most of a decode step on a CPU. The
    uniform u of (key, t) picks the token whose cumulative mass first exceeds u times the total:
    the same distribution, and a token may differ from a one-level search where u falls within a
    float rounding of a block's edge. The entropy is log Z - E[z - max z], with z = logits / T and
    Z = sum exp(z - max z): H = -sum p log p from one pass of exp."""
    b, V = logits.shape
    rows = max(1, CHUNK_VALUES // V) if logits.device.type == "cpu" else b
    u = stream_uniforms(keys, t) if temperature > 0 else None
    parts = [_draw(logits[s:s + rows].float(), None if u is None else u[s:s + rows], temperature)
             for s in range(0, b, rows)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _draw(z, u, temperature):
    """sample on one chunk of rows: logits z (c, V) float32 (overwritten), uniforms u (c,)."""
    c, V = z.shape
    if temperature == 0:  # greedy
        return z.argmax(dim=-1), z.new_zeros(c), torch.zeros(c, dtype=torch.bool, device=z.device)
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


def head_logits(model, hidden, out=None):
    """The logits (b, V) of the last hidden states (b, H), by the model's lm_head: under autocast in
    its dtype, as generate's own head; without it, on a CPU, into `out` (the loop's buffer), since
    there a fresh (b, V) tensor costs as much in page faults as the matmul itself."""
    head = model.get_output_embeddings()
    if out is None or torch.is_autocast_enabled(hidden.device.type) or head.bias is not None:
        return head(hidden)
    return torch.mm(hidden, head.weight.t(), out=out)


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or inf logits while sampling: its weights have most likely
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
            f"the model produced NaN or inf logits while sampling (in {len(bad)} of "
            f"{len(first)} rows; first at decode position {t} of row {row}): its weights have "
            f"probably diverged")


# -----------------------------------------------------------------------------
# the loop's model side: a static KV cache, each prompt prefilled once, one token at a time

# How the decode step is compiled: "auto" on a GPU only (torch.compile with CUDA graphs, as
# gpt-fast), "off" never, or a torch.compile backend ("eager", "aot_eager") on any device: the tests
# trace it on a CPU. [ours] Nothing is compiled on a CPU by default: with "inductor" there, the step
# of experiments/bench_decode.py's real world took 200 s to compile and decoded 2.5x slower
# (experiments/speed.md).
COMPILE = "auto"
BUCKET = 64  # [ours] compiled: prompt widths rounded up to a multiple of this, and never below the
             # kept cache's, so a run compiles a few times, not once per width (more left
             # padding: harmless, by the mask)
SYNC_EVERY = 32  # on a GPU, decode steps between the loop's "all stopped?" checks (a host sync)
# [ours] compiled: the one static cache kept between calls (CUDA graphs replay on fixed addresses,
# so a call of its rows and budget reuses it, reset, rather than a new one each time); another
# shape replaces it. machinery/memory.py counts it in every phase of a step.
_kept, _compiled, _failed = {}, {}, []
STATS = {"compiles": 0}  # graphs compiled for the decode step (compiles()), this process


def compiles():
    """How many graphs the decode step has compiled in this process: one per (rows, width bucket,
    temperature, autocast) seen, and a recompile would show here (gpu_check counts them)."""
    return STATS["compiles"]


def compile_failures():
    """The errors that turned compiling the decode step off in this process (one line said each)."""
    return list(_failed)


def reset():
    """The decode step as a new process has it: nothing compiled, no failure, no kept cache (for a
    script that runs several train.py runs in one process: experiments/gpu_check.py)."""
    if STATS["compiles"] or _failed:
        torch.compiler.reset()
    _kept.clear()
    _compiled.clear()
    _failed.clear()


def _graphs():
    """torch's count of the graphs dynamo has compiled in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class DecodeStep:
    """The loop's model side. Built with the prompts (n, P), each prefilled once (the decoder body,
    no lm_head) into a static KV cache of the rows (prompt_of (b,): each row's prompt) of length
    P + max_new_tokens. first: (token, entropy, bad) at t = 0, drawn from each prompt's last hidden
    state. Then self(token, t): the token of every row at position t - 1 through the cache, the
    next drawn (the decoder, the lm_head and the sampler: one graph on a GPU)."""

    def __init__(self, model, prompt_ids, prompt_mask, prompt_of, max_new_tokens, temperature,
                 keys):
        device = prompt_ids.device
        self.backend = COMPILE if COMPILE not in ("auto", "off") else (
            "reduce-overhead" if COMPILE == "auto" and device.type == "cuda" else None)
        if _failed:
            self.backend = None
        if self.backend:  # a bounded number of widths, one compile each
            kept = _kept.get((id(model), len(prompt_of), max_new_tokens, device))
            width = max(-(-prompt_ids.shape[1] // BUCKET) * BUCKET,
                        kept.layers[0].max_cache_len - max_new_tokens if kept else 0)
            pad = width - prompt_ids.shape[1]
            prompt_ids, prompt_mask = F.pad(prompt_ids, (pad, 0)), F.pad(prompt_mask, (pad, 0))
        self.model, self.temperature, self.keys = model, temperature, keys
        # t as a tensor, so that a new t is no new graph; filled in place (no copy from the host)
        self.t = torch.zeros((), dtype=torch.long, device=device)
        self.sync_every = 1 if device.type == "cpu" else SYNC_EVERY  # a CPU's sync costs nothing
        self.P, b = prompt_ids.shape[1], len(prompt_of)
        positions = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (n, P) as generate derives them
        kv = DynamicCache(config=model.config)
        hidden = model.get_decoder()(input_ids=prompt_ids, attention_mask=prompt_mask,
                                     position_ids=positions, cache=kv, use_cache=True)
        self.cache = _static_cache(model, kv, prompt_of, max_new_tokens, self.backend)
        # (b, L): the padding; causality comes from the cache's length
        self.mask = torch.cat([prompt_mask[prompt_of],
                               prompt_mask.new_ones(b, max_new_tokens)], dim=1)
        self.last = positions[prompt_of, -1]  # (b,) the last prompt token's position
        # on a CPU, one (b, V) buffer for every step's logits
        weight = model.get_output_embeddings().weight  # (V, H)
        self.out = None if self.backend or device.type != "cpu" else torch.empty(
            b, weight.shape[0], dtype=weight.dtype, device=device)
        self.first = sample(head_logits(model, hidden.last_hidden_state[prompt_of, -1], self.out),
                            keys, 0, temperature)

    def __call__(self, token, t):
        """(token, entropy, bad) at decode position t, from token (b,), drawn at t - 1."""
        args = (self.model, self.cache, token, self.mask, self.last + t, self.keys,
                self.t.fill_(t), self.temperature, self.out)
        if not self.backend or _failed:
            return _one_token(*args)
        before, t0 = _graphs(), time.time()
        try:
            if token.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # outputs of the last replay are read
            out = tuple(x.clone() for x in _compiled_step(self.backend)(*args))
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # the run goes on, eager
            _failed.append(e)
            print(f"decode step: compiling failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                  f"decoding on without compiling", file=sys.stderr, flush=True)
            for layer in self.cache.layers:  # a failed call may have written its column
                layer.cumulative_length.fill_(self.P + t - 1)
            return _one_token(*args)
        if _graphs() > before:
            STATS["compiles"] += _graphs() - before
            print(f"decode step: compiled for {token.shape[0]} rows x {self.mask.shape[1]} columns "
                  f"in {time.time() - t0:.1f} s (once per width bucket of {BUCKET})",
                  file=sys.stderr, flush=True)
        return out


def _one_token(model, cache, token, mask, positions, keys, t, temperature, out=None):
    """The decode step: token (b,) at positions (b,) through the decoder and its cache, then the
    lm_head and the sampler -> (token, entropy, bad) at decode position t."""
    hidden = model.get_decoder()(input_ids=token[:, None], attention_mask=mask,
                                 position_ids=positions[:, None], cache=cache, use_cache=True)
    return sample(head_logits(model, hidden.last_hidden_state[:, -1], out), keys, t, temperature)


def _compiled_step(backend):
    """_one_token compiled whole (fullgraph: a graph break is an error), once per backend."""
    if backend not in _compiled:
        how = {"mode": backend} if backend == "reduce-overhead" else {"backend": backend}
        _compiled[backend] = torch.compile(_one_token, fullgraph=True, **how)
    return _compiled[backend]


def _static_cache(model, kv, prompt_of, max_new_tokens, reuse):
    """A StaticCache of len(prompt_of) rows and P + max_new_tokens columns holding the prefill kv
    (P columns) of each row's prompt (every layer's keys and values in the prefill's dtype: under
    autocast, the autocast dtype). reuse: a compiled step's, kept for the next call of its shape."""
    keys = kv.layers[0].keys  # (n, kv_heads, P, head_dim)
    b, P = len(prompt_of), keys.shape[2]
    name = (id(model), b, max_new_tokens, keys.device)
    cache = _kept.get(name) if reuse else None
    shape = (b, keys.shape[1], P + max_new_tokens, keys.shape[3])
    if cache is None or len(cache.layers) != len(kv.layers) or \
            cache.layers[0].keys.shape != shape or cache.layers[0].keys.dtype != keys.dtype:
        cache = StaticCache(config=model.config, max_cache_len=P + max_new_tokens)
        cache.early_initialization(b, keys.shape[1], keys.shape[3], keys.dtype, keys.device)
        _kept.clear()
        if reuse:
            _kept[name] = cache
    else:
        cache.reset()
    for static, layer in zip(cache.layers, kv.layers):
        static.keys[:, :, :P] = layer.keys[prompt_of]
        static.values[:, :, :P] = layer.values[prompt_of]
        static.cumulative_length.fill_(P)
    return cache


# -----------------------------------------------------------------------------
# the reference engine: transformers' generate, with the same sampler

class Sampler(LogitsProcessor):
    """sample() as generate's logits processor: it draws the token, records the entropy and marks
    the rows with no distribution (check_finite() reads the marks once, after generate), and returns
    0 at the drawn token and -inf elsewhere, over which generate then decodes greedily. It runs with
    the blank configuration of generation_mode, so no processor of its own runs before this one and
    the scores here are the raw logits. Row i of the call is row first_row + i of the whole batch;
    its stream key is built at the first decode step, on the logits' device."""

    def __init__(self, temperature, seed, first_row=0):
        self.temperature, self.seed, self.first_row = temperature, seed, first_row
        self.t, self.entropy = 0, []  # decode steps so far; (b,) entropy of each
        self.keys = self.first_nonfinite = None  # (b,) int64 row_keys; (b,) long first_bad

    def __call__(self, input_ids, scores):
        if self.keys is None:  # once per generate call, on the logits' device
            b, device = scores.shape[0], scores.device
            self.keys = row_keys(self.seed, torch.arange(self.first_row, self.first_row + b,
                                                         device=device))
            self.first_nonfinite = torch.full((b,), -1, dtype=torch.long, device=device)
        if self.keys.shape[0] != scores.shape[0]:
            raise RuntimeError(f"Sampler: {scores.shape[0]} rows at decode step {self.t}, "
                               f"{self.keys.shape[0]} at the first: use one Sampler per generate "
                               f"call")
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
    own, its dynamic cache), sampling with Sampler (temperature > 0, top_p = 1), greedy, or with its
    own nucleus sampler (top_p < 1, from torch's generator). -> tokens (b, t), t <= max_new_tokens
    (less when every row stopped), and the entropy (b, t) or None."""
    sampler = Sampler(temperature, seed, first_row) if temperature > 0 and top_p == 1 else None
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
        sampling = dict(do_sample=False)  # greedy; with our Sampler, greedy over its one-hot scores
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                            pad_token_id=pad_id, **sampling)


@contextmanager
def generation_mode(model, device):
    """The model as generate_groups samples from it, restored afterwards even on an error: eval
    mode, no gradient, a blank model.generation_config (generate fills every field the configuration
    it is given leaves unset from it), and under autocast the hooks of _rotary_in_autocast_dtype."""
    hooks = _rotary_in_autocast_dtype(model, device)
    was_training, checkpoint_config = model.training, model.generation_config
    model.eval()
    model.generation_config = GenerationConfig()
    try:
        with torch.no_grad():
            yield
    finally:
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
