#!/usr/bin/env bash
# What to run on a GPU machine (experiments/speed.md): the GPU check of train.py on a
# Qwen2.5-0.5B-shaped model, then the bench study. Expects .whl (wheels of the pinned packages the
# machine lacks), .tok (the Qwen2.5 tokenizer and GSM8K as NAME/SPLIT.jsonl) and out/tiny (the
# warmed-up tiny model) next to the repository, and $OUT for results.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 240 python3 experiments/gpu_check.py --tokenizer .tok/qwen2.5 --data_dir .tok/data \
    --out /tmp/gpu 2>&1 | grep -v Warning | tail -45
cp /tmp/gpu/summary.json "$OUT/gpu_summary.json"
timeout 330 python3 experiments/bench.py --methods all --seeds 5 --device cuda --jobs 10 \
    --threads 1 --eval_every 10 --out /tmp/bench 2>&1 | tail -15
cp /tmp/bench/results.md /tmp/bench/results.json /tmp/bench/bench.png "$OUT/" 2>/dev/null
ls -la "$OUT"
