"""The update of train.py: several optimizer steps per rollout batch (K), the ratio and the clip,
GSPO's sequence ratio, micro-batches cut to their own span, and the entropy recorded while sampling.
Each test compares against a hand-written reference: the plain full-width computation."""
import os
from signal import SIGINT

import pytest
import torch

from machinery import config
import d3s
import rollout
from machinery import tiny
import train
from conftest import rows, weights
from machinery.data import format_prompt, load_problems
from machinery.model import load_model
from reward import score

SMALL = dict(steps=2, prompts_per_step=4, group_size=4, eval_size=4, eval_every=100, save_every=100,
             updates_per_batch=1, lr=1e-4)  # K = 1 unless a test says otherwise (the default is 4)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def no_precision():
    return torch.autocast("cuda", enabled=False)


def token_logprobs(model, kept, with_entropy=True):
    """The plain reference: one full-width forward of every row, log-probs (and entropies) of every position."""
    hidden = rollout.completion_hidden(model, kept.input_ids, kept.attention_mask, kept.completion_start)
    return rollout.head_logprobs(model, hidden, kept.input_ids[:, kept.completion_start:], None, 1.0, with_entropy)


def old_logprobs(model, kept, parts, cfg, token_mask=None):
    """train.py's no-grad pass at K > 1: logp_old of a second mini-batch's micro-batches `parts`
    (the first takes logp_old = logp itself, and the pass skips it), where the loss reads it."""
    token_mask = kept.completion_mask if token_mask is None else token_mask
    return train.old_logprobs(model, kept, [parts], token_mask, cfg, no_precision)[0]


# ----------------------------------------------------------------------------- K = 1 is the plain step


def test_k1_step_equals_the_plain_full_width_step(tmp_path, tiny_dir):
    """train.py's first step with K = 1, against the plain computation written out by hand: the same
    rollouts (same seed), one full-width forward of every kept rollout with grad, token selection on
    the sampler's entropy pooled over the step, logp_old = logp.detach(), one step. SGD at lr 1, so
    the weights after it are the clipped gradient itself (AdamW's first step, lr * g / (|g| + eps),
    would turn a gradient within rounding of 0 into a sizable move)."""
    cfg = train.Config(model=tiny_dir, out_dir=str(tmp_path / "run"), method="d3s",
                       **{**SMALL, "steps": 1, "optimizer": "sgd", "lr": 1.0})
    train.train(cfg, log=lambda *a: None)
    log = rows(tmp_path / "run")[0]

    model, tok = load_model(tiny_dir, device="cpu", dtype="float32")
    model.train()
    batch = train.batch_at(load_problems("tiny", "train"), 0, 4, 0)
    # train.py's sampling seed for step 0 of --seed 0: seed * 1_000_003 + step
    ro = rollout.generate_groups(model, tok, [format_prompt(tok, r["prompt"]) for r in batch], 4, 32, seed=0,
                                 record_entropy=True)
    rewards = torch.tensor(score(ro.texts, [r["answer"] for r in batch for _ in range(4)])[0])
    adv = d3s.group_advantages(rewards, 4)
    rho_s, rho_t = d3s.keep_ratios(0, 1, "linear", 0.25, 0.75, 0.2, 0.6)
    idx, adv_kept = d3s.select_samples(rewards, adv, 4, rho_s, "cross")
    kept = ro.select(idx)
    logp, _ = token_logprobs(model, kept, with_entropy=False)
    mask = d3s.select_tokens(d3s.token_scores(adv_kept, kept.entropy, "adv_entropy"), kept.completion_mask, rho_t)
    loss, _ = d3s.policy_loss(logp, logp.detach(), adv_kept, mask, int(mask.sum()), seq_mask=kept.completion_mask)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9, fused=True).step()  # train.py's optimizer

    assert (log["kept"], log["tokens"], log["valid"]) == (len(idx), int(mask.sum()), int(kept.completion_mask.sum()))
    assert log["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert log["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
    assert (log["updates"], log["ratio"], log["clip_frac"]) == (1, pytest.approx(1.0), 0.0)
    after, ref = weights(tmp_path / "run" / "checkpoint"), model.state_dict()
    for k in ref:  # float reassociation only: the cuts, and the lm_head on the kept tokens
        torch.testing.assert_close(after[k], ref[k], atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------- the loop's pieces on a fixed batch


@pytest.fixture(scope="module")
def setup(tiny_dir):
    """The warmed tiny model and 17 kept rollouts: 16 sampled (4 prompts x 4), and one long truncated
    rollout written by hand (60 tokens, no stop token), as a model cut off mid-reasoning leaves."""
    model, tok = load_model(tiny_dir, device="cpu", dtype="float32")
    torch.manual_seed(3)
    prompts = [format_prompt(tok, r["prompt"]) for r in load_problems("tiny", "train", limit=4)]
    ro = rollout.generate_groups(model, tok, prompts, 4, 32, record_entropy=True)
    long_prompt = tok(format_prompt(tok, "1+2+3+4"))["input_ids"]
    long_completion = tok(" 1+2=3\n" * 10)["input_ids"][:60]
    P, T = max(ro.prompt_ids.shape[1], len(long_prompt)), 60
    pad = torch.nn.functional.pad
    prompt_ids = torch.cat([pad(ro.prompt_ids, (P - ro.prompt_ids.shape[1], 0), value=tok.pad_token_id),
                            pad(torch.tensor([long_prompt]), (P - len(long_prompt), 0), value=tok.pad_token_id)])
    prompt_mask = torch.cat([pad(ro.prompt_mask, (P - ro.prompt_ids.shape[1], 0)),
                             pad(torch.ones(1, len(long_prompt), dtype=torch.long), (P - len(long_prompt), 0))])
    completion_ids = torch.cat([pad(ro.completion_ids, (0, T - ro.completion_ids.shape[1]), value=tok.pad_token_id),
                                torch.tensor([long_completion])])
    completion_mask = torch.cat([pad(ro.completion_mask, (0, T - ro.completion_ids.shape[1])),
                                 torch.ones(1, T, dtype=torch.bool)])
    entropy = torch.cat([pad(ro.entropy, (0, T - ro.completion_ids.shape[1])), torch.zeros(1, T)])
    kept = rollout.Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask,
                            torch.cat([ro.truncated, torch.tensor([True])]), torch.cat([ro.group, torch.tensor([4])]),
                            ro.texts + [tok.decode(long_completion)], entropy)
    assert kept.lengths[-1] == 60 and kept.lengths[:-1].max() < 40
    adv = torch.linspace(-1.5, 1.5, len(kept.texts))
    return model, kept, adv


def cfg_for(**kw):
    return config.resolve(train.Config(model="tiny", **kw), given={"model", *kw})  # defaults too


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def reference_grads(model, kept, adv, token_mask, old_logp=None, loss="grpo", eps=(0.2, 0.2),
                    divisor="kept"):
    """The plain computation: one full-width forward of every kept rollout, no span cut, no micro-batches."""
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, kept, with_entropy=False)
    old = logp.detach() if old_logp is None else old_logp
    d_i = d3s.divisors(token_mask, kept.completion_mask, divisor)
    out, _ = d3s.policy_loss(logp, old, adv, token_mask, d_i, loss=loss, eps_low=eps[0],
                             eps_high=eps[1], seq_mask=kept.completion_mask)
    out.backward()
    g = grads(model)
    model.zero_grad(set_to_none=True)
    return out.item(), g


def train_grads(model, kept, adv, token_mask, size, old_logp=None, loss="grpo", divisor="kept"):
    """train.backward as train.py calls it: each row cut after the last column the loss reads."""
    model.zero_grad(set_to_none=True)
    reads = kept.completion_mask if loss == "gspo" and old_logp is not None else None
    rows = torch.arange(len(kept.texts))
    parts = train.micro_batches(kept, rows, size, d3s.needed_columns(token_mask, adv, 0.0, reads))
    cfg = cfg_for(loss=loss, divisor=divisor)
    stats = train.backward(model, kept, rows, parts, adv, token_mask, old_logp, cfg, no_precision)
    g = grads(model)
    model.zero_grad(set_to_none=True)
    return stats["loss"], g


def assert_same(ga, gb):
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-4)


def test_span_cut_and_length_sorted_micro_batches_keep_the_gradient(setup):
    """One long truncated rollout makes the whole batch 60 columns wide; cut micro-batches are
    narrower, and the gradient is the same for every micro-batch size (the divisor is global)."""
    model, kept, adv = setup
    token_mask = kept.completion_mask.clone()
    token_mask[:, ::3] = False  # some tokens dropped, as token selection would
    token_mask &= kept.completion_mask
    ref_loss, ref = reference_grads(model, kept, adv, token_mask)
    for size in (1, 3, 7, 100):
        parts = train.micro_batches(kept, torch.arange(len(kept.texts)), size)
        assert sorted(torch.cat([p.rows for p in parts]).tolist()) == list(range(len(kept.texts)))
        if size < len(kept.texts):
            assert min(p.width for p in parts) < 40 < 60 == max(p.width for p in parts)  # only the long one is wide
        loss, g = train_grads(model, kept, adv, token_mask, size)
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        assert_same(g, ref)


def test_piece_is_the_rows_own_span(setup):
    _, kept, _ = setup
    rows = torch.tensor([0, 2])
    ids, mask, start, width = kept.piece(rows)
    full_mask = kept.attention_mask[rows]
    first = int((full_mask[:, :kept.completion_start].sum(0) > 0).nonzero().min())
    assert start == kept.completion_start - first and width == int(kept.lengths[rows].max())
    assert torch.equal(ids, kept.input_ids[rows][:, first:kept.completion_start + width])
    assert torch.equal(mask, full_mask[:, first:kept.completion_start + width])


def test_entropy_recorded_while_sampling_matches_the_training_forward(setup):
    """[ours] the sampling entropy of the step line: recorded by the sampler, it must agree with the
    training forward's (on the tiny model in float32: to ~1e-6)."""
    model, kept, _ = setup
    kept = kept.select(range(16))  # the sampled rows (the 17th was written by hand)
    with torch.no_grad():
        _, ent = token_logprobs(model, kept)
    valid = kept.completion_mask
    diff = (ent - kept.entropy)[valid].abs().max().item()
    print(f"max |entropy recorded while sampling - training forward| = {diff:.2e}")
    assert diff < 1e-5, diff
    assert kept.entropy[~valid].abs().max() == 0  # padding is 0
    assert ent[valid].mean() > 0.01  # a real distribution, not a degenerate one


@pytest.mark.parametrize("divisor", d3s.DIVISORS)
def test_micro_batch_size_does_not_change_the_gradient_with_an_old_policy(setup, divisor):
    """K > 1: logp_old from the no-grad pass, ratios away from 1; still invariant to micro-batching,
    for GRPO and GSPO, under each divisor (d_i are taken once from the whole mini-batch)."""
    model, kept, adv = setup
    cfg = cfg_for()
    parts = train.micro_batches(kept, torch.arange(len(kept.texts)), 5)
    old_logp = old_logprobs(model, kept, parts, cfg)
    torch.manual_seed(0)
    old_logp = old_logp + 0.05 * torch.randn_like(old_logp)  # a policy that has moved a little
    token_mask = d3s.select_tokens(d3s.token_scores(adv, kept.entropy, "adv_entropy"), kept.completion_mask, 0.4)
    for loss in ("grpo", "gspo"):
        eps = (0.2, 0.2) if loss == "grpo" else (3e-4, 4e-4)
        ref_loss, ref = reference_grads(model, kept, adv, token_mask, old_logp, loss, eps, divisor)
        for size in (2, 100):
            got_loss, g = train_grads(model, kept, adv, token_mask, size, old_logp, loss, divisor)
            assert got_loss == pytest.approx(ref_loss, abs=1e-6)
            assert_same(g, ref)


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_old_logprobs_are_the_plain_forward_where_the_loss_reads_them(setup, loss):
    """logp_old from the no-grad pass, on cut micro-batches: the plain forward's at every token the
    loss reads (GRPO: the kept ones; GSPO: every valid one, for s_i), 0 elsewhere; counted."""
    model, kept, adv = setup
    valid = kept.completion_mask
    token_mask = valid & (torch.arange(valid.shape[1]) % 3 == 1)
    token_mask[3] = False  # a row with no kept token: not forwarded
    cfg = cfg_for(loss=loss)
    reads = valid if loss == "gspo" else token_mask
    cols = d3s.needed_columns(token_mask, adv, 0.0, valid if loss == "gspo" else None)
    parts = train.micro_batches(kept, torch.arange(len(kept.texts)), 4, cols)
    logp, counts = train.old_logprobs(model, kept, [parts], token_mask, cfg, no_precision)
    with torch.no_grad():
        ref, _ = token_logprobs(model, kept, with_entropy=False)
    live = reads & (cols > 0)[:, None]  # adv[8] is 0 and row 3 keeps nothing: neither is read
    assert not live[8].any() and not live[3].any() and live.sum() < reads.sum()
    torch.testing.assert_close(logp[live], ref[live], atol=1e-5, rtol=0)
    assert (logp[~live] == 0).all()
    prompts = kept.prompt_mask.sum(dim=1)
    assert counts["nograd_tokens"] == int((prompts + cols)[cols > 0].sum())  # up to each row's cut
    assert counts["head_rows"] == int(live.sum())
    assert counts["nograd_positions"] == sum(p.attention_mask.numel() for p in parts)


# ----------------------------------------------------------------------------- K > 1: the ratio and the clip


def split(n, seed=0, K=4, M=0):
    return train.minibatch_rows(n, train.Config(updates_per_batch=K, minibatch_size=M),
                                torch.Generator().manual_seed(seed))


def test_minibatch_rows_split_near_equal_and_k1_draws_nothing():
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    k1 = train.Config(updates_per_batch=1)
    assert [r.tolist() for r in train.minibatch_rows(5, k1, g)] == [[0, 1, 2, 3, 4]]
    assert torch.equal(g.get_state(), state)  # K = 1 draws no random number: the old runs replay exactly
    parts = split(10)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    assert [len(p) for p in split(2)] == [1, 1]  # fewer rollouts than K: no empty update


def test_a_fixed_minibatch_size_makes_ceil_kept_over_m_near_equal_updates():
    """--minibatch_size M: ceil(N / M) mini-batches of near-equal size [ours], K's shuffle."""
    same_as_k4 = split(128, seed=5, K=0, M=32)
    assert [len(p) for p in same_as_k4] == [32] * 4  # 4 updates, exactly K = 4's
    assert all(torch.equal(a, b) for a, b in zip(same_as_k4, split(128, seed=5, K=4)))
    assert [len(p) for p in split(40, K=0, M=32)] == [20, 20]  # near-equal: not 32 + 8
    assert [len(p) for p in split(97, K=0, M=32)] == [25, 24, 24, 24]
    assert [p.tolist() for p in split(20, K=0, M=32)] == [list(range(20))]  # one: in order
    assert all(torch.equal(a, b) for a, b in zip(split(97, 3, K=0, M=32), split(97, 3, K=0, M=32)))


def test_second_update_moves_the_ratio_and_the_clip_zeroes_gradients(setup):
    """After one large step the policy is off the one that sampled: ratios leave 1, and every token
    whose ratio is out of range on the side its advantage pushes gets exactly zero gradient."""
    model, kept, adv = setup
    model = type(model)(model.config)
    model.load_state_dict(setup[0].state_dict())
    cfg = cfg_for(lr=1e-2)
    rows = torch.arange(len(kept.texts))
    parts = train.micro_batches(kept, rows, 100, d3s.needed_columns(kept.completion_mask, adv))
    old_logp = old_logprobs(model, kept, parts, cfg)
    token_mask = kept.completion_mask
    u = train.backward(model, kept, rows, parts, adv, token_mask, old_logp, cfg, no_precision)
    assert u["clip_frac"] == 0.0 and abs(u["ratio_mean"] - 1) < 1e-5  # the first update is on-policy
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # a large step
    model.zero_grad(set_to_none=True)

    hidden = rollout.completion_hidden(model, kept.input_ids, kept.attention_mask, kept.completion_start).detach()
    logp, _ = rollout.head_logprobs(model, hidden, kept.input_ids[:, kept.completion_start:], token_mask)
    logp = logp.detach().requires_grad_(True)
    loss, st = d3s.policy_loss(logp, old_logp, adv, token_mask, int(token_mask.sum()), seq_mask=token_mask)
    loss.backward()
    w, a = torch.exp(logp.detach() - old_logp), adv[:, None].expand_as(logp)
    pushed_out = ((w > 1.2) & (a > 0)) | ((w < 0.8) & (a < 0))
    pushed_out &= token_mask
    assert st["clip_frac"] > 0 and pushed_out.any() and st["ratio_max"] > 1.2
    assert (logp.grad[pushed_out] == 0).all()
    inside = token_mask & (w > 0.8) & (w < 1.2) & (a != 0)
    assert inside.any() and (logp.grad[inside] != 0).all()
    # the clip's share counts the kept tokens that carry a gradient (A != 0), not those with A = 0
    signal = token_mask & (a != 0)
    assert (signal != token_mask).any()  # some kept rollout has A = 0, so the two denominators differ here
    assert st["clip_frac"] == pytest.approx(pushed_out.sum().item() / signal.sum().item())


def test_gspo_sequence_ratio_is_the_geometric_mean_by_hand(setup):
    model, kept, adv = setup
    valid = kept.completion_mask
    with torch.no_grad():
        logp, _ = token_logprobs(model, kept, with_entropy=False)
    torch.manual_seed(1)
    old = logp + 0.02 * torch.randn_like(logp)
    i = 5  # one rollout, by hand: s_i = exp(mean over its valid tokens of (logp - logp_old))
    n = int(valid[i].sum())
    s_i = torch.exp((logp[i, :n] - old[i, :n]).sum() / n).item()
    one = torch.zeros_like(valid)
    one[i, :n] = True
    loss, st = d3s.policy_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], one[i:i + 1], n, loss="gspo",
                               eps_low=0.9, eps_high=0.9, seq_mask=valid[i:i + 1])  # no clipping
    assert st["ratio_min"] == pytest.approx(s_i, rel=1e-6) and st["ratio_max"] == pytest.approx(s_i, rel=1e-6)
    assert loss.item() == pytest.approx(-s_i * adv[i].item(), rel=1e-5)


def test_k2_gspo_and_grpo_part_ways_and_the_log_shows_the_clip(tmp_path, tiny_dir):
    logs, after = {}, {}
    for loss in ("grpo", "gspo"):
        run_dir = tmp_path / loss
        # grpo keeps every rollout and token, so both mini-batches have tokens (with d3s's pooled 20%
        # of 4 rollouts, one of two mini-batches may keep none, and then it takes no step)
        train.train(train.Config(model=tiny_dir, out_dir=str(run_dir), method="grpo", loss=loss,
                                 **{**SMALL, "updates_per_batch": 2, "lr": 1e-3, "steps": 1, "save_every": 1,
                                    "prompts_per_step": 8, "group_size": 8}),  # 4 x 4 had no signal
                    log=lambda *a: None)
        logs[loss], after[loss] = rows(run_dir)[0], weights(run_dir / "checkpoint")
    for loss, r in logs.items():
        assert r["updates"] == 2 and len(r["losses"]) == 2
        assert max(1 - r["ratio_min"], r["ratio_max"] - 1) > 1e-3, loss  # the second update is off-policy
    assert logs["gspo"]["clip_frac"] > 0 and logs["grpo"]["clip_frac"] > 0  # GSPO's eps is 3e-4 / 4e-4
    assert logs["grpo"]["var_adv"] > 0  # the batch has a signal
    assert (logs["grpo"]["kept"], logs["grpo"]["tokens"]) == (logs["gspo"]["kept"], logs["gspo"]["tokens"])
    assert any(not torch.equal(after["grpo"][k], after["gspo"][k]) for k in after["grpo"])


def test_k2_resume_reproduces_the_uninterrupted_run(tmp_path, tiny_dir):
    kw = dict(SMALL, steps=3, updates_per_batch=2, method="d3s")
    train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "full"), **kw), log=lambda *a: None)

    def interrupt_after_step_0(line):
        if line.startswith("step    0 "):
            os.kill(os.getpid(), SIGINT)  # a real Ctrl-C: the run stops at the step's end
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "cut"), **kw), log=interrupt_after_step_0)
    train.train(train.Config(resume=str(tmp_path / "cut")), log=lambda *a: None)
    full, cut = rows(tmp_path / "full"), rows(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2]
    for a, b in zip(full, cut):
        for key in ("reward", "kept", "tokens", "losses", "grad_norm", "ratio_min", "ratio_max", "clip_frac"):
            assert a[key] == b[key], (a["step"], key)
    wa, wb = weights(tmp_path / "full" / "checkpoint"), weights(tmp_path / "cut" / "checkpoint")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_minibatch_size_and_random_controls_replay_exactly(tmp_path, tiny_dir):
    """A d3s-random run with a fixed mini-batch size: the same seed draws the same rollouts, tokens
    and mini-batches, so two runs, and one cut after step 0 and resumed, end in the same weights."""
    kw = dict(SMALL, steps=3, method="d3s-random", minibatch_size=3, lr=1e-3, prompts_per_step=8,
              group_size=4)
    del kw["updates_per_batch"]  # M sets the updates: giving K too is refused
    for name in ("a", "b"):
        train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / name), **kw),
                    log=lambda *a: None)

    def interrupt_after_step_0(line):
        if line.startswith("step    0 "):
            os.kill(os.getpid(), SIGINT)  # a real Ctrl-C: the run stops at the step's end
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "cut"), **kw),
                    log=interrupt_after_step_0)
    train.train(train.Config(resume=str(tmp_path / "cut")), log=lambda *a: None)
    a, b, cut = rows(tmp_path / "a"), rows(tmp_path / "b"), rows(tmp_path / "cut")
    assert a == [{**r, **{k: a[i][k] for k in r if k.startswith("t_")}} for i, r in enumerate(b)]
    for x, y in zip(a, cut):
        for key in ("reward", "kept", "tokens", "losses", "grad_norm", "updates", "minibatches"):
            assert x[key] == y[key], (x["step"], key)
    # kept 0.25 -> 0.75 of 32 rollouts at M = 3: ceil(8 / 3) = 3 updates, then up to 24 / 3 = 8
    assert [r["minibatches"] for r in a if not r["no_signal"]] == [-(-r["kept"] // 3) for r in a
                                                                   if not r["no_signal"]]
    assert a[0]["kept"] == 8 and a[-1]["kept"] == 24
    assert any(r["updates"] > 1 for r in a)
    wa, wb, wc = (weights(tmp_path / n / "checkpoint") for n in ("a", "b", "cut"))
    assert all(torch.equal(wa[k], wb[k]) and torch.equal(wa[k], wc[k]) for k in wa)
    with open(tmp_path / "a" / "config.json") as f:
        assert '"updates_per_batch": 0' in f.read()  # M sets the updates: K is recorded as 0


def test_tiny_worlds_are_known():
    assert "tiny" in tiny.WORLDS and tiny.world_of("tiny") == "tiny" and tiny.world_of("Qwen2.5-0.5B") is None


def test_grpo_forwards_what_the_filter_forwards_and_trains_every_token(tmp_path, tiny_dir):
    """grpo-filter against GRPO on the same step 0 (one seed: the same rollouts). The filter keeps
    exactly the rollouts of the mixed groups and trains every one of their tokens. GRPO keeps all B
    and trains every token, A = 0 ones included (its divisor counts them), but forwards only the
    filter's rollouts, prompt and completion: those with A = 0 carry exactly no gradient. Tiny's
    prompts all have one length L, so each count is exact by hand."""
    kw = dict(SMALL, steps=1, prompts_per_step=8, group_size=4, seed=3)
    for m in ("grpo", "grpo-filter"):
        train.train(train.Config(model=tiny_dir, method=m, out_dir=str(tmp_path / m), **kw),
                    log=lambda *a: None)
    g, f = rows(tmp_path / "grpo")[0], rows(tmp_path / "grpo-filter")[0]
    assert g["reward"] == f["reward"] and g["valid_all"] == f["valid_all"]  # the same rollouts
    assert 0 < g["zero_var"] < 1  # some groups carry no signal, some do
    _, tokenizer = load_model(tiny_dir)
    prompt = format_prompt(tokenizer, load_problems("tiny", "train", limit=1)[0]["prompt"])
    L = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert g["kept"] == 32 and g["tokens"] == g["valid"] == g["valid_all"]  # all in GRPO's loss
    assert f["kept"] == round(32 * (1 - g["zero_var"])) < 32
    assert f["tokens"] == f["valid"] < g["valid_all"]  # every token of a kept rollout is trained
    assert f["fwd_bwd_tokens"] == f["kept"] * L + f["valid"] == g["fwd_bwd_tokens"]
    assert g["head_rows"] == f["head_rows"] == f["valid"]  # K = 1: the head on trained tokens alone
    assert g["nograd_tokens"] == f["nograd_tokens"] == 0  # K = 1: no logp_old pass
    # the gradient differs by the divisor alone (kept: every token trained, A = 0 ones too)
    assert g["grad_norm"] == pytest.approx(f["grad_norm"] * f["tokens"] / g["tokens"], rel=1e-4)
