"""machinery/memory.py: the counts experiments/speed.md's memory table and train.py's `auto` knobs
rest on, checked against real models (experiments/memory.py's measurements), and by hand."""
import pytest

from experiments import memory  # noqa: E402
from machinery import memory as counts

TINY = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tied=True)


@pytest.mark.parametrize("tied", [True, False])
def test_param_count_is_the_models(tied):
    model = memory.build(2, dict(TINY, tied=tied))
    assert counts.param_count(dict(TINY, tied=tied)) == sum(p.numel() for p in model.parameters())
    # Qwen2.5-0.5B's published count, 0.49B (0.36B without the embedding)
    assert counts.param_count(counts.SHAPES["Qwen2.5-0.5B"]) == 494_032_768


def test_layer_activations_are_the_inventory():
    """What one more layer holds per token after the forward, read from torch's profiler as
    memory.py reads it, is exactly layer_act_bytes: the (layers, rows) difference cancels the bf16
    weight copies, the head and everything outside the layers. A formula that forgot the per-layer
    bf16 mask, the repeated keys and values, or a norm's 1 / rms would be off by 2L, 2 x 2 x nh x d
    or 4 bytes."""
    held = {}
    for layers in (1, 2):
        model = memory.build(layers, TINY)
        for rows in (1, 2):
            held[layers, rows] = memory.measure_update(model, rows, 24, 24, 8, 4096)["held"]
    per_token = (held[2, 2] - held[2, 1] - held[1, 2] + held[1, 1]) / 48
    assert per_token == counts.layer_act_bytes(TINY, 48) == 3320


def lora_model(layers, shape, rank):
    """memory.build's model with LoRA as the knob holds it on a bf16 GPU (memory.lora)."""
    pytest.importorskip("peft")
    return memory.lora(memory.build(layers, shape), rank)


def test_lora_counts_are_peft_s():
    """adapter_params is PEFT's trainable count, and by hand for Qwen2.5-0.5B at rank 16:
    16 x ((896 + 896) + 2 (896 + 128) + (896 + 896) + 2 (896 + 4864) + (4864 + 896)) = 366,592 a
    layer (q, k, v, o, gate, up, down), 8,798,208 in 24 layers."""
    import torch
    model = lora_model(2, TINY, 8)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == 2 * counts.adapter_params(TINY, 8)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert 24 * counts.adapter_params(counts.SHAPES["Qwen2.5-0.5B"], 16) == 8_798_208


def test_lora_layer_activations_are_the_inventory():
    """The same measurement with a frozen bf16 base and rank-r adapters, under bf16 autocast: the
    frozen linears and norms keep nothing for their weights, each adapter keeps its bf16 input and
    its rank-r output (layer_act_bytes with lora_rank): 8H less, 2 nh d and 7 x 2r more."""
    import torch
    from rollout import completion_hidden, head_logprobs

    def held(model, rows):
        ids, mask, keep = memory.batch(rows, 24, 24, TINY["vocab"], 8)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = completion_hidden(model, ids, mask, 24)
                logp, _ = head_logprobs(model, hidden, ids[:, 24:], keep, 1.0, False, 4096)
            memory.mark("forward")
            (-logp.sum()).backward()
        timeline, t = memory.timeline(step)
        return memory.level(timeline, t["forward"])

    for rank in (8, 16):
        got = {}
        for layers in (1, 2):
            model = lora_model(layers, TINY, rank)
            for rows in (1, 2):
                got[layers, rows] = held(model, rows)
        per_token = (got[2, 2] - got[2, 1] - got[1, 2] + got[1, 1]) / 48
        assert per_token == counts.layer_act_bytes(TINY, 48, rank) == 3320 - 6 * 64 + 14 * rank


def test_any_qwen2_or_llama_config_gives_its_shape():
    """shape_of reads a transformers config: the parameter count is the built model's, with
    Qwen2's q, k, v biases and Llama's none (and its own head_dim)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    for config, cls in ((Qwen2Config(**small, tie_word_embeddings=True), Qwen2ForCausalLM),
                        (LlamaConfig(**small, head_dim=32, tie_word_embeddings=False),
                         LlamaForCausalLM)):
        model = cls(config)
        assert counts.param_count(counts.shape_of(config)) == sum(p.numel()
                                                                   for p in model.parameters())
    assert counts.shape_of(Qwen2Config(**small, tie_word_embeddings=True)) == dict(
        TINY, head_dim=16, qkv_bias=True, o_bias=False, mlp_bias=False)


QWEN05 = counts.SHAPES["Qwen2.5-0.5B"]
KNOBS = counts.KNOBS


def settings(micro, gen, chunk, gc):
    return dict(zip(KNOBS, (micro, gen, chunk, gc)))


def test_the_choice_by_hand_on_a_24_gib_card():
    """`python train.py --model Qwen2.5-0.5B` (D3S, K = 4, the longest GSM8K prompt 240 + 512
    tokens) with 24 GiB free, which holds a peak of (24 - 1) / 1.1 = 20.9 GiB. Weights and moments
    7.36 GiB and autocast's bf16 copies of the layers 0.67 come first; 16 rollouts' activations
    alone are 19.23 GiB, so no micro-batch of 16 fits. Held for the whole run besides: the decode's
    bf16 copies of every linear and the lm_head, 2 x (24 x 14,910,592 + 151,936 x 896) bytes =
    0.92 GiB; the loop's static KV cache, one for step 1 and the evaluation alike (256 rows each),
    256 x (256 + 512) columns (the prompt width rounded up to a power of two) x 12 KiB = 2.25 GiB;
    and the CUDA graphs' pool, a decode step's logits and sampler, 256 x 34 x V = 1.23 GiB. 8
    rollouts hold 9.61 and the head chunk (three (chunk, V) float32 tensors, 6.96 GiB at 4096
    positions) decides: D3S trains at most rho_t = 0.6 of the 8 x 512 positions, 2458, so 26.2 at
    chunk 4096, 25.5 at 2048, 23.8 at 1024: none fits. [ours] A generate call of every row comes
    before the micro-batch (decoding in parts pays a whole decode per part), so the micro-batch
    goes on down: 4, with chunk 4096 (19.3). With gradient checkpointing given, 16 fit; with
    --generation hf no cache, no pool, and the head's autocast copy only while generating: 8 at
    chunk 1024 fit (20.3)."""
    job, GiB = counts.Job(token_share=0.6), counts.GiB
    parts = counts.predict(QWEN05, settings(16, 0, 4096, False), job)["parts"]
    assert round(parts["weights, gradients, moments"] / GiB, 2) == 7.36
    assert round(parts["bf16 copies"] / GiB, 2) == 0.67
    assert round(parts["activations"] / GiB, 2) == 19.23
    assert parts["decode copies"] == 2 * (24 * 14_910_592 + 151_936 * 896)
    assert parts["KV caches"] == 256 * (256 + 512) * counts.kv_bytes_per_token(QWEN05) == 2.25 * GiB
    assert parts["CUDA graphs"] == 256 * 34 * 151_936
    for gen, want in ((0, [26.2, 25.5, 23.8]), (128, [24.5, 23.8, 22.0])):
        peaks = [counts.predict(QWEN05, settings(8, gen, chunk, False), job)["update"] / GiB
                 for chunk in (4096, 2048, 1024)]
        assert [round(p, 1) for p in peaks] == want
    hf = counts.Job(token_share=0.6, kv_held=0)
    assert [round(counts.predict(QWEN05, settings(8, 0, chunk, False), hf)["update"] / GiB, 1)
            for chunk in (4096, 2048, 1024)] == [22.7, 22.0, 20.3]
    assert {k: counts.choose(QWEN05, hf, 24 * GiB)[k] for k in KNOBS} == \
        settings(8, 0, 1024, False)
    got = counts.choose(QWEN05, job, 24 * GiB)
    assert {k: got[k] for k in KNOBS} == settings(4, 0, 4096, False)
    assert round(got["predicted"]["peak"] / GiB, 1) == 19.3
    given = counts.choose(QWEN05, job, 24 * GiB, {"micro_batch_size": 16})
    assert {k: given[k] for k in KNOBS} == settings(16, 0, 4096, True)  # a number given wins


def test_the_held_caches_are_one_when_step_and_evaluation_have_as_many_rows():
    """Step 1's calls and the evaluation's share one kept cache when they have as many rows
    (train.py's: --gen_batch_size each, or all 256); 64 rows a step and an evaluation of 256 hold
    two. The width: the longest prompt rounded up to a power of two, at least 64, + the new
    tokens."""
    kv, GiB = counts.kv_bytes_per_token(QWEN05), counts.GiB

    def caches(gen, **job):
        return counts.predict(QWEN05, settings(1, gen, 256, False),
                              counts.Job(**job))["parts"]["KV caches"]
    assert caches(0) == 256 * 768 * kv and caches(16) == 16 * 768 * kv
    assert caches(0, rollouts=64) == (64 + 256) * 768 * kv
    assert caches(0, prompt_len=257) == 256 * (512 + 512) * kv
    assert caches(0, prompt_len=20, new_tokens=32) == 256 * (64 + 32) * kv
    assert caches(0, kv_held=0) == 0


def test_lora_fits_the_papers_models_where_full_training_cannot():
    """Qwen2.5-1.5B: 23 GiB of float32 weights, gradients and moments, no 24 GiB card; with LoRA
    rank 16 (its base in bf16) it fits within 90% of one. 7B: no card here with every weight
    trained; the line says what would fit."""
    GiB, lora = counts.GiB, counts.Job(lora_rank=16, weight_bytes=2)
    s15, s7 = counts.SHAPES["Qwen2.5-1.5B"], counts.SHAPES["Qwen2.5-7B"]
    assert counts.choose(s15, counts.Job(), 24 * GiB) is None
    got = counts.choose(s15, lora, 24 * GiB)
    assert got["predicted"]["peak"] <= 0.9 * 24 * GiB
    assert counts.predict(s15, settings(1, 8, 256, True), lora)["parts"][
        "weights, gradients, moments"] < 3.5 * GiB  # 2 bytes a weight, adapters 16 bytes
    line = counts.nothing_fits(s7, counts.Job(), 80 * GiB)
    assert line.startswith("the model does not fit the 80.0 GiB free: even micro-batch 1 with "
                           "gradient checkpointing needs 14") and line.endswith(
        "what would fit: LoRA (--lora_rank 16)")
    assert counts.choose(s7, counts.Job(), 80 * GiB) is None
    short = counts.nothing_fits(QWEN05, counts.Job(), 12.75 * GiB,
                                {"gradient_checkpointing": False})
    assert short.endswith("what would fit: --gradient_checkpointing auto, or LoRA (--lora_rank "
                          "16), or a shorter --max_new_tokens (256 fits)")
    assert counts.nothing_fits(QWEN05, counts.Job(), 9 * GiB, {"gradient_checkpointing": False}) \
        .endswith("what would fit: LoRA (--lora_rank 16)")  # the weights alone need 8.8


def test_what_each_method_adds():
    """The method at hand: D3S's kept tokens fill fewer head positions (rho_t 0.6 of 8 x 512 is
    2458 < 4096), in the gradient pass and in logp_old's no-grad pass, which reads only them (no
    entropy: the sampler's); GSPO's no-grad head over the unkept tokens, and logp_old over every
    one; beta > 0 a float32 copy of the model (none under LoRA)."""
    def predict(micro, **job):
        return counts.predict(QWEN05, settings(micro, 0, 4096, False), counts.Job(**job))

    def update(micro, **job):
        return predict(micro, **job)["update"]
    V = QWEN05["vocab"]
    assert update(8) - update(8, token_share=0.6) == 12 * V * (4096 - 2458)
    no_grad = [predict(8, token_share=t)["no_grad"] for t in (1.0, 0.6)]
    assert no_grad[0] - no_grad[1] == counts.NO_GRAD_HEAD * V * (4096 - 2458)
    assert predict(8, token_share=0.6, gspo_share=0.4)["no_grad"] == no_grad[0]
    assert update(16, token_share=0.2, gspo_share=0.8) > update(16, token_share=0.2)
    assert update(16, reference=True) - update(16) == 4 * counts.param_count(QWEN05)

    def held(**job):
        return counts.predict(QWEN05, settings(16, 0, 4096, False),
                              counts.Job(lora_rank=16, weight_bytes=2, **job))["parts"]
    assert held(reference=True)["weights, gradients, moments"] == \
        held()["weights, gradients, moments"]  # the reference: the adapters off, no copy


@pytest.mark.parametrize("kind, now, rows, positions, want", [
    ("generation", dict(gen_batch_size=0), 256, 0, {"gen_batch_size": 128}),
    ("generation", dict(gen_batch_size=24), 24, 0, {"gen_batch_size": 12}),
    ("generation", dict(gen_batch_size=12), 12, 0, {"gen_batch_size": 6}),  # within a group
    ("generation", dict(gen_batch_size=1), 1, 0, {}),
    ("evaluation", dict(gen_batch_size=0), 256, 0, {"gen_batch_size": 128}),
    ("update", dict(micro_batch_size=16, logprob_chunk=4096), 16, 8192, {"micro_batch_size": 8}),
    ("update", dict(micro_batch_size=1, logprob_chunk=4096), 1, 512, {"logprob_chunk": 256}),
    ("update", dict(micro_batch_size=1, logprob_chunk=16), 1, 512,
     {"gradient_checkpointing": True}),
    ("no_grad", dict(micro_batch_size=1, logprob_chunk=16), 1, 512, {}),
])
def test_what_an_out_of_memory_pass_lowers_next(kind, now, rows, positions, want):
    """By hand: the rows of a generation call, halved down to 1 (the loop prefills each prompt of
    a call once, whole groups or not); the micro-batch, then the chunk (from the positions a
    micro-batch asks for), then checkpointing."""
    full = {**dict(micro_batch_size=16, gen_batch_size=0, logprob_chunk=4096,
                   gradient_checkpointing=False), **now}
    assert counts.halve(kind, full, rows, positions) == want
