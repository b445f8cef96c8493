"""
Rollouts for GRPO/D3S: sample groups of completions, mark which tokens are real, and score tokens.

Step 1 (docs/algorithm.md), generate_groups: G completions per prompt, group by group, each with a
mask up to and including its first stop token (completion_mask) and a truncated flag, from decode:
each prompt prefilled once into a static KV cache of its G rows, then one token at a time (after
nanochat's engine and gpt-fast; compiled on a GPU). machinery/sampling.py holds the step beneath:
every token is drawn from exactly softmax(logits / T) with random numbers that are a pure function
of (seed, row, position), so whatever the batch or engine (HF `generate` is the reference) a row's
sample is a function of its logits, equal across them up to the logits' rounding. Step 5,
completion_hidden then head_logprobs: log pi(y_t | x, y_<t) of each completion token and the
entropy H_t of softmax(logits / T), the lm_head in float32 and in checkpointed chunks, so that
nothing ever holds the (B, T, V) float32 logits (V = 151,936 for Qwen2.5).
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from machinery.sampling import (SYNC_EVERY, check_finite, check_generate_args, decode_step,
                                draw_seed, encode_left_padded, fill_rows, first_bad,
                                generation_mode, gqa_decoding, head_logits, hf_generate, prefill,
                                row_keys, sample, static_cache)

# [ours] lm_head positions per chunk, counted over the micro-batch (only the positions asked for).
# A chunk briefly holds a few (chunk, V) float32 tensors (logits, log-softmax, probabilities, their
# gradients): for V = 151,936, 2.5 GB each, at the peak 7.0 GiB in the gradient pass and 9.3 GiB in
# the no-grad pass with the entropy (experiments/memory.py), whatever the batch and lengths.
# Smaller chunks save memory but barely time; lower it on a small GPU.
CHUNK_SIZE = 4096


@dataclass
class Rollouts:
    """B = len(prompts) * group_size completions, group by group, on the model's device."""
    prompt_ids: torch.Tensor       # (B, P) long, left-padded
    prompt_mask: torch.Tensor      # (B, P) long, 1 on real prompt tokens
    completion_ids: torch.Tensor   # (B, T) long, pad id after the first stop token
    completion_mask: torch.Tensor  # (B, T) bool, generated tokens up to and with the first stop
    truncated: torch.Tensor        # (B,) bool, no stop token within max_new_tokens
    group: torch.Tensor            # (B,) long, index of the prompt each row answers
    texts: list[str]               # B str, decoded completions without the stop / special tokens
    entropy: Optional[torch.Tensor] = None  # (B, T) float32, the sampler's (record_entropy=True)
    decoded: int = 0  # row-positions decoded: rows x decode steps, summed over the calls

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
        """The rows `index` (a list or a long tensor), e.g. those kept by sample selection."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.group.device)
        return Rollouts(self.prompt_ids[index], self.prompt_mask[index], self.completion_ids[index],
                        self.completion_mask[index], self.truncated[index], self.group[index],
                        [self.texts[i] for i in index.tolist()],
                        None if self.entropy is None else self.entropy[index])

    def piece(self, rows, columns=None):
        """(input_ids, attention_mask, completion_start, width) of the rows `rows`, cut to their own
        span: from the first column where any has a real prompt token to the last of the completion
        columns each needs, columns (B,) (None: all), later ones masked as padding. Positions come
        from the mask (completion_hidden): dropping all-padding columns changes no value."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.group.device)
        cols = (self.lengths if columns is None else columns)[rows]  # (n,)
        prompt_mask, width = self.prompt_mask[rows], int(cols.max()) if len(rows) else 0
        first = int(prompt_mask.any(dim=0).long().argmax())  # left padding shared by all these rows
        upto = torch.arange(width, device=cols.device) < cols[:, None]  # (n, width) each own cut
        return (torch.cat([self.prompt_ids[rows, first:], self.completion_ids[rows, :width]], 1),
                torch.cat([prompt_mask[:, first:], (self.completion_mask[rows, :width] & upto)
                           .long()], 1), self.completion_start - first, width)


@dataclass
class Piece:
    """A micro-batch of rollouts, cut to its own span (Rollouts.piece), for a forward pass."""
    rows: torch.Tensor            # (n,) indices into the rollouts
    input_ids: torch.Tensor       # (n, L)
    attention_mask: torch.Tensor  # (n, L)
    start: int                    # first completion column of input_ids
    width: int                    # completion columns: the (n, width) slice of (N, T)


def micro_batches(kept, rows, size, columns=None):
    """The rollouts `rows` of `kept` in micro-batches of at most `size`, longest first, each cut to
    its own span, so a short rollout never pays for a long one's padding [ours]; columns (N,): each
    row's columns to forward (d3s.needed_columns; None: all), a row with 0 left out."""
    cols = kept.lengths if columns is None else columns
    rows = rows[cols[rows] > 0]
    order = rows[torch.argsort(kept.prompt_mask[rows].sum(dim=1) + cols[rows], descending=True,
                               stable=True)]
    return [Piece(r, *kept.piece(r, cols)) for r in order.split(size) if len(r)]


def stop_token_ids(model, tokenizer):
    """Sorted list of every token id that ends a completion: the model's
    generation_config.eos_token_id (int or list) and the tokenizer's eos_token_id. [ours] Plus
    <|im_end|> whenever the tokenizer has a chat template and knows that token: our prompts are
    ChatML (data.format_prompt), so even a base Qwen model, whose generation_config names only
    <|endoftext|>, ends its turn with <|im_end|>."""
    ids = set()
    for eos in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        ids.update([] if eos is None else [eos] if isinstance(eos, int) else map(int, eos))
    if getattr(tokenizer, "chat_template", None):
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            ids.add(im_end)
    if not ids:
        raise ValueError("stop_token_ids: neither model.generation_config.eos_token_id nor "
                         "tokenizer.eos_token_id is set; set one so that completions can end")
    return sorted(ids)


def completion_mask(completion_ids, stop_ids):
    """True on every token up to and including the first stop token of its row, False after it:
    found by position (no stop token strictly before), so a pad id that is also a stop id (Qwen2.5
    pads with <|endoftext|>, the base models' EOS) is handled, and a pad id that the model really
    generated before stopping stays a real token."""
    stop_ids = torch.as_tensor(stop_ids, device=completion_ids.device)
    is_stop = torch.isin(completion_ids, stop_ids)  # (B, T)
    stops_before = is_stop.long().cumsum(dim=1) - is_stop.long()  # (B, T) stops strictly before t
    return stops_before == 0


def generate_groups(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0,
                    top_p=1.0, batch_size=None, record_entropy=False, engine="loop", seed=None,
                    first_row=0, stop=None):
    """Step 1: `group_size` completions for each prompt, group by group. Returns a Rollouts.

    engine: loop (decode, below) or hf (transformers' generate, the reference): the same samples
    up to rounding. temperature 0 is greedy (evaluation); > 0 with top_p 1 samples from exactly
    softmax(logits / T) (sampling.sample): of model.generation_config only its EOS ids are used.
    top_p < 1 (eval.py) is generate's own nucleus sampler, from torch's generator (no seed). seed:
    None draws one from torch's generator (machinery/sampling.py says what a seed guarantees).
    first_row: this call's first row in a larger batch the caller splits over calls (eval.py).
    batch_size: rows per call (None = all). record_entropy: Rollouts.entropy holds the sampler's.
    stop: machinery/stops.Stop, whose flag ends every row early (a signal came). Raises
    NonFiniteLogits on NaN or inf logits (but with top_p < 1)."""
    check_generate_args(**locals())  # ValueError on a bad argument (machinery/sampling.py)
    stop_ids = stop_token_ids(model, tokenizer)
    # [ours] no pad token (Llama): pad with the first stop id, harmless since found by position
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (x.to(device) for x in encode_left_padded(tokenizer, prompts, pad_id))
    group = torch.arange(len(prompts), device=device).repeat_interleave(group_size)  # (B,)
    B, sampled = len(group), temperature > 0 and top_p == 1
    seed = draw_seed() if sampled and seed is None else seed  # one a call, before other draws
    calls = []
    with generation_mode(model, device):  # eval, no grad, a blank model.generation_config
        for s in range(0, B, batch_size or B):
            rows = torch.arange(s, min(s + (batch_size or B), B), device=device)  # (b,)
            if engine == "hf" or top_p < 1:
                calls.append(hf_generate(model, prompt_ids[group[rows]], prompt_mask[group[rows]],
                                         max_new_tokens, stop_ids, pad_id, temperature, top_p,
                                         seed, first_row + s, stop))
                continue
            used, prompt_of = group[rows].unique(return_inverse=True)  # each prompt once
            keys = row_keys(seed, rows + first_row) if sampled else None
            *call, bad = decode(model, prompt_ids[used], prompt_mask[used], prompt_of,
                                max_new_tokens, stop_ids, pad_id, temperature, keys, stop)
            check_finite(bad, first_row + s)  # NaN or inf logits are an error, not samples
            calls.append(call)

    # each call padded to the longest, then cut to the longest completion (a loop may run on)
    T = max(ids.shape[1] for ids, _ in calls)
    completion_ids = torch.cat([F.pad(ids, (0, T - ids.shape[1]), value=pad_id)
                                for ids, _ in calls])
    mask = completion_mask(completion_ids, stop_ids)  # (B, T)
    T = int(mask.sum(dim=1).max())
    completion_ids, mask = completion_ids[:, :T], mask[:, :T]
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=device))
    truncated = ~(is_stop & mask).any(dim=1)  # (B,) the only stop in a row's mask is its last
    completion_ids = completion_ids.masked_fill(~mask, pad_id)

    keep = mask & ~is_stop  # (B, T) the text: without the stop token (a truncated row: all)
    answers = [row[k].tolist() for row, k in zip(completion_ids.cpu(), keep.cpu())]
    texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
    entropy = None if not record_entropy else torch.cat(  # (B, T), 0 after the stop token
        [F.pad(e, (0, max(0, T - e.shape[1])))[:, :T] for _, e in calls]).masked_fill(~mask, 0)
    return Rollouts(prompt_ids[group], prompt_mask[group], completion_ids, mask, truncated, group,
                    texts, entropy, sum(ids.numel() for ids, _ in calls))


def decode(model, prompt_ids, prompt_mask, prompt_of, max_new_tokens, stop_ids, pad_id,
           temperature, keys, stop=None):
    """Step 1's decode loop (after gpt-fast's generate.py, nanochat's engine) for the rows prompt_of
    (b,) of the prompts (n, P): each prompt prefilled once into a static KV cache, then one token a
    step through it (sampling.one_token; compiled on a GPU, over a cache kept for the run). ->
    tokens (b, t), entropy (b, t), each row's first position with NaN or inf logits (-1: none)."""
    b, N, device = len(prompt_of), max_new_tokens, prompt_ids.device
    cache = static_cache(model, b, prompt_ids.shape[1], N, temperature == 0)
    prompt_of, keys = fill_rows(prompt_of, cache), fill_rows(keys, cache)  # (R,): R = b on a CPU
    pad, last, hidden = prefill(model, prompt_ids, prompt_mask, prompt_of, cache, N)
    token, h, nonfinite = sample(head_logits(model, hidden), keys, 0, temperature)  # t = 0
    R, stops, step = len(prompt_of), torch.tensor(stop_ids, device=device), decode_step(model, N)
    tokens, entropy = torch.full((R, N), pad_id, device=device), torch.zeros((R, N), device=device)
    done = torch.zeros(R, dtype=torch.bool, device=device)  # (R,) rows that stopped
    bad = torch.full((R,), -1, device=device)  # (R,) first position with NaN or inf logits
    sync_every = 1 if device.type == "cpu" else SYNC_EVERY  # a CPU's sync costs nothing
    with gqa_decoding(model):  # attention over the cache, each key and value read once
        for t in range(N):
            tokens[:, t] = token = token.masked_fill(done, pad_id)  # a stopped row gets padding
            entropy[:, t], bad = h, first_bad(bad, nonfinite, t)
            done |= torch.isin(token, stops)
            signal = stop is not None and stop.first is not None  # the caller drops these rows
            if t + 1 == N or signal or (t + 1) % sync_every == 0 and done.all():
                break  # the budget, a signal, or every row stopped (a host sync: rare on a GPU)
            token, h, nonfinite = step(model, cache, pad, token, last, keys, t + 1, temperature)
    return tokens[:b, :t + 1], entropy[:b, :t + 1], bad[:b]


def _chunk_logprobs(head, hidden, targets, temperature, with_entropy):
    """(n, H) hidden states -> logp of targets (n,) and entropy (n,) or None, in float32 (float64
    for a float64 model)."""
    # The lm_head in float32, the caller's autocast off: bf16 logits are rounded to an 8-bit
    # mantissa (+-0.06 at |logit| 16-32), and every log-prob, entropy, ratio and KL would carry it.
    # With --dtype auto the weights (float32 masters) and hidden states (the float32 residual
    # stream) need no cast; bf16 weights (--dtype bfloat16) are upcast, one chunk at a time.
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
    """The decoder's last hidden states that predict the completion tokens, (B, T, H) with
    T = L - completion_start: of input_ids, attention_mask (B, L), left-padded prompt then
    completion, the state at position completion_start - 1 + t predicts completion token t."""
    L = input_ids.shape[1]
    if not 1 <= completion_start <= L:
        raise ValueError(f"completion_start={completion_start} must be in [1, {L}] "
                         f"(the prompt needs a token)")
    # A plain forward does not derive positions from the mask; generate does. Give the same ones,
    # so a left-padded row is scored at the positions it was generated at.
    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, L)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state
    return hidden[:, completion_start - 1:L - 1]  # (B, T, H) of the (B, L, H)


def head_logprobs(model, hidden, targets, positions=None, temperature=1.0, with_entropy=False,
                  chunk_size=CHUNK_SIZE):
    """log pi(target) (B, T) and the entropy (B, T) or None, computed only where `positions` (B, T)
    bool is True (None: everywhere) and 0 elsewhere. hidden (B, T, H) from completion_hidden,
    targets (B, T) the completion ids. float32 (float64 for a float64 model, so that tests can
    compare without float32 rounding), the lm_head included: it runs in float32 with autocast off,
    so the logits are never rounded to bf16. It runs on chunks of chunk_size positions, each
    checkpointed when grad is on: only the (chunk, H) inputs are kept, never (chunk, V) logits."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 to score tokens "
                         f"(greedy has no log-probs)")
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
            # autograd would keep every chunk's (chunk, V) log-softmax, the full logits after all:
            # checkpointing keeps the (chunk, H) inputs and recomputes one chunk at a time in
            # backward (the no_grad entropy comes last, so the recompute stops before it)
            logp, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logp, entropy = _chunk_logprobs(*args)
        logps.append(logp)
        entropies.append(entropy)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    zeros = torch.zeros((B, T), dtype=dtype, device=targets.device)
    if not logps:  # no position asked for
        return zeros, (zeros.clone() if with_entropy else None)
    logp = zeros.masked_scatter(positions, torch.cat(logps))  # (B, T), with grad where computed
    entropy = zeros.masked_scatter(positions, torch.cat(entropies)) if with_entropy else None
    return logp, entropy
