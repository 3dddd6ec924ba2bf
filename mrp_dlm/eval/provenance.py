"""Where a result came from: model and head directories, code commit, hardware, peak memory.

Benchmark reports and eval summaries record these so that a number can be traced back to
the weights, the code and the machine that produced it.

Deliberately not here: timing (decode calls time themselves into `DecodeStats`).
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
from pathlib import Path

import torch

from mrp_dlm.pipeline import Pipeline

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when run from one


def head_dir(pipe: Pipeline) -> str | None:
    """The head directory of a pipeline (absolute): the given one, the embedded one, or None."""
    return None if pipe.head_dir is None else str(pipe.head_dir.resolve())


def source_of(task: str, data: str | None, pipe: Pipeline, dtype: str) -> dict:
    """Task, data file, model, head and dtype of a run, as its outputs record them."""
    return dict(task=task, data=str(Path(data).resolve()) if data else None,
                model=str(pipe.directory.resolve()), head=head_dir(pipe), dtype=dtype)


def git_commit() -> str:
    """HEAD of the source checkout ("-dirty" with uncommitted changes); "unknown" if none."""
    if not (SOURCE_ROOT / ".git").exists():
        return "unknown"  # an installed package: no checkout to ask
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=SOURCE_ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=SOURCE_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware(device: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(), device=device)
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def peak_memory(device: str) -> int:
    """Peak bytes: allocated on a CUDA device, else the process's peak resident set."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
