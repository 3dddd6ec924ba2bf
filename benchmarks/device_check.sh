#!/usr/bin/env bash
# The GPU check in one command, under 8 minutes on one H200 with nothing downloaded:
# benchmarks/gpu_probe.py first, then round costs at SDAR-1.7B/8B/30B-A3B shapes, the tests
# marked gpu, MrpSpeculative vs LowConfidence served at 1/8/32 requests, and head training
# steps, each part with a hard stop (benchmarks/device_check.py has the parts and their
# seconds). Writes $OUT/device_check.json (one summary, rewritten after every part),
# $OUT/device_check.log and $OUT/gpu_probe.json.
#
# The SDAR shapes read the published configs. Only the checkout travels to the device
# machine, so copy them into .fixtures (git ignores it) and carry it:
#     for d in sdar-4b-chat sdar-8b-chat; do mkdir -p .fixtures/$d
#         cp ../shared/fixtures/$d/{config,generation_config}.json .fixtures/$d/; done
#     run(command="bash benchmarks/device_check.sh", carry=[".fixtures"], timeout_s=540)
# Without them the probe uses the library's presets and the round costs time the embedded
# model only. Parts by name, with more seconds: `bash benchmarks/device_check.sh costs=450`,
# `train=450`, `sets=300` (candidate sets, not in the default check).
# `--dry-run` runs every part at toy sizes on a CPU (CI does: .ci/run), in about 2 minutes.
#
# Usage: bash benchmarks/device_check.sh [--dry-run] [PART[=SECONDS] ...]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 benchmarks/device_check.py "$@"
