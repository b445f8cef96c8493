"""The update computes what it trains: a row of step 7 is forwarded up to the last column its loss
reads, and not at all when every term is exactly 0 (A = 0 with beta = 0, or no kept token). Against
the uncut computation (every kept row of the mini-batch forwarded in full, the loss over all of
them), the loss and every parameter's gradient are equal to float32 rounding: for every method,
loss, divisor, K in {1, 4}, beta in {0, 0.04}, full fine-tuning and LoRA, on a batch with mixed
lengths, zero-variance groups and rows with no trained token."""
import contextlib
import dataclasses

import pytest
import torch

import d3s
import rollout
import train
from machinery import config
from machinery.data import format_prompt, load_problems
from machinery.model import adapters_off, load_model, with_lora

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
G, RHO_S, RHO_T = 4, 0.6, 0.3
REWARDS = torch.tensor([1, 0, 0, 0,  0, 0, 0, 0,  1, 1, 0, 1,  1, 1, 1, 1.])  # 2 zero-variance groups


@pytest.fixture(scope="module")
def batch(tiny_dir):
    """16 rollouts (4 prompts x 4) sampled from the tiny model, row 11 (A = 0.5) replaced by a
    60-token truncated one written by hand (its sampler entropy 0: |A| H never keeps its tokens)."""
    model, tok = load_model(tiny_dir, device="cpu", dtype="float32")
    prompts = [format_prompt(tok, r["prompt"]) for r in load_problems("tiny", "train", limit=4)]
    ro = rollout.generate_groups(model, tok, prompts, G, 32, seed=5, record_entropy=True)
    long = tok(" 1+2=3\n" * 10)["input_ids"][:60]
    T, pad = 60, torch.nn.functional.pad
    ids = pad(ro.completion_ids, (0, T - ro.completion_ids.shape[1]), value=tok.pad_token_id)
    mask = pad(ro.completion_mask, (0, T - ro.completion_ids.shape[1]))
    entropy = pad(ro.entropy, (0, T - ro.completion_ids.shape[1]))
    ids[11], mask[11], entropy[11] = torch.tensor(long), True, 0.0
    truncated = ro.truncated.clone()
    truncated[11] = True
    out = dataclasses.replace(ro, completion_ids=ids, completion_mask=mask, entropy=entropy,
                              truncated=truncated)
    assert out.lengths[11] == 60 > out.lengths[:11].max()  # mixed lengths
    return model, tiny_dir, out


@pytest.fixture(scope="module")
def policies(batch):
    """(policy, KL reference) for full fine-tuning (a perturbed frozen copy as the reference) and
    for LoRA (adapters with B away from 0, the reference its base: the policy, adapters off): a
    2-layer Qwen2 of the tiny world's vocabulary at random, where the cuts are what is tested."""
    model, _, _ = batch
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    torch.manual_seed(0)
    cfg = {k: v for k, v in model.config.to_dict().items() if k != "layer_types"}
    policy = type(model)(type(model.config)(**{**cfg, **small}))
    g = torch.Generator().manual_seed(0)
    ref = type(policy)(policy.config)
    ref.load_state_dict({k: v + 0.01 * torch.randn(v.shape, generator=g)
                         for k, v in policy.state_dict().items()})
    frozen = type(policy)(policy.config)
    frozen.load_state_dict(policy.state_dict())
    lora = with_lora(frozen, 4, "tiny")
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return {"full": (policy.train(), ref.eval().requires_grad_(False)), "lora": (lora.train(), lora)}


def selected(batch, method):
    """Step 4 and step 6 as train.py runs them for `method`: the kept rollouts, their advantages
    and the kept tokens."""
    ro, m, gen = batch, d3s.METHODS[method], torch.Generator().manual_seed(1)
    adv = d3s.group_advantages(REWARDS, G)
    idx, adv_kept = d3s.select_samples(REWARDS, adv, G, RHO_S, m["sample"], gen)
    kept = ro.select(idx)
    token_mask = kept.completion_mask
    if m["token"] != "none":
        scores = d3s.token_scores(adv_kept, kept.entropy, m["token"])
        count = None if scores is not None else d3s.d3s_token_count(
            REWARDS, adv, ro.lengths, G, RHO_S, RHO_T)
        token_mask = d3s.select_tokens(scores, kept.completion_mask, RHO_T, gen, count)
    return kept, adv_kept, token_mask


def grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def uncut(model, ref_model, kept, rows, adv, token_mask, old_logp, cfg):
    """The plain computation: every kept row forwarded in full, the mini-batch's loss over all of
    its rows (A = 0 ones and those with no kept token included), its gradient."""
    valid, start = kept.completion_mask, kept.completion_start
    targets = kept.input_ids[:, start:]
    hidden = rollout.completion_hidden(model, kept.input_ids, kept.attention_mask, start)
    logp, _ = rollout.head_logprobs(model, hidden, targets, valid)
    old = logp.detach() if old_logp is None else old_logp
    ref_logp = None
    if cfg.beta > 0:
        with torch.no_grad(), adapters_off(ref_model):
            h = rollout.completion_hidden(ref_model, kept.input_ids, kept.attention_mask, start)
            ref_logp = rollout.head_logprobs(ref_model, h, targets, valid)[0][rows]
    div = d3s.divisors(token_mask[rows], valid[rows], cfg.divisor)
    loss, _ = d3s.policy_loss(logp[rows], old[rows], adv[rows], token_mask[rows], div,
                              loss=cfg.loss, eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
                              ref_logp=ref_logp, beta=cfg.beta, seq_mask=valid[rows])
    loss.backward()
    return loss.item(), grads(model)


def cut(model, ref_model, kept, rows, i, adv, token_mask, old_logp, cfg):
    """train.py's step 7 for mini-batch i: the micro-batches cut to what the loss reads."""
    reads = kept.completion_mask if cfg.loss == "gspo" and i else None
    cols = d3s.needed_columns(token_mask, adv, cfg.beta, reads)
    parts = train.micro_batches(kept, rows, 4, cols)
    u = train.backward(model, kept, rows, parts, adv, token_mask, old_logp if i else None, cfg,
                       contextlib.nullcontext, ref_model if cfg.beta > 0 else None)
    return (0.0 if u is None else u["loss"]), grads(model), parts, cols


@pytest.mark.parametrize("method", list(d3s.METHODS))
def test_the_cut_update_is_the_uncut_one(batch, policies, method):
    model, _, ro = batch
    kept, adv, token_mask = selected(ro, method)
    valid = kept.completion_mask
    cases = 0
    for loss in ("grpo", "gspo"):
        for divisor in d3s.DIVISORS:
            for K in (1, 4):
                cfg = config.resolve(train.Config(model="tiny", loss=loss, divisor=divisor,
                                                  updates_per_batch=K), given={"model", "loss"})
                parts = train.minibatch_rows(len(kept.texts), cfg, torch.Generator().manual_seed(2))
                for beta in (0.0, 0.04):
                    cfg = dataclasses.replace(cfg, beta=beta)
                    for kind, (policy, ref_model) in policies.items():
                        with torch.no_grad():  # a policy that has moved a little since sampling
                            h = rollout.completion_hidden(policy, kept.input_ids,
                                                          kept.attention_mask,
                                                          kept.completion_start)
                            old = rollout.head_logprobs(policy, h, kept.input_ids[
                                :, kept.completion_start:], valid)[0]
                            old += 0.05 * torch.randn(old.shape, generator=torch.Generator()
                                                      .manual_seed(3)) * valid
                        for i, rows in enumerate(parts):
                            o = old if i else None
                            want_loss, want = uncut(policy, ref_model, kept, rows, adv,
                                                    token_mask, o, cfg)
                            got_loss, got, pieces, cols = cut(policy, ref_model, kept, rows, i,
                                                              adv, token_mask, old, cfg)
                            what = (loss, divisor, K, beta, kind, i)
                            assert got_loss == pytest.approx(want_loss, rel=1e-6, abs=1e-6), what
                            assert set(got) <= set(want), what
                            for n, g in want.items():  # float32 rounding of the sums
                                err = (got.get(n, torch.zeros_like(g)) - g).norm()
                                assert err <= 1e-5 * g.norm() + 1e-9, (what, n, err, g.norm())
                            forwarded = torch.cat([p.rows for p in pieces]) if pieces else rows[:0]
                            live = token_mask[rows].any(dim=1) & ((adv[rows] != 0) | (beta > 0))
                            assert sorted(forwarded.tolist()) == sorted(rows[live].tolist()), what
                            cases += 1
    assert cases >= 2 * 3 * 2 * 2 * 2


def test_the_batch_has_what_the_cuts_skip(batch):
    """The batch of the test above holds each thing a cut leaves out, for D3S: rollouts with A = 0,
    kept rows with no kept token, and kept rows cut before their end."""
    _, _, ro = batch
    kept, adv, token_mask = selected(ro, "d3s")
    cols = d3s.needed_columns(token_mask, adv)
    assert (adv == 0).any() and (~token_mask.any(dim=1) & (adv != 0)).any()
    assert ((cols > 0) & (cols < kept.lengths)).any()
    kept, adv, token_mask = selected(ro, "grpo")
    assert (adv == 0).sum() == 8 and (d3s.needed_columns(token_mask, adv) == 0).sum() == 8


def test_needed_columns_by_hand():
    token_mask = torch.tensor([[1, 0, 1, 0, 0],
                               [0, 0, 0, 0, 0],
                               [1, 1, 0, 0, 0],
                               [0, 0, 0, 1, 0]], dtype=torch.bool)
    seq = torch.tensor([[1, 1, 1, 1, 0],
                        [1, 1, 0, 0, 0],
                        [1, 1, 1, 1, 1],
                        [1, 1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 0.0, -0.2])
    assert d3s.needed_columns(token_mask, adv).tolist() == [3, 0, 0, 4]
    assert d3s.needed_columns(token_mask, adv, beta=0.1).tolist() == [3, 0, 2, 4]  # the KL term
    assert d3s.needed_columns(token_mask, adv, 0.0, seq).tolist() == [4, 0, 0, 5]  # GSPO's s_i


def test_a_piece_masks_each_row_after_its_own_columns(batch):
    """Two rows cut to one piece: the piece is as wide as the wider cut, and each row's tokens past
    its own cut are padding (mask 0), so the compute counted is what each row's loss reads."""
    _, _, ro = batch
    cols = torch.zeros(len(ro.texts), dtype=torch.long)
    cols[[0, 11]] = torch.tensor([3, 40])  # row 11: the 60-token one
    ids, mask, start, width = ro.piece(torch.tensor([0, 11]), cols)
    assert width == 40 and mask[0, start:].tolist() == [1] * 3 + [0] * 37
    assert mask[1, start:].sum() == 40
    (p,) = train.micro_batches(ro, torch.arange(16), 16, cols)
    assert p.rows.tolist() == [11, 0]  # longest first; the rows with 0 columns left out
