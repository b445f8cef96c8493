"""The selection page (plots.py) on hand-made steps: it marks exactly what d3s.select_samples and
d3s.select_tokens kept, escapes every token, says what grpo keeps, rebuilds from its JSON, and renders
in a real headless browser."""
import html.parser
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import d3s
import plots
import tiny
from conftest import ROOT
from rollout import Rollouts

G = 4
# Four groups of four completions, in the tiny world's format; <eos> (id 1) ends a completion, and
# the last one of group 3 is cut off without it.
TEXTS = [
    " 1+2=3\n#### 3", " 1+2=4\n#### 4", " 1+2=5\n#### 5", " 1+2=3\n#### 3",   # mixed
    " 9+9=8\n#### 8", " 9+9=8\n#### 8", " 9+9=8\n#### 8", " 9+9=8\n#### 8",   # all right
    " 5+6=2\n#### 2", " 5+6=0\n#### 0", " 5+6=9\n#### 9", " 5+6=2\n#### 2",   # all wrong
    " 2+2=4\n#### 4", " 2+2=5\n#### 5", " 2+2=6\n#### 6", " 2+2=7\n#### 7 and more",  # mixed, last cut
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
    entropy = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) * 2 * mask  # (B, T), 0 on padding
    return Rollouts(zeros, zeros, ids, mask, torch.tensor([i in cut for i in range(B)]),
                    torch.arange(B) // G, list(texts), entropy)


def stats_of(rollouts, rewards, adv, idx, token_mask, method, rho_s, rho_t, **extra):
    """The fields of train.py's log row that the page shows, computed as train.py does."""
    pop_var = lambda a: a.var(unbiased=False).item()  # noqa: E731
    return dict(step=7, method=method, sample_mode=d3s.METHODS[method]["sample"],
                token_mode=d3s.METHODS[method]["token"], rho_s=rho_s, rho_t=rho_t, kept=len(idx),
                rollouts=len(rewards), tokens=int(token_mask.sum()), valid=int(rollouts.completion_mask[idx].sum()),
                valid_all=int(rollouts.completion_mask.sum()), var_adv=pop_var(adv), var_kept=pop_var(adv[idx]),
                zero_var=(rewards.view(-1, G).std(dim=1) == 0).float().mean().item(), reward=rewards.mean().item(),
                **extra)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def d3s_step(tokenizer):
    """A D3S step by hand, selected by the real d3s functions: (rollouts, rewards, adv, idx, token_mask,
    scores, record)."""
    rollouts = make_rollouts(tokenizer, TEXTS, cut={15})
    rewards = torch.tensor(REWARDS, dtype=torch.float)
    adv = d3s.group_advantages(rewards, G)
    idx, adv_kept = d3s.select_samples(rewards, adv, G, 0.375, "cross")  # 6 of 16
    valid = rollouts.completion_mask[idx]  # (N, T)
    scores = d3s.token_scores(adv_kept, rollouts.entropy[idx], "adv_entropy")
    token_mask = d3s.select_tokens(scores, valid, 0.3)
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "d3s", 0.375, 0.3)
    record = plots.selection_record(tokenizer, rollouts, QUESTIONS, ANSWERS, rewards, adv, idx, token_mask, scores,
                                    stats)
    return rollouts, rewards, adv, idx, token_mask, scores, record


class Page(html.parser.HTMLParser):
    """What a reader sees in each rollout row: rows[row] = {"class", "spans": [(classes, title, text)]}, one
    span per token (a <u> element), with its classes, its title (the score on hover) and its text."""

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
    """A token's classes -> ("k" trained | "d" not trained | None in a dropped rollout, its shade 0-7 or None)."""
    c = [x for x in classes if x != "sp"]
    return (c[0][0], int(c[0][1:]) if c[0][1:] else None) if c else (None, None)


def shown(text):
    """A token's text as the page shows it: whitespace made visible, a newline also a line break."""
    return text.replace(" ", "·").replace("\n", "↵<br>")


def test_record_keeps_exactly_what_d3s_selected(tokenizer, d3s_step):
    rollouts, rewards, adv, idx, token_mask, scores, record = d3s_step
    assert [(g["prompt"], g["kind"]) for g in record["groups"]] == [(0, "mixed"), (3, "mixed"), (1, "all right"),
                                                                     (2, "all wrong")]
    kept_at = {row: n for n, row in enumerate(idx.tolist())}
    assert sum(r["kept"] for g in record["groups"] for r in g["rollouts"]) == len(idx) == 6
    for g in record["groups"]:
        assert g["question"] == QUESTIONS[g["prompt"]] and g["answer"] == ANSWERS[g["prompt"]]
        for j, r in enumerate(g["rollouts"]):
            b = g["prompt"] * G + j
            n = int(rollouts.completion_mask[b].sum())  # valid tokens only: no padding in the record
            assert r["row"] == b and r["reward"] == REWARDS[b] and r["adv"] == pytest.approx(adv[b].item(), abs=1e-4)
            assert r["tokens"] == [tokenizer.decode([i]) for i in rollouts.completion_ids[b, :n].tolist()]
            assert "".join(r["tokens"]) == TEXTS[b] + ("" if b == 15 else tiny.EOS)
            assert r["kept"] == (b in kept_at) and r["truncated"] == (b == 15)
            if b in kept_at:
                assert r["trained"] == token_mask[kept_at[b], :n].int().tolist()
                assert r["scores"] == pytest.approx(scores[kept_at[b], :n].tolist(), rel=1e-2)
            else:
                assert r["trained"] is None and r["scores"] is None
    assert record["score_cut"] == pytest.approx(scores[token_mask].min().item(), rel=1e-2)
    assert record["specials"] == [tiny.EOS]
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
            assert [int(mark(s[0])[0] == "k") for s in row["spans"]] == token_mask[kept_at[b], :n].int().tolist()
            assert all(mark(s[0])[0] in "kd" and mark(s[0])[1] is not None for s in row["spans"])  # each shaded
            assert all(s[1] is not None for s in row["spans"])  # each score on hover
        else:
            assert row["class"] == "dropped" and all(s[0] <= {"sp"} and s[1] is None for s in row["spans"])
    marks = [mark(s[0]) for row in page.rows.values() for s in row["spans"]]
    assert sum(m == "k" for m, _ in marks) == int(token_mask.sum())  # all kept rollouts are shown here
    # the shades rank the scores: no token left out is darker than a trained one
    assert max(b for m, b in marks if m == "d") <= min(b for m, b in marks if m == "k")
    top = plots.selection_html(record)
    tokens = f"<b>{int(token_mask.sum())} / {int(rollouts.completion_mask[idx].sum())}</b>"  # trained / valid
    assert "<b>6 / 16</b>" in top and tokens in top


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
    record = plots.selection_record(tok, rollouts, ["is 2<3 & <b>bold</b>?"], ["<i>"], rewards, adv, idx,
                                    token_mask, None, stats)
    assert record["groups"][0]["rollouts"][0]["tokens"][:2] == ["x", "<script>"]  # one token, decoded as is
    assert record["specials"] == ["<eos>", "<|im_end|>"]
    text = plots.selection_html(record)
    page = Page(text)
    assert "script" not in page.tags  # no token, question or answer became a tag
    assert "<script>" not in text and "<b>bold" not in text
    assert "&lt;script&gt;" in text and "is 2&lt;3 &amp; &lt;b&gt;bold&lt;/b&gt;?" in text
    assert "<code>&lt;i&gt;</code>" in text
    spans = [s for s in page.rows[0]["spans"]]
    assert spans[1][2] == "<script>" and spans[-4][2] == spans[-3][2] == "↵<br>" and spans[-2][2] == "y"
    assert page.rows[1]["spans"][0][2] == "a·&·b"
    assert "".join(s[2] for s in page.rows[1]["spans"][1:-1]) == "<z·&amp;"
    im_end = page.rows[2]["spans"][1]
    assert im_end[2] == "<|im_end|>" and "sp" in im_end[0]  # shown as text, in the special style
    assert [s[2] for s in page.rows[3]["spans"][:3]] == ["·", "·", "↵<br>"]
    assert "&lt;|im_end|&gt;" in text
    # characters the tiny tokenizer cannot spell: a tab, a no-break space, a control character, nothing
    assert plots._visible("\t\u00a0\x07") == "<i>→\\xa0\\x07</i>" and plots._visible("") == "<i>∅</i>"
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
    text = plots.selection_html(plots.selection_record(tok, rollouts, ["q"], ["a"], rewards, adv, idx, token_mask,
                                                       scores, stats))
    page = Page(text)
    assert set(page.tags) <= {"html", "head", "meta", "title", "style", "body", "h1", "small", "div", "b", "p",
                              "span", "u", "i", "br", "h2", "code", "table", "tr", "th", "td"}
    assert len(page.rows) == 4 and [len(r["spans"]) for r in page.rows.values()] == [2, 2, 2, 3]


def test_grpo_keeps_everything_and_says_so(tokenizer):
    """grpo: every rollout kept, every token trained, nothing scored; a step without a mixed group."""
    rollouts = make_rollouts(tokenizer, TEXTS[4:12])  # an all-right and an all-wrong group
    rewards = torch.tensor(REWARDS[4:12], dtype=torch.float)
    adv = d3s.group_advantages(rewards, G)
    idx, _ = d3s.select_samples(rewards, adv, G, 1.0, "none")
    token_mask = rollouts.completion_mask  # token mode none: the valid tokens
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "grpo", 1.0, 1.0)
    record = plots.selection_record(tokenizer, rollouts, QUESTIONS[1:3], ANSWERS[1:3], rewards, adv, idx,
                                    token_mask, None, stats)
    assert [g["kind"] for g in record["groups"]] == ["all right", "all wrong"] and record["score"] is None
    text = plots.selection_html(record)
    assert "keeps every rollout and trains every token" in text and 'class="all"' in text
    page = Page(text)
    assert len(page.rows) == 8 and all(r["class"] == "kept" for r in page.rows.values())
    assert all(mark(s[0]) == ("k", None) for r in page.rows.values() for s in r["spans"])  # all trained, unshaded
    assert "dropped" not in [r["class"] for r in page.rows.values()]


def test_skipped_step_says_why(tokenizer, d3s_step):
    record = dict(d3s_step[-1], stats=dict(d3s_step[-1]["stats"], skipped_reason="no kept token has A != 0"))
    text = plots.selection_html(record)
    assert text.count("made no update") == 1 and "no kept token has A != 0" in text


def test_pick_groups_rule():
    mixed, right, wrong = [1, 0], [1, 1], [0, 0]
    assert plots.pick_groups([wrong, mixed, right, mixed, mixed, wrong], 4) == [
        (1, "mixed"), (3, "mixed"), (2, "all right"), (0, "all wrong")]
    assert plots.pick_groups([mixed, mixed, mixed, mixed, mixed], 4) == [(i, "mixed") for i in range(4)]
    assert plots.pick_groups([wrong, wrong, right], 4) == [(2, "all right"), (0, "all wrong"), (1, "all wrong")]
    assert plots.pick_groups([wrong, mixed, right], 1) == [(1, "mixed")]


def test_every_mode_has_its_words():
    assert set(plots.SAMPLE_RULES) == set(d3s.SAMPLE_MODES) and set(plots.TOKEN_RULES) == set(d3s.TOKEN_MODES)


def test_write_selection_and_rebuild_from_the_run_folder(tmp_path, d3s_step, capsys):
    record = d3s_step[-1]
    run = tmp_path / "run"
    run.mkdir()
    row = dict(record["stats"], entropy=0.5, grad_norm=1.0, clip_frac=0.0, truncated=0.1)
    (run / "log.jsonl").write_text("".join(json.dumps(dict(row, step=s)) + "\n" for s in range(8)))
    plots.write_selection(str(run), dict(record, step=3))
    top = plots.write_selection(str(run), record)
    assert top == str(run / "selection.html")
    names = sorted(os.listdir(run / "selection"))
    assert names == ["step_000003.html", "step_000003.json", "step_000007.html", "step_000007.json"]
    assert json.loads((run / "selection" / "step_000007.json").read_text()) == record
    pages = {p: (run / p).read_bytes() for p in ["selection.html", "selection/step_000003.html",
                                                  "selection/step_000007.html"]}
    assert b'href="selection/step_000003.html"' in pages["selection.html"] and b"Step 7:" in pages["selection.html"]
    assert b"steps: <a " in pages["selection.html"] and b" \xc2\xb7 <b>7</b></nav>" in pages["selection.html"]
    assert b'href="../selection.html"' in pages["selection/step_000003.html"]
    for p in pages:
        (run / p).unlink()
    assert plots.main([str(run)]) == 0
    assert {p: (run / p).read_bytes() for p in pages} == pages  # the same pages, from the JSON alone
    assert (run / "curves.png").stat().st_size > 0
    assert sorted(capsys.readouterr().out.split()) == sorted(str(run / p) for p in [*pages, "curves.png"])


def test_bad_run_folder_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "selection").mkdir()
    (tmp_path / "selection" / "step_000001.json").write_text("{not json")
    for folder in [tmp_path / "missing", tmp_path]:
        out = subprocess.run([sys.executable, str(ROOT / "plots.py"), str(folder)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
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
    rollouts = Rollouts(zeros, zeros, ids, mask, torch.ones(B, dtype=torch.bool), torch.arange(B) // 8,
                        [""] * B, torch.rand(B, T) * 3)
    rewards = torch.tensor([1.0, 0.0] * 16)
    adv = d3s.group_advantages(rewards, 8)
    idx = torch.arange(B)
    scores = d3s.token_scores(adv, rollouts.entropy, "entropy")
    token_mask = d3s.select_tokens(scores, mask, 0.2)
    stats = stats_of(rollouts, rewards, adv, idx, token_mask, "entropy", 1.0, 0.2)
    stats["step"] = 100
    record = plots.selection_record(tokenizer, rollouts, ["q"] * 4, ["a"] * 4, rewards, adv, idx, token_mask, scores,
                                    stats)
    assert record["score"] == "H"  # the 80/20 method scores by entropy alone
    page = plots.selection_html(record)
    size_json = len(json.dumps(record, separators=(",", ":")).encode())
    assert sum(len(r["tokens"]) for g in record["groups"] for r in g["rollouts"]) == 4 * 8 * 512
    assert len(page.encode()) < 500_000 and size_json < 250_000, (len(page.encode()), size_json)  # 459 KB, 189 KB

# -----------------------------------------------------------------------------
# the page as a person sees it: a real headless browser


BROWSERS = ["chromium", "chromium-headless-shell", "google-chrome"]


def find_browser():
    for name in BROWSERS:
        if shutil.which(name):
            return shutil.which(name)
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def screenshot(browser, page, png, tmp_path, width=1200, height=3000):
    """Render the page in headless Chromium, offline, at a tall window. -> (H, W, 3) uint8 pixels."""
    import numpy as np
    from matplotlib.image import imread
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", f"--window-size={width},{height}",
           f"--screenshot={png}", page.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and png.is_file(), out.stderr[-2000:]
    return (np.asarray(imread(str(png)))[..., :3] * 255).round().astype(np.uint8)


def test_page_renders_in_a_real_browser(tmp_path, d3s_step):
    import numpy as np
    browser = find_browser()
    if browser is None:
        pytest.skip(f"no headless browser: looked for {', '.join(BROWSERS)} on PATH and /usr/bin/chromium; "
                    f".ci/run installs Debian's chromium (apt-get install chromium)")
    page = tmp_path / "selection.html"
    page.write_text(plots.selection_html(d3s_step[-1]), encoding="utf-8")
    pixels = screenshot(browser, page, tmp_path / "page.png", tmp_path)  # (3000, 1200, 3)
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7]}
    assert len(colours) > 20, f"{len(colours)} colours: a blank page?"
    kept = np.array([int(plots.VERMILLION[i:i + 2], 16) for i in (1, 3, 5)])  # the trained tokens' underline
    near = (np.abs(pixels.astype(int) - kept).max(axis=-1) <= 3).sum()
    assert near >= 3 * 20, f"the trained-token colour {plots.VERMILLION} covers only {near} pixels"
    # the page's height: its last row that is not background, at a window taller than the page
    used = np.nonzero((pixels != 255).any(axis=(1, 2)))[0]
    assert 600 < used.max() + 1 < 2900, f"page height {used.max() + 1} px"
