"""
Rollouts for GRPO/D3S: sample groups of completions, mark which tokens are real, and score tokens.

Steps 1 and 5 of the algorithm (docs/algorithm.md):

  generate_groups  step 1. G completions per prompt with HF `generate` (temperature T, stop on any
                   EOS id), laid out group by group: rows 0..G-1 are prompt 0, rows G..2G-1 prompt 1...
                   Keeps the left-padded prompt, the completion ids, a completion mask covering every
                   generated token up to and including the first stop token and nothing after, a
                   truncated flag (no stop token within max_new_tokens), and the decoded texts.
                   temperature == 0 is greedy decoding (used by evaluation with group_size=1).
  completion_mask  the mask of step 1 as a pure function of ids and stop ids. Padding is found by
                   position (after the first stop token), never by comparing with the pad id: Qwen2.5
                   pads with <|endoftext|>, which is also the base models' EOS.
  stop_token_ids   every id that ends a completion: the model's generation_config.eos_token_id (int or
                   list) and the tokenizer's eos_token_id. [ours] plus <|im_end|> whenever the tokenizer
                   has a chat template and knows that token: our prompts are ChatML (data.format_prompt),
                   so even a base Qwen model, whose generation_config names only <|endoftext|>, ends its
                   turn with <|im_end|>.
  Rollouts.piece   the tensors a forward pass of some rows needs, cut to those rows' own span (from
                   their first real prompt column to their last real completion column), so one long
                   rollout elsewhere in the batch never widens them.
  completion_hidden, head_logprobs
                   step 5. log pi(y_t | x, y_<t) of each completion token (with gradient when enabled)
                   and the entropy H_t = -sum_v p_v log p_v of p = softmax(logits / T) over the full
                   vocabulary (never with gradient), in two parts: completion_hidden runs the decoder
                   body once; head_logprobs runs the lm_head and the softmax, both in float32 even
                   under bf16 autocast, only at the positions asked for (the kept tokens, say), in
                   chunks, each inside activation checkpointing, so neither the forward nor autograd
                   ever holds the (B, T, V) float32 logits (V = 151,936 for Qwen2.5).

[ours] generate_groups(record_entropy=True) also records, at every decode step, the entropy of the
distribution it samples from, softmax(logits / T) over the full vocabulary (Sampler): the step line
logs it, and when the kept rollouts need several micro-batches it is the entropy of token selection
(step 6), so no extra full-vocabulary forward pass is needed. The cached decode computes the same
function as the training forward in another order of floating-point operations; on the tiny model
the two entropies differ by at most 2.4e-6 in float32 (tests/test_updates.py measures it). Under
bf16 autocast (--dtype auto on a GPU) they differ by more: the decode runs in bf16, and its logits
come from generate's own lm_head, in bf16, where head_logprobs runs the head in float32.

[ours] Sampling is exactly softmax(logits / T), whatever the checkpoint's generation_config.json says.
Sampler draws the tokens, and `generate` runs with a configuration built here that holds only what
rollouts need (the token budget, the stop and pad ids, greedy or not, the cache). transformers fills
every field we leave unset from model.generation_config (GenerationMixin._prepare_generation_config),
so while generating, model.generation_config is a blank GenerationConfig: nothing of the checkpoint's
(Qwen2.5 instruct ships top_k=20 and repetition_penalty=1.05; others suppress tokens, force an EOS at
the last position, set a min_length, a max_time, stop strings, beams...) can reach the logits or the
stopping rule. Only transformers' library defaults remain, and with do_sample=False none of them builds
a logits processor (a test checks the exact processor list generate builds). This matters because the
policy gradient scores the samples with softmax(logits / T) alone (head_logprobs): a different sampler
would make the rollouts off-policy without saying so, and a forced EOS would put a token the policy
never sampled into the loss and hide a truncation. Greedy decoding (temperature 0) runs with the same
blank configuration: argmax of the raw logits. eval.py's top_p < 1 uses generate's own sampler with
our temperature and top_p and nothing else (top_k=0: transformers' own default is 50).

[ours] The random numbers are a pure function of (seed, row, position): Sampler's uniform for row r
of the call (counted over all its rows, group by group) at decode position t is a counter-based hash
(splitmix64) of (seed, r, t), computed on the model's device for all rows at once. So the random
numbers are the same whatever batch_size splits the rows into generate calls, whatever the cache mode,
and whatever else draws random numbers in between; seed=None draws one seed from torch's global
generator per call, so torch.manual_seed still makes a run reproducible. The samples are then the same
bit for bit on a CPU in float32 (the tests compare them exactly). On a GPU under bf16 autocast the
logits themselves change with the batch's shape and the cache mode (bf16 matmuls and attention pick
other kernels and summation orders), so a token can flip where a uniform falls within that rounding
of a step of the cumulative distribution, and the rollout diverges from there.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList

# [ours] Default token positions per lm_head chunk, counted over the whole micro-batch (only the
# positions asked for: real completion tokens, never padding). Each chunk briefly holds a few
# (chunk, V) float32 tensors (logits, log-softmax, probabilities; their gradient in backward), 4 bytes
# per entry: for Qwen's V = 151,936 and chunk = 4096 that is 4096 * 151,936 * 4 B = 2.5 GB per tensor,
# at the peak 7.0 GiB in the gradient pass and 9.3 GiB in the no-grad pass with the entropy (measured:
# experiments/memory.py), whatever the batch and completion length (the full logits of 16 rollouts of 4096
# tokens: 40 GB each). Smaller chunks save memory but barely time; lower it on a small GPU.
CHUNK_SIZE = 4096


@dataclass
class Rollouts:
    """B = len(prompts) * group_size completions, group by group. Tensors live on the model's device."""
    prompt_ids: torch.Tensor       # (B, P) long, left-padded
    prompt_mask: torch.Tensor      # (B, P) long, 1 on real prompt tokens
    completion_ids: torch.Tensor   # (B, T) long, pad id after the first stop token
    completion_mask: torch.Tensor  # (B, T) bool, generated tokens up to and including the first stop
    truncated: torch.Tensor        # (B,) bool, no stop token within max_new_tokens
    group: torch.Tensor            # (B,) long, index of the prompt each row answers
    texts: list[str]               # B str, decoded completions without the stop token / special tokens
    entropy: Optional[torch.Tensor] = None  # (B, T) float32, the sampler's entropy (record_entropy=True)

    @property
    def completion_start(self):
        """Column of the first completion token in input_ids (= P)."""
        return self.prompt_ids.shape[1]

    @property
    def input_ids(self):
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (B, P + T)

    @property
    def attention_mask(self):
        return torch.cat([self.prompt_mask, self.completion_mask.long()], dim=1)  # (B, P + T)

    @property
    def lengths(self):
        return self.completion_mask.sum(dim=1)  # (B,) completion tokens, stop token included

    def select(self, index):
        """The rows `index` (a list or a long tensor), e.g. the rollouts kept by sample selection."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.group.device)
        return Rollouts(self.prompt_ids[index], self.prompt_mask[index], self.completion_ids[index],
                        self.completion_mask[index], self.truncated[index], self.group[index],
                        [self.texts[i] for i in index.tolist()],
                        None if self.entropy is None else self.entropy[index])

    def piece(self, rows):
        """(input_ids, attention_mask, completion_start, width) of the rows `rows`, cut to their own
        span: from the first column where any of them has a real prompt token to the last column
        where any has a completion token. width is the number of completion columns kept; the
        completion tensors of these rows are all padding beyond it. Positions come from the mask
        (completion_hidden), so dropping all-padding columns on either side changes no value."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.group.device)
        prompt_mask, mask = self.prompt_mask[rows], self.completion_mask[rows]  # (n, P), (n, T)
        first = int(prompt_mask.any(dim=0).long().argmax())  # left padding shared by all these rows
        width = int(mask.any(dim=0).nonzero().max()) + 1 if mask.any() else 0
        input_ids = torch.cat([self.prompt_ids[rows, first:], self.completion_ids[rows, :width]], dim=1)
        attention_mask = torch.cat([prompt_mask[:, first:], mask[:, :width].long()], dim=1)
        return input_ids, attention_mask, self.completion_start - first, width


def stop_token_ids(model, tokenizer):
    """Sorted list of every token id that ends a completion (see the module docstring)."""
    ids = set()
    for eos in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else [int(i) for i in eos])
    if getattr(tokenizer, "chat_template", None):
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            ids.add(im_end)
    if not ids:
        raise ValueError("stop_token_ids: neither model.generation_config.eos_token_id nor tokenizer.eos_token_id "
                         "is set; set one so that completions can end")
    return sorted(ids)


def completion_mask(completion_ids, stop_ids):
    """True on every token up to and including the first stop token of its row, False after it.

    Found by position: a token counts as long as no stop token came strictly before it, so a pad id
    that is also a stop id (Qwen2.5's <|endoftext|>) is handled, and a pad id that the model really
    generated before stopping stays a real token.
    """
    is_stop = torch.isin(completion_ids, torch.as_tensor(stop_ids, device=completion_ids.device))  # (B, T)
    stops_before = is_stop.long().cumsum(dim=1) - is_stop.long()  # (B, T) stop tokens strictly before t
    return stops_before == 0


def _encode_left_padded(tokenizer, prompts, pad_id):
    """Token ids of each prompt, left-padded by hand: independent of tokenizer.padding_side."""
    # Prompts are complete strings (data.format_prompt). Add the tokenizer's special tokens (a BOS for
    # Llama) only when the prompt does not already start with them, as a chat template's output does.
    bos = tokenizer.bos_token
    add_special = not (bos and all(p.startswith(bos) for p in prompts))
    ids = tokenizer(prompts, add_special_tokens=add_special)["input_ids"]
    P = max(len(x) for x in ids)
    prompt_ids = torch.full((len(ids), P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(ids), P), dtype=torch.long)
    for i, x in enumerate(ids):
        if len(x) == 0:
            raise ValueError(f"prompts[{i}]={prompts[i]!r} encodes to no tokens; give a non-empty prompt")
        prompt_ids[i, P - len(x):] = torch.tensor(x, dtype=torch.long)
        prompt_mask[i, P - len(x):] = 1
    return prompt_ids, prompt_mask  # (n, P), (n, P)


# -----------------------------------------------------------------------------
# random numbers: one uniform per (seed, row, decode position)

# [ours] splitmix64 (Steele, Lea and Flood 2014; the generator behind Java's SplittableRandom) in int64
# tensor arithmetic, so one call hashes every row at once on the CPU or a GPU. torch's int64 + and *
# wrap modulo 2**64 exactly like the uint64 original; constants above 2**63 are written as the int64
# with the same bits.
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
    """The splitmix64 finaliser of every int64 in x: a bijection of 64-bit words in which every output
    bit depends on every input bit."""
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def row_keys(seed, rows):
    """(b,) int64: the key of each row in rows (b,) long, hashed from (seed, row): the start of the row's
    splitmix64 stream. Sampler builds these once per generate call."""
    seed = splitmix64(torch.tensor(_int64(seed), dtype=torch.long, device=rows.device))  # a copy to the device
    return splitmix64(seed + rows * GOLDEN)


def stream_uniforms(keys, t):
    """(b,) float64 in [0, 1): the t-th number of each row's stream (keys from row_keys), with 53 random
    bits, as many as a float64 holds. Python ints only besides keys: no copy to the device."""
    bits = splitmix64(keys + _int64((t + 1) * GOLDEN))  # (b,) the row's stream at position t
    return _shr(bits, 11).double() * 2.0 ** -53  # top 53 bits: an exact float64, never 1.0


def uniforms(seed, rows, t):
    """(b,) float64 in [0, 1): the uniform number of each row in rows (b,) long at decode position t,
    a pure function of (seed, row, t): the t-th number of the splitmix64 stream started at a key
    hashed from (seed, row)."""
    return stream_uniforms(row_keys(seed, rows), t)


def draw_seed():
    """A seed drawn from torch's global generator (CPU): torch.manual_seed makes it reproducible."""
    return int(torch.randint(2 ** 63 - 1, ()))


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or inf logits while sampling: its weights have most likely diverged."""


class Sampler(LogitsProcessor):
    """Draws every next token from exactly softmax(logits / T), the distribution step 5 scores the
    samples with, and records that distribution's entropy H at every decode step.

    generate then decodes greedily over what this returns: 0 at the drawn token, -inf elsewhere. It
    runs with the blank configuration of generate_groups, so no processor of its own runs before this
    one and the scores here are the raw logits. [ours] The draw is by inverse CDF: row i of this
    generate call is row first_row + i of the whole batch, and at its t-th decode step it compares
    uniforms(seed, first_row + i, t) against the float64 cumulative sum of its probabilities. The same
    distribution as generate's own torch.multinomial, which on a CPU costs 35 ms per decode step over a
    151,936-token vocabulary (it is bound by random-number generation), against 4 ms here; and unlike
    a generator's stream, a row's numbers do not depend on which other rows share the call.

    Nothing here waits for the device: the rows' stream keys are built once, at the first decode step,
    on the logits' device (later steps pass only Python ints), and a row whose logits hold a NaN or
    +inf (or are all -inf) is not an error here but marked on the device, at its first such position;
    check_finite() reads the marks once, after generate returns. Such a row has no distribution (its
    log-softmax is NaN), and the token drawn for it is meaningless.
    """

    def __init__(self, temperature, seed, first_row=0):
        self.temperature, self.seed, self.first_row = temperature, seed, first_row
        self.t, self.entropy = 0, []  # decode steps so far; (b,) entropy of each
        self.keys = None  # (b,) int64 each row's stream key (row_keys), built at the first step
        self.first_nonfinite = None  # (b,) long: each row's first decode position with no distribution, or -1

    def __call__(self, input_ids, scores):
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (b, V)
        p = logp.exp()
        self.entropy.append(torch.special.entr(p).sum(dim=-1))  # (b,) -p log p, 0 where p = 0 (a -inf logit)
        cdf = p.double().cumsum(dim=-1)  # (b, V) float64: no rounding drift over 151,936 terms
        if self.keys is None:  # once per generate call, on the logits' device
            rows = torch.arange(self.first_row, self.first_row + p.shape[0], device=p.device)  # (b,)
            self.keys = row_keys(self.seed, rows)
            self.first_nonfinite = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)
        if self.keys.shape[0] != p.shape[0]:
            raise RuntimeError(f"Sampler: {p.shape[0]} rows at decode step {self.t}, {self.keys.shape[0]} at the "
                               f"first: use one Sampler per generate call")
        # A NaN or +inf logit (or none above -inf) makes the row's log-softmax, hence its total, NaN
        bad = ~torch.isfinite(cdf[:, -1])  # (b,)
        self.first_nonfinite = torch.where(bad & (self.first_nonfinite < 0), self.t, self.first_nonfinite)
        u = stream_uniforms(self.keys, self.t)[:, None] * cdf[:, -1:]  # (b, 1) uniform in [0, total)
        self.t += 1
        token = torch.searchsorted(cdf, u, side="right").clamp(max=p.shape[-1] - 1)  # (b, 1); never a p = 0 token
        return torch.full_like(scores, -math.inf).scatter_(-1, token, 0.0)

    def check_finite(self):
        """Raise NonFiniteLogits if any row had NaN or inf logits at some decode step (one read from the
        device, after generate)."""
        if self.first_nonfinite is None:
            return
        first = self.first_nonfinite.tolist()
        bad = [(t, self.first_row + i) for i, t in enumerate(first) if t >= 0]
        if bad:
            t, row = min(bad)
            raise NonFiniteLogits(
                f"the model produced NaN or inf logits while sampling (in {len(bad)} of {len(first)} rows; "
                f"first at decode position {t} of row {row}): its weights have probably diverged")


CACHES = ("prefix", "plain", "static")


def clean_generation_config(max_new_tokens, stop_ids, pad_id, temperature, top_p, cache):
    """Everything `generate` is told, as a GenerationConfig. generate_groups blanks model.generation_config
    while generating (see the module docstring), so what is not set here is transformers' library default
    (GenerationConfig._get_default_generation_params), never the checkpoint's."""
    if temperature > 0 and top_p < 1:
        # nucleus sampling (eval.py): generate's own sampler, softmax(logits / T) cut to top_p, nothing
        # else (transformers' default top_k is 50)
        sampling = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
    else:
        sampling = dict(do_sample=False)  # greedy; with our Sampler, greedy over its one-hot scores
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad_id,
                            cache_implementation="static" if cache == "static" else None, **sampling)


def generate_groups(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                    batch_size=None, record_entropy=False, cache="prefix", seed=None, first_row=0):
    """Step 1: `group_size` completions for each prompt, group by group. Returns a Rollouts.

    temperature == 0 means greedy decoding. Sampling (temperature > 0, top_p == 1) draws from exactly
    softmax(logits / T) with Sampler; nothing of model.generation_config but its EOS ids is used (see
    the module docstring).
    seed: the random numbers are a pure function of (seed, row, decode position), so the samples do not
    depend on batch_size, on cache, or on other random draws: bit for bit on a CPU in float32; on a
    GPU under bf16 see batch_size below. None draws one seed from torch's global
    generator (torch.manual_seed reproduces it). first_row: the index of this call's first row in a
    larger batch that the caller splits over calls (eval.py), so that the split changes no sample; rows
    of calls with the same seed and overlapping rows get the same random numbers. Greedy decoding
    needs no seed; top_p < 1 samples with generate's own sampler from torch's global generator, so a
    seed there is refused (seed torch instead: eval.evaluate does).
    batch_size caps the rows per `generate` call (None = all). What it changes: only the floating-point
    rounding of the forward (a batch of another shape may sum in another order; the cache modes too),
    which moves the recorded entropy by a few float32 ulps (at most 2.6e-6 on the tiny test model) and
    would flip a token only if a uniform fell within that rounding of a step of the cumulative
    distribution (never seen in the tests, which compare the tokens exactly, on a CPU in float32). On
    a GPU under bf16 autocast that rounding is bf16's (an 8-bit mantissa, in every matmul), so there a
    different batch_size or cache can flip a token now and then, and the rest of that rollout with it.
    record_entropy (sampling only): Rollouts.entropy holds the entropy of softmax(logits / T) at every
    generated position, recorded while decoding (see the module docstring).
    cache: how `generate` keeps its keys and values, the same samples every way up to float rounding
    (bit for bit on a CPU in float32; see batch_size for bf16 on a GPU). Under autocast the cache holds
    keys and values in the autocast dtype (_rotary_in_autocast_dtype says why):
      prefix  [ours] the decoder runs once over each prompt and its KV cache is copied to the prompt's
              G rows, instead of G identical prefills (the default: measured faster, experiments/speed.md)
      plain   transformers' default dynamic cache, every row prefilled on its own
      static  a preallocated static cache: on a GPU transformers then compiles the decode step
    Raises NonFiniteLogits when the model's logits hold a NaN or inf while sampling (Sampler marks them
    on the device; they are read once per generate call, after it returns).
    """
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
        raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 or None (all rows at once)")
    if cache not in CACHES:
        raise ValueError(f"cache={cache!r} must be one of {', '.join(CACHES)}")
    if record_entropy and not (temperature > 0 and top_p == 1):
        raise ValueError("record_entropy needs plain sampling (temperature > 0, top_p = 1): it records the entropy "
                         "of softmax(logits / T)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed={seed!r} must be an integer or None (draw one from torch's generator)")
    if seed is not None and temperature > 0 and top_p < 1:
        raise ValueError(f"seed={seed} with top_p={top_p}: nucleus sampling uses generate's own sampler, which "
                         f"draws from torch's global generator; leave seed=None and seed torch "
                         f"(eval.evaluate(seed=...) does)")
    if isinstance(first_row, bool) or not isinstance(first_row, int) or first_row < 0:
        raise ValueError(f"first_row={first_row!r} must be an integer >= 0")

    stop_ids = stop_token_ids(model, tokenizer)
    # [ours] a tokenizer without a pad token (Llama) pads with its first stop id; harmless, since
    # padding is found by position and masked out.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    device = next(model.parameters()).device

    prompt_ids, prompt_mask = _encode_left_padded(tokenizer, prompts, pad_id)  # (n, P)
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0).to(device)  # (B, P) group by group
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0).to(device)
    group = torch.arange(len(prompts), device=device).repeat_interleave(group_size)  # (B,)
    B, P = prompt_ids.shape

    own_sampler = temperature > 0 and top_p == 1
    if own_sampler and seed is None:
        seed = draw_seed()  # one per call, before anything else draws
    config = clean_generation_config(max_new_tokens, stop_ids, pad_id, temperature, top_p, cache)

    share = cache == "prefix" and group_size > 1 and P > 1
    step = B if batch_size is None else batch_size
    if share:  # whole groups per call, so that a prompt's rows share its cache
        step = max(group_size, step // group_size * group_size)
    hooks = _rotary_in_autocast_dtype(model, device)  # under autocast: a KV cache in the autocast dtype
    was_training, checkpoint_config = model.training, model.generation_config
    model.eval()
    # generate fills every field `config` leaves unset from model.generation_config: make that blank
    model.generation_config = GenerationConfig()
    chunks, entropies = [], []
    try:
        with torch.no_grad():
            for s in range(0, B, step):
                sampler = Sampler(temperature, seed, first_row + s) if own_sampler else None
                extra = {}
                if share:
                    extra["cache"] = prefill(model, prompt_ids[s:s + step:group_size],
                                             prompt_mask[s:s + step:group_size], group_size)
                out = model.generate(
                    input_ids=prompt_ids[s:s + step], attention_mask=prompt_mask[s:s + step], generation_config=config,
                    logits_processor=LogitsProcessorList([sampler] if sampler else []), **extra,
                )  # (b, P + t), t <= max_new_tokens: generate stops early once every row has stopped
                if sampler is not None:
                    sampler.check_finite()  # NaN or inf logits are an error, not samples
                chunks.append(out[:, P:])
                if record_entropy:
                    entropies.append(torch.stack(sampler.entropy, dim=1))  # (b, t)
    finally:
        for hook in hooks:
            hook.remove()
        model.generation_config = checkpoint_config
        model.train(was_training)

    T = max(c.shape[1] for c in chunks)
    completion_ids = torch.full((B, T), pad_id, dtype=torch.long, device=device)  # (B, T)
    entropy = torch.zeros((B, T), dtype=torch.float32, device=device) if record_entropy else None
    for i, (s, c) in enumerate(zip(range(0, B, step), chunks)):
        completion_ids[s:s + c.shape[0], :c.shape[1]] = c
        if record_entropy:
            entropy[s:s + c.shape[0], :c.shape[1]] = entropies[i]
    mask = completion_mask(completion_ids, stop_ids)  # (B, T)
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=device))
    truncated = ~(is_stop & mask).any(dim=1)  # (B,) the only stop token a row can have in its mask is the last
    completion_ids = completion_ids.masked_fill(~mask, pad_id)

    # The text is the answer without its stop token; a truncated row keeps all its tokens.
    keep = mask & ~is_stop  # (B, T)
    texts = tokenizer.batch_decode([row[k].tolist() for row, k in zip(completion_ids.cpu(), keep.cpu())],
                                   skip_special_tokens=True)
    if entropy is not None:
        entropy = entropy.masked_fill(~mask, 0.0)  # after the stop token: padding
    return Rollouts(prompt_ids, prompt_mask, completion_ids, mask, truncated, group, texts, entropy)


def _rotary_in_autocast_dtype(model, device):
    """Forward hooks, to remove after generating, that cast the rotary embedding's cos and sin to the
    autocast dtype (none when autocast is off on device).

    Why: under --dtype auto the weights and the residual stream are float32, and the rotary embedding
    returns cos and sin in the dtype of the residual stream (float32), while q_proj, k_proj and
    v_proj return the autocast dtype (bf16). q * cos then promotes the queries and keys to float32,
    so the KV cache would hold float32 keys beside bf16 values (1.5x the memory of a bf16 cache) and
    every decode step would cast them back for attention. In bf16, cos and sin are what a model with
    bf16 weights uses (transformers casts them to the weights' dtype), and the cache is all bf16. Only
    generation is hooked: the training forward (completion_hidden) keeps no cache and is unchanged."""
    if not torch.is_autocast_enabled(device.type):
        return []
    dtype = torch.get_autocast_dtype(device.type)

    def cast(module, args, out):  # (cos, sin)
        return tuple(x.to(dtype) for x in out)
    return [m.register_forward_hook(cast) for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def prefill(model, prompt_ids, prompt_mask, group_size):
    """The KV cache of every prompt but its last token, computed once per prompt (prompt_ids (n, P))
    and repeated for its group_size rows: generate then runs only the last prompt token and the decode.
    The decoder body alone: no lm_head over the prompt."""
    kv = DynamicCache(config=model.config)
    positions = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # as generate derives them from the mask
    model.get_decoder()(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
                        position_ids=positions[:, :-1], cache=kv, use_cache=True)
    kv.batch_repeat_interleave(group_size)  # (n, ...) -> (n * group_size, ...), group by group
    return kv


def _chunk_logprobs(head, hidden, targets, temperature, with_entropy):
    """(n, H) hidden states -> logp of targets (n,) and entropy (n,) or None, in float32 (float64 for a
    float64 model)."""
    # The lm_head itself in float32, with the caller's autocast off: under bf16 autocast it would return
    # bf16 logits, rounded to an 8-bit mantissa (+-0.06 at |logit| 16-32) before any float32 cast, and
    # every log-prob, entropy, ratio and KL would carry that rounding. With --dtype auto the weights are
    # the float32 masters and the hidden states the float32 residual stream (after the final norm), so
    # nothing is cast; bf16 weights (--dtype bfloat16) are upcast, one chunk at a time.
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    bias = getattr(head, "bias", None)
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        logits = F.linear(hidden.to(dtype), head.weight.to(dtype), bias) / temperature  # (n, V)
    logp_all = torch.log_softmax(logits, dim=-1)  # (n, V)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n,)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # step 5: no gradient through H
            entropy = -(logp_all.exp() * logp_all).sum(dim=-1)  # (n,)
    return logp, entropy


def completion_hidden(model, input_ids, attention_mask, completion_start):
    """The decoder's last hidden states that predict the completion tokens: (B, T, H), T = L - completion_start.

    input_ids, attention_mask: (B, L), left-padded prompt then completion. The state at position
    completion_start - 1 + t predicts completion token t.
    """
    L = input_ids.shape[1]
    if not 1 <= completion_start <= L:
        raise ValueError(f"completion_start={completion_start} must be in [1, {L}] (the prompt needs a token)")
    # A plain forward does not derive positions from the mask; generate does. Give the same ones, so
    # a left-padded row is scored at the positions it was generated at.
    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, L)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state  # (B, L, H)
    return hidden[:, completion_start - 1:L - 1]  # (B, T, H)


def head_logprobs(model, hidden, targets, positions=None, temperature=1.0, with_entropy=False,
                  chunk_size=CHUNK_SIZE):
    """log pi(target) (B, T) and the entropy (B, T) or None, computed only where `positions` (B, T)
    bool is True (None: everywhere) and 0 elsewhere. hidden (B, T, H) from completion_hidden,
    targets (B, T) the completion ids. float32 (float64 for a float64 model, so that tests can compare
    without float32 rounding), the lm_head included: it runs in float32 with autocast off, so the
    logits are never rounded to bf16. It runs on chunks of chunk_size positions, each
    checkpointed when grad is on: only the (chunk, H) inputs are kept, never (chunk, V) logits."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 to score tokens (greedy has no log-probs)")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be an integer >= 1")
    B, T = targets.shape
    if positions is None:
        positions = torch.ones((B, T), dtype=torch.bool, device=targets.device)
    h, y = hidden[positions], targets[positions]  # (n, H), (n,): only the positions asked for
    head = model.get_output_embeddings()  # lm_head: logits = head(hidden), as in Qwen2 / Llama
    logps, entropies = [], []
    for s in range(0, y.shape[0], chunk_size):
        args = (head, h[s:s + chunk_size], y[s:s + chunk_size], temperature, with_entropy)
        if torch.is_grad_enabled():
            # Autograd would keep each chunk's (chunk, V) log-softmax for the backward pass, i.e. the
            # full logits after all. Checkpointing keeps only the (chunk, H) hidden states and
            # recomputes one chunk's logits at a time during backward. (The entropy is under no_grad
            # and after the last op that saves a tensor, so torch's early stop skips it on recompute.)
            logp, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logp, entropy = _chunk_logprobs(*args)
        logps.append(logp)
        entropies.append(entropy)
    zeros = torch.zeros((B, T), dtype=torch.promote_types(hidden.dtype, torch.float32), device=targets.device)
    if not logps:  # no position asked for
        return zeros, (zeros.clone() if with_entropy else None)
    logp = zeros.masked_scatter(positions, torch.cat(logps))  # (B, T), with grad where computed
    entropy = zeros.masked_scatter(positions, torch.cat(entropies)) if with_entropy else None
    return logp, entropy

