"""experiments/study_k.py, section K's reading: the paired t-test and Holm's correction by hand, and a
run read at a budget priced on a device, on hand-made runs."""
import json

import pytest

import experiments.study_k as k


def test_t_test_against_the_t_table():
    # diffs 1..5: mean 3, sd sqrt(2.5), t = 3 / (sqrt(2.5) / sqrt(5)) = 4.243 on 4 degrees of freedom:
    # two-sided p = 0.01324, t(0.975, 4) = 2.776 (a t table)
    mean, half, p = k.t_test([1, 2, 3, 4, 5])
    assert mean == 3 and p == pytest.approx(0.01324, abs=1e-5)
    assert half == pytest.approx(2.776 * (2.5 ** 0.5) / 5 ** 0.5, rel=1e-3)
    assert k.t_test([0.0, 0.0, 0.0])[2] == 1.0 and k.t_test([1.0, 1.0])[2] == 0.0


def test_holm_steps_down_by_hand():
    # alpha 0.05 over 4, smallest first: 0.001 <= 0.05/4 and 0.01 <= 0.05/3 pass; 0.03 > 0.05/2 fails,
    # and nothing after the first refusal passes (0.04 <= 0.05/1 would on its own)
    assert k.holm([0.03, 0.01, 0.04, 0.001]) == [False, True, False, True]
    assert k.holm([0.02, 0.01, 0.04, 0.001]) == [True] * 4  # 0.02 <= 0.05/2, 0.04 <= 0.05
    assert k.holm([0.2, 0.3]) == [False, False]


def run(method, steps, accuracy_by_step, **config):
    cfg = dict(method=method, s_init=0.25, s_final=0.75, t_init=0.2, t_final=0.6, **config)
    return {"method": method, "config": cfg, "seed": 0, "steps": [{}] * steps,
            "history": [{"step": s, "accuracy": a} for s, a in accuracy_by_step]}


def test_a_run_is_read_where_its_priced_seconds_cross_the_budget():
    device = {"name": "dev", "share": 0.5, "ratio": {"grpo-filter": 0.5}}
    # the filter's step costs 0.5 + 0.5 * 0.5 = 0.75 GRPO steps: 40 of them cost 30
    filt = run("grpo-filter", 60, [(0, 0.0), (60, 0.6)])
    s, acc, ended = k.read_at(filt, device, 30)
    assert (s, ended) == (pytest.approx(40.0), False) and acc == pytest.approx(0.4)
    s, acc, ended = k.read_at(filt, device, 60)  # 60 steps cost 45: it ends first, read at its end
    assert (s, acc, ended) == (60, pytest.approx(0.6), True)
    grpo = run("grpo", 60, [(0, 0.0), (60, 0.6)])
    assert k.read_at(grpo, device, 30)[:2] == (pytest.approx(30.0), pytest.approx(0.3))


def test_this_cpus_prices_fit_the_counts_and_price_each_step(tmp_path):
    """Update seconds = a + b fwd_bwd + c nograd, fitted exactly on made-up configurations priced by
    a = 0.05, b = 1e-4, c = 2e-5; step 1 from the share; a step with nothing to learn costs step 1."""
    def config(fb, ng):
        return {"fwd_bwd_tokens": fb, "nograd_tokens": ng, "upd_s": 0.05 + 1e-4 * fb + 2e-5 * ng}
    now = {"grpo": config(5000, 3000), "grpo-filter": config(4000, 3000),
           "d3s 0.25/0.2": config(1000, 700), "d3s 0.75/0.6": config(4500, 2000)}
    now["share"] = 0.25  # step 1 = upd / 3
    path = tmp_path / "u.json"
    path.write_text(json.dumps({"results": {"now": now}}))
    coef, gen, fit = k.cpu_prices({"tiny": str(path)})
    assert coef == pytest.approx((0.05, 1e-4, 2e-5)) and fit < 1e-9
    assert gen["tiny"] == pytest.approx(now["grpo"]["upd_s"] / 3)
    steps = [{"no_signal": False, "fwd_bwd_tokens": 5000, "nograd_tokens": 3000},
             {"no_signal": True, "fwd_bwd_tokens": 0, "nograd_tokens": 0}]
    got = k.step_seconds({"steps": steps}, coef, 0.3)
    assert got == pytest.approx([0.3 + 0.05 + 0.5 + 0.06, 0.3])


def test_the_share_where_the_answer_flips_by_hand():
    """GRPO reaches 50% at step 5 (1 s of update a step), D3S at step 8 (0.2 s a step): D3S is
    sooner while 8 g + 1.6 < 5 g + 5, below g* = 3.4 / 3 s of generation a step, a share of GRPO's
    step of g* / (g* + 1) = 17 / 32."""
    def priced(method, tokens, accuracy_at_10):
        r = run(method, 10, [(0, 0.0), (10, accuracy_at_10)])
        r["steps"] = [{"no_signal": False, "fwd_bwd_tokens": tokens}] * 10
        return r
    coef = (0.0, 1e-3, 0.0)
    grpo, d3s = [priced("grpo", 1000, 1.0)], [priced("d3s", 200, 0.625)]
    flip = k.flip_share(grpo, d3s, coef, 1.0, 0.5)
    assert flip == pytest.approx(17 / 32)
    g = flip / (1 - flip)  # generation's seconds a step at that share: x is 1 there
    at = {"coef": coef, "gen": g, "unit": g + 1.0}
    assert k.cost_to(grpo, at, 0.5) == pytest.approx(k.cost_to(d3s, at, 0.5))
    assert k.flip_share(grpo, [priced("d3s", 200, 1.0)], coef, 1.0, 0.5) == 1.0  # fewer, cheaper
    assert k.flip_share(grpo, [priced("d3s", 1000, 0.625)], coef, 1.0, 0.5) == 0.0  # more, as dear
    assert k.flip_share(grpo, [priced("d3s", 200, 0.4)], coef, 1.0, 0.5) is None  # never there
