#!/usr/bin/env bash
# The GPU check of head training: one `mrp train head` step at the SDAR-1.7B-Chat-b16 shape,
# whole (28 layers, vocabulary 151,936, block 16), on one CUDA GPU, random weights:
# benchmarks/train_step_cost.py with the recipe's settings (docs/training.md: sequence
# 4096, K = 3, head init std 0.2, bfloat16 backbone) at 1, 2 and 4 rows per GPU (a global
# batch of 16 on 8 GPUs is 2 rows each), 1- and 3-layer heads, with and without gradient
# checkpointing. Writes $OUT/train_step/results.jsonl and log.txt. Nothing is downloaded
# or installed; expected well under 8 minutes on one H200 (each run stops at 100 s, the
# whole at 7.5 minutes).
#
#     run(command="bash benchmarks/device_train_step.sh", timeout_s=540)
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT/train_step"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
deadline=$((SECONDS + 450))
for setting in "1 1" "2 1" "4 1" "2 3" "2 3 --grad-checkpointing" "4 3 --grad-checkpointing"; do
    set -- $setting
    rows=$1 head=$2; shift 2
    if [ $SECONDS -ge $deadline ]; then echo "out of time before rows=$rows head=$head $*"; break; fi
    PYTHONUNBUFFERED=1 timeout 100 python3 benchmarks/train_step_cost.py --device cuda --bf16 \
        --preset sdar-1.7b --seq-len 4096 --lookahead 3 --rows "$rows" --head-layers "$head" \
        --warmup 1 --steps 3 "$@" 2>&1 | tee -a "$OUT/train_step/log.txt" | tail -1 \
        | grep '^{' >> "$OUT/train_step/results.jsonl" \
        || echo "rows=$rows head=$head $*: failed (out of memory or time), see log.txt"
done
cat "$OUT/train_step/results.jsonl"
