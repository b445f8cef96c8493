#!/usr/bin/env bash
# The GPU check (experiments/gpu_check.py) on one GPU machine with no network, in under 8 minutes:
# the check's --budget starts no part after 400 s unless its estimate fits, and `timeout` stops it
# at 450 s whatever happens; OUT/gpu_check/summary.json is rewritten after every run and part, so
# a check cut short keeps what it measured. Results: $OUT/gpu_check/ (summary.json, gpu_check.log,
# each run's config.json and log.jsonl); the random models go to /tmp, not to $OUT.
#
# Prepare on the CPU machine (ignored by git; carried to the device: .whl and .tok, 32 MB):
#   mkdir -p .tok/data && cp -r ../shared/tokenizers/qwen2.5 .tok/ && cp -r ../shared/data/gsm8k .tok/data/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 math-verify==0.9.0 \
#     latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 peft==0.21.2 \
#     regex==2026.11.19 tqdm==4.70.1
#   python experiments/gpu_check.py --dry_run --tokenizer .tok/qwen2.5 --data_dir .tok/data \
#     --out /tmp/gpu_dry                        # every part on the CPU: about a minute
# Then on the device (torch 2.11 there, transformers 5.17 and no datasets: the wheels above):
#   bash experiments/device_run.sh              # carry .whl and .tok; allow it 500 s
# Arguments go to gpu_check.py (e.g. --parts gib24,gib16,lora,float16,update_cost for the parts a
# first run did not start).
set -u
: "${OUT:?set OUT to the folder whose files come back}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout -k 10 450 python3 experiments/gpu_check.py --tokenizer .tok/qwen2.5 --data_dir .tok/data \
    --out "$OUT/gpu_check" --models /tmp/gpu_check_models --budget 400 "$@" 2>&1 \
    | grep -v "^step \|Warning\|warnings.warn" | tail -60
echo "gpu_check.py exit ${PIPESTATUS[0]} (124: stopped by timeout)"
ls -la "$OUT/gpu_check"
