"""
A run's pictures, so that a learner sees it learn and sees what D3S keeps. train.py calls both at
every evaluation; `python plots.py RUN` rebuilds them for any run folder, finished or not.

RUN/curves.png (plot_run), from RUN/log.jsonl and the held-out evaluations. Six panels against the
step: the mean reward of the rollouts and the held-out accuracy; the share of rollouts and of tokens
kept (D3S's two levels; GRPO keeps all); Var(A) of all rollouts and of the kept ones (sample
selection raises it); the mean entropy of the sampling distribution; the gradient norm before
clipping; and, with several updates per batch, the share of clipped tokens.

RUN/selection.html (selection_record, write_selection, selection_html): one step seen rollout by
rollout and token by token, the picture of what D3S keeps. For a few groups of the step just
trained (pick_groups), each rollout with its reward and advantage A, whether sample selection kept
it, and its tokens as the tokenizer decodes them one by one: in a kept rollout each token is shaded
blue by its score (|A|*H for D3S, by eighths of the step's scores) and the tokens token selection
kept are bold and underlined in vermillion; tokens not trained and dropped rollouts are grey. The
page is one self-contained file (inline CSS, no script, nothing from the network), rebuilt from
RUN/selection/step_NNNNNN.json, a small record of the groups shown; train.py records only the step
before an evaluation, so the other steps cost nothing.
"""
import bisect
import glob
import html
import json
import os
import sys
import unicodedata

import matplotlib
matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def plot_run(run_dir, history=None):
    """Write run_dir/curves.png. history: [{step, accuracy}] (None: read from run_dir/checkpoint/trainer.pt)."""
    path = os.path.join(run_dir, "log.jsonl")
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    if history is None:
        import torch  # only to re-plot a finished run from its checkpoint
        state = os.path.join(run_dir, "checkpoint", "trainer.pt")
        history = torch.load(state, weights_only=False)["history"] if os.path.isfile(state) else []
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), dpi=70)
    (a, b, c), (d, e, g) = axes

    a.plot(steps, [r["reward"] for r in rows], label="reward (mean of the rollouts)", alpha=0.6)
    a.plot([h["step"] for h in history], [h["accuracy"] for h in history], "o-", label="held-out accuracy (greedy)")
    a.set_ylim(0, 1)
    b.plot(steps, [r["kept"] / r["rollouts"] for r in rows], label="rollouts kept / generated")
    b.plot(steps, [r["tokens"] / max(r["valid_all"], 1) for r in rows], label="tokens trained / generated")
    b.set_ylim(0, 1.05)
    c.plot(steps, [r["var_adv"] for r in rows], label="Var(A), all rollouts")
    c.plot(steps, [r["var_kept"] for r in rows], label="Var(A), kept rollouts")
    d.plot(steps, [r["entropy"] for r in rows], label="entropy of softmax(logits / T), kept rollouts")
    e.plot(steps, [r["grad_norm"] for r in rows], label="gradient norm (before clipping)")
    g.plot(steps, [r["clip_frac"] for r in rows], label="clipped share of kept tokens")
    g.plot(steps, [r["truncated"] for r in rows], label="truncated rollouts")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
    # fixed margins: tight_layout measures every label first and doubled the cost of a plot
    fig.subplots_adjust(left=0.04, right=0.99, top=0.93, bottom=0.08, wspace=0.16, hspace=0.3)
    fig.savefig(os.path.join(run_dir, "curves.png"))
    plt.close(fig)


# -----------------------------------------------------------------------------
# what D3S keeps: the selection page
#
# The record (selection_record -> JSON, RUN/selection/step_NNNNNN.json) holds only the groups shown:
#   {"format": "nanoD3S selection 1", "step", "method", "sample_mode", "token_mode",
#    "prompts": P, "group_size": G, "stats": the step's log row,
#    "score": "|A|·H" | "H" | null (no token selection), "score_max", "score_cut": the highest score
#    of the step's kept rollouts and the lowest score token selection kept, "score_edges": the 7
#    scores that split the step's scored tokens into eighths (all three over the whole step),
#    "specials": the special-token strings among the tokens shown,
#    "groups": [{"prompt": index, "kind": "mixed" | "all right" | "all wrong", "question", "answer",
#                "rollouts": [{"row", "reward", "adv", "kept", "truncated",
#                              "tokens": [str] (each id decoded on its own, valid tokens only),
#                              "trained": [0/1] per token, or null for a dropped rollout,
#                              "scores": [float] per token, or null (dropped, or nothing scored)}]}]}

FORMAT = "nanoD3S selection 1"
BINS = 8  # shades of the score, by eighths of the step's scores: 8 CSS classes keep each token's markup short
KINDS = ("mixed", "all right", "all wrong")  # the order groups are shown in


def _group_kind(rewards):
    """A group's rewards -> "mixed", or "all right" / "all wrong" when they are all equal (A = 0 for all)."""
    if max(rewards) != min(rewards):
        return "mixed"
    return "all right" if rewards[0] > 0 else "all wrong"


def pick_groups(group_rewards, max_groups=4):
    """Which groups the page shows: [(index, kind)], at most max_groups, mixed groups first.

    The rule: the first mixed group, then the first all-right and the first all-wrong group when the
    step has them (their A is 0: they show what sample selection drops first), then more mixed
    groups, then any other group, each in batch order. Shown mixed first, then all right, all wrong.
    """
    kinds = [_group_kind(r) for r in group_rewards]
    first = {k: [i for i, kind in enumerate(kinds) if kind == k] for k in KINDS}
    order = (first["mixed"][:1] + first["all right"][:1] + first["all wrong"][:1] + first["mixed"]
             + list(range(len(kinds))))
    chosen = list(dict.fromkeys(order))[:max_groups]  # unique, in priority order
    return [(i, kinds[i]) for i in sorted(chosen, key=lambda i: (KINDS.index(kinds[i]), i))]


def _plain(value):
    """A log-row value as JSON: tensors and numpy scalars become Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _sig(x, digits=3):
    """A float to `digits` significant digits: the page shows two, the record keeps a little more."""
    return float(f"{x:.{digits}g}")


def selection_record(tokenizer, rollouts, questions, answers, rewards, adv, idx, token_mask, scores, stats,
                     max_groups=4):
    """
    The selection page's data for one step, as plain JSON-able Python, for a few groups only
    (pick_groups). rollouts: the step's B = P * G rows, group by group; rewards, adv (B,); idx (N,)
    the rows sample selection kept, ascending; token_mask (N, T) the tokens token selection kept,
    for the kept rows in idx order; scores (N, T) the score of each of those tokens, or None when
    the method does no token selection. stats: the step's log row (step, method, rho_s, rho_t, ...).
    Tokens are decoded one id at a time, special tokens included: that is what the model saw.
    """
    ids, mask, truncated = rollouts.completion_ids.cpu(), rollouts.completion_mask.cpu(), rollouts.truncated.cpu()
    B, P = ids.shape[0], len(questions)
    if P == 0 or B % P or len(answers) != P:
        raise ValueError(f"selection_record: {B} rollouts, {P} questions and {len(answers)} answers; "
                         f"need B = P * G rollouts laid out group by group and one answer per question")
    G = B // P
    rewards, adv = rewards.detach().float().cpu(), adv.detach().float().cpu()  # (B,)
    idx, token_mask = idx.cpu(), token_mask.cpu()  # (N,), (N, T)
    if rewards.shape != (B,) or adv.shape != (B,) or token_mask.shape != (len(idx), ids.shape[1]):
        raise ValueError(f"selection_record: rewards {tuple(rewards.shape)}, adv {tuple(adv.shape)}, token_mask "
                         f"{tuple(token_mask.shape)}; need ({B},), ({B},) and ({len(idx)}, {ids.shape[1]})")
    kept_at = {row: n for n, row in enumerate(idx.tolist())}  # row -> its position among the kept rows
    import d3s  # here, not at the top: rebuilding a page from its JSON needs no torch
    method = stats.get("method")
    modes = d3s.METHODS.get(method, {})  # train.py's row names the modes too; this is for other callers
    sample_mode, token_mode = stats.get("sample_mode", modes.get("sample")), stats.get("token_mode", modes.get("token"))

    score_max = score_cut = edges = None
    if scores is not None:
        scores = scores.detach().float().cpu()  # (N, T)
        scored = scores[mask[idx]].sort().values  # every valid token of the kept rows, ascending
        if len(scored):
            score_max = _sig(scored[-1].item())
            # [ours] shades by rank, not by value: a few outliers (large |A| times a rare high H) would
            # otherwise leave almost every token in the lightest shade
            edges = [_sig(scored[b * len(scored) // BINS].item()) for b in range(1, BINS)]
        if token_mask.any():
            score_cut = _sig(scores[token_mask].min().item())  # token selection kept every score above this

    special = set(getattr(tokenizer, "all_special_tokens", []))
    decoded = {}  # id -> its text: each id decoded once

    def token_text(i):
        if i not in decoded:
            decoded[i] = tokenizer.decode([i], skip_special_tokens=False)
        return decoded[i]

    groups, shown = [], set()
    for g, kind in pick_groups(rewards.view(P, G).tolist(), max_groups):
        rows = []
        for b in range(g * G, (g + 1) * G):
            cols = mask[b].nonzero().flatten()  # the valid tokens: no padding in the record
            tokens = [token_text(i) for i in ids[b, cols].tolist()]
            shown.update(tokens)
            n = kept_at.get(b)
            rows.append({
                "row": b, "reward": round(rewards[b].item(), 4), "adv": round(adv[b].item(), 4), "kept": n is not None,
                "truncated": bool(truncated[b]), "tokens": tokens,
                "trained": None if n is None else [int(t) for t in token_mask[n, cols].tolist()],
                "scores": None if n is None or scores is None else [_sig(s) for s in scores[n, cols].tolist()],
            })
        groups.append({"prompt": g, "kind": kind, "question": str(questions[g]), "answer": str(answers[g]),
                       "rollouts": rows})
    return {
        "format": FORMAT, "step": int(stats["step"]), "method": method, "sample_mode": sample_mode,
        "token_mode": token_mode, "prompts": P, "group_size": G,
        "stats": {k: _plain(v) for k, v in stats.items()},
        "score": None if scores is None else ("H" if token_mode == "entropy" else "|A|·H"),
        "score_max": score_max, "score_cut": score_cut, "score_edges": edges, "specials": sorted(special & shown),
        "groups": groups,
    }


# What each level keeps under each mode, in words for the page (docs/algorithm.md has the exact rules).
SAMPLE_RULES = {
    "none": "every rollout (no sample selection).",
    "cross": "the share ρs of the step's rollouts whose advantages have the largest variance, pooled over the "
             "batch. Such a set is always some of the batch's largest A and the rest of its smallest, so a group "
             "may keep only its wrong (or only its right) rollouts, and groups with A = 0 (all right or all wrong) "
             "are the first dropped. A dropped rollout never reaches the model again.",
    "intra": "inside each group, the rollouts whose advantages have the largest variance. A dropped rollout never "
             "reaches the model again.",
    "pods": "inside each group, the rollouts whose rewards have the largest variance (PODS); their advantages are "
            "re-normalised, and the A shown is the full group's. A dropped rollout never reaches the model again.",
    "random": "the share ρs of the step's rollouts, at random (a control).",
}
TOKEN_RULES = {
    "none": "every token of a kept rollout (no token selection): nothing is scored or shaded.",
    "adv_entropy": "the share ρt of the kept rollouts' tokens with the highest score |A|·H (advantage times "
                   "entropy), pooled over the step.",
    "entropy": "the share ρt of the kept rollouts' tokens with the highest entropy H (the 80/20 rule), pooled "
               "over the step.",
}

# Okabe-Ito colours, distinguishable with every common colour-vision deficiency: blue for the score
# (one hue, light to dark, so the order reads without a colour key), vermillion for "trained",
# reddish purple for special tokens.
BLUE, VERMILLION, PURPLE = (0, 114, 178), "#d55e00", "#cc79a7"
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;background:#fff;
 margin:14px 20px;max-width:1160px}
h1{font-size:19px;margin:0 0 8px}
h2{font-size:15px;margin:0 0 4px}
nav,.rule,.legend{margin:4px 0;font-size:13px}
.cards{display:flex;flex-wrap:wrap;gap:8px;margin:8px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:3px 9px}
.card b{display:block;font-size:18px}
.card small{color:#666;font-size:12px}
.warn{background:#fff4e0;border-left:4px solid #e69f00;padding:4px 8px;margin:6px 0}
.legend .key{margin-right:12px;white-space:nowrap}
.gone{color:#a8a8a8}
.group{border-top:1px solid #ccc;margin-top:12px;padding-top:8px}
.q,td.toks{font-family:ui-monospace,Menlo,Consolas,"DejaVu Sans Mono",monospace}
.q{white-space:pre-wrap;background:#f4f4f4;padding:4px 8px;margin:0 0 6px;font-size:13px}
table{border-collapse:collapse;width:100%;table-layout:fixed}
th:nth-child(-n+2){width:46px}
th:nth-child(3){width:72px}
th:nth-child(4){width:64px}
td{padding:2px 6px;vertical-align:top;border-bottom:1px solid #eee;white-space:nowrap;font-size:13px}
th{text-align:left;font-size:12px;color:#666;font-weight:normal;padding:0 6px}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.toks{white-space:normal;overflow-wrap:anywhere;width:100%;line-height:1.4}
tr.dropped td{color:#a8a8a8}
tr.kept td:nth-child(3){font-weight:bold}
u{text-decoration:none;margin-right:1px;padding:1px 0}
tr.dropped u{background:#f2f2f2}
u[class^=d]{color:#5f5f5f}
u[class^=k]{color:#000;font-weight:bold;box-shadow:inset 0 -3px VERMILLION}
.all u[class^=k]{font-weight:normal;box-shadow:inset 0 -1px VERMILLION}
i{font-style:normal;color:#aaa}
.sp{color:PURPLE;border:1px solid PURPLE;border-radius:3px;font-size:11px;padding:0 2px}
tr.dropped .sp{color:#bbb;border-color:#ccc}
""".replace("VERMILLION", VERMILLION).replace("PURPLE", PURPLE)
# the score's shades, lightest to darkest: k0/d0 the lowest eighth of the step's scores .. k7/d7 the highest
CSS += "".join(f".k{b},.d{b}{{background:rgba({BLUE[0]},{BLUE[1]},{BLUE[2]},{0.05 + 0.4 * b / (BINS - 1):.2f})}}\n"
               for b in range(BINS))

WHITESPACE = {" ": "·", "\t": "→", "\n": "↵"}  # shown faint; a newline is also a real line break


def _visible(text):
    """A token's text as HTML with whitespace and control characters made visible, all escaped."""
    if text == "":
        return "<i>∅</i>"  # a token that decodes to nothing (a partial character, say)
    out, faint = [], None  # runs of plain and of faint characters, so "   " is one <i>···</i>
    for c in text:
        mark = WHITESPACE.get(c)
        if mark is None and unicodedata.category(c)[0] in "CZ":  # other spaces, controls: their code
            mark = c.encode("unicode_escape").decode()
        is_faint = mark is not None
        if is_faint != faint:
            out.append("</i>" if faint else "")
            out.append("<i>" if is_faint else "")
            faint = is_faint
        out.append(html.escape(mark if is_faint else c) + ("</i><br><i>" if c == "\n" else ""))
    out.append("</i>" if faint else "")
    return "".join(out).replace("<i></i>", "")


def _stat(stats, key, spec):
    return format(stats[key], spec) if isinstance(stats.get(key), (int, float)) else "?"


def _token(text, trained, score, edges, special):
    """One token as <u class=k5 title=0.83>text</u>: k trained / d not (None: a dropped rollout), then
    its eighth of the step's scores. <u> is HTML's element for text with a non-textual annotation; a
    page can hold 16k tokens, so the markup is short: one class, unquoted values (valid HTML5 when
    they hold no space), the score to 2 digits."""
    cls = ""  # a dropped rollout: no mark, no score
    if trained is not None:
        cls = ("k" if trained else "d") + ("" if score is None else str(bisect.bisect_left(edges, score)))
    attrs = (f' class="{cls} sp"' if cls else ' class=sp') if special else (f" class={cls}" if cls else "")
    attrs += "" if score is None else f" title={score:.2g}"
    return f"<u{attrs}>{html.escape(text) if special else _visible(text)}</u>"


def _rollout_row(r, record):
    """One <tr>: reward, A, kept or dropped, trained tokens, then the tokens."""
    specials, edges = set(record["specials"]), record["score_edges"] or []
    n = len(r["tokens"])
    trained, scores = r["trained"] or [None] * n, r["scores"] or [None] * n  # None: dropped, or nothing scored
    cells = [_token(text, t, s, edges, text in specials) for text, t, s in zip(r["tokens"], trained, scores)]
    count = f"{sum(r['trained'])}/{n}" if r["kept"] else "–"
    status = ("kept" if r["kept"] else "dropped") + ("<br><small>truncated</small>" if r["truncated"] else "")
    reward, adv = f"{r['reward']:g}", f"{r['adv']:+.2f}" if r["adv"] else "0"  # A = 0: no sign to read
    return (f'<tr class="{"kept" if r["kept"] else "dropped"}" data-row="{r["row"]}"><td class="num">{reward}</td>'
            f'<td class="num">{adv}</td><td>{status}</td><td class="num">{count}</td>'
            f'<td class="toks">{"".join(cells)}</td></tr>')


def selection_html(record, links=()):
    """The page of one step's record, as a string: a pure function of the record. links: (label, href)
    pairs for a line of links to other steps' pages."""
    st, e = record["stats"], html.escape
    name, sample, token = record["method"] or "?", record["sample_mode"], record["token_mode"]
    n_right = lambda g: sum(r["reward"] > 0 for r in g["rollouts"])  # noqa: E731
    parts = [f"<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
             f"<title>step {record['step']}: what {e(name)} keeps</title><style>{CSS}</style></head>"
             + ('<body class="all">' if token == "none" else "<body>"),  # every token trained: a quieter mark
             f"<h1>Step {record['step']}: what {e(name)} keeps</h1>"]
    if links:
        nav = [f"<b>{t}</b>" if t == record["step"] else f'<a href="{e(h)}">{e(str(t))}</a>' for t, h in links]
        parts.append("<nav>steps: " + " · ".join(nav) + "</nav>")  # this page's step in bold, not a link
    generated = f" of {st['valid_all']}" if isinstance(st.get("valid_all"), int) else ""
    zero_var = f"{100 * st['zero_var']:.0f}%" if isinstance(st.get("zero_var"), (int, float)) else "?"
    cards = [("ρs · ρt", f"{_stat(st, 'rho_s', '.2f')} · {_stat(st, 'rho_t', '.2f')}", "keep ratios applied"),
             ("rollouts", f"{_stat(st, 'kept', 'd')} / {_stat(st, 'rollouts', 'd')}", "kept / generated"),
             ("tokens", f"{_stat(st, 'tokens', 'd')} / {_stat(st, 'valid', 'd')}", "trained / in kept rollouts"
              + generated),
             ("Var(A)", f"{_stat(st, 'var_adv', '.2f')} → {_stat(st, 'var_kept', '.2f')}", "all → kept rollouts"),
             ("zero-variance groups", zero_var, f"of {record['prompts']}, {record['group_size']} rollouts each"),
             ("reward", _stat(st, "reward", ".2f"), "mean of the rollouts")]
    parts.append('<div class="cards">' + "".join(f"<div class=card><small>{e(a)}</small><b>{e(b)}</b><small>{e(c)}"
                                                 f"</small></div>" for a, b, c in cards) + "</div>")
    if st.get("skipped_reason"):
        parts.append(f'<p class="warn">This step made no update: {e(str(st["skipped_reason"]))}</p>')
    if sample == "none" and token == "none":
        parts.append('<p class="rule"><b>This method keeps every rollout and trains every token of each</b>: all are '
                     'kept and marked trained, nothing is greyed, and nothing is scored.</p>')
    else:
        parts.append(f'<p class="rule"><b>Rollouts kept</b> (sample selection, {e(str(sample))}): '
                     f'{e(SAMPLE_RULES.get(sample, "?"))}<br><b>Tokens trained</b> (token selection, {e(str(token))}): '
                     f'{e(TOKEN_RULES.get(token, "?"))}</p>')

    # the legend, one line: each mark that can appear in the rows below, as it appears there
    shade = (5, 2) if record["score"] else ("", "")
    legend = [f"<u class=k{shade[0]}>trained</u> token"]
    legend += [] if token == "none" else [f"<u class=d{shade[1]}>not trained</u>"]
    legend += [] if sample == "none" else ['<span class="gone">dropped rollout</span>']
    legend += ["<i>·</i> space <i>↵</i> newline", '<span class="sp">special</span>']
    if record["score"] and record["score_cut"] is not None:
        shades = "".join(f"<u class=d{b}>&nbsp;</u>" for b in range(BINS))
        legend.insert(2, f"score {e(record['score'])}: low {shades} high (by eighths; trained from "
                         f"{record['score_cut']:.3g} up)")
    parts.append('<p class="legend">' + " ".join(f'<span class="key">{x}</span>' for x in legend) + "</p>")
    hover = "; hover a token for its score" if record["score"] else ""
    parts.append(f"<p class=rule>{len(record['groups'])} of the step's {record['prompts']} groups (mixed first, then "
                 f"one all-right and one all-wrong group when the step has them). A: the rollout's advantage"
                 f"{hover}.</p>")

    for g in record["groups"]:
        kept = sum(r["kept"] for r in g["rollouts"])
        parts.append(f'<div class="group"><h2>Prompt {g["prompt"]} · {e(g["kind"])}: {n_right(g)} of '
                     f'{len(g["rollouts"])} right · {kept} kept · reference answer '
                     f'<code>{e(g["answer"])}</code></h2><div class="q">{e(g["question"])}</div>'
                     '<table><tr><th>reward</th><th>A</th><th>sample</th><th>trained</th><th>tokens</th></tr>')
        parts += [_rollout_row(r, record) for r in g["rollouts"]]
        parts.append("</table></div>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _write(path, text):
    """Atomic: a reader (a browser refreshing the page) never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _step_name(step):
    return f"step_{step:06d}"


def _write_step_page(run_dir, record):
    """RUN/selection/step_NNNNNN.html, with a link back to RUN/selection.html. -> its path."""
    path = os.path.join(run_dir, "selection", _step_name(record["step"]) + ".html")
    _write(path, selection_html(record, links=[("all steps", "../selection.html")]))
    return path


def _write_top_page(run_dir, record):
    """RUN/selection.html: this record's page, with links to every recorded step's page. -> its path."""
    found = glob.glob(os.path.join(run_dir, "selection", "step_??????.json"))
    steps = sorted(int(os.path.basename(p)[5:11]) for p in found)
    path = os.path.join(run_dir, "selection.html")
    _write(path, selection_html(record, links=[(s, f"selection/{_step_name(s)}.html") for s in steps]))
    return path


def write_selection(run_dir, record):
    """Write RUN/selection/step_NNNNNN.json (the record), its page beside it, and RUN/selection.html
    (this step, linking every recorded step). Returns the path of RUN/selection.html."""
    os.makedirs(os.path.join(run_dir, "selection"), exist_ok=True)
    _write(os.path.join(run_dir, "selection", _step_name(record["step"]) + ".json"),
           json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
    _write_step_page(run_dir, record)
    return _write_top_page(run_dir, record)


def main(argv=None):
    """`python plots.py RUN`: rebuild RUN/curves.png and the selection pages from RUN's files."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python plots.py RUN_FOLDER (a train.py run folder, with its log.jsonl)", file=sys.stderr)
        return 2
    run_dir = argv[0]
    log = os.path.join(run_dir, "log.jsonl")
    records = []
    for path in sorted(glob.glob(os.path.join(run_dir, "selection", "step_??????.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                records.append(json.load(f))
            if not isinstance(records[-1], dict) or records[-1].get("format") != FORMAT:
                raise ValueError(f"its format is not {FORMAT!r}")
        except (OSError, ValueError) as err:
            print(f"plots.py: {path} is not a selection record: {err}", file=sys.stderr)
            return 2
    if not os.path.isfile(log) and not records:
        print(f"plots.py: {run_dir} has neither log.jsonl nor selection/*.json; is it a train.py run folder?",
              file=sys.stderr)
        return 2
    written = []
    try:
        if os.path.isfile(log):
            plot_run(run_dir)
            written.append(os.path.join(run_dir, "curves.png"))
        records.sort(key=lambda r: r["step"])
        written += [_write_step_page(run_dir, r) for r in records]
        if records:  # the top page shows the latest step
            written.append(_write_top_page(run_dir, records[-1]))
    except (KeyError, TypeError, ValueError) as err:
        print(f"plots.py: {run_dir}: cannot rebuild its pictures: {type(err).__name__} {err}", file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
