"""experiments/bench_decode.py's timed side: engines run in the same rounds of one process, another
checkout's loop (--against) among them, imported beside this one, its tokens compared with the
loop's."""
from pathlib import Path

import pytest

import rollout
from experiments import bench_decode
from machinery import data
from machinery.model import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
ROOT = Path(__file__).resolve().parent.parent


def test_against_runs_another_checkouts_loop_in_the_same_rounds(tiny_dir):
    runs = bench_decode.engines(ROOT)  # this checkout again, imported a second time
    other = f"loop {ROOT.name}"
    assert list(runs) == ["loop", "hf", other]
    assert runs[other].func is not rollout.generate_groups  # a fresh import, not this module's
    assert runs[other].func.__module__ == "rollout" and runs[other].keywords == {"engine": "loop"}
    model, tok = load_model(str(tiny_dir), device="cpu", dtype="float32")
    prompts = [data.format_prompt(tok, r["prompt"]) for r in data.load_problems("tiny", "train",
                                                                                 limit=2)]
    times, same = bench_decode.measure(model, tok, prompts, 4, 8, 2, runs)
    assert {e: len(v) for e, v in times.items()} == {"loop": 2, "hf": 2, other: 2}  # 0 warms up
    assert same[other] == [24, 24]  # the same code and seeds: every row's tokens, 3 rounds x 8
    assert same["hf"][1] == 24 and all(t[2] > 0 for v in times.values() for t in v)
