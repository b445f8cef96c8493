#!/usr/bin/env bash
# The study of experiments/study.md: does D3S learn faster per step than GRPO? Every command, in
# order.
#
#   bash experiments/study.sh tune       # learning rates (and K) on seeds 100-101: about 70 minutes
#   bash experiments/study.sh run        # the study itself on seeds 0-7: about 100 minutes
#   bash experiments/study.sh weak-tune  # tiny-weak (most groups all wrong): lr and K, ~40 minutes
#   bash experiments/study.sh weak       # tiny-weak on seeds 0-7, GRPO's 100-step check, the step
#                                        # sizes: ~40 minutes
#   bash experiments/study.sh controls   # what D3S buys (tiny, tiny-weak): the random twin, GRPO's
#                                        # seconds, the divisor, a fixed mini-batch size, GSPO
#   bash experiments/study.sh fork-tune  # tiny-fork: each method's lr on seeds 100-101
#   bash experiments/study.sh fork       # tiny-fork on seeds 0-7, in steps and in GRPO's seconds
#   bash experiments/study.sh share      # J: the filter baseline, the informative controls, and
#                                        # the speed-up at every generation share, three worlds
#   bash experiments/study.sh cut        # K: per second priced on each device, equal seconds
#
# On a 2-core machine, two runs at a time with one thread each. bench.py keeps every finished run
# under out/study/ and reuses it when a command is repeated, so an interrupted stage resumes where
# it stopped. Each bench command prints its table and writes results.md, results.json and bench.png.
set -euo pipefail
cd "$(dirname "$0")/.."
C="--eval_size all --eval_every 10 --jobs 2 --threads 1"   # the whole test split, every 10 steps
SIX=grpo,d3s,d2s,d1s-cross,entropy,pods
# momentum 0.9 (train.py); no clip: D3S's larger gradient norm reaches the weights
SGD="--optimizer sgd --grad_clip 0"
WEAK="--model tiny-weak --steps 60 $C"  # the world where most groups start all wrong (tiny.py)
FORK="--model tiny-fork --steps 60 $C"  # the world with a real model's share of forks
BENCH="python experiments/bench.py"
USAGE="usage: bash experiments/study.sh tune|run|weak-tune|weak|controls|fork-tune|fork|share|cut"

case "${1:-}" in
tune)
  # each method's learning rate from the same grid, chosen by AUC on seeds 100-101 (not the
  # reported ones)
  $BENCH --methods $SIX --lr_grid 2.5e-5,5e-5,1e-4,2e-4 --seeds 2 --seed_start 100 --steps 60 $C \
      --out out/study/tune-tiny-adamw
  $BENCH --methods grpo,d3s,d1s-cross,entropy $SGD --lr_grid 3e-4,1e-3,3e-3,1e-2,3e-2 --seeds 2 \
      --seed_start 100 --steps 60 $C --out out/study/tune-tiny-sgd
  # K (updates per step) and the learning rate together, K = 1 included
  $BENCH --methods grpo,d3s --lr_grid 2.5e-5,5e-5,1e-4 --updates_grid 1,2,4 --seeds 2 \
      --seed_start 100 --steps 60 $C --out out/study/tune-tiny-adamw-k
  ;;
run)
  # A: the default world, AdamW, K = 1, every method at its tuned learning rate
  $BENCH --methods $SIX --tuned out/study/tune-tiny-adamw/tuned.json --seeds 8 --steps 60 $C \
      --out out/study/tiny-adamw
  # D: the default world, AdamW, each method's tuned K and learning rate
  $BENCH --methods grpo,d3s --tuned out/study/tune-tiny-adamw-k/tuned.json --seeds 8 --steps 60 $C \
      --out out/study/tiny-adamw-k
  # D, second table: the same under GSPO's sequence ratio and clip range (--loss gspo)
  $BENCH --methods grpo,d3s --loss gspo --tuned out/study/tune-tiny-adamw-k/tuned.json --seeds 8 \
      --steps 60 $C --out out/study/tiny-adamw-k-gspo
  # B: the default world, SGD with momentum, no gradient clip: where a larger gradient norm is a
  #    larger update
  $BENCH --methods grpo,d3s,d1s-cross,entropy $SGD --tuned out/study/tune-tiny-sgd/tuned.json \
      --seeds 8 --steps 60 $C --out out/study/tiny-sgd
  # C: the longer-chain world (8 terms, 50-token solutions), AdamW, the tiny world's learning
  #    rates [a shortcut: not tuned again]; 40 steps, because GRPO is near the ceiling by step 100
  $BENCH --model tiny-long --methods grpo,d3s,d2s --tuned out/study/tune-tiny-adamw/tuned.json \
      --seeds 8 --steps 40 $C --out out/study/long-adamw
  ;;
weak-tune)
  # F: K and lr together for GRPO and D3S on seeds 100-101 ...
  $BENCH $WEAK --methods grpo,d3s --lr_grid 2.5e-5,5e-5,1e-4,2e-4 --updates_grid 1,2,4 --seeds 2 \
      --seed_start 100 --out out/study/tune-weak-k
  # ... then the two halves of D3S, each lr from the same grid at D3S's K [a shortcut: their K is
  # not tuned]
  K=$(python -c 'import json
print(json.load(open("out/study/tune-weak-k/tuned.json"))["updates_per_batch"]["d3s"])')
  $BENCH $WEAK --methods d1s-cross,entropy --lr_grid 2.5e-5,5e-5,1e-4,2e-4 \
      --updates_per_batch "$K" --seeds 2 --seed_start 100 --out out/study/tune-weak-parts
  # one tuned.json for the four methods, what --tuned reads
  python -c 'import json
a, b = (json.load(open(f"out/study/{d}/tuned.json")) for d in ("tune-weak-k", "tune-weak-parts"))
merged = {k: {**a[k], **b[k]} for k in ("lr", "updates_per_batch", "auc")}
json.dump(merged, open("out/study/tune-weak.json", "w"))'
  ;;
weak)
  # F: tiny-weak, AdamW, each method at its tuned lr and K, 8 reported seeds
  $BENCH $WEAK --methods grpo,d3s,d1s-cross,entropy --tuned out/study/tune-weak.json --seeds 8 \
      --out out/study/weak
  # the world's check: GRPO at its tuned lr and K, 100 steps, 3 seeds (the same seeds 0-2 as F's
  # first three)
  $BENCH --model tiny-weak --methods grpo --tuned out/study/tune-weak.json --seeds 3 --steps 100 \
      $C --out out/study/weak-grpo-100
  # G: GRPO and D3S at one setting, lr 5e-5 and K = 4 (D3S's tuned one in both worlds), both
  #    worlds, one code
  $BENCH $WEAK --methods grpo,d3s --lr 5e-5 --updates_per_batch 4 --seeds 8 \
      --out out/study/weak-same
  $BENCH --methods grpo,d3s --lr 5e-5 --updates_per_batch 4 --seeds 8 --steps 60 $C \
      --out out/study/tiny-same
  # how far each update moves the weights (||delta theta||), GRPO against D3S in both worlds, at
  # that setting
  python experiments/step_size.py run --model tiny --lr 5e-5 --updates_per_batch 4 \
      --out out/study/step-tiny.json
  python experiments/step_size.py run --model tiny-weak --lr 5e-5 --updates_per_batch 4 \
      --out out/study/step-weak.json
  python experiments/step_size.py show out/study/step-tiny.json out/study/step-weak.json \
      --png out/study/step-size.png
  ;;
controls)
  # (a) D3S against its random twin (the same ratios, schedule and divisor, rollouts and tokens
  #     drawn uniformly) and (b) against GRPO in GRPO's seconds: both at their tuned setting,
  #     lr 5e-5 and K = 4 in tiny (section D), the twin at D3S's
  $BENCH --methods grpo,d3s,d3s-random --lr 5e-5 --seeds 8 --steps 60 $C --budget seconds \
      --out out/study/controls-tiny
  mkdir -p out/study
  printf '%s' '{"lr": {"grpo": 1e-4, "d3s": 5e-5, "d3s-random": 5e-5, "entropy": 5e-5},
    "updates_per_batch": {"grpo": 2, "d3s": 4, "d3s-random": 4, "entropy": 4}}' \
      > out/study/weak-settings.json  # section F's tuned settings, the twin at D3S's
  $BENCH $WEAK --methods grpo,d3s,d3s-random --tuned out/study/weak-settings.json --seeds 8 \
      --budget seconds --out out/study/controls-weak
  # (c) the divisor: D3S under each paper's (valid: DAPO, TRL, 80/20; seq: GRPO's and GSPO's
  #     papers; kept, ours, is above), the entropy baseline under its paper's (valid) and ours;
  # (d) a fixed mini-batch size (M = 32 rollouts an update, ceil(kept / 32) updates) against K = 4.
  #     lr 5e-5, K = 4: D3S's tuned setting in both worlds, the entropy baseline's in tiny-weak
  #     (in tiny it was tuned at K = 1 only; here it takes D3S's)
  for world in tiny tiny-weak; do
    for div in valid seq; do
      $BENCH --model $world --methods d3s --divisor $div --lr 5e-5 --seeds 8 --steps 60 $C \
          --out out/study/divisor-$world-$div
    done
    for div in valid kept; do
      $BENCH --model $world --methods entropy --divisor $div --lr 5e-5 --seeds 8 --steps 60 $C \
          --out out/study/divisor-$world-entropy-$div
    done
    $BENCH --model $world --methods d3s --minibatch_size 32 --lr 5e-5 --seeds 8 --steps 60 $C \
        --out out/study/minibatch-$world
    if [ $world = tiny ]; then  # GSPO as its paper aggregates it (the sequence mean)
      $BENCH --methods grpo,d3s --loss gspo --lr 5e-5 --seeds 8 --steps 60 $C \
          --out out/study/gspo-tiny
    fi
  done
  # each pair, seed by seed: python experiments/paired.py A B (study.md gives every one)
  ;;
fork-tune)
  # tiny-fork (a fifth of the tokens forks, as in a real model): GRPO's and D3S's lr at K = 4 on
  # seeds 100-101, the random twin at D3S's
  $BENCH $FORK --methods grpo,d3s --lr_grid 2.5e-5,5e-5,1e-4,2e-4 --seeds 2 --seed_start 100 \
      --out out/study/tune-fork
  python -c 'import json
t = json.load(open("out/study/tune-fork/tuned.json"))
for k in ("lr", "updates_per_batch"):
    t[k]["d3s-random"] = t[k]["d3s"]
json.dump(t, open("out/study/fork-settings.json", "w"))'
  ;;
fork)
  # D3S against GRPO per step and in GRPO's seconds, and against its random twin: seeds 0-7
  $BENCH $FORK --methods grpo,d3s,d3s-random --tuned out/study/fork-settings.json --seeds 8 \
      --budget seconds --out out/study/fork
  ;;
share)
  # J: what D3S buys where generation dominates, against GRPO and against GRPO that never forwards
  #    a rollout with A = 0 (grpo-filter), in the three worlds; in tiny and tiny-fork also the
  #    controls that choose among the informative (d3s-random-nonzero: random rollouts from those
  #    with A != 0 and random tokens, D3S's counts; d3s-entropy: D3S's rollouts, tokens by H alone)
  #    and the random twins. Every method at lr 5e-5, K = 4: GRPO's and D3S's tuned setting in tiny
  #    and tiny-fork, D3S's in tiny-weak (where GRPO's tuned one was its tuning noise, section F);
  #    the filter and the controls at it, untuned. Evaluated every 5 steps; in GRPO's seconds too;
  #    then the speed-up at every generation share (experiments/share.py).
  J="--eval_size all --eval_every 5 --jobs 2 --threads 1 --lr 5e-5 --seeds 8 --steps 60"
  FIVE=grpo,grpo-filter,d3s,d3s-entropy,d3s-random-nonzero
  $BENCH --model tiny $J --methods $FIVE --budget seconds --out out/study/share-tiny
  $BENCH --model tiny-fork $J --methods ${FIVE%,*} --budget seconds --out out/study/share-tiny-fork
  $BENCH --model tiny-fork $J --methods $FIVE --out out/study/share-tiny-fork  # results.json: all 5
  for world in tiny tiny-fork; do
    $BENCH --model $world $J --methods d3s-random,d1s-cross-random --out out/study/share-$world-twins
  done
  # GRPO's budget where generation is 80% of its step (a GPU's share, section J), then tiny-weak
  for world in tiny tiny-fork; do
    $BENCH --model $world $J --methods ${FIVE%,*} --budget seconds --share 0.8 \
        --out out/study/share-$world
  done
  for share in "" "--share 0.8"; do
    $BENCH --model tiny-weak $J --methods grpo,grpo-filter,d3s --budget seconds $share \
        --out out/study/share-tiny-weak
  done
  python experiments/share.py out/study/share-tiny out/study/share-tiny-fork \
      out/study/share-tiny-weak --out experiments/figures/share.png --json out/study/share.json
  ;;
cut)
  # K: grpo, grpo-filter and d3s after the update stopped forwarding what it does not train, three
  #    worlds, 12 paired seeds; D3S's lengths are the ones GRPO's 60 steps' seconds afford it on
  #    this CPU (79) and on the H200 (66), planned before the runs (experiments/budget.py plan);
  #    then this CPU's prices, timed on a quiet machine, and the reading (experiments/study_k.py)
  K="--eval_size 400 --eval_every 10 --jobs 2 --threads 1 --lr 5e-5 --seeds 12"
  for world in tiny tiny-fork tiny-weak; do
    $BENCH --model $world $K --methods grpo,grpo-filter --steps 60 --out out/study/cut-$world
    $BENCH --model $world $K --methods d3s --steps 79 --out out/study/cut-$world-d3s-cpu
    $BENCH --model $world $K --methods d3s --steps 66 --out out/study/cut-$world-d3s-h200
  done
  for world in tiny tiny-fork tiny-weak; do  # on an otherwise idle machine
    python experiments/bench_update.py --world $world --threads 1 --steps 3 --rounds 2 \
        --ratios 0.25/0.2,0.375/0.3,0.5/0.4,0.625/0.5,0.75/0.6 --json out/study/update-$world.json
  done
  U=out/study/update
  python experiments/study_k.py --json out/study/k.json \
      --prices tiny=$U-tiny.json,tiny-fork=$U-tiny-fork.json,tiny-weak=$U-tiny-weak.json
  ;;
-h|--help)
  echo "$USAGE"
  ;;
*)
  echo "$USAGE" >&2
  exit 2
  ;;
esac
