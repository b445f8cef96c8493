"""rollout.py on tiny real models: group layout, masks by position, stop ids, left padding, and
chunked log-probs / entropies against the plain full-logits computation."""
import math

import pytest
import torch
from conftest import SHARED, requires_shared

import rollout
import tiny

PROMPTS = ["Question: 3+8+5+9\nAnswer:", "Question: 1+2\nAnswer:", "Question: 12+7+1+40+6\nAnswer:", "Q:"]


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
    ids = torch.tensor([[10, 11, qeos, qeos, qeos], [10, 11, 12, 13, 14], [qeos, qeos, qeos, qeos, qeos]])
    mask = rollout.completion_mask(ids, [151645, qeos])
    assert mask.tolist() == [[True, True, True, False, False], [True] * 5, [True, False, False, False, False]]


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
        assert r.texts[i] == tok.decode(row[:n - 1] if stopped else row[:n], skip_special_tokens=True)
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

    assert r.completion_mask[0].sum() == 4 and r.completion_mask[0].tolist() == [True] * 4 + [False] * (r.completion_ids.shape[1] - 4)
    assert r.completion_ids[0, :4].tolist() == row0[:4] and not r.truncated[0]
    assert r.texts[0] == tok.decode(row0[:3])  # without the stop token
    # every other row: cut at its first stop id, as predicted from the free run
    for i in range(len(PROMPTS)):
        free_row = real_tokens(free, i)
        expect = free_row[:next((t + 1 for t, x in enumerate(free_row) if x in (s, tok.eos_token_id)), len(free_row))]
        assert real_tokens(r, i) == expect
        assert bool(r.truncated[i]) == (expect[-1] not in (s, tok.eos_token_id))
    # at least one row that never stops: truncated, with a full mask of N tokens
    never = [i for i in range(len(PROMPTS)) if r.truncated[i]]
    assert never, "precondition: some row never emits a stop id"
    assert r.completion_ids.shape[1] == N and all(r.completion_mask[i].all() for i in never)


def test_left_padding_and_batch_size_match_one_prompt_at_a_time(tok, model):
    N = 8
    batch = rollout.generate_groups(model, tok, PROMPTS, 1, N, temperature=0)
    assert batch.prompt_mask.sum(1).unique().numel() > 1  # the prompts really have different lengths
    for i, p in enumerate(PROMPTS):
        alone = rollout.generate_groups(model, tok, [p], 1, N, temperature=0)
        assert alone.prompt_mask.all()  # no padding at all
        assert real_tokens(batch, i) == real_tokens(alone, 0)
        assert batch.texts[i] == alone.texts[0] and batch.truncated[i] == alone.truncated[0]
    # group_size > 1 with greedy repeats the same answer; batch_size splits change nothing
    full = rollout.generate_groups(model, tok, PROMPTS, 2, N, temperature=0)
    for bs in (1, 3):
        split = rollout.generate_groups(model, tok, PROMPTS, 2, N, temperature=0, batch_size=bs)
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "group"):
            assert torch.equal(getattr(split, name), getattr(full, name)), name
        assert split.texts == full.texts
    assert full.texts[0::2] == full.texts[1::2] == batch.texts


def test_generation_config_sampling_knobs_are_ignored(tok, model):
    """Rollouts must follow softmax(logits / T) whatever generation_config.json says, since
    token_logprobs scores them with exactly that distribution."""
    prompt = PROMPTS[0]
    ids = torch.tensor([encode_one(tok, prompt)])
    with torch.no_grad():  # greedy by hand: argmax of the plain forward, until the EOS
        for _ in range(10):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if nxt == tok.eos_token_id:
                break
    manual = ids[0, len(encode_one(tok, prompt)):].tolist()
    assert len(set(manual)) < len(manual), "precondition: the greedy answer repeats a token"

    gc = model.generation_config
    gc.repetition_penalty, gc.no_repeat_ngram_size, gc.top_k, gc.min_p, gc.do_sample = 50.0, 1, 1, 0.9, True
    greedy = rollout.generate_groups(model, tok, [prompt], 1, 10, temperature=0)
    assert real_tokens(greedy, 0) == manual
    torch.manual_seed(0)
    cold = rollout.generate_groups(model, tok, [prompt], 2, 10, temperature=1e-4)  # ~ greedy
    assert real_tokens(cold, 0) == real_tokens(cold, 1) == manual
    torch.manual_seed(0)
    hot = rollout.generate_groups(model, tok, [prompt], 6, 10, temperature=1.0)  # top_k=1 or min_p=0.9 would give copies
    assert len({tuple(real_tokens(hot, i)) for i in range(6)}) > 1


def test_bad_arguments(tok, model):
    for kwargs in (dict(prompts=[]), dict(prompts="Q:"), dict(group_size=0), dict(max_new_tokens=0),
                   dict(temperature=-1.0), dict(top_p=0.0), dict(batch_size=0)):
        args = dict(prompts=PROMPTS, group_size=2, max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            rollout.generate_groups(model, tok, **args)
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="completion_start"):
        rollout.token_logprobs(model, ids, ids, 0)
    with pytest.raises(ValueError, match="temperature"):
        rollout.token_logprobs(model, ids, ids, 2, temperature=0.0)


# ----------------------------------------------------------------------------- token_logprobs

def full_reference(model, input_ids, attention_mask, start, temperature):
    """The plain computation: all (B, T, V) logits at once, same positions."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
    logp_all = torch.log_softmax(logits[:, start - 1:-1].float() / temperature, dim=-1)  # (B, T, V)
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
    r, temp = batch, 0.7
    ids, am, start, mask = r.input_ids, r.attention_mask, r.completion_start, r.completion_mask.float()
    T, V = ids.shape[1] - start, model.config.vocab_size
    params = [p for p in model.parameters()]
    ref_logp, ref_ent = full_reference(model, ids, am, start, temp)
    ref_grads = torch.autograd.grad((ref_logp * mask).sum(), params)
    assert ref_logp.shape == (ids.shape[0], T)

    for chunk in (1, 3, 7, T, T + 5):
        with torch.no_grad():
            logp, ent = rollout.token_logprobs(model, ids, am, start, temperature=temp, chunk_size=chunk)
        assert logp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(logp, ref_logp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
        assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
        assert (ent >= -1e-6).all() and (ent <= math.log(V) + 1e-5).all()

        logp, ent = rollout.token_logprobs(model, ids, am, start, temperature=temp, chunk_size=chunk)
        assert logp.requires_grad and not ent.requires_grad  # no gradient through H
        torch.testing.assert_close(logp.detach(), ref_logp.detach(), atol=1e-5, rtol=0)
        grads = torch.autograd.grad((logp * mask).sum(), params)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-4)

    logp, ent = rollout.token_logprobs(model, ids, am, start, with_entropy=False, chunk_size=4)
    assert ent is None and logp.shape == (ids.shape[0], T)
    logp, ent = rollout.token_logprobs(model, ids, am, ids.shape[1])  # no completion tokens at all
    assert logp.shape == ent.shape == (ids.shape[0], 0)


def test_token_logprobs_left_padding_equals_unpadded(model, batch):
    r = batch
    with torch.no_grad():
        logp, ent = rollout.token_logprobs(model, r.input_ids, r.attention_mask, r.completion_start, chunk_size=4)
    for i in range(r.input_ids.shape[0]):
        p = r.prompt_ids[i][r.prompt_mask[i].bool()]
        c = r.completion_ids[i][r.completion_mask[i]]
        with torch.no_grad():
            one, one_ent = rollout.token_logprobs(model, torch.cat([p, c])[None], torch.ones(1, len(p) + len(c),
                                                  dtype=torch.long), len(p))
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
        logp, _ = rollout.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_start,
                                         chunk_size=3)
    assert saved and not [s for s in saved if len(s) >= 3 and s[-1] == V]
    logp.sum().backward()  # and the backward still works
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_token_logprobs_bf16(tok, batch):
    model = sharpen(tiny.build_model(tok, seed=0, hidden_size=32, num_layers=2)).to(torch.bfloat16)
    r = batch
    with torch.no_grad():
        logp, ent = rollout.token_logprobs(model, r.input_ids, r.attention_mask, r.completion_start, chunk_size=5)
        ref_logp, ref_ent = full_reference(model, r.input_ids, r.attention_mask, r.completion_start, 1.0)
    assert logp.dtype == ent.dtype == torch.float32
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(logp, ref_logp, atol=2e-2, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=2e-2, rtol=0)


# ----------------------------------------------------------------------------- the real Qwen2.5 tokenizer

@pytest.fixture(scope="module")
def qwen_tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(SHARED / "tokenizers" / "qwen2.5"))


def qwen_model(qtok):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=len(qtok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    model = sharpen(Qwen2ForCausalLM(config))
    model.generation_config.eos_token_id = [151645, 151643]  # <|im_end|>, <|endoftext|> as in Qwen2.5 instruct
    model.generation_config.pad_token_id = 151643
    return model


@requires_shared
def test_qwen_stop_ids(qwen_tok):
    from transformers import AutoTokenizer
    model = qwen_model(qwen_tok)
    assert rollout.stop_token_ids(model, qwen_tok) == [151643, 151645]
    # A base model (Qwen2.5-Math-7B) names only <|endoftext|>, in its generation_config and its
    # tokenizer, but our prompts are ChatML, so it ends its turn with <|im_end|>: stop there too.
    base_tok = AutoTokenizer.from_pretrained(str(SHARED / "tokenizers" / "qwen2.5"), eos_token="<|endoftext|>")
    assert base_tok.eos_token_id == 151643 and base_tok.chat_template
    model.generation_config.eos_token_id = 151643
    assert rollout.stop_token_ids(model, base_tok) == [151643, 151645]
    base_tok.chat_template = None  # no chat template: no ChatML turns to end
    assert rollout.stop_token_ids(model, base_tok) == [151643]


@requires_shared
def test_qwen_completions_cut_at_either_stop_id(qwen_tok):
    """Relabel tokens: swapping two rows of the (tied) embedding matrix swaps the two token ids and
    changes nothing else, so the free greedy answers, relabeled, must now contain <|im_end|> in row 0
    at index 3 and <|endoftext|> (also the pad id) in row 1 at index 5, and be cut right there."""
    qtok, model = qwen_tok, qwen_model(qwen_tok)
    assert qtok.pad_token_id == 151643  # pad == a stop id: padding must be found by position
    assert qtok.padding_side == "right"  # the real tokenizer's default; generate_groups left-pads anyway
    prompts = PROMPTS[:2]  # plain text: a ChatML prompt holds <|im_end|>, whose embedding we swap below
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


def test_generation_caches_give_the_same_samples(tok, model):
    """prefix (a prompt's KV cache computed once for its group), plain and static: the same tokens
    from the same seed, and the same recorded entropy; prefix also with groups split over calls."""
    outs = {}
    for cache, batch_size in (("plain", None), ("prefix", None), ("static", None), ("plain", 3), ("prefix", 4)):
        torch.manual_seed(5)
        outs[cache, batch_size] = rollout.generate_groups(model, tok, PROMPTS, 3, 8, temperature=1.0, cache=cache,
                                                          batch_size=batch_size, record_entropy=True)
    for key, r in outs.items():
        # several generate calls draw random numbers in another order; prefix rounds 4 rows down to a whole group
        ref = outs["plain", None if key[1] is None else 3]
        assert torch.equal(r.completion_ids, ref.completion_ids), key
        assert torch.equal(r.completion_mask, ref.completion_mask), key
        torch.testing.assert_close(r.entropy, ref.entropy, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cache='paged' must be one of prefix, plain, static"):
        rollout.generate_groups(model, tok, PROMPTS, 2, 4, cache="paged")


def test_sampler_draws_from_exactly_softmax_over_t():
    """rollout.Sampler against the distribution by hand: 200,000 draws from 5 tokens at T = 0.7,
    frequencies within 4 standard errors, a probability-0 token never drawn, and the entropy of
    softmax(logits / T) recorded."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -math.inf])
    T, n = 0.7, 200_000
    p = torch.softmax(logits / T, dim=-1)
    torch.manual_seed(0)
    sampler = rollout.Sampler(T)
    out = sampler(None, logits.repeat(n, 1))
    assert ((out == 0).sum(dim=1) == 1).all() and torch.isinf(out).sum() == n * 4  # one token per row
    freq = torch.bincount(out.argmax(dim=1), minlength=5).double() / n
    se = (p * (1 - p) / n).sqrt().double()
    assert ((freq - p.double()).abs() <= 4 * se + 1e-12).all(), (freq, p)
    assert freq[4] == 0
    h = -(p[:4] * p[:4].log()).sum()
    torch.testing.assert_close(sampler.entropy[0], h.expand(n), atol=1e-6, rtol=0)
