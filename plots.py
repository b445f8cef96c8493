"""
A run's curves, so that a learner sees it learn: RUN/curves.png from RUN/log.jsonl and the held-out
evaluations. train.py calls plot_run at every evaluation and at the end; any run folder can be
re-plotted with `python plots.py RUN`.

Six panels against the step: the mean reward of the rollouts and the held-out accuracy; the share of
rollouts and of tokens kept (D3S's two levels; GRPO keeps all); Var(A) of all rollouts and of the
kept ones (sample selection raises it); the mean entropy of the sampling distribution; the gradient
norm before clipping; and, with several updates per batch, the share of clipped tokens.
"""
import json
import os
import sys

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
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curves.png"))
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        print("usage: python plots.py RUN_FOLDER (a train.py run folder, with its log.jsonl)", file=sys.stderr)
        sys.exit(2)
    plot_run(sys.argv[1])
    print(os.path.join(sys.argv[1], "curves.png"))
