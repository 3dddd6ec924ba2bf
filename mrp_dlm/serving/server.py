"""The SGLang server process of `mrp serve`: `python -m mrp_dlm.serving.server <SGLang flags>`,
which does what `python -m sglang.launch_server` does (load the plugins, run the HTTP
server, kill its process tree on the way out).

On a CPU (SGLANG_USE_CPU_ENGINE=1) this module installs the CPU import stand-ins when it
is imported. SGLang starts its scheduler and detokenizer with the `spawn` start method,
which imports the parent's main module (this one, as `__mp_main__`) in each child before
anything else, so every SGLang process gets the stand-ins without the `.pth` hook of
`.ci/install_sglang.sh`. Hence the work below waits for `__main__`.

Deliberately not here: the choice of flags (see `launch.py`).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    from mrp_dlm.serving import cpu_standins  # noqa: F401  (installs the stand-ins on import)


def main(argv: list[str]) -> None:
    from mrp_dlm.serving.sglang_process import run_server

    run_server(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
