"""train.py on the tiny world: real steps, the schedule, every method, bad input, the config block
(an inline edit counts, --help), and a step with nothing to learn. Resume and checkpoints: test_checkpoint.py."""
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from machinery import config
import d3s
from machinery import tiny
import train
from conftest import ROOT, exit_2, rows, weights
from machinery.data import load_problems
from machinery.model import grad_scaler

SMALL = dict(steps=3, prompts_per_step=4, group_size=4, eval_size=8, eval_every=2, save_every=2,
             updates_per_batch=1, lr=1e-4)  # the values these tests were written at (defaults: K = 4, lr 5e-5)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def run(tmp_path, name, model, **kw):
    cfg = train.Config(model=model, out_dir=str(tmp_path / name), **{**SMALL, **kw})
    lines = []
    history = train.train(cfg, log=lines.append)
    return history, lines, tmp_path / name


def test_steps_change_the_model_and_write_log_config_checkpoint(tmp_path, tiny_dir):
    before = weights(tiny_dir)
    history, lines, run_dir = run(tmp_path, "a", tiny_dir)
    log = rows(run_dir)
    assert [r["step"] for r in log] == [0, 1, 2]
    assert all(r["rollouts"] == 16 for r in log)
    assert [h["step"] for h in history] == [0, 2, 3]
    assert json.load(open(run_dir / "config.json"))["method"] == "d3s"
    after = weights(run_dir / "checkpoint")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "three optimizer steps should move most tensors"
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 3
    assert any(line.startswith("done: held-out accuracy") for line in lines)
    step_lines = [line for line in lines if line.startswith("step ")]  # piped output: clean lines, no bar
    assert len(step_lines) == 3 and not any("\r" in line for line in lines)


# the keep ratios each method applies, as config.json records them: (s_init, s_final, t_init, t_final)
APPLIED = {"grpo": (1.0, 1.0, 1.0, 1.0), "pods": (0.25, 0.25, 1.0, 1.0), "d1s": (0.25, 0.25, 1.0, 1.0),
           "d1s-cross": (0.25, 0.25, 1.0, 1.0), "d2s": (0.25, 0.25, 0.2, 0.2), "d3s": (0.25, 0.75, 0.2, 0.6),
           "d3s-i": (0.25, 0.75, 0.2, 0.6), "entropy": (1.0, 1.0, 0.2, 0.2),
           "d3s-random": (0.25, 0.75, 0.2, 0.6), "d1s-cross-random": (0.25, 0.25, 1.0, 1.0),
           "grpo-filter": (1.0, 1.0, 1.0, 1.0), "d3s-entropy": (0.25, 0.75, 0.2, 0.6),
           "d3s-random-nonzero": (0.25, 0.75, 0.2, 0.6)}


@pytest.mark.parametrize("loss, K", [("grpo", 1), ("gspo", 2)])
def test_every_method_keeps_what_its_schedule_says(tmp_path, tiny_dir, loss, K):
    """Every method, two steps (the schedule's two ends), on GRPO's loss at K = 1 and on GSPO's at K = 2:
    no update is non-finite; config.json records the ratios the method applies (1 where it keeps
    everything, the 80/20 baseline's 0.2, init = final without a schedule); every step applies the
    schedule's ratios and keeps exactly round(rho_s * B) rollouts (pooled), max(2, round(rho_s * G)) per
    group (intra, pods), every rollout with A != 0 (the filter) or all, and round(rho_t * valid)
    tokens or all; the random controls train D3S's count of tokens (one seed: step 0's rollouts
    are the same for every method)."""
    assert set(APPLIED) == set(d3s.METHODS)
    first = {}  # step 0's row of each method
    for method, ratios in APPLIED.items():
        _, _, run_dir = run(tmp_path, method, tiny_dir, method=method, loss=loss, updates_per_batch=K, steps=2,
                            eval_size=2, eval_every=0, save_every=0)
        saved = json.load(open(run_dir / "config.json"))
        assert tuple(saved[k] for k in ("s_init", "s_final", "t_init", "t_final")) == ratios, method
        spec = d3s.METHODS[method]
        for r in rows(run_dir):
            rho_s, rho_t = d3s.keep_ratios(r["step"], 2, "linear", *ratios)
            assert (r["rho_s"], r["rho_t"]) == pytest.approx((rho_s, rho_t)) and r["nonfinite"] == 0, method
            kept = {"none": 16, "cross": d3s.num_keep(rho_s, 16), "intra": 4 * max(2, d3s.num_keep(rho_s, 4)),
                    "pods": 4 * max(2, d3s.num_keep(rho_s, 4)),
                    "random": d3s.num_keep(rho_s, 16), "random-nonzero": d3s.num_keep(rho_s, 16),
                    "nonzero": round(16 * (1 - r["zero_var"]))}[spec["sample"]]
            assert r["kept"] == kept, (method, r["step"])
            first.setdefault(method, r)
            if r["updates"] == K and spec["token"] != "random":  # all the kept tokens were trained
                assert r["tokens"] == (r["valid"] if spec["token"] == "none" else d3s.num_keep(rho_t, r["valid"]))
        # the selection page shades tokens by their score only where the method scores them
        page = json.load(open(run_dir / "selection" / "step_000001.json"))
        assert (page["score"] is None) == (spec["token"] in ("none", "random")), method
    for twin in ("d3s-random", "d3s-random-nonzero"):
        if first[twin]["updates"] == first["d3s"]["updates"] == K:
            assert first[twin]["tokens"] == first["d3s"]["tokens"], twin


BAD = [
    (["--method", "d4s"], "--method 'd4s' is unknown"),
    (["--loss", "ppo"], "--loss 'ppo' is unknown"),
    (["--s_init", "1.5"], "--s_init must be in (0, 1], got 1.5"),
    (["--t_final", "0"], "--t_final must be in (0, 1], got 0"),
    (["--group_size", "1"], "--group_size must be at least 2"),
    (["--dataset", "nosuchset"], "unknown data set 'nosuchset'"),
    (["--model", "Qwen/Qwen2.5-0.5B", "--dataset", "tiny"], "Qwen/Qwen2.5-0.5B"),  # offline: no hub
    (["--model", "no-such-model-xyz", "--dataset", "tiny"], "no-such-model-xyz"),
    (["--dataset", "gsm8k", "--data_dir", "nowhere"], "gsm8k"),
    (["--resume", "nowhere/run"], "--resume nowhere/run: no such folder"),
    (["--gradient_checkpointing", "maybe"], "'maybe' is not a boolean"),
    (["--clip_eps_low", "1.5"], "--clip_eps_low must be in [0, 1)"),
    (["--method", "grpo", "--s_init", "0.5"], "--s_init 0.5 does not apply to --method grpo: it keeps every rollout"),
    (["--method", "entropy", "--t_init", "0.5"], "the 80/20 baseline keeps a fixed 20% of tokens"),
    (["--method", "d2s", "--t_final", "0.9"], "--t_final 0.9 does not apply to --method d2s: it has no schedule"),
    (["--eval_every", "-1"], "--eval_every must be at least 0"),
    (["--updates_per_batch", "0"], "--updates_per_batch must be at least 1"),
    (["--minibatch_size", "32", "--updates_per_batch", "4"],
     "--updates_per_batch 4 does not apply with --minibatch_size 32"),
    (["--minibatch_size", "-1"], "--minibatch_size must be at least 0"),
    (["--divisor", "mean"], "--divisor must be one of kept, valid, seq, got 'mean'"),
    (["--steps"], "expected one argument"),
    (["--top_p", "0.9"], "unrecognized arguments: --top_p 0.9"),
    (["--out_dir", "/proc/no-such/run"], "cannot make the run folder /proc/no-such/run"),
    (["--lora_rank", "-1"], "--lora_rank must be at least 0 (0: every weight trains), got -1"),
    (["--dtype", "float8"], "--dtype must be auto, float32, bfloat16 or float16, got 'float8'"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_dir, capsys, argv, message):
    assert message in exit_2(["--model", tiny_dir, "--out_dir", str(tmp_path / "bad")] + argv, capsys)
    assert not (tmp_path / "bad").exists()  # refused before any work


def test_eval_and_save_every_0_mean_only_at_the_end_and_curves_are_drawn(tmp_path, tiny_dir):
    history, _, run_dir = run(tmp_path, "zero", tiny_dir, steps=2, eval_every=0, save_every=0)
    assert [h["step"] for h in history] == [0, 2]
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 2
    png = run_dir / "curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the page of what the step before the last evaluation kept (plots.py)
    assert (run_dir / "selection.html").is_file() and (run_dir / "selection" / "step_000001.json").is_file()


# ----------------------------------------------------------------------------- the config block


def resolved(*argv):
    """The config of `python train.py ARGV`."""
    return config.resolve(*config.parse_args(train.Config, list(argv)))


def test_each_method_and_loss_takes_its_papers_divisor_unless_given():
    assert {m: resolved("--method", m).divisor for m in d3s.METHODS} == {
        m: "valid" if m == "entropy" else "kept" for m in d3s.METHODS}  # 80/20's; else [ours]
    assert resolved("--loss", "gspo").divisor == "seq"  # GSPO's paper
    assert resolved("--method", "grpo", "--loss", "gspo").divisor == "seq"  # method grpo: not loss
    assert resolved("--method", "entropy", "--loss", "gspo").divisor == "seq"  # the loss wins
    assert resolved("--method", "entropy", "--divisor", "kept").divisor == "kept"  # given: it holds
    assert resolved("--divisor", "valid").out_dir == os.path.join("out", "d3s-tiny-divisor=valid")
    assert resolved("--method", "entropy").out_dir == os.path.join("out", "entropy-tiny")
    # the keys of one line: a world, tiny/real, the loss, then method_NAME, then the first value
    knob = config.pick(default=0, grpo=1, gspo=2, method_grpo=3, method_d1s_cross=4)
    assert config.picked(knob, None, "gspo", "grpo") == 2  # the loss's gspo, never method grpo's
    assert config.picked(knob, "tiny", "grpo", "d1s-cross") == 1  # the loss wins
    by_method = config.pick(default=0, tiny_weak=5, method_grpo=3, method_d1s_cross=4)
    runs = [(None, "grpo"), (None, "d1s-cross"), ("tiny", "d3s"), ("tiny-weak", "grpo")]
    assert [config.picked(by_method, w, "gspo", m) for w, m in runs] == [3, 4, 0, 5]


def test_minibatch_size_sets_the_updates_and_k_is_recorded_as_0():
    cfg = resolved("--minibatch_size", "32")
    assert (cfg.minibatch_size, cfg.updates_per_batch) == (32, 0)
    assert config.resolve(cfg) == cfg  # resolved again (a resume's saved config): the same
    assert resolved("--minibatch_size", "32", "--updates_per_batch", "0").updates_per_batch == 0
    assert cfg.out_dir == os.path.join("out", "d3s-tiny-minibatch_size=32")
    assert resolved().updates_per_batch == 4 and resolved().minibatch_size == 0  # fixed K: default


def halfway(step, total_steps, schedule, s_init, s_final, t_init, t_final):
    """A schedule a learner might add: linear, but it stops halfway to the final ratios."""
    p = min(step / max(total_steps - 1, 1), 0.5)
    return (1 - p) * s_init + p * s_final, (1 - p) * t_init + p * t_final


def test_the_first_lines_describe_any_schedule_by_the_ratios_it_applies(monkeypatch):
    from machinery.run import first_lines

    def lines(*argv):
        return "\n".join(first_lines(resolved(*argv), "tiny", "cpu", None, 10, 2))
    assert ("+ grpo loss, divisor kept | keep rho_s 0.25->0.75, rho_t 0.2->0.6\n" in lines()
            and "| K 4 updates per step, adamw" in lines())
    assert "keep rho_s 1, rho_t 1 (fixed)" in lines("--method", "grpo")
    assert "keep rho_s 0.25, rho_t 0.2 (fixed)" in lines("--method", "d2s")
    assert "divisor valid | keep rho_s 1, rho_t 0.2 (fixed)" in lines("--method", "entropy")
    assert "keep rho_s 0.25, rho_t 1 (fixed)" in lines("--method", "d1s-cross-random")
    assert "gspo loss, divisor seq | keep rho_s 0.25->0.75" in lines("--loss", "gspo")
    assert "| M 32 rollouts per update, adamw" in lines("--minibatch_size", "32")
    monkeypatch.setattr(d3s, "SCHEDULES", d3s.SCHEDULES + ("halfway",))
    real = d3s.keep_ratios
    monkeypatch.setattr(d3s, "keep_ratios",
                        lambda *a: halfway(*a) if a[2] == "halfway" else real(*a))
    monkeypatch.setitem(d3s.METHODS, "d3s", dict(d3s.METHODS["d3s"], schedule="halfway"))
    # not "(constant)", not s_final: the ratios the schedule applies at the first and last step
    assert "halfway schedule) + grpo loss, divisor kept | keep rho_s 0.25->0.5, rho_t 0.2->0.4" in \
        lines("--steps", "5")
    assert "keep rho_s 0.25, rho_t 0.2 (fixed)" in lines("--steps", "1")  # one step: p = 0


def real_model_folder(path):
    """A real model for the config's purposes: not a tiny world, a tiny random Qwen2 with a tokenizer."""
    tok = tiny.build_tokenizer()
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_an_inline_edit_of_the_config_block_is_the_run(tmp_path, tiny_dir, capsys, monkeypatch):
    """A learner edits a value in train.py's config block, as nanoGPT's readers do: the tiny world's
    max_new_tokens and a real model's learning rate. Both runs record the edited value."""
    source = (ROOT / "train.py").read_text()
    assert source.count("max_new_tokens: int = pick(tiny=32,") == 1 and source.count(" real=1e-6,") == 1
    edited = source.replace("max_new_tokens: int = pick(tiny=32,", "max_new_tokens: int = pick(tiny=40,")
    edited = edited.replace(" real=1e-6,", " real=3e-6,")
    (tmp_path / "train.py").write_text(edited)
    spec = importlib.util.spec_from_file_location("edited_train", tmp_path / "train.py")
    mine = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "edited_train", mine)  # --help reads the config block's source
    spec.loader.exec_module(mine)
    small = ["--steps", "1", "--prompts_per_step", "1", "--group_size", "2", "--eval_size", "1", "--eval_every", "0"]
    config.main(mine.Config, mine.train, ["--model", tiny_dir, "--out_dir", str(tmp_path / "tiny")] + small)
    first = capsys.readouterr().out.splitlines()[:4]  # the run's first lines show the edited value
    assert any("max_new_tokens 40" in line and "lr 5e-05" in line for line in first), first
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in (("1+2", "3"), ("2+2", "4"))))
    config.main(mine.Config, mine.train, ["--model", real_model_folder(tmp_path / "real"), "--dataset", str(jsonl),
                                          "--max_new_tokens", "4", "--out_dir", str(tmp_path / "real-run")] + small)
    first = capsys.readouterr().out.splitlines()[:4]
    assert any("lr 3e-06" in line for line in first), first
    ran = {name: json.load(open(tmp_path / name / "config.json")) for name in ("tiny", "real-run")}
    assert (ran["tiny"]["max_new_tokens"], ran["tiny"]["lr"]) == (40, 5e-5)
    assert (ran["real-run"]["lr"], ran["real-run"]["micro_batch_size"]) == (3e-6, 16)
    for name in ("tiny", "real-run"):  # both paths draw their pictures: the curves and what the step kept
        assert (tmp_path / name / "curves.png").is_file() and (tmp_path / name / "selection.html").is_file()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        config.parse_args(mine.Config, ["--help"])
    assert "(tiny 40, tiny_long 64, real 512)" in " ".join(capsys.readouterr().out.split())


def test_help_shows_every_knob_its_values_and_its_comment(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_args(train.Config, ["--help"])
    assert e.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    comments = config.knob_comments(train.Config)
    for f in dataclasses.fields(train.Config):
        assert f"--{f.name}" in text and "".join(comments[f.name].split()) in text, f.name  # every knob has one
        for value in f.metadata.get("pick", {"": f.default}).values():
            assert "".join(repr(value).split()) in text, f.name
    assert "(tiny5e-05,real1e-06,lora_tiny0.0005,lora_real1e-05)" in text and "(grpo0.2,gspo0.0003)" in text
    assert "(default'kept',method_entropy'valid',gspo'seq')" in text  # --divisor's three
    # a comment that goes on below its knob's line is all of its help
    assert "entropy|thecontrolsd3s-entropy|d3s-random|d3s-random-nonzero|d1s-cross-random(default'd3s')" in text
    for knob, words in [("eval_every", "0: only those"), ("save_every", "0: only those"),
                        ("wandb", "pip install wandb"), ("clip_eps_low", "(gspo: GSPO's own)"),
                        ("max_new_tokens", "cut-off rollouts: docs/grading.md")]:
        assert "".join(words.split()) in "".join(comments[knob].split()), knob


def test_each_knob_takes_its_value_for_the_run():
    real = config.resolve(train.Config(model="Qwen2.5-0.5B"), given={"model"})
    picks = {f.name: f.metadata["pick"] for f in dataclasses.fields(train.Config) if "pick" in f.metadata}
    assert {k: getattr(real, k) for k in picks if "real" in picks[k]} == {k: v["real"] for k, v in picks.items()
                                                                          if "real" in v}
    assert (real.dataset, real.lr, real.max_new_tokens) == ("gsm8k", 1e-6, 512)
    assert real.out_dir == os.path.join("out", "d3s-Qwen2.5-0.5B")
    # a knob set to the tiny world's value is still the user's: the command line says which were set
    cfg, given = config.parse_args(train.Config, ["--model", "Qwen2.5-0.5B", "--lr", "5e-5", "--steps", "100"])
    mine = config.resolve(cfg, given)
    assert (mine.lr, mine.steps, mine.prompts_per_step) == (5e-5, 100, 32)
    tiny_run = config.resolve(train.Config())
    assert (tiny_run.lr, tiny_run.dataset, tiny_run.max_new_tokens, tiny_run.updates_per_batch) == (5e-5, "tiny", 32, 4)
    long_run = config.resolve(train.Config(model="tiny-long"))
    assert (long_run.dataset, long_run.max_new_tokens, long_run.lr) == ("tiny-long", 64, 5e-5)
    gspo = config.resolve(train.Config(loss="gspo"))
    assert (gspo.clip_eps_low, gspo.clip_eps_high) == (3e-4, 4e-4)
    assert config.resolve(train.Config(loss="gspo", clip_eps_low=0.1)).clip_eps_low == 0.1
    assert config.resolve(config.resolve(train.Config(model="Qwen2.5-0.5B"))) == real  # resolving twice: the same


def test_wandb_logs_the_step_fields_or_says_how_to_get_it(tmp_path, tiny_dir, capsys, monkeypatch):
    """--wandb PROJECT: with wandb installed, an offline W&B run gets every log.jsonl field; without it,
    a one-line error that says what to install (it is not a required dependency)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        err = exit_2(["--model", tiny_dir, "--out_dir", str(tmp_path / "w"), "--wandb", "nanod3s"], capsys)
        assert "--wandb needs the wandb package: pip install wandb" in err
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    _, _, run_dir = run(tmp_path, "w", tiny_dir, steps=2, eval_every=0, save_every=0, wandb="nanod3s")
    records = next(tmp_path.rglob("*.wandb")).read_bytes()  # an offline run's history, protobuf with plain keys
    for key in list(rows(run_dir)[-1]) + ["accuracy"]:
        assert f'"{key}"'.encode() in records or key.encode() in records, key


# ----------------------------------------------------------------------------- a step with nothing to learn


def test_a_run_where_every_reward_is_0_changes_nothing(tmp_path, tiny_dir):
    """--max_new_tokens 2: every rollout is cut off without an answer, so every reward and advantage is 0
    and (beta = 0) every step skips its update: no forward, no backward, no optimizer step."""
    _, lines, run_dir = run(tmp_path, "zero", tiny_dir, max_new_tokens=2, steps=3, updates_per_batch=2,
                            eval_every=0, save_every=0)
    log = rows(run_dir)
    got = [(r["reward"], r["updates"], r["no_signal"], r["t_fb"], r["tokens"]) for r in log]
    assert got == [(0.0, 0, True, 0.0, 0)] * 3
    assert all("upd skipped: no signal" in line for line in lines if line.startswith("step "))
    assert "3 of 3 steps had nothing to learn" in lines[-1]
    before, after = weights(tiny_dir), weights(run_dir / "checkpoint")
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit
    state = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["optimizer"]["state"]
    assert state == {}  # AdamW never stepped: no moments, no step count


def test_backward_skips_a_minibatch_without_signal_unless_there_is_a_kl_term(tiny_dir):
    """The mini-batch rule: kept tokens whose advantages are all 0 give exactly zero gradient with
    beta = 0, so backward takes no step (as for a mini-batch with no kept token); with beta > 0 the KL
    to a reference that differs from the policy has a gradient, and the mini-batch is trained."""
    from machinery.data import format_prompt
    from machinery.model import load_model
    from rollout import generate_groups
    model, tok = load_model(tiny_dir, device="cpu", dtype="float32")
    kept = generate_groups(model, tok, [format_prompt(tok, "1+2+3+4")], 4, 8, seed=0, record_entropy=True)
    adv, mask = torch.zeros(4), kept.completion_mask
    rows, cfg, nothing = torch.arange(4), config.resolve(train.Config(model="tiny", beta=0.1)), contextlib.nullcontext

    def parts(token_mask, beta):  # as train.py cuts them: a row whose terms are all 0 is not forwarded
        return train.micro_batches(kept, rows, 2, train.d3s.needed_columns(token_mask, adv, beta))
    assert parts(mask, 0.0) == [] and parts(torch.zeros_like(mask), 0.1) == [] and len(parts(mask, 0.1)) == 2
    assert train.backward(model, kept, rows, parts(mask, 0.0), adv, mask, None,
                          config.resolve(train.Config(model="tiny")), nothing) is None
    assert train.backward(model, kept, rows, parts(torch.zeros_like(mask), 0.1), adv, torch.zeros_like(mask),
                          None, cfg, nothing, model) is None
    ref = type(model)(model.config)
    ref.load_state_dict({k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()})
    stats = train.backward(model, kept, rows, parts(mask, 0.1), adv, mask, None, cfg, nothing,
                           ref.requires_grad_(False))
    assert stats is not None and stats["kl"] > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.fixture
def one_step_of_signal(tmp_path, tiny_dir):
    """A .jsonl of tiny questions where only the prompts of step 0 can be answered (the others' reference
    is "x", which no completion matches): steps 1 and 2 have every reward 0, step 0 has a signal."""
    rows_, path = tiny.problems("train")[:12], tmp_path / "one.jsonl"

    def write(answer):
        path.write_text("".join(json.dumps({"question": r["prompt"], "answer": answer(r)}) + "\n" for r in rows_))
    # train.py trains on the file minus the rows data.py holds out (1 question in 10, by a hash of its text
    # alone, so the answers written below do not move it): step 0's prompts come from that split
    write(lambda r: r["answer"])
    first = {r["prompt"] for r in train.batch_at(load_problems(str(path), "train"), 0, 4, 0)}
    write(lambda r: r["answer"] if r["prompt"] in first else "x")
    return dict(dataset=str(path), steps=3, updates_per_batch=2, eval_every=0, save_every=0)


def test_one_step_of_signal_among_skipped_ones(tmp_path, tiny_dir, one_step_of_signal):
    kw = one_step_of_signal
    run(tmp_path, "three", tiny_dir, **kw)
    run(tmp_path, "one", tiny_dir, **{**kw, "steps": 1})  # only step 0: the code path without any skipped step
    three, one = rows(tmp_path / "three"), rows(tmp_path / "one")
    assert three[0]["var_adv"] > 0 and three[0]["updates"] == 2 and [r["updates"] for r in three[1:]] == [0, 0]
    for key in ("reward", "kept", "tokens", "losses", "grad_norm", "t_fb"):
        if key != "t_fb":
            assert three[0][key] == one[0][key], key
    a, b = weights(tmp_path / "three" / "checkpoint"), weights(tmp_path / "one" / "checkpoint")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the skipped steps moved nothing
    # stopped after the skipped step 1 and resumed: the same rows and weights as straight through

    def stop_after_step_1(line):  # a real Ctrl-C: the run stops at the step's end
        if line.startswith("step    1 "):
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train.train(train.Config(model=tiny_dir, out_dir=str(tmp_path / "cut"), **{**SMALL, **kw}),
                    log=stop_after_step_1)
    train.train(train.Config(resume=str(tmp_path / "cut")), log=lambda *a: None)
    cut = rows(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2] and [r["losses"] for r in cut] == [r["losses"] for r in three]
    c = weights(tmp_path / "cut" / "checkpoint")
    assert all(torch.equal(a[k], c[k]) for k in a)
    # with a KL term the same steps are not skipped, and the weights move (the policy is no longer the reference)
    run(tmp_path, "kl3", tiny_dir, **{**kw, "beta": 0.1})
    run(tmp_path, "kl1", tiny_dir, **{**kw, "beta": 0.1, "steps": 1})
    assert [r["updates"] for r in rows(tmp_path / "kl3")] == [2, 2, 2]
    a, b = weights(tmp_path / "kl3" / "checkpoint"), weights(tmp_path / "kl1" / "checkpoint")
    assert any(not torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- a second run, a checkpoint's world


def test_a_second_run_never_destroys_the_first_and_a_checkpoint_keeps_its_world(tmp_path, tiny_dir, capsys,
                                                                                  monkeypatch):
    """`python train.py` then `python train.py --seed 1`: two folders, both intact. The first command again
    refuses its folder (one line naming --resume and --overwrite) and leaves it as it was; --overwrite true
    replaces it. The first run's checkpoint, passed as --model, continues in the tiny world with its values."""
    monkeypatch.chdir(tmp_path)  # the default run folders are under out/
    small = ["--model", tiny_dir, "--steps", "1", "--prompts_per_step", "2", "--group_size", "2", "--eval_size", "2"]
    config.main(train.Config, train.train, small)
    config.main(train.Config, train.train, small + ["--seed", "1"])
    first = tmp_path / "out" / "d3s-tiny-steps=1-prompts_per_step=2-group_size=2-eval_size=2"
    second = tmp_path / "out" / "d3s-tiny-steps=1-prompts_per_step=2-group_size=2-eval_size=2-seed=1"
    assert [json.load(open(d / "config.json"))["seed"] for d in (first, second)] == [0, 1]
    saved = (first / "checkpoint" / "model.safetensors").read_bytes()
    err = exit_2(small, capsys)
    assert "holds another run" in err and f"--resume {os.path.join('out', first.name)}" in err
    assert "--overwrite true" in err and (first / "checkpoint" / "model.safetensors").read_bytes() == saved
    config.main(train.Config, train.train, small + ["--overwrite", "true", "--max_new_tokens", "8"])  # another name
    config.main(train.Config, train.train, small + ["--overwrite", "true"])
    assert len(rows(first)) == 1 and (second / "checkpoint" / "trainer.pt").is_file()
    # the checkpoint knows its world: the tiny values, the tiny data set, and the run says so
    ckpt = str(first / "checkpoint")
    assert tiny.world_of(ckpt) == "tiny"
    picked = config.resolve(train.Config(model=ckpt), given={"model"})
    assert (picked.lr, picked.dataset, picked.max_new_tokens, picked.micro_batch_size) == (5e-5, "tiny", 32, 128)
    _, lines, _ = run(tmp_path, "from-checkpoint", ckpt, steps=1, prompts_per_step=2, group_size=2, eval_size=2)
    assert "the tiny world's values" in lines[0]


# ----------------------------------------------------------------------------- the exact corners


def dropout_model(path, tiny_dir):
    """The tiny world's model with attention dropout 0.1 in its config."""
    model, tok = train.load_model(tiny_dir, device="cpu", dtype="float32")
    model.config.attention_dropout = 0.1
    model.save_pretrained(path)
    tok.save_pretrained(path)
    shutil.copy(os.path.join(tiny_dir, "tiny.json"), path)  # still the tiny world
    return str(path)


def test_dropout_is_off_so_one_seed_gives_one_run(tmp_path, tiny_dir):
    """A model whose config has dropout: two runs with one seed are the same run, and the first mini-batch's
    ratio is exactly 1 (with dropout on, two forwards of the same weights differ)."""
    model = dropout_model(tmp_path / "dropout", tiny_dir)
    kw = dict(steps=2, updates_per_batch=2, eval_every=0)
    runs = [run(tmp_path, name, model, **kw)[2] for name in ("a", "b")]
    a, b = rows(runs[0]), rows(runs[1])
    assert a == [dict(r, t_gen=x["t_gen"], t_upd=x["t_upd"], t_fb=x["t_fb"]) for r, x in zip(b, a)]
    assert all(r["ratio_first"] == [1.0, 1.0] and r["clip_first"] == 0.0 for r in a if not r["no_signal"])
    wa, wb = weights(runs[0] / "checkpoint"), weights(runs[1] / "checkpoint")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.load(open(runs[0] / "checkpoint" / "config.json"))["attention_dropout"] == 0.0  # as trained


def test_a_zero_or_nonfinite_gradient_takes_no_step_and_counts_as_none(tiny_dir, capsys):
    """After a real step AdamW's moments are nonzero, so a step on an exactly-zero gradient (every token
    with a gradient clipped) would still move the weights: it is not taken, and not counted."""
    model, _ = train.load_model(tiny_dir, device="cpu", dtype="float32")
    cfg = config.resolve(train.Config(model="tiny"))
    optimizer = train.make_optimizer(model, cfg)
    scaler = grad_scaler(optimizer, "cpu", cfg.dtype)  # off: --dtype auto on a CPU
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    assert train.optimizer_step(model, optimizer, 1.0, 0.5, scaler)["applied"]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    out = train.optimizer_step(model, optimizer, 1.0, 0.0, scaler)
    assert (out["applied"], out["zero_grad"], out["grad_norm"]) == (False, 1, 0.0)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    params[0].grad = torch.full_like(params[0], math.nan)
    capsys.readouterr()
    out = train.optimizer_step(model, optimizer, 1.0, 0.3, scaler)
    assert (out["applied"], out["nonfinite"], out["scaler_skip"]) == (False, 1, 0)  # no scaler: a real problem
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    # each such update says so as it happens, not only in the step line's count
    assert capsys.readouterr().out.startswith("warning: a non-finite loss (0.3) or gradient")
    # the log counts only the applied update's tokens; the skipped step's gradient norm is a gap, not 0
    from machinery.logs import step_record
    from rollout import Rollouts
    mask = torch.ones(2, 3, dtype=torch.bool)
    ro = Rollouts(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 3,
                  dtype=torch.long), mask, torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long),
                  ["", ""], torch.zeros(2, 3))
    stats = dict(loss=0.1, clipped=0, signal=4, clip_frac=0.0, ratio_mean=1.0, kl=0.0, ratio_min=1.0, ratio_max=1.0,
                 fwd_bwd_tokens=7, fwd_bwd_positions=8, nograd_tokens=0, head_rows=4)
    updates = [{**stats, "tokens": 4, "on_policy": True, "grad_norm": 2.0, "applied": True, "nonfinite": 0,
                "zero_grad": 0, "scaler_skip": 0},
               {**stats, "tokens": 2, "on_policy": False, "grad_norm": 0.0, "applied": False, "nonfinite": 0,
                "zero_grad": 1, "scaler_skip": 0},
               {**stats, "tokens": 3, "on_policy": False, "grad_norm": math.inf, "applied": False, "nonfinite": 1,
                "zero_grad": 0, "scaler_skip": 0}]
    args = (0, 2, ro, torch.tensor([1.0, 0.0]), torch.tensor([0.7, -0.7]), ro, torch.tensor([0.7, -0.7]),
            {"no_answer": 0, "hedge": 0})
    row = step_record(*args, updates)
    assert row["pad_share"] is None  # a Rollouts that does not say what it decoded
    ro.decoded = 10  # 2 rows x 5 decode steps, 6 of them real: 4 after their row had stopped
    assert step_record(*args, updates)["pad_share"] == 0.4
    ro.decoded = 0
    assert (row["updates"], row["tokens"], row["zero_grad"], row["nonfinite"], row["grad_norm"]) == (1, 4, 1, 1, 1.0)
    assert row["fwd_bwd_tokens"] == 21  # the compute of all three: forwarded, applied or not
    assert (row["head_rows"], row["nograd_tokens"], row["upd_pad_share"]) == (12, 0, pytest.approx(1 - 21 / 24))
    forward = {"nograd_tokens": 9, "nograd_positions": 12, "head_rows": 5}  # step 7's no-grad pass
    assert (lambda r: (r["nograd_tokens"], r["head_rows"], r["upd_pad_share"]))(
        step_record(*args, updates, forward)) == (9, 17, pytest.approx(1 - 30 / 36))
    from machinery.logs import step_line
    line = step_line(dict(row, t_gen=0, t_upd=0, kept=4), 4)  # 4 mini-batches: one had nothing to learn
    assert "updates 1/4 (1 no signal, 1 zero grad, 1 non-finite)" in line
    assert " | tokens 4/6 | fwd+bwd 21 no-grad 0 | " in line  # trained / kept completion tokens; compute
    skipped = step_record(*args, [])
    assert skipped["grad_norm"] is None and skipped["no_signal"] and skipped["ratio_first"] is None


def cpu_bf16(device, dtype):
    """What --dtype auto does on a bf16 GPU, on the CPU: forward passes under bf16 autocast."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("loss, dtype, generation", [("grpo", "auto", "loop"), ("gspo", "auto", "hf"),
                                                      ("grpo", "bfloat16", "loop")])
def test_the_gpu_paths_run_on_the_cpu_and_the_first_ratio_is_exactly_1(tmp_path, tiny_dir, monkeypatch, loss, dtype,
                                                                       generation):
    """bf16 autocast (what a GPU runs), bf16 weights and either engine, on the CPU: a run's first mini-batch
    has ratio exactly 1 and nothing clipped, also under GSPO's 3e-4 clip, though under bf16 a forward's
    numbers change with the batch's shape; every update is finite."""
    if dtype == "auto":
        monkeypatch.setattr(train, "autocast", cpu_bf16)
    _, lines, run_dir = run(tmp_path, "gpu", tiny_dir, steps=2, updates_per_batch=2, loss=loss, dtype=dtype,
                            generation=generation, eval_every=0, lr=5e-5)
    log = rows(run_dir)
    trained = [r for r in log if not r["no_signal"]]
    assert trained and all(r["ratio_first"] == [1.0, 1.0] and r["clip_first"] == 0.0 for r in trained), trained
    assert all(r["nonfinite"] == 0 and math.isfinite(r["loss"]) for r in log)
    assert all(0 <= r["pad_share"] < 1 for r in log)  # the longest row's tax, logged each step


def test_nan_logits_stop_the_run_naming_the_step(tmp_path, tiny_dir, capsys):
    """A model whose logits are NaN: one line, exit 1, naming the step, instead of training on made-up tokens."""
    model, tok = train.load_model(tiny_dir, device="cpu", dtype="float32")
    with torch.no_grad():
        model.model.norm.weight.fill_(math.nan)
    model.save_pretrained(tmp_path / "nan")
    tok.save_pretrained(tmp_path / "nan")
    shutil.copy(os.path.join(tiny_dir, "tiny.json"), tmp_path / "nan")  # still the tiny world
    with pytest.raises(SystemExit) as e:
        config.main(train.Config, train.train, ["--model", str(tmp_path / "nan"), "--out_dir", str(tmp_path / "run"),
                                                "--steps", "2", "--prompts_per_step", "2", "--group_size", "2",
                                                "--eval_size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith("error: step 0: the model produced NaN or inf logits") and "--lr" in err[0]
    assert not (tmp_path / "run" / "log.jsonl").exists()  # no step was logged, no checkpoint saved


def test_the_steps_clip_share_is_counted_over_all_its_updates(tmp_path, tiny_dir, monkeypatch):
    """A step's clip_frac is its clipped tokens over its kept tokens with a gradient (A != 0), summed over
    all its updates (README, docs/algorithm.md): not each update's share weighted by its kept tokens."""
    real, seen = train.backward, []

    def recorded(*a, **k):
        u = real(*a, **k)
        if u is not None:
            seen.append(u)
        return u
    monkeypatch.setattr(train, "backward", recorded)
    _, _, run_dir = run(tmp_path, "clip", tiny_dir, method="grpo", updates_per_batch=4, lr=2e-4, steps=2,
                        eval_size=2, eval_every=0, save_every=0)
    log = rows(run_dir)
    for r in log:
        mine = seen[:len(r["losses"])]
        del seen[:len(r["losses"])]
        assert r["clip_frac"] == pytest.approx(sum(u["clipped"] for u in mine) / max(sum(u["signal"] for u in mine), 1))
    assert any(r["clip_frac"] > 0 for r in log)  # the clip acted, so the two definitions can differ
    # by hand: 1 of 10 clipped in an update of 100 kept tokens, 3 of 10 in one of 10 kept tokens: 4 / 20
    from machinery.logs import step_record
    from rollout import Rollouts
    mask = torch.ones(2, 3, dtype=torch.bool)
    ro = Rollouts(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 3,
                  dtype=torch.long), mask, torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long),
                  ["", ""], torch.zeros(2, 3))
    base = dict(loss=0.1, ratio_mean=1.0, kl=0.0, ratio_min=0.5, ratio_max=1.5, on_policy=False, grad_norm=1.0,
                applied=True, nonfinite=0, zero_grad=0, fwd_bwd_tokens=0, fwd_bwd_positions=0,
                nograd_tokens=0, head_rows=0, scaler_skip=0)
    updates = [dict(base, tokens=100, clipped=1, signal=10, clip_frac=0.1),
               dict(base, tokens=10, clipped=3, signal=10, clip_frac=0.3)]
    row = step_record(0, 2, ro, torch.tensor([1.0, 0.0]), torch.tensor([0.7, -0.7]), ro, torch.tensor([0.7, -0.7]),
                      {"no_answer": 0, "hedge": 0}, updates)
    assert row["clip_frac"] == 0.2  # a weighted mean of the shares would give (0.1 * 100 + 0.3 * 10) / 110


# ----------------------------------------------------------------------------- LoRA


def test_lora_takes_its_own_lr_unless_given():
    """--lora_rank > 0 reads the lr line's lora_ values first: about 10x full fine-tuning's."""
    assert resolved("--lora_rank", "8").lr == 5e-4 and resolved().lr == 5e-5
    real = resolved("--model", "Qwen2.5-0.5B", "--lora_rank", "16")
    assert real.lr == 1e-5 and real.out_dir == os.path.join("out", "d3s-Qwen2.5-0.5B-lora_rank=16")
    assert resolved("--lora_rank", "8", "--lr", "1e-4").lr == 1e-4  # given: it holds
    knob = config.pick(default=0, tiny=1, real=2, lora_tiny=3, lora_real=4, tiny_long=5)
    runs = [("tiny-long", False), ("tiny-long", True), ("tiny", True), (None, True), (None, False)]
    assert [config.picked(knob, w, "grpo", "d3s", lora) for w, lora in runs] == [5, 3, 3, 4, 2]


def lora_run(tmp_path, name, model, **kw):
    """A tiny LoRA run of SMALL's size at LoRA's own lr (the pick), K = 2."""
    cfg = train.Config(model=model, out_dir=str(tmp_path / name), **{
        **{k: v for k, v in SMALL.items() if k != "lr"}, "updates_per_batch": 2, "eval_size": 8,
        "lora_rank": 4, **kw})
    lines = []
    history = train.train(cfg, log=lines.append)
    return history, lines, tmp_path / name


def test_a_tiny_lora_run_trains_its_adapters_and_its_checkpoint_loads_everywhere(tmp_path, tiny_dir, capsys):
    """--lora_rank 4 offline on the tiny world: only the adapters train, at LoRA's lr; RUN/checkpoint holds them
    (no copy of the base, which is left as it was) and names its base; eval.py --model RUN/checkpoint gives the
    run's held-out accuracy; --model RUN/checkpoint starts a new run from that policy."""
    from safetensors.torch import load_file
    import eval as eval_py
    base_file = os.path.join(tiny_dir, "model.safetensors")
    base_bytes = open(base_file, "rb").read()
    history, lines, run_dir = lora_run(tmp_path, "lora", tiny_dir)
    ckpt = run_dir / "checkpoint"
    assert sorted(os.listdir(ckpt)) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                        "tiny.json", "tokenizer.json", "tokenizer_config.json", "trainer.pt"]
    saved = json.load(open(ckpt / "adapter_config.json"))
    assert (saved["base_model_name_or_path"], saved["r"]) == (os.path.abspath(tiny_dir), 4)
    adapters = load_file(ckpt / "adapter_model.safetensors")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert all(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)  # B moved from its 0
    state = torch.load(ckpt / "trainer.pt", weights_only=False)["optimizer"]
    assert len(state["state"]) == len(adapters) == len(state["param_groups"][0]["params"])  # AdamW: adapters only
    assert open(base_file, "rb").read() == base_bytes
    ran = json.load(open(run_dir / "config.json"))
    assert (ran["lora_rank"], ran["lr"]) == (4, 5e-4)
    log = rows(run_dir)
    assert any(not r["no_signal"] for r in log)
    assert all(r["ratio_first"] == [1.0, 1.0] for r in log if not r["no_signal"])
    assert all(r["nonfinite"] == 0 and r["scaler_skips"] == 0 for r in log)
    # eval.py on the checkpoint: the run's last held-out accuracy, bit for bit on a CPU
    capsys.readouterr()
    assert eval_py.main(["--model", str(ckpt), "--benchmarks", "tiny", "--limit", "8", "--device", "cpu",
                         "--max_new_tokens", "32", "--out", str(tmp_path / "e.jsonl")]) == 0
    assert json.load(open(tmp_path / "e.json"))["results"]["tiny"]["accuracy"] == history[-1]["accuracy"]
    # a new run from the trained policy: its adapters kept, frozen, fresh ones on top, on the same base
    _, lines, again = lora_run(tmp_path, "again", str(ckpt), lora_rank=2, steps=1)
    assert "the tiny world's values" in lines[0]
    assert json.load(open(again / "checkpoint" / "adapter_config.json"))["base_model_name_or_path"] == \
        os.path.abspath(tiny_dir)
    loaded, _ = train.load_model(str(again / "checkpoint"), device="cpu")
    assert (loaded.peft_config["default"].r, loaded.peft_config["frozen1"].r) == (2, 4)


def test_the_kl_reference_under_lora_is_the_base_with_no_second_copy(tiny_dir):
    """beta > 0 with LoRA: the reference is the policy itself with its adapters off, so backward gives the
    loss, KL and gradient it gives with a separate frozen copy of the base."""
    from machinery.data import format_prompt
    from machinery.model import reference_model, with_lora
    cfg = config.resolve(train.Config(model=tiny_dir, beta=0.1, lora_rank=4))
    policy, tok = train.load_model(tiny_dir, device="cpu")
    policy = with_lora(policy, 4, tiny_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as if trained: B away from 0
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    assert reference_model(policy, cfg, "cpu") is policy
    assert reference_model(policy, dataclasses.replace(cfg, beta=0.0), "cpu") is None
    kept = train.generate_groups(policy, tok, [format_prompt(tok, "1+2+3+4")], 4, 8, seed=0)
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.5]), kept.completion_mask
    base = train.load_model(tiny_dir, device="cpu")[0].eval().requires_grad_(False)
    got = []
    for ref in (policy, base):
        parts = train.micro_batches(kept, torch.arange(4), 2)
        stats = train.backward(policy, kept, torch.arange(4), parts, adv, mask, None, cfg,
                               contextlib.nullcontext, ref)
        got.append((stats, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
        policy.zero_grad(set_to_none=True)
    (mine, grads), (theirs, want) = got
    assert mine["kl"] > 0 and mine == theirs
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in grads)


def test_without_peft_lora_is_one_line_and_exit_2(tmp_path, tiny_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails, as when it is not installed
    err = exit_2(["--model", tiny_dir, "--out_dir", str(tmp_path / "lora"), "--lora_rank", "4"], capsys)
    assert err == "error: --lora_rank needs peft: pip install peft"
    assert not (tmp_path / "lora").exists()


# ----------------------------------------------------------------------------- float16 (a T4) on the CPU


def test_float16_runs_on_the_cpu_with_a_scaler_and_the_first_ratio_is_exactly_1(tmp_path, tiny_dir):
    """--dtype float16 anywhere: float16 autocast over float32 weights and a gradient scaler, whose scale
    trainer.pt holds. Every update is finite, the first mini-batch's ratio exactly 1."""
    _, _, run_dir = run(tmp_path, "fp16", tiny_dir, dtype="float16", steps=2, updates_per_batch=2, eval_every=0)
    log = rows(run_dir)
    trained = [r for r in log if not r["no_signal"]]
    assert trained and all(r["ratio_first"] == [1.0, 1.0] and r["clip_first"] == 0.0 for r in trained)
    assert all(r["nonfinite"] == 0 and r["scaler_skips"] == 0 and math.isfinite(r["loss"]) for r in log)
    state = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["optimizer"]
    assert state["scaler"]["scale"] == 2.0 ** 16  # no skip: the scale it started with
    assert {v.dtype for v in weights(run_dir / "checkpoint").values()} == {torch.float32}


def test_an_inf_gradient_under_float16_is_a_counted_scaler_skip(tmp_path, tiny_dir, monkeypatch, capsys):
    """The scaler's skip, forced: an inf in the first update's gradient. That update is not applied, the step
    line and log.jsonl count it (scaler_skips), no warning calls it a problem, and the scale is halved."""
    real, calls = train.optimizer_step, []

    def inf_first(model, *a):
        calls.append(1)
        if len(calls) == 1:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        return real(model, *a)
    monkeypatch.setattr(train, "optimizer_step", inf_first)
    capsys.readouterr()
    _, lines, run_dir = run(tmp_path, "skip", tiny_dir, dtype="float16", steps=1, updates_per_batch=2,
                            eval_every=0)
    row = rows(run_dir)[0]
    assert len(row["losses"]) == 2 and (row["scaler_skips"], row["updates"], row["nonfinite"]) == (1, 1, 0)
    assert "updates 1/2 (1 scaler skip)" in next(line for line in lines if line.startswith("step "))
    assert "warning" not in capsys.readouterr().out
    state = torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["optimizer"]
    assert state["scaler"]["scale"] == 2.0 ** 15  # halved once
    # under bf16 or float32 the same inf is a non-finite update, with its warning
    calls.clear()
    _, lines, run_dir = run(tmp_path, "nan", tiny_dir, steps=1, updates_per_batch=2, eval_every=0)
    row = rows(run_dir)[0]
    assert (row["scaler_skips"], row["nonfinite"]) == (0, 1) and "warning: a non-finite" in capsys.readouterr().out


def test_help_names_each_divisors_paper_and_the_config_block_says_which_pick_wins(capsys):
    """--help's divisor line names whose each choice is (d3s.divisors: [ours]; 80/20, DAPO; GRPO's
    and GSPO's papers), and the config block's comment, where a learner meets pick(default=...,
    method_entropy=..., gspo=...), gives the order config.picked follows: the one it names first
    wins."""
    with pytest.raises(SystemExit):
        config.parse_args(train.Config, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--divisor STR kept [ours] | valid (80/20, DAPO) | seq (GRPO, GSPO) (default" in text
    source = open(ROOT / "train.py").read()
    block = source[source.index("# config:"):source.index("@dataclass")]
    order = ["gpu=", "lora_*", "(tiny_long=)", "tiny=/real=", "the loss's", "the method's",
             "else the first"]
    assert all(key in block for key in order) and "the first that applies wins" in block
    assert [block.index(key) for key in order] == sorted(block.index(key) for key in order)
    # and so it is: by hand, each key against the next one in that order
    knob = config.pick(default="d", tiny="t", tiny_long="l", real="r", gspo="g", method_entropy="m")
    assert config.picked(knob, "tiny-long", "gspo", "entropy") == "l"  # a world's own first
    assert config.picked(knob, "tiny-fork", "gspo", "entropy") == "t"  # then tiny
    no_kind = config.pick(default="d", gspo="g", method_entropy="m")
    assert config.picked(no_kind, None, "gspo", "entropy") == "g"  # the loss over the method
    assert config.picked(no_kind, None, "grpo", "entropy") == "m"
    assert config.picked(no_kind, None, "grpo", "d3s") == "d"  # else the first
    gpu = config.pick(gpu="auto", default="d", lora_tiny="lt", tiny="t")
    assert config.picked(gpu, "tiny", "grpo", "d3s", lora=True, gpu=True) == "auto"  # gpu= first
    assert config.picked(gpu, "tiny", "grpo", "d3s", lora=True) == "lt"  # then lora_
    assert config.picked(gpu, None, "grpo", "d3s") == "d"  # the first that is not gpu=


def test_a_tiny_fork_run_names_its_world_in_its_lines(tmp_path, fork_dir):
    """--model tiny-fork evaluates on the tiny-fork world's questions (the dataset knob picks tiny
    for every tiny world: the same questions); its data line, evaluation lines and last line name
    that world, not "tiny"."""
    _, lines, _ = run(tmp_path, "fork", fork_dir, steps=1, eval_size=2, eval_every=0)
    assert lines[1].startswith("data ") and ": tiny-fork test split (" in lines[1], lines[1]
    evals = [line for line in lines if line.startswith("eval step")]
    assert len(evals) == 2 and all("(2 held-out tiny-fork prompts, greedy)" in e for e in evals)
    assert "(tiny-fork, 2 prompts, greedy)" in lines[-1]
    _, lines, _ = run(tmp_path, "tiny", fork_dir, steps=1, eval_size=2, eval_every=0,
                      dataset="tiny-long")  # another world's questions: that world's name
    assert "(2 held-out tiny-long prompts, greedy)" in lines[4], lines


def test_gspo_at_k_1_differs_from_grpo_only_by_its_divisor_as_the_spec_says():
    """docs/algorithm.md: at K = 1 every ratio is 1, so GRPO's and GSPO's ratios give the same
    gradient, and --loss gspo still trains otherwise because it also picks the seq divisor; with
    --divisor kept it is --loss grpo. Checked on hand-made tensors through d3s.policy_loss."""
    spec = (ROOT / "docs" / "algorithm.md").read_text()
    section = spec.split("## Several updates per step (K)")[1].strip()
    k_1 = " ".join(section.split("\n\n")[0].split())  # its first paragraph, unwrapped
    assert "`--loss gspo` alone still trains otherwise at K = 1: it also changes the divisor to " \
           "`seq`" in k_1 and "`--loss gspo --divisor kept` is `--loss grpo` at K = 1" in k_1
    assert (resolved("--loss", "gspo").divisor, resolved("--loss", "gspo", "--divisor",
                                                         "kept").divisor) == ("seq", "kept")
    logp0 = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -2.5, -0.7]])
    keep = torch.tensor([[True, True, True, True], [True, True, False, False]])  # 4 and 2 kept
    adv = torch.tensor([1.0, -0.5])

    def gradient(loss, divisor, eps):
        logp = logp0.clone().requires_grad_()
        div = d3s.divisors(keep, keep, divisor)
        value, _ = d3s.policy_loss(logp, logp.detach(), adv, keep, div, loss=loss,
                                   eps_low=eps[0], eps_high=eps[1])
        value.backward()
        return logp.grad
    grpo = gradient("grpo", "kept", (0.2, 0.2))
    assert torch.allclose(grpo, -adv[:, None] * keep / 6)  # by hand: -A / (6 kept tokens)
    assert torch.equal(gradient("gspo", "kept", (3e-4, 4e-4)), grpo)
    # seq: each rollout's mean, then the mean over the 2 rollouts: -A / (n_i * 2)
    seq = gradient("gspo", "seq", (3e-4, 4e-4))
    assert torch.allclose(seq, -adv[:, None] * keep / torch.tensor([[8.0], [4.0]]))
