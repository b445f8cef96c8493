"""tiny.py's worlds: the default world's questions exactly as before the named worlds (the same rows in
the same order), long chains from a fixed sample with disjoint splits, every world's settings (its
token budget fits a worked solution), tiny-weak's teacher (it adds, and rarely carries), tiny-fork's
teacher (any order, answers that grade right) and its model's forks, and a world's warmed-up folder
built, recognised and rebuilt."""
import hashlib
import json
import random

import pytest

from machinery import tiny


def digest(rows):
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def test_default_world_questions_are_unchanged():
    train, test = tiny.problems("train"), tiny.problems("test")
    assert (len(train), len(test)) == (8964, 1036)  # all 10**4 four-digit questions, 1 in 10 held out by hash
    assert train[:2] == [{"prompt": "2+3+9+5", "answer": "9"}, {"prompt": "6+2+1+6", "answer": "5"}]
    assert test[:2] == [{"prompt": "3+9+9+2", "answer": "3"}, {"prompt": "5+7+9+5", "answer": "6"}]
    # the digests of the whole lists as they were before long chains existed (commit fe5f152)
    assert digest(train) == "178a38ba2d95b2751938b7559e8213dae6293c61d2a37ee3ab61c00f138e59fc"
    assert digest(test) == "be89c1c84d02753439c334da74237fd044102cff2ec946ce7d74dd42bc30a34e"


@pytest.mark.parametrize("terms", [6, 8])
def test_long_chains_are_a_fixed_sample_with_disjoint_splits(terms):
    train, test = tiny.problems("train", terms=terms), tiny.problems("test", terms=terms)
    assert len(train) + len(test) == tiny.QUESTIONS == 10_000      # a sample, not 10**terms questions
    assert 900 <= len(test) <= 1100                              # about 1 in TEST_SHARE
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train[:50] + test[:50]:
        digits = [int(d) for d in r["prompt"].split("+")]
        assert len(digits) == terms and r["answer"] == str(sum(digits) % 10)
    # another seed shuffles the same questions; a second call gives the same rows
    again = tiny.problems("train", seed=1, terms=terms)
    assert again != train and sorted(again, key=str) == sorted(train, key=str)
    assert tiny.problems("test", terms=terms) == test


def test_every_world_is_complete_and_its_budget_fits_a_solution():
    """A world's budget is train.py's max_new_tokens for it: the one source of that value."""
    import train
    from machinery import config
    tokenizer = tiny.build_tokenizer()
    assert tiny.WORLDS["tiny"] == dict(terms=4, warmup_steps=200, noise=0.6)
    for name, spec in tiny.WORLDS.items():
        assert name == "tiny" or name.startswith("tiny-")
        assert set(spec) - {"shuffle"} == {"terms", "warmup_steps", "noise"}
        # a worked solution is 6 * terms + 2 tokens: " ", terms-1 lines "a+b=c" and their newlines,
        # "\n#### d" and <eos> (26 for 4 terms); the budget leaves room for a longer, wrong answer
        solution = tiny.solve([9] * spec["terms"]) + tiny.EOS
        assert len(tokenizer(solution, add_special_tokens=False)["input_ids"]) == 6 * spec["terms"] + 2
        budget = config.resolve(train.Config(model=name)).max_new_tokens
        assert budget >= 6 * spec["terms"] + 2 + 4, name


def test_a_worlds_folder_is_built_recognised_and_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setitem(tiny.WORLDS, "tiny-test", dict(terms=3, warmup_steps=2, noise=0.5))
    built = []
    path = tiny.pretrained(str(tmp_path / "w"), name="tiny-test", log=built.append)
    assert len(built) > 0 and tiny.world_of(path) == "tiny-test"
    marker = json.loads((tmp_path / "w" / "tiny.json").read_text())
    assert (marker["world"], marker["terms"], marker["steps"], marker["noise"]) == ("tiny-test", 3, 2, 0.5)
    built.clear()
    tiny.pretrained(path, name="tiny-test", log=built.append)
    assert built == []  # reused
    monkeypatch.setitem(tiny.WORLDS, "tiny-test", dict(terms=3, warmup_steps=2, noise=0.4, max_new_tokens=24))
    tiny.pretrained(path, name="tiny-test", log=built.append)
    assert built and json.loads((tmp_path / "w" / "tiny.json").read_text())["noise"] == 0.4  # rebuilt


def test_tiny_weak_adds_like_the_default_world_but_rarely_carries():
    # the default world's questions and warm-up; only the teacher is sloppier: it forgets the carry on
    # 90% of the steps that wrap past 9 and never errs on a step that does not
    weak = tiny.WORLDS["tiny-weak"]
    assert weak == {**tiny.WORLDS["tiny"], "noise": 0.9}
    rng, plain, wrapping, forgotten = random.Random(0), 0, 0, 0
    for _ in range(2000):
        digits = [rng.randrange(10) for _ in range(weak["terms"])]
        for line in tiny.solve(digits, rng, weak["noise"]).strip().split("\n")[:-1]:  # "a+b=c" lines
            a, b, c = map(int, line.replace("=", "+").split("+"))
            if a + b < 10:
                assert c == a + b
                plain += 1
            else:
                wrapping += 1
                forgotten += c == (a + b + 1) % 10
                assert c in ((a + b) % 10, (a + b + 1) % 10)
    assert plain > 1000 and wrapping > 1000 and abs(forgotten / wrapping - 0.9) < 0.02
    # a model that adds but never carries is right exactly on the questions with no wrapping step
    # (digit sum <= 9): 66 of the 1036 test questions, the floor under the world's 7.0% greedy start
    test = tiny.problems("test")
    assert sum(sum(map(int, r["prompt"].split("+"))) <= 9 for r in test) == 66


def test_tiny_fork_teacher_adds_in_any_order_and_every_reference_answer_grades_right():
    """tiny-fork's forks of two kinds: the order of the terms and of a step's operands (the answer
    stays), and the forgotten carry (the answer changes). The default world's teacher is as it
    was."""
    from reward import grade
    fork = tiny.WORLDS["tiny-fork"]
    assert fork == {**tiny.WORLDS["tiny"], "warmup_steps": 300, "noise": 0.5, "shuffle": True}
    rng, firsts, acc_second, later, forgotten, wrapping = random.Random(0), set(), 0, 0, 0, 0
    for r in tiny.problems("train") + tiny.problems("test"):  # tiny's questions, 4 terms
        digits = [int(c) for c in r["prompt"].split("+")]
        clean = tiny.solve(digits, rng, 0.0, shuffle=True)
        assert r["answer"] == str(sum(digits) % 10) and grade(clean, r["answer"]) == 1.0, (r, clean)
        steps = [list(map(int, s.replace("=", "+").split("+"))) for s in clean.split("\n")[:-1]]
        terms, acc = [steps[0][0], steps[0][1]], steps[0][2]
        for a, b, c in steps[1:]:  # one operand is the previous result, the other a new term
            assert acc in (a, b) and c == (a + b) % 10
            terms.append(b if a == acc else a)
            if a != b:  # which operand came first shows
                acc_second += b == acc
                later += 1
            acc = c
        assert sorted(terms) == sorted(digits)  # every term of the question, once
        firsts.add(steps[0][0])
        sloppy = tiny.solve(digits, rng, fork["noise"], shuffle=True)
        for a, b, c in (map(int, s.replace("=", "+").split("+")) for s in sloppy.split("\n")[:-1]):
            if a + b >= 10:
                wrapping += 1
                forgotten += c == (a + b + 1) % 10
    assert firsts == set(range(10)) and 0.45 < acc_second / later < 0.55
    assert 0.47 < forgotten / wrapping < 0.53
    # the same seed writes the same solutions; without shuffle the default world's teacher draws
    # and writes exactly as before tiny-fork (the digest of commit ca76006's)
    one, two = random.Random(1), random.Random(1)
    assert [tiny.solve([3, 8, 5, 9], one, 0.5, True) for _ in range(20)] == \
        [tiny.solve([3, 8, 5, 9], two, 0.5, True) for _ in range(20)]
    rng = random.Random(0)
    out = [tiny.solve([rng.randrange(10) for _ in range(4)], rng, 0.6) for _ in range(500)]
    assert hashlib.sha256("|".join(out).encode()).hexdigest() == \
        "0f7235cb04854d4f6a0aaafd7f3db8d6b082b34a380662c24ece6ebe9112abab"


def test_tiny_fork_has_a_real_models_share_of_forks_and_tiny_has_not(fork_dir, tiny_dir,
                                                                      one_thread):
    """At T = 1 on its training questions, tiny-fork's warmed-up model samples 15-25% of its tokens
    above 0.672 nats with a mean entropy of 0.2-0.4 (a real 0.5B model on GSM8K: 17.1%, 0.281); the
    default world's forks are too few (5.7%) for token selection to have anything to select."""
    from experiments.world_figures import entropy_profile
    from machinery.model import load_model
    rows = tiny.problems("train")[:32]  # 32 groups of 8: about 6,700 tokens
    profile = {}
    for name, folder in (("tiny-fork", fork_dir), ("tiny", tiny_dir)):
        model, tokenizer = load_model(folder, device="cpu")
        profile[name] = entropy_profile(model, tokenizer, rows, max_new_tokens=32)
    fork, plain = profile["tiny-fork"], profile["tiny"]
    assert 0.15 <= fork["forking share"] <= 0.25 and 0.2 <= fork["mean H"] <= 0.4, fork
    assert fork["median H"] < 0.1 and fork["top 20% hold"] > 0.6, fork  # most tokens are certain
    assert plain["forking share"] < 0.1 and plain["mean H"] < 0.2, plain


def test_the_warm_up_is_the_same_on_any_number_of_threads():
    """The warmed-up model must not depend on the machine that built it: the warm-up runs on one thread
    (with 2 threads the float sums run in another order, and 200 steps moved weights by up to 0.018)."""
    import torch
    threads, got = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(tiny.warmup(steps=3, batch_size=32, log=lambda *a: None)[0].state_dict())
            assert torch.get_num_threads() == n  # the caller's setting is restored
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])
