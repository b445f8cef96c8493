"""
GPU memory of a train.py run, counted: a model's shape, the run's lengths and method -> the peak of
each phase of a step, the settings that fit the memory free, and what out of memory lowers next.

    shape, job = memory.shape_of(model.config), memory.job_of(cfg, longest_prompt)
    memory.predict(shape, settings, job)         # each phase's peak, in bytes
    memory.choose(shape, job, free_bytes, given) # the `auto` knobs of the config block, or None
    memory.halve(kind, settings, rows, ...)      # what an out-of-memory pass lowers next

Pure functions of those numbers, no torch (but free_bytes, is_out_of_memory), so that the choice is
tested on a CPU. The coefficients are per position, row or token in units of the vocabulary V, the
width H or a layer's activations, measured once on a CPU under bf16 autocast by
experiments/memory.py, which also prints experiments/speed.md's table from these functions. Which
figure is measured, which counted and which computed: experiments/speed.md, "Memory by card size".
"""
import math
from dataclasses import dataclass

GiB = 2 ** 30

# `python experiments/memory.py --json out/memory.json` at commit 99cc27c (experiments/speed.md)
MEASURED = {"plain_backward": 0.202, "head_with_weight_grad_per_position": 4.02,
            "head_weight_grad": 1.0, "embedding_backward": 3.0, "head_per_position": 12.0,
            "no_grad_decoder": 0.581,
            "checkpointed_per_token": 4.0, "checkpointed_backward": 1.116, "decode_per_row": 34.0}
NO_GRAD_HEAD = 8.0  # V bytes a position of a no-grad head (logits, log-softmax): an estimate
# The published config.json of each model: all Qwen2 (GQA, biases on q/k/v, SwiGLU MLP, RMSNorm).
SHAPES = {
    "Qwen2.5-0.5B": dict(vocab=151936, hidden=896, intermediate=4864, layers=24, heads=14,
                         kv_heads=2, tied=True),
    "Qwen2.5-1.5B": dict(vocab=151936, hidden=1536, intermediate=8960, layers=28, heads=12,
                         kv_heads=2, tied=True),
    "Qwen2.5-7B": dict(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28,
                       kv_heads=4, tied=False),
}
# [ours] What the memory free must keep beside the predicted peak: cuBLAS and attention workspaces
# and the CUDA context where it is not counted yet (0.5-1 GB, outside torch's counters), and a tenth
# for the caching allocator's fragmentation and what this count leaves out (small tensors, the
# optimizer's per-parameter scalars, the log's bookkeeping).
RESERVE_GIB, HEADROOM = 1.0, 0.10
KNOBS = ("micro_batch_size", "gen_batch_size", "logprob_chunk", "gradient_checkpointing")
# [ours] The smallest log-prob chunk an out-of-memory halving goes to (below it the chunk's
# (chunk, V) tensors are a few MB; the next lever is gradient checkpointing), and those auto tries.
MIN_CHUNK, AUTO_CHUNKS = 16, (4096, 2048, 1024, 512, 256)
EVAL_ROWS = 256  # rows of train.py's held-out generation calls at --gen_batch_size 0
LORA_TARGETS = 7  # adapters per layer: q, k, v, o, gate, up, down (the LoRA knob's interface)
# The loop on a GPU (machinery/sampling.py) keeps KV_HELD = 1 (yes) its static KV caches for the
# run, one for step 1's rows and one for the evaluation's (one if they have as many rows), each
# MIN_WIDTH or the longest prompt rounded up to a power of two + max_new_tokens wide, and the pool
# of the CUDA graphs that replay its step (its logits and sampler: decode_per_row)
MIN_WIDTH, KV_HELD = 64, 1


def shape_of(config):
    """The shape this count needs, from a Qwen2 or Llama transformers config (or a dict of it)."""
    c = config if isinstance(config, dict) else {**vars(config), "model_type": config.model_type}
    heads, qwen = c["num_attention_heads"], c.get("model_type") == "qwen2"
    bias = c.get("attention_bias", qwen)  # Qwen2: biases on q, k and v; Llama: on all four, or none
    return dict(vocab=c["vocab_size"], hidden=c["hidden_size"],
                intermediate=c["intermediate_size"], layers=c["num_hidden_layers"], heads=heads,
                kv_heads=c.get("num_key_value_heads") or heads, tied=c["tie_word_embeddings"],
                head_dim=c.get("head_dim") or c["hidden_size"] // heads, qkv_bias=bias,
                o_bias=bias and not qwen, mlp_bias=c.get("mlp_bias", False))


def head_dim(s):
    return s.get("head_dim") or s["hidden"] // s["heads"]


def layer_params(s):
    """Parameters of one decoder layer: q/k/v (Qwen2: with bias), o, the SwiGLU MLP, two RMSNorm
    weights."""
    H, I = s["hidden"], s["intermediate"]
    q, kv = s["heads"] * head_dim(s), s["kv_heads"] * head_dim(s)
    qkv_bias, o_bias, mlp_bias = (s.get(k, d) for k, d in (("qkv_bias", True), ("o_bias", False),
                                                          ("mlp_bias", False)))
    return (H * q + 2 * H * kv + qkv_bias * (q + 2 * kv) + q * H + o_bias * H + 3 * H * I
            + mlp_bias * (2 * I + H) + 2 * H)


def param_count(s):
    """All parameters: the embedding, the layers, the final norm, and the lm_head unless it is
    tied."""
    embed = s["vocab"] * s["hidden"]
    return embed + s["layers"] * layer_params(s) + s["hidden"] + (0 if s["tied"] else embed)


def adapter_params(s, rank):
    """LoRA parameters of one decoder layer: rank x (in + out) for each of its seven linears."""
    H, I = s["hidden"], s["intermediate"]
    q, kv = s["heads"] * head_dim(s), s["kv_heads"] * head_dim(s)
    return rank * ((H + q) + 2 * (H + kv) + (q + H) + 2 * (H + I) + (I + H))


def layer_act_bytes(s, length, lora_rank=0):
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
    With LoRA (a frozen base, float32 adapters, also measured): the frozen linears keep no input,
    each adapter keeps its own bf16 copy of it (the same bytes, and o's 2 x nh x d more) and its
    rank-r output (2r); the norms keep no output for their frozen weights (8H less)."""
    H, I, nh, d = s["hidden"], s["intermediate"], s["heads"], head_dim(s)
    full = 2 * (8 * H + 4) + 5 * 2 * H + 4 * 2 * nh * d + 4 * nh + 2 * length + 4 * 2 * I
    return full + (2 * nh * d - 8 * H + LORA_TARGETS * 2 * lora_rank if lora_rank else 0)


def base_act_bytes(s):
    """Bytes per token kept outside the layers: the final RMSNorm (8H + 4), its float32 output (the
    hidden states, 4H), the rotary cos and sin (float32, 4d each) and the int64 input ids."""
    return 12 * s["hidden"] + 4 + 8 * head_dim(s) + 8


def kv_bytes_per_token(s, key_bytes=2, value_bytes=2):
    """KV cache bytes per token over all layers (bf16 keys and values under autocast)."""
    return s["layers"] * s["kv_heads"] * head_dim(s) * (key_bytes + value_bytes)


@dataclass
class Job:
    """What a run asks of memory besides its model's shape (job_of reads it from a run's config)."""
    prompt_len: int = 240      # the longest prompt, tokens (chat template included)
    new_tokens: int = 512      # max_new_tokens: every rollout cut there, the worst case
    rollouts: int = 256        # B = P x G sampled per step
    group_size: int = 8        # G
    eval_size: int = 500       # held-out prompts (a generation call holds at most EVAL_ROWS)
    token_share: float = 1.0   # the largest share of its tokens an update trains (rho_t)
    gspo_share: float = 0.0    # GSPO off-policy: the share in a no-grad head pass (the unkept)
    reference: bool = False    # beta > 0: a frozen reference's forward on every micro-batch
    lora_rank: int = 0         # 0: every weight trains
    weight_bytes: int = 4      # the weights (float32 masters), or the frozen base's under LoRA
    autocast: bool = True      # forward passes under 2-byte autocast (bf16, or float16 on a T4)
    moments: int = 2           # AdamW's two (SGD's momentum: one)
    kv_held: int = 1           # --generation loop: its caches and CUDA graphs are held for the
                               # run (machinery/sampling.py; hf: 0)


def job_of(cfg, prompt_len):
    """The Job of a train.py config (resolved: the keep ratios are those its method applies) whose
    longest prompt is prompt_len tokens. [ours] The longest, not a percentile: the micro-batches are
    sorted by length, so the first of a step holds its longest prompts, and over a run some step
    meets the data's longest."""
    B, M, K = cfg.prompts_per_step * cfg.group_size, cfg.minibatch_size, cfg.updates_per_batch
    off_policy = K > 1 or M > 0  # mini-batches 2..K have logp_old
    lora = getattr(cfg, "lora_rank", 0)
    return Job(prompt_len=prompt_len, new_tokens=cfg.max_new_tokens, rollouts=B,
               group_size=cfg.group_size, eval_size=cfg.eval_size,
               token_share=max(cfg.t_init, cfg.t_final),
               gspo_share=(1 - min(cfg.t_init, cfg.t_final)) * (cfg.loss == "gspo" and off_policy),
               reference=cfg.beta > 0, lora_rank=lora,
               weight_bytes=2 if lora or cfg.dtype == "bfloat16" else 4,
               autocast=cfg.dtype in ("auto", "float16"),
               moments=2 if cfg.optimizer == "adamw" else 1,
               kv_held=KV_HELD if cfg.generation == "loop" else 0)


def generation_rows(gen_batch_size, job):
    """Rows of the largest generation call: step 1's or the held-out evaluation's."""
    return max(step_and_eval_rows(gen_batch_size, job))


def step_and_eval_rows(gen_batch_size, job):
    """(rows of step 1's generation calls, rows of the held-out evaluation's largest)."""
    return (min(gen_batch_size or job.rollouts, job.rollouts),
            min(gen_batch_size or EVAL_ROWS, job.eval_size))


def linear_params(s):
    """Parameters of one decoder layer's linears (q, k, v, o and the MLP's): all but its norms."""
    return layer_params(s) - 2 * s["hidden"]


def predict(s, settings, job=Job(), m=MEASURED):
    """Peak bytes of each phase of a train.py step for model shape s, the KNOBS `settings` and the
    job, from the measured coefficients m.
      held      in every phase: weights and moments; under autocast the decode's copies of the
                weights in the autocast dtype (machinery/sampling.decode_weights: every linear's and
                the lm_head's, or LoRA's adapters'), refreshed each generation call; with the loop
                its kept KV caches (step 1's rows and the evaluation's, each its prompt width
                rounded up to a power of two + new_tokens) and [ours, an estimate] the pool of the
                CUDA graphs that replay its step, which keeps the step's logits and sampler (the
                coefficient measured with generate's step, a bound for the loop's) of the largest
                call
      generate  step 1 and the held-out evaluation: on top, the larger of a prefill of
                generation_rows prompts and (hf) generate's own KV cache of as many rows of
                prompt_len + new_tokens with its step's logits and sampler and its lm_head's
                autocast copy
      no_grad   step 7's logp_old (K > 1): autocast's bf16 copies of the layers' weights, then the
                decoder's transient, then one head chunk over the tokens the loss reads (GSPO's:
                every completion token); the entropy comes from the sampler, no pass of its own
      update    step 7 on a micro-batch after the first of its mini-batch (the gradients exist). On
                top of autocast's copies and the activations every layer keeps (with gradient
                checkpointing: each layer's input) come, one after the other: the head chunk's
                forward and backward over the tokens it trains (the larger of two moments: the
                lm_head's (V, H) float32 gradient with one (chunk, V) tensor, or the log-softmax's
                backward with three); a layer's backward (recomputed first with checkpointing);
                with the activations freed, the embedding's backward. And where the method has them:
                GSPO's no-grad head over the tokens not trained, the reference model's forward
                (beta > 0).
    LoRA (job.lora_rank, as the knob's interface says): the frozen base at job.weight_bytes a weight
    with no gradient, no moments and no autocast copies; the adapters at 16 bytes a parameter; no
    (V, H) gradient and no embedding backward, but the lm_head's float32 copy (4VH) in every head
    pass; the reference is the same model with its adapters off. Returns each phase's peak and the
    largest, in bytes, and the parts of the update."""
    V, H, layers, N = s["vocab"], s["hidden"], s["layers"], param_count(s)
    micro, gen, chunk, checkpointing = (settings[k] for k in KNOBS)
    T, L = job.new_tokens, job.prompt_len + job.new_tokens  # the longest prompt, all truncated
    n, tokens, lora = micro, micro * L, job.lora_rank > 0
    wb, A = job.weight_bytes, layers * adapter_params(s, job.lora_rank)
    trained, tb = (A, 4) if lora else (N, wb)  # adapters in float32
    weights = (N * wb if lora else 0) + trained * tb * (1 + job.moments)  # gradients freed
    ref = N * wb * (job.reference and not lora)  # a frozen copy; under LoRA the adapters go off
    cast = job.autocast and (lora or wb == 4)  # float32 weights under autocast
    copies = 2 * (A if lora else layers * layer_params(s)) * cast  # autocast's, in a forward
    decode_copies = 2 * (A if lora else layers * linear_params(s) + V * H) * cast
    f32_head = 4 * V * H * (wb < 4)  # head_logprobs' float32 copy of a 2-byte lm_head
    act = layer_act_bytes(s, L, job.lora_rank) * (1 if job.autocast or wb < 4 else 2)  # a bound
    kv = kv_bytes_per_token(s) * (1 if job.autocast or wb < 4 else 2)

    rows, (step_rows, eval_rows) = generation_rows(gen, job), step_and_eval_rows(gen, job)
    loop = job.kv_held > 0
    width = max(MIN_WIDTH, 2 ** math.ceil(math.log2(job.prompt_len))) + T
    caches = (step_rows + eval_rows * (eval_rows != step_rows)) * width * kv * loop
    step = rows * m["decode_per_row"] * V  # a decode step's logits and sampler
    held = weights + ref + decode_copies + caches + step * loop
    prefill = rows * job.prompt_len * (m["no_grad_decoder"] * act + kv)
    hf = (rows * L * kv + step + 2 * V * H * (job.autocast and wb == 4 and not lora)) * (not loop)
    generate = held + max(prefill, hf)
    base = held + copies
    def positions(share):  # a micro-batch's completion tokens that a head pass takes, chunked
        return min(chunk, math.ceil(share * n * T))
    read = positions(1 if job.gspo_share else job.token_share)  # logp_old where the loss reads it
    no_grad = base + max(tokens * m["no_grad_decoder"] * act, f32_head + read * NO_GRAD_HEAD * V)

    kept = positions(job.token_share)  # [ours] D3S's rho_t of them, as an expectation
    head = f32_head + max((0 if lora else m["head_weight_grad"] * 4 * V * H)
                          + kept * m["head_with_weight_grad_per_position"] * V,
                          kept * m["head_per_position"] * V)
    kind = "checkpointed" if checkpointing else "plain"
    per_layer = m["checkpointed_per_token"] * H if checkpointing else act
    acts = tokens * (base_act_bytes(s) + layers * per_layer) + n * T * 4 * H  # + the head's inputs
    # a layer's backward: per token, plus (tied embeddings) the lm_head's (V, H) gradient, which
    # autograd holds until the embedding's arrives to be summed with it, plus [ours, a bound] one
    # layer's weight gradients in bf16 and float32 at once
    layer_backward = (tokens * m[kind + "_backward"] * act + 4 * V * H * (s["tied"] and not lora)
                      + 6 * (A // layers if lora else layer_params(s)))
    moments = [acts + head, acts + layer_backward,
               0 if lora else m["embedding_backward"] * 4 * V * H]
    if job.gspo_share:
        moments.append(acts + f32_head + positions(job.gspo_share) * NO_GRAD_HEAD * V)
    if job.reference:
        moments.append(acts + max(tokens * m["no_grad_decoder"] * act,
                                  f32_head + kept * NO_GRAD_HEAD * V))
    update = base + trained * tb + max(moments)
    return {"generate": generate, "no_grad": no_grad, "update": update,
            "peak": max(generate, no_grad, update),
            "parts": {"weights, gradients, moments": weights + trained * tb + ref,
                      "bf16 copies": copies, "decode copies": decode_copies,
                      "activations": acts, "head chunk": head,
                      "a layer's backward": layer_backward, "KV caches": caches,
                      "CUDA graphs": step * loop}}


def fits(peak_bytes, free_bytes):
    """Does a predicted peak fit the memory free, with RESERVE_GIB and HEADROOM kept?"""
    return peak_bytes * (1 + HEADROOM) + RESERVE_GIB * GiB <= free_bytes


def candidates(job, ceiling=16):
    """Each knob's values, the most preferred first. [ours] In this order of preference: no gradient
    checkpointing (it runs every layer's forward twice), then the largest generation call (0: all
    rollouts at once; a decode step costs about as much for few rows as for all, so each extra call
    is a whole decode more), then the largest micro-batch (up to the config block's CPU value: auto
    only lowers), then the largest lm_head chunk (it barely changes the time)."""
    gens = [0] + halvings(job.rollouts // 2, 1)
    return {"gradient_checkpointing": [False, True], "micro_batch_size": halvings(ceiling, 1),
            "logprob_chunk": list(AUTO_CHUNKS), "gen_batch_size": gens}


def halvings(top, low):
    """top, top // 2, ... down to low: [16, 8, 4, 2, 1]."""
    return [top >> i for i in range(top.bit_length()) if top >> i >= low]


def choose(s, job, free_bytes, given=None, ceiling=16, m=MEASURED):
    """The first settings in candidates' order whose prediction fits free_bytes, with the knobs in
    `given` ({knob: value}) held as given; None when none fits. -> settings, with "predicted"."""
    values = {k: [v] for k, v in (given or {}).items()}
    options = {**candidates(job, ceiling), **values}
    for gc in options["gradient_checkpointing"]:
        for gen in options["gen_batch_size"]:
            for micro in options["micro_batch_size"]:
                for chunk in options["logprob_chunk"]:
                    settings = dict(zip(KNOBS, (micro, gen, chunk, gc)))
                    got = predict(s, settings, job, m)
                    if fits(got["peak"], free_bytes):
                        return {**settings, "predicted": got}
    return None


def nothing_fits(s, job, free_bytes, given=None, ceiling=16):
    """The one line when no setting fits: the smallest one's prediction, and what would fit."""
    given = given or {}
    least = {**{k: v[-1] for k, v in candidates(job, ceiling).items()}, **given}
    least["gradient_checkpointing"] = given.get("gradient_checkpointing", True)
    need = predict(s, least, job)["peak"] / GiB
    gc = " with gradient checkpointing" if least["gradient_checkpointing"] else ""
    helps, auto_gc = [], {k: v for k, v in given.items() if k != "gradient_checkpointing"}
    if given.get("gradient_checkpointing") is False and choose(s, job, free_bytes, auto_gc,
                                                               ceiling):
        helps.append("--gradient_checkpointing auto")
    if not job.lora_rank and choose(s, Job(**{**vars(job), "lora_rank": 16, "weight_bytes": 2}),
                                    free_bytes, given, ceiling):
        helps.append("LoRA (--lora_rank 16)")
    for t in (job.new_tokens // 2 ** i for i in range(1, 4)):
        if choose(s, Job(**{**vars(job), "new_tokens": t}), free_bytes, given, ceiling):
            helps.append(f"a shorter --max_new_tokens ({t} fits)")
            break
    return (f"the model does not fit the {free_bytes / GiB:.1f} GiB free: even micro-batch "
            f"{least['micro_batch_size']}{gc} needs {need:.1f} GiB, "
            f"{need * (1 + HEADROOM) + RESERVE_GIB:.1f} with the margins (machinery/memory.py); "
            + ("what would fit: " + ", or ".join(helps) if helps else
                                          "use a smaller model or a GPU with more memory"))


def describe(settings, free_bytes, auto):
    """The run's line for the knobs sized `auto`, the given ones in brackets."""
    say = {"micro_batch_size": f"micro-batch {settings['micro_batch_size']}",
           "logprob_chunk": f"log-prob chunk {settings['logprob_chunk']}",
           "gen_batch_size": "generation " + (f"{settings['gen_batch_size']} rows a call"
                                              if settings["gen_batch_size"] else "all at once"),
           "gradient_checkpointing": "gradient checkpointing "
                                     + ("on" if settings["gradient_checkpointing"] else "off")}
    parts = [say[k] if k in auto else f"({say[k]}, given)" for k in KNOBS]
    return (f"memory auto: {', '.join(parts)}: predicted "
            f"{settings['predicted']['peak'] / GiB:.1f} of {free_bytes / GiB:.1f} GiB free")


def free_bytes(device):
    """What torch may allocate on a CUDA device at the run's start: free now plus what this process
    holds already (the model), at most its share (torch.cuda.set_per_process_memory_fraction).
    device: as model.resolve_device takes it; torch.cuda's calls get it with its index, which
    get_per_process_memory_fraction requires ("cuda" alone is an error there)."""
    import torch
    from machinery.model import resolve_device
    device = resolve_device(device)
    free, total = torch.cuda.mem_get_info(device)
    return min(free + torch.cuda.memory_reserved(device),
               torch.cuda.get_per_process_memory_fraction(device) * total)


# What CUDA's libraries say when an allocation of theirs fails: torch raises these as a plain
# RuntimeError ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
# not as torch.OutOfMemoryError, which only its caching allocator raises.
ALLOC_FAILED = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                "CUDNN_STATUS_ALLOC_FAILED", "CUSOLVER_STATUS_ALLOC_FAILED", "ALLOCATION_FAILED")


def is_out_of_memory(error):
    """Is `error` the GPU out of memory: torch.OutOfMemoryError, or a CUDA library's failed
    allocation (ALLOC_FAILED)?"""
    import torch
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in ALLOC_FAILED))


def halve(kind, settings, rows, positions=0):
    """{knob: new value} that an out-of-memory error in a pass of `kind` lowers next, or {} when
    nothing that bears on it is left. rows: the largest generation call or micro-batch of the pass;
    positions: its largest micro-batch's completion positions; settings: KNOBS (a generation pass
    reads none: eval.py passes only its gen_batch_size).
      generation,  --gen_batch_size, down to 1 (the loop prefills each prompt of a call once,
      evaluation   whole groups or not)
      no_grad      --micro_batch_size to 1, then --logprob_chunk to MIN_CHUNK
      update       the same, then --gradient_checkpointing true"""
    if kind in ("generation", "evaluation"):
        return {"gen_batch_size": rows // 2} if rows > 1 else {}
    chunk = min(settings["logprob_chunk"], positions or settings["logprob_chunk"])
    if rows > 1:
        return {"micro_batch_size": rows // 2}
    if chunk > MIN_CHUNK:
        return {"logprob_chunk": max(MIN_CHUNK, chunk // 2)}
    if kind == "update" and not settings["gradient_checkpointing"]:
        return {"gradient_checkpointing": True}
    return {}
