"""data.py: every named data set against its raw file, field detection, a .jsonl's train and test
splits, errors, and the prompt format."""
import hashlib
import json
import random
import re
import subprocess
import sys

import pytest
from conftest import ROOT, SHARED, requires_shared

from machinery import data
from machinery.data import INSTRUCTION, describe, format_prompt, load_problems
from machinery.grader import last_boxed

DATA = SHARED / "data"


def _raw(folder, split="test"):
    with open(DATA / folder / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _bare(text):
    """The spec for a boxed reference: drop $ math delimiters (not an escaped \\$), strip spaces."""
    return re.sub(r"(?<!\\)\$", "", text).strip()


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path

# -----------------------------------------------------------------------------
# Every name on the real data in ../shared/data


@requires_shared
@pytest.mark.parametrize("name,split,n", [
    ("gsm8k", "train", 7473), ("gsm8k", "test", 1319), ("math", "train", 4500), ("math", "test", 500),
    ("math500", "test", 500), ("aime24", "test", 30), ("aime25", "test", 30), ("amc23", "test", 40),
    ("minerva", "test", 272), ("olympiadbench", "test", 675),
])
def test_every_name_loads_with_clean_answers(name, split, n):
    rows = load_problems(name, split, data_dir=DATA)
    assert len(rows) == n
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)  # source order kept
    for r in rows:
        assert isinstance(r["prompt"], str) and r["prompt"].strip()
        assert isinstance(r["answer"], str) and r["answer"] == r["answer"].strip() and r["answer"]
        # math delimiters are gone; only an escaped \$ (a dollar sign) may remain
        assert r["answer"].replace("\\$", "").count("$") == 0, r["answer"]
        assert not r["prompt"].startswith("<|im_start|>") and "\nAnswer:" not in r["prompt"][-9:]


@requires_shared
def test_gsm8k_answers_are_the_number_after_hashes():
    for split in ("train", "test"):
        rows = load_problems("gsm8k", split, data_dir=DATA)
        raw = _raw("gsm8k", split)
        assert [r["prompt"] for r in rows] == [r["question"] for r in raw]
        assert [r["answer"] for r in rows] == [r["answer"].split("####")[-1].strip().replace(",", "") for r in raw]
    test = load_problems("gsm8k", "test", data_dir=DATA)
    assert test[0]["answer"] == "18"  # Janet's ducks
    assert sum("," in r["answer"] for r in _raw("gsm8k", "test")) > 0  # there were commas to drop
    assert all(r["answer"].lstrip("-").isdigit() for r in test)


@requires_shared
def test_math_train_is_math_test_minus_math500_with_boxed_answers():
    full, bench = _raw("math"), _raw("math500")
    bench_problems = {r["problem"] for r in bench}
    expected = [r for r in full if r["problem"] not in bench_problems]
    rows = load_problems("math", "train", data_dir=DATA)
    assert [r["prompt"] for r in rows] == [r["problem"] for r in expected]
    assert [r["answer"] for r in rows] == [_bare(last_boxed(r["solution"])) for r in expected]
    assert not {r["prompt"] for r in rows} & bench_problems
    assert rows[0]["answer"] == "2"  # "...the graph has $\boxed{2}$ vertical asymptotes."
    # `math` test is MATH-500 itself
    assert load_problems("math", "test", data_dir=DATA) == load_problems("math500", "test", data_dir=DATA)


@requires_shared
def test_benchmark_answers_match_their_raw_fields():
    m500 = load_problems("math500", "test", data_dir=DATA)
    assert [r["answer"] for r in m500] == [r["answer"] for r in _raw("math500")]  # incl. "\\$18.90"
    assert m500[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    aime = load_problems("aime24", "test", data_dir=DATA)
    assert [r["answer"] for r in aime] == [r["answer"] for r in _raw("aime24")] and aime[0]["answer"] == "204"
    aime25 = load_problems("aime25", "test", data_dir=DATA)
    raw25 = _raw("aime25")
    assert [(r["prompt"], r["answer"]) for r in aime25] == [(r["problem"], r["answer"]) for r in raw25]
    assert aime25[0]["answer"] == "70" and aime25[0]["prompt"].startswith("Find the sum of all integer bases")
    assert all(0 <= int(r["answer"]) <= 999 for r in aime25)  # AIME answers are integers 0-999
    amc = load_problems("amc23", "test", data_dir=DATA)
    assert [r["answer"] for r in amc] == [str(int(r["answer"])) for r in _raw("amc23")]  # 27.0 -> "27"
    assert amc[0]["answer"] == "27"
    minerva = load_problems("minerva", "test", data_dir=DATA)
    assert [r["answer"] for r in minerva] == [_bare(last_boxed(r["solution"])) for r in _raw("minerva_math")]
    assert minerva[0]["answer"] == "1.6"
    ob = load_problems("olympiadbench", "test", data_dir=DATA)
    raw_ob = _raw("olympiadbench")
    assert [r["prompt"] for r in ob] == [r["question"] for r in raw_ob]
    assert [r["answer"] for r in ob] == [r["final_answer"][0].replace("$", "").strip() for r in raw_ob]
    assert ob[1]["answer"] == "\\frac{1}{2 n+2}"  # was "$\frac{1}{2 n+2}$"


@requires_shared
def test_limit_and_env_var(monkeypatch):
    full = load_problems("gsm8k", "test", data_dir=DATA)
    assert load_problems("gsm8k", "test", limit=5, data_dir=DATA) == full[:5]
    assert load_problems("gsm8k", "test", limit=0, data_dir=DATA) == []
    assert len(load_problems("aime24", "test", limit=100, data_dir=DATA)) == 30
    monkeypatch.setenv("NANOD3S_DATA_DIR", str(DATA))
    assert load_problems("gsm8k", "test", limit=3) == full[:3]

# -----------------------------------------------------------------------------
# Local copies and .jsonl files written here


def test_data_dir_layout_and_math_pool(tmp_path):
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "1+1?", "answer": "so 2\n#### 2"}])
    assert load_problems("gsm8k", "test", data_dir=tmp_path) == [{"prompt": "1+1?", "answer": "2", "id": 0}]
    _write_jsonl(tmp_path / "math" / "test.jsonl", [
        {"problem": "A?", "solution": "$\\boxed{1}$"},
        {"problem": "B  is\nhere?", "solution": "$\\boxed{2}$"},
        {"problem": "C?", "solution": "so \\boxed{\\frac{3}{4}}."},
    ])
    # MATH-500 holds B, written with different whitespace: it still leaves the training pool
    _write_jsonl(tmp_path / "math500" / "test.jsonl", [{"problem": "B is here?", "solution": "x", "answer": "2"}])
    pool = load_problems("math", "train", data_dir=tmp_path)
    assert [(r["prompt"], r["answer"], r["id"]) for r in pool] == [("A?", "1", 0), ("C?", "\\frac{3}{4}", 2)]
    assert load_problems("math", "test", data_dir=tmp_path) == [{"prompt": "B is here?", "answer": "2", "id": 0}]


@pytest.mark.parametrize("row,answer", [
    ({"question": "q", "answer": "work\n#### 1,234"}, "1234"),  # GSM8K style
    ({"problem": "q", "solution": "so $\\boxed{\\frac{1}{2}}$."}, "\\frac{1}{2}"),  # MATH style
    ({"problem": "q", "solution": "so \\fbox{7}"}, "7"),
    ({"Problem": "q", "Answer": 45.0}, "45"),  # AMC float, capitalised fields
    ({"question": "q", "answer": 2.5}, "2.5"),
    ({"question": "q", "answer": -3}, "-3"),
    ({"prompt": "q", "final_answer": ["$x^2$", "$y$"]}, "x^2"),  # OlympiadBench style list
    ({"input": "q", "expected_answer": " \\$5 "}, "\\$5"),  # an escaped dollar sign is kept
    ({"query": "q", "ground_truth": "$(1,2)$"}, "(1,2)"),
    ({"question": "q", "target": "x+1"}, "x+1"),
    ({"problem": "q", "answer": "7", "solution": "\\boxed{8}"}, "7"),  # an answer field beats a solution
    ({"question": "q", "problem": "other", "answer": "1"}, "1"),
])
def test_jsonl_field_variants(tmp_path, row, answer):
    path = _write_jsonl(tmp_path / "p_test.jsonl", [row, row])  # a test file: its test split is every row
    rows = load_problems(path, "test")
    assert rows == [{"prompt": "q", "answer": answer, "id": 0}, {"prompt": "q", "answer": answer, "id": 1}]
    assert load_problems(str(path), "test", limit=1) == rows[:1]


def _one_line_error(*args, **kwargs):
    with pytest.raises(ValueError) as info:
        load_problems(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("load_problems: ")
    return msg


def test_bad_inputs_give_one_line_errors(tmp_path):
    msg = _one_line_error("gsm9k")
    assert "'gsm9k'" in msg and "gsm8k, math, math500, aime24, aime25, amc23, minerva, olympiadbench, tiny" in msg
    msg = _one_line_error(str(tmp_path / "missing.jsonl"))
    assert str(tmp_path / "missing.jsonl") in msg and ".jsonl" in msg
    msg = _one_line_error("aime24")  # default split "train" does not exist for a benchmark
    assert "aime24" in msg and "'train'" in msg and "splits: test" in msg
    assert "splits: train, test" in _one_line_error("gsm8k", "validation")
    for bad_limit in (-1, 2.0, "3"):
        assert "limit" in _one_line_error("gsm8k", "test", limit=bad_limit)

    path = _write_jsonl(tmp_path / "odd.jsonl", [{"q": "1+1?", "a": "2"}])
    msg = _one_line_error(path)
    assert "['a', 'q']" in msg and "question" in msg and str(path) in msg
    path = _write_jsonl(tmp_path / "noans.jsonl", [{"question": "1+1?", "a": "2"}])
    assert "['a', 'question']" in _one_line_error(path) and "answer" in _one_line_error(path)
    path = _write_jsonl(tmp_path / "nobox.jsonl", [{"problem": "p", "solution": "no final answer here"}])
    assert "row 0" in _one_line_error(path) and "'solution'" in _one_line_error(path)
    path = _write_jsonl(tmp_path / "empty.jsonl", [{"question": " ", "answer": "1"}])
    assert "'question'" in _one_line_error(path)
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "q", "answer": "1"}\n{not json\n', encoding="utf-8")
    assert "line 2" in _one_line_error(path)


# -----------------------------------------------------------------------------
# A .jsonl file's train and test splits: no held-out row is ever a training row


def _qa(questions):
    return [{"question": q, "answer": str(i)} for i, q in enumerate(questions)]


def _digest(question):
    """The spec of the hash: sha256 of "held out: " and the whitespace-collapsed question."""
    return hashlib.sha256(("held out: " + " ".join(question.split())).encode("utf-8")).hexdigest()


def _is_held(question):
    return int(_digest(question), 16) % 10 == 0


def _splits(path):
    return load_problems(path, "train"), load_problems(path, "test")


def test_no_held_out_row_of_a_jsonl_is_ever_in_its_train_split(tmp_path):
    """A property over 40 generated files (2 to 300 rows, questions written twice, whitespace variants):
    train and test partition the rows, share no question, each holds at least one row, the held-out
    questions are exactly those of the hash rule (or the smallest hash when none is), and neither the
    file's order nor rows appended to it move a question between the splits."""
    rng = random.Random(0)
    fell_back = 0
    for case in range(40):
        n = rng.choice([2, 3, 5, 12, 40, 300])
        pool = [f"What is {rng.randrange(10**6)} + {case}?" for _ in range(max(2, n * 3 // 4))]
        questions = pool[:2] + [rng.choice(pool) for _ in range(n - 2)]  # some questions twice
        questions = [q.replace(" ", "  ", 1) if rng.random() < 0.2 else q for q in questions]  # same, spaced
        path = _write_jsonl(tmp_path / f"c{case}.jsonl", _qa(questions))
        train, test = _splits(path)
        assert train and test
        assert sorted(r["id"] for r in train + test) == list(range(n))
        collapse = {r["id"]: " ".join(r["prompt"].split()) for r in train + test}
        held = {collapse[r["id"]] for r in test}
        assert not held & {collapse[r["id"]] for r in train}
        by_rule = {q for q in collapse.values() if _is_held(q)}
        if by_rule:
            assert held == by_rule, case
        else:  # no question falls in the slice: the one with the smallest hash is held out
            fell_back += 1
            assert held == {min(set(collapse.values()), key=_digest)}
        shuffled = questions[:]
        rng.shuffle(shuffled)
        again = load_problems(_write_jsonl(tmp_path / f"s{case}.jsonl", _qa(shuffled)), "test")
        assert {" ".join(r["prompt"].split()) for r in again} == held
        if by_rule:  # a question the rule holds out stays held out, whatever is appended
            more = questions + [f"An appended question {case}.{i}?" for i in range(30)]
            longer = load_problems(_write_jsonl(tmp_path / f"a{case}.jsonl", _qa(more)), "test")
            assert held <= {" ".join(r["prompt"].split()) for r in longer}
    assert 0 < fell_back < 40  # both paths ran: the hash rule and the at-least-one fallback
    # and describe() says the same numbers, and never calls a training row held out
    path = _write_jsonl(tmp_path / "mine.jsonl", _qa([f"question {i}" for i in range(120)]))
    train, test = _splits(path)
    assert len(test) == 10 and len(train) == 110  # 10 of these 120 questions fall in the slice
    assert describe(path, "test") == (f"{path}: 10 of 120 rows held out by question hash (1 in 10, at least 1), "
                                      f"never trained on")
    assert describe(path, "train") == (f"{path}: 110 of 120 rows, the other 10 held out by question hash "
                                       f"(1 in 10, at least 1)")


@pytest.mark.parametrize("train_name,test_name", [
    ("train.jsonl", "test.jsonl"), ("mine_train.jsonl", "mine_test.jsonl"), ("mine.train.jsonl", "mine.test.jsonl"),
    ("train-v2.jsonl", "test-v2.jsonl"),
])
def test_a_test_file_beside_the_training_file_is_the_held_out_set(tmp_path, train_name, test_name):
    train_rows = _qa([f"train question {i}" for i in range(30)])
    test_rows = _qa(["new 1", "train question 3", "new 2", "train   question\n7", "new 3"])  # 2 also in training
    train_path = _write_jsonl(tmp_path / "d" / train_name, train_rows)
    test_path = _write_jsonl(tmp_path / "d" / test_name, test_rows)
    train, test = _splits(train_path)
    assert [r["prompt"] for r in train] == [r["question"] for r in train_rows]  # the whole training file
    assert [(r["prompt"], r["id"]) for r in test] == [("new 1", 0), ("new 2", 2), ("new 3", 4)]
    assert describe(train_path, "test") == f"{test_path} beside {train_path} (2 of its 5 rows also in training dropped)"
    assert describe(train_path, "train") == f"{train_path}, all 30 rows (the held-out rows are {test_path} beside it)"
    # the test file's own name gives the same held-out rows, and refuses to be trained on
    assert load_problems(test_path, "test") == test and describe(test_path, "test") == describe(train_path, "test")
    msg = _one_line_error(test_path, "train")
    assert "named as a test set" in msg and str(train_path) in msg


def test_a_test_file_alone_is_all_test_and_a_train_file_alone_holds_out_by_hash(tmp_path):
    bench = _write_jsonl(tmp_path / "bench_test.jsonl", _qa(["a?", "b?", "a?"]))
    assert [r["prompt"] for r in load_problems(bench, "test")] == ["a?", "b?", "a?"]
    assert describe(bench, "test") == f"{bench}, all 3 rows (named as a test set, never trained on)"
    assert "never trained on" in _one_line_error(bench)  # the default split is train
    # a training file with no test file beside it: the hash rule, and describe says what is missing
    alone = _write_jsonl(tmp_path / "mine_train.jsonl", _qa([f"question {i}" for i in range(120)]))
    plain = _write_jsonl(tmp_path / "mine.jsonl", _qa([f"question {i}" for i in range(120)]))
    assert _splits(alone) == _splits(plain)
    assert describe(alone, "test").endswith(f"(1 in 10, at least 1; no {tmp_path / 'mine_test.jsonl'} beside it), "
                                            f"never trained on")
    # "train" inside a longer word is not the word: training.jsonl has no test file, testing.jsonl is ignored
    training = _write_jsonl(tmp_path / "training.jsonl", _qa([f"question {i}" for i in range(120)]))
    _write_jsonl(tmp_path / "testing.jsonl", _qa(["elsewhere?"]))
    assert _splits(training) == _splits(plain)


def test_describe_names_each_named_split_without_loading_it(tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("describe must not load a named data set")
    monkeypatch.setattr(data, "_raw_rows", no_loading)
    monkeypatch.delenv("NANOD3S_DATA_DIR", raising=False)
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    assert describe("gsm8k", "test", data_dir=tmp_path) == f"gsm8k test split ({tmp_path / 'gsm8k' / 'test.jsonl'})"
    assert describe("gsm8k", "train", data_dir=tmp_path) == "gsm8k train split (hub openai/gsm8k)"
    assert describe("aime24", "test") == "aime24 test split (hub HuggingFaceH4/aime_2024)"
    assert describe("math", "test") == "math test split (MATH-500)"
    assert describe("math", "train") == "math train split (the MATH test problems outside MATH-500)"
    assert describe("tiny", "test") == "tiny test split (1 question in 10 of the world, held out by a hash of its text)"
    assert describe("tiny-long", "train").startswith("tiny-long train split")
    for args in (("gsm9k", "test"), ("aime24", "train"), ("tiny-nope", "test")):
        with pytest.raises(ValueError) as info:
            describe(*args)
        assert "\n" not in str(info.value)


def test_a_jsonl_that_cannot_hold_anything_out_is_a_one_line_error(tmp_path):
    one = _write_jsonl(tmp_path / "one.jsonl", _qa(["1+2?"]))
    assert "1 distinct question(s), too few to hold any out" in _one_line_error(one, "train")
    same = _write_jsonl(tmp_path / "same.jsonl", _qa(["1+2?", "1+2?", " 1+2? "]))
    assert "too few to hold any out" in _one_line_error(same, "test")
    both = [q for q in (f"q{i}" for i in range(200)) if _is_held(q)][:2]  # two questions, both in the slice
    msg = _one_line_error(_write_jsonl(tmp_path / "both.jsonl", _qa(both)), "train")
    assert "all 2 questions" in msg and "nothing to train on" in msg
    _write_jsonl(tmp_path / "x_train.jsonl", _qa(["a", "b"]))
    msg = _one_line_error(_write_jsonl(tmp_path / "x_test.jsonl", _qa(["b", " a"])), "test")
    assert "every one of the 2 questions" in msg and "nothing is held out" in msg
    msg = _one_line_error(one, "validation")
    assert "a .jsonl file has the splits train and test, got 'validation'" in msg


def test_aime25_local_copy_first_then_its_hub_id(tmp_path, monkeypatch):
    _write_jsonl(tmp_path / "aime25" / "test.jsonl", [{"problem": "Find x.", "answer": "70"}])
    assert load_problems("aime25", "test", data_dir=tmp_path) == [{"prompt": "Find x.", "answer": "70", "id": 0}]
    import datasets
    calls = []

    def offline(hub_id, config=None, split=None):
        calls.append((hub_id, config, split))
        raise ConnectionError("no network")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    msg = _one_line_error("aime25", "test", data_dir=tmp_path / "elsewhere")
    assert calls == [("math-ai/aime25", None, "test")]
    assert "math-ai/aime25" in msg and "aime25/test.jsonl" in msg


def test_hub_offline_without_local_copy_fails_fast_in_one_line(tmp_path):
    # A fresh interpreter with an empty HF cache, offline, no data dir: nothing cached can answer.
    script = (
        "import json, sys, time\n"
        "from machinery import data\n"
        "cheap = 'datasets' not in sys.modules\n"
        "out = {'cheap_import': cheap}\n"
        "for key, data_dir in (('none', None), ('empty', sys.argv[1])):\n"
        "    t = time.time()\n"
        "    try:\n"
        "        data.load_problems('gsm8k', 'train', data_dir=data_dir)\n"
        "        out[key] = None\n"
        "    except ValueError as e:\n"
        "        out[key] = str(e)\n"
        "    out[key + '_s'] = time.time() - t\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "NANOD3S_DATA_DIR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    empty = tmp_path / "empty_data"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-c", script, str(empty)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["cheap_import"]  # importing data.py does not import datasets
    for key in ("none", "empty"):
        msg = out[key]
        assert msg is not None and "\n" not in msg, msg
        assert "gsm8k" in msg and "openai/gsm8k" in msg and "--data_dir DIR holding gsm8k/train.jsonl" in msg
        assert ".jsonl path" in msg
        assert out[key + "_s"] < 30
    assert "NANOD3S_DATA_DIR is unset" in out["none"]
    assert f"no local copy at {empty / 'gsm8k' / 'train.jsonl'}" in out["empty"]

# -----------------------------------------------------------------------------
# format_prompt


def _char_tokenizer():
    """A real fast tokenizer, built in code, with no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(sorted(set("Question: What is 2+3?\nAnswer")))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_format_prompt_without_template():
    tok = _char_tokenizer()
    assert not tok.chat_template
    assert format_prompt(tok, "What is 2+3?") == "Question: What is 2+3?\nAnswer:"


@requires_shared
def test_format_prompt_with_qwen_template():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen2.5")
    q = "What is $1+1$?"
    text = format_prompt(tok, q)
    # QwenLM/Qwen2.5-Math evaluation/utils.py, PROMPT_TEMPLATES["qwen25-math-cot"], written out
    assert text == ("<|im_start|>system\nPlease reason step by step, and put your final answer within "
                    "\\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n")
    assert INSTRUCTION in text and text.endswith("<|im_start|>assistant\n")
    assert "You are Qwen" not in text  # our system message replaces the template's default one
