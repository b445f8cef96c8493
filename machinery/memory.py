"""
GPU memory of a train.py run, counted: a model's shape, its lengths and its method -> the peak of
each phase of a step, and the settings that fit a card. experiments/memory.py measured the
coefficients these counts take and prints the table experiments/speed.md holds.
"""
GiB = 2 ** 30

# The published config.json of each model: all Qwen2 (GQA, biases on q/k/v, SwiGLU MLP, RMSNorm).
SHAPES = {
    "Qwen2.5-0.5B": dict(vocab=151936, hidden=896, intermediate=4864, layers=24, heads=14,
                         kv_heads=2, tied=True),
    "Qwen2.5-1.5B": dict(vocab=151936, hidden=1536, intermediate=8960, layers=28, heads=12,
                         kv_heads=2, tied=True),
    "Qwen2.5-7B": dict(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28,
                       kv_heads=4, tied=False),
}
CARDS_GIB = (80, 40, 24, 16)
# [ours] What a card must keep free beside the predicted peak: the CUDA context and cuBLAS
# workspaces (0.5-1 GB, outside torch's counters), and a tenth for the caching allocator's
# fragmentation and what this count leaves out (small tensors, the optimizer's per-parameter
# scalars, the log's bookkeeping).
RESERVE_GIB, HEADROOM = 1.0, 0.10


def head_dim(s):
    return s["hidden"] // s["heads"]


def layer_params(s):
    """Parameters of one decoder layer: q/k/v (with bias), o, the SwiGLU MLP, two RMSNorm
    weights."""
    H, I = s["hidden"], s["intermediate"]
    q, kv = s["heads"] * head_dim(s), s["kv_heads"] * head_dim(s)
    return (H * q + q) + 2 * (H * kv + kv) + q * H + 3 * H * I + 2 * H


def param_count(s):
    """All parameters: the embedding, the layers, the final norm, and the lm_head unless it is
    tied."""
    embed = s["vocab"] * s["hidden"]
    return embed + s["layers"] * layer_params(s) + s["hidden"] + (0 if s["tied"] else embed)


def layer_act_bytes(s, length):
    """Bytes one decoder layer keeps for backward per token, under bf16 autocast with float32
    weights and residual stream, for rows of `length` tokens with a padding mask (every real batch
    has one).
    The inventory of what autograd saves (tests/test_memory.py checks it against a measurement):
      2 RMSNorms        8H + 4 each: the float32 input and normalised input, and 1 / rms
      5 matmul inputs   2H each: q, k, v, gate and up each cast their own bf16 copy of the input
      attention         2 x nh x d each for q, k and v (k, v repeated to all heads: with a mask,
                        transformers calls SDPA without enable_gqa), and for the output, which
                        o_proj reuses; 4 x nh for the log-sum-exp; 2 x length for the mask,
                        converted to bf16 by every layer's SDPA
      MLP               2I each: gate's output, silu's output, up's output, their product (down's
                        input)
    """
    H, I, nh, d = s["hidden"], s["intermediate"], s["heads"], head_dim(s)
    return 2 * (8 * H + 4) + 5 * 2 * H + 4 * 2 * nh * d + 4 * nh + 2 * length + 4 * 2 * I


def base_act_bytes(s):
    """Bytes per token kept outside the layers: the final RMSNorm (8H + 4), its float32 output (the
    hidden states, 4H), the rotary cos and sin (float32, 4d each) and the int64 input ids."""
    return 12 * s["hidden"] + 4 + 8 * head_dim(s) + 8


def kv_bytes_per_token(s, key_bytes=2, value_bytes=2):
    """KV cache bytes per token over all layers (bf16 keys and values under autocast)."""
    return s["layers"] * s["kv_heads"] * head_dim(s) * (key_bytes + value_bytes)


def predict(s, micro_batch_size, logprob_chunk, gradient_checkpointing, gen_rows, m, prompt_len=240,
            new_tokens=512, updates_per_batch=4):
    """Peak bytes of each phase of a train.py step for model shape s, from the measured
    coefficients m (measure() returns them, each per position, row or token in units of the
    vocabulary V, the width H or layer_act_bytes, so that it carries over to other model sizes).
    gen_rows: rows per generate call.
      generate  step 1 and the held-out evaluation: weights and moments, autocast's bf16 copies (the
                lm_head's too: generate's own head runs under autocast), then the larger of a
                prefill of gen_rows prompts (evaluation's plain cache; sampling's prefix cache
                prefills 1 in G) and the full KV cache of gen_rows rows of prompt_len + new_tokens
                with each row's decode step (logits and sampler)
      no_grad   step 5 (logp_old and the entropy): the decoder's transient, then one head chunk with
                the entropy
      update    step 7 on a micro-batch after the first of its mini-batch (the gradients exist). On
                top of the activations every layer keeps (with gradient checkpointing: each layer's
                input) come, one after the other: the head chunk's forward and backward (the larger
                of two moments: the lm_head's (V, H) float32 gradient with one (chunk, V) tensor, or
                the log-softmax's backward with three); a layer's backward (recomputed first with
                checkpointing); with the activations freed, the embedding's backward. With K = 1 and
                one micro-batch, step 5's head with the entropy runs on top of the activations too.
    Returns each phase's peak and the largest, in bytes."""
    V, H, N = s["vocab"], s["hidden"], param_count(s)
    # a micro-batch of the longest rollouts: the longest prompt, all truncated
    L = prompt_len + new_tokens
    n, tokens = micro_batch_size, micro_batch_size * L
    chunk = min(logprob_chunk, n * new_tokens)  # GRPO keeps every completion token: the worst case
    act = layer_act_bytes(s, L)
    # autocast's bf16 copies of the layers' weights
    cache_layers = 2 * s["layers"] * layer_params(s)
    weights_moments, grads = 12 * N, 4 * N
    prefill = gen_rows * prompt_len * (m["no_grad_decoder"] * act + kv_bytes_per_token(s))
    decode = gen_rows * (L * kv_bytes_per_token(s) + m["decode_per_row"] * V)
    gen = weights_moments + cache_layers + 2 * V * H + max(prefill, decode)
    entropy_head = chunk * m["entropy_head_per_position"] * V
    no_grad = weights_moments + cache_layers + max(tokens * m["no_grad_decoder"] * act,
                                                   entropy_head)
    with_weight_grad = m["head_weight_grad"] * 4 * V * H
    head = max(with_weight_grad + chunk * m["head_with_weight_grad_per_position"] * V,
               chunk * m["head_per_position"] * V)
    kind = "checkpointed" if gradient_checkpointing else "plain"
    per_layer = m["checkpointed_per_token"] * H if gradient_checkpointing else act
    # + the head's inputs
    held = tokens * (base_act_bytes(s) + s["layers"] * per_layer) + n * new_tokens * 4 * H
    # a layer's backward: per token, plus (tied embeddings) the lm_head's (V, H) gradient, which
    # autograd holds until the embedding's arrives to be summed with it, plus [ours, a bound] one
    # layer's weight gradients in bf16 and float32 at once
    layer_backward = (tokens * m[kind + "_backward"] * act + (4 * V * H if s["tied"] else 0)
                      + 6 * layer_params(s))
    moments = [held + head, held + layer_backward, m["embedding_backward"] * 4 * V * H]
    if updates_per_batch == 1:
        moments.append(held + entropy_head)
    update = weights_moments + grads + cache_layers + max(moments)
    return {"generate": gen, "no_grad": no_grad, "update": update,
            "peak": max(gen, no_grad, update),
            "parts": {"weights, gradients, moments": weights_moments + grads,
                      "bf16 copies": cache_layers, "activations": held, "head chunk": head,
                      "a layer's backward": layer_backward,
                      "KV cache": gen_rows * L * kv_bytes_per_token(s)}}


def fits(peak_bytes, card_gib):
    """Does a predicted peak fit a card, with RESERVE_GIB and HEADROOM kept free?"""
    return peak_bytes * (1 + HEADROOM) + RESERVE_GIB * GiB <= card_gib * GiB


def settings_for(s, card_gib, m, rollouts=256, checkpointing=(False, True), **lengths):
    """The settings for a card, or None when nothing fits. [ours] In this order of preference: no
    gradient checkpointing (it runs every layer's forward twice), then the largest micro-batch, then
    the largest lm_head chunk (it barely changes the time); the largest generate call that fits (0 =
    all rollouts at once)."""
    for gc in checkpointing:
        for micro in (16, 8, 4, 2, 1):
            for chunk in (4096, 2048, 1024, 512, 256):
                for gen in (0, 128, 64, 32, 16):
                    p = predict(s, micro, chunk, gc, gen or rollouts, m, **lengths)
                    if fits(p["peak"], card_gib):
                        return {"micro_batch_size": micro, "gen_batch_size": gen,
                                "logprob_chunk": chunk, "gradient_checkpointing": gc, **p}
    return None
