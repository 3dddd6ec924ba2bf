"""The modules a fresh Python process holds after a script: the check behind the tests that
say what a module does not import (torch, another package of ours)."""

import json
import os
import subprocess
import sys


def modules_after(script: str) -> set[str]:
    """Every name in `sys.modules` once `script` has run in a new interpreter.

    Without the serving tests' CPU stand-ins, which a .pth file loads (with torch) in every
    process while MRP_SGLANG_CPU_STANDINS is set: a user's shell has no such variable."""
    report = "\nimport json as _json, sys as _sys\nprint(_json.dumps(sorted(_sys.modules)))"
    env = {k: v for k, v in os.environ.items() if k != "MRP_SGLANG_CPU_STANDINS"}
    done = subprocess.run([sys.executable, "-c", script + report], capture_output=True,
                          text=True, check=True, env=env)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))
