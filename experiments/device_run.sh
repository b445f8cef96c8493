#!/usr/bin/env bash
# What to run on a GPU machine (experiments/speed.md): the GPU check of train.py
# (experiments/gpu_check.py), about 6-7 minutes on one H200 by estimate; its --budget starts no part
# after 420 s, so it ends inside the 10-minute limit of one command. Expects .whl (wheels of the
# pinned packages the machine lacks) and .tok (the Qwen2.5 tokenizer and GSM8K as NAME/SPLIT.jsonl)
# next to the repository, and $OUT for results.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 570 python3 experiments/gpu_check.py --tokenizer .tok/qwen2.5 --data_dir .tok/data \
    --out /tmp/gpu 2>&1 | grep -v Warning | tee "$OUT/gpu_check.log" \
    | grep -v "^step \|^eval step\|^  warnings" | tail -60
cp /tmp/gpu/summary.json "$OUT/gpu_summary.json"
ls -la "$OUT"
