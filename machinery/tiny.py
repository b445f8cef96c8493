"""
The offline tiny world: everything D3S needs, built in code, so that the whole method runs and
visibly learns on two CPU cores with no download. `python train.py` uses it by default.

- build_tokenizer(): a character-level tokenizer (one token per character, plus <pad> and <eos>). It
  is a `Qwen2Tokenizer` (a `PreTrainedTokenizerFast`) whose byte-level BPE has no merges, so
  `AutoTokenizer.from_pretrained` reloads it exactly, like any Qwen2.5 tokenizer.
- build_model(tokenizer): a ~0.8M-parameter Qwen2 (the architecture class of Qwen2.5), random.
- problems(split): chained arithmetic, "3+8+5+9" -> the last digit of the sum, answered as a short
  worked solution and a final `#### N` line, like GSM8K:

      Question: 3+8+5+9
      Answer: 3+8=1
      1+5=6
      6+9=5
      #### 5

  Most tokens are easy copies (the digits of the question, the previous result, the format); the
  three results decide the answer. That is the situation token-level selection is made for.
- warmup(): a short supervised warm-up on worked solutions written by a *sloppy teacher* [ours]:
  whenever a step wraps past 9 the teacher adds a spurious +1 (a forgotten carry) with
  probability WARMUP_NOISE. The warmed-up model inherits the mistake: it is right 21.6% of the time
  greedily on the held-out questions and 24.8% sampled at T=1 (the table below), so RL has right and
  wrong answers in most groups, and the held-out greedy accuracy has room to climb.
  The deciding tokens are exactly the high-entropy ones, which is what D3S's |A|*H score looks for.
- pretrained(path): the warmed-up model as an ordinary HF folder (save_pretrained), built once and
  reused by later runs; rebuilt when missing.

The worlds (WORLDS, by name: `--model tiny-long` trains that world's warmed-up model on its own
questions). The default, "tiny", is the one above. The harder ones [ours] are where D3S's mechanism
should matter more:
  tiny-long  8 terms: 7 worked steps, a 50-token solution instead of 26, so token selection has more
             to choose from. The teacher forgets the carry 40% of the time, not 60%: over 7 steps a
             60% teacher leaves a greedy model right 0.7% of the time (measured), nothing to climb
             from.
  tiny-weak  most groups all wrong, and RL still learns: the default world's questions and warm-up,
             but the teacher forgets the carry 90% of the time. The model learns to add (0.95 on the
             right digit of a step that does not wrap) and applies the carry rarely (0.07 on the
             right digit of a wrapping step, 0.83 on the forgotten carry). Greedy, it is right on
             the 6.4% of questions with no wrapping step and on almost nothing else; sampled, on a
             question with one wrapping step about 1 time in 10, so 62% of a GRPO step's groups are
             all wrong. A right answer is a carry the model made, which RL can reinforce: GRPO at
             its tuned lr 1e-4, K = 2 takes the held-out accuracy from 7.0% to 43.2% in 100 steps
             (seeds 0-2, whole test split), and about half of each batch's groups still have all
             rewards equal at the end (0.58 over the first 10 steps, 0.49 over the last 50);
             experiments/study.md, section F.
  tiny-fork  a real model's forks (the 80/20 paper's: about 20% of a reasoning model's tokens are
             sampled above H = 0.672 nats, the rest near-certain; tiny's model has 7.6%): the
             default world's questions, but the teacher adds the terms in a random order and writes
             either operand of a step first (forks that never change the answer), and forgets the
             carry half the time (forks that do: a 50/50 digit is 0.69 nats). 300 warm-up steps
             (64 s on one thread). 23.7% of its sampled tokens are forks, mean H 0.302, close to a
             real 0.5B instruct model on GSM8K (17.1%, 0.281, measured 4 x 4, 256 tokens), so the
             token level has real choices to rank, of both kinds.
Their starting points, measured by `python experiments/world_figures.py --world NAME` at commit
3e1f34b (2026-12-01; another CPU builds other weights: at commit d39fb00, on an AMD EPYC with AVX2
kernels, tiny measured greedy 20.3%, sampled 24.8%, 28.5% all-wrong, p(wrap) 0.26) and again, with
tiny-fork and the entropy columns, at commit 1e4b66e (2026-12-02, the same figures for the first
three) (seed 0, 1 CPU thread; greedy on the whole test split; sampled at T = 1, 8 answers to each
of the first 256 training questions, the groups of a GRPO step; p(plain), p(wrap): teacher-forced
on the clean test solutions, in the question's order, the mean probability of the right result
digit on steps that do not and that do wrap past 9; forks: of those groups' completion tokens, the
share sampled above H = 0.672 nats; top 20%: the share of all their entropy the top 20% hold):

  world      terms  warm-up  noise  greedy (test)   sampled  all-wrong  mixed  all-right
  tiny       4      200      0.6    21.6% of 1036   24.8%    26.2%      73.0%  0.8%
  tiny-long  8      200      0.4    19.8% of 1024   11.6%    47.7%      52.3%  0.0%
  tiny-weak  4      200      0.9     7.0% of 1036   11.8%    62.5%      34.8%  2.7%
  tiny-fork  4      300      0.5    28.4% of 1036   21.0%    21.1%      78.5%  0.4%

  world      p(plain)  p(wrap)  solution  budget  forks  mean H  median H  top 20%
  tiny       0.83      0.28     26        32       7.6%  0.126   0.019     88%
  tiny-long  0.95      0.51     50        64       7.5%  0.109   0.017     88%
  tiny-weak  0.95      0.07     26        32       2.7%  0.070   0.016     82%
  tiny-fork  0.97      0.46     26        32      23.7%  0.302   0.015     79%

(solution: tokens of a worked solution with its <eos>, 6 * terms + 2; budget: train.py's
max_new_tokens for the world, pick(tiny=32, tiny_long=64), with room for a longer wrong answer.)
Also tried: 8 terms with noise 0.5 (greedy 6.4%, 59% all-wrong groups) and with 400 warm-up steps
at 0.4 (greedy 43.5%, sampled 17.7%, 30% all-wrong); the default world at noise 0.8 (greedy 9.8%,
sampled 17.6%) and at 0.85 (greedy 7.8%, sampled 14.1%, 53% all-wrong; GRPO 7.8% -> 68.2% in 100
steps, one seed, its zero-variance share down from 0.62 at step 0 to 0.42 over the first 10 steps:
it leaves the regime fast), or with 60 warm-up steps (greedy 10.1%, sampled 9.6%), or 100 (the old
tiny-weak: greedy 10.0%, sampled 10.2%, 44.1% all-wrong, p(plain) 0.12).

Chains longer than 4 terms have too many questions to list (10**8 for 8 terms): a world of more than
QUESTIONS = 10**4 questions uses a fixed sample of that many (questions()), split by the same hash
rule, about 1000 of them held out; 4 terms list all 10**4, exactly as before.

Train and test never share a question: a question's split is a hash of its text.
"""
import functools
import hashlib
import json
import os
import random
import string
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD, EOS = "<pad>", "<eos>"
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
NUM_TERMS = 4          # digits per question: 4 digits -> 3 worked steps
TEST_SHARE = 10        # 1 question in TEST_SHARE is held out (by hash), never trained on
QUESTIONS = 10 ** 4    # questions per world (train + test): all of them for 4 terms, a fixed
                       # sample for longer chains
WARMUP_NOISE = 0.6     # [ours] chance that the teacher forgets the carry on a wrapping step
WARMUP_STEPS = 200     # supervised steps (batch WARMUP_BATCH); 103 s on 2 CPU cores (2026-12-01)
WARMUP_BATCH = 64
WARMUP_LR = 1e-3
VERSION = 3            # of the warmed-up folder: pretrained() rebuilds a folder made by another
                       # version (3: the warm-up on one thread; a folder of version 2 may have been
                       # built on more)

# The worlds, by name: `--model NAME` trains NAME's warmed-up model on NAME's questions. "tiny" is
# the default world, built from the constants above; harder ones vary the chain length and the
# warm-up (their starting points are in the docstring). A world's completion budget is train.py's
# max_new_tokens, on that knob's line (one source for each value).
WORLDS = {
    "tiny": dict(terms=NUM_TERMS, warmup_steps=WARMUP_STEPS, noise=WARMUP_NOISE),
    "tiny-long": dict(terms=8, warmup_steps=WARMUP_STEPS, noise=0.4),   # 7 steps, 50 tokens
    "tiny-weak": dict(terms=NUM_TERMS, warmup_steps=WARMUP_STEPS, noise=0.9),
    # shuffle: the teacher adds the terms in any order, either operand first (solve)
    "tiny-fork": dict(terms=NUM_TERMS, warmup_steps=300, noise=0.5, shuffle=True),
}


# -----------------------------------------------------------------------------
# tokenizer and model

def build_tokenizer():
    """One token per character; decode(encode(s)) == s for any string made of CHARS.

    Why a Qwen2Tokenizer and not a bare tokenizers pipeline: transformers 5's AutoTokenizer picks
    the tokenizer class from the model's config (qwen2), so a custom pipeline saved next to a Qwen2
    model would be reloaded as a Qwen2Tokenizer anyway, and silently drop spaces and newlines. A
    byte-level BPE whose vocabulary is our characters and whose merge list is empty is one token per
    character, and survives save_pretrained / AutoTokenizer.from_pretrained unchanged.
    """
    byte_char = bytes_to_unicode()  # byte -> the printable character byte-level BPE uses for it
    vocab = {PAD: 0, EOS: 1}
    for c in CHARS:
        vocab[byte_char[ord(c)]] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=[], pad_token=PAD, eos_token=EOS, unk_token=None,
                          bos_token=None)


def build_model(tokenizer, seed=0, hidden_size=128, num_layers=4):
    """A random tiny Qwen2: the same code path as Qwen2.5 in transformers, just small."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=3 * hidden_size,
        max_position_embeddings=256, tie_word_embeddings=True,
        # [ours] Qwen2's default init (std 0.02) leaves a model this small on a loss plateau for
        # hundreds of steps (900 in our try: it never learned to look back at the question); with
        # std 0.1 the loss on clean solutions fell below 0.01 within 200 steps.
        initializer_range=0.1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# -----------------------------------------------------------------------------
# the task

def solve(digits, rng=None, noise=0.0, shuffle=False):
    """Worked solution of digits[0]+digits[1]+... (mod 10). With noise > 0 and an rng, a wrapping
    step gets a forgotten carry (+1) with that probability: the sloppy teacher of the warm-up. With
    shuffle and an rng [ours], the teacher adds the terms in a random order and writes either
    operand of a step first: choices that never change the answer (tiny-fork's harmless forks)."""
    if shuffle:
        digits = rng.sample(digits, len(digits))
    acc, lines = digits[0], []
    for d in digits[1:]:
        s = (acc + d) % 10
        if noise > 0 and acc + d >= 10 and rng.random() < noise:
            s = (s + 1) % 10
        a, b = (d, acc) if shuffle and rng.random() < 0.5 else (acc, d)
        lines.append(f"{a}+{b}={s}")
        acc = s
    return " " + "\n".join(lines) + f"\n#### {acc}"


def _is_test(question):
    return int(hashlib.sha256(question.encode()).hexdigest(), 16) % TEST_SHARE == 0


def world(name):
    """The settings of a named world (WORLDS), or a one-line ValueError that lists the names."""
    if name not in WORLDS:
        raise ValueError(f"unknown tiny world {name!r}; the worlds are {', '.join(WORLDS)}")
    return WORLDS[name]


def world_of(model):
    """The world name of a model argument: a name in WORLDS, or a folder pretrained() wrote; else
    None."""
    if model in WORLDS:
        return model
    marker = os.path.join(str(model), "tiny.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            # folders of before the named worlds are "tiny"
            return json.load(f).get("world", "tiny")
    return None


def questions(terms=NUM_TERMS):
    """The digit lists of a world's questions, before the train/test split: all 10**terms of them
    when that is at most QUESTIONS (4 terms: every question, in counting order), else [ours] a fixed
    sample of QUESTIONS distinct ones, drawn with a random.Random(terms), so every split, seed and
    run sees the same questions (10**8 of them could not be listed; 10**4 keep the test split near
    1000)."""
    if 10 ** terms <= QUESTIONS:
        numbers = range(10 ** terms)
    else:
        numbers = sorted(random.Random(terms).sample(range(10 ** terms), QUESTIONS))
    return [[int(c) for c in str(n).zfill(terms)] for n in numbers]


def problems(split="train", limit=None, seed=0, terms=NUM_TERMS):
    """All questions of a split as {"prompt", "answer"} rows, shuffled by `seed` (deterministic)."""
    if split not in ("train", "test"):
        raise ValueError(f"tiny has splits train and test, got split={split!r}")
    rows = [{"prompt": q, "answer": a} for q, a in _split(terms)[split == "test"]]
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit is not None else rows


@functools.lru_cache(maxsize=None)
def _split(terms):
    """(train, test) (question, answer) pairs of a world in counting order, computed once per
    process (hashing 10**4 questions is most of what a tiny run spends loading its data)."""
    pairs = [("+".join(map(str, d)), str(sum(d) % 10)) for d in questions(terms)]
    return [p for p in pairs if not _is_test(p[0])], [p for p in pairs if _is_test(p[0])]


# -----------------------------------------------------------------------------
# warm-up

def warmup(seed=0, steps=WARMUP_STEPS, batch_size=WARMUP_BATCH, lr=WARMUP_LR, noise=WARMUP_NOISE,
           terms=NUM_TERMS, shuffle=False, log=print):
    """Supervised warm-up from scratch on the sloppy teacher's solutions. Returns (model,
    tokenizer). [ours] One CPU thread, whatever the machine: a float sum's order depends on the
    thread count, and over 200 steps that moved weights by up to 0.018 (1 thread against 2). The
    CPU's own kernels still choose their order (AVX2 or AVX-512 code paths), so another kind of CPU
    may build other weights and other starting figures (the docstring's table says by how much)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _warmup(seed, steps, batch_size, lr, noise, terms, shuffle, log)
    finally:
        torch.set_num_threads(threads)


def _warmup(seed, steps, batch_size, lr, noise, terms, shuffle, log):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed)
    train = problems("train", seed=seed, terms=terms)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0 = time.time()
    for step in range(steps):
        batch = [train[(step * batch_size + i) % len(train)] for i in range(batch_size)]
        # = data.format_prompt without a chat template
        prompts = [f"Question: {r['prompt']}\nAnswer:" for r in batch]
        targets = [solve([int(c) for c in r["prompt"].split("+")], rng, noise, shuffle) + EOS
                   for r in batch]
        enc = tokenizer([p + t for p, t in zip(prompts, targets)], return_tensors="pt",
                        padding=True, padding_side="right")
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        for i, p in enumerate(prompts):
            labels[i, :len(p)] = -100  # one token per character: the prompt is len(p) tokens
        loss = model(**enc, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"warm-up step {step:4d} | loss {loss.item():.3f} | {time.time() - t0:.0f}s")
    model.eval()
    return model, tokenizer


def pretrained(path="out/tiny", seed=0, log=print, name="tiny"):
    """The warmed-up model of world `name` as an HF folder at `path`: built (and saved) once, then
    reused."""
    spec = world(name)
    want = {"version": VERSION, "world": name, "seed": seed, "terms": spec["terms"],
            "steps": spec["warmup_steps"], "noise": spec["noise"],
            "shuffle": spec.get("shuffle", False)}
    marker = os.path.join(path, "tiny.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            # older folders: the default world, its teacher's fixed order
            have = {"world": "tiny", "terms": NUM_TERMS, "shuffle": False, **json.load(f)}
        if all(have.get(k) == v for k, v in want.items() if k != "seed"):
            return path
    log(f"building the {name} world's warmed-up model in {path} (once: a minute or two on a CPU)")
    model, tokenizer = warmup(seed=seed, steps=spec["warmup_steps"], noise=spec["noise"],
                              terms=spec["terms"], shuffle=want["shuffle"], log=log)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(marker, "w") as f:  # written last: marks the folder complete
        json.dump(want, f)
    return path
