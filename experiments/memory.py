"""
GPU memory of `python train.py --model Qwen2.5-0.5B` by card size, measured on a CPU: the
coefficients machinery/memory.py's counts take (it holds them, and train.py's `auto` knobs use
them). experiments/speed.md ("Memory by card size") holds this script's tables and says which
figure is measured and which counted.

Not measured on a GPU yet. What train.py holds on a GPU is what it holds on a CPU under bf16
autocast: the same operators save the same tensors for backward, in the same dtypes. Attention, the
one operator whose kernel differs, keeps the same things on both (the CPU's flash kernel and CUDA's
memory-efficient one, which is what a padding mask gets: q, k and v, the output, the log-sum-exp,
and the mask converted to bf16). So this script runs train.py's own functions
(rollout.completion_hidden, rollout.head_logprobs, loss.backward(), rollout.generate_groups) under
torch.autocast("cpu", bfloat16) on Qwen2.5-shaped models of 1 and 2 layers with random weights and
the real vocabulary (151,936), at 1, 2 and 4 rollouts of the longest GSM8K prompt + 512 tokens, and
reads every allocation and free from torch's profiler (profile_memory=True: torch's CPU allocator
keeps no statistics of its own). A step's peak, phase by phase:

  counted     weights, gradients and AdamW's two moments, float32: 16 bytes a parameter (12 between
              steps, when the gradients are freed); autocast's bf16 copy of each matmul weight (2
              bytes, as measured)
  measured    the activations a micro-batch keeps for backward, per token and layer: equal, to the
              byte, to an inventory of every tensor autograd saves (layer_act_bytes), at
              Qwen2.5-0.5B's width and at 1.5B's, so the inventory gives 7B's; the lm_head chunk's
              peak per position, and the (V, H) float32 gradient it adds; a layer's backward; step
              5's no-grad pass (the decoder, then the head with the entropy); gradient
              checkpointing's activations and recompute; a generate call's transient per row
  checked     the KV cache, read from the generate call's own cache: 2 x kv_heads x head_dim x 2
              bytes per token and layer (bf16 keys and values)
  computed    a whole model's figures from these (machinery/memory.predict), and the settings
              `auto` picks for each card (memory.choose)

    python experiments/memory.py                          # one thread, about 3 minutes, 7.5 GB RAM
    python experiments/memory.py --json out/memory.json   # also every measurement and the table
    python experiments/memory.py --table                  # the tables from the saved coefficients
    python experiments/memory.py --table out/memory.json  # ... or from those of a --json file
    python experiments/memory.py --card 16 24 80          # what auto picks with this many GiB free
    python experiments/memory.py --card 24 --model Qwen2.5-1.5B --lora_rank 16
    python experiments/memory.py --lora_check  # a LoRA update measured against the count
    python experiments/memory.py --rss_check   # the profiler's peak against a fresh process's RSS
    # where ../shared is absent (the defaults are ../shared's)
    python experiments/memory.py --tokenizer DIR --data_dir DIR
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machinery.memory import (KNOBS, MEASURED, SHAPES, GiB, Job,  # noqa: E402
                              base_act_bytes, choose, describe, job_of, kv_bytes_per_token,
                              layer_act_bytes, layer_params, nothing_fits, param_count, predict)

# -----------------------------------------------------------------------------
# measuring: train.py's functions on a CPU under bf16 autocast, every allocation read from the
# profiler


def build(layers, shape):
    """A Qwen2 of this shape with `layers` layers and random weights, float32 (--dtype auto), in
    training mode, with float32 gradients already allocated: a micro-batch after the first of its
    mini-batch, whose backward adds into them."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    qwen = shape["vocab"] > 151645  # Qwen2.5's special tokens exist: stop ids as in gpu_check.py
    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=layers,
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         tie_word_embeddings=shape["tied"], max_position_embeddings=32768,
                         rope_theta=1e6, bos_token_id=151643 if qwen else None,
                         eos_token_id=151643 if qwen else None)
    model = Qwen2ForCausalLM(config).train()
    if qwen:
        model.generation_config.eos_token_id = [151645, 151643]  # <|im_end|>, <|endoftext|>
        model.generation_config.pad_token_id = 151643
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def timeline(fn):
    """Run fn under the profiler -> ([(time, bytes)] sorted: +allocated, -freed) and {mark: time}.
    Only what fn allocates counts (the weights and gradients allocated before are not in the
    figures)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    marks = {e.name()[5:]: e.start_ns() for e in events if e.name().startswith("mark:")}
    return memory, marks


def mark(name):
    """A point in time on the profiler's clock."""
    from torch.profiler import record_function
    with record_function("mark:" + name):
        pass


def peak(memory, start=None, end=None):
    """The largest total allocated (since the profiler started) at any event between start and
    end."""
    total, top = 0, 0
    for t, nbytes in memory:
        total += nbytes
        if (start is None or t >= start) and (end is None or t < end):
            top = max(top, total)
    return top


def level(memory, t):
    """Total allocated just before time t."""
    return sum(nbytes for s, nbytes in memory if s < t)


def batch(rows, prompt_len, new_tokens, vocab, kept, seed=0):
    """(input_ids, attention_mask, keep) for `rows` rollouts: row i's prompt is 8 i tokens shorter
    (left padding), every completion runs to new_tokens (the worst case) but row 0's, which stops 8
    tokens early, and `kept` completion positions are asked for. A batch with padding is the worst
    case: without any, transformers passes no mask and attention keeps neither it nor repeated
    keys."""
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, prompt_len + new_tokens), generator=g)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, :8 * i] = 0
    mask[0, -8:] = 0
    keep = torch.zeros(rows * new_tokens, dtype=torch.bool)
    keep[torch.randperm(rows * new_tokens, generator=g)[:kept]] = True
    return ids, mask, keep.view(rows, new_tokens)


def update_step(model, ids, mask, keep, prompt_len, chunk):
    """Step 7 on one micro-batch, as train.backward runs it: the decoder and the lm_head on the kept
    positions under autocast, the loss's backward outside it; marks when the head's backward and the
    decoder's are done."""
    import torch
    from rollout import completion_hidden, head_logprobs

    # the embedding output's gradient comes last: then the decoder's backward is done
    def on_embedding(module, args, out):
        out.register_hook(lambda g: mark("decoder_backward"))

    hook = model.get_input_embeddings().register_forward_hook(on_embedding)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = completion_hidden(model, ids, mask, prompt_len)
        # its gradient is complete: the head is done
        hidden.register_hook(lambda g: mark("head_backward"))
        logp, _ = head_logprobs(model, hidden, ids[:, prompt_len:], keep, 1.0, False, chunk)
    hook.remove()
    mark("forward")
    # d3s.policy_loss's memory is a few (n, T) floats: nothing here
    (-logp.sum() / keep.sum()).backward()


def measure_update(model, rows, prompt_len, new_tokens, kept, chunk):
    """update_step on `rows` rollouts. -> bytes above what existed before:
      held      after the forward: the activations, autocast's bf16 weights, the head's inputs
      head      the most during the head's forward and backward (all activations still held)
      decoder   the most during the decoder's backward
      embedding the most after it (the embedding's gradient)"""
    ids, mask, keep = batch(rows, prompt_len, new_tokens, model.config.vocab_size, kept)
    memory, t = timeline(lambda: update_step(model, ids, mask, keep, prompt_len, chunk))
    return {"held": level(memory, t["forward"]), "head": peak(memory, end=t["head_backward"]),
            "decoder": peak(memory, t["head_backward"], t["decoder_backward"]),
            "embedding": peak(memory, t["decoder_backward"])}


def measure_no_grad(model, rows, prompt_len, new_tokens, kept, chunk):
    """Step 7's no-grad pass (train.old_logprobs, K > 1) on one micro-batch: the decoder without
    gradient, then the head. -> bytes above what existed before: decoder (its most), head (its
    most)."""
    import torch
    from rollout import completion_hidden, head_logprobs
    ids, mask, keep = batch(rows, prompt_len, new_tokens, model.config.vocab_size, kept)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            hidden = completion_hidden(model, ids, mask, prompt_len)
            mark("decoder")
            head_logprobs(model, hidden, ids[:, prompt_len:], keep, 1.0, False, chunk)

    memory, t = timeline(step)
    return {"decoder": peak(memory, end=t["decoder"]),
            "head": peak(memory, t["decoder"]) - level(memory, t["decoder"])}


def measure_head(model, positions, chunk):
    """The lm_head alone in the gradient pass (rollout.head_logprobs and its backward), on random
    hidden states of `positions` positions. -> the most it allocates."""
    import torch
    from rollout import head_logprobs
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, positions, model.config.hidden_size, generator=g).requires_grad_()
    targets = torch.randint(0, model.config.vocab_size, (1, positions), generator=g)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = head_logprobs(model, hidden, targets, None, 1.0, False, chunk)
        logp.sum().backward()

    return peak(timeline(step)[0])


def measure_generate(model, tokenizer, prompts, group_size, new_tokens):
    """Step 1: rollout.generate_groups under autocast (the loop, the default). -> the most it
    allocates, and its KV cache at the end (read from the static cache the loop filled)."""
    import torch
    import rollout
    from machinery import sampling
    caches, static_cache = [], sampling._static_cache

    def keep_cache(*args):
        caches.append(static_cache(*args))
        return caches[-1]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rollout.generate_groups(model, tokenizer, prompts, group_size, new_tokens, seed=0,
                                    record_entropy=True)

    sampling._static_cache = keep_cache
    try:
        memory, _ = timeline(step)
    finally:
        sampling._static_cache = static_cache
    kv_tensors = [t for layer in caches[0].layers for t in (layer.keys, layer.values)]
    tokens = caches[0].layers[0].keys.shape[0] * caches[0].layers[0].keys.shape[2]  # rows x length
    return {"peak": peak(memory), "kv": sum(t.nbytes for t in kv_tensors), "kv_tokens": tokens,
            "kv_dtypes": sorted({str(t.dtype) for t in kv_tensors})}


RSS_CASE = dict(layers=2, rows=4, prompt_len=240, new_tokens=512, kept=64, chunk=4096)


def rss_step():
    """In a fresh process, without the profiler: update_step on RSS_CASE, twice (the first run also
    loads code and fills caches), and the second run's rise of the process's peak resident memory
    (ru_maxrss) above what it held before, in bytes. rss_check sets MALLOC_MMAP_THRESHOLD_ so that
    glibc returns every large block when it is freed; by default it keeps some on its heap, and the
    resident memory then counts blocks that no tensor holds."""
    import resource
    import torch
    torch.set_num_threads(1)
    c = RSS_CASE
    model = build(c["layers"], SHAPES["Qwen2.5-0.5B"])
    ids, mask, keep = batch(c["rows"], c["prompt_len"], c["new_tokens"], model.config.vocab_size,
                            c["kept"])
    for _ in range(2):
        with open("/proc/self/statm") as f:
            before = int(f.read().split()[1]) * resource.getpagesize()  # resident now
        update_step(model, ids, mask, keep, c["prompt_len"], c["chunk"])
    # ru_maxrss: kilobytes on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def rss_check():
    """The profiler's peak for RSS_CASE against rss_step's in a fresh process. -> (profiler,
    resident), bytes."""
    import subprocess
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss_step"],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072"))
    c = RSS_CASE
    got = measure_update(build(c["layers"], SHAPES["Qwen2.5-0.5B"]), c["rows"], c["prompt_len"],
                         c["new_tokens"], c["kept"], c["chunk"])
    return max(got["head"], got["decoder"], got["embedding"]), int(run.stdout.split()[-1])


def lora(model, rank):
    """model with its base frozen in bf16 and PEFT's LoRA adapters (float32, PEFT's default for a
    2-byte base) on each layer's seven linears, as the LoRA knob holds it on a bf16 GPU; float32
    gradients allocated for the adapters. -> the adapted transformers model inside PEFT's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from machinery.model import quiet  # PEFT's deprecation warning, as train.py's LoRA has none
    for p in model.parameters():
        p.grad = None
    with quiet():
        model = get_peft_model(model.to(torch.bfloat16), LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return model.base_model.model


def lora_check(rank=16, log=print):
    """Step 7 on a LoRA micro-batch at Qwen2.5-0.5B's width (one layer, the real vocabulary, rank
    16), measured as above, against predict()'s count for that one-layer shape: the peak above the
    weights and gradients, for a few rows and kept positions. (update_step's hook on the
    embedding's output does not apply: a frozen embedding's output needs no gradient.)"""
    import torch
    from rollout import completion_hidden, head_logprobs
    shape, P, T = dict(SHAPES["Qwen2.5-0.5B"], layers=1), 240, 512
    model = lora(build(1, shape), rank)
    for rows, kept in ((2, 64), (2, 1024), (1, 512)):
        ids, mask, keep = batch(rows, P, T, shape["vocab"], kept)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = completion_hidden(model, ids, mask, P)
                logp, _ = head_logprobs(model, hidden, ids[:, P:], keep, 1.0, False, 4096)
            (-logp.sum()).backward()
        measured = peak(timeline(step)[0])
        job = Job(prompt_len=P, new_tokens=T, lora_rank=rank, weight_bytes=2,
                  token_share=kept / (rows * T))
        got = predict(shape, dict(zip(KNOBS, (rows, 0, 4096, False))), job)
        counted = got["update"] - got["parts"]["weights, gradients, moments"] - \
            got["parts"]["bf16 copies"]
        log(f"LoRA rank {rank}, one layer at Qwen2.5-0.5B's width, {rows} rollouts of {P} + {T} "
            f"tokens, {kept} kept: measured {measured / 2 ** 20:.0f} MiB, counted "
            f"{counted / 2 ** 20:.0f} MiB")


def fit_layers(points):
    """Least squares of held = c + layers w + rows (b + layers a) over {(layers, rows): bytes}.
    -> (a, b, w, c, largest residual)."""
    import numpy as np
    keys = sorted(points)
    X = np.array([[layers * rows, rows, layers, 1.0] for layers, rows in keys])
    y = np.array([points[k] for k in keys], dtype=float)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return (*coef, float(np.abs(X @ coef - y).max()))


def prompt_lengths(tokenizer, data_dir):
    """Token counts of every GSM8K train prompt as train.py formats it (data.format_prompt)."""
    from machinery.data import format_prompt, load_problems
    rows = load_problems("gsm8k", "train", data_dir=data_dir)
    prompts = [format_prompt(tokenizer, r["prompt"]) for r in rows]
    return [len(x) for x in tokenizer(prompts)["input_ids"]]


def measure(tokenizer, data_dir, log=print):
    """Every measurement (raw bytes), and the coefficients predict() takes."""
    import torch
    torch.set_num_threads(1)
    s = SHAPES["Qwen2.5-0.5B"]
    V, H = s["vocab"], s["hidden"]
    lengths = sorted(prompt_lengths(tokenizer, data_dir))
    # the longest prompt and a completion cut at max_new_tokens: the longest micro-batch
    P, T = lengths[-1], 512
    L = P + T
    log(f"GSM8K train prompts with the chat template: mean {sum(lengths) / len(lengths):.0f} "
        f"tokens, 99th percentile {lengths[int(0.99 * len(lengths))]}, longest {P}: rollouts of "
        f"{L} tokens")
    out, m = {"prompt_len": P, "new_tokens": T, "length": L}, {}
    MiB = 2 ** 20

    def layers_and_rows(shape, layer_counts, row_counts, checkpointing=False):
        """measure_update on every (layers, rows), 64 kept positions (a small head)."""
        got = {}
        for layers in layer_counts:
            model = build(layers, shape)
            if checkpointing:
                model.activation_checkpointing_enable()  # as train.py turns it on
            for rows in row_counts:
                got[layers, rows] = measure_update(model, rows, P, T, 64, 4096)
        return got

    def backward_fit(got, layers, shape):
        """A layer's backward above what is held, per token, in units of layer_act_bytes: the slope
        between the two largest micro-batches (with one rollout, a moment that does not grow with
        the tokens can decide: the lm_head's gradient, held for the embedding's)."""
        lo, hi = sorted(r for l_, r in got if l_ == layers)[-2:]
        rise = (got[layers, hi]["decoder"] - got[layers, hi]["held"]) - (got[layers, lo]["decoder"]
                                                                         - got[layers, lo]["held"])
        return rise / ((hi - lo) * L) / layer_act_bytes(shape, L)

    def backward_bound(got, shape, kind):
        """How far predict()'s bound on a layer's backward lies above each measured one, in MiB."""
        V_, H_, act = shape["vocab"], shape["hidden"], layer_act_bytes(shape, L)
        grads = 4 * V_ * H_ * shape["tied"] + 6 * layer_params(shape)  # lm_head and layer grads
        return [round((rows * L * m[kind + "_backward"] * act + grads - (r["decoder"] - r["held"]))
                      / MiB, 1) for (layers, rows), r in sorted(got.items())]

    # 1. the activations, and a layer's backward: 1 and 2 layers, 1, 2 and 4 rollouts
    t0 = time.time()
    got = layers_and_rows(s, (1, 2), (1, 2, 4))
    a, b, w, c, residual = fit_layers({k: v["held"] for k, v in got.items()})
    m["plain_backward"] = backward_fit(got, 2, s)
    out["update"] = {str(k): v for k, v in got.items()}
    out["activations"] = {"per_layer_per_token": a / L, "inventory": layer_act_bytes(s, L),
                          "base_per_token": b / L, "base_inventory": base_act_bytes(s),
                          "bf16_weights_per_layer": w, "counted": 2 * layer_params(s),
                          "fit_residual": residual}
    log(f"activations ({time.time() - t0:.0f} s): {a / L:.0f} bytes per token and layer (inventory "
        f"{layer_act_bytes(s, L)}), {b / L:.0f} outside the layers (inventory "
        f"{base_act_bytes(s)}); bf16 weights {w / MiB:.1f} MiB a layer (counted "
        f"{2 * layer_params(s) / MiB:.1f}); fit within {residual / MiB:.2f} MiB. A layer's "
        f"backward adds {m['plain_backward']:.3f} x its activations a token; the bound lies above "
        f"each measurement by {backward_bound(got, s, 'plain')} MiB")

    # 2. the lm_head in the gradient pass. At the real width, few positions: the moment its (V, H)
    # float32 gradient is made. Alone on a 64-wide head (the (V, H) terms are then small), 256 and
    # 1024 positions: the log-softmax's backward, which decides at the default 4096; and 1024 in
    # chunks of 256.
    t0, model = time.time(), build(1, s)
    fixed = {}
    for kept in (64, 256):
        r = measure_update(model, 1, P, T, kept, 4096)
        fixed[kept] = r["head"] - r["held"]
    out["embedding_backward"] = r["embedding"]
    m["head_with_weight_grad_per_position"] = (fixed[256] - fixed[64]) / 192 / V
    m["head_weight_grad"] = ((fixed[64] - 64 * m["head_with_weight_grad_per_position"] * V)
                             / (4 * V * H))
    m["embedding_backward"] = r["embedding"] / (4 * V * H)
    narrow = build(1, dict(s, hidden=64, intermediate=128, heads=4, kv_heads=2))
    alone = {(n, c): measure_head(narrow, n, c)
             for n, c in ((256, 4096), (1024, 4096), (1024, 256))}
    m["head_per_position"] = (alone[1024, 4096] - alone[256, 4096]) / 768 / V
    out["head"] = {"real_width": fixed, "narrow": {str(k): v for k, v in alone.items()}}
    log(f"lm_head, gradient pass ({time.time() - t0:.0f} s): {m['head_per_position']:.2f} V bytes "
        f"a position ({m['head_per_position'] * V * 4096 / GiB:.2f} GiB at 4096; 1024 positions in "
        f"chunks of 256: {alone[1024, 256] / MiB:.0f} MiB, 256 in one: "
        f"{alone[256, 4096] / MiB:.0f} MiB), or its (V, H) gradient ({m['head_weight_grad']:.2f} "
        f"x 4VH) with {m['head_with_weight_grad_per_position']:.2f} V bytes a position; the "
        f"embedding's backward {r['embedding'] / MiB:.0f} MiB ({m['embedding_backward']:.2f} "
        "x 4VH)")

    # 3. step 7's no-grad pass: the decoder's transient per token, the head a position (checks
    # machinery/memory.py's NO_GRAD_HEAD)
    t0, e = time.time(), {}
    for rows, kept in ((1, 64), (2, 64), (2, 256)):
        e[rows, kept] = measure_no_grad(model, rows, P, T, kept, 4096)
    m["no_grad_decoder"] = (e[2, 64]["decoder"] - e[1, 64]["decoder"]) / L / layer_act_bytes(s, L)
    m["no_grad_head_per_position"] = (e[2, 256]["head"] - e[2, 64]["head"]) / 192 / V
    out["no_grad"] = {str(k): v for k, v in e.items()}
    log(f"no-grad pass ({time.time() - t0:.0f} s): decoder {m['no_grad_decoder']:.3f} x a layer's "
        f"activations a token; head {m['no_grad_head_per_position']:.2f} V bytes a position "
        f"({m['no_grad_head_per_position'] * V * 4096 / GiB:.2f} GiB at 4096)")
    del model

    # 4. gradient checkpointing: what each layer keeps, and a layer's recompute and backward
    t0 = time.time()
    gc = layers_and_rows(s, (1, 2), (1, 2, 4), checkpointing=True)
    rise = (gc[2, 4]["held"] - gc[2, 1]["held"]) - (gc[1, 4]["held"] - gc[1, 1]["held"])
    per_layer = rise / (3 * L)
    m["checkpointed_per_token"] = per_layer / H
    m["checkpointed_backward"] = backward_fit(gc, 2, s)
    out["checkpointing"] = {str(k): v for k, v in gc.items()}
    log(f"gradient checkpointing ({time.time() - t0:.0f} s): {per_layer / H:.2f} H bytes a token "
        f"and layer kept; a layer's recompute and backward add {m['checkpointed_backward']:.3f} x "
        f"its activations a token; the bound lies above each measurement by "
        f"{backward_bound(gc, s, 'checkpointed')} MiB")

    # 5. generation: the KV cache read from generate's own cache, and the transient per row
    t0, model = time.time(), build(1, s)
    from machinery.data import format_prompt, load_problems
    questions = [r["prompt"] for r in load_problems("gsm8k", "train", limit=2, data_dir=data_dir)]
    prompts = [format_prompt(tokenizer, q) for q in questions]
    g = {rows: measure_generate(model, tokenizer, prompts, rows // 2, 16) for rows in (8, 16)}
    kv_token = g[16]["kv"] / g[16]["kv_tokens"]  # one layer
    m["decode_per_row"] = ((g[16]["peak"] - g[16]["kv"]) - (g[8]["peak"] - g[8]["kv"])) / 8 / V
    out["generate"] = {"kv_per_token_per_layer": kv_token,
                       "counted": kv_bytes_per_token(s) / s["layers"],
                       "raw": {str(k): v for k, v in g.items()}}
    log(f"generation ({time.time() - t0:.0f} s): KV cache {kv_token:.0f} bytes a token and layer "
        f"({', '.join(g[16]['kv_dtypes'])}; counted {kv_bytes_per_token(s) // s['layers']}); "
        f"{m['decode_per_row']:.1f} V bytes a row besides "
        f"({m['decode_per_row'] * V * 256 / GiB:.2f} GiB for 256 rows)")
    del model

    # 6. the inventory and a layer's backward at Qwen2.5-1.5B's width (1 and 2 layers, 1 and 2
    # rollouts)
    t0, s15 = time.time(), SHAPES["Qwen2.5-1.5B"]
    got = layers_and_rows(s15, (1, 2), (1, 2))
    a15 = fit_layers({k: v["held"] for k, v in got.items()})[0]
    backward15 = backward_fit(got, 2, s15)
    bound15 = backward_bound(got, s15, "plain")  # with 0.5B's slope, as predict() uses it
    out["width_1.5B"] = {"per_layer_per_token": a15 / L, "inventory": layer_act_bytes(s15, L),
                         "backward": backward15, "raw": {str(k): v for k, v in got.items()}}
    log(f"Qwen2.5-1.5B's width ({time.time() - t0:.0f} s): {a15 / L:.0f} bytes per token and layer "
        f"(inventory {layer_act_bytes(s15, L)}); a layer's backward adds {backward15:.3f} x its "
        f"activations a token (1 and 2 rollouts), the bound with 0.5B's slope lies above by "
        f"{bound15} MiB")
    out["coefficients"] = m
    return out


CARDS_GIB = (80, 40, 24, 16)  # the table's rows: GiB free
LORA_RANK = 16  # [ours] the rank of the LoRA rows: the knob's interface allows any; 16 is common


def real_job(prompt_len=240, new_tokens=512, lora_rank=0, model="Qwen2.5-0.5B"):
    """The Job of `python train.py --model MODEL` (D3S, 32 prompts x 8, K = 4, AdamW, --dtype auto
    on a GPU with bf16) whose longest prompt is prompt_len tokens, with LoRA of lora_rank (the
    frozen base in bf16, as the knob's interface holds it on such a GPU)."""
    import dataclasses
    from machinery import config
    import train
    cfg = config.resolve(train.Config(model=model, max_new_tokens=new_tokens, device="cpu"),
                         given={"model", "max_new_tokens", "device"})
    job = job_of(cfg, prompt_len)
    return dataclasses.replace(job, lora_rank=lora_rank, weight_bytes=2 if lora_rank else 4)


def table(coefficients=MEASURED, prompt_len=240, new_tokens=512, log=print):
    """experiments/speed.md's tables: for each model, every weight trained and LoRA of LORA_RANK,
    the settings auto picks on each card and their predicted peaks (machinery/memory.py)."""
    rows = []
    for name, s in SHAPES.items():
        job = real_job(prompt_len, new_tokens)
        default = predict(s, dict(zip(KNOBS, (16, 0, 4096, False))), job, coefficients)
        log(f"\n{name}: {param_count(s) / 1e9:.2f}B parameters, "
            f"{16 * param_count(s) / GiB:.1f} GiB of weights, gradients and AdamW moments; the "
            "CPU's values (micro 16, chunk 4096, all 256 rollouts per generate call) peak at "
            f"{default['peak'] / GiB:.1f} GiB\n  their parts, GiB: "
            + ", ".join(f"{k} {v / GiB:.2f}" for k, v in default["parts"].items()))
    log("\n| model | free | `--micro_batch_size` | `--gen_batch_size` | `--logprob_chunk` | "
        "`--gradient_checkpointing` | predicted peak | generate / no-grad / update |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for lora in (0, LORA_RANK):
        for name, s in SHAPES.items():
            job = real_job(prompt_len, new_tokens, lora)
            for card in CARDS_GIB:
                alternatives = [choose(s, job, card * GiB, m=coefficients)]
                if alternatives[0] and alternatives[0]["micro_batch_size"] < 16 and \
                        not alternatives[0]["gradient_checkpointing"]:
                    alternatives.append(choose(s, job, card * GiB, {"gradient_checkpointing": True},
                                               m=coefficients))
                for i, got in enumerate(alternatives):
                    rows.append({"model": name, "lora_rank": lora, "card_gib": card, **(got or {})})
                    model = name + (f", LoRA rank {lora}" if lora else "")
                    if got is None:
                        log(f"| {model} | {card} GiB | does not fit | | | | | |")
                        continue
                    p = got["predicted"]
                    log(f"| {model} | {card} GiB{', or' if i else ''} | "
                        f"{got['micro_batch_size']} | "
                        f"{got['gen_batch_size']} | {got['logprob_chunk']} | "
                        f"{str(got['gradient_checkpointing']).lower()} | "
                        f"{p['peak'] / GiB:.1f} GiB ({p['peak'] / (card * GiB):.0%}) | "
                        + " / ".join(f"{p[k] / GiB:.1f}" for k in ("generate", "no_grad", "update"))
                        + " |")
    return rows


def cards(model, gib, lora_rank=0, prompt_len=240, new_tokens=512, log=print):
    """What `python train.py --model MODEL` sizes `auto` to with `gib` GiB free: its line, and the
    prediction's share of the card."""
    job = real_job(prompt_len, new_tokens, lora_rank, model)
    shape = SHAPES[model]
    for card in gib:
        got = choose(shape, job, card * GiB)
        lora = f" --lora_rank {lora_rank}" if lora_rank else ""
        log(f"--model {model}{lora}, {card:g} GiB free: " + (
            f"{describe(got, card * GiB, KNOBS)} ({got['predicted']['peak'] / (card * GiB):.0%})"
            if got else nothing_fits(shape, job, card * GiB)))


if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--tokenizer", default=os.path.join(here, "..", "shared", "tokenizers",
                                                            "qwen2.5"),
                        help="the Qwen2.5 tokenizer (a folder or hub id)")
    parser.add_argument("--data_dir", default=os.path.join(here, "..", "shared", "data"),
                        help="local copies laid out as NAME/SPLIT.jsonl ('': the hub)")
    parser.add_argument("--json", default="", help="also write the measurements and the table here")
    parser.add_argument("--rss_check", action="store_true",
                        help="only compare the profiler's peak with a fresh process's resident "
                             "memory (30 s)")
    # --rss_check's fresh process
    parser.add_argument("--rss_step", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--table", nargs="?", const="saved", default="",
                        help="only print the tables, from machinery/memory.py's saved coefficients "
                             "or a --json file's (no measuring): to try other margins "
                             "(RESERVE_GIB, HEADROOM) or lengths")
    parser.add_argument("--lora_check", action="store_true",
                        help="only measure a LoRA update at the real width against the count "
                             "(needs peft)")
    parser.add_argument("--card", type=float, nargs="+", default=[],
                        help="only print what auto picks for --model with this many GiB free")
    parser.add_argument("--model", default="Qwen2.5-0.5B", choices=list(SHAPES),
                        help="for --card")
    parser.add_argument("--lora_rank", type=int, default=0, help="for --card")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.rss_step:
        print(rss_step())
        sys.exit(0)
    if args.rss_check:
        by_profiler, by_rss = rss_check()
        print(f"{RSS_CASE}: the profiler's peak {by_profiler / 2 ** 20:.0f} MiB, the resident "
              f"memory's rise in a fresh process without it {by_rss / 2 ** 20:.0f} MiB")
        sys.exit(0)
    if args.card:
        cards(args.model, args.card, args.lora_rank)
        sys.exit(0)
    if args.lora_check:
        lora_check()
        sys.exit(0)
    if args.table:
        saved = {"coefficients": MEASURED, "prompt_len": 240, "new_tokens": 512}
        if args.table != "saved":
            with open(args.table) as f:
                saved = json.load(f)
        table(saved["coefficients"], saved["prompt_len"], saved["new_tokens"])
        sys.exit(0)
    from transformers import AutoTokenizer
    t_start = time.time()
    result = measure(AutoTokenizer.from_pretrained(args.tokenizer), args.data_dir or None)
    result["table"] = table(result["coefficients"], result["prompt_len"], result["new_tokens"])
    print(f"\n{time.time() - t_start:.0f} s; coefficients: {json.dumps(result['coefficients'])}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
