"""
A run's pictures, so that a learner sees it learn and sees what D3S keeps, and one picture that puts
runs side by side. train.py calls the first two at every evaluation.

    python -m machinery.plots RUN                # rebuild RUN/curves.png and RUN's selection pages
    python -m machinery.plots RUN RUN [RUN ...]  # compare runs: one picture, out/compare.png
    python -m machinery.plots RUN RUN --out PATH # ... written to PATH instead

Each command prints the paths it wrote, one a line. A folder that is not a run is one line on stderr
and exit code 2.

RUN/curves.png (plot_run, curves_figure), from RUN/log.jsonl and the held-out evaluations. Six
panels against the step: the mean reward of the rollouts and the held-out accuracy; the share of
rollouts kept and the share of tokens trained, of the kept rollouts' tokens (rho_t, the step line's
`tokens k/v`) and of all generated tokens (D3S's two levels; GRPO keeps all); Var(A) of all
rollouts and of the kept ones (sample selection raises it); the mean entropy of the sampling
distribution; the gradient norm before clipping; and, with several updates per step, the share of
clipped tokens. A step that made no update has no gradient norm and no clipped share: those two
curves have a gap there. Above the accuracy panel, a second axis gives the seconds of generation +
update spent so far (seconds_at).

The comparison (compare_runs, compare_figure, run_labels): held-out accuracy against the step,
against the tokens trained and against the seconds of generation + update spent before each
evaluation (log.jsonl's t_gen + t_upd summed over the steps before it; evaluation not counted: the
paper's wall-clock unit), the mean reward, the share of rollouts kept and of generated tokens
trained, the tokens trained so far and the seconds spent so far, one line per run. Each line is
labelled by the knobs of its config.json that differ between the runs ("method=grpo" /
"method=d3s"), leaving out the knobs that change nothing computed (config.UNNAMED: out_dir, device,
eval_every, micro_batch_size ...), keep ratios a method does not use and the divisor its method and
loss picked (config.json's picked); runs of one method that d3s.py defined otherwise are labelled
by what changed in its spec (config.json's method_spec: "schedule=constant"). The held-out
accuracy comes from RUN/checkpoint/trainer.pt; a run without one (stopped before its first
checkpoint) is drawn from its log.jsonl alone and its label says so.

RUN/selection.html (selection_record, write_selection, selection_html): one step seen rollout by
rollout and token by token, the picture of what D3S keeps. For a few groups of the step just trained
(pick_groups), each rollout with its reward and advantage A, whether sample selection kept it, and
its tokens as the tokenizer decodes them one by one. Four marks, never confused: a rollout sample
selection dropped (it never reaches the model) is faded and struck through; in a kept rollout each
token is dark text shaded blue by its score (|A|*H for D3S, by eighths of the step's scores), and
the tokens token selection trained are also bold with a thick vermillion bar below; in every
rollout, kept or dropped, a bluish-green triangle above points at each fork, a token sampled with
an entropy above FORK_ENTROPY (0.672 nats, the 80/20 paper's threshold), so a trained fork has a
triangle above and a bar below. Each mark is 6 px, readable at 100% zoom, and the legend shows
each. The header gives the step's forking share and how many forks were trained; the legend names
the score in d3s.TOKEN_MODES' own words (score_name) and says where token selection cut it, and how
many tokens of a tie at the cut it trained. A zero-variance group (all G rewards equal, so A = 0)
that still had rollouts kept says why, and what they train. A page of cross selection ends with a
worked example that d3s computes as the page is written (worked_example): four identical groups, one
right of 8 in each, 4 of 32 kept, which ones and what their A average.
The page is one self-contained file (inline CSS, no script, nothing from the network), rebuilt from
RUN/selection/step_NNNNNN.json, a small record of the groups shown; train.py records only the step
before an evaluation, so the other steps cost nothing.
"""
import argparse
import bisect
import glob
import html
import io
import json
import math
import os
import re
import sys
import unicodedata

import matplotlib
matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402
from PIL import Image  # matplotlib's own dependency  # noqa: E402


def read_log(run_dir):
    """RUN/log.jsonl as a list of rows ([] when there is none)."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rows += [json.loads(line)] if line.strip() else []
            except ValueError:
                raise ValueError(f"{path}, line {n}, is not JSON (a line cut short?)") from None
    return rows


def read_history(run_dir):
    """The held-out evaluations [{step, tokens, accuracy}] saved in RUN/checkpoint/trainer.pt, or
    None when the run has no checkpoint yet."""
    state = os.path.join(run_dir, "checkpoint", "trainer.pt")
    if not os.path.isfile(state):
        return None
    import torch  # only to read a checkpoint: `import plots` stays light
    try:
        # map_location: a GPU run's checkpoint, on any machine
        return torch.load(state, map_location="cpu", weights_only=False)["history"]
    except Exception as err:  # a torn or foreign file: any of pickle's, zipfile's or torch's errors
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"{state} cannot be read ({type(err).__name__}: {first})") from None


def measured(row, key):
    """row[key], or NaN (a gap in the curve) where the step made no update: such a step has no
    gradient norm and no clipped share. Newer logs write null there; older ones wrote 0.0 with
    "updates": 0."""
    value = row.get(key)
    no_update = value is None or row.get("updates") == 0 or row.get("no_signal") is True
    return math.nan if no_update else value


def seconds_at(rows, steps):
    """The seconds of generation + update (log.jsonl's t_gen + t_upd) the run spent before each of
    `steps`: its training time at each evaluation, the evaluations themselves not counted (the
    paper's wall-clock unit)."""
    spent = {r["step"]: r["t_gen"] + r["t_upd"] for r in rows}  # a step logged twice: its last row
    return [sum(t for s, t in spent.items() if s < step) for step in steps]


SECONDS = "seconds of generation + update (t_gen + t_upd)"  # the axis label


def curves_figure(rows, history, title):
    """The figure of curves.png: rows of log.jsonl, history [{step, accuracy}]."""
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), dpi=70)
    (a, b, c), (d, e, g) = axes

    a.plot(steps, [r["reward"] for r in rows], label="reward (mean of the rollouts)", alpha=0.6)
    a.plot([h["step"] for h in history], [h["accuracy"] for h in history], "o-",
           label="held-out accuracy (greedy)")
    a.set_ylim(0, 1)
    if rows:  # the seconds spent by each step on a second axis above: the paper's unit
        ticks = list(range(steps[-1] + 2))
        spent = seconds_at(rows, ticks)
        top = a.secondary_xaxis("top", functions=(lambda x: np.interp(x, ticks, spent),
                                                  lambda t: np.interp(t, spent, ticks)))
        top.set_xlabel(SECONDS, fontsize=8)
    # two token shares, each named by its denominator: the step line's `tokens k/v` is the first
    b.plot(steps, [r["kept"] / r["rollouts"] for r in rows], label="rollouts kept / generated")
    b.plot(steps, [r["tokens"] / max(r["valid"], 1) for r in rows],
           label="tokens trained / kept rollouts' tokens (rho_t)")
    b.plot(steps, [r["tokens"] / max(r["valid_all"], 1) for r in rows],
           label="tokens trained / all generated tokens")
    b.set_ylim(0, 1.05)
    c.plot(steps, [r["var_adv"] for r in rows], label="Var(A), all rollouts")
    c.plot(steps, [r["var_kept"] for r in rows], label="Var(A), kept rollouts")
    d.plot(steps, [r["entropy"] for r in rows],
           label="entropy of softmax(logits / T), kept rollouts")
    e.plot(steps, [measured(r, "grad_norm") for r in rows],
           label="gradient norm (before clipping; gap: no update)")
    g.plot(steps, [measured(r, "clip_frac") for r in rows],
           label="clipped share of kept tokens (gap: no update)")
    g.plot(steps, [r["truncated"] for r in rows], label="truncated rollouts")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    # fixed margins: tight_layout measures every label first and doubled the cost of a plot
    fig.subplots_adjust(left=0.04, right=0.99, top=0.93, bottom=0.08, wspace=0.16, hspace=0.3)
    return fig


def plot_run(run_dir, history=None):
    """Write run_dir/curves.png. history: [{step, accuracy}] (None: read from
    run_dir/checkpoint/trainer.pt)."""
    if history is None:
        history = read_history(run_dir) or []
    fig = curves_figure(read_log(run_dir), history, os.path.basename(os.path.normpath(run_dir)))
    fig.savefig(os.path.join(run_dir, "curves.png"))
    plt.close(fig)


# -----------------------------------------------------------------------------
# runs side by side: `python -m machinery.plots RUN RUN ...`

RATIOS = {"s_init": "sample", "s_final": "sample", "t_init": "token", "t_final": "token"}
OKABE_ITO = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000", "#f0e442"]


def _used(knob, config):
    """Does this run's method use this keep ratio? config.json records 1 (or the 80/20 share) for a
    ratio a method ignores, so "s_init=1" beside "method=grpo" would only repeat the method. Is its
    divisor other than the one its method and loss picked (config.json's picked; a config.json
    from before picked: yes)?"""
    import d3s  # here: `import plots` needs no torch
    method = d3s.METHODS.get(config.get("method"))
    if knob == "divisor":  # the divisor its method and loss picked only repeats them
        return config.get(knob) != config.get("picked", {}).get(knob)
    if knob not in RATIOS or method is None:
        return True
    if method[RATIOS[knob]] == "none" or (RATIOS[knob] == "token" and "t_keep" in method):
        return False
    return knob.endswith("_init") or method["schedule"] != "constant"


def _value(v):
    if isinstance(v, float):
        return f"{v:g}"
    return json.dumps(v) if isinstance(v, (bool, type(None))) else str(v)


def run_labels(configs, names):
    """One label per run: "knob=value, ..." for each knob whose value differs between the runs'
    configs (config.json dicts; None: the run has none), in config order, then what differs in the
    method_spec of runs of one method. A run without a config.json, or whose label would be empty
    or another run's, is named by its folder (names) as well."""
    from machinery import checkpoint, config  # here: `import plots` needs no torch
    # config.UNNAMED: the knobs a run folder's name leaves out, those that change nothing computed
    # (where the run is written, when it reports, where it runs, how it fits in memory), and the
    # method and model, which do change it: two runs that differ only in the others are the same
    # run, so they label nothing. checkpoint.RECORDED is not a knob: the method names its spec,
    # and picked repeats the knobs.
    unlabelled = set(config.UNNAMED) - {"method", "model"} | set(checkpoint.RECORDED)
    have = [c for c in configs if c is not None]
    knobs = list(dict.fromkeys(k for c in have for k in c if k not in unlabelled))
    # where the values a label would use differ; the divisor's wherever they differ: the one a
    # run's method and loss picked labels nothing, a given one beside it does
    differ = [k for k in knobs
              if len({_value(c.get(k)) for c in have if k == "divisor" or _used(k, c)}) > 1]
    # but where runs of one method recorded different specs (d3s.py edited between them), the
    # entries that differ label those runs: "schedule=constant"
    specs = {}
    for c in have:
        if "method_spec" in c:
            specs.setdefault(c.get("method"), []).append(c["method_spec"])
    edited = {m: [k for k in dict.fromkeys(k for sp in sps for k in sp)
                  if len({_value(sp.get(k)) for sp in sps}) > 1] for m, sps in specs.items()}

    def knobs_of(c):  # "knob=value, ..."
        spec = c.get("method_spec") or {}
        return ", ".join([f"{k}={_value(c.get(k))}" for k in differ if _used(k, c)] +
                         [f"{k}={_value(spec.get(k))}" for k in edited.get(c.get("method"), [])
                          if spec])
    labels = [None if c is None else knobs_of(c) for c in configs]
    out = []
    for name, c, label in zip(names, configs, labels):
        if c is None:
            out.append(f"{name} (no config.json)")
        elif not label or labels.count(label) > 1:
            out.append(f"{name}: {label}" if label else name)
        else:
            out.append(label)
    return out


def _trailing_mean(ys, n):
    """The mean of the last n values at each point (fewer at the start)."""
    return [sum(ys[max(0, i + 1 - n):i + 1]) / (i + 1 - max(0, i + 1 - n)) for i in range(len(ys))]


def compare_figure(runs, title, smooth=10):
    """The comparison figure. runs: [{"label", "rows": log.jsonl rows, "history": [{step, tokens,
    accuracy}] or None}]; smooth: the steps the solid reward line averages over."""
    fig, axes = plt.subplots(2, 4, figsize=(19, 7.6), dpi=70)
    (acc_step, acc_tok, acc_sec, reward), (kept, tokens, total, spent) = axes
    for i, run in enumerate(runs):
        style = dict(color=OKABE_ITO[i % len(OKABE_ITO)],
                     linestyle=["-", "--", ":"][i // len(OKABE_ITO) % 3])
        rows, history = run["rows"], run["history"] or []
        no_accuracy = " (no checkpoint: no held-out accuracy)"
        label = run["label"] + ("" if run["history"] is not None else no_accuracy)
        steps = [r["step"] for r in rows]
        acc = [h["accuracy"] for h in history]
        acc_step.plot([h["step"] for h in history], acc, marker="o", ms=4, label=label, **style)
        with_tokens = [h for h in history if "tokens" in h]
        acc_tok.plot([h["tokens"] for h in with_tokens], [h["accuracy"] for h in with_tokens],
                     marker="o", ms=4, **style)
        acc_sec.plot(seconds_at(rows, [h["step"] for h in history]), acc, marker="o", ms=4, **style)
        rewards = [r["reward"] for r in rows]
        reward.plot(steps, rewards, alpha=0.25, lw=1, **style)
        reward.plot(steps, _trailing_mean(rewards, smooth), **style)
        kept.plot(steps, [r["kept"] / r["rollouts"] for r in rows], **style)
        tokens.plot(steps, [r["tokens"] / max(r["valid_all"], 1) for r in rows], **style)
        so_far, n = [], 0
        for r in rows:  # older logs have no tokens_trained: the running sum of the steps' tokens
            n = r.get("tokens_trained", n + r["tokens"])
            so_far.append(n)
        total.plot(steps, so_far, **style)
        spent.plot(steps, seconds_at(rows, [s + 1 for s in steps]), **style)
    titles = [("held-out accuracy (greedy)", "step"),
              ("held-out accuracy (greedy)", "tokens trained"),
              ("held-out accuracy (greedy)", SECONDS),
              (f"mean reward of the rollouts\n(faint: each step; solid: mean of the last {smooth})",
               "step"),
              ("rollouts kept / generated", "step"),
              ("tokens trained / all generated tokens", "step"),
              ("tokens trained so far", "step"),
              ("seconds of generation + update so far", "step")]
    for ax, (name, xlabel) in zip(axes.flat, titles):
        ax.set_title(name, fontsize=11)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    acc_tok.xaxis.set_major_formatter(EngFormatter(sep=""))  # 100k, not 100000
    total.yaxis.set_major_formatter(EngFormatter(sep=""))
    for ax in (acc_step, acc_tok, acc_sec, reward):
        ax.set_ylim(0, 1)
    for ax in (kept, tokens):
        ax.set_ylim(0, 1.05)
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=min(len(runs), 3), fontsize=10,
               frameon=False)
    fig.suptitle(title, y=0.995)
    fig.subplots_adjust(left=0.035, right=0.99, top=0.84, bottom=0.07, wspace=0.2, hspace=0.38)
    return fig


def load_runs(run_dirs):
    """[{"label", "rows", "history"}] for train.py run folders: log.jsonl's rows, the held-out
    evaluations (None: no checkpoint yet) and the label run_labels gives. Raises ValueError (one
    line) for a folder that is not a run."""
    runs, configs = [], []
    for run_dir in run_dirs:
        if not os.path.isdir(run_dir):
            raise ValueError(f"{run_dir} is not a folder; give train.py run folders "
                             f"(out/d3s-tiny ...)")
        rows, history = read_log(run_dir), read_history(run_dir)
        if not rows and history is None:
            raise ValueError(f"{run_dir} has neither log.jsonl nor checkpoint/trainer.pt; is it a "
                             f"train.py run folder?")
        path = os.path.join(run_dir, "config.json")
        config = None
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
        runs.append({"rows": rows, "history": history})
        configs.append(config)
    for run, label in zip(runs, run_labels(configs, [os.path.normpath(r) for r in run_dirs])):
        run["label"] = label
    return runs


def compare_runs(run_dirs, out):
    """Write the comparison of run_dirs (train.py run folders) to `out` (PNG). -> out."""
    runs = load_runs(run_dirs)
    names = ", ".join(os.path.normpath(r) for r in run_dirs)
    fig = compare_figure(runs, f"{names}: each line labelled by what differs in its config.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    # [ours] 64 colours: a picture small enough to commit (about 30 KB instead of 90), the lines
    # unchanged to the eye
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(64).save(out, format="png", optimize=True)
    return out


# -----------------------------------------------------------------------------
# what D3S keeps: the selection page
#
# The record (selection_record -> JSON, RUN/selection/step_NNNNNN.json) holds only the groups shown:
#   {"format": "nanoD3S selection 1", "step", "method", "sample_mode", "token_mode",
#    "prompts": P, "group_size": G, "stats": the step's log row,
#    "score": what the tokens are ranked by (score_name: "|A|·H", "entropy H") | null (nothing
#    scored), "score_max", "score_cut": the highest score of the step's kept rollouts and the
#    lowest score token selection kept, "score_tie": [trained, all] of the kept rollouts' tokens at
#    score_cut (optional: later), "score_edges": the 7 scores that split the step's scored tokens
#    into eighths (all four over the whole step),
#    "specials": the special-token strings among the tokens shown,
#    "forks": {"threshold": FORK_ENTROPY, "tokens": the step's completion tokens, "count": those
#              above the threshold, "trained": those of them token selection trained} (null: no
#              entropy was recorded while sampling; records of before have no "forks"),
#    "groups": [{"prompt": index, "kind": "mixed" | "all right" | "all wrong", "question", "answer",
#                "rollouts": [{"row", "reward", "adv", "kept", "truncated",
#                              "tokens": [str] (each id decoded on its own, valid tokens only),
#                              "trained": [0/1] per token, or null for a dropped rollout,
#                              "scores": [float] per token, or null (dropped, or nothing
#                                        scored),
#                              "forks": [0/1] per token, 1 where the sampling entropy is above
#                                       FORK_ENTROPY, or null (no entropy recorded)}]}]}

FORMAT = "nanoD3S selection 1"  # "forks", "score_tie" came later, optional: older records load
# A "forking" token: one sampled with an entropy above 0.672 nats, the 80/20 paper's threshold
# (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939: 80% of a reasoning model's tokens
# lie below it); the few tokens where the policy decides which way the reasoning goes.
FORK_ENTROPY = 0.672
BINS = 8  # shades of the score, by eighths of the step's scores: 8 CSS classes, short markup
KINDS = ("mixed", "all right", "all wrong")  # the order groups are shown in


def _group_kind(rewards):
    """A group's rewards -> "mixed", or "all right" / "all wrong" for a zero-variance group (all
    rewards equal, A = 0 for all)."""
    if max(rewards) != min(rewards):
        return "mixed"
    return "all right" if rewards[0] > 0 else "all wrong"


def pick_groups(group_rewards, max_groups=4):
    """Which groups the page shows: [(index, kind)], at most max_groups, mixed groups first.

    The rule: the first mixed group, then the first all-right and the first all-wrong zero-variance
    group when the step has them (their A is 0: they show what sample selection drops first), then
    more mixed groups, then any other group, each in the step's order. Shown mixed first, then all
    right, all wrong.
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
    """A float to `digits` significant digits: the page shows two, the record keeps a little
    more."""
    return float(f"{x:.{digits}g}")


def selection_record(tokenizer, rollouts, questions, answers, rewards, adv, idx, token_mask, scores,
                     stats, max_groups=4):
    """
    The selection page's data for one step, as plain JSON-able Python, for a few groups only
    (pick_groups). rollouts: the step's B = P * G rows, group by group; rewards, adv (B,); idx (N,)
    the rows sample selection kept, ascending; token_mask (N, T) the tokens token selection kept,
    for the kept rows in idx order; scores (N, T) the score of each of those tokens, or None when
    the method does no token selection. stats: the step's log row (step, method, rho_s, rho_t, ...).
    Tokens are decoded one id at a time, special tokens included: that is what the model saw.
    """
    ids, mask = rollouts.completion_ids.cpu(), rollouts.completion_mask.cpu()  # (B, T)
    truncated = rollouts.truncated.cpu()  # (B,)
    B, P = ids.shape[0], len(questions)
    if P == 0 or B % P or len(answers) != P:
        raise ValueError(f"selection_record: {B} rollouts, {P} questions and {len(answers)} "
                         f"answers; need B = P * G rollouts laid out group by group and one answer "
                         f"per question")
    G = B // P
    rewards, adv = rewards.detach().float().cpu(), adv.detach().float().cpu()  # (B,)
    idx, token_mask = idx.cpu(), token_mask.cpu()  # (N,), (N, T)
    if rewards.shape != (B,) or adv.shape != (B,) or token_mask.shape != (len(idx), ids.shape[1]):
        raise ValueError(f"selection_record: rewards {tuple(rewards.shape)}, adv "
                         f"{tuple(adv.shape)}, token_mask {tuple(token_mask.shape)}; need ({B},), "
                         f"({B},) and "
                         f"({len(idx)}, {ids.shape[1]})")
    kept_at = {row: n for n, row in enumerate(idx.tolist())}  # row -> its place among the kept rows
    forks = None  # (B, T) bool: sampled above FORK_ENTROPY, padding never
    if rollouts.entropy is not None:
        forks = (rollouts.entropy.detach().float().cpu() > FORK_ENTROPY) & mask
    import d3s  # here, not at the top: rebuilding a page from its JSON needs no torch
    method = stats.get("method")
    modes = d3s.METHODS.get(method, {})  # train.py's row names the modes too; this is for others
    sample_mode = stats.get("sample_mode", modes.get("sample"))
    token_mode = stats.get("token_mode", modes.get("token"))

    score_max = score_cut = score_tie = edges = None
    if scores is not None:
        scores = scores.detach().float().cpu()  # (N, T)
        scored = scores[mask[idx]].sort().values  # every valid token of the kept rows, ascending
        if len(scored):
            score_max = _sig(scored[-1].item())
            # [ours] shades by rank, not by value: a few outliers (large |A| times a rare high H)
            # would otherwise leave almost every token in the lightest shade
            edges = [_sig(scored[b * len(scored) // BINS].item()) for b in range(1, BINS)]
        if token_mask.any():
            cut = scores[token_mask].min()
            score_cut = _sig(cut.item())  # token selection kept all above it
            tied = (scores == cut) & mask[idx]  # the kept rollouts' tokens at the cut: it may
            score_tie = [int((tied & token_mask).sum()), int(tied.sum())]  # keep only some

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
                "row": b, "reward": round(rewards[b].item(), 4), "adv": round(adv[b].item(), 4),
                "kept": n is not None, "truncated": bool(truncated[b]), "tokens": tokens,
                "trained": None if n is None else [int(t) for t in token_mask[n, cols].tolist()],
                "scores": None if n is None or scores is None else [_sig(s) for s in
                                                                    scores[n, cols].tolist()],
                "forks": None if forks is None else forks[b, cols].int().tolist(),
            })
        groups.append({"prompt": g, "kind": kind, "question": str(questions[g]),
                       "answer": str(answers[g]), "rollouts": rows})
    return {
        "format": FORMAT, "step": int(stats["step"]), "method": method, "sample_mode": sample_mode,
        "token_mode": token_mode, "prompts": P, "group_size": G,
        "stats": {k: _plain(v) for k, v in stats.items()},
        "score": None if scores is None else score_name(token_mode),
        "score_max": score_max, "score_cut": score_cut, "score_tie": score_tie,
        "score_edges": edges,
        "specials": sorted(special & shown),
        "forks": None if forks is None else {
            "threshold": FORK_ENTROPY, "tokens": int(mask.sum()), "count": int(forks.sum()),
            "trained": int((forks[idx] & token_mask).sum())},
        "groups": groups,
    }


PAGE_SIGNS = {"rho_s": "ρs", "rho_t": "ρt", "|A| * H": "|A|·H", "!=": "≠"}


def _signs(words):
    for plain, sign in PAGE_SIGNS.items():
        words = words.replace(plain, sign)
    return words


def score_name(mode):
    """What a token mode ranks by, the shading's name, in d3s.TOKEN_MODES' own words ("... the
    highest |A| * H, ..." -> |A|·H), so a mode added there is named where it is defined; else the
    mode's name."""
    import d3s  # here: `import plots` needs no torch
    found = re.search(r"highest (.+?)(?:,| \(|$)", d3s.TOKEN_MODES.get(mode, ""))
    return _signs(found.group(1)) if found else str(mode)


def rule(level, mode, scored=False):
    """The page's words for what a level ("sample" or "token") keeps under a mode: d3s.py's own
    (SAMPLE_MODES, TOKEN_MODES), so a mode is described where it is defined. scored: the step's
    tokens have scores (the record's), so the page shades them."""
    import d3s  # here: `import plots` needs no torch
    words = _signs((d3s.SAMPLE_MODES if level == "sample" else d3s.TOKEN_MODES)[mode])
    if level == "sample" and mode != "none":
        words += ". A dropped rollout never reaches the model again"
    if level == "token" and not scored:
        words += ": nothing is scored or shaded"
    return words[0].upper() + words[1:] + "."

# Okabe-Ito colours, distinguishable with every common colour-vision deficiency: blue for the score
# (one hue, light to dark, so the order reads without a colour key), vermillion for "trained",
# reddish purple for special tokens, bluish green for a fork (a triangle above the token, in every
# rollout: trained, a fork also has the vermillion bar below): two shapes, two colours, two places,
# each MARK px (the lines are spaced for them). Only a dropped rollout is grey (and
# struck through): a kept rollout's tokens that were not trained are dark text, so the two never
# look alike.
BLUE, VERMILLION, PURPLE, GREEN = (0, 114, 178), "#d55e00", "#cc79a7", "#009e73"
MARK = 6  # px: the trained bar's height and the fork triangle's, readable at 100% zoom
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;background:#fff;
 margin:14px 20px;max-width:1160px}
h1{font-size:19px;margin:0 0 8px}
h2{font-size:15px;margin:0 0 4px}
nav,.rule,.legend{margin:4px 0;font-size:13px}
.legend{line-height:32px}
.cards{display:flex;flex-wrap:wrap;gap:8px;margin:8px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:3px 9px}
.card b{display:block;font-size:18px}
.card small{color:#666;font-size:12px}
.why{font-size:13px;margin:2px 0 6px;color:#444}
.warn{background:#fff4e0;border-left:4px solid #e69f00;padding:4px 8px;margin:6px 0}
.legend .key{margin-right:12px;white-space:nowrap}
.group{border-top:1px solid #ccc;margin-top:12px;padding-top:8px}
.q,td.toks{font-family:ui-monospace,Menlo,Consolas,"DejaVu Sans Mono",monospace}
.q{white-space:pre-wrap;background:#f4f4f4;padding:4px 8px;margin:0 0 6px;font-size:13px}
table{border-collapse:collapse;width:100%;table-layout:fixed}
th:nth-child(-n+2){width:46px}
th:nth-child(3){width:72px}
th:nth-child(4){width:64px}
td{padding:2px 6px;vertical-align:top;border-bottom:1px solid #eee;white-space:nowrap;
 font-size:13px}
th{text-align:left;font-size:12px;color:#666;font-weight:normal;padding:0 6px}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.toks{white-space:normal;overflow-wrap:anywhere;width:100%;line-height:32px}
tr.dropped td{color:#a0a0a0}
tr.kept td:nth-child(3){font-weight:bold}
u{text-decoration:none;margin-right:1px;padding:1px 0;position:relative}
tr.dropped u,.gone{color:#a0a0a0;background:#f2f2f2;text-decoration:line-through}
u[class^=d]{color:#222}
u[class^=k]{color:#000;font-weight:bold;box-shadow:0 MARKpx VERMILLION}
.all u[class^=k]{font-weight:normal;box-shadow:0 2px VERMILLION}
i{font-style:normal;color:#aaa}
.sp{color:PURPLE;border:1px solid PURPLE;border-radius:3px;font-size:11px;padding:0 2px}
tr.dropped .sp{color:#bbb;border-color:#ccc}
.example{border-top:1px solid #ccc;margin-top:12px;padding-top:8px}
summary{cursor:pointer;font-size:14px}
.note{font-size:13px;margin:4px 0;color:#444}
table.ex{width:auto;table-layout:auto;margin-top:4px}
.ex th,.ex td{width:auto;padding:1px 8px;text-align:right;font-variant-numeric:tabular-nums}
""".replace("VERMILLION", VERMILLION).replace("PURPLE", PURPLE).replace("MARK", str(MARK))
# the score's shades, lightest to darkest: k0/d0 the lowest eighth of the step's scores .. k7/d7
# the highest; a fork's class is the same with an f (k5f)
CSS += "".join(f".k{b},.d{b},.k{b}f,.d{b}f{{background:rgba({BLUE[0]},{BLUE[1]},{BLUE[2]},"
               f"{0.05 + 0.4 * b / (BINS - 1):.2f})}}\n" for b in range(BINS))
# every fork's class, named one by one (no substring match): f in a dropped rollout, kf / df
# unscored, k0f .. d7f scored; its mark a triangle MARK px high, pointing down at the token
CSS += (",".join(f".{c}f::before" for c in ["", "k", "d", *(f"{m}{b}" for m in "kd" for b in
                                                          range(BINS))])
        + f'{{content:"";position:absolute;left:50%;bottom:100%;margin-left:-{MARK // 2 + 1}px;'
          f"border:solid transparent;border-width:{MARK}px {MARK // 2 + 1}px 0;"
          f"border-top-color:{GREEN}}}\n")

WHITESPACE = {" ": "·", "\t": "→", "\n": "↵"}  # shown faint; a newline is also a real line break


def _visible(text):
    """A token's text as HTML with whitespace and control characters made visible, all escaped."""
    if text == "":
        return "<i>∅</i>"  # a token that decodes to nothing (a partial character, say)
    out, faint = [], None  # runs of plain and of faint characters, so "   " is one <i>···</i>
    for c in text:
        mark = WHITESPACE.get(c)
        if mark is None and unicodedata.category(c)[0] in "CZ":  # other spaces, controls: a code
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


def _token(text, trained, score, edges, special, fork):
    """One token as <u class=k5f title=0.83>text</u>: k trained / d not (None: a dropped rollout),
    then its eighth of the step's scores, then f if it is a fork (FORK_ENTROPY). <u> is HTML's
    element for text with a non-textual annotation; a page can hold 16k tokens, so the markup is
    short: one class, unquoted values (valid HTML5 when they hold no space), the score to 2
    digits."""
    cls = ""  # a dropped rollout: no mark, no score
    if trained is not None:
        shade = "" if score is None else str(bisect.bisect_left(edges, score))
        cls = ("k" if trained else "d") + shade
    cls += "f" if fork else ""
    if special:
        attrs = f' class="{cls} sp"' if cls else " class=sp"
    else:
        attrs = f" class={cls}" if cls else ""
    attrs += "" if score is None else f" title={score:.2g}"
    return f"<u{attrs}>{html.escape(text) if special else _visible(text)}</u>"


def _rollout_row(r, record):
    """One <tr>: reward, A, kept or dropped, trained tokens, then the tokens."""
    specials, edges = set(record["specials"]), record["score_edges"] or []
    n = len(r["tokens"])
    # None: a dropped rollout, or nothing scored
    trained, scores = r["trained"] or [None] * n, r["scores"] or [None] * n
    forks = r.get("forks") or [0] * n  # none: a record of before, or no entropy recorded
    cells = [_token(text, t, s, edges, text in specials, f)
             for text, t, s, f in zip(r["tokens"], trained, scores, forks)]
    count = f"{sum(r['trained'])}/{n}" if r["kept"] else "–"
    state = "kept" if r["kept"] else "dropped"
    status = state + ("<br><small>truncated</small>" if r["truncated"] else "")
    reward, adv = f"{r['reward']:g}", f"{r['adv']:+.2f}" if r["adv"] else "0"  # A = 0: no sign
    return (f'<tr class="{state}" data-row="{r["row"]}"><td class="num">{reward}</td>'
            f'<td class="num">{adv}</td><td>{status}</td><td class="num">{count}</td>'
            f'<td class="toks">{"".join(cells)}</td></tr>')


def _why_kept(g, record):
    """For a zero-variance group (A = 0) with rollouts kept: why sample selection kept them, and
    what they train. One <p>, or "" for any other group."""
    kept = [r for r in g["rollouts"] if r["kept"]]
    if g["kind"] == "mixed" or not kept:
        return ""
    st, sample = record["stats"], record["sample_mode"]
    if sample == "cross":  # A = 0 rollouts are taken only once every A != 0 one is (select_samples)
        known = isinstance(st.get("zero_var"), (int, float)) and isinstance(st.get("rollouts"), int)
        mixed = f"the {round((1 - st['zero_var']) * st['rollouts'])}" if known else "the rollouts"
        why = (f"sample selection, pooled over the step, kept {_stat(st, 'kept', 'd')} of "
               f"{_stat(st, 'rollouts', 'd')} rollouts (ρs {_stat(st, 'rho_s', '.2f')}), more than "
               f"{mixed} in groups with mixed rewards, so it took rollouts with A = 0 too.")
    elif sample in ("intra", "pods"):
        why = ("sample selection keeps the same number of rollouts in every group, a zero-variance "
               "group too.")
    elif sample == "random":
        why = "random sample selection does not look at A."
    else:
        why = "this method keeps every rollout."
    trained = sum(sum(r["trained"]) for r in kept)
    if st.get("skipped_reason"):
        what = "This step made no update, so nothing was trained."
    elif trained == 0:
        what = ("A rollout with A = 0 has nothing to learn, so token selection trains none of its "
                "tokens and its loss is 0.")
    else:  # no token selection, or one that scores by entropy alone: such tokens are in the update
        what = (f"A rollout with A = 0 has nothing to learn: the {trained} tokens marked trained "
                f"here add 0 to the policy loss (only a KL term, β > 0, acts on them), yet each "
                f"counts in the divisor of its update's mean (docs/algorithm.md, the divisor).")
    return (f'<p class="why"><b>Why {len(kept)} kept with A = 0:</b> {html.escape(why)} '
            f'{html.escape(what)}</p>')


def worked_example(groups=4, group_size=8, keep=4):
    """Ties in cross selection, worked by d3s itself: `groups` identical groups, the first of each
    group's group_size rollouts right, and select_samples(..., "cross") keeping `keep` of them
    (rho_s = keep / B). -> {"rewards", "adv", "kept": the rows kept, "mean" and "var": the kept
    A's mean and variance, "var_all": all A's, "group_size"}."""
    import torch  # here: `import plots` needs no torch
    import d3s
    rewards = torch.zeros(groups * group_size)
    rewards[::group_size] = 1.0  # (B,) one right answer per group, the group's first
    adv = d3s.group_advantages(rewards, group_size)
    idx, kept = d3s.select_samples(rewards, adv, group_size, keep / len(rewards), "cross")
    return {"rewards": rewards.tolist(), "adv": adv.tolist(), "kept": idx.tolist(),
            "mean": kept.mean().item(), "var": d3s.population_variance(kept),
            "var_all": d3s.population_variance(adv), "group_size": group_size}


def _example_html(ex):
    """worked_example() as a section of the page, closed until clicked: each group a row of its
    rollouts (reward · A), those dropped struck through, then what was kept and why."""
    G, B, kept = ex["group_size"], len(ex["rewards"]), ex["kept"]
    rows = []
    for g in range(B // G):
        cells = [f"{ex['rewards'][b]:g} · {ex['adv'][b]:+.2f}" for b in range(g * G, (g + 1) * G)]
        rows.append(f"<tr><th>group {g}</th>" + "".join(
            f"<td><b>{c}</b></td>" if g * G + j in kept else f'<td><span class="gone">{c}</span>'
            f"</td>" for j, c in enumerate(cells)) + "</tr>")
    right = [b for b in kept if ex["rewards"][b] > 0]
    which = ", ".join(f"group {b // G}'s rollout {b % G} ({'right' if b in right else 'wrong'}, "
                      f"A {ex['adv'][b]:+.2f})" for b in kept)
    alone = [b // G for b in right if not any(k // G == b // G for k in kept if k not in right)]
    text = (f"{B // G} identical groups, one right answer of {G} in each, and cross selection "
            f"keeping {len(kept)} of {B} (ρs = {len(kept)}/{B}): the {len(kept)} whose A have the "
            f"largest variance, {ex['var']:.2f} (all {B}: {ex['var_all']:.2f}), are {len(right)} "
            f"right and {len(kept) - len(right)} wrong. Every right rollout has the same A, and "
            f"every wrong one, so which of them are kept falls to the tie-break: "
            f"d3s.select_samples keeps {which}.")
    if alone:
        many = len(alone) > 1
        text += (f" The right answer{'s of groups' if many else ' of group'} "
                 f"{' and '.join(map(str, alone))} {'are' if many else 'is'} trained without "
                 f"any of {'their' if many else 'its'} group's wrong ones.")
    text += f" The kept A average {ex['mean']:+.2f}" + (
        ", not 0: the kept rollouts' loss is not centred on the groups' baseline."
        if abs(ex["mean"]) > 1e-6 else ", centred as the groups' are.")
    return ('<details class="example"><summary><b>A worked example: ties in cross selection</b> '
            '(computed by d3s.py when this page was written)</summary><p class="note">'
            f'{html.escape(text)}</p><table class="ex"><tr><th>reward · A</th>'
            + "".join(f"<th>{j}</th>" for j in range(G)) + "</tr>" + "".join(rows)
            + "</table></details>")


def selection_html(record, links=()):
    """The page of one step's record, as a string: a pure function of the record. links: (label,
    href) pairs for a line of links to other steps' pages."""
    st, e = record["stats"], html.escape
    name, sample, token = record["method"] or "?", record["sample_mode"], record["token_mode"]
    n_right = lambda g: sum(r["reward"] > 0 for r in g["rollouts"])  # noqa: E731
    parts = [f"<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
             f"<title>step {record['step']}: what {e(name)} keeps</title>"
             f"<style>{CSS}</style></head>"
             + ('<body class="all">' if token == "none" else "<body>"),  # all trained: quieter
             f"<h1>Step {record['step']}: what {e(name)} keeps</h1>"]
    if links:
        nav = [f"<b>{t}</b>" if t == record["step"] else f'<a href="{e(h)}">{e(str(t))}</a>'
               for t, h in links]
        parts.append("<nav>steps: " + " · ".join(nav) + "</nav>")  # this page's step in bold
    generated = f" of {st['valid_all']}" if isinstance(st.get("valid_all"), int) else ""
    zero_var = "?"
    if isinstance(st.get("zero_var"), (int, float)):
        zero_var = f"{100 * st['zero_var']:.0f}%"
    cards = [("ρs · ρt", f"{_stat(st, 'rho_s', '.2f')} · {_stat(st, 'rho_t', '.2f')}",
              "keep ratios applied"),
             ("rollouts", f"{_stat(st, 'kept', 'd')} / {_stat(st, 'rollouts', 'd')}",
              "kept / generated"),
             ("tokens", f"{_stat(st, 'tokens', 'd')} / {_stat(st, 'valid', 'd')}",
              "trained / in kept rollouts" + generated),
             ("Var(A)", f"{_stat(st, 'var_adv', '.2f')} → {_stat(st, 'var_kept', '.2f')}",
              "all → kept rollouts"),
             ("zero-variance groups", zero_var,
              f"of {record['prompts']}, {record['group_size']} rollouts each"),
             ("reward", _stat(st, "reward", ".2f"), "mean of the rollouts")]
    forks = record.get("forks")  # none: a record of before, or no entropy recorded
    if forks:
        cards.append(("forking tokens", f"{100 * forks['count'] / max(forks['tokens'], 1):.1f}%",
                      f"H > {forks['threshold']:g} nats · {forks['trained']} of "
                      f"{forks['count']} trained"))
    parts.append('<div class="cards">' + "".join(f"<div class=card><small>{e(a)}</small><b>{e(b)}"
                                                 f"</b><small>{e(c)}</small></div>"
                                                 for a, b, c in cards) + "</div>")
    if st.get("skipped_reason"):
        parts.append(f'<p class="warn">This step made no update: '
                     f'{e(str(st["skipped_reason"]))}</p>')
    if sample == "none" and token == "none":
        parts.append('<p class="rule"><b>This method keeps every rollout and trains every token '
                     'of each</b>: all are kept and marked trained, nothing is struck out, and '
                     'nothing is scored.</p>')
    else:
        parts.append(f'<p class="rule"><b>Rollouts kept</b> (sample selection, {e(str(sample))}): '
                     f'{e(rule("sample", sample))}<br><b>Tokens trained</b> '
                     f'(token selection, {e(str(token))}): '
                     f'{e(rule("token", token, scored=bool(record["score"])))}</p>')

    # the legend: each mark that can appear in the rows below, styled by the rules that style them
    shade = (5, 2) if record["score"] else ("", "")
    legend = [f"<u class=k{shade[0]}>trained</u> token"]
    if token != "none":
        legend.append(f"<u class=d{shade[1]}>not trained</u> token of a kept rollout")
    if sample != "none":
        legend.append('<span class="gone">dropped</span> rollout (sample selection: it never '
                      'reaches the model)')
    if forks:  # a fork not trained occurs only where token selection leaves tokens out
        sample = ("" if token == "none" else f"<u class=d{shade[1]}f>fork</u> / ") + \
            f"<u class=k{shade[0]}f>trained</u> fork"
        legend.append(f"{sample}: a token sampled with entropy H > {forks['threshold']:g} nats "
                      "(the 80/20 paper's forking threshold), in every rollout shown")
    legend += ["<i>·</i> space <i>↵</i> newline", '<span class="sp">special</span>']
    if record["score"] and record["score_cut"] is not None:
        shades = "".join(f"<u class=d{b}>&nbsp;</u>" for b in range(BINS))
        cut, tie = record["score_cut"], record.get("score_tie")  # none: a record of before
        trained = f"trained from {cut:.3g} up"
        if tie and tie[0] < tie[1]:  # the cut split a tie: "from 0 up" would claim them all
            trained = (f"trained: every token above {cut:.3g}, and {tie[0]} of the {tie[1]} at "
                       f"{cut:.3g}, a tie broken any way")
        legend.insert(2, f"score {e(record['score'])}: low {shades} high (by eighths; "
                         f"{e(trained)})")
    parts.append('<p class="legend">' + " ".join(f'<span class="key">{x}</span>' for x in legend)
                 + "</p>")
    hover = "; hover a token for its score" if record["score"] else ""
    parts.append(f"<p class=rule>{len(record['groups'])} of the step's {record['prompts']} groups "
                 f"(mixed first, then one all-right and one all-wrong zero-variance group when the "
                 f"step has them). A: the rollout's advantage{hover}.</p>")

    for g in record["groups"]:
        kept = sum(r["kept"] for r in g["rollouts"])
        kind = g["kind"] if g["kind"] == "mixed" else f"zero-variance group ({g['kind']})"
        parts.append(f'<div class="group"><h2>Prompt {g["prompt"]} · {e(kind)}: {n_right(g)} of '
                     f'{len(g["rollouts"])} right · {kept} kept · reference answer '
                     f'<code>{e(g["answer"])}</code></h2>{_why_kept(g, record)}'
                     f'<div class="q">{e(g["question"])}</div><table><tr><th>reward</th><th>A</th>'
                     '<th>sample</th><th>trained</th><th>tokens</th></tr>')
        parts += [_rollout_row(r, record) for r in g["rollouts"]]
        parts.append("</table></div>")
    if record["sample_mode"] == "cross":  # how it breaks ties, seen where it acts
        parts.append(_example_html(worked_example()))
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
    """RUN/selection.html: this record's page, with links to every recorded step's page. -> its
    path."""
    found = glob.glob(os.path.join(run_dir, "selection", "step_??????.json"))
    steps = sorted(int(os.path.basename(p)[5:11]) for p in found)
    path = os.path.join(run_dir, "selection.html")
    links = [(s, f"selection/{_step_name(s)}.html") for s in steps]
    _write(path, selection_html(record, links=links))
    return path


def write_selection(run_dir, record):
    """Write RUN/selection/step_NNNNNN.json (the record), its page beside it, and RUN/selection.html
    (this step, linking every recorded step). Returns the path of RUN/selection.html."""
    os.makedirs(os.path.join(run_dir, "selection"), exist_ok=True)
    _write(os.path.join(run_dir, "selection", _step_name(record["step"]) + ".json"),
           json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
    _write_step_page(run_dir, record)
    return _write_top_page(run_dir, record)


class OneLineParser(argparse.ArgumentParser):
    """A bad command line is one line on stderr and exit code 2, like a bad run folder."""

    def error(self, message):
        print(f"plots.py: {message} (python -m machinery.plots --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv):
    parser = OneLineParser(
        prog="python -m machinery.plots", description="One RUN: rebuild RUN/curves.png and "
        "RUN/selection.html (and its step pages) from the run's files. Two or more: one picture "
        "comparing them (held-out accuracy against step, tokens trained and seconds of generation "
        "+ update, mean reward, rollouts kept / generated, tokens trained / generated), each line "
        "labelled by what differs between the runs' config.json. Prints the paths it wrote.")
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="a train.py run folder (out/d3s-tiny ...)")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="where the comparison of two or more runs is written "
                             "(default out/compare.png)")
    return parser.parse_args(argv)


def main(argv=None):
    """`python -m machinery.plots RUN`: rebuild RUN/curves.png and the selection pages from RUN's
    files. `python -m machinery.plots RUN RUN ... [--out PATH]`: the comparison picture. -> exit
    code (2: bad input)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if len(args.runs) > 1:
        try:
            print(compare_runs(args.runs, args.out or os.path.join("out", "compare.png")))
        except (OSError, KeyError, TypeError, ValueError) as err:  # json's and a bad row's too
            print(f"plots.py: cannot compare these runs: {type(err).__name__} {err}",
                  file=sys.stderr)
            return 2
        return 0
    if args.out is not None:
        print("plots.py: --out names the comparison of two or more runs; with one RUN plots.py "
              "rebuilds RUN/curves.png and RUN/selection.html", file=sys.stderr)
        return 2
    run_dir = args.runs[0]
    if not os.path.isdir(run_dir):
        print(f"plots.py: {run_dir} is not a folder; give a train.py run folder (out/d3s-tiny ...)",
              file=sys.stderr)
        return 2
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
        print(f"plots.py: {run_dir} has neither log.jsonl nor selection/*.json; is it a train.py "
              f"run folder?", file=sys.stderr)
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
        print(f"plots.py: {run_dir}: cannot rebuild its pictures: {type(err).__name__} {err}",
              file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
