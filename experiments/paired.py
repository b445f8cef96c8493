"""
Paired per-seed differences between two bench.py studies, method by method: B minus A, for the runs
with the same method and seed (same seed = same prompts), with bench.py's 95% t intervals (one
seed: the difference alone, and a line that says it has no interval). Used by
experiments/study.md to compare K = 4 with K = 1, a fixed mini-batch size with a fixed K, and GSPO
with GRPO's loss.

    python experiments/paired.py out/study/tiny-adamw out/study/tiny-adamw-k
    python experiments/paired.py out/study/controls-tiny:d3s-random out/study/controls-tiny:d3s

STUDY:METHOD pairs one method of A with one method of B (a method against its random twin, say),
seed by seed; the row is named "B's method - A's".

Each side's updates: "K 4", or with a mini-batch size (--minibatch_size M) "M 8 (2.44/step)", the
updates made per step, mean over the steps and seeds. Also prints, from each run's log.jsonl, the
mean share of kept tokens the clip zeroed (clip_frac) and the mean min/max ratio over the steps:
what several updates per step did to the ratio.
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def runs(study):
    """{(method, seed): run} of a study's finished runs; one setting per method (not a tuning
    run)."""
    if not os.path.isfile(os.path.join(study, "results.json")):
        sys.exit(f"{study}: no results.json; pass the --out folder of a bench.py command that "
                 "finished")
    with open(os.path.join(study, "results.json")) as f:
        ok = [r for r in json.load(f)["runs"] if r["error"] is None]
    by = {(r["method"], r["seed"]): r for r in ok}
    if len(by) < len(ok):
        sys.exit(f"{study}: several settings of one method (a tuning run?); pass studies run with "
                 "--tuned or --lr")
    return by


def log_means(run):
    """Mean clip_frac, ratio_min, ratio_max and updates (those made) over the run's steps (from its
    log.jsonl)."""
    with open(os.path.join(run["out_dir"], "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [statistics.mean(r.get(k, 1.0 if k != "clip_frac" else 0.0) for r in rows)
            for k in ("clip_frac", "ratio_min", "ratio_max")] + \
        [statistics.mean(r["updates"] for r in rows)]


def main(a, b):
    from experiments import bench  # here: --help and a wrong call need no torch
    (a, ma), (b, mb) = (s.partition(":")[::2] for s in (a, b))
    ra, rb = runs(a), runs(b)
    if ma or mb:  # one method against another: B's runs renamed to A's method, paired by seed
        if not (ma and mb):
            sys.exit("give a method on both sides (STUDY:METHOD) or on neither")
        name = f"{mb} - {ma}"
        ra = {(name, s): r for (m, s), r in ra.items() if m == ma}
        rb = {(name, s): r for (m, s), r in rb.items() if m == mb}
        if not (ra and rb):
            sys.exit(f"no finished runs of {ma} in {a} or of {mb} in {b}")
    print(f"B minus A, paired by seed; A = {a}{':' + ma if ma else ''}, "
          f"B = {b}{':' + mb if mb else ''}; points, mean ± 95% CI")
    print("| method | seeds | A: updates, lr | B: updates, lr | Δ final | Δ AUC | B better in "
          "| A clip, ratio min-max | B clip, ratio min-max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    alone = []  # the rows of one seed
    for m in dict.fromkeys(k[0] for k in rb):
        pairs = [(ra[k], rb[k]) for k in sorted(rb) if k[0] == m and k in ra]
        if not pairs:
            continue
        d_final = [y["history"][-1]["accuracy"] - x["history"][-1]["accuracy"] for x, y in pairs]
        d_auc = [bench.auc(y["history"]) - bench.auc(x["history"]) for x, y in pairs]
        # "+5.0 ± 63.5", or "+5.0" alone for one seed
        fmt = lambda d: bench.pm(bench.pct(bench.mean_ci(d)), "+")  # noqa: E731
        means = [[statistics.mean(col) for col in zip(*(log_means(p[side]) for p in pairs))]
                 for side in (0, 1)]  # A's runs, B's: clip, ratio min, ratio max, updates

        def setting(side):  # "K 4, 0.0001" or "M 8 (2.44/step), 0.0001"
            run, M = pairs[0][side], pairs[0][side].get("minibatch_size") or 0
            updates = f"M {M} ({means[side][3]:.2f}/step)" if M else f"K {run['updates_per_batch']}"
            return f"{updates}, {run['lr']:g}"
        clip = "{:.3f}, {:.2f}-{:.2f}".format
        print(f"| {m} | {len(pairs)} | {setting(0)} | {setting(1)} | {fmt(d_final)} "
              f"| {fmt(d_auc)} | {sum(d > 0 for d in d_auc)}/{len(pairs)} | {clip(*means[0][:3])} "
              f"| {clip(*means[1][:3])} |")
        if len(pairs) == 1:  # said under the table
            alone.append(m)
    for m in alone:
        print(f"{m}: one seed, so its differences have no interval (a 95% interval needs two or "
              f"more seeds)")


USAGE = ("usage: python experiments/paired.py STUDY_A[:METHOD] STUDY_B[:METHOD]  (two bench.py "
         "--out folders)")

if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(f"{USAGE}\n{__doc__}")
        sys.exit(0)
    if len(sys.argv) != 3:
        sys.exit(USAGE)
    main(*sys.argv[1:])
