#!/usr/bin/env bash
# Installs lm-evaluation-harness, the requirement of pyproject.toml's `lmeval` extra, for
# tests/eval/test_harness.py, without changing anything already installed: lm-eval (0.4.11
# and later) requires no torch, and a constraint file pins every installed distribution at
# its installed version (and torch at 2.13.0 when it is absent, as on a fresh machine
# before README's install), so pip can only add packages, or fails saying which installed
# version is in the way. Idempotent: a second run finds the requirement satisfied. In any
# order with .ci/install_sglang.sh, without pip's "dependency conflicts" ERROR (see
# .ci/pip_checked.sh: it fails instead if the install breaks a requirement).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/pip_checked.sh

PY=${PYTHON:-python}

spec=$("$PY" - <<'PYEOF'
import tomllib
with open("pyproject.toml", "rb") as file:
    [spec] = tomllib.load(file)["project"]["optional-dependencies"]["lmeval"]
print(spec)
PYEOF
)

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - > "$constraints" <<'PYEOF'
from importlib.metadata import distributions

pins = {}
for dist in distributions():  # in sys.path order: the first of a name is the one imported
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name and name != "mrp-dlm":
        pins.setdefault(name, dist.version)
pins.setdefault("torch", "2.13.0")
print("\n".join(f"{name}=={version}" for name, version in sorted(pins.items())))
PYEOF

echo "install_lmeval: $spec (installed packages kept at their versions)"
pip_install_checked -c "$constraints" "$spec"
