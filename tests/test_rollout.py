"""rollout.py and machinery/sampling.py on tiny real models: group layout, masks by position,
stop ids, left padding, a checkpoint's generation_config that must change nothing, the decode loop
against transformers' generate (token for token on tiny models; in general up to the rounding of
the logits, the sampler being exactly a function of them), its compiled step (traced on the CPU:
tests/test_decode_trace.py has its graph), samples that do not depend on batching, the sampler's
and the hash's distributions, and chunked log-probs / entropies against the plain full-logits
computation."""
import copy
import math
import warnings

import pytest
import torch
from conftest import SHARED, requires_shared

import rollout
from machinery import sampling, tiny

PROMPTS = ["Question: 3+8+5+9\nAnswer:", "Question: 1+2\nAnswer:", "Question: 12+7+1+40+6\nAnswer:",
           "Q:"]


def sharpen(model, std=0.3, seed=1):
    """Re-draw every matrix with a larger std: a freshly initialised model is almost uniform, so its
    greedy argmax is a near-tie that float noise can flip and it repeats one token forever."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


@pytest.fixture
def model(tok):
    return sharpen(tiny.build_model(tok, seed=0, hidden_size=32, num_layers=2))


def encode_one(tok, prompt):
    return tok(prompt, add_special_tokens=True)["input_ids"]


def first_stop_mask(row, stop_ids):
    """Brute force: True up to and including the first stop id."""
    out, stopped = [], False
    for x in row:
        out.append(not stopped)
        stopped = stopped or x in stop_ids
    return out


def real_tokens(r, i):
    return r.completion_ids[i][r.completion_mask[i]].tolist()


# ----------------------------------------------------------------------------- masks and stop ids

def test_completion_mask_hand_made():
    eos, pad = 1, 0
    ids = torch.tensor([
        [5, 6, 7, eos, pad, pad],   # stops at token 3: 4 positions
        [eos, pad, pad, pad, pad, pad],  # stops at once: 1 position
        [5, 6, 7, 8, 2, 5],         # never stops: all 6
        [pad, 5, eos, 6, eos, 7],   # a generated pad id before the stop is a real token
        [5, 9, 6, 6, 6, 6],         # 9 is a second stop id
    ])
    mask = rollout.completion_mask(ids, [eos, 9])
    assert mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [4, 1, 6, 3, 2]
    for row, m in zip(ids.tolist(), mask.tolist()):
        assert m == first_stop_mask(row, {eos, 9})
    # pad == eos (Qwen2.5 pads with <|endoftext|>, the base models' EOS): found by position, not id.
    qeos = 151643
    ids = torch.tensor([[10, 11, qeos, qeos, qeos], [10, 11, 12, 13, 14],
                        [qeos, qeos, qeos, qeos, qeos]])
    mask = rollout.completion_mask(ids, [151645, qeos])
    assert mask.tolist() == [[True, True, True, False, False], [True] * 5,
                             [True, False, False, False, False]]


def test_stop_token_ids(tok, model):
    assert rollout.stop_token_ids(model, tok) == [tok.eos_token_id]
    model.generation_config.eos_token_id = [7, tok.eos_token_id, 5]
    assert rollout.stop_token_ids(model, tok) == [tok.eos_token_id, 5, 7]
    model.generation_config.eos_token_id = 9
    assert rollout.stop_token_ids(model, tok) == [tok.eos_token_id, 9]


# ----------------------------------------------------------------------------- generate_groups

def test_groups_layout_shapes_and_masks(tok, model):
    model.train()
    tok.padding_side = "right"  # generate_groups must left-pad whatever the tokenizer's default
    try:
        torch.manual_seed(0)
        G, N = 3, 10
        r = rollout.generate_groups(model, tok, PROMPTS, G, N, temperature=1.0)
    finally:
        tok.padding_side = "left"
    assert model.training  # restored
    B, P = len(PROMPTS) * G, max(len(encode_one(tok, p)) for p in PROMPTS)
    T = r.completion_ids.shape[1]
    assert r.prompt_ids.shape == r.prompt_mask.shape == (B, P)
    assert 1 <= T <= N and r.completion_mask.shape == (B, T)
    assert r.truncated.shape == r.group.shape == (B,) and len(r.texts) == B
    assert r.completion_mask.dtype == r.truncated.dtype == torch.bool
    assert r.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert r.completion_start == P and r.input_ids.shape == r.attention_mask.shape == (B, P + T)

    stop = {tok.eos_token_id}
    for i in range(B):
        ids = encode_one(tok, PROMPTS[i // G])  # group by group, left-padded
        assert r.prompt_ids[i, P - len(ids):].tolist() == ids
        assert r.prompt_mask[i].tolist() == [0] * (P - len(ids)) + [1] * len(ids)
        assert (r.prompt_ids[i, :P - len(ids)] == tok.pad_token_id).all()
        row = r.completion_ids[i].tolist()
        assert r.completion_mask[i].tolist() == first_stop_mask(row, stop)
        n = int(r.completion_mask[i].sum())
        assert r.lengths[i] == n
        assert all(x == tok.pad_token_id for x in row[n:])  # nothing but pad after the stop
        stopped = row[n - 1] in stop
        assert bool(r.truncated[i]) == (not stopped)
        if not stopped:
            assert n == N  # a truncated row used the whole budget
        assert r.texts[i] == tok.decode(row[:n - 1] if stopped else row[:n],
                                        skip_special_tokens=True)
    assert not any("<eos>" in t or "<pad>" in t for t in r.texts)
    # sampling: the G answers to one prompt are not copies of each other
    assert len({tuple(real_tokens(r, i)) for i in range(G)}) > 1

    sub = r.select([4, 0])
    assert sub.group.tolist() == [1, 0] and sub.texts == [r.texts[4], r.texts[0]]
    assert torch.equal(sub.completion_ids, r.completion_ids[[4, 0]])


def test_stop_at_token_3_gives_4_mask_positions_and_truncation(tok, model):
    """Greedy decoding is deterministic: declare the token that row 0 emits at index 3 a stop id
    (it must not occur at indices 0..2), regenerate, and the completion stops exactly there."""
    N = 12
    free = rollout.generate_groups(model, tok, PROMPTS, 1, N, temperature=0)
    row0 = free.completion_ids[0].tolist()
    assert free.truncated[0] and row0[3] not in row0[:3], "precondition on the random model"
    s = row0[3]
    model.generation_config.eos_token_id = [tok.eos_token_id, s]
    r = rollout.generate_groups(model, tok, PROMPTS, 1, N, temperature=0)

    assert r.completion_mask[0].sum() == 4
    assert r.completion_mask[0].tolist() == [True] * 4 + [False] * (r.completion_ids.shape[1] - 4)
    assert r.completion_ids[0, :4].tolist() == row0[:4] and not r.truncated[0]
    assert r.texts[0] == tok.decode(row0[:3])  # without the stop token
    # every other row: cut at its first stop id, as predicted from the free run
    for i in range(len(PROMPTS)):
        free_row = real_tokens(free, i)
        stops = (s, tok.eos_token_id)
        cut = next((t + 1 for t, x in enumerate(free_row) if x in stops), len(free_row))
        expect = free_row[:cut]
        assert real_tokens(r, i) == expect
        assert bool(r.truncated[i]) == (expect[-1] not in (s, tok.eos_token_id))
    # at least one row that never stops: truncated, with a full mask of N tokens
    never = [i for i in range(len(PROMPTS)) if r.truncated[i]]
    assert never, "precondition: some row never emits a stop id"
    assert r.completion_ids.shape[1] == N and all(r.completion_mask[i].all() for i in never)


def test_left_padding_and_batch_size_match_one_prompt_at_a_time(tok, model):
    N = 8
    batch = rollout.generate_groups(model, tok, PROMPTS, 1, N, temperature=0)
    assert batch.prompt_mask.sum(1).unique().numel() > 1  # the prompts have different lengths
    for i, p in enumerate(PROMPTS):
        alone = rollout.generate_groups(model, tok, [p], 1, N, temperature=0)
        assert alone.prompt_mask.all()  # no padding at all
        assert real_tokens(batch, i) == real_tokens(alone, 0)
        assert batch.texts[i] == alone.texts[0] and batch.truncated[i] == alone.truncated[0]
    # group_size > 1 with greedy repeats the same answer; batch_size splits change nothing
    full = rollout.generate_groups(model, tok, PROMPTS, 2, N, temperature=0)
    for bs in (1, 3):
        split = rollout.generate_groups(model, tok, PROMPTS, 2, N, temperature=0, batch_size=bs)
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
                     "group"):
            assert torch.equal(getattr(split, name), getattr(full, name)), name
        assert split.texts == full.texts
    assert full.texts[0::2] == full.texts[1::2] == batch.texts


# ----------------------------------------------------------------- a checkpoint's generation_config

def knobs(tok):
    """What a checkpoint's generation_config.json may set that transformers turns into a logits
    processor, a stopping criterion or another decoding mode, each to a value that would change
    the samples (suppress tokens, force an EOS at the last position, forbid EOS for 40 tokens,
    penalise every repeat, keep only the top token, return 2 sequences per prompt, stop after a
    microsecond)."""
    t = tok.convert_tokens_to_ids
    return dict(
        suppress_tokens=[t("5"), t("a")], begin_suppress_tokens=[t("b")],
        forced_bos_token_id=t("c"), forced_eos_token_id=tok.eos_token_id,
        bad_words_ids=[[t("d")], [t("e"), t("f")]],
        min_length=40, min_new_tokens=8, sequence_bias=[[[t("g")], 10.0]], repetition_penalty=5.0,
        no_repeat_ngram_size=1, exponential_decay_length_penalty=(1, 3.0),
        remove_invalid_values=True, renormalize_logits=True, guidance_scale=1.5,
        watermarking_config={"greenlist_ratio": 0.25, "bias": 2.0, "context_width": 1},
        do_sample=True, temperature=0.05, top_k=1, top_p=0.1, min_p=0.9, typical_p=0.2,
        epsilon_cutoff=0.2, eta_cutoff=0.2, num_return_sequences=2, max_length=5, max_new_tokens=3,
        max_time=1e-6)


# what knobs() makes the checkpoint's own configuration build (transformers 5.24)
CHECKPOINT_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor", "SequenceBiasLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "WatermarkLogitsProcessor",
    "LogitNormalization"}


@pytest.fixture(scope="module")
def checkpoint(tok, tmp_path_factory):
    """(clean, loaded): one set of weights, with transformers' default generation_config and
    loaded from a folder whose generation_config.json sets every knob of knobs(), as a downloaded
    one would."""
    from transformers import Qwen2ForCausalLM
    clean = sharpen(tiny.build_model(tok, seed=0, hidden_size=32, num_layers=2))
    ckpt = copy.deepcopy(clean)
    ckpt.generation_config.update(**knobs(tok))
    path = tmp_path_factory.mktemp("knobs")
    ckpt.save_pretrained(path)
    loaded = Qwen2ForCausalLM.from_pretrained(path)
    # precondition: saved and read back
    assert loaded.generation_config.forced_eos_token_id == tok.eos_token_id
    return clean, loaded


def assert_same_rollouts(a, b, entropy_atol=0.0):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated",
                 "group"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.texts == b.texts
    if a.entropy is not None or b.entropy is not None:
        torch.testing.assert_close(a.entropy, b.entropy, atol=entropy_atol, rtol=0)


def test_generate_builds_no_processor_but_ours(tok, checkpoint, monkeypatch):
    """The guard against a checkpoint's knobs and against a future transformers that adds one:
    the exact logits processors and stopping criteria that `generate` builds, recorded from
    inside it (the real methods, called through). The checkpoint's own configuration builds 22
    processors; the hf engine builds ours alone (the Sampler, greedy too, where it is the argmax
    and marks NaN logits; temperature and top_p for nucleus sampling) and stops only at
    max_new_tokens or a stop id. A processor that a new transformers adds by default, or fills in
    from the checkpoint, lands in these lists and fails this test. The loop calls no generate at
    all, but for nucleus sampling."""
    _, loaded = checkpoint
    built = {"_get_logits_processor": [], "_get_stopping_criteria": []}
    for name, calls in built.items():
        def spy(*args, real=getattr(loaded, name), calls=calls, **kwargs):
            out = real(*args, **kwargs)
            calls.append([type(x).__name__ for x in out])
            return out
        monkeypatch.setattr(loaded, name, spy)

    with warnings.catch_warnings():  # precondition: the checkpoint's configuration shapes generate
        warnings.simplefilter("ignore")  # (transformers warns about its conflicting lengths)
        loaded.generate(**tok(["Q:"], return_tensors="pt"))
    assert set(built["_get_logits_processor"].pop()) == CHECKPOINT_PROCESSORS
    assert "MaxTimeCriteria" in built["_get_stopping_criteria"].pop()

    nucleus = ["TemperatureLogitsWarper", "TopPLogitsWarper"]
    for kwargs, ours in ((dict(temperature=0.7), ["Sampler"]), (dict(temperature=0), ["Sampler"]),
                         (dict(temperature=0.7, top_p=0.9), nucleus)):
        for engine in sampling.ENGINES:
            rollout.generate_groups(loaded, tok, PROMPTS, 2, 6, batch_size=4, engine=engine,
                                    **kwargs)
            calls = built["_get_logits_processor"]
            # 8 rows, 4 per generate call
            n = 0 if engine == "loop" and "temperature" in kwargs and len(kwargs) == 1 else 2
            assert calls == [ours] * n, (kwargs, engine)
            stopping = ["MaxLengthCriteria", "EosTokenCriteria"]
            assert built["_get_stopping_criteria"] == [stopping] * n
            for c in built.values():
                c.clear()
    assert loaded.generation_config.top_k == 1
    assert loaded.generation_config.forced_eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("engine", sampling.ENGINES)
def test_checkpoint_generation_config_changes_no_sample(tok, checkpoint, engine):
    """The same weights with and without every knob in generation_config.json: the same tokens,
    texts, masks, truncation flags and recorded entropies, for training's sampler, greedy
    decoding and nucleus sampling, with either engine. With the checkpoint's knobs, max_new_tokens
    12 would end every row in a forced EOS (no row truncated) and never repeat a token."""
    clean, loaded = checkpoint
    sampled = rollout.generate_groups(clean, tok, PROMPTS, 3, 12, temperature=1.0, seed=3,
                                      record_entropy=True, engine=engine)
    assert_same_rollouts(rollout.generate_groups(loaded, tok, PROMPTS, 3, 12, temperature=1.0,
                                                 seed=3, record_entropy=True, engine=engine),
                         sampled)
    assert sampled.truncated.any(), "precondition: some row runs out of tokens"
    greedy = rollout.generate_groups(clean, tok, PROMPTS, 1, 12, temperature=0, engine=engine)
    assert_same_rollouts(rollout.generate_groups(loaded, tok, PROMPTS, 1, 12, temperature=0,
                                                 engine=engine), greedy)
    nucleus = []
    for m in (clean, loaded):  # generate's own sampler draws from torch's generator
        torch.manual_seed(4)
        nucleus.append(rollout.generate_groups(m, tok, PROMPTS, 3, 12, temperature=0.7, top_p=0.9))
    assert_same_rollouts(*nucleus)

    # greedy is the argmax of the plain forward, and sampling follows softmax(logits / T) (top_k=1
    # or min_p=0.9 would make the hot samples copies of each other)
    prompt = PROMPTS[0]
    ids = torch.tensor([encode_one(tok, prompt)])
    with torch.no_grad():  # greedy by hand: argmax of the plain forward, until the EOS
        for _ in range(10):
            nxt = loaded(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if nxt == tok.eos_token_id:
                break
    manual = ids[0, len(encode_one(tok, prompt)):].tolist()
    assert len(set(manual)) < len(manual), "precondition: the greedy answer repeats a token"
    alone = rollout.generate_groups(loaded, tok, [prompt], 1, 10, temperature=0, engine=engine)
    assert real_tokens(alone, 0) == manual
    # ~ greedy
    cold = rollout.generate_groups(loaded, tok, [prompt], 2, 10, temperature=1e-4, seed=0,
                                   engine=engine)
    assert real_tokens(cold, 0) == real_tokens(cold, 1) == manual
    hot = rollout.generate_groups(loaded, tok, [prompt], 6, 10, temperature=1.0, seed=0,
                                  engine=engine)
    assert len({tuple(real_tokens(hot, i)) for i in range(6)}) > 1


def test_bad_arguments(tok, model):
    for kwargs in (dict(prompts=[]), dict(prompts="Q:"), dict(group_size=0), dict(max_new_tokens=0),
                   dict(temperature=-1.0), dict(top_p=0.0), dict(batch_size=0), dict(seed="1"),
                   dict(seed=True), dict(seed=1.0), dict(first_row=-1), dict(first_row=2.0),
                   dict(engine="vllm")):
        args = dict(prompts=PROMPTS, group_size=2, max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            rollout.generate_groups(model, tok, **args)
    with pytest.raises(ValueError,
                       match="seed=1 with top_p=0.9: nucleus sampling uses generate's own sampler"):
        rollout.generate_groups(model, tok, PROMPTS, 2, 4, top_p=0.9, seed=1)
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="completion_start"):
        rollout.completion_hidden(model, ids, ids, 0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, ids, 2, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(model, ids, ids, 2, chunk_size=0)


# ---------------------------------------------------------------- completion_hidden + head_logprobs

def token_logprobs(model, input_ids, attention_mask, start, temperature=1.0, with_entropy=True,
                   chunk_size=rollout.CHUNK_SIZE, positions=None):
    """Step 5 as the training loop composes it: the decoder body once, then the chunked head."""
    hidden = rollout.completion_hidden(model, input_ids, attention_mask, start)  # (B, T, H)
    return rollout.head_logprobs(model, hidden, input_ids[:, start:], positions, temperature,
                                 with_entropy, chunk_size)


def full_reference(model, input_ids, attention_mask, start, temperature):
    """The plain computation: all (B, T, V) logits at once, same positions, in at least float32."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits[:, start - 1:-1] / temperature, dim=-1)  # (B, T, V)
    logp = logp_all.gather(-1, input_ids[:, start:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach()


@pytest.fixture
def batch(tok, model):
    torch.manual_seed(1)
    r = rollout.generate_groups(model, tok, PROMPTS, 2, 9, temperature=1.0)
    assert (~r.prompt_mask.bool()).any()  # left padding present
    return r


def test_token_logprobs_chunked_equals_full(model, batch):
    """Chunking the head (and checkpointing each chunk) only reorders sums, so in float64 it must
    match the full-logits computation to float64 rounding, gradients included. (In float32 a
    weight gradient, a sum over ~100 positions, moved by 1.07e-5 in one element of 1024 when
    summed chunk by chunk: float32 reassociation, not an error, and no fixed float32 tolerance
    tells the two apart.)"""
    model = model.double()
    r, temp = batch, 0.7
    ids, am, start = r.input_ids, r.attention_mask, r.completion_start
    mask = r.completion_mask.double()
    T, V = ids.shape[1] - start, model.config.vocab_size
    params = [p for p in model.parameters()]
    ref_logp, ref_ent = full_reference(model, ids, am, start, temp)
    ref_grads = torch.autograd.grad((ref_logp * mask).sum(), params)
    assert ref_logp.shape == (ids.shape[0], T)

    for chunk in (1, 3, 7, T, T + 5):
        with torch.no_grad():
            logp, ent = token_logprobs(model, ids, am, start, temperature=temp, chunk_size=chunk)
        assert logp.dtype == ent.dtype == torch.float64
        torch.testing.assert_close(logp, ref_logp.detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
        assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
        assert (ent >= -1e-12).all() and (ent <= math.log(V) + 1e-12).all()

        logp, ent = token_logprobs(model, ids, am, start, temperature=temp, chunk_size=chunk)
        assert logp.requires_grad and not ent.requires_grad  # no gradient through H
        torch.testing.assert_close(logp.detach(), ref_logp.detach(), atol=1e-12, rtol=0)
        grads = torch.autograd.grad((logp * mask).sum(), params)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg, atol=1e-12, rtol=1e-10)

    logp, ent = token_logprobs(model, ids, am, start, with_entropy=False, chunk_size=4)
    assert ent is None and logp.shape == (ids.shape[0], T)
    logp, ent = token_logprobs(model, ids, am, ids.shape[1])  # no completion tokens at all
    assert logp.shape == ent.shape == (ids.shape[0], 0)
    # positions: only those asked for are computed, 0 elsewhere, the same values there
    with torch.no_grad():
        logp, ent = token_logprobs(model, ids, am, start, temperature=temp, chunk_size=3,
                                   positions=r.completion_mask)
    m = r.completion_mask
    assert (logp[~m] == 0).all() and (ent[~m] == 0).all()
    torch.testing.assert_close(logp[m], ref_logp.detach()[m], atol=1e-12, rtol=0)
    torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-12, rtol=0)


def test_token_logprobs_left_padding_equals_unpadded(model, batch):
    r = batch
    with torch.no_grad():
        logp, ent = token_logprobs(model, r.input_ids, r.attention_mask, r.completion_start,
                                   chunk_size=4)
    assert logp.dtype == ent.dtype == torch.float32  # a float32 model is scored in float32
    for i in range(r.input_ids.shape[0]):
        p = r.prompt_ids[i][r.prompt_mask[i].bool()]
        c = r.completion_ids[i][r.completion_mask[i]]
        with torch.no_grad():
            ones = torch.ones(1, len(p) + len(c), dtype=torch.long)
            one, one_ent = token_logprobs(model, torch.cat([p, c])[None], ones, len(p))
        torch.testing.assert_close(logp[i, :len(c)], one[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, :len(c)], one_ent[0], atol=1e-5, rtol=0)


def test_token_logprobs_never_saves_vocab_sized_tensors(model, batch):
    """With grad on, autograd must not keep any (B, chunk, V) tensor alive between forward and
    backward: checkpointing recomputes the logits chunk by chunk. (Without it, every chunk's
    log-softmax is saved for backward: the full logits after all.)"""
    V, H = model.config.vocab_size, model.config.hidden_size
    assert V != H
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask,
                                 batch.completion_start, chunk_size=3)
    assert saved and not [s for s in saved if len(s) >= 3 and s[-1] == V]
    logp.sum().backward()  # and the backward still works
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_token_logprobs_bf16(tok, batch):
    model = sharpen(tiny.build_model(tok, seed=0, hidden_size=32, num_layers=2)).to(torch.bfloat16)
    r = batch
    with torch.no_grad():
        logp, ent = token_logprobs(model, r.input_ids, r.attention_mask, r.completion_start,
                                   chunk_size=5)
        ref_logp, ref_ent = full_reference(model, r.input_ids, r.attention_mask,
                                           r.completion_start, 1.0)
    assert logp.dtype == ent.dtype == torch.float32
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(logp, ref_logp, atol=2e-2, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=2e-2, rtol=0)
    # exactly: the head upcast to float32, so the bf16 weights' logits are never rounded to bf16
    # again
    with torch.no_grad():
        hidden = rollout.completion_hidden(model, r.input_ids, r.attention_mask, r.completion_start)
        logits = hidden.float() @ model.get_output_embeddings().weight.float().T  # (B, T, V)
    targets = r.input_ids[:, r.completion_start:, None]
    exact = torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)
    torch.testing.assert_close(logp, exact, atol=2e-6, rtol=0)
    assert (ref_logp - exact).abs().max() > 1e-3  # what rounding the logits to bf16 would have cost


# ----------------------------------------------------------------------- the real Qwen2.5 tokenizer

@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(SHARED / "tokenizers" / "qwen2.5"))


def qwen_model(qtok):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=len(qtok), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(0)
    model = sharpen(Qwen2ForCausalLM(config))
    # <|im_end|>, <|endoftext|> as in Qwen2.5 instruct
    model.generation_config.eos_token_id = [151645, 151643]
    model.generation_config.pad_token_id = 151643
    return model


@requires_shared
def test_qwen_stop_ids(qwen_tok):
    model = qwen_model(qwen_tok)
    assert rollout.stop_token_ids(model, qwen_tok) == [151643, 151645]
    # A base model (Qwen2.5-Math-7B) names only <|endoftext|>, in its generation_config and its
    # tokenizer, but our prompts are ChatML, so it ends its turn with <|im_end|>: stop there too.
    # (The shared tokenizer made into a base model's for this test: loading a second one costs
    # seconds.)
    eos, template = qwen_tok.eos_token, qwen_tok.chat_template
    try:
        qwen_tok.eos_token = "<|endoftext|>"
        assert qwen_tok.eos_token_id == 151643 and qwen_tok.chat_template
        model.generation_config.eos_token_id = 151643
        assert rollout.stop_token_ids(model, qwen_tok) == [151643, 151645]
        qwen_tok.chat_template = None  # no chat template: no ChatML turns to end
        assert rollout.stop_token_ids(model, qwen_tok) == [151643]
    finally:
        qwen_tok.eos_token, qwen_tok.chat_template = eos, template
    assert qwen_tok.eos_token_id == 151645


@requires_shared
def test_qwen_completions_cut_at_either_stop_id(qwen_tok):
    """Relabel tokens: swapping two rows of the (tied) embedding matrix swaps the two token ids
    and changes nothing else, so the free greedy answers, relabeled, must now contain <|im_end|>
    in row 0 at index 3 and <|endoftext|> (also the pad id) in row 1 at index 5, and be cut right
    there."""
    qtok, model = qwen_tok, qwen_model(qwen_tok)
    assert qtok.pad_token_id == 151643  # pad == a stop id: padding must be found by position
    assert qtok.padding_side == "right"  # the real tokenizer's default; generate_groups left-pads
    # plain text: a ChatML prompt holds <|im_end|>, whose embedding we swap below
    prompts = PROMPTS[:2]
    free = rollout.generate_groups(model, qtok, prompts, 1, 10, temperature=0)
    a, b = free.completion_ids[0, 3].item(), free.completion_ids[1, 5].item()
    prompt_tokens = set(free.prompt_ids[free.prompt_mask.bool()].tolist())
    row0, row1 = free.completion_ids[0].tolist(), free.completion_ids[1].tolist()
    assert free.truncated.all() and a != b and not {a, b} & prompt_tokens, "precondition"
    assert a not in row0[:3] + row1[:6] and b not in row0[:4] + row1[:5], "precondition"
    assert not {151643, 151645} & set(row0 + row1), "precondition"
    w = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is w  # tied: one swap relabels input and output
    with torch.no_grad():
        for x, stop in ((a, 151645), (b, 151643)):
            w[[x, stop]] = w[[stop, x]]
    r = rollout.generate_groups(model, qtok, prompts, 1, 10, temperature=0)
    assert r.completion_mask.sum(1).tolist() == [4, 6]
    assert r.completion_ids[0, :4].tolist() == row0[:3] + [151645]
    assert r.completion_ids[1, :6].tolist() == row1[:5] + [151643]
    assert (r.completion_ids[0, 4:] == 151643).all() and (r.completion_ids[1, 6:] == 151643).all()
    assert not r.truncated.any()
    assert r.texts == [qtok.decode(row0[:3]), qtok.decode(row1[:5])]
    assert "<|im_end|>" not in r.texts[0] and "<|endoftext|>" not in r.texts[1]


# ----------------------------------------------------------------------------- the random numbers

def test_samples_do_not_depend_on_batching_engine_or_other_draws(tok, model):
    """One seed, one set of samples: every batch_size and engine, with other random draws in
    between, gives the same tokens, texts, masks and truncation flags; the entropies agree to
    float32 rounding (a batch of another shape, or a cache of another length, may sum the forward
    in another order). A batch split by hand over two calls (first_row) too. Another seed gives
    other samples; seed=None follows torch.manual_seed."""
    args = (tok, PROMPTS, 3, 8)
    # a random model rarely stops: its commonest token does
    free = rollout.generate_groups(model, *args, seed=11)
    commonest = int(free.completion_ids.flatten().mode().values)
    model.generation_config.eos_token_id = [tok.eos_token_id, commonest]
    ref = rollout.generate_groups(model, *args, temperature=1.0, seed=11, record_entropy=True)
    assert ref.truncated.any() and not ref.truncated.all(), "precondition: rows of several lengths"
    for engine in sampling.ENGINES:
        for batch_size in (None, 1, 3, 8):
            torch.rand(5)  # someone else draws from torch's generator in between
            r = rollout.generate_groups(model, *args, temperature=1.0, seed=11, record_entropy=True,
                                        engine=engine, batch_size=batch_size)
            # entropies: at most 2.6e-6 apart on this model (a few float32 ulps of values near 2.5,
            # the logits summed in another order); another row's or another T's entropy is 1e-2 away
            # or more
            assert_same_rollouts(r, ref, entropy_atol=1e-5)
    # a batch split by hand: rows 0-5 and 6-11 (the second call pads its prompts less, so compare
    # tokens)
    halves = [rollout.generate_groups(model, tok, PROMPTS[:2], 3, 8, seed=11),
              rollout.generate_groups(model, tok, PROMPTS[2:], 3, 8, seed=11, first_row=6)]
    assert ([real_tokens(h, i) for h in halves for i in range(6)]
            == [real_tokens(ref, i) for i in range(12)])
    assert [t for h in halves for t in h.texts] == ref.texts
    assert torch.equal(torch.cat([h.truncated for h in halves]), ref.truncated)

    other = rollout.generate_groups(model, *args, seed=12)
    assert sum(real_tokens(other, i) != real_tokens(ref, i) for i in range(12)) >= 6
    drawn = []
    for batch_size in (None, 2):
        torch.manual_seed(0)
        # seed=None: one draw per call
        drawn.append(rollout.generate_groups(model, *args, batch_size=batch_size))
    assert_same_rollouts(*drawn)
    torch.manual_seed(0)
    assert_same_rollouts(drawn[0], rollout.generate_groups(model, *args, seed=sampling.draw_seed()))
    with pytest.raises(ValueError, match="engine='paged' must be one of loop, hf"):
        rollout.generate_groups(model, tok, PROMPTS, 2, 4, engine="paged")


# ------------------------------------------------------------------ the decode loop against generate

def test_the_loop_equals_generate_on_a_tiny_model(tok, model):
    """rollout.decode against transformers' generate (the hf engine), on the CPU in float32, on a
    tiny model whose distributions put no uniform near an edge (so the rounding of the logits
    flips no token: test_the_engines_agree_up_to_the_rounding_of_their_logits has the general
    case): the same tokens, masks, texts, truncation flags and decoded row-positions, sampled
    (T = 1 and 0.7) and greedy, at every batch split, with prompts of different lengths, a pad id
    that is also a stop id, a row that stops at its first token, and a budget of one token; the
    entropies to float32 rounding (the loop's static cache and shared prefill sum in another
    order). On the CPU the loop checks for "all stopped" every step, so it decodes exactly the
    longest row of each call, as generate does."""
    free = rollout.generate_groups(model, tok, PROMPTS, 3, 8, seed=11, engine="hf")
    first = int(free.completion_ids[0, 0])  # row 0's first token: a stop id below
    commonest = int(free.completion_ids.flatten().mode().values)  # so that rows stop
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id, first, commonest]
    for N in (8, 1):
        for temperature, G in ((1.0, 3), (0.7, 3), (0.0, 1)):
            for batch_size in (None, 1, 3):
                kwargs = dict(temperature=temperature, batch_size=batch_size,
                              seed=11 if temperature else None, record_entropy=temperature > 0)
                loop = rollout.generate_groups(model, tok, PROMPTS, G, N, engine="loop", **kwargs)
                hf = rollout.generate_groups(model, tok, PROMPTS, G, N, engine="hf", **kwargs)
                assert_same_rollouts(loop, hf, entropy_atol=1e-5)
                step = batch_size or len(loop.texts)
                longest = [int(loop.lengths[s:s + step].max())
                           for s in range(0, len(loop.texts), step)]
                assert loop.decoded == hf.decoded == sum(
                    len(loop.texts[s:s + step]) * n for s, n in zip(range(0, 99, step), longest))
                if N == 8 and temperature == 1.0:  # preconditions
                    assert loop.lengths[0] == 1 and not loop.truncated[0]
                    assert loop.truncated.any() and (loop.lengths[~loop.truncated] > 1).any()
                if N == 1:
                    assert loop.completion_ids.shape[1] == 1


def test_a_rows_sample_is_a_function_of_its_logits_alone():
    """What is exact on any device: a row's token and entropy are a function of its logits and its
    key alone. 40 rows of the real vocabulary's width (151,936: chunks of 6 rows on a CPU),
    sampled at T = 1 and 0.7 and greedy, in one batch, one row at a time and in reverse order
    (their keys with them): the same tokens and bit for bit the same entropies; the hf engine's
    Sampler draws the same tokens from the same logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 151_936, generator=g) * 2
    keys = sampling.row_keys(9, torch.arange(40))
    for T in (1.0, 0.7, 0.0):
        token, entropy, _ = sampling.sample(logits.clone(), keys, 5, T)
        alone = [sampling.sample(logits[i:i + 1].clone(), keys[i:i + 1], 5, T) for i in range(40)]
        assert torch.equal(torch.cat([a[0] for a in alone]), token)
        assert torch.equal(torch.cat([a[1] for a in alone]), entropy)
        back = sampling.sample(logits.flip(0).clone(), keys.flip(0), 5, T)
        assert torch.equal(back[0].flip(0), token) and torch.equal(back[1].flip(0), entropy)
        sampler = sampling.Sampler(T, seed=9)
        sampler.t = 5
        assert torch.equal(sampler(None, logits.clone()).argmax(dim=-1), token)
    assert len(set(token.tolist())) > 30  # precondition: the rows differ


@requires_shared
def test_the_engines_agree_up_to_the_rounding_of_their_logits(qwen_tok, monkeypatch):
    """What is equal up to rounding: the tokens of the two engines, in float32 and under bf16
    autocast. A random model of the real vocabulary is nearly flat (each of 151,936 tokens ~7e-6
    of the mass), where a uniform can fall within rounding of an edge. Every logits row each
    engine's sampler was given is recorded: while a row's tokens agree, the engines' logits differ
    by rounding at most (here by nothing: on this CPU the shared prefill and the static cache sum
    in the same order as generate's; experiments/bench_decode.py's 256 rows of GSM8K prompts
    differ by a few ulps, and a row now and then), and every token each engine drew is sample() of
    its own logits, redrawn alone. So two engines' rows can differ only where the rounding of
    their logits moves a uniform across an edge."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(qwen_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.generation_config.eos_token_id = [151645]
    seen, real = {}, sampling.sample

    def recorded(logits, keys, t, temperature):
        seen[engine].append((logits.clone(), keys))
        return real(logits, keys, t, temperature)
    monkeypatch.setattr(sampling, "sample", recorded)
    monkeypatch.setattr(rollout, "sample", recorded)
    prompts = ["Question: a farmer has 3 cows and 8 hens; how many legs are there?\nAnswer:",
               "Q: 7 =", "Say hi:", "Count: " + " ".join(map(str, range(30)))]
    for dtype, rounding in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)):
        tokens = {}
        for engine in sampling.ENGINES:
            seen[engine] = []
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                tokens[engine] = rollout.generate_groups(model, qwen_tok, prompts, 4, 12,
                                                         seed=4).completion_ids
        assert len(seen["loop"]) == len(seen["hf"]) == 12  # no row stops: every step recorded
        same = torch.ones(16, dtype=torch.bool)
        for t, ((a, keys), (b, _)) in enumerate(zip(seen["loop"], seen["hf"])):
            assert float((a.float() - b.float()).abs()[same].max()) <= rounding
            for engine, logits in (("loop", a), ("hf", b)):
                for i in range(16):  # a function of its own logits
                    alone = real(logits[i:i + 1].clone(), keys[i:i + 1], t, 1.0)[0]
                    assert int(alone) == int(tokens[engine][i, t])
            same &= tokens["loop"][:, t] == tokens["hf"][:, t]
        assert float(seen["loop"][0][0].float().std()) > 0.1  # precondition: logits that size


def test_the_loop_is_what_runs(tok, model, monkeypatch):
    """What a learner reads is what runs: the loop by hand, a few lines over the model's plain
    forward (no cache at all: the whole sequence each step) and sampling.sample, gives the tokens
    of generate_groups' loop; and the loop calls the decoder once for the prefill of the 4 prompts
    (not their 8 rows) and once per further token, and never `generate`."""
    G, N, seed = 2, 6, 5
    stops = torch.tensor(rollout.stop_token_ids(model, tok))
    ids, mask = sampling.encode_left_padded(tok, PROMPTS, tok.pad_token_id)  # (n, P)
    ids, mask = ids.repeat_interleave(G, dim=0), mask.repeat_interleave(G, dim=0)  # (B, P)
    keys = sampling.row_keys(seed, torch.arange(len(ids)))
    done, by_hand = torch.zeros(len(ids), dtype=torch.bool), []
    model.eval()
    with torch.no_grad():
        for t in range(N):
            positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            token, _, _ = sampling.sample(logits[:, -1], keys, t, 1.0)
            token = token.masked_fill(done, tok.pad_token_id)
            done |= torch.isin(token, stops)
            by_hand.append(token)
            ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, mask[:, -1:]], 1)
    by_hand = torch.stack(by_hand, dim=1)  # (B, N)

    calls = []
    model.get_decoder().register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["input_ids"].shape), with_kwargs=True)
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("generate was called"))
    r = rollout.generate_groups(model, tok, PROMPTS, G, N, seed=seed)
    for i in range(len(ids)):
        assert real_tokens(r, i) == by_hand[i, :int(r.lengths[i])].tolist()
    T = r.completion_ids.shape[1]
    assert calls == [(4, r.completion_start)] + [(8, 1)] * (T - 1)


def test_the_two_level_search_is_the_inverse_cdf():
    """sampling.sample against the one-level inverse CDF by brute force (float64 throughout): 64
    rows of 300 tokens (not a multiple of a block: the last one is padded), a quarter of the
    logits -inf, at T = 1 and 0.7, over 40 positions: the same token wherever u lies farther than
    1e-6 (float32 rounding of the probabilities) from an edge of the cumulative distribution, a
    -inf token never; the entropy of softmax(logits / T) to 1e-5; greedy is the argmax. The logits
    are overwritten (both engines own theirs)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 3
    logits[torch.rand(64, 300, generator=g) < 0.25] = -math.inf
    keys, same, near = sampling.row_keys(7, torch.arange(64)), 0, 0
    for T in (1.0, 0.7):
        p = torch.softmax(logits.double() / T, dim=-1)  # (64, 300)
        cdf = p.cumsum(dim=-1)
        entropy = -(p * p.clamp(min=1e-300).log()).sum(dim=-1)
        for t in range(40):
            x = logits.clone()
            token, h, bad = sampling.sample(x, keys, t, T)
            assert not torch.equal(x, logits)  # overwritten
            target = sampling.stream_uniforms(keys, t) * cdf[:, -1]
            want = torch.searchsorted(cdf, target[:, None], side="right")[:, 0]
            edge = (cdf - target[:, None]).abs().min(dim=-1).values < 1e-6
            assert ((token == want) | edge).all()
            same, near = same + int((token == want).sum()), near + int(edge.sum())
            assert not torch.isinf(logits.gather(1, token[:, None])).any() and not bad.any()
            torch.testing.assert_close(h.double(), entropy, atol=1e-5, rtol=0)
    assert same >= 2 * 64 * 40 - near and near < 10  # the edges are rare
    token, h, bad = sampling.sample(logits.clone(), keys, 0, 0)
    assert torch.equal(token, logits.argmax(dim=-1)) and not h.any() and not bad.any()


@pytest.fixture
def compiling(monkeypatch):
    """The decode step compiled as on a GPU, with torch.compile's eager backend (no compiler
    needed), from a clean slate (sampling.reset: no graph, no kept cache, no failure, counts 0)."""
    sampling.reset()
    monkeypatch.setattr(sampling, "COMPILE", "eager")
    yield
    sampling.reset()


def test_the_compiled_step_is_one_graph_with_the_same_tokens(tok, model, compiling, capsys):
    """The step a GPU compiles (the decoder, the lm_head and the sampler, fullgraph=True: a graph
    break is an error), traced here with the eager backend: the same tokens as the eager loop,
    sampled and greedy, and one line for each compile. Calls at another prompt width (within the
    kept cache's power of two), seed or fewer rows (filled up to the cache's with copies of their
    last) compile nothing and build no cache; greedy decoding is one more graph over the same
    cache; a wider prompt or more rows than the kept cache are a new cache and one compile more
    (automatic dynamic shapes: the size made symbolic), after which fewer rows again compile
    nothing; greedy calls of as many rows move to the wider cache too."""
    sampling.COMPILE = "off"
    eager = rollout.generate_groups(model, tok, PROMPTS, 3, 8, seed=11, record_entropy=True)
    greedy = rollout.generate_groups(model, tok, PROMPTS, 3, 8, temperature=0)
    fewer = rollout.generate_groups(model, tok, PROMPTS, 2, 8, seed=3)
    sampling.COMPILE = "eager"
    compiled = rollout.generate_groups(model, tok, PROMPTS, 3, 8, seed=11, record_entropy=True)
    assert_same_rollouts(compiled, eager, entropy_atol=1e-5)
    assert sampling.counters() == {"decode_compiles": 1, "decode_cudagraph_records": 0,
                                   "decode_cudagraph_skips": 0, "decode_caches": 1}
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("decode step: compiled for 12 rows x 72 columns in ")  # 64 + 8
    narrower = ["Q: 1", "Question: 1+2\nAnswer:", "Q:", "Question: 5+5\nAnswer:"]
    assert compiled.prompt_ids.shape[1] != rollout.generate_groups(
        model, tok, narrower, 3, 8, seed=3).prompt_ids.shape[1]  # precondition: another width
    assert_same_rollouts(rollout.generate_groups(model, tok, PROMPTS, 2, 8, seed=3), fewer)
    assert sampling.counters()["decode_compiles"] == 1 and capsys.readouterr().err == ""
    assert_same_rollouts(rollout.generate_groups(model, tok, PROMPTS, 3, 8, temperature=0), greedy)
    assert (sampling.counters()["decode_compiles"], sampling.counters()["decode_caches"]) == (2, 1)
    assert sampling._kept["greedy"] is sampling._kept["sampled"]  # as many rows: one cache
    assert capsys.readouterr().err.startswith("decode step: compiled for 12 rows x 72 columns")
    # a prompt wider than 64 columns: a wider cache, which greedy calls (as many rows) move to
    wide = rollout.generate_groups(model, tok, ["Q: " + "1+" * 40] + PROMPTS[1:], 3, 8, seed=3)
    assert wide.prompt_ids.shape[1] > 64 and sampling.counters()["decode_caches"] == 2
    assert sampling._kept["greedy"] is sampling._kept["sampled"]
    assert sampling._kept["greedy"].layers[0].keys.shape[:3] == (12, 2, 128 + 8)
    compiles = sampling.counters()["decode_compiles"]  # 3: the width made symbolic
    rollout.generate_groups(model, tok, PROMPTS, 4, 8, seed=3)  # 16 rows
    assert (sampling.counters()["decode_compiles"], sampling.counters()["decode_caches"]) == \
        (compiles + 1, 3)
    assert "decode step: compiled for 16 rows x 136 columns" in capsys.readouterr().err
    assert_same_rollouts(rollout.generate_groups(model, tok, PROMPTS, 2, 8, seed=3), fewer)
    assert sampling.counters()["decode_compiles"] == compiles + 1
    assert not sampling.compile_failures()


def test_no_compile_and_no_new_cache_after_the_first_step(tok, model, compiling):
    """train.py's pattern, the step compiled: each step an evaluation (greedy, 13 rows in calls of
    8 and 5, numbered on over the calls) and a rollout (12 sampled rows, other prompts each
    step). Everything compiles and every cache is built in the first step; after it nothing is
    compiled or built, and the kept caches' tensors stay at the addresses they had (a CUDA graph
    replays on them: no re-record). Every call gives the eager loop's tokens."""
    prompts = [f"Question: {i}+{i % 7}\nAnswer:" for i in range(13)] + PROMPTS

    def step(i):
        evaluation = [rollout.generate_groups(model, tok, prompts[:8], 1, 6, temperature=0),
                      rollout.generate_groups(model, tok, prompts[8:13], 1, 6, temperature=0,
                                              first_row=8)]
        return evaluation + [rollout.generate_groups(model, tok, prompts[4 * i:4 * i + 4], 3, 6,
                                                     seed=i)]
    sampling.COMPILE = "off"
    eager = [step(i) for i in range(3)]
    sampling.COMPILE = "eager"
    counts, addresses = [], []
    for i in range(3):
        for got, want in zip(step(i), eager[i]):
            assert_same_rollouts(got, want)
        counts.append(sampling.counters())
        addresses.append({k: [t.data_ptr() for layer in cache.layers
                              for t in (layer.keys, layer.values)]
                          for k, cache in sampling._kept.items()})
    assert counts[0]["decode_compiles"] == 2 and counts[0]["decode_caches"] == 2
    assert counts[0] == counts[1] == counts[2]
    assert addresses[0] == addresses[1] == addresses[2] and set(addresses[0]) == {"greedy",
                                                                                  "sampled"}


def test_a_compile_failure_says_one_line_and_decodes_on_eager(tok, model, compiling, capsys,
                                                             monkeypatch):
    """A compiled step that fails (here after it wrote its column of the cache, as a failed
    capture could) must not stop the run: one line, then the eager step from the right column,
    with the eager loop's tokens; later calls do not try again."""
    sampling.COMPILE = "off"
    eager = rollout.generate_groups(model, tok, PROMPTS, 3, 8, seed=11, record_entropy=True)
    sampling.COMPILE = "eager"

    def broken(backend):
        def step(*args):
            sampling.one_token(*args)
            raise RuntimeError("capture failed\nat some depth")
        return step
    monkeypatch.setattr(sampling, "_compiled_step", broken)
    got = rollout.generate_groups(model, tok, PROMPTS, 3, 8, seed=11, record_entropy=True)
    assert_same_rollouts(got, eager, entropy_atol=1e-5)
    assert capsys.readouterr().err.splitlines() == [
        "decode step: compiling failed (RuntimeError: capture failed); decoding on without "
        "compiling"]
    assert_same_rollouts(rollout.generate_groups(model, tok, PROMPTS, 3, 8, seed=11,
                                                 record_entropy=True), eager, entropy_atol=1e-5)
    assert capsys.readouterr().err == "" and sampling.compile_failures()


# chi-square quantiles P(X > q) = 0.001 (scipy.stats.chi2.isf(0.001, df)): a fixed seed, so these
# tests are deterministic; a correct sampler passes them with probability 0.999 over seeds
CHI2_3, CHI2_99 = 16.266, 148.230


def chi_square(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampler_draws_from_exactly_softmax_over_t():
    """sampling.Sampler against the distribution by hand: 200,000 draws from 5 tokens at T = 0.7
    (2,000 rows over 100 decode steps), a chi-square goodness-of-fit test against
    softmax(logits / T) that the same draws fail against softmax(logits), each frequency within 4
    standard errors, a probability-0 token never drawn, and the entropy of softmax(logits / T)
    recorded."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -math.inf])
    T, rows, steps = 0.7, 2_000, 100
    n = rows * steps
    p = torch.softmax(logits / T, dim=-1).double()
    sampler = sampling.Sampler(T, seed=0)
    counts = torch.zeros(5, dtype=torch.float64)
    for _ in range(steps):
        out = sampler(None, logits.repeat(rows, 1))
        # one token per row
        assert ((out == 0).sum(dim=1) == 1).all() and torch.isinf(out).sum() == rows * 4
        counts += torch.bincount(out.argmax(dim=1), minlength=5)
    assert sampler.t == steps and len(sampler.entropy) == steps
    assert counts[4] == 0
    assert chi_square(counts[:4], n * p[:4]) < CHI2_3
    p_untempered = torch.softmax(logits, dim=-1).double()
    assert chi_square(counts[:4], n * p_untempered[:4]) > 100 * CHI2_3  # T matters
    freq, se = counts / n, (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4 * se + 1e-12).all(), (freq, p)
    h = -(p[:4] * p[:4].log()).sum().float()
    torch.testing.assert_close(sampler.entropy[0], h.expand(rows), atol=1e-6, rtol=0)


def splitmix64_reference(x):
    """splitmix64's finaliser on Python's unbounded ints, masked to 64 bits: the published
    algorithm."""
    mask = 2 ** 64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def uniform_reference(seed, row, t):
    golden, mask = 0x9E3779B97F4A7C15, 2 ** 64 - 1
    key = splitmix64_reference((splitmix64_reference(seed & mask) + row * golden) & mask)
    return (splitmix64_reference((key + (t + 1) * golden) & mask) >> 11) / 2 ** 53


def test_uniforms_are_splitmix64_uniform_and_independent():
    """sampling.uniforms: bit for bit the published splitmix64 (the int64 tensor arithmetic
    wraps, and its right shifts are logical), then 200,000 numbers (1,000 rows x 200 positions)
    uniform on [0, 1) by a chi-square test on 100 bins, with no correlation between neighbouring
    rows, positions or seeds."""
    # the first output of splitmix64 seeded with 0, as published (Vigna's splitmix64.c)
    assert int(sampling.splitmix64(torch.tensor(sampling.GOLDEN))) % 2 ** 64 == 0xE220A8397B1DCDAF
    rows = torch.tensor([0, 1, 2, 1000, 2 ** 40])
    for seed in (0, 1, -1, 2 ** 63 - 1, 2 ** 64 + 5, 12345678901234567890):
        for t in (0, 1, 7, 10 ** 6):
            reference = [uniform_reference(seed, r, t) for r in rows.tolist()]
            assert sampling.uniforms(seed, rows, t).tolist() == reference

    R, T = 1_000, 200
    u = torch.stack([sampling.uniforms(7, torch.arange(R), t) for t in range(T)], dim=1)  # (R, T)
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    counts = torch.bincount((u * 100).long().flatten(), minlength=100).double()
    assert chi_square(counts, torch.full((100,), R * T / 100)) < CHI2_99
    assert abs(u.mean() - 0.5) < 4 * (1 / 12 / u.numel()) ** 0.5

    def corr(a, b):
        return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])
    bound = 4 / u.numel() ** 0.5  # 4 standard errors of a correlation near 0
    other_seed = torch.stack([sampling.uniforms(8, torch.arange(R), t) for t in range(T)], dim=1)
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:]), (u[:-1, 1:], u[1:, :-1]), (u, other_seed)):
        assert abs(corr(a, b)) < bound
    # the check itself sees a correlation when there is one
    assert corr(u[:-1], u[:-1] * 0.5 + u[1:] * 0.5) > 0.5


# ------------------------------------------------------------------------- bf16 autocast on the CPU

def test_head_runs_in_float32_under_bf16_autocast(model, batch):
    """Under bf16 autocast (--dtype auto on a GPU; here the CPU's), head_logprobs computes the
    logits in float32 from the float32 hidden states and weights: the log-probs, entropies and
    the gradient equal the float32 computation outside autocast, and not the one whose logits
    were rounded to bf16 first."""
    r, temp = batch, 0.7
    targets, head = r.input_ids[:, r.completion_start:], model.get_output_embeddings()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = rollout.completion_hidden(model, r.input_ids, r.attention_mask, r.completion_start)
        rounded = head(hidden.detach())  # what the head returns under autocast
    assert hidden.dtype == torch.float32 and rounded.dtype == torch.bfloat16, "precondition"

    def reference(logits):
        logp_all = torch.log_softmax(logits.float() / temp, dim=-1)  # (B, T, V)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, targets[..., None]).squeeze(-1), entropy
    ref_logp, ref_ent = reference(hidden @ head.weight.T)  # float32, no autocast
    ref_grad, = torch.autograd.grad(ref_logp.sum(), hidden, retain_graph=True)
    with torch.no_grad():
        bf16_logp, bf16_ent = reference(rounded)
    assert (bf16_logp - ref_logp).abs().max() > 1e-3, "precondition"
    assert (bf16_ent - ref_ent).abs().max() > 1e-4, "precondition"

    for grad in (False, True):  # no grad: logp_old; grad: the checkpointed chunks of the update
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
            logp, ent = rollout.head_logprobs(model, hidden, targets, None, temp, True,
                                              chunk_size=5)
        assert logp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(logp, ref_logp, atol=2e-6, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=2e-6, rtol=0)
    grad, = torch.autograd.grad(logp.sum(), hidden)  # the backward recomputes in float32 too
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=0)


def cache_dtypes(model):
    """A forward hook on the decoder that records, at every call, the dtypes of the KV cache's
    keys and values and whether a forward hook sits on the rotary embedding. Returns (records,
    handle)."""
    records = []
    rotary = model.get_decoder().rotary_emb

    def record(module, args, kwargs, out):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layers = [] if cache is None else [layer for layer in cache.layers
                                           if getattr(layer, "keys", None) is not None]
        records.append(({layer.keys.dtype for layer in layers},
                        {layer.values.dtype for layer in layers}, bool(rotary._forward_hooks)))
    return records, model.get_decoder().register_forward_hook(record, with_kwargs=True)


def test_generation_keeps_its_cache_in_the_autocast_dtype(tok, model):
    """Under bf16 autocast with float32 weights, either engine (the loop's prefill and static
    cache, generate's dynamic cache) holds bf16 keys and bf16 values at every decode step: without
    the rotary hook the keys were float32, promoted by the float32 cos and sin. In float32 no hook
    is installed (the samples are those of before), and none is left behind either way. This also
    runs each engine's lines under autocast on the CPU."""
    records, handle = cache_dtypes(model)
    rotary = model.get_decoder().rotary_emb
    try:
        for engine in sampling.ENGINES:
            records.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                r = rollout.generate_groups(model, tok, PROMPTS, 2, 5, seed=3, engine=engine,
                                            record_entropy=True)
            assert r.completion_mask.any(dim=1).all() and r.entropy.dtype == torch.float32
            assert len(records) >= 5 and all(hooked for _, _, hooked in records), engine
            bf16 = all(keys == values == {torch.bfloat16} for keys, values, _ in records)
            assert bf16, (engine, records)
            assert not rotary._forward_hooks
            records.clear()
            rollout.generate_groups(model, tok, PROMPTS, 2, 5, seed=3, engine=engine)
            assert all(keys == values == {torch.float32} and not hooked
                       for keys, values, hooked in records), engine
    finally:
        handle.remove()


def test_the_decode_weights_are_autocasts_values(tok, model, monkeypatch):
    """Under bf16 autocast the decode reads bf16 copies of every linear's weights and the lm_head's
    (sampling.decode_weights) where autocast would cast each at every step: the same values, so
    bit for bit the same tokens and entropies, either engine. The copies follow the masters: after
    a weight changes (as an optimizer step changes it) the next call reads the new one."""
    def rollouts():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return [rollout.generate_groups(model, tok, PROMPTS, 3, 8, seed=5, engine=engine,
                                            record_entropy=True) for engine in sampling.ENGINES]
    for change in (False, True):
        if change:
            with torch.no_grad():
                model.get_decoder().layers[0].mlp.up_proj.weight.mul_(1.5)
        copied = rollouts()
        with monkeypatch.context() as m:
            m.setattr(sampling, "decode_weights", lambda *a: lambda: None)  # autocast's casts
            cast = rollouts()
        for a, b in zip(copied, cast):
            assert_same_rollouts(a, b)  # entropies too, exactly
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        if not change:
            before = copied[0]
    assert not torch.equal(before.completion_ids, copied[0].completion_ids)  # precondition


# ----------------------------------------------------------------- no host-device syncs, bad logits

def test_sampler_hashes_seed_and_rows_once_per_call(monkeypatch):
    """The seed's and the rows' keys are derived once per generate call (one copy to the device),
    each decode step hashing only its position: splitmix64 runs n + 2 times over n steps (3n
    before), and the tokens are those of the inverse CDF against uniforms(seed, row, t) at every
    step (50 tokens: one block of the two-level search)."""
    calls, real = [], sampling.splitmix64
    monkeypatch.setattr(sampling, "splitmix64", lambda x: calls.append(1) or real(x))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 50, generator=g)  # (steps, rows, V)
    sampler = sampling.Sampler(0.8, seed=5, first_row=3)
    for t in range(6):
        token = sampler(None, logits[t].clone()).argmax(dim=-1)  # the sampler overwrites it
        cdf = torch.softmax(logits[t].double() / 0.8, dim=-1).cumsum(dim=-1)
        u = sampling.uniforms(5, torch.arange(3, 7), t)
        expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], side="right")[:, 0]
        assert token.tolist() == expected.tolist()
    # the sampler's, then the reference's (uniforms hashes 3 times a call)
    assert len(calls) == 6 + 2 + 6 * 3


def test_nonfinite_logits_are_an_error(tok, model):
    """NaN or +inf logits (or a row with every logit -inf) leave a row with no distribution: the
    sampler marks the first such decode position of each row on the device and check_finite()
    raises, naming the first; a -inf logit alone is a probability-0 token, not an error. Greedy
    decoding the same: its argmax of NaN logits would be a token all the same. A model with a NaN
    weight stops generate_groups with that error, sampling or greedy, with either engine, and
    leaves the model as it found it (its float32 weights, and no copy left on its lm_head)."""
    nan, inf = math.nan, math.inf
    for temperature in (1.0, 0.0):
        sampler = sampling.Sampler(temperature, seed=0, first_row=10)
        sampler(None, torch.tensor([[0.0, 1.0, -inf], [0.0, 1.0, 2.0], [0.0, 1.0, 2.0],
                                    [0.0, 0.0, 0.0]]))
        sampler.check_finite()  # a -inf logit is fine
        sampler(None, torch.tensor([[0.0, 1.0, 2.0], [nan, 0.0, 1.0], [inf, 0.0, 1.0],
                                    [-inf, -inf, -inf]]))
        sampler(None, torch.tensor([[0.0, 1.0, 2.0], [nan, 0.0, 1.0], [0.0, 1.0, 2.0],
                                    [0.0, 1.0, 2.0]]))
        assert sampler.first_nonfinite.tolist() == [-1, 1, 1, 1]  # each row's first
        with pytest.raises(sampling.NonFiniteLogits,
                           match="3 of 4 rows; first at decode position 1 of row 11"):
            sampler.check_finite()

    with torch.no_grad():
        model.get_decoder().norm.weight[0] = nan  # every logit of every row NaN
    model.train()
    config = model.generation_config
    for engine in sampling.ENGINES:
        for temperature in (1.0, 0.0):
            with pytest.raises(sampling.NonFiniteLogits) as e:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    rollout.generate_groups(model, tok, PROMPTS, 2, 4, temperature, seed=0,
                                            batch_size=4, engine=engine)
            message = str(e.value)
            assert "\n" not in message and isinstance(e.value, RuntimeError)
            assert message.startswith("the model produced NaN or inf logits while generating "
                                      "(in 4 of 4 rows; first at decode position 0 of row 0)")
            # what to do: the caller says (train.py)
            assert message.endswith("its weights have probably diverged")
            assert model.training and model.generation_config is config
            assert not model.get_decoder().rotary_emb._forward_hooks
            assert {p.dtype for p in model.parameters()} == {torch.float32}
            assert "decode_weight" not in vars(model.get_output_embeddings())
