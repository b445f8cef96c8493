"""
Stop real `python train.py` processes at random moments and check that nothing is lost or repeated.

    python experiments/stop_fuzz.py              # 10 runs, a few minutes on a CPU
    python experiments/stop_fuzz.py --runs 20 --seed 1

One uninterrupted tiny-world run first (an evaluation every 2 steps, a checkpoint every step,
K = 2), timed from its first line to its exit. Then each fuzzed run is started and, once it has
printed its first line, hit after a random delay (up to that time, so some signals come as the run
ends or closes) by SIGINT, SIGTERM or SIGHUP, in a third of the cases doubled within 50 ms; it is
resumed (or started again, where no checkpoint exists yet) and hit again, until it finishes. Every
exit must be 0, or 128 + the first signal (130, 143, 129), and no output a traceback. At the end
each run must have logged every step once, with the rewards of the uninterrupted run, the same
held-out evaluations and bit for bit the same final weights (a CPU in float32). One summary line;
exit code 1 when any run differs.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery import tiny  # noqa: E402

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]  # Ctrl-C, a scheduler, a closed terminal
RUN = ["--steps", "6", "--prompts_per_step", "4", "--group_size", "4", "--eval_size", "8",
       "--eval_every", "2", "--save_every", "1", "--updates_per_batch", "2"]


def start(argv):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def outcome(run_dir):
    """(steps logged, rewards, evaluations, weights) of a finished run."""
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    state = torch.load(os.path.join(run_dir, "checkpoint", "trainer.pt"), weights_only=False)
    evals = [(h["step"], h["accuracy"]) for h in state["history"]]
    return ([r["step"] for r in rows], [r["reward"] for r in rows], evals,
            load_file(os.path.join(run_dir, "checkpoint", "model.safetensors")))


def fuzz(run_dir, model, rng, max_delay):
    """Start, stop and resume one run until it finishes; returns (signals, doubled, starts) or
    raises AssertionError on a wrong exit code."""
    signals = doubled = starts = 0
    while True:
        fresh = not os.path.isfile(os.path.join(run_dir, "checkpoint", "trainer.pt"))
        argv = (["--model", model, "--out_dir", run_dir, "--overwrite", "true", *RUN] if fresh
                else ["--resume", run_dir])
        proc, starts = start(argv), starts + 1
        output = [proc.stdout.readline()]  # the first line: the run's handlers are installed
        time.sleep(rng.uniform(0, max_delay))
        first = rng.choice(SIGNALS)
        if proc.poll() is None:
            proc.send_signal(first)
            signals += 1
            if rng.random() < 1 / 3:
                time.sleep(rng.uniform(0, 0.05))
                if proc.poll() is None:
                    proc.send_signal(rng.choice(SIGNALS))
                    doubled += 1
        output += proc.stdout.readlines()
        code = proc.wait()
        assert not any(line.startswith("Traceback") for line in output), \
            f"{run_dir}: a traceback after signal {first}:\n" + "".join(output[-8:])
        if code == 0:
            return signals, doubled, starts
        assert code == 128 + first, f"{run_dir}: exit {code} after signal {first}:\n" + \
            "".join(output[-5:])
        assert starts < 100, f"{run_dir}: not finished after 100 starts"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--runs", type=int, default=10, help="fuzzed runs (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="of the delays and signals")
    parser.add_argument("--max_delay", type=float, default=0.0,
                        help="seconds after the first line, at most, before a signal (default: "
                             "the uninterrupted run's, from its first line to its exit)")
    args = parser.parse_args()
    if args.runs < 1 or args.max_delay < 0:
        parser.error("--runs must be at least 1 and --max_delay at least 0 (0: the run's time)")
    model = tiny.pretrained(os.path.join(ROOT, "out", "tiny"), log=lambda *a: None)
    rng, failed, total = random.Random(args.seed), [], [0, 0, 0]
    with tempfile.TemporaryDirectory() as tmp:
        ref = os.path.join(tmp, "uninterrupted")
        proc = start(["--model", model, "--out_dir", ref, *RUN])
        first = proc.stdout.readline()
        t0 = time.time()
        out, _ = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"error: the uninterrupted run failed:\n{first}{out[-2000:]}")
        want, max_delay = outcome(ref), args.max_delay or time.time() - t0
        for i in range(args.runs):
            run_dir = os.path.join(tmp, f"run{i}")
            try:
                counts = fuzz(run_dir, model, rng, max_delay)
                total = [a + b for a, b in zip(total, counts)]
                got = outcome(run_dir)
                same = got[:3] == want[:3] and all(torch.equal(got[3][k], want[3][k])
                                                   for k in want[3])
                if not same:
                    failed.append(f"run{i}: steps {got[0]}, evals {got[2]}")
            except AssertionError as e:
                failed.append(str(e))
    print(f"stop_fuzz: {args.runs} runs, {total[0]} signals ({total[1]} doubled), {total[2]} "
          f"starts: {args.runs - len(failed)} end as the uninterrupted run (every step logged "
          f"once, the same rewards, evaluations and weights)" + "".join(f"\n  {f}" for f in failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
