"""Run untrusted, model-written Python in a throwaway subprocess and report what happened.

Each call starts `python -I -S sandbox_child.py` in its own session (so the whole process
group can be killed), with an empty environment and a fresh temporary working directory
that is deleted afterwards. The child lowers its rlimits (address space, CPU, file size,
processes), tries to unshare the network namespace, installs an audit hook that refuses
sockets, process spawning, ctypes and file-system writes outside its directory, and only then
runs the code; see `sandbox_child.py`. The parent enforces the wall-clock timeout.

Deliberately not here: grading (tasks compare `SandboxResult.value` themselves) and any
claim of real isolation. This stops accidents and sloppy code from a small model, not a
determined attacker; run graders in a container when that matters.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
MAX_STDERR_CHARS = 2000  # how much of the child's stderr an error message quotes


class Outcome(str, enum.Enum):
    """How a sandboxed run ended."""

    OK = "ok"  # ran to the end; `value` holds repr(call) when a call was given
    ERROR = "error"  # exception, syntax error, refused operation or crash
    TIMED_OUT = "timed_out"  # wall-clock or CPU limit hit
    MEMORY_EXCEEDED = "memory_exceeded"  # MemoryError, or killed by the kernel for memory


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    timeout_s: float = 5.0  # wall-clock limit, enforced by killing the process group
    memory_mb: int = 256  # RLIMIT_AS of the child, in MiB
    file_mb: int = 16  # RLIMIT_FSIZE: largest file the child may write, in MiB
    isolate_network: bool = True  # try unshare(CLONE_NEWNET) (best effort, needs root)
    max_value_chars: int = 4000  # repr of the returned value is cut to this length

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 32:
            raise ValueError(f"memory_mb must be >= 32 (the interpreter needs it), "
                             f"got {self.memory_mb}")
        if self.file_mb < 1 or self.max_value_chars < 1:
            raise ValueError("file_mb and max_value_chars must be >= 1")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run; `value` is repr() of the call's return value when `ok`."""

    outcome: Outcome  # how the run ended
    value: str | None = None  # repr of the returned value (ok with a call only)
    error: str | None = None  # exception text or reason, when not ok
    duration_s: float = 0.0  # wall-clock time including process start

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def build_request(code: str, call: str | None, limits: SandboxLimits) -> bytes:
    request = {
        "code": code,
        "call": call,
        "memory_bytes": limits.memory_mb * 2**20,
        # CPU time can only run out after the wall clock, so a CPU kill still means timeout.
        "cpu_seconds": math.ceil(limits.timeout_s) + 1,
        "file_bytes": limits.file_mb * 2**20,
        "isolate_network": limits.isolate_network,
        "max_value_chars": limits.max_value_chars,
    }
    return json.dumps(request).encode()


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group; it is still unreaped, so its pgid is ours."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()


def parse_result(stdout: bytes) -> SandboxResult | None:
    """The child's final JSON line, or None when it died before writing one."""
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    try:
        payload = json.loads(lines[-1])
        return SandboxResult(Outcome(payload["status"]), payload["value"], payload["error"])
    except (ValueError, KeyError, TypeError):
        return None


def classify_crash(returncode: int, stderr: bytes) -> SandboxResult:
    """Outcome of a child that produced no result line."""
    text = stderr.decode(errors="replace")[-MAX_STDERR_CHARS:].strip()
    if returncode == -signal.SIGXCPU:
        return SandboxResult(Outcome.TIMED_OUT, error="CPU time limit exceeded")
    if returncode == -signal.SIGKILL or "MemoryError" in text:
        return SandboxResult(Outcome.MEMORY_EXCEEDED, error=text or "killed")
    reason = f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
    return SandboxResult(Outcome.ERROR, error=f"child died ({reason}): {text}")


def run_child(request: bytes, workdir: str, limits: SandboxLimits) -> SandboxResult:
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", str(CHILD_SCRIPT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        cwd=workdir, env={}, start_new_session=True, close_fds=True,
    )
    try:
        stdout, stderr = process.communicate(request, timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(process)
        process.communicate()
        return SandboxResult(Outcome.TIMED_OUT, error=f"timed out after {limits.timeout_s} s")
    result = parse_result(stdout)
    return result if result is not None else classify_crash(process.returncode, stderr)


def run_python(code: str, call: str | None = None,
               limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code`, then evaluate the expression `call` (e.g. "solve()") in its namespace.

    Never raises for anything the code does: syntax errors, exceptions, refused operations,
    crashes, timeouts and memory blow-ups all come back as a `SandboxResult`.
    """
    start = time.perf_counter()
    request = build_request(code, call, limits)
    with tempfile.TemporaryDirectory(prefix="mrp-sandbox-", ignore_cleanup_errors=True) as workdir:
        result = run_child(request, workdir, limits)
    duration = time.perf_counter() - start
    log.debug("sandbox run: %s in %.3f s", result.outcome.value, duration)
    return SandboxResult(result.outcome, result.value, result.error, duration)


def run_many(codes: Sequence[str], call: str | None = None,
             limits: SandboxLimits = SandboxLimits(),
             max_workers: int | None = None) -> list[SandboxResult]:
    """`run_python` on each program in parallel threads; results keep the input order."""
    if not codes:
        return []
    workers = max_workers or min(len(codes), 2 * (os.cpu_count() or 1), 16)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda code: run_python(code, call, limits), codes))
