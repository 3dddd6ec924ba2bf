#!/usr/bin/env bash
# Installs SGLang 0.5.23 for the CPU tests of the mrp-dlm plugin (tests/serving), without
# touching torch: SGLang pins a CUDA torch, so SGLang and the packages that require torch go
# in with --no-deps; what else it imports goes in with its dependencies, under a constraint
# that keeps torch at the installed version (2.13.0 CPU on a fresh machine), pinned as
# SGLang pins them (the rest at the versions these tests ran with).
# Then writes a .pth hook that installs the CPU import stand-ins (triton, torchvision,
# sgl_kernel, soundfile; see mrp_dlm/serving/cpu_standins.py) in every Python process,
# SGLang's subprocesses included, but only when MRP_SGLANG_CPU_STANDINS names that file (the
# tests set it; `mrp serve` needs no hook). Idempotent: a second run checks the versions and
# only rewrites the hook. In any order with .ci/install_lmeval.sh (see .ci/pip_checked.sh).
# A GPU host does not use this script: there, `pip install -e '.[sglang]'` (see docs/serving.md).
set -euo pipefail
source "$(dirname "$0")/pip_checked.sh"

PY=${PYTHON:-python}

# name==version (SGLang's pins first), or a bare name where the machine's own copy is used.
PACKAGES=(
  sglang==0.5.23 apache-tvm-ffi==0.1.11 xgrammar==0.2.7 openai==2.8.0 sentencepiece==0.2.1
  compressed-tensors==0.18.0 transformers==5.19.0
  pybase64==1.5.1 starlette==1.10.0 fastapi==0.165.0 opentelemetry-api==1.45.2
  uvicorn==0.54.0 msgspec==0.23.0 pyzmq==27.3.0 uvloop==0.23.0 dill==0.4.1 loguru==0.7.3
  gguf==0.19.0 httpx==0.28.1 distro==1.9.0 partial-json-parser==0.2.1.1.post7
  setproctitle==1.3.8 prometheus-client==0.26.0 interegular==0.3.3 einops==0.8.2
  tiktoken==0.14.0 python-multipart==0.0.34 xxhash==4.1.0 zstandard==0.25.0
  aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1
  aiosignal==1.4.0 frozenlist==1.8.0
  pydantic orjson requests psutil pyyaml pillow huggingface-hub regex anyio h11 sniffio
  filelock packaging scipy jsonschema safetensors tokenizers numpy tqdm ipython
)

missing=$("$PY" - "${PACKAGES[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name, _, wanted = spec.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have is None or (wanted and have != wanted):
        print(spec)
PYEOF
)
if [ -n "$missing" ]; then
  # Packages that require (CUDA) torch go in without their dependencies; the rest with
  # theirs (a fresh machine has none of them), under a constraint that keeps torch as is.
  nodeps=$(printf '%s\n' $missing | grep -E '^(sglang|xgrammar|compressed-tensors)==' || true)
  withdeps=$(printf '%s\n' $missing | grep -vE '^(sglang|xgrammar|compressed-tensors)==' || true)
  constraints=$(mktemp)
  "$PY" - > "$constraints" <<'PYEOF'
from importlib.metadata import PackageNotFoundError, version
try:
    print(f"torch=={version('torch').split('+')[0]}")
except PackageNotFoundError:
    print("torch==2.13.0")
PYEOF
  echo "install_sglang: installing $(echo $missing | wc -w) package(s)"
  if [ -n "$withdeps" ]; then
    # shellcheck disable=SC2086
    pip_install_checked -c "$constraints" $withdeps
  fi
  if [ -n "$nodeps" ]; then
    # shellcheck disable=SC2086
    "$PY" -m pip install --no-deps $nodeps
  fi
  rm -f "$constraints"
else
  echo "install_sglang: SGLang 0.5.23 and its imports are already installed"
fi

site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$site/mrp_dlm_sglang_cpu.pth" <<'PTH'
import os; os.environ.get("MRP_SGLANG_CPU_STANDINS") and __import__("runpy").run_path(os.environ["MRP_SGLANG_CPU_STANDINS"])
PTH
echo "install_sglang: CPU stand-in hook at $site/mrp_dlm_sglang_cpu.pth"
