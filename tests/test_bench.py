"""bench.py: a 2-step, 1-seed benchmark of grpo and d3s on the tiny world, its table checked against
results.json, against the runs' own log.jsonl / train.log, and against the schedule by hand; the
aggregation on hand-made runs (std, steps to GRPO, failures); bad input."""
import contextlib
import io
import json
import re
import shutil

import pytest
import torch

import bench

ARGS = ["--methods", "grpo,d3s", "--seeds", "1", "--steps", "2", "--eval_every", "1", "--eval_size", "16",
        "--prompts_per_step", "2", "--group_size", "4", "--threads", "1", "--out", "bench"]


def table_rows(text):
    """{method: [cells]} from the markdown table in a printed text."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in bench.d3s.METHODS:
            rows[cells[0]] = cells
    return rows


@pytest.fixture(scope="module")
def benched(tiny_dir, tmp_path_factory):
    """Run bench once (in this process, one thread) in a temporary folder; return its outputs."""
    tmp = tmp_path_factory.mktemp("bench")
    shutil.copytree(tiny_dir, tmp / "tiny")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench.main(ARGS + ["--model", str(tmp / "tiny")])
    torch.set_num_threads(threads)
    res = json.loads((tmp / "bench" / "results.json").read_text())
    return tmp / "bench", out.getvalue(), res


def test_table_matches_results_json_and_the_runs_logs(benched):
    out_dir, printed, res = benched
    rows = table_rows(printed)
    assert list(rows) == ["grpo", "d3s"]
    assert table_rows((out_dir / "results.md").read_text()) == rows  # saved as printed
    table = {r["method"]: r for r in res["table"]}
    logs, accs = {}, {}
    for m in ("grpo", "d3s"):
        run = out_dir / "runs" / f"{m}-seed0"
        logs[m] = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        assert json.loads((run / "config.json").read_text())["method"] == m
        # train.py's own printed evaluations, independent of the returned history
        accs[m] = [float(a) for a in re.findall(r"held-out accuracy (\d\.\d+) \(", (run / "train.log").read_text())]
        assert len(logs[m]) == 2 and len(accs[m]) == 3  # steps 0, 1; evaluations at 0, 1, 2
    for m, cells in rows.items():
        t, log = table[m], logs[m]
        # the printed cells are the json numbers
        assert cells[1] == f"{t['final_mean']:.1f} ± {t['final_std']:.1f}"
        assert cells[2] == f"{t['best']:.1f}"
        assert cells[4] == f"{t['rollouts']} ({t['rollouts_pct']:.1f}%)"
        assert cells[5] == f"{t['tokens']} ({t['tokens_pct']:.1f}%)"
        assert cells[6:10] == [f"{t['t_gen']:.2f}", f"{t['t_upd']:.2f}", str(t["wall"]), "1/1"]
        # the json numbers are the runs' logs, recomputed here
        assert t["final_mean"] == round(100 * accs[m][-1], 1) and t["final_std"] == 0.0
        assert t["best"] == round(100 * max(accs[m]), 1)
        assert t["rollouts"] == sum(r["kept"] for r in log)
        assert t["tokens"] == sum(r["tokens"] for r in log) == log[-1]["tokens_trained"]
        assert t["t_gen"] == round(sum(r["t_gen"] for r in log) / 2, 2)
        assert t["t_upd"] == round(sum(r["t_upd"] for r in log) / 2, 2)
        run = next(r for r in res["runs"] if r["method"] == m)
        assert [h["accuracy"] for h in run["history"]] == pytest.approx(accs[m], abs=5e-4 + 1e-9)  # printed with 3 decimals: 0.1875 -> "0.188"
        assert [h["step"] for h in run["history"]] == [0, 1, 2]
    # by hand: grpo trains all 2*4 rollouts a step; d3s keeps round(rho_s * 8) with rho_s 0.25 -> 0.75
    assert table["grpo"]["rollouts"] == 16 and table["d3s"]["rollouts"] == 2 + 6
    assert table["grpo"]["rollouts_pct"] == 100.0 and table["d3s"]["rollouts_pct"] == 50.0
    assert table["d3s"]["tokens_pct"] == round(100 * table["d3s"]["tokens"] / table["grpo"]["tokens"], 1)
    # steps to GRPO's final accuracy: the first evaluated step at or above it
    target = accs["grpo"][-1]
    for m in rows:
        hit = [s for s, a in zip([0, 1, 2], accs[m]) if a >= target - 1e-9]
        assert table[m]["steps_to_grpo"] == (hit[0] if hit else "not reached")
        assert rows[m][3] == str(table[m]["steps_to_grpo"])


def test_plot_is_a_png_and_results_json_has_the_plot_rows(benched):
    out_dir, _, res = benched
    assert (out_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for run in res["runs"]:
        assert run["error"] is None
        assert [s["step"] for s in run["steps"]] == [0, 1]
        assert all(s["grad_norm"] >= 0 for s in run["steps"])
    assert res["curves"]["grpo"]["step"] == [0, 1, 2]


def fake_run(method, seed, accs, kept=(8, 8), tokens=(100, 100), error=None):
    """A hand-made run result, as run_one returns it."""
    steps = [{"step": i, "kept": k, "tokens": t, "grad_norm": 1.0, "t_gen": 1.0, "t_upd": 0.5}
             for i, (k, t) in enumerate(zip(kept, tokens))]
    history = [{"step": i, "tokens": sum(tokens[:i]), "accuracy": a} for i, a in enumerate(accs)]
    if error:
        history, steps = [], []
    return {"method": method, "seed": seed, "history": history, "steps": steps, "wall": 10.0, "error": error}


def test_aggregate_by_hand():
    results = [
        fake_run("grpo", 0, [0.2, 0.4, 0.5]), fake_run("grpo", 1, [0.2, 0.3, 0.7]),   # final mean 0.6
        fake_run("d3s", 0, [0.2, 0.7, 0.6], kept=(2, 6), tokens=(10, 40)),
        fake_run("d3s", 1, [0.2, 0.5, 0.4], kept=(2, 6), tokens=(20, 30)),             # curve .2 .6 .5
        fake_run("d3s", 2, [], error="RuntimeError: boom"),
        fake_run("pods", 0, [0.2, 0.3, 0.4], kept=(4, 4), tokens=(50, 50)),
        fake_run("d2s", 0, [], error="ValueError: bad"),
    ]
    rows, curves = bench.aggregate(results, ["grpo", "d3s", "pods", "d2s"])
    grpo, d3s, pods, d2s = rows
    assert (grpo["final_mean"], grpo["final_std"]) == (60.0, 14.1)      # sample std of 0.5, 0.7
    assert grpo["best"] == 60.0 and grpo["steps_to_grpo"] == 2
    assert (d3s["final_mean"], d3s["final_std"], d3s["best"]) == (50.0, 14.1, 60.0)
    assert d3s["steps_to_grpo"] == 1 and pods["steps_to_grpo"] == "not reached"
    assert (d3s["rollouts"], d3s["rollouts_pct"]) == (8, 50.0)
    assert (d3s["tokens"], d3s["tokens_pct"]) == (50, 25.0)             # (50 + 50) / 2 of grpo's 200
    assert d3s["runs"] == 2 and d3s["failed"] == ["seed 2: RuntimeError: boom"] and d3s["wall"] == 30
    assert curves["d3s"]["acc_mean"] == pytest.approx([0.2, 0.6, 0.5])
    assert d2s == {"method": "d2s", "runs": 0, "failed": ["seed 0: ValueError: bad"], "wall": 10}
    table = bench.format_table(rows)
    cells = table_rows(table)
    assert cells["d3s"][1:5] == ["50.0 ± 14.1", "60.0", "1", "8 (50.0%)"]
    assert cells["d3s"][-1] == "2/3; failed seed 2: RuntimeError: boom"
    assert cells["d2s"][1] == "failed" and cells["d2s"][-1] == "0/1; failed seed 0: ValueError: bad"
    # without grpo there is nothing to compare to
    rows, _ = bench.aggregate([r for r in results if r["method"] == "pods"], ["pods"])
    assert rows[0]["steps_to_grpo"] == "-" and "| - |" in bench.format_table(rows)


@pytest.mark.parametrize("flags, word", [
    (["--methods", "grpo,nope"], "nope"), (["--seeds", "0"], "--seeds"), (["--steps", "0"], "--steps"),
    (["--lr", "-1"], "--lr"), (["--s_init", "2"], "--s_init"),
])
def test_bad_input_is_one_line_and_exit_2(flags, word, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and word in err[0]
    assert not (tmp_path / "out").exists()  # nothing was built or written
