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
  token_logprobs   step 5. log pi(y_t | x, y_<t) of each completion token (with gradient when enabled)
                   and the entropy H_t = -sum_v p_v log p_v of p = softmax(logits / T) over the full
                   vocabulary (never with gradient). In two parts that the training loop also calls
                   one by one: completion_hidden runs the decoder body once; head_logprobs runs the
                   lm_head and the float32 softmax only at the positions asked for (the kept tokens,
                   say), in chunks, each inside activation checkpointing, so neither the forward nor
                   autograd ever holds the (B, T, V) float32 logits (V = 151,936 for Qwen2.5).

[ours] generate_groups(record_entropy=True) also records, at every decode step, the entropy of the
distribution it samples from, softmax(logits / T) over the full vocabulary (Sampler): the step line
logs it, and when the kept rollouts need several micro-batches it is the entropy of token selection
(step 6), so no extra full-vocabulary forward pass is needed. The cached decode computes the same
function as the training forward in another order of floating-point operations; on the tiny model
the two entropies differ by at most 2.4e-6 in float32 (tests/test_updates.py measures it).

[ours] Sampling is exactly softmax(logits / T): Sampler draws the tokens, and every knob a
checkpoint's generation_config.json may set is switched off (Qwen2.5 instruct ships top_k=20 and
repetition_penalty=1.05, and transformers' own default is top_k=50), because the policy gradient
scores samples with token_logprobs, which knows only T. A different sampler would make the rollouts
off-policy without saying so. (eval.py's top_p < 1 uses generate's own sampler with those knobs off.)
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

# [ours] Default token positions per lm_head chunk, counted over the whole micro-batch (only the
# positions asked for: real completion tokens, never padding). Each chunk briefly holds a few
# (chunk, V) float32 tensors (logits, log-softmax, probabilities; their gradient in backward), 4 bytes
# per entry: for Qwen's V = 151,936 and chunk = 4096 that is 4096 * 151,936 * 4 B = 2.5 GB per tensor,
# ~10 GB at the peak, whatever the batch and completion length (the full logits of 16 rollouts of 4096
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
        (token_logprobs), so dropping all-padding columns on either side changes no value."""
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


class Sampler(LogitsProcessor):
    """Draws every next token from exactly softmax(logits / T), the distribution step 5 scores the
    samples with, and records that distribution's entropy H at every decode step.

    generate then decodes greedily over what this returns: 0 at the drawn token, -inf elsewhere.
    generate runs custom processors before any warper of its own, so the scores here are the raw
    logits. [ours] The draw is by inverse CDF, one uniform number per row against the float64
    cumulative sum of the probabilities: the same distribution as generate's own torch.multinomial,
    which on a CPU costs 35 ms per decode step over a 151,936-token vocabulary (it is bound by
    random-number generation), against 4 ms here.
    """

    def __init__(self, temperature):
        self.temperature, self.entropy = temperature, []

    def __call__(self, input_ids, scores):
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (b, V)
        p = logp.exp()
        self.entropy.append(torch.special.entr(p).sum(dim=-1))  # (b,) -p log p, 0 where p = 0 (a -inf logit)
        cdf = p.double().cumsum(dim=-1)  # (b, V) float64: no rounding drift over 151,936 terms
        u = torch.rand(p.shape[0], 1, dtype=torch.float64, device=p.device) * cdf[:, -1:]  # uniform in [0, total)
        token = torch.searchsorted(cdf, u, side="right").clamp(max=p.shape[-1] - 1)  # (b, 1); never a p = 0 token
        return torch.full_like(scores, -math.inf).scatter_(-1, token, 0.0)


CACHES = ("prefix", "plain", "static")


def generate_groups(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
                    batch_size=None, record_entropy=False, cache="prefix"):
    """Step 1: `group_size` completions for each prompt, group by group. Returns a Rollouts.

    temperature == 0 means greedy decoding. batch_size caps the rows per `generate` call (None = all);
    every call sees the same left padding, so greedy results do not depend on it. record_entropy
    (sampling only): Rollouts.entropy holds the entropy of softmax(logits / T) at every generated
    position, recorded while decoding (see the module docstring).
    cache: how `generate` keeps its keys and values, the same samples every way (up to float rounding):
      prefix  [ours] the decoder runs once over each prompt and its KV cache is copied to the prompt's
              G rows, instead of G identical prefills (the default: measured faster, see README)
      plain   transformers' default dynamic cache, every row prefilled on its own
      static  a preallocated static cache: on a GPU transformers then compiles the decode step
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
    if temperature == 0 or own_sampler:
        sampling = dict(do_sample=False)  # greedy; with our Sampler, greedy over its one-hot scores
    else:
        # nucleus sampling (eval.py): generate's own sampler, exactly softmax(logits / T) + top_p, with
        # whatever generation_config.json asks for switched off
        sampling = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0,
                        typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        if model.generation_config.min_p is not None:
            sampling["min_p"] = 0.0
    knobs = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)  # both modes

    share = cache == "prefix" and group_size > 1 and P > 1
    step = B if batch_size is None else batch_size
    if share:  # whole groups per call, so that a prompt's rows share its cache
        step = max(group_size, step // group_size * group_size)
    was_training = model.training
    model.eval()
    chunks, entropies = [], []
    try:
        with torch.no_grad():
            for s in range(0, B, step):
                sampler = Sampler(temperature) if own_sampler else None
                extra = {"cache_implementation": "static"} if cache == "static" else {}
                if share:
                    extra["cache"] = prefill(model, prompt_ids[s:s + step:group_size],
                                                       prompt_mask[s:s + step:group_size], group_size)
                out = model.generate(
                    input_ids=prompt_ids[s:s + step], attention_mask=prompt_mask[s:s + step],
                    max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                    logits_processor=LogitsProcessorList([sampler] if sampler else []), **sampling, **knobs, **extra,
                )  # (b, P + t), t <= max_new_tokens: generate stops early once every row has stopped
                chunks.append(out[:, P:])
                if record_entropy:
                    entropies.append(torch.stack(sampler.entropy, dim=1))  # (b, t)
    finally:
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
    """(n, H) hidden states -> logp of targets (n,) and entropy (n,) or None, in float32."""
    logits = head(hidden).float() / temperature  # (n, V) float32, also for a bf16 model
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
    targets (B, T) the completion ids. The lm_head runs on chunks of chunk_size positions, each
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
    zeros = torch.zeros((B, T), dtype=torch.float32, device=targets.device)
    if not logps:  # no position asked for
        return zeros, (zeros.clone() if with_entropy else None)
    logp = zeros.masked_scatter(positions, torch.cat(logps))  # (B, T), with grad where computed
    entropy = zeros.masked_scatter(positions, torch.cat(entropies)) if with_entropy else None
    return logp, entropy


def token_logprobs(model, input_ids, attention_mask, completion_start, temperature=1.0, with_entropy=True,
                   chunk_size=CHUNK_SIZE, positions=None):
    """Step 5: per-token log-probs and entropies of the completion tokens input_ids[:, completion_start:].

    input_ids, attention_mask: (B, L), left-padded prompt then completion (Rollouts.input_ids /
    .attention_mask, or a Rollouts.piece). Returns logp (B, T) and entropy (B, T) or None,
    T = L - completion_start, float32. positions (B, T) bool: compute only there (0 elsewhere);
    None: every position, padding included (finite but meaningless values there: the caller masks them).
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 to score tokens (greedy has no log-probs)")
    hidden = completion_hidden(model, input_ids, attention_mask, completion_start)  # (B, T, H)
    return head_logprobs(model, hidden, input_ids[:, completion_start:], positions, temperature, with_entropy,
                         chunk_size)
