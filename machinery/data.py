"""
Data: math problems as {"prompt", "answer"} rows, and the one prompt format the whole project uses.

    load_problems("gsm8k", "train")                  # openai/gsm8k from the hub, or a local copy
    load_problems("math500", "test", data_dir="data")      # data/math500/test.jsonl, offline
    load_problems("mine.jsonl", "test")              # your own file's held-out rows (see below)
    describe("mine.jsonl", "test")                   # what those rows are, in words, for a log line
    format_prompt(tokenizer, row["prompt"])          # the text the policy continues
    batch_at(problems, step, size, seed)             # the prompts of a step: one shuffle per epoch

Every row is {"prompt": the raw question (not templated), "answer": the reference answer, already
extracted, "id": the row's index in its source}. D3S step 2 (docs/algorithm.md) grades each rollout
against "answer" with reward.grade; step 1 samples G rollouts of format_prompt(tokenizer, prompt).

Where a named data set comes from, in this order:
  1. a local copy: {data_dir}/{folder}/{split}.jsonl, with data_dir the argument (train.py's
     --data_dir) or else the environment variable NANOD3S_DATA_DIR (gsm8k/train.jsonl,
     math500/test.jsonl, ...).
  2. the hub, through datasets.load_dataset (the table _SOURCES below).
If both fail, a one-line ValueError says what was tried and how to supply a local file.

The names and what they mean (the D3S paper trains on MATH and reports the seven benchmarks
below: GSM8K, MATH (as MATH-500), AIME 2024 and 2025, AMC 2023, Minerva, OlympiadBench):
  gsm8k          train 7473 / test 1319 (GSM8K; the answer is the number after '####')
  math           train = the 4500 MATH test problems that are not in MATH-500, the usual training
                 pool that does not overlap the benchmark [ours: the problem texts are matched with
                 whitespace collapsed]; test = MATH-500 itself [ours: the natural held-out set for
                 that pool, so `--dataset math` trains and evaluates without overlap]
  math500        test 500 (MATH-500)
  aime24         test 30 (AIME 2024)
  aime25         test 30 (AIME 2025, I and II)
  amc23          test 40 (AMC 2023)
  minerva        test 272 (Minerva math)
  olympiadbench  test 675 (OlympiadBench, English, text-only, open-ended math)
  tiny           the offline synthetic arithmetic world (machinery/tiny.py); tiny-* are its harder
                 worlds (tiny.WORLDS)
The benchmarks only have a test split; asking for another split is an error that lists the splits.

A .jsonl file of your own has a train and a test split too, and no test row is ever a training row
(questions are compared with whitespace collapsed). What its name says decides which rows are which:
  - a training file with a test file beside it: a name with the word "train" in it (train.jsonl,
    mine_train.jsonl, mine.train.jsonl; lower case, not inside a longer word like "training") whose
    sibling with "train" replaced by "test" exists. train = the whole training file; test = the
    sibling, minus any question also in the training file (dropped, and counted by describe()).
  - a test file: a name with the word "test" in it. Its test split is the whole file (minus the
    questions of its "train" sibling, if there is one: the same rows as above, from either name); it
    has no train split, since a file named as a test set is never trained on.
  - any other file (or a training file with no test file beside it): 1 question in HOLD_OUT is held
    out by a hash of its text, as machinery/tiny.py splits its world [ours]: test = the rows whose
    question's salted sha256 (_hash) is 0 mod HOLD_OUT (the one with the smallest hash if none is,
    so at least 1), train = the rest. A question's side depends on its own text alone, not on the
    file's order or the other rows: appending rows never moves a held-out question into training
    (except the at-least-1 fallback's, once a question that falls in the slice is added), and a
    question written twice is on one side. A file with fewer than 2 distinct questions cannot hold
    any out: an error.
train.py trains on the train split and reports its held-out accuracy on the test split; eval.py
evaluates a .jsonl benchmark on the same test split, so the two measure the same rows.
"""
import hashlib
import json
import os
import random
import re
from pathlib import Path

from machinery.grader import last_boxed

# -----------------------------------------------------------------------------
# Where each data set lives: (name, split) -> (local file under data_dir, hub id, hub config,
# hub split). The hub split is the name the hub uses, which is not always ours: AIME 2024 and
# OlympiadBench are benchmarks, but their hub copies call their only split "train".
_SOURCES = {
    ("gsm8k", "train"): ("gsm8k/train.jsonl", "openai/gsm8k", "main", "train"),
    ("gsm8k", "test"): ("gsm8k/test.jsonl", "openai/gsm8k", "main", "test"),
    ("math500", "test"): ("math500/test.jsonl", "HuggingFaceH4/MATH-500", None, "test"),
    # the full MATH test set (5000 problems); `math` train is cut from it. Not verified: that
    # DigitalLearningGmbH/MATH-lighteval's default config has a 5000-row "test" split with the
    # original fields (problem, level, type, solution); its derived copies on the hub do.
    ("math5000", "test"): ("math/test.jsonl", "DigitalLearningGmbH/MATH-lighteval", "default",
                           "test"),
    # verified: one split, "train", 30 rows, fields problem/solution/answer
    ("aime24", "test"): ("aime24/test.jsonl", "HuggingFaceH4/aime_2024", None, "train"),
    # not verified against the hub (no network where this was written): others' code loads
    # math-ai/aime25's "test" split and reads problem/answer, and its docs say 30 rows (id, problem,
    # answer), the fields of the local copy
    ("aime25", "test"): ("aime25/test.jsonl", "math-ai/aime25", None, "test"),
    # not verified: the split name ("test") and the field names of math-ai/amc23 (40 rows)
    ("amc23", "test"): ("amc23/test.jsonl", "math-ai/amc23", None, "test"),
    # verified: split "test", 272 rows, fields question/answer
    ("minerva", "test"): ("minerva_math/test.jsonl", "math-ai/minervamath", None, "test"),
    # not verified: the config name (the original release's file name for this subset) and that
    # its only split is "train"; fields question/final_answer as in the original release
    ("olympiadbench", "test"): ("olympiadbench/test.jsonl", "Hothan/OlympiadBench",
                                "OE_TO_maths_en_COMP", "train"),
}
SPLITS = {  # the splits each name has
    "gsm8k": ("train", "test"),
    "math": ("train", "test"),
    "math500": ("test",),
    "aime24": ("test",),
    "aime25": ("test",),
    "amc23": ("test",),
    "minerva": ("test",),
    "olympiadbench": ("test",),
}
NAMES = tuple(SPLITS) + ("tiny",)
# a .jsonl with no test file beside it holds out 1 question in HOLD_OUT (tiny.py's TEST_SHARE)
HOLD_OUT = 10

# Field names, most specific first, matched case-insensitively (some hub copies write "Problem").
QUESTION_FIELDS = ("question", "problem", "prompt", "input", "query")
ANSWER_FIELDS = ("answer", "final_answer", "expected_answer", "ground_truth", "gt", "target",
                 "solution")

# The Qwen2.5-Math chain-of-thought prompt: this instruction as the system message, the question as
# the user message. QwenLM/Qwen2.5-Math, evaluation/utils.py, PROMPT_TEMPLATES["qwen25-math-cot"].
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# -----------------------------------------------------------------------------
# Public API


def load_problems(name_or_path, split="train", limit=None, data_dir=None):
    """Rows {"prompt", "answer", "id"} of a named data set or a .jsonl file (see the module
    docstring).

    split: for a name, one of SPLITS[name]; for a .jsonl, "train" or "test" by the file rules above.
    limit: keep the first `limit` rows (deterministic: the source's own order, no shuffling).
    data_dir: folder with local copies laid out as NAME_FOLDER/SPLIT.jsonl (gsm8k/train.jsonl, ...);
    None means the environment variable NANOD3S_DATA_DIR, and if that is unset too, the hub.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"load_problems: limit must be None or an integer >= 0, got {limit!r}")
    name = str(name_or_path)
    kind = _kind(name, split)
    if kind == "tiny":
        # imported here: only the tiny world needs it, and it pulls in torch
        from machinery import tiny
        # a named world (tiny.WORLDS)
        return tiny.problems(split, limit, terms=tiny.world(name)["terms"])
    if kind == "file":
        rows = _file_split(name, split)[0]
    else:
        data_dir = data_dir or os.environ.get("NANOD3S_DATA_DIR") or None
        if name == "math" and split == "train":
            rows = _math_train_pool(data_dir)
        else:
            source = ("math500", "test") if name == "math" else (name, split)
            rows = _problems(*_raw_rows(source, data_dir))
    return rows if limit is None else rows[:limit]


def describe(name_or_path, split="train", data_dir=None):
    """What load_problems(name_or_path, split, data_dir=data_dir) returns, in words, for a log line.

    "gsm8k test split (data/gsm8k/test.jsonl)", "mine.jsonl: 12 of 120 rows held out by question
    hash (1 in 10, at least 1), never trained on", "mine_test.jsonl beside mine_train.jsonl (3 of
    its 40 rows also in training dropped)". A .jsonl is read (the counts come from the same code
    that splits it); a named set is never loaded. Bad input: the one-line ValueError load_problems
    raises.
    """
    name = str(name_or_path)
    kind = _kind(name, split)
    if kind == "file":
        return _file_split(name, split)[1]
    if kind == "tiny":
        from machinery import tiny
        tiny.world(name)  # an unknown world: tiny's one-line error
        return (f"{name} {split} split (1 question in {tiny.TEST_SHARE} of the world, held out by "
                f"a hash of its text)")
    if name == "math":
        return ("math train split (the MATH test problems outside MATH-500)" if split == "train"
                else "math test split (MATH-500)")
    data_dir = data_dir or os.environ.get("NANOD3S_DATA_DIR") or None
    local_file, hub_id = _SOURCES[(name, split)][:2]
    local = Path(data_dir) / local_file if data_dir else None
    return (f"{name} {split} split "
            f"({local if local is not None and local.is_file() else f'hub {hub_id}'})")


def format_prompt(tokenizer, question):
    """The text the policy continues: the chat template if the tokenizer has one, else plain text.

    With a template (Qwen2.5 and its instruct/math models): system INSTRUCTION, user question,
    then the assistant's generation prompt, as the Qwen2.5-Math evaluation does. Without one (base
    tokenizers, the tiny world's char tokenizer): exactly "Question: ...\\nAnswer:", the format the
    tiny model is trained on.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": INSTRUCTION},
                    {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {question}\nAnswer:"

# -----------------------------------------------------------------------------
# Which kind of data set an argument names, and a .jsonl file's train and test splits


def batch_at(problems, step, size, seed):
    """The prompts of a step: a fixed shuffle per epoch, so a resumed run sees the same prompts."""
    out, epoch_seen = [], None
    for pos in range(step * size, (step + 1) * size):  # the data position is step * size
        epoch, i = divmod(pos, len(problems))
        if epoch != epoch_seen:
            order, epoch_seen = list(range(len(problems))), epoch
            random.Random(seed * 1000003 + epoch).shuffle(order)
        out.append(problems[order[i]])
    return out


def _kind(name, split):
    """"tiny", "file" or "named" for a data set argument; a one-line ValueError for an unknown one
    or a bad split."""
    if name == "tiny" or (name.startswith("tiny-") and not name.endswith(".jsonl")):
        return "tiny"
    if name in SPLITS:
        if split not in SPLITS[name]:
            raise ValueError(f"load_problems: {name} has no split {split!r}; its splits: "
                             f"{', '.join(SPLITS[name])}")
        return "named"
    if name.endswith(".jsonl") or os.path.isfile(name):
        if not os.path.isfile(name):
            raise ValueError(f"load_problems: no file {name!r}; pass an existing .jsonl file "
                             f"(one JSON object per line with a question and an answer field) "
                             f"or one of the names {', '.join(NAMES)}")
        if split not in ("train", "test"):
            raise ValueError(f"load_problems: a .jsonl file has the splits train and test, "
                             f"got {split!r}")
        return "file"
    raise ValueError(f"load_problems: unknown data set {name!r}; known names: {', '.join(NAMES)}; "
                     f"or a path to a .jsonl file with a question and an answer field")


# "train" or "test" as a word of the file name: not inside a longer word ("training", "contest")
_TRAIN_WORD = re.compile(r"(?<![A-Za-z])train(?![A-Za-z])")
_TEST_WORD = re.compile(r"(?<![A-Za-z])test(?![A-Za-z])")


def _file_split(path, split):
    """(rows, what they are in words) of one split of a .jsonl file."""
    folder, base = os.path.split(path)
    if _TRAIN_WORD.search(base):
        train_path, test_path = path, os.path.join(folder, _TRAIN_WORD.sub("test", base))
    elif _TEST_WORD.search(base):
        train_path, test_path = os.path.join(folder, _TEST_WORD.sub("train", base)), path
        if split == "train":
            raise ValueError(f"load_problems: {path} is named as a test set, and a test set is "
                             f"never trained on; train on a file without 'test' in its name "
                             f"(e.g. {train_path})")
    else:
        train_path, test_path = path, None
    if test_path is not None and os.path.isfile(train_path) and os.path.isfile(test_path):
        train = _problems(_read_jsonl(train_path), train_path)
        if split == "train":
            return train, (f"{train_path}, all {len(train)} rows (the held-out rows are "
                           f"{test_path} beside it)")
        seen = {_collapse(r["prompt"]) for r in train}
        rows = _problems(_read_jsonl(test_path), test_path)
        test = [r for r in rows if _collapse(r["prompt"]) not in seen]
        if not test:
            raise ValueError(f"load_problems: every one of the {len(rows)} questions of "
                             f"{test_path} is also in {train_path}, so nothing is held out; put "
                             f"questions in {test_path} that are not in {train_path}")
        return test, (f"{test_path} beside {train_path} ({len(rows) - len(test)} of its "
                      f"{len(rows)} rows also in training dropped)")
    rows = _problems(_read_jsonl(path), path)
    if test_path == path:  # a test file with no training file beside it
        return rows, f"{path}, all {len(rows)} rows (named as a test set, never trained on)"
    held = _held_out([r["prompt"] for r in rows], path)
    test = [r for r in rows if _collapse(r["prompt"]) in held]
    why = f"; no {test_path} beside it" if test_path is not None else ""
    if split == "test":
        return test, (f"{path}: {len(test)} of {len(rows)} rows held out by question hash "
                      f"(1 in {HOLD_OUT}, at least 1{why}), never trained on")
    train = [r for r in rows if _collapse(r["prompt"]) not in held]
    return train, (f"{path}: {len(train)} of {len(rows)} rows, the other {len(test)} held out by "
                   f"question hash (1 in {HOLD_OUT}, at least 1{why})")


def _held_out(questions, where="the file"):
    """The questions (whitespace collapsed) a single .jsonl holds out: those whose sha256 is 0 mod
    HOLD_OUT, or, if none is, the one with the smallest hash, so that at least one is. A one-line
    ValueError when nothing is left to train on or to hold out (fewer than 2 distinct questions)."""
    distinct = {_collapse(q) for q in questions}
    if len(distinct) < 2:
        raise ValueError(f"load_problems: {where} has {len(distinct)} distinct question(s), "
                         f"too few to hold any out; add rows, or put held-out questions in a test "
                         f"file beside a *_train.jsonl")
    held = {q for q in distinct if _hash(q) % HOLD_OUT == 0} or {min(distinct, key=_hash)}
    if held == distinct:
        raise ValueError(f"load_problems: all {len(distinct)} questions of {where} fall in the "
                         f"held-out slice (1 in {HOLD_OUT} by question hash), leaving nothing to "
                         f"train on; add rows, or put held-out questions in a test file beside a "
                         f"*_train.jsonl")
    return held


def _hash(question):
    # [ours] salted: machinery/tiny.py picks its test questions by the unsalted sha256 % 10, so
    # without the salt a file of tiny's training questions would have none in the slice, and one of
    # its test questions all
    return int(hashlib.sha256(("held out: " + question).encode("utf-8")).hexdigest(), 16)


# -----------------------------------------------------------------------------
# Reading raw rows: a local copy first, then the hub


def _raw_rows(source, data_dir):
    """(list of raw dicts, where they came from) for one (name, split) of _SOURCES."""
    name, split = source
    local_file, hub_id, config, hub_split = _SOURCES[source]
    local = Path(data_dir) / local_file if data_dir else None
    if local is not None and local.is_file():
        return _read_jsonl(local), str(local)
    try:
        import datasets  # imported here: it takes seconds, and local copies never need it
        rows = list(datasets.load_dataset(hub_id, config, split=hub_split))
    except Exception as e:  # offline, no such repo, no such split, ...: datasets raises many kinds
        looked = (f"no local copy at {local}" if local is not None
                  else "no local copy (no --data_dir given and NANOD3S_DATA_DIR is unset)")
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"load_problems: could not load {name} split {split!r}: {looked}, "
                         f"and the hub {hub_id} failed ({type(e).__name__}: {why}); "
                         f"supply a local file with --data_dir DIR holding {local_file}, "
                         f"or pass a .jsonl path") from None
    return rows, f"{hub_id} ({hub_split})"


def _read_jsonl(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"load_problems: {path} line {i} is not JSON ({e.msg}); "
                                 f"a .jsonl file holds one JSON object per line") from None
    return rows


def _math_train_pool(data_dir):
    """The MATH test problems outside MATH-500: the usual training pool that does not overlap it."""
    bench = {_collapse(r["prompt"]) for r in _problems(*_raw_rows(("math500", "test"), data_dir))}
    return [r for r in _problems(*_raw_rows(("math5000", "test"), data_dir))
            if _collapse(r["prompt"]) not in bench]


def _collapse(text):
    return " ".join(text.split())

# -----------------------------------------------------------------------------
# Turning a raw row into {"prompt", "answer"}


def _problems(raw_rows, where):
    out = []
    for i, row in enumerate(raw_rows):
        if not isinstance(row, dict):
            raise ValueError(f"load_problems: {where} row {i} is a {type(row).__name__}, "
                             f"not a JSON object")
        q_field, question = _field(row, QUESTION_FIELDS)
        a_field, raw_answer = _field(row, ANSWER_FIELDS)
        if q_field is None or a_field is None:
            missing = "question" if q_field is None else "answer"
            wanted = QUESTION_FIELDS if q_field is None else ANSWER_FIELDS
            raise ValueError(f"load_problems: {where} row {i}: no {missing} field among its fields "
                             f"{sorted(row)}; expected one of {', '.join(wanted)}")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"load_problems: {where} row {i}: field {q_field!r} is not a "
                             f"non-empty string")
        answer = _answer(raw_answer, solution=(a_field.lower() == "solution"))
        if answer is None:
            raise ValueError(f"load_problems: {where} row {i}: no reference answer in field "
                             f"{a_field!r} (a worked solution needs a final \\boxed{{...}} "
                             f"or '#### N')")
        out.append({"prompt": question, "answer": answer, "id": i})
    return out


def _field(row, names):
    """(the row's own key, its value) for the first of names present (any case), or (None, None)."""
    by_lower = {k.lower(): k for k in row if isinstance(k, str)}
    for n in names:
        key = by_lower.get(n)
        if key is not None and row[key] is not None:
            return key, row[key]
    return None, None


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+")


def _answer(value, solution=False):
    """The reference answer as a clean string, or None if there is none.

    - a list (OlympiadBench's final_answer): its first item [ours: multi-part answers are one item
      there, e.g. "$69$,$84$"]
    - a number: AMC's 45.0 -> "45"
    - GSM8K's worked answer: the text after the last '####', thousands commas dropped ("1,080" ->
      "1080") [ours]
    - a worked solution (MATH, Minerva): the last \\boxed{...}, read by grader.last_boxed
    - then the $...$ math delimiters are dropped (OlympiadBench writes "$\\frac{1}{2}$"), keeping
      an escaped \\$ (MATH-500's "\\$18.90"), so the grader sees the bare expression.
    """
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        text = str(int(value)) if float(value).is_integer() else repr(value)
    elif isinstance(value, str):
        if "####" in value:
            text = value.rsplit("####", 1)[1].strip()
            if _THOUSANDS.fullmatch(text):
                text = text.replace(",", "")
        elif "\\boxed" in value or "\\fbox" in value:
            text = last_boxed(value)
        elif solution:
            return None  # a worked solution without a final answer we can read
        else:
            text = value
    else:
        return None
    if text is None:
        return None
    text = _UNESCAPED_DOLLAR.sub("", text).strip()
    return text or None
