"""`.ci/pip_checked.sh`: the install scripts pass pip's list of requirements that were
broken before an install (SGLang's, after its CPU install) and fail on ones it breaks.

pip is a stand-in here: a script answers `-m pip check` from a file and, on
`-m pip install`, records its arguments and swaps in the file of the state after it. The
real orders (SGLang then lm-eval, and back) are measured in throwaway virtual environments;
see docs/evaluation.md.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLEAN = "No broken requirements found."
SGLANG_TORCH = ("sglang 0.5.23 requires torch==2.14.1, but you have torch 2.13.0+cpu which "
                "is incompatible.")
SGLANG_DATASETS = "sglang 0.5.23 requires datasets, which is not installed."
NEW_BREAK = "evaluate 0.4.6 requires dill, which is not installed."
FAKE_PYTHON = """#!/usr/bin/env bash
state=$(dirname "$0")
case "$3" in
  check) cat "$state/check"; [ "$(cat "$state/check")" = "No broken requirements found." ] ;;
  install) shift 3; echo "$@" > "$state/args"; cp "$state/check_after" "$state/check" ;;
esac
"""


def install(tmp_path: Path, before: list[str], after: list[str]) -> subprocess.CompletedProcess:
    """`pip_install_checked -c constraints.txt lm-eval` against the stand-in pip."""
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "check").write_text("\n".join(before) + "\n")
    (tmp_path / "check_after").write_text("\n".join(after) + "\n")
    script = (f"set -euo pipefail; source {ROOT / '.ci' / 'pip_checked.sh'}; PY={python}; "
              "pip_install_checked -c constraints.txt lm-eval")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("before, after, kept", [
    ([SGLANG_DATASETS, SGLANG_TORCH], [SGLANG_TORCH], 1),  # lm-eval after SGLang
    ([CLEAN], [CLEAN], 0),
    ([SGLANG_TORCH], [CLEAN], 0),
])
def test_requirements_broken_before_the_install_pass(tmp_path, before, after, kept):
    done = install(tmp_path, before, after)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "args").read_text().split() == [
        "--no-warn-conflicts", "-c", "constraints.txt", "lm-eval"]
    assert "ERROR" not in done.stdout + done.stderr
    assert (f"({kept} broken before it still are" in done.stdout) == (kept > 0), done.stdout


@pytest.mark.parametrize("before", [[CLEAN], [SGLANG_TORCH]])
def test_a_requirement_the_install_breaks_fails_it(tmp_path, before):
    done = install(tmp_path, before, [line for line in (*before, NEW_BREAK) if line != CLEAN])
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "pip_install_checked: the install broke these requirements:", NEW_BREAK]
