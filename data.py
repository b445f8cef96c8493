"""
Data: math problems as {"prompt", "answer"} rows, and the one prompt format the whole project uses.

    load_problems("gsm8k", "train")                  # openai/gsm8k from the hub, or a local copy
    load_problems("math500", "test", data_dir="data")      # data/math500/test.jsonl, offline
    load_problems("my_problems.jsonl", limit=100)    # any .jsonl with a question and an answer field
    format_prompt(tokenizer, row["prompt"])          # the text the policy continues

Every row is {"prompt": the raw question (not templated), "answer": the reference answer, already
extracted, "id": the row's index in its source}. D3S step 2 (docs/algorithm.md) grades each rollout
against "answer" with reward.grade; step 1 samples G rollouts of format_prompt(tokenizer, prompt).

Where a named data set comes from, in this order:
  1. a local copy: {data_dir}/{folder}/{split}.jsonl, with data_dir the argument (train.py's
     --data_dir) or else the environment variable NANOD3S_DATA_DIR (gsm8k/train.jsonl, math500/test.jsonl, ...).
  2. the hub, through datasets.load_dataset (the table _SOURCES below).
If both fail, a one-line ValueError says what was tried and how to supply a local file.

The names and what they mean (the D3S paper trains on MATH and reports the seven benchmarks
below: GSM8K, MATH (as MATH-500), AIME 2024 and 2025, AMC 2023, Minerva, OlympiadBench):
  gsm8k          train 7473 / test 1319 (GSM8K; the answer is the number after '####')
  math           train = the 4500 MATH test problems that are not in MATH-500, the usual training
                 pool that does not overlap the benchmark [ours: the problem texts are matched with
                 whitespace collapsed]; test = MATH-500 itself [ours: the natural held-out set for
                 that pool, so `--data math` trains and evaluates without overlap]
  math500        test 500 (MATH-500)
  aime24         test 30 (AIME 2024)
  aime25         test 30 (AIME 2025, I and II)
  amc23          test 40 (AMC 2023)
  minerva        test 272 (Minerva math)
  olympiadbench  test 675 (OlympiadBench, English, text-only, open-ended math)
  tiny           the offline synthetic arithmetic world (tiny.py); tiny-* are its harder
                 worlds (tiny.WORLDS)
The benchmarks only have a test split; asking for another split is an error that lists the splits.
"""
import json
import os
import re
from pathlib import Path

from reward import last_boxed

# -----------------------------------------------------------------------------
# Where each data set lives: (name, split) -> (local file under data_dir, hub id, hub config, hub split)
# The hub split is the name the hub uses, which is not always ours: AIME 2024 and OlympiadBench
# are benchmarks, but their hub copies call their only split "train".
_SOURCES = {
    ("gsm8k", "train"): ("gsm8k/train.jsonl", "openai/gsm8k", "main", "train"),
    ("gsm8k", "test"): ("gsm8k/test.jsonl", "openai/gsm8k", "main", "test"),
    ("math500", "test"): ("math500/test.jsonl", "HuggingFaceH4/MATH-500", None, "test"),
    # the full MATH test set (5000 problems); `math` train is cut from it. Not verified: that
    # DigitalLearningGmbH/MATH-lighteval's default config has a 5000-row "test" split with the
    # original fields (problem, level, type, solution); its derived copies on the hub do.
    ("math5000", "test"): ("math/test.jsonl", "DigitalLearningGmbH/MATH-lighteval", "default", "test"),
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

# Field names, most specific first, matched case-insensitively (some hub copies write "Problem").
QUESTION_FIELDS = ("question", "problem", "prompt", "input", "query")
ANSWER_FIELDS = ("answer", "final_answer", "expected_answer", "ground_truth", "gt", "target", "solution")

# The Qwen2.5-Math chain-of-thought prompt: this instruction as the system message, the question as
# the user message. QwenLM/Qwen2.5-Math, evaluation/utils.py, PROMPT_TEMPLATES["qwen25-math-cot"].
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# -----------------------------------------------------------------------------
# Public API


def load_problems(name_or_path, split="train", limit=None, data_dir=None):
    """Rows {"prompt", "answer", "id"} of a named data set (see the module docstring) or a .jsonl file.

    split: for a name, one of SPLITS[name]; a .jsonl path is one split by itself and ignores it.
    limit: keep the first `limit` rows (deterministic: the source's own order, no shuffling).
    data_dir: folder with local copies laid out as NAME_FOLDER/SPLIT.jsonl (gsm8k/train.jsonl, ...);
    None means the environment variable NANOD3S_DATA_DIR, and if that is unset too, the hub.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"load_problems: limit must be None or an integer >= 0, got {limit!r}")
    name = str(name_or_path)
    if name == "tiny" or (name.startswith("tiny-") and not name.endswith(".jsonl")):
        import tiny  # imported here: only the tiny world needs it, and it pulls in torch
        return tiny.problems(split, limit, terms=tiny.world(name)["terms"])  # a named world (tiny.WORLDS)
    if name in SPLITS:
        if split not in SPLITS[name]:
            raise ValueError(f"load_problems: {name} has no split {split!r}; its splits: "
                             f"{', '.join(SPLITS[name])}")
        data_dir = data_dir or os.environ.get("NANOD3S_DATA_DIR") or None
        if name == "math" and split == "train":
            rows = _math_train_pool(data_dir)
        else:
            source = ("math500", "test") if name == "math" else (name, split)
            rows = _problems(*_raw_rows(source, data_dir))
    elif name.endswith(".jsonl") or os.path.isfile(name):
        if not os.path.isfile(name):
            raise ValueError(f"load_problems: no file {name!r}; pass an existing .jsonl file (one JSON "
                             f"object per line with a question and an answer field) or one of the "
                             f"names {', '.join(NAMES)}")
        rows = _problems(_read_jsonl(name), name)
    else:
        raise ValueError(f"load_problems: unknown data set {name!r}; known names: {', '.join(NAMES)}; "
                         f"or a path to a .jsonl file with a question and an answer field")
    return rows if limit is None else rows[:limit]


def format_prompt(tokenizer, question):
    """The text the policy continues: the chat template if the tokenizer has one, else plain text.

    With a template (Qwen2.5 and its instruct/math models): system INSTRUCTION, user question,
    then the assistant's generation prompt, as the Qwen2.5-Math evaluation does. Without one (base
    tokenizers, the tiny world's char tokenizer): exactly "Question: ...\\nAnswer:", the format the
    tiny model is trained on.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {question}\nAnswer:"

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
        raise ValueError(f"load_problems: could not load {name} split {split!r}: {looked}, and the hub "
                         f"{hub_id} failed ({type(e).__name__}: {why}); supply a local file with "
                         f"--data_dir DIR holding {local_file}, or pass a .jsonl path") from None
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
            raise ValueError(f"load_problems: {where} row {i} is a {type(row).__name__}, not a JSON object")
        q_field, question = _field(row, QUESTION_FIELDS)
        a_field, raw_answer = _field(row, ANSWER_FIELDS)
        if q_field is None or a_field is None:
            missing = "question" if q_field is None else "answer"
            wanted = QUESTION_FIELDS if q_field is None else ANSWER_FIELDS
            raise ValueError(f"load_problems: {where} row {i}: no {missing} field among its fields "
                             f"{sorted(row)}; expected one of {', '.join(wanted)}")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"load_problems: {where} row {i}: field {q_field!r} is not a non-empty string")
        answer = _answer(raw_answer, solution=(a_field.lower() == "solution"))
        if answer is None:
            raise ValueError(f"load_problems: {where} row {i}: no reference answer in field {a_field!r} "
                             f"(a worked solution needs a final \\boxed{{...}} or '#### N')")
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
    - a worked solution (MATH, Minerva): the last \\boxed{...}, read by reward.last_boxed
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
