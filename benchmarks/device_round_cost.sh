#!/usr/bin/env bash
# The GPU check of speculation's round cost: benchmarks/round_cost.py on one CUDA GPU, every size
# (embedded; sdar-1.7b, sdar-4b, sdar-8b built whole when they fit) at batch 1, 8 and 32,
# in bfloat16: verify forwards of 2-6 and 8 copies (a FreeDave-sized candidate set), head
# steps, and the projected speed of head drafts and of self-drafts (no head: a round costs
# its verify copies only). Writes $OUT/round_cost/round_cost.json, round_cost.md and log.txt.
# Expected well under 8 minutes on one H200 (a hard stop at 7.5); nothing is installed:
# the script puts the checkout on sys.path, and the machine's python3 has torch,
# safetensors, tokenizers and jinja2.
#
# The SDAR shapes read the published configs (../shared/fixtures beside the checkout).
# Only the checkout travels to the device machine, so copy the two configs into a folder
# git ignores and carry it (never commit them):
#     echo /.fixtures/ >> .git/info/exclude
#     for d in sdar-4b-chat sdar-8b-chat; do mkdir -p .fixtures/$d
#         cp ../shared/fixtures/$d/{config,generation_config}.json .fixtures/$d/; done
#     run(command="bash benchmarks/device_round_cost.sh", carry=[".fixtures"], timeout_s=540)
# Without them (and without ../shared/fixtures) only the embedded model is timed.
#
# Usage: bash benchmarks/device_round_cost.sh [FIXTURES_DIR]
set -euo pipefail
: "${OUT:?OUT must name the output folder}"
cd "$(dirname "$0")/.."
fixtures=${1:-}
for candidate in .fixtures ../shared/fixtures; do
    if [ -z "$fixtures" ] && [ -d "$candidate/sdar-8b-chat" ]; then fixtures=$candidate; fi
done
sizes=embedded,sdar-1.7b,sdar-4b,sdar-8b
if [ -z "$fixtures" ]; then
    echo "no published SDAR configs (.fixtures or ../shared/fixtures): timing embedded only" >&2
    sizes=embedded fixtures=.
fi
mkdir -p "$OUT/round_cost"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
PYTHONUNBUFFERED=1 timeout 450 python3 benchmarks/round_cost.py --device cuda \
    --sizes "$sizes" --batches 1,8,32 --fixtures "$fixtures" --out "$OUT/round_cost" \
    2>&1 | tee "$OUT/round_cost/log.txt"
