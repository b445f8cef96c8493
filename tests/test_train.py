"""train.py on the tiny world: a few real steps, checkpoints, exact resume, the schedule, bad input."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import d3s
import train
from conftest import ROOT

SMALL = dict(steps=3, prompts_per_step=4, group_size=4, eval_size=8, eval_every=2, save_every=2, progress=False)


def run(tmp_path, name, model, **kw):
    cfg = train.Config(model=model, out_dir=str(tmp_path / name), **{**SMALL, **kw})
    lines = []
    history = train.train(cfg, log=lines.append)
    return history, lines, tmp_path / name


def rows(run_dir):
    with open(run_dir / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def test_steps_change_the_model_and_write_log_config_checkpoint(tmp_path, tiny_dir):
    before = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    history, lines, run_dir = run(tmp_path, "a", tiny_dir)
    log = rows(run_dir)
    assert [r["step"] for r in log] == [0, 1, 2]
    assert all(r["rollouts"] == 16 for r in log)
    assert [h["step"] for h in history] == [0, 2, 3]
    assert json.load(open(run_dir / "config.json"))["method"] == "d3s"
    after = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint").state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "three optimizer steps should move most tensors"
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 3
    assert any(line.startswith("done: held-out accuracy") for line in lines)


@pytest.mark.parametrize("method", ["d3s", "d2s", "pods", "d3s-i"])
def test_kept_counts_follow_the_schedule(tmp_path, tiny_dir, method):
    _, _, run_dir = run(tmp_path, method, tiny_dir, method=method, steps=3, eval_every=3, save_every=3)
    spec = d3s.METHODS[method]
    for r in rows(run_dir):
        rho_s, rho_t = d3s.keep_ratios(r["step"], 3, spec["schedule"], 0.25, 0.75, 0.2, 0.6)
        assert (r["rho_s"], r["rho_t"]) == pytest.approx((rho_s, rho_t))
        if spec["sample"] == "cross":
            assert r["kept"] == d3s.num_keep(rho_s, 16)
        else:  # intra / pods: max(2, round(rho_s * G)) per group, 4 groups of 4
            assert r["kept"] == 4 * min(4, max(2, d3s.num_keep(rho_s, 4)))
        assert r["tokens"] == d3s.num_keep(rho_t, r["valid"]) if spec["token"] != "none" else r["valid"]


def test_resume_reproduces_the_uninterrupted_run(tmp_path, tiny_dir):
    kw = dict(steps=4, save_every=100, eval_every=100, method="d3s")
    run(tmp_path, "full", tiny_dir, **kw)

    def interrupt_after_step_1(line):
        if line.startswith("step    1 "):
            raise KeyboardInterrupt
    cfg = train.Config(model=tiny_dir, out_dir=str(tmp_path / "cut"), **{**SMALL, **kw})
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, log=interrupt_after_step_1)
    assert torch.load(tmp_path / "cut" / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 2
    train.train(train.Config(resume=str(tmp_path / "cut"), progress=False), log=lambda *a: None)

    full, cut = rows(tmp_path / "full"), rows(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3]
    for a, b in zip(full, cut):
        for key in ("reward", "kept", "tokens", "valid", "loss", "grad_norm", "tokens_trained"):
            assert a[key] == b[key], (a["step"], key)
    wa = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "checkpoint").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(tmp_path / "cut" / "checkpoint").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_every_method_runs(tmp_path, tiny_dir, loss):
    for method in d3s.METHODS:
        _, _, run_dir = run(tmp_path, f"{method}-{loss}", tiny_dir, method=method, loss=loss, steps=1,
                            prompts_per_step=2, eval_size=2, eval_every=1, save_every=1)
        assert len(rows(run_dir)) == 1 and rows(run_dir)[0]["skipped"] == 0


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
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_dir, capsys, argv, message):
    base = ["--model", tiny_dir, "--out_dir", str(tmp_path / "bad"), "--progress", "false"]
    with pytest.raises(SystemExit) as e:
        train.main(base + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_incomplete_resume_folder(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", str(tmp_path / "half")])
    assert e.value.code == 2 and "incomplete run folder" in capsys.readouterr().err


def test_command_line_bad_ratio_has_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--s_final=2"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --s_final must be in (0, 1], got 2.0"
