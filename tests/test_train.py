"""train.py on the tiny world: a few real steps, checkpoints, exact resume, the schedule, bad input."""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import d3s
import train
from conftest import ROOT
from model import load_model

SMALL = dict(steps=3, prompts_per_step=4, group_size=4, eval_size=8, eval_every=2, save_every=2, progress=False,
             updates_per_batch=1, lr=1e-4)  # the values these tests were written at (defaults: 4, 5e-5)


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
        rho_t = rho_t if spec["token"] != "none" else 1.0  # the log shows the ratio applied (pods keeps every token)
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


# ----------------------------------------------------------------------------- no silent surprises (issue 12)

def exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("argv,message", [
    (["--progress", "maybe"], "'maybe' is not a boolean"),
    (["--top_p", "0.9"], "--top_p 0.9: training scores every sample with the full softmax"),
    (["--method", "grpo", "--s_init", "0.5"], "--s_init 0.5 does not apply to --method grpo: it keeps every rollout"),
    (["--method", "entropy", "--t_init", "0.5"], "the 80/20 baseline keeps a fixed 20% of tokens"),
    (["--method", "d2s", "--t_final", "0.9"], "--t_final 0.9 does not apply to --method d2s: it has no schedule"),
    (["--eval_every", "-1"], "--eval_every must be at least 0"),
    (["--updates_per_batch", "0"], "--updates_per_batch must be at least 1"),
    (["--steps"], "expected one argument"),
])
def test_bad_flag_values_are_one_line(tmp_path, capsys, argv, message):
    assert message in exit_2(["--out_dir", str(tmp_path / "x")] + argv, capsys)


def test_config_records_the_ratios_that_ran(tmp_path, tiny_dir):
    for method, ratios in (("grpo", (1.0, 1.0, 1.0, 1.0)), ("entropy", (1.0, 1.0, 0.2, 0.2)),
                           ("d2s", (0.25, 0.25, 0.2, 0.2)), ("d3s", (0.25, 0.75, 0.2, 0.6))):
        _, _, run_dir = run(tmp_path, method, tiny_dir, method=method, steps=2, eval_every=0, save_every=0)
        saved = json.load(open(run_dir / "config.json"))
        assert tuple(saved[k] for k in ("s_init", "s_final", "t_init", "t_final")) == ratios, method
        for r in rows(run_dir):  # the step line's ratios are the applied ones
            expected = d3s.keep_ratios(r["step"], 2, "linear", *ratios)
            assert (r["rho_s"], r["rho_t"]) == pytest.approx(expected), method
        if method == "grpo":
            assert all(r["kept"] == r["rollouts"] and r["tokens"] == r["valid"] for r in rows(run_dir))


def test_eval_and_save_every_0_mean_only_at_the_end(tmp_path, tiny_dir):
    history, _, run_dir = run(tmp_path, "zero", tiny_dir, steps=3, eval_every=0, save_every=0)
    assert [h["step"] for h in history] == [0, 3]
    assert torch.load(run_dir / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 3


def test_resume_refuses_flags_that_would_change_the_run(tmp_path, tiny_dir, capsys):
    _, _, run_dir = run(tmp_path, "done", tiny_dir, steps=1, eval_every=0, save_every=0)
    err = exit_2(["--resume", str(run_dir), "--steps", "400", "--lr", "5e-4", "--progress", "false"], capsys)
    assert "--lr, --steps cannot change now" in err
    with pytest.raises(ValueError, match="--method cannot change now"):  # the API too
        train.train(train.Config(resume=str(run_dir), method="grpo", progress=False), log=lambda *a: None)
    # the safe ones are taken, even at their default values
    train.main(["--resume", str(run_dir), "--eval_every", "25", "--progress", "false", "--device", "cpu"])
    assert json.load(open(run_dir / "config.json"))["eval_every"] == 25


def test_a_copied_run_folder_resumes_in_itself(tmp_path, tiny_dir, capsys):
    kw = dict(steps=3, eval_every=0, save_every=1)

    def stop_after_step_0(line):
        if line.startswith("step    0 "):
            raise KeyboardInterrupt
    cfg = train.Config(model=tiny_dir, out_dir=str(tmp_path / "orig"), **{**SMALL, **kw})
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, log=stop_after_step_0)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    before = sorted(p.name for p in (tmp_path / "orig").rglob("*"))
    train.train(train.Config(resume=str(tmp_path / "copy"), progress=False), log=lambda *a: None)
    assert sorted(p.name for p in (tmp_path / "orig").rglob("*")) == before  # the original is untouched
    assert torch.load(tmp_path / "copy" / "checkpoint" / "trainer.pt", weights_only=False)["step"] == 3
    assert json.load(open(tmp_path / "copy" / "config.json"))["out_dir"] == str(tmp_path / "copy")
    assert len(rows(tmp_path / "copy")) == 3 and len(rows(tmp_path / "orig")) == 1
    # a broken copy names the copy, not the original
    (tmp_path / "copy" / "checkpoint" / "trainer.pt").unlink()
    err = exit_2(["--resume", str(tmp_path / "copy")], capsys)
    assert str(tmp_path / "copy") in err and str(tmp_path / "orig") not in err


def test_a_crash_at_any_point_of_the_checkpoint_swap_leaves_a_checkpoint(tmp_path, tiny_dir, monkeypatch):
    """Simulate a crash at every filesystem operation of save_checkpoint's swap: --resume must always
    find a complete checkpoint, the new one once it was completely written, else the previous one."""
    model, tok = load_model(tiny_dir, device="cpu", dtype="float32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = train.rng_state(torch.Generator())
    (tmp_path / "config.json").write_text(json.dumps({"model": tiny_dir}))

    real_replace, real_rmtree, calls = os.replace, shutil.rmtree, []

    def crash_at(n):
        def counted(real):
            def op(*a, **k):
                calls.append(a[0])
                if len(calls) == n:
                    raise OSError("simulated crash")
                return real(*a, **k)
            return op
        monkeypatch.setattr(train.os, "replace", counted(real_replace))
        monkeypatch.setattr(train.shutil, "rmtree", counted(real_rmtree))

    for n in range(1, 20):
        real_rmtree(tmp_path / "checkpoint", ignore_errors=True)
        monkeypatch.undo()
        train.save_checkpoint(str(tmp_path), model, tok, opt, 1, rng, [], 0)  # the previous checkpoint, step 1
        calls.clear()
        crash_at(n)
        try:
            train.save_checkpoint(str(tmp_path), model, tok, opt, 2, rng, [], 0)
            crashed = False
        except OSError:
            crashed = True
        monkeypatch.undo()
        complete_new = crashed and len(calls) >= 1 and any(
            (tmp_path / d / "trainer.pt").is_file() and
            torch.load(tmp_path / d / "trainer.pt", weights_only=False)["step"] == 2
            for d in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
        _, state = train.load_resume(str(tmp_path))
        assert state["step"] in (1, 2)
        if not crashed or complete_new:
            assert state["step"] == 2, n
        assert not (tmp_path / "checkpoint.tmp").exists() and not (tmp_path / "checkpoint.old").exists()
        if not crashed:
            break
    assert not crashed and n > 4  # every operation of the swap was crashed once


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path, tiny_dir):
    out = tmp_path / "term"
    proc = subprocess.Popen([sys.executable, "train.py", "--model", tiny_dir, "--out_dir", str(out), "--steps", "500",
                             "--save_every", "1000", "--eval_every", "0", "--eval_size", "4", "--prompts_per_step", "2",
                             "--group_size", "4", "--progress", "false"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                      "OMP_NUM_THREADS": "1"})
    lines = []
    for line in proc.stdout:  # wait for two step lines, then send what a scheduler sends
        lines.append(line)
        if line.startswith("step    1 "):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, lines + [rest]
    assert "checkpoint saved after step" in rest and f"python train.py --resume {out}" in rest
    step = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)["step"]
    assert step >= 2 and len(rows(out)) == step


# ----------------------------------------------------------------------------- the config block (issue 14)

def test_help_shows_every_knob_its_default_and_its_comment():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0
    text = "".join(out.stdout.split())  # argparse wraps lines, also at hyphens: compare without whitespace
    comments = train.knob_comments()
    for f in dataclasses.fields(train.Config):
        assert f"--{f.name}" in text and "".join(f"default {f.default!r}".split()) in text, f.name
        assert "".join(comments[f.name].split()) in text, f.name  # every knob has its comment
    assert "(default5e-05;realmodel1e-06)" in text


def test_real_model_preset_applies_only_to_the_knobs_not_set():
    real = train.resolve(train.Config(model="Qwen2.5-0.5B"), given={"model"})
    assert {k: getattr(real, k) for k in train.REAL_MODEL} == train.REAL_MODEL
    assert real.eval_dataset == "gsm8k" and real.out_dir == os.path.join("out", "d3s-Qwen2.5-0.5B")
    # a knob set to the tiny world's value is still the user's: the command line says which were set
    cfg, given = train.parse_args(["--model", "Qwen2.5-0.5B", "--lr", "1e-4", "--steps", "100"])
    mine = train.resolve(cfg, given)
    assert (mine.lr, mine.steps, mine.prompts_per_step) == (1e-4, 100, 32)
    tiny_run = train.resolve(train.Config())
    assert (tiny_run.lr, tiny_run.dataset, tiny_run.max_new_tokens, tiny_run.updates_per_batch) == (5e-5, "tiny", 32, 4)
    gspo = train.resolve(train.Config(loss="gspo"))
    assert (gspo.clip_eps_low, gspo.clip_eps_high) == (3e-4, 4e-4)
    assert train.resolve(train.Config(loss="gspo", clip_eps_low=0.1)).clip_eps_low == 0.1
    assert train.resolve(train.resolve(train.Config(model="Qwen2.5-0.5B"))) == real  # resolving twice changes nothing


def test_a_run_draws_its_curves(tmp_path, tiny_dir):
    _, _, run_dir = run(tmp_path, "curves", tiny_dir, steps=2, eval_every=1, save_every=0)
    png = run_dir / "curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_wandb_logs_the_step_fields_or_says_how_to_get_it(tmp_path, tiny_dir, capsys, monkeypatch):
    """--wandb true: with wandb installed, an offline W&B run gets every log.jsonl field; without it,
    a one-line error that says what to install (it is not a required dependency)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        err = exit_2(["--model", tiny_dir, "--out_dir", str(tmp_path / "w"), "--wandb", "true"], capsys)
        assert "--wandb true needs the wandb package: pip install wandb" in err
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    _, _, run_dir = run(tmp_path, "w", tiny_dir, steps=2, eval_every=0, save_every=0, wandb=True)
    records = next(tmp_path.rglob("*.wandb")).read_bytes()  # an offline run's history, protobuf with plain keys
    for key in list(rows(run_dir)[-1]) + ["accuracy"]:
        assert f'"{key}"'.encode() in records or key.encode() in records, key
