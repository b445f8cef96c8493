"""plots.py. The selection page on hand-made steps: it marks exactly what d3s.select_samples and
d3s.select_tokens kept, escapes every token, says what grpo keeps and why a zero-variance group has
kept rollouts, rebuilds from its JSON, and renders in a real headless browser, where a dropped
rollout, an untrained token and a trained one look different, and every fork (a token sampled above
0.672 nats) carries its own mark, trained or not. curves.png's curves (a gap where a step made no
update, each token share named by its denominator, the seconds above) and the comparison of runs
(labels, curves against step, tokens and seconds, the command and its one-line refusals)."""
import dataclasses
import html
import html.parser
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

import d3s
from machinery import plots
from machinery import tiny
from conftest import ROOT
from rollout import Rollouts

G = 4
# Four groups of four completions, in the tiny world's format; <eos> (id 1) ends a completion, and
# the last one of group 3 is cut off without it.
TEXTS = [
    " 1+2=3\n#### 3", " 1+2=4\n#### 4", " 1+2=5\n#### 5", " 1+2=3\n#### 3",   # mixed
    " 9+9=8\n#### 8", " 9+9=8\n#### 8", " 9+9=8\n#### 8", " 9+9=8\n#### 8",   # all right
    " 5+6=2\n#### 2", " 5+6=0\n#### 0", " 5+6=9\n#### 9", " 5+6=2\n#### 2",   # all wrong
    " 2+2=4\n#### 4", " 2+2=5\n#### 5", " 2+2=6\n#### 6",
    " 2+2=7\n#### 7 and more",  # mixed, the last cut
]
REWARDS = [1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0]
QUESTIONS, ANSWERS = ["1+2", "9+9", "5+6", "2+2"], ["3", "8", "1", "4"]


def make_rollouts(tokenizer, texts, cut=()):
    """A Rollouts by hand: each text encoded, <eos> appended unless its row is in `cut`, padded."""
    eos, pad = tokenizer.convert_tokens_to_ids(tiny.EOS), tokenizer.convert_tokens_to_ids(tiny.PAD)
    rows = [tokenizer.encode(t) + ([] if i in cut else [eos]) for i, t in enumerate(texts)]
    B, T = len(rows), max(map(len, rows))
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), True
    zeros = torch.zeros(B, 1, dtype=torch.long)
    # (B, T), 0 on padding
    entropy = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) * 2 * mask
    return Rollouts(zeros, zeros, ids, mask, torch.tensor([i in cut for i in range(B)]),
                    torch.arange(B) // G, list(texts), entropy)


def stats_of(rollouts, rewards, adv, idx, token_mask, method, rho_s, rho_t, **extra):
    """The fields of train.py's log row that the page shows, computed as train.py does."""
    pop_var = lambda a: a.var(unbiased=False).item()  # noqa: E731
    return dict(step=7, method=method, sample_mode=d3s.METHODS[method]["sample"],
                token_mode=d3s.METHODS[method]["token"], rho_s=rho_s, rho_t=rho_t, kept=len(idx),
                rollouts=len(rewards), tokens=int(token_mask.sum()),
                valid=int(rollouts.completion_mask[idx].sum()),
                valid_all=int(rollouts.completion_mask.sum()), var_adv=pop_var(adv),
                var_kept=pop_var(adv[idx]),
                zero_var=(rewards.view(-1, G).std(dim=1) == 0).float().mean().item(),
                reward=rewards.mean().item(), **extra)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def d3s_step(tokenizer):
    """A D3S step by hand, selected by the real d3s functions: (rollouts, rewards, adv, idx,
    token_mask, scores, record)."""
    rollouts = make_rollouts(tokenizer, TEXTS, cut={15})
    rewards = torch.tensor(REWARDS, dtype=torch.float)
    adv = d3s.group_advantages(rewards, G)
    idx, adv_kept = d3s.select_samples(rewards, adv, G, 0.375, "cross")  # 6 of 16
    valid = rollouts.completion_mask[idx]  # (N, T)
    scores = d3s.token_scores(adv_kept, rollouts.entropy[idx], "adv_entropy")
    token_mask = d3s.select_tokens(scores, valid, 0.3)
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "d3s", 0.375, 0.3)
    record = plots.selection_record(tokenizer, rollouts, QUESTIONS, ANSWERS, rewards, adv, idx,
                                    token_mask, scores, stats)
    return rollouts, rewards, adv, idx, token_mask, scores, record


class Page(html.parser.HTMLParser):
    """What a reader sees in each rollout row: rows[row] = {"class", "spans": [(classes, title,
    text)]}, one span per token (a <u> element), with its classes, its title (the score on hover)
    and its text."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.rows, self.row, self.span, self.tags = {}, None, None, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "tr" and "data-row" in a:
            self.row = self.rows.setdefault(int(a["data-row"]), {"class": a["class"], "spans": []})
        elif tag == "u" and self.row is not None:
            self.span = [set((a.get("class") or "").split()), a.get("title"), ""]
        elif tag == "br" and self.span is not None:
            self.span[2] += "<br>"

    def handle_endtag(self, tag):
        if tag == "u" and self.span is not None:
            self.row["spans"].append(tuple(self.span))
            self.span = None
        elif tag == "tr":
            self.row = None

    def handle_data(self, data):
        if self.span is not None:
            self.span[2] += data


def mark(classes):
    """A token's classes -> ("k" trained | "d" not trained | None in a dropped rollout, its shade
    0-7 or None); a fork's f (is_fork) left aside."""
    c = [x.removesuffix("f") for x in classes if x != "sp" and x != "f"]
    return (c[0][0], int(c[0][1:]) if c[0][1:] else None) if c else (None, None)


def is_fork(classes):
    """Is the token marked as a fork (its class ends in f: k5f, d0f, kf, or f in a dropped
    rollout)?"""
    return any(x.endswith("f") for x in classes if x != "sp")


def shown(text):
    """A token's text as the page shows it: whitespace made visible, a newline also a line break."""
    return text.replace(" ", "·").replace("\n", "↵<br>")


def test_record_keeps_exactly_what_d3s_selected(tokenizer, d3s_step):
    rollouts, rewards, adv, idx, token_mask, scores, record = d3s_step
    assert [(g["prompt"], g["kind"]) for g in record["groups"]] == [
        (0, "mixed"), (3, "mixed"), (1, "all right"), (2, "all wrong")]
    kept_at = {row: n for n, row in enumerate(idx.tolist())}
    assert sum(r["kept"] for g in record["groups"] for r in g["rollouts"]) == len(idx) == 6
    for g in record["groups"]:
        assert g["question"] == QUESTIONS[g["prompt"]] and g["answer"] == ANSWERS[g["prompt"]]
        for j, r in enumerate(g["rollouts"]):
            b = g["prompt"] * G + j
            n = int(rollouts.completion_mask[b].sum())  # valid tokens: no padding in the record
            assert (r["row"] == b and r["reward"] == REWARDS[b]
                    and r["adv"] == pytest.approx(adv[b].item(), abs=1e-4))
            assert r["tokens"] == [tokenizer.decode([i])
                                   for i in rollouts.completion_ids[b, :n].tolist()]
            assert "".join(r["tokens"]) == TEXTS[b] + ("" if b == 15 else tiny.EOS)
            assert r["kept"] == (b in kept_at) and r["truncated"] == (b == 15)
            if b in kept_at:
                assert r["trained"] == token_mask[kept_at[b], :n].int().tolist()
                assert r["scores"] == pytest.approx(scores[kept_at[b], :n].tolist(), rel=1e-2)
            else:
                assert r["trained"] is None and r["scores"] is None
            # kept or dropped: a fork is a token sampled above the 80/20 paper's 0.672 nats
            assert r["forks"] == [int(h > 0.672) for h in rollouts.entropy[b, :n].tolist()]
    assert record["score_cut"] == pytest.approx(scores[token_mask].min().item(), rel=1e-2)
    assert record["specials"] == [tiny.EOS]
    # the step's forks, by brute force over every valid token of every rollout (not only those
    # shown), and those of them token selection trained
    valid = rollouts.completion_mask
    forks = [(b, t) for b in range(16) for t in range(valid.shape[1])
             if valid[b, t] and rollouts.entropy[b, t] > 0.672]
    trained = [(b, t) for b, t in forks if b in kept_at and token_mask[kept_at[b], t]]
    assert plots.FORK_ENTROPY == 0.672 and 0 < len(trained) < len(forks)
    assert record["forks"] == {"threshold": 0.672, "tokens": int(valid.sum()),
                               "count": len(forks), "trained": len(trained)}
    assert json.loads(json.dumps(record)) == record  # plain JSON


def test_page_marks_exactly_the_kept_rollouts_and_tokens(d3s_step):
    rollouts, rewards, adv, idx, token_mask, scores, record = d3s_step
    page = Page(plots.selection_html(record))
    kept_at = {row: n for n, row in enumerate(idx.tolist())}
    assert sorted(page.rows) == list(range(16))
    for b, row in page.rows.items():
        n = int(rollouts.completion_mask[b].sum())
        assert len(row["spans"]) == n  # one span per token
        text = "".join(shown(t) for t in TEXTS[b]) + ("" if b == 15 else tiny.EOS)
        assert "".join(s[2] for s in row["spans"]) == text  # every token shown, in order
        if b in kept_at:
            assert row["class"] == "kept"
            assert ([int(mark(s[0])[0] == "k") for s in row["spans"]]
                    == token_mask[kept_at[b], :n].int().tolist())
            assert all(mark(s[0])[0] in "kd" and mark(s[0])[1] is not None
                       for s in row["spans"])  # each shaded
            assert all(s[1] is not None for s in row["spans"])  # each score on hover
        else:
            assert row["class"] == "dropped" and all(s[0] <= {"sp", "f"} and s[1] is None
                                                     for s in row["spans"])
        # every fork marked, kept or dropped, and nothing else
        assert ([is_fork(s[0]) for s in row["spans"]]
                == [h > plots.FORK_ENTROPY for h in rollouts.entropy[b, :n].tolist()])
    marks = [mark(s[0]) for row in page.rows.values() for s in row["spans"]]
    assert sum(m == "k" for m, _ in marks) == int(token_mask.sum())  # all kept rollouts are here
    # the shades rank the scores: no token left out is darker than a trained one
    assert max(b for m, b in marks if m == "d") <= min(b for m, b in marks if m == "k")
    top = plots.selection_html(record)
    # trained / valid
    tokens = f"<b>{int(token_mask.sum())} / {int(rollouts.completion_mask[idx].sum())}</b>"
    assert "<b>6 / 16</b>" in top and tokens in top
    forks = record["forks"]  # the header: the step's forking share, the forks trained
    share = f"<b>{100 * forks['count'] / forks['tokens']:.1f}%</b>"
    assert share in top and f"H &gt; 0.672 nats · {forks['trained']} of {forks['count']} trained" \
        in top


def test_every_token_is_escaped_and_visible(tokenizer):
    tok = tiny.build_tokenizer()
    tok.add_tokens(["<script>", "a & b"])
    tok.add_special_tokens({"extra_special_tokens": ["<|im_end|>"]})
    texts = ["x<script>alert(1)</s>\n\ny", "a & b<z &amp;", "1<|im_end|>", "  \n"]
    rollouts = make_rollouts(tok, texts)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = d3s.group_advantages(rewards, G)
    idx = torch.arange(4)
    token_mask = rollouts.completion_mask
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "grpo", 1.0, 1.0)
    record = plots.selection_record(tok, rollouts, ["is 2<3 & <b>bold</b>?"], ["<i>"], rewards, adv,
                                    idx, token_mask, None, stats)
    # one token, decoded as is
    assert record["groups"][0]["rollouts"][0]["tokens"][:2] == ["x", "<script>"]
    assert record["specials"] == ["<eos>", "<|im_end|>"]
    text = plots.selection_html(record)
    page = Page(text)
    assert "script" not in page.tags  # no token, question or answer became a tag
    assert "<script>" not in text and "<b>bold" not in text
    assert "&lt;script&gt;" in text and "is 2&lt;3 &amp; &lt;b&gt;bold&lt;/b&gt;?" in text
    assert "<code>&lt;i&gt;</code>" in text
    spans = [s for s in page.rows[0]["spans"]]
    assert (spans[1][2] == "<script>" and spans[-4][2] == spans[-3][2] == "↵<br>"
            and spans[-2][2] == "y")
    assert page.rows[1]["spans"][0][2] == "a·&·b"
    assert "".join(s[2] for s in page.rows[1]["spans"][1:-1]) == "<z·&amp;"
    im_end = page.rows[2]["spans"][1]
    assert im_end[2] == "<|im_end|>" and "sp" in im_end[0]  # shown as text, in the special style
    assert [s[2] for s in page.rows[3]["spans"][:3]] == ["·", "·", "↵<br>"]
    assert "&lt;|im_end|&gt;" in text
    # characters the tiny tokenizer cannot spell: a tab, a no-break space, a control character,
    # nothing
    assert (plots._visible("\t\u00a0\x07") == "<i>→\\xa0\\x07</i>"
            and plots._visible("") == "<i>∅</i>")
    assert plots._visible("a  b\n") == "a<i>··</i>b<i>↵</i><br>"


def test_every_tag_in_the_escaped_page_is_ours(tokenizer):
    """Whatever the tokens say, the only tags in the page are the ones plots.py writes."""
    tok = tiny.build_tokenizer()
    tok.add_tokens(["<script>", "<img src=x onerror=alert(1)>", "</table>"])
    rollouts = make_rollouts(tok, ["<script>", "<img src=x onerror=alert(1)>", "</table>", "\"'"])
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = d3s.group_advantages(rewards, G)
    idx = torch.tensor([0, 1])
    valid = rollouts.completion_mask[idx]
    scores = d3s.token_scores(adv[idx], rollouts.entropy[idx], "adv_entropy")
    token_mask = d3s.select_tokens(scores, valid, 0.5)
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "d3s", 0.5, 0.5)
    text = plots.selection_html(plots.selection_record(tok, rollouts, ["q"], ["a"], rewards, adv,
                                                       idx, token_mask, scores, stats))
    page = Page(text)
    assert set(page.tags) <= {"html", "head", "meta", "title", "style", "body", "h1", "small",
                              "div", "b", "p", "span", "u", "i", "br", "h2", "code", "table", "tr",
                              "th", "td", "details", "summary"}
    assert len(page.rows) == 4 and [len(r["spans"]) for r in page.rows.values()] == [2, 2, 2, 3]


def test_grpo_keeps_everything_and_says_so(tokenizer):
    """grpo: every rollout kept, every token trained, nothing scored; a step without a mixed
    group."""
    rollouts = make_rollouts(tokenizer, TEXTS[4:12])  # an all-right and an all-wrong group
    rewards = torch.tensor(REWARDS[4:12], dtype=torch.float)
    adv = d3s.group_advantages(rewards, G)
    idx, _ = d3s.select_samples(rewards, adv, G, 1.0, "none")
    token_mask = rollouts.completion_mask  # token mode none: the valid tokens
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "grpo", 1.0, 1.0)
    record = plots.selection_record(tokenizer, rollouts, QUESTIONS[1:3], ANSWERS[1:3], rewards, adv,
                                    idx, token_mask, None, stats)
    assert ([g["kind"] for g in record["groups"]] == ["all right", "all wrong"]
            and record["score"] is None)
    text = plots.selection_html(record)
    assert "keeps every rollout and trains every token" in text and 'class="all"' in text
    page = Page(text)
    assert len(page.rows) == 8 and all(r["class"] == "kept" for r in page.rows.values())
    # all trained, unshaded
    assert all(mark(s[0]) == ("k", None) for r in page.rows.values() for s in r["spans"])
    assert "dropped" not in [r["class"] for r in page.rows.values()]


def test_no_entropy_recorded_no_fork_marks(tokenizer, d3s_step):
    """A step sampled without its entropy, and a record written before forks were: the page
    shows no fork, names none in its legend, and gives no forking share."""
    rollouts, rewards, adv, idx, token_mask, scores, record = d3s_step
    bare = dataclasses.replace(rollouts, entropy=None)
    without = plots.selection_record(tokenizer, bare, QUESTIONS, ANSWERS, rewards, adv, idx,
                                     token_mask, scores, record["stats"])
    assert without["forks"] is None
    assert all(r["forks"] is None for g in without["groups"] for r in g["rollouts"])
    older = {k: v for k, v in record.items() if k != "forks"}
    older["groups"] = [dict(g, rollouts=[{k: v for k, v in r.items() if k != "forks"}
                                         for r in g["rollouts"]]) for g in record["groups"]]
    for rec in (without, older):
        text = plots.selection_html(rec)
        assert "forking" not in text and "fork" not in " ".join(legend_keys(text))
        assert not any(is_fork(s[0]) for row in Page(text).rows.values() for s in row["spans"])
    assert "forking tokens" in plots.selection_html(record)


def test_skipped_step_says_why(tokenizer, d3s_step):
    record = dict(d3s_step[-1], stats=dict(d3s_step[-1]["stats"],
                                           skipped_reason="no kept token has A != 0"))
    text = plots.selection_html(record)
    assert text.count("made no update") == 1 and "no kept token has A != 0" in text


def test_pick_groups_rule():
    mixed, right, wrong = [1, 0], [1, 1], [0, 0]
    assert plots.pick_groups([wrong, mixed, right, mixed, mixed, wrong], 4) == [
        (1, "mixed"), (3, "mixed"), (2, "all right"), (0, "all wrong")]
    assert plots.pick_groups([mixed, mixed, mixed, mixed, mixed], 4) == [(i, "mixed")
                                                                         for i in range(4)]
    assert plots.pick_groups([wrong, wrong, right], 4) == [(2, "all right"), (0, "all wrong"),
                                                           (1, "all wrong")]
    assert plots.pick_groups([wrong, mixed, right], 1) == [(1, "mixed")]


def test_every_mode_has_d3s_words_on_the_page(d3s_step):
    """The page describes each mode in d3s.py's own words, so no mode can show as "?"."""
    for level, modes in (("sample", d3s.SAMPLE_MODES), ("token", d3s.TOKEN_MODES)):
        for mode, words in modes.items():
            page = plots.selection_html(dict(d3s_step[-1], **{f"{level}_mode": mode}))
            rule = html.unescape(page.split('<p class="rule">')[1].split("</p>")[0])
            assert words.split(",")[0].replace("rho_", "ρ").replace("|A| * H", "|A|·H")[1:] \
                in rule, (level, mode, rule)
            assert "?" not in rule
    # the shading's name, from the same words
    assert plots.score_name("adv_entropy") == "|A|·H" and plots.score_name("entropy") == "entropy H"


def test_a_mode_added_to_d3s_is_described_by_its_own_words(tokenizer, d3s_step, monkeypatch):
    """A token mode added to d3s.py (here: the top |A|, every token of a rollout scored alike) shows
    its words from there, its score named by them and shaded, never "nothing is scored"; one whose
    step has no scores says that nothing is."""
    monkeypatch.setitem(d3s.TOKEN_MODES, "abs_adv",
                        "the share rho_t with the highest |A|, pooled over the step")
    rollouts, rewards, adv, idx, _, _, record = d3s_step
    valid = rollouts.completion_mask[idx]
    scores = adv[idx].abs()[:, None].expand(valid.shape).clone()  # (N, T) |A| at every token
    token_mask = d3s.select_tokens(scores, valid, 0.3)
    stats = dict(record["stats"], token_mode="abs_adv", tokens=int(token_mask.sum()))
    new = plots.selection_record(tokenizer, rollouts, QUESTIONS, ANSWERS, rewards, adv, idx,
                                 token_mask, scores, stats)
    assert new["token_mode"] == "abs_adv" and new["score"] == "|A|"
    page = html.unescape(plots.selection_html(new))
    rule = page.split('<p class="rule">')[1].split("</p>")[0]
    assert "The share ρt with the highest |A|, pooled over the step." in rule, rule
    assert "nothing is scored" not in page and "score |A|: low" in page
    assert all(mark(s[0])[1] is not None for row in Page(plots.selection_html(new)).rows.values()
               if row["class"] == "kept" for s in row["spans"])  # every kept token shaded
    monkeypatch.setitem(d3s.TOKEN_MODES, "new_mode", "the tokens a new rule keeps")
    unscored = dict(record, token_mode="new_mode", score=None)
    rule = plots.selection_html(unscored).split('<p class="rule">')[1].split("</p>")[0]
    assert "The tokens a new rule keeps: nothing is scored or shaded." in rule, rule


def test_write_selection_and_rebuild_from_the_run_folder(tmp_path, d3s_step, capsys):
    record = d3s_step[-1]
    run = tmp_path / "run"
    run.mkdir()
    row = dict(record["stats"], entropy=0.5, grad_norm=1.0, clip_frac=0.0, truncated=0.1, t_gen=0.5,
               t_upd=0.25)
    (run / "log.jsonl").write_text("".join(json.dumps(dict(row, step=s)) + "\n" for s in range(8)))
    plots.write_selection(str(run), dict(record, step=3))
    top = plots.write_selection(str(run), record)
    assert top == str(run / "selection.html")
    names = sorted(os.listdir(run / "selection"))
    assert names == ["step_000003.html", "step_000003.json", "step_000007.html", "step_000007.json"]
    assert json.loads((run / "selection" / "step_000007.json").read_text()) == record
    pages = {p: (run / p).read_bytes() for p in ["selection.html", "selection/step_000003.html",
                                                  "selection/step_000007.html"]}
    assert (b'href="selection/step_000003.html"' in pages["selection.html"]
            and b"Step 7:" in pages["selection.html"])
    assert (b"steps: <a " in pages["selection.html"]
            and b" \xc2\xb7 <b>7</b></nav>" in pages["selection.html"])
    assert b'href="../selection.html"' in pages["selection/step_000003.html"]
    for p in pages:
        (run / p).unlink()
    assert plots.main([str(run)]) == 0
    assert {p: (run / p).read_bytes() for p in pages} == pages  # the same pages, from the JSON
    assert (run / "curves.png").stat().st_size > 0
    assert sorted(capsys.readouterr().out.split()) == sorted(str(run / p)
                                                             for p in [*pages, "curves.png"])


def test_bad_run_folder_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "selection").mkdir()
    (tmp_path / "selection" / "step_000001.json").write_text("{not json")
    for folder in [tmp_path / "missing", tmp_path]:
        out = subprocess.run([sys.executable, "-m", "machinery.plots", str(folder)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert (out.returncode == 2 and out.stdout == ""
                and len(out.stderr.strip().splitlines()) == 1), out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plots.main([str(empty)]) == 2


def test_page_stays_small_for_a_real_model_step(tokenizer):
    """G = 8 rollouts of 512 tokens in 4 groups, every one kept and scored: a few hundred KB."""
    torch.manual_seed(0)
    B, T = 32, 512
    ids = torch.randint(2, 90, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    zeros = torch.zeros(B, 1, dtype=torch.long)
    rollouts = Rollouts(zeros, zeros, ids, mask, torch.ones(B, dtype=torch.bool),
                        torch.arange(B) // 8, [""] * B, torch.rand(B, T) * 3)
    rewards = torch.tensor([1.0, 0.0] * 16)
    adv = d3s.group_advantages(rewards, 8)
    idx = torch.arange(B)
    scores = d3s.token_scores(adv, rollouts.entropy, "entropy")
    token_mask = d3s.select_tokens(scores, mask, 0.2)
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "entropy", 1.0, 0.2)
    stats["step"] = 100
    record = plots.selection_record(tokenizer, rollouts, ["q"] * 4, ["a"] * 4, rewards, adv, idx,
                                    token_mask, scores, stats)
    assert record["score"] == "entropy H"  # the 80/20 method scores by entropy alone
    page = plots.selection_html(record)
    size_json = len(json.dumps(record, separators=(",", ":")).encode())
    assert sum(len(r["tokens"]) for g in record["groups"] for r in g["rollouts"]) == 4 * 8 * 512
    # 459 KB, 189 KB
    assert len(page.encode()) < 500_000 and size_json < 250_000, (len(page.encode()), size_json)


def d3s_record_at(tokenizer, rho_s):
    """The hand-made step of d3s_step's rollouts, selected by the real d3s functions at this rho_s
    (rho_t 0.3)."""
    rollouts = make_rollouts(tokenizer, TEXTS, cut={15})
    rewards = torch.tensor(REWARDS, dtype=torch.float)
    adv = d3s.group_advantages(rewards, G)
    idx, adv_kept = d3s.select_samples(rewards, adv, G, rho_s, "cross")
    scores = d3s.token_scores(adv_kept, rollouts.entropy[idx], "adv_entropy")
    token_mask = d3s.select_tokens(scores, rollouts.completion_mask[idx], 0.3)
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "d3s", rho_s, 0.3)
    return plots.selection_record(tokenizer, rollouts, QUESTIONS, ANSWERS, rewards, adv, idx,
                                  token_mask, scores, stats)


def test_an_a0_group_with_kept_rollouts_says_why(tokenizer):
    """rho_s 0.75 keeps 12 of 16 rollouts, more than the 8 of the two mixed groups: sample
    selection takes A = 0 rollouts too, token selection trains none of their tokens, and the page
    says so beside that group (and beside no other)."""
    record = d3s_record_at(tokenizer, 0.75)
    kept_a0 = {g["prompt"]: sum(r["kept"] for r in g["rollouts"]) for g in record["groups"]
               if g["kind"] != "mixed"}
    # every A != 0 rollout, then 4 with A = 0
    assert record["stats"]["kept"] == 12 and sum(kept_a0.values()) == 4
    assert all(sum(r["trained"]) == 0 for g in record["groups"] if g["kind"] != "mixed"
               for r in g["rollouts"] if r["kept"])
    # one piece per group, in order
    groups = plots.selection_html(record).split('<div class="group">')[1:]
    for g, piece in zip(record["groups"], groups):
        n = kept_a0.get(g["prompt"], 0)
        assert piece.count('<p class="why">') == (n > 0), (g["prompt"], g["kind"])
        if n:
            assert f"Why {n} kept with A = 0:" in piece and "sample selection, pooled over the " \
                "step, kept 12 of 16 rollouts (ρs 0.75), more than the 8 in groups with mixed " \
                "rewards, so it took rollouts with A = 0 too." in piece
            assert "token selection trains none of its tokens and its loss is 0." in piece
            # under the group's heading
            assert piece.index('<p class="why">') < piece.index('<div class="q">')
    # 6 kept: all A != 0
    assert 'class="why"' not in plots.selection_html(d3s_record_at(tokenizer, 0.375))


def test_the_page_names_a_zero_variance_group_and_the_step_as_the_rules_do(tokenizer):
    """One vocabulary: "zero-variance group" (all G rewards equal, A = 0) and "step", under every
    sample mode."""
    for sample in d3s.SAMPLE_MODES:
        record = d3s_record_at(tokenizer, 0.75)
        text = plots.selection_html(dict(record, sample_mode=sample))
        assert "batch" not in text, sample
        assert "a group with A = 0" not in text and "groups with A = 0" not in text, sample
        assert "Prompt 1 · zero-variance group (all right): 4 of 4 right" in text
        assert "Prompt 2 · zero-variance group (all wrong): 0 of 4 right" in text
        assert "Prompt 0 · mixed:" in text
        assert "one all-right and one all-wrong zero-variance group when the step has them" in text
    assert ("zero-variance groups (all right or all wrong, so A = 0) are the first dropped"
            in plots.rule("sample", "cross"))
    intra = plots.selection_html(dict(d3s_record_at(tokenizer, 0.75), sample_mode="intra"))
    assert "keeps the same number of rollouts in every group, a zero-variance group too." in intra


def legend_keys(text):
    """The legend's entries as a reader reads them, tags stripped."""
    legend = text.split('<p class="legend">')[1].split("</p>")[0]
    return [html.unescape(re.sub("<[^>]+>", "", k)).strip()
            for k in legend.split('<span class="key">')[1:]]


def test_the_legend_names_the_three_states(d3s_step):
    keys = legend_keys(plots.selection_html(d3s_step[-1]))
    assert keys[0] == "trained token" and keys[1] == "not trained token of a kept rollout"
    assert "dropped rollout (sample selection: it never reaches the model)" in keys
    page = Page(plots.selection_html(d3s_step[-1]))
    assert {r["class"] for r in page.rows.values()} == {"kept", "dropped"}


def test_the_legend_says_the_real_cut_when_it_splits_a_tie(tokenizer, d3s_step):
    """rho_s 0.75 keeps 12 of the 16 rollouts: the 8 of the mixed groups and 4 with A = 0, whose
    tokens all score |A|·H = 0. rho_t 0.9 trains more tokens than the mixed rollouts have, so the
    cut is 0 and only some of the tokens at 0 are trained: the legend counts them (by brute force
    here, over the step), where "trained from 0 up" claimed them all. Without a split tie it reads
    as before."""
    rollouts = make_rollouts(tokenizer, TEXTS, cut={15})
    rewards = torch.tensor(REWARDS, dtype=torch.float)
    adv = d3s.group_advantages(rewards, G)
    idx, adv_kept = d3s.select_samples(rewards, adv, G, 0.75, "cross")
    valid = rollouts.completion_mask[idx]
    scores = d3s.token_scores(adv_kept, rollouts.entropy[idx], "adv_entropy")
    token_mask = d3s.select_tokens(scores, valid, 0.9)
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "d3s", 0.75, 0.9)
    record = plots.selection_record(tokenizer, rollouts, QUESTIONS, ANSWERS, rewards, adv, idx,
                                    token_mask, scores, stats)
    zero = valid & (scores == 0)
    trained, tied = int((zero & token_mask).sum()), int(zero.sum())
    assert len(idx) == 12 and record["score_cut"] == 0 and 0 < trained < tied
    assert record["score_tie"] == [trained, tied]
    keys = legend_keys(plots.selection_html(record))
    assert any(f"(by eighths; trained: every token above 0, and {trained} of the {tied} at 0, a "
               "tie broken any way)" in k for k in keys), keys
    assert not any("trained from 0 up" in k for k in keys)
    record = d3s_step[-1]  # the lowest score trained is a token of its own
    assert record["score_cut"] > 0 and record["score_tie"] == [1, 1]
    assert any(f"trained from {record['score_cut']:.3g} up)" in k
               for k in legend_keys(plots.selection_html(record)))


def test_the_worked_example_is_d3s_own_selection(d3s_step):
    """Four identical groups, one right of 8 each (A = 0.875 / sqrt(1/8) = +2.47 right, -0.125 /
    sqrt(1/8) = -0.35 wrong), 4 of 32 kept: the largest variance keeps two of each (2.00, against
    1.5 for one and three; every 4-subset tried); equal A fall to the tie-break, which keeps group
    0's first two wrong rollouts and the right ones of groups 2 and 3, so the kept A average
    (2 * 0.875 - 2 * 0.125) / 4 / sqrt(1/8) = +1.06."""
    ex = plots.worked_example()
    adv = np.array(ex["adv"])
    best = max(np.var(adv[list(c)]) for c in itertools.combinations(range(32), 4))
    assert ex["var"] == pytest.approx(best, abs=1e-5) == pytest.approx(2.0, abs=1e-4)
    assert ex["kept"] == [1, 2, 16, 24]
    assert ex["mean"] == pytest.approx((2 * 0.875 - 2 * 0.125) / 4 / math.sqrt(1 / 8), abs=1e-4)
    page = html.unescape(plots.selection_html(d3s_step[-1]))
    assert ("d3s.select_samples keeps group 0's rollout 1 (wrong, A -0.35), group 0's rollout 2 "
            "(wrong, A -0.35), group 2's rollout 0 (right, A +2.47), group 3's rollout 0 (right, "
            "A +2.47). The right answers of groups 2 and 3 are trained without any of their "
            "group's wrong ones. The kept A average +1.06, not 0") in page
    assert page.count("<b>1 · +2.47</b>") == 2 and page.count("<b>0 · -0.35</b>") == 2
    assert "worked example" not in plots.selection_html(dict(d3s_step[-1], sample_mode="intra"))


def test_grpo_a0_group_says_its_tokens_add_nothing(tokenizer):
    rollouts = make_rollouts(tokenizer, TEXTS[:8])  # a mixed and an all-right group
    rewards = torch.tensor(REWARDS[:8], dtype=torch.float)
    adv = d3s.group_advantages(rewards, G)
    idx = torch.arange(8)
    stats = stats_of(rollouts, rewards, adv, idx, rollouts.completion_mask, "grpo", 1.0, 1.0)
    record = plots.selection_record(tokenizer, rollouts, QUESTIONS[:2], ANSWERS[:2], rewards, adv,
                                    idx, rollouts.completion_mask, None, stats)
    mixed, right = plots.selection_html(record).split('<div class="group">')[1:]
    trained = int(rollouts.completion_mask[4:].sum())
    assert 'class="why"' not in mixed
    assert ("Why 4 kept with A = 0:</b> this method keeps every rollout. A rollout with A = 0 has "
            f"nothing to learn: the {trained} tokens marked trained here add 0 to the policy "
            f"loss") in right


# -----------------------------------------------------------------------------
# curves.png and the comparison of runs


def log_row(step, **fields):
    """A log.jsonl row with the fields the pictures read (a D3S-like step unless told otherwise)."""
    row = dict(step=step, reward=0.5, kept=40, rollouts=128, tokens=200, valid=1000, valid_all=2500,
               var_adv=0.5, var_kept=1.2, entropy=0.3, grad_norm=2.0, clip_frac=0.01, truncated=0.0,
               updates=4, no_signal=False, t_gen=1.0, t_upd=0.5)
    return dict(row, **fields)


def lines(fig):
    """{label: (x, y)} of every labelled line of a figure."""
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
            for ax in fig.axes for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def same(a, b):
    """Equal lists, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, b))


def test_curves_leave_a_gap_where_a_step_made_no_update():
    rows = [log_row(0, grad_norm=1.5, clip_frac=0.02),
            # the log from now on: null
            log_row(1, grad_norm=None, clip_frac=None, updates=0, no_signal=True),
            # older logs: 0.0 with updates 0
            log_row(2, grad_norm=0.0, clip_frac=0.0, updates=0, no_signal=True),
            log_row(3, grad_norm=0.0, clip_frac=0.0, updates=0),  # older still: no no_signal field
            log_row(4, grad_norm=2.5, clip_frac=0.0)]  # an update that clipped nothing: 0, measured
    fig = plots.curves_figure(rows, [{"step": 0, "accuracy": 0.2}], "run")
    got = lines(fig)
    plt.close(fig)
    grad = next(y for label, (x, y) in got.items() if label.startswith("gradient norm"))
    clip = next(y for label, (x, y) in got.items() if label.startswith("clipped share"))
    nan = math.nan
    assert (same(grad, [1.5, nan, nan, nan, 2.5])
            and same(clip, [0.02, nan, nan, nan, 0.0])), (grad, clip)


def test_curves_name_each_token_share_by_its_denominator():
    rows = [log_row(0, tokens=200, valid=1000, valid_all=2500),
            log_row(1, tokens=0, valid=800, valid_all=2000)]
    fig = plots.curves_figure(rows, [], "run")
    got = lines(fig)
    plt.close(fig)
    # the step line's tokens k/v
    assert got["tokens trained / kept rollouts' tokens (rho_t)"][1] == [0.2, 0.0]
    assert got["tokens trained / all generated tokens"][1] == [0.08, 0.0]
    assert got["rollouts kept / generated"][1] == [40 / 128] * 2


def resolved(**knobs):
    """config.json as train.py writes it for these knobs."""
    from machinery import config, run, tiny
    import train
    cfg = config.resolve(train.Config(**knobs))
    return run.config_json(cfg, tiny.world_of(cfg.model))


def test_labels_say_what_differs_and_nothing_else():
    d3s_run = resolved(out_dir="out/a")
    grpo_run = resolved(method="grpo", out_dir="out/b", eval_every=5)
    assert grpo_run["s_init"] == 1.0 != d3s_run["s_init"]  # config.json records grpo's ratios
    assert plots.run_labels([d3s_run, grpo_run], ["a", "b"]) == ["method=d3s", "method=grpo"]
    seed1 = resolved(seed=1, out_dir="out/c", device="cpu", micro_batch_size=8)
    assert plots.run_labels([d3s_run, seed1], ["a", "c"]) == ["seed=0", "seed=1"]
    half = resolved(s_init=0.5, out_dir="out/d")
    assert plots.run_labels([d3s_run, half, grpo_run], ["a", "d", "b"]) == [
        "method=d3s, s_init=0.25", "method=d3s, s_init=0.5", "method=grpo"]
    # 80/20's fixed share, d2s's constant schedule: the method's
    assert plots.run_labels([d3s_run, resolved(method="entropy"), resolved(method="d2s")],
                            list("abc")) == ["method=d3s", "method=entropy", "method=d2s"]
    # nothing computed differs: the folders name them
    assert plots.run_labels([d3s_run, dict(d3s_run, out_dir="out/e", wandb="p"), None],
                            ["a", "e", "f"]) == ["a", "e", "f (no config.json)"]


def make_run(folder, config, rows, history):
    """A run folder as train.py leaves it: config.json, log.jsonl and (history not None)
    checkpoint/trainer.pt."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if history is not None:
        (folder / "checkpoint").mkdir()
        torch.save({"version": 2, "step": rows[-1]["step"] + 1, "history": history,
                    "tokens_trained": 0}, folder / "checkpoint" / "trainer.pt")
    return str(folder)


@pytest.fixture
def two_runs(tmp_path):
    """A D3S run and a GRPO run (keeping everything), and a GRPO run stopped before its first
    checkpoint."""
    # seconds a step: d3s 1 + s generating, 0.5 updating; grpo 2 and 1
    d3s_rows = [log_row(s, kept=32 + s, tokens=100 + s, valid_all=2000,
                        tokens_trained=sum(100 + i for i in range(s + 1)), t_gen=1.0 + s)
                for s in range(4)]
    grpo_rows = [log_row(s, kept=128, tokens=2000, valid=2000, valid_all=2000, reward=0.25 * s,
                         t_gen=2.0, t_upd=1.0)
                 for s in range(4)]
    d3s_hist = [{"step": 0, "tokens": 0, "accuracy": 0.2},
                {"step": 4, "tokens": 406, "accuracy": 0.5}]
    grpo_hist = [{"step": 0, "tokens": 0, "accuracy": 0.2},
                 {"step": 4, "tokens": 8000, "accuracy": 0.4}]
    return (make_run(tmp_path / "d3s", resolved(out_dir="out/d3s"), d3s_rows, d3s_hist),
            make_run(tmp_path / "grpo", resolved(method="grpo", out_dir="out/grpo"), grpo_rows,
                     grpo_hist),
            make_run(tmp_path / "grpo1", resolved(method="grpo", seed=1), grpo_rows[:2], None))


def test_compare_draws_each_run_from_its_folder(two_runs):
    runs = plots.load_runs(two_runs)
    assert [r["label"] for r in runs] == ["method=d3s, seed=0", "method=grpo, seed=0",
                                          "method=grpo, seed=1"]
    assert runs[2]["history"] is None and len(runs[2]["rows"]) == 2
    fig = plots.compare_figure(runs, "t", smooth=2)
    acc_step, acc_tok, acc_sec, reward, kept, tokens, total, spent = fig.axes
    plt.close(fig)
    # the paper's unit: accuracy against the seconds of generation + update before an evaluation
    assert acc_sec.get_xlabel() == "seconds of generation + update (t_gen + t_upd)"
    assert spent.get_title() == "seconds of generation + update so far"
    assert [ln.get_label() for ln in acc_step.get_lines()] == [
        "method=d3s, seed=0", "method=grpo, seed=0",
        "method=grpo, seed=1 (no checkpoint: no held-out accuracy)"]
    xy = lambda ax, i: (list(ax.get_lines()[i].get_xdata()),  # noqa: E731
                        list(ax.get_lines()[i].get_ydata()))
    assert xy(acc_step, 0) == ([0, 4], [0.2, 0.5]) and xy(acc_step, 2) == ([], [])
    assert xy(acc_tok, 0) == ([0, 406], [0.2, 0.5]) and xy(acc_tok, 1) == ([0, 8000], [0.2, 0.4])
    assert xy(reward, 2) == ([0, 1, 2, 3], [0.0, 0.25, 0.5, 0.75])  # each step, faint
    assert xy(reward, 3) == ([0, 1, 2, 3], [0.0, 0.125, 0.375, 0.625])  # the mean of the last 2
    assert xy(kept, 0)[1] == [(32 + s) / 128 for s in range(4)] and xy(kept, 1)[1] == [1.0] * 4
    assert (xy(tokens, 0)[1] == [(100 + s) / 2000 for s in range(4)]
            and xy(tokens, 1)[1] == [1.0] * 4)
    assert xy(total, 0)[1] == [100, 201, 303, 406]  # tokens_trained as logged
    # a log without it: the running sum of the steps' tokens
    assert xy(total, 1)[1] == [2000, 4000, 6000, 8000]
    # evaluation at step 4: d3s spent (1 + 2 + 3 + 4) + 4 * 0.5 s in steps 0..3, grpo 4 * 3 s
    assert xy(acc_sec, 0) == ([0, 12.0], [0.2, 0.5]) and xy(acc_sec, 1) == ([0, 12.0], [0.2, 0.4])
    assert xy(acc_sec, 2) == ([], [])  # no checkpoint, no accuracy
    assert xy(spent, 0) == ([0, 1, 2, 3], [1.5, 4.0, 7.5, 12.0])  # after each step
    assert xy(spent, 2) == ([0, 1], [3.0, 6.0])


def test_seconds_at_sums_the_steps_before_each_evaluation():
    rows = [log_row(0, t_gen=1.0, t_upd=0.5), log_row(1, t_gen=2.0, t_upd=0.25),
            log_row(2, t_gen=9.0, t_upd=9.0),  # a step cut short, then run again after a resume:
            log_row(2, t_gen=4.0, t_upd=0.0)]  # its last row is the step that counts
    assert plots.seconds_at(rows, [0, 1, 2, 3]) == [0, 1.5, 3.75, 7.75]
    # curves.png: the same seconds on a second axis above the accuracy
    fig = plots.curves_figure(rows, [{"step": 0, "accuracy": 0.2}], "run")
    acc, top = fig.axes[0], fig.axes[0].child_axes[0]
    acc.set_xlim(1, 3)
    fig.canvas.draw()  # the axis above takes its limits from the steps' through seconds_at
    plt.close(fig)
    assert top.get_xlabel() == plots.SECONDS and top.get_xlim() == pytest.approx((1.5, 7.75))


def test_compare_command_writes_one_picture(two_runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pictures" / "cmp.png"
    assert plots.main([*two_runs, "--out", str(out)]) == 0
    assert (capsys.readouterr().out == f"{out}\n"
            and 5_000 < out.stat().st_size < 60_000)  # 64 colours
    monkeypatch.chdir(tmp_path)
    assert plots.main(list(two_runs[:2])) == 0  # the default: out/compare.png
    assert (capsys.readouterr().out == "out/compare.png\n"
            and (tmp_path / "out" / "compare.png").is_file())


def test_compare_refuses_what_is_not_a_run_in_one_line(two_runs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    torn = tmp_path / "torn"
    (torn / "checkpoint").mkdir(parents=True)
    (torn / "checkpoint" / "trainer.pt").write_bytes(b"PK\x03\x04 cut short")
    bad_row = tmp_path / "bad_row"
    bad_row.mkdir()
    (bad_row / "log.jsonl").write_text('{"step": 0}\n')
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "log.jsonl").write_text(json.dumps(log_row(0)) + '\n{"step": 1, "rew')
    for folder, says in [("missing", "is not a folder"),
                         ("empty", "has neither log.jsonl nor checkpoint"),
                         ("torn", "trainer.pt cannot be read"), ("bad_row", "KeyError"),
                         ("cut", "log.jsonl, line 2, is not JSON")]:
        assert plots.main([two_runs[0], str(tmp_path / folder)]) == 2, folder
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert captured.out == "" and len(err) == 1 and says in err[0], (folder, err)
    # --out is for two or more runs
    assert plots.main([two_runs[0], "--out", str(tmp_path / "x.png")]) == 2
    assert "two or more runs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        plots.main(["--out"])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


# -----------------------------------------------------------------------------
# the page as a person sees it: a real headless browser


BROWSERS = ["chromium", "chromium-headless-shell", "google-chrome"]


def find_browser():
    for name in BROWSERS:
        if shutil.which(name):
            return shutil.which(name)
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def run_browser(browser, page, tmp_path, *flags):
    """Headless Chromium, offline, on the page with these flags. -> the finished process."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", *flags, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def screenshot(browser, page, png, tmp_path, width=1200, height=3000):
    """Render the page in headless Chromium at a tall window. -> (H, W, 3) uint8 pixels."""
    from matplotlib.image import imread
    out = run_browser(browser, page, tmp_path, "--hide-scrollbars",
                      f"--window-size={width},{height}", f"--screenshot={png}")
    assert out.returncode == 0 and png.is_file(), out.stderr[-2000:]
    return (np.asarray(imread(str(png)))[..., :3] * 255).round().astype(np.uint8)


def browser_or_skip():
    browser = find_browser()
    if browser is None:
        pytest.skip(f"no headless browser: looked for {', '.join(BROWSERS)} on PATH and "
                    f"/usr/bin/chromium; .ci/run installs Debian's chromium (apt-get install "
                    f"chromium)")
    return browser


def test_page_renders_in_a_real_browser(tmp_path, d3s_step):
    browser = browser_or_skip()
    page = tmp_path / "selection.html"
    page.write_text(plots.selection_html(d3s_step[-1]), encoding="utf-8")
    pixels = screenshot(browser, page, tmp_path / "page.png", tmp_path)  # (3000, 1200, 3)
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7]}
    assert len(colours) > 20, f"{len(colours)} colours: a blank page?"
    # the trained tokens' underline
    kept = np.array([int(plots.VERMILLION[i:i + 2], 16) for i in (1, 3, 5)])
    near = (np.abs(pixels.astype(int) - kept).max(axis=-1) <= 3).sum()
    assert near >= 3 * 20, f"the trained-token colour {plots.VERMILLION} covers only {near} pixels"
    # the page's height: its last row that is not background, at a window taller than the page
    used = np.nonzero((pixels != 255).any(axis=(1, 2)))[0]
    assert 600 < used.max() + 1 < 2900, f"page height {used.max() + 1} px"


# A script added to a copy of the page (the page itself has none): each mark's style as the browser
# computes it, written into the page as JSON for --dump-dom to print.
PROBE = """<script>
const look = el => { const s = getComputedStyle(el); let fade = 1;
  for (let e = el; e; e = e.parentElement) fade *= getComputedStyle(e).opacity;
  const b = getComputedStyle(el, "::before");  // a fork's triangle
  return {color: s.color, weight: s.fontWeight, line: s.textDecorationLine, shadow: s.boxShadow,
          background: s.backgroundColor, fade: fade,
          top: s.borderTopWidth + " " + s.borderTopStyle + " " + s.borderTopColor,
          before: b.content + " " + b.borderTopWidth + " " + b.borderTopStyle + " " +
                  b.borderTopColor + " " + b.borderLeftWidth + " " + b.borderLeftColor}; };
const fork = "[class$=f]", plain = ":not([class$=f])";
const marks = {trained: "tr.kept u[class^=k]", untrained: "tr.kept u[class^=d]",
  dropped: "tr.dropped u:not(.sp)", legend_trained: ".legend u[class^=k]",
  legend_untrained: ".legend u[class^=d]", legend_dropped: ".legend .gone", body: "body",
  untrained_plain: "tr.kept u[class^=d]" + plain, dropped_plain: "tr.dropped u:not([class])",
  trained_fork: "tr.kept u[class^=k]" + fork, untrained_fork: "tr.kept u[class^=d]" + fork,
  dropped_fork: "tr.dropped u.f", legend_fork: ".legend u[class^=d]" + fork,
  legend_trained_fork: ".legend u[class^=k]" + fork};
const out = {};
for (const [name, sel] of Object.entries(marks)) {
  const el = document.querySelector(sel);
  out[name] = el ? look(el) : null; }  // null: no such mark on the page
const pre = document.createElement("pre");
pre.id = "probe";
pre.textContent = JSON.stringify(out);
document.body.append(pre);
</script>"""


def rgb(colour):
    """"#d55e00" -> "rgb(213, 94, 0)", as getComputedStyle writes it."""
    return "rgb({}, {}, {})".format(*(int(colour[i:i + 2], 16) for i in (1, 3, 5)))


def computed_looks(tmp_path, record):
    """The record's page in headless Chromium with PROBE added: {mark: its computed style, or None
    when the page has no such mark}."""
    browser = browser_or_skip()
    page = tmp_path / "probe.html"
    page.write_text(plots.selection_html(record).replace("</body>", PROBE + "</body>"),
                    encoding="utf-8")
    out = run_browser(browser, page, tmp_path, "--dump-dom")
    assert out.returncode == 0 and '<pre id="probe">' in out.stdout, out.stderr[-2000:]
    return json.loads(html.unescape(out.stdout.split('<pre id="probe">')[1].split("</pre>")[0]))


def test_dropped_rollout_untrained_token_and_trained_token_look_different(tmp_path, d3s_step):
    """A dropped rollout is grey and struck through; a kept rollout's untrained token is the page's
    dark text (on its score's shade); a trained token is bold and underlined in vermillion. The
    legend shows each as the rows do."""
    looks = computed_looks(tmp_path, d3s_step[-1])
    trained, untrained, dropped = looks["trained"], looks["untrained"], looks["dropped"]
    body = looks["body"]
    vermillion = rgb(plots.VERMILLION)
    assert trained["weight"] == "700" and vermillion in trained["shadow"], trained
    # dark, not grey
    assert untrained["color"] == body["color"] and untrained["weight"] == "400", untrained
    assert (untrained["line"] == "none" and untrained["shadow"] == "none"
            and untrained["fade"] == 1), untrained
    # faded and struck
    assert "line-through" in dropped["line"] and dropped["color"] != body["color"], dropped
    seen = lambda x: (x["color"], x["weight"], x["line"], x["shadow"], x["fade"])  # noqa: E731
    assert len({seen(trained), seen(untrained), seen(dropped)}) == 3
    for state in ("trained", "untrained", "dropped"):  # the legend's sample looks like the rows'
        legend = looks[f"legend_{state}"]
        assert seen(legend) == seen(looks[state]), (state, legend, looks[state])
    assert looks["legend_dropped"]["background"] == dropped["background"]


def test_forks_are_marked_in_every_rollout_and_a_trained_fork_is_told_apart(tmp_path, d3s_step):
    """A fork (sampled above 0.672 nats) has a bluish-green triangle above it, MARK = 6 px high,
    in a kept rollout or a dropped one, trained or not; no other token has one. A trained fork
    keeps the trained mark (bold, a 6 px vermillion bar below), so it never looks like an untrained
    fork: two shapes, two colours, two places. The legend shows both."""
    looks = computed_looks(tmp_path, d3s_step[-1])
    assert plots.MARK >= 6  # readable at 100% zoom (2-3 px were not)
    # a triangle: a 6 px top border under transparent sides, the shape CSS draws a triangle with
    side = f"{plots.MARK // 2 + 1}px rgba(0, 0, 0, 0)"
    triangle = f'"" {plots.MARK}px solid {rgb(plots.GREEN)} {side}'
    for name in ("trained_fork", "untrained_fork", "dropped_fork", "legend_fork",
                 "legend_trained_fork"):
        assert looks[name]["before"] == triangle, (name, looks[name])
    # not a fork: no triangle (every token trained here is a fork: the legend's sample is not)
    for name in ("untrained_plain", "dropped_plain", "legend_trained", "legend_untrained"):
        assert looks[name]["before"].startswith("none "), (name, looks[name])
    vermillion = rgb(plots.VERMILLION)
    trained, untrained = looks["trained_fork"], looks["untrained_fork"]
    bar = f"{vermillion} 0px {plots.MARK}px 0px 0px"  # a bar MARK px high, right below the token
    assert trained["weight"] == "700" and trained["shadow"] == bar, trained
    assert looks["trained"]["shadow"] == bar and looks["legend_trained"]["shadow"] == bar
    assert untrained["weight"] == "400" and untrained["shadow"] == "none", untrained
    assert "line-through" in looks["dropped_fork"]["line"]  # still a dropped rollout
    for state in ("trained_fork", "untrained_fork"):
        legend = looks[f"legend_{state.replace('untrained_', '')}"]
        assert (legend["weight"], legend["shadow"]) == (looks[state]["weight"],
                                                        looks[state]["shadow"]), state
    keys = legend_keys(plots.selection_html(d3s_step[-1]))
    assert ("fork / trained fork: a token sampled with entropy H > 0.672 nats (the 80/20 paper's "
            "forking threshold), in every rollout shown") in keys


def tallest(mask):
    """The longest vertical run of True pixels in any column of an (H, W) mask."""
    best = 0
    for col in mask.T[mask.any(axis=0)]:
        edges = np.diff(np.concatenate([[0], col.astype(int), [0]]))
        best = max(best, int((np.nonzero(edges == -1)[0] - np.nonzero(edges == 1)[0]).max()))
    return best


def test_the_fork_and_trained_marks_are_readable_at_100_percent(tmp_path, d3s_step):
    """Measured on the page as a browser draws it at 100% zoom: the trained bar and the fork
    triangle are each 6 px high in their own colour (2 and 3 px sent a reader to 300%)."""
    browser = browser_or_skip()
    page = tmp_path / "selection.html"
    page.write_text(plots.selection_html(d3s_step[-1]), encoding="utf-8")
    pixels = screenshot(browser, page, tmp_path / "page.png", tmp_path).astype(int)

    def near(colour, by):
        return np.abs(pixels - [int(colour[i:i + 2], 16) for i in (1, 3, 5)]).max(axis=-1) <= by
    assert tallest(near(plots.VERMILLION, 8)) == 6  # the bar below a trained token
    # the triangle: its middle columns are 5 px of green and the tip's half-covered pixel
    assert tallest(near(plots.GREEN, 32)) == 5


def test_no_module_under_machinery_imports_train():
    """Imports run one way (STYLE.md): the learner's files use machinery/, never the reverse, so
    machinery/plots.py reads the divisor its run's line picked from config.json, not train.py."""
    import ast
    for path in sorted((ROOT / "machinery").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "train" or n.startswith("train.") for n in names), path.name


def test_labels_read_the_divisor_and_the_method_from_config_json():
    """The divisor its method and loss pick (config.json's picked) repeats them and labels nothing;
    a given one does. Two runs of one method that d3s.py defined otherwise between them (their
    method_spec) are labelled by what changed. picked and method_spec are no knobs to label."""
    grpo, gspo = resolved(out_dir="out/a"), resolved(loss="gspo", out_dir="out/b")
    assert (grpo["picked"]["divisor"], gspo["picked"]["divisor"]) == ("kept", "seq")
    eps = "clip_eps_low=0.0003, clip_eps_high=0.0004"  # GSPO's own, picked by the loss too
    assert plots.run_labels([grpo, gspo], ["a", "b"]) == [
        "loss=grpo, clip_eps_low=0.2, clip_eps_high=0.2", f"loss=gspo, {eps}"]
    given = dict(gspo, divisor="kept", out_dir="out/c")  # --loss gspo --divisor kept
    assert plots.run_labels([gspo, given], ["b", "c"]) == ["b", "divisor=kept"]
    valid = dict(grpo, divisor="valid")
    assert plots.run_labels([grpo, valid], ["a", "c"]) == ["a", "divisor=valid"]
    edited = dict(grpo, out_dir="out/d",
                  method_spec=dict(grpo["method_spec"], schedule="constant"))
    assert plots.run_labels([grpo, edited], ["a", "d"]) == ["schedule=linear", "schedule=constant"]
    old = {k: v for k, v in grpo.items() if k not in ("picked", "method_spec")}  # before both
    assert plots.run_labels([old, resolved(method="grpo")], ["a", "e"]) == [
        "method=d3s", "method=grpo"]
