"""
trl_d3s.py: D3S inside TRL's GRPOTrainer, checked against d3s.py's functions and plain GRPOTrainer.
CPU, offline, tiny Qwen2 models built in code. The two-process test forks two processes from this
one (gloo, the environment torchrun sets); the code they run is two_process_worker, at the bottom.
"""
import copy
import dataclasses
import gc
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

import d3s
from machinery import tiny
from experiments import trl_d3s
from experiments.trl_d3s import D3SConfig, D3STrainer, process_shares
from conftest import SHARED, requires_shared

G, T = 4, 6  # group size; completion width of the synthetic batches
DATASET = Dataset.from_list([{"prompt": f"Question: {a}+{b}\nAnswer:", "answer": str((a + b) % 10)}
                             for a in range(10) for b in range(10)])


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Trainer.train ends in accelerate's free_memory, a gc.collect over every object of the
    process: 0.5 s of a 0.6 s step here, most of it the imported libraries. Frozen, they are not
    scanned (and any garbage among them waits for the unfreeze)."""
    gc.freeze()
    yield
    gc.unfreeze()


def checksum_reward(completions, **kwargs):
    """A reward that differs between the completions of a random model: advantages are not all 0."""
    return [sum(map(ord, text)) % 7 / 6 for text in completions]


def make_trainer(out, method="d3s", per_device=8, accumulation=1, plain=False, model=None,
                 **overrides):
    """A trainer on a 1-layer tiny Qwen2, ready for direct calls (Trainer.train's setup done)."""
    tokenizer = tiny.build_tokenizer()
    model = model if model is not None else tiny.build_model(tokenizer, hidden_size=32,
                                                             num_layers=1)
    knobs = dict(output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False,
                 report_to="none", save_strategy="no", logging_steps=1,
                 per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                 num_generations=G, max_completion_length=T, max_steps=1, learning_rate=1e-3,
                 seed=0)
    knobs.update(overrides)
    if plain:
        trainer_class, args = GRPOTrainer, GRPOConfig(**knobs)
    else:
        trainer_class, args = D3STrainer, D3SConfig(method=method, **knobs)
    trainer = trainer_class(model=model, reward_funcs=checksum_reward, args=args,
                            train_dataset=DATASET, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model.train()
    return trainer


def synthetic(B, seed, rewards=None):
    """A scored batch as TRL's _generate_and_score_completions returns it (text-only), B rollouts in
    groups of G. The last prompt token of row i is the token id 2 + i, so fake_entropy can find it.
    Returns (batch, rewards (B,), entropy (B, T))."""
    g = torch.Generator().manual_seed(seed)
    if rewards is None:
        rewards = torch.randint(0, 2, (B,), generator=g).float()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    batch = {
        "prompt_ids": torch.tensor([[5, 6, 2 + i] for i in range(B)]),
        "prompt_mask": torch.ones(B, 3, dtype=torch.long),
        "completion_ids": torch.randint(2, 90, (B, T), generator=g) * completion_mask,  # 0 is <pad>
        "completion_mask": completion_mask,
        "advantages": d3s.group_advantages(rewards, G),
    }
    return batch, rewards, torch.rand(B, T, generator=g) * 3


def local_rows(batch, start, stop):
    """One process's rows, as narrow as TRL pads them, with the whole batch's num_items_in_batch."""
    rows = {key: t[start:stop] for key, t in batch.items()}
    width = int(rows["completion_mask"].sum(dim=1).max())
    for key in ("completion_ids", "completion_mask"):
        rows[key] = rows[key][:, :width]
    rows["num_items_in_batch"] = batch["completion_mask"].sum()
    return rows


def fake_entropy(entropy):
    """Stands in for TRL's scoring forward: each row's entropies, found by the id in its last
    prompt token."""
    def forward(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        h = entropy[input_ids[:, -logits_to_keep - 1] - 2, :logits_to_keep]
        return torch.zeros_like(h), h, None
    return forward


def down_sample(trainer, local, rewards, step=0, steps=1):
    trainer.state.global_step, trainer.state.max_steps = step, steps
    return trainer._down_sample(local, rewards)


def trained(micro_batches):
    """{rollout: (advantage, kept token columns)} of every real row of the micro-batches. Fillers
    must be weightless (no valid token, advantage 0) and are left out; no rollout may come twice."""
    out = {}
    for mb in micro_batches:
        for i, rollout in enumerate(mb["rollout_index"].tolist()):
            if rollout < 0:
                assert mb["completion_mask"][i].sum() == 0 and mb["advantages"][i] == 0
                continue
            assert rollout not in out
            kept = (mb["tool_mask"][i] * mb["completion_mask"][i]).bool()
            out[rollout] = (mb["advantages"][i].item(), kept.nonzero().flatten().tolist())
    return out


def expected(batch, rewards, entropy, method, rho_s, rho_t):
    """The same, straight from d3s.py on the whole batch at the ratios rho_s, rho_t: what train.py
    would keep."""
    m = d3s.METHODS[method]
    index, adv = d3s.select_samples(rewards, batch["advantages"], G, rho_s, m["sample"])
    valid = batch["completion_mask"].bool()[index]
    if m["token"] == "none":
        mask = valid
    else:
        scores = d3s.token_scores(adv, entropy[index], m["token"])
        mask = d3s.select_tokens(scores, valid, rho_t)
    return {int(i): (a.item(), mask[j].nonzero().flatten().tolist())
            for j, (i, a) in enumerate(zip(index, adv))}


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for rollout, (adv, cols) in want.items():
        assert got[rollout][0] == pytest.approx(adv, abs=1e-6), rollout
        assert list(got[rollout][1]) == cols, rollout

# -----------------------------------------------------------------------------
# the pieces


def test_process_shares_by_hand():
    shares = lambda *a: [s.tolist() for s in process_shares(*a)]  # noqa: E731
    assert shares(5, 2, 2) == [[0, 1, 2], [3, 4, -1]]  # near-equal contiguous shares, one filler
    assert shares(16, 8, 1) == [[2 * p, 2 * p + 1] for p in range(8)]  # nothing to fill
    assert shares(1, 2, 2) == [[0, -1], [-1, -1]]  # every micro-batch of every process gets a row
    assert shares(7, 1, 3) == [list(range(7))]


def test_config_knobs_are_train_pys(tmp_path):
    import train
    defaults = {f.name: f.default for f in dataclasses.fields(train.Config)}
    config = D3SConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for name in ("method", "s_init", "s_final", "t_init", "t_final"):
        assert getattr(config, name) == defaults[name], name
    for method in d3s.METHODS:
        config = D3SConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", method=method)
        assert config.method == method


@pytest.mark.parametrize("bad, message", [
    (dict(method="d4s"), "unknown"),
    (dict(s_init=0.0), "s_init"),
    (dict(t_final=1.5), "t_final"),
    (dict(loss_type="grpo"), "dapo"),
    (dict(top_entropy_quantile=0.2), "method='entropy'"),
    (dict(method="grpo", s_init=0.5), r"s_init 0.5 does not apply to method 'grpo': it trains with "
                                      r"\(rho_s, rho_t\) \(1.0, 1.0\) at the first step and "
                                      r"\(1.0, 1.0\) at the last, whatever s_init is"),
])
def test_config_refuses(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        D3SConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **bad)


def test_config_refuses_a_ratio_the_method_ignores(tmp_path):
    # as train.py: a keep ratio away from its default, which the method would not read, is refused
    uses = {"grpo": set(), "pods": {"s_init"}, "d1s": {"s_init"}, "d1s-cross": {"s_init"},
            "d2s": {"s_init", "t_init"}, "d3s": set(trl_d3s.RATIOS), "d3s-i": set(trl_d3s.RATIOS),
            "entropy": set(), "d3s-random": set(trl_d3s.RATIOS),
            "d1s-cross-random": {"s_init"},  # without a schedule no *_final is read
            "grpo-filter": set(), "d3s-entropy": set(trl_d3s.RATIOS),
            "d3s-random-nonzero": set(trl_d3s.RATIOS)}
    refused = {}
    for method in d3s.METHODS:
        for name in trl_d3s.RATIOS:
            try:
                D3SConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", method=method,
                          **{name: 0.35})
            except ValueError as e:
                assert str(e).startswith(f"{name} 0.35 does not apply to method {method!r}"), e
                refused.setdefault(method, set()).add(name)
    assert {m: set(trl_d3s.RATIOS) - refused.get(m, set()) for m in d3s.METHODS} == uses


def test_command_line_refusal_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        trl_d3s.main(["--output_dir", str(tmp_path), "--method", "entropy", "--t_init", "0.3",
                      "--use_cpu", "true"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: t_init 0.3 does not apply to method 'entropy'")
    assert "\n" not in err

def test_reward_is_reward_grade(monkeypatch):
    stop = {1}  # <eos> of the tiny tokenizer
    reward = trl_d3s.correctness_reward(stop)
    got = reward([" 3+8=1\n#### 5", "#### 4"], answer=["5", "5"], completion_ids=[[3, 1], [3, 1]])
    assert got == [1.0, 0.0]
    seen = []  # reward.grade is getting a truncated= argument: it is passed only if grade takes it

    def grade(text, reference, truncated=False):
        seen.append(truncated)
        return 0.0
    monkeypatch.setattr(trl_d3s, "grade", grade)
    trl_d3s.correctness_reward(stop)(["a", "b"], answer=["1", "1"], completion_ids=[[3, 1], [3, 4]])
    assert seen == [False, True]  # the second one never reached a stop token

# -----------------------------------------------------------------------------
# one process


# Every method: the knobs it reads, and the (rho_s, rho_t) it applies at the first and the last of 2
# steps, by hand: 1 where it keeps everything, the 80/20 baseline's 0.2 of tokens, no schedule but
# d3s's and d3s-i's
APPLIED = {
    "grpo":      ({}, [(1, 1), (1, 1)]),
    "pods":      (dict(s_init=0.4), [(0.4, 1), (0.4, 1)]),
    "d1s":       (dict(s_init=0.4), [(0.4, 1), (0.4, 1)]),
    "d1s-cross": (dict(s_init=0.4), [(0.4, 1), (0.4, 1)]),
    "d2s":       (dict(s_init=0.4, t_init=0.3), [(0.4, 0.3), (0.4, 0.3)]),
    # s_final, t_final: the defaults
    "d3s":       (dict(s_init=0.4, t_init=0.3), [(0.4, 0.3), (0.75, 0.6)]),
    "d3s-i":     (dict(s_init=0.4, t_init=0.3), [(0.4, 0.3), (0.75, 0.6)]),
    "entropy":   ({}, [(1, 0.2), (1, 0.2)]),
    "d3s-random":       (dict(s_init=0.4, t_init=0.3), [(0.4, 0.3), (0.75, 0.6)]),
    "d1s-cross-random": (dict(s_init=0.4), [(0.4, 1), (0.4, 1)]),
    "grpo-filter": ({}, [(1, 1), (1, 1)]),
    "d3s-entropy": (dict(s_init=0.4, t_init=0.3), [(0.4, 0.3), (0.75, 0.6)]),
    "d3s-random-nonzero": (dict(s_init=0.4, t_init=0.3), [(0.4, 0.3), (0.75, 0.6)]),
}


@pytest.mark.parametrize("method", d3s.METHODS)
def test_keeps_what_d3s_keeps_and_logs_the_applied_ratios(tmp_path, method):
    # 16 rollouts, 2 micro-batches; the same rewards, advantages and entropies as d3s.py gets
    knobs, ratios = APPLIED[method]
    trainer = make_trainer(tmp_path, method, per_device=8, accumulation=2, **knobs)
    batch, rewards, entropy = synthetic(16, seed=1)
    m = d3s.METHODS[method]
    random = "random" in (m["sample"], m["token"]) or m["sample"] == "random-nonzero"

    def no_entropy_pass(*args, **kwargs):  # the random control scores nothing
        raise AssertionError("an entropy pass for the random token mode")
    trainer._get_per_token_logps_and_entropies = (no_entropy_pass if m["token"] == "random" else
                                                  fake_entropy(entropy))
    metrics = trainer._metrics["train"]
    for step, (rho_s, rho_t) in enumerate(ratios):
        micro = down_sample(trainer, local_rows(batch, 0, 16), rewards, step=step, steps=2)
        # the logged ratios are the method's, and they are the ones it selected with
        assert (metrics["d3s/rho_s"][-1], metrics["d3s/rho_t"][-1]) == pytest.approx((rho_s, rho_t))
        want = expected(batch, rewards, entropy, method, rho_s, rho_t)
        if random:  # a uniform draw: D3S's counts of rollouts and tokens, valid tokens only
            got, valid = trained(micro), batch["completion_mask"].bool()
            assert len(got) == len(want) == d3s.num_keep(rho_s, 16)
            assert all(adv == batch["advantages"][r].item() for r, (adv, _) in got.items())
            assert all(valid[r, cols].all() for r, (_, cols) in got.items())
            if m["token"] == "random":  # D3S's count of tokens, not rho_t of the twin's own
                count = d3s.d3s_token_count(rewards, batch["advantages"],
                                            batch["completion_mask"].sum(dim=1), G, rho_s, rho_t)
                assert sum(len(c) for _, c in got.values()) == count
            want = got
        assert_same(trained(micro), want)
        assert len(micro) == 2
        kept_tokens = sum(len(cols) for _, cols in want.values())
        # TRL's dapo divisor
        assert [int(mb["num_items_in_batch"]) for mb in micro] == [kept_tokens] * 2
        assert metrics["d3s/kept"][-1] == len(want) and metrics["d3s/tokens"][-1] == kept_tokens
        assert metrics["d3s/rollouts"][-1] == 16 and metrics["d3s/fillers"][-1] == 0
        rows = sorted(want)
        kept_adv = torch.tensor([want[r][0] for r in rows])
        var_adv = batch["advantages"].var(unbiased=False).item()
        assert metrics["d3s/var_adv"][-1] == pytest.approx(var_adv)
        assert metrics["d3s/var_kept"][-1] == pytest.approx(kept_adv.var(unbiased=False).item())
        # train.py's entropy: over the valid tokens of the kept rollouts
        if d3s.METHODS[method]["token"] in ("adv_entropy", "entropy"):  # scored: H was computed
            valid = batch["completion_mask"][rows].bool()
            assert metrics["d3s/entropy"][-1] == pytest.approx(entropy[rows][valid].mean().item())


def test_schedule_reads_the_global_step(tmp_path):
    trainer = make_trainer(tmp_path, "d3s", per_device=8, accumulation=2)
    batch, rewards, entropy = synthetic(16, seed=4)
    trainer._get_per_token_logps_and_entropies = fake_entropy(entropy)
    for step, (rho_s, rho_t) in enumerate([(0.25, 0.2), (0.5, 0.4), (0.75, 0.6)]):
        micro = down_sample(trainer, local_rows(batch, 0, 16), rewards, step=step, steps=3)
        assert_same(trained(micro), expected(batch, rewards, entropy, "d3s", rho_s, rho_t))
    assert trainer._metrics["train"]["d3s/rho_s"] == pytest.approx([0.25, 0.5, 0.75])
    assert trainer._metrics["train"]["d3s/rho_t"] == pytest.approx([0.2, 0.4, 0.6])


def test_grpo_method_is_plain_grpo(tmp_path):
    model = tiny.build_model(tiny.build_tokenizer(), hidden_size=32, num_layers=1)
    ours = make_trainer(tmp_path / "ours", "grpo", model=copy.deepcopy(model))
    plain = make_trainer(tmp_path / "plain", plain=True, model=copy.deepcopy(model))
    # one generation batch: 2 prompts x G
    prompts = [DATASET[i] for i in range(2) for _ in range(G)]
    scored, generate = {}, ours._generate_and_score_completions
    ours._generate_and_score_completions = lambda batch: scored.setdefault("batch", generate(batch))
    # Trainer's path: _prepare_inputs, compute_loss, backward
    loss = ours.training_step(ours.model, prompts, None)
    # TRL's own loss on the same rollouts
    plain_loss = plain.compute_loss(plain.model, scored["batch"])
    plain_loss.backward()
    assert loss.item() != 0 and loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    for ours_p, plain_p in zip(ours.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(ours_p.grad, plain_p.grad, rtol=1e-5, atol=1e-7)
    assert sum(p.grad.abs().sum() for p in ours.model.parameters()) > 0


@pytest.mark.parametrize("level, loss", [("token", "grpo"), ("sequence", "gspo")])
def test_gradient_is_train_pys(tmp_path, level, loss):
    # 7 of 16 rollouts kept, in 2 micro-batches of 4 and 3; token selection on the model's entropy
    trainer = make_trainer(tmp_path, "d3s", per_device=8, accumulation=2, s_init=0.45, t_init=0.5,
                           importance_sampling_level=level)
    batch, rewards, _ = synthetic(16, seed=3)
    micro = down_sample(trainer, local_rows(batch, 0, 16), rewards)
    model = trainer.model
    model.zero_grad()
    for mb in micro:
        trainer.compute_loss(model, mb).backward()
    ours = [p.grad.clone() for p in model.parameters()]

    # train.py's loss, d3s.policy_loss, on the same kept rollouts and tokens in one batch
    kept = trained(micro)
    rows = sorted(kept)
    assert [len(mb["advantages"]) for mb in micro] == [4, 3] and len(rows) == 7
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for j, rollout in enumerate(rows):
        mask[j, kept[rollout][1]] = True
    input_ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], dim=1)
    logp, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, T)
    advantages = torch.tensor([kept[rollout][0] for rollout in rows])
    model.zero_grad()
    reference, _ = d3s.policy_loss(logp, logp.detach(), advantages, mask, int(mask.sum()),
                                   loss=loss, seq_mask=batch["completion_mask"][rows].bool())
    reference.backward()
    for got, p in zip(ours, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)
    assert sum(g.abs().sum() for g in ours) > 0


@pytest.mark.parametrize("method, with_grad, without_grad", [
    ("grpo", 16, 0),       # every rollout, in the gradient forward
    ("d1s-cross", 4, 0),   # round(0.25 * 16) kept; no token selection, so no entropy pass
    ("d3s", 4, 4),         # the same 4, plus the no-grad entropy pass over them for token selection
])
def test_dropped_rollouts_are_not_forwarded(tmp_path, method, with_grad, without_grad):
    trainer = make_trainer(tmp_path, method, per_device=16)
    rows = {True: 0, False: 0}  # rows the model scored, with and without gradient

    def count(module, args, kwargs):
        # TRL's scoring forwards; generation calls the model without fused_lm_head
        if kwargs.get("fused_lm_head"):
            rows[torch.is_grad_enabled()] += kwargs["input_ids"].size(0)
    trainer.model.register_forward_pre_hook(count, with_kwargs=True)
    trainer.train()  # one step: 4 prompts x G = 16 rollouts
    assert rows == {True: with_grad, False: without_grad}


def test_dropout_is_off_by_default(tmp_path):
    # as train.py: with dropout the first mini-batch's ratio is not 1, and one seed gives two runs
    parser = HfArgumentParser((trl_d3s.ScriptArguments, D3SConfig))
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true"]
    assert parser.parse_args_into_dataclasses(argv)[1].disable_dropout
    _, config = parser.parse_args_into_dataclasses(argv + ["--disable_dropout", "false"])
    assert not config.disable_dropout
    model = tiny.build_model(tiny.build_tokenizer(), hidden_size=32, num_layers=1)
    model.config.attention_dropout = 0.5  # Qwen2's dropout: a float on each attention module
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout acts
    trainer = make_trainer(tmp_path, model=model)
    assert trainer.model.training and model.config.attention_dropout == 0.0
    torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_two_step_run_follows_the_schedule(tmp_path):
    tokenizer = tiny.build_tokenizer()
    tiny.build_model(tokenizer, hidden_size=32, num_layers=1).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    trl_d3s.main(["--model", str(tmp_path / "model"), "--dataset", "tiny", "--output_dir",
                  str(tmp_path / "run"), "--max_steps", "2", "--per_device_train_batch_size", "16",
                  "--num_generations", "4", "--max_completion_length", "8", "--use_cpu", "true",
                  "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
                  "--logging_steps", "1", "--save_strategy", "no"])
    log = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    steps = [row for row in log if "d3s/kept" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row, rho_s, rho_t in zip(steps, (0.25, 0.75), (0.2, 0.6)):  # the first and the last step
        assert row["d3s/rho_s"] == pytest.approx(rho_s) and row["d3s/rho_t"] == pytest.approx(rho_t)
        assert row["d3s/rollouts"] == 16 and row["d3s/kept"] == d3s.num_keep(rho_s, 16)
        assert row["d3s/tokens"] == d3s.num_keep(rho_t, int(row["d3s/valid"]))
        assert "rewards/correct/mean" in row  # reward.grade, through TRL



@requires_shared
def test_vllm_gets_the_stop_tokens_through_generation_kwargs(tmp_path):
    """vLLM loads the model from its files and never sees the stop ids main sets in model.generation_config:
    with --use_vllm they reach its SamplingParams as stop_token_ids, through generation_kwargs (a base
    Qwen2.5 ends its files' turns with <|endoftext|> 151643 alone; our ChatML prompts end with <|im_end|>
    151645). Ids the command line gave win; without vLLM the config is left as it was."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen2.5")
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         eos_token_id=151643))  # the base model's generation_config
    parser = HfArgumentParser((trl_d3s.ScriptArguments, D3SConfig))
    flags = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    _, config = parser.parse_args_into_dataclasses(flags + ["--use_vllm", "true"])
    assert trl_d3s.stop_at_the_turns_end(model, tok, config) == [151643, 151645]
    assert config.generation_kwargs == {"stop_token_ids": [151643, 151645]}
    assert model.generation_config.eos_token_id == [151643, 151645]  # TRL's own generate, and its eos ids
    _, given = parser.parse_args_into_dataclasses(
        flags + ["--use_vllm", "true", "--generation_kwargs", '{"stop_token_ids": [7], "seed": 1}'])
    trl_d3s.stop_at_the_turns_end(model, tok, given)
    assert given.generation_kwargs == {"stop_token_ids": [7], "seed": 1}
    _, plain = parser.parse_args_into_dataclasses(flags)
    trl_d3s.stop_at_the_turns_end(model, tok, plain)
    assert plain.generation_kwargs is None

# -----------------------------------------------------------------------------
# two processes


def two_process_batch():
    """16 rollouts, 8 per process. Process 0's two groups are all wrong and all right (A = 0), so
    cross selection keeps only rollouts of process 1: the shares must move rows between
    processes."""
    rewards = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float)
    return synthetic(16, seed=2, rewards=rewards)


def test_two_processes_select_as_one(tmp_path):
    out = tmp_path / "two.json"
    # forked, not launched: the two processes start with TRL already imported (torchrun's fresh
    # processes spent 9 of their 10 s importing it), and find each other as torchrun's would
    context = torch.multiprocessing.start_processes(two_process_worker, (str(out), free_port()),
                                                    nprocs=2, join=False, start_method="fork")
    deadline = time.monotonic() + 300
    while not context.join(timeout=1):  # a failed process raises here, with its traceback
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two processes did not finish within 300 s")
    result = json.loads(out.read_text())

    # one process with the whole batch, and d3s.py itself
    batch, rewards, entropy = two_process_batch()
    one = make_trainer(tmp_path / "one", "d3s", per_device=8, accumulation=2, s_init=0.3,
                       t_init=0.3)
    one._get_per_token_logps_and_entropies = fake_entropy(entropy)
    alone = trained(down_sample(one, local_rows(batch, 0, 16), rewards))
    want = expected(batch, rewards, entropy, "d3s", 0.3, 0.3)
    assert_same(alone, want)
    together = {}
    for share in result["processes"]:
        for rollout, value in share["trained"].items():
            assert int(rollout) not in together
            together[int(rollout)] = value
    assert_same(together, want)

    # 5 kept, all from process 1's rows; each process trains 3 rows (one filler) in micro-batches
    # of 2 and 1
    assert len(want) == 5 and min(want) >= 8
    assert [share["sizes"] for share in result["processes"]] == [[2, 1], [2, 1]]
    assert [len(share["trained"]) for share in result["processes"]] == [3, 2]
    # and the two processes trained 2 steps together, with the schedule's counts
    steps = [row for row in result["log"] if "d3s/kept" in row]
    assert result["world"] == [2, 2]
    assert [row["d3s/kept"] for row in steps] == [d3s.num_keep(0.25, 16), d3s.num_keep(0.75, 16)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_process_worker(rank, out_path, port):
    """Process `rank` of 2, forked from the test: each hands its 8 rows of two_process_batch to
    _down_sample; then both train 2 real steps together. Process 0 writes what each process got,
    and the log."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # what torchrun would set
    AcceleratorState._reset_state(reset_partial_state=True)  # forget the parent's one-process state
    GradientState._reset_state()
    torch.set_num_threads(1)  # a forked process starts a fresh thread pool
    work = Path(out_path).parent
    trainer = make_trainer(work / "select", "d3s", per_device=4, accumulation=2, s_init=0.3,
                           t_init=0.3)
    acc = trainer.accelerator
    batch, rewards, entropy = two_process_batch()
    trainer._get_per_token_logps_and_entropies = fake_entropy(entropy)
    micro = down_sample(trainer, local_rows(batch, 8 * rank, 8 * (rank + 1)), rewards)
    mine = {"sizes": [len(mb["advantages"]) for mb in micro], "trained": trained(micro)}
    processes = gather_object([mine])
    run = make_trainer(work / "run", "d3s", per_device=4, accumulation=2, max_steps=2)
    run.train()
    if acc.is_main_process:
        world = [acc.num_processes, torch.distributed.get_world_size()]
        Path(out_path).write_text(json.dumps({"processes": processes, "log": run.state.log_history,
                                              "world": world}))


def test_the_filter_on_a_step_without_signal_trains_one_weightless_row(tmp_path):
    """grpo-filter keeps every rollout with A != 0; when every group is zero-variance there is none,
    and the port (which must hand TRL a row) passes one rollout with A = 0: its loss and gradient
    are exactly 0."""
    trainer = make_trainer(tmp_path, "grpo-filter", per_device=8, accumulation=1)
    batch, rewards, _ = synthetic(8, seed=2, rewards=torch.zeros(8))
    micro = down_sample(trainer, local_rows(batch, 0, 8), rewards)
    got = trained(micro)
    assert list(got) == [0] and got[0][0] == 0.0  # one row, advantage 0
    assert trainer._metrics["train"]["d3s/kept"][-1] == 1
    batch, rewards, _ = synthetic(8, seed=2, rewards=torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]))
    got = trained(down_sample(trainer, local_rows(batch, 0, 8), rewards))
    assert sorted(got) == [0, 1, 2, 3] and all(adv != 0 for adv, _ in got.values())
