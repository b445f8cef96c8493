"""
The sampling machinery beneath rollout.generate_groups: the sampler that draws every token from
exactly softmax(logits / T) with counter-based random numbers, the blank generation configuration
`generate` runs with, the shared-prefix KV cache, the rotary hooks that keep that cache in the
autocast dtype, the left-padded prompts, and the checks of generate_groups' arguments. rollout.py
reads as the algorithm; this file is why its samples are the policy's and the same however they
are batched.

[ours] Sampling is exactly softmax(logits / T), whatever the checkpoint's generation_config.json
says. Sampler draws the tokens, and `generate` runs with a configuration built here that holds only
what rollouts need (the token budget, the stop and pad ids, greedy or not, the cache). transformers
fills every field we leave unset from model.generation_config
(GenerationMixin._prepare_generation_config), so while generating (generation_mode),
model.generation_config is a blank GenerationConfig: nothing of the checkpoint's (Qwen2.5 instruct
ships top_k=20 and repetition_penalty=1.05; others suppress tokens, force an EOS at the last
position, set a min_length, a max_time, stop strings, beams...) can reach the logits or the stopping
rule. Only transformers' library defaults remain, and with do_sample=False none of them builds a
logits processor (a test checks the exact processor list generate builds). This matters because the
policy gradient scores the samples with softmax(logits / T) alone (rollout.head_logprobs): a
different sampler would make the rollouts off-policy without saying so, and a forced EOS would put a
token the policy never sampled into the loss and hide a truncation. Greedy decoding (temperature 0)
runs with the same blank configuration: argmax of the raw logits. eval.py's top_p < 1 uses
generate's own sampler with our temperature and top_p and nothing else (top_k=0: transformers' own
default is 50).

[ours] The random numbers are a pure function of (seed, row, position): Sampler's uniform for row r
of the call (counted over all its rows, group by group) at decode position t is a counter-based hash
(splitmix64) of (seed, r, t), computed on the model's device for all rows at once. So the random
numbers are the same whatever batch_size splits the rows into generate calls, whatever the cache
mode, and whatever else draws random numbers in between; seed=None draws one seed from torch's
global generator per call, so torch.manual_seed still makes a run reproducible. The samples are then
the same bit for bit on a CPU in float32 (the tests compare them exactly): batch_size and the cache
mode change only the floating-point rounding of the forward (a batch of another shape may sum in
another order), which moves the recorded entropy by a few float32 ulps (at most 2.6e-6 on the tiny
test model) and would flip a token only if a uniform fell within that rounding of a step of the
cumulative distribution. On a GPU under bf16 autocast the logits themselves change with the batch's
shape and the cache mode (bf16 matmuls and attention pick other kernels and summation orders, with
an 8-bit mantissa), so a token can flip now and then, and the rest of that rollout with it.

[ours] generate_groups(record_entropy=True) also records, at every decode step, the entropy of the
distribution it samples from, softmax(logits / T) over the full vocabulary (Sampler): the step line
logs it (token selection takes the entropy of a training forward instead: step 5 of train.py, so
that its arithmetic never changes with the memory knobs). The cached decode computes the same
function as the training forward in another order of floating-point operations; on the tiny model
the two entropies differ by at most 2.4e-6 in float32 (tests/test_updates.py measures it). Under
bf16 autocast (--dtype auto on a GPU) they differ by more: the decode runs in bf16, and its logits
come from generate's own lm_head, in bf16, where head_logprobs runs the head in float32.
"""
import math
from contextlib import contextmanager

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor

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
    row's splitmix64 stream. Sampler builds these once per generate call."""
    # a copy to the device
    seed = splitmix64(torch.tensor(_int64(seed), dtype=torch.long, device=rows.device))
    return splitmix64(seed + rows * GOLDEN)


def stream_uniforms(keys, t):
    """(b,) float64 in [0, 1): the t-th number of each row's stream (keys from row_keys), with
    53 random bits, as many as a float64 holds. Python ints only besides keys: no copy to the
    device."""
    bits = splitmix64(keys + _int64((t + 1) * GOLDEN))  # (b,) the row's stream at position t
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
# the sampler

class NonFiniteLogits(RuntimeError):
    """The model produced NaN or inf logits while sampling: its weights have most likely
    diverged."""


class Sampler(LogitsProcessor):
    """Draws every next token from exactly softmax(logits / T), the distribution step 5 scores the
    samples with, and records that distribution's entropy H at every decode step.

    generate then decodes greedily over what this returns: 0 at the drawn token, -inf elsewhere. It
    runs with the blank configuration of generation_mode, so no processor of its own runs before
    this one and the scores here are the raw logits. [ours] The draw is by inverse CDF: row i of
    this generate call is row first_row + i of the whole batch, and at its t-th decode step it
    compares uniforms(seed, first_row + i, t) against the float64 cumulative sum of its
    probabilities. The same distribution as generate's own torch.multinomial, which on a CPU costs
    35 ms per decode step over a 151,936-token vocabulary (it is bound by random-number generation),
    against 4 ms here; and unlike a generator's stream, a row's numbers do not depend on which other
    rows share the call.

    Nothing here waits for the device: the rows' stream keys are built once, at the first decode
    step, on the logits' device (later steps pass only Python ints), and a row whose logits hold a
    NaN or +inf (or are all -inf) is not an error here but marked on the device, at its first such
    position; check_finite() reads the marks once, after generate returns. Such a row has no
    distribution (its log-softmax is NaN), and the token drawn for it is meaningless.
    """

    def __init__(self, temperature, seed, first_row=0):
        self.temperature, self.seed, self.first_row = temperature, seed, first_row
        self.t, self.entropy = 0, []  # decode steps so far; (b,) entropy of each
        self.keys = None  # (b,) int64 each row's stream key (row_keys), built at the first step
        # (b,) long: each row's first decode position with no distribution, or -1
        self.first_nonfinite = None

    def __call__(self, input_ids, scores):
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (b, V)
        p = logp.exp()
        # (b,) -p log p, 0 where p = 0 (a -inf logit)
        self.entropy.append(torch.special.entr(p).sum(dim=-1))
        cdf = p.double().cumsum(dim=-1)  # (b, V) float64: no rounding drift over 151,936 terms
        if self.keys is None:  # once per generate call, on the logits' device
            rows = torch.arange(self.first_row, self.first_row + p.shape[0],
                                device=p.device)  # (b,)
            self.keys = row_keys(self.seed, rows)
            self.first_nonfinite = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)
        if self.keys.shape[0] != p.shape[0]:
            raise RuntimeError(f"Sampler: {p.shape[0]} rows at decode step {self.t}, "
                               f"{self.keys.shape[0]} at the first: use one Sampler per generate "
                               f"call")
        # A NaN or +inf logit (or none above -inf) makes the row's log-softmax, hence its total, NaN
        bad = ~torch.isfinite(cdf[:, -1])  # (b,)
        self.first_nonfinite = torch.where(bad & (self.first_nonfinite < 0), self.t,
                                           self.first_nonfinite)
        u = stream_uniforms(self.keys, self.t)[:, None] * cdf[:, -1:]  # (b, 1) in [0, total)
        self.t += 1
        # (b, 1); never a p = 0 token
        token = torch.searchsorted(cdf, u, side="right").clamp(max=p.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(-1, token, 0.0)

    def check_finite(self):
        """Raise NonFiniteLogits if any row had NaN or inf logits at some decode step (one read from
        the device, after generate)."""
        if self.first_nonfinite is None:
            return
        first = self.first_nonfinite.tolist()
        bad = [(t, self.first_row + i) for i, t in enumerate(first) if t >= 0]
        if bad:
            t, row = min(bad)
            raise NonFiniteLogits(
                f"the model produced NaN or inf logits while sampling (in {len(bad)} of "
                f"{len(first)} rows; first at decode position {t} of row {row}): its weights have "
                f"probably diverged")


# -----------------------------------------------------------------------------
# what generate is told, and the model's state while it runs

CACHES = ("prefix", "plain", "static")


def clean_generation_config(max_new_tokens, stop_ids, pad_id, temperature, top_p, cache):
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
                            pad_token_id=pad_id,
                            cache_implementation="static" if cache == "static" else None,
                            **sampling)


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


def prefill(model, prompt_ids, prompt_mask, group_size):
    """The KV cache of every prompt but its last token, computed once per prompt (prompt_ids (n, P))
    and repeated for its group_size rows: generate then runs only the last prompt token and the
    decode. The decoder body alone: no lm_head over the prompt."""
    kv = DynamicCache(config=model.config)
    positions = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # as generate derives them
    model.get_decoder()(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
                        position_ids=positions[:, :-1], cache=kv, use_cache=True)
    kv.batch_repeat_interleave(group_size)  # (n, ...) -> (n * group_size, ...), group by group
    return kv


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
                        batch_size, record_entropy, cache, seed, first_row, stop=None):
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
    if cache not in CACHES:
        raise ValueError(f"cache={cache!r} must be one of {', '.join(CACHES)}")
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
