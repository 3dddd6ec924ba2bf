"""How many intra-op threads torch uses for CPU inference, chosen by the model's size.

Every matmul of a forward is a parallel region whose threads meet at a barrier at its end.
When another process holds one of the cores, the thread scheduled there is preempted and
the whole region waits for it. On the 2-core development machine with one busy process, a
forward with 2 threads instead of 1 took up to 50x longer for models of up to a few
million parameters (16x for the embedded model at 16 tokens) and 1.0-1.9x longer from 58M
to 1.7B parameters; idle, a second thread gained 1.3-1.5x below 60M parameters and 1.6-1.9x
above (docs/experiments.md, 2026-11-30). So the automatic rule is

    threads = clamp(parameters // PARAMS_PER_THREAD, 1, usable CPUs - 1)

one thread per PARAMS_PER_THREAD parameters (enough work per thread to pay for its
barrier), never every CPU (a laptop is never idle: the CPU left over absorbs the browser,
the IDE or a test run, so no thread of ours shares a core with it), and at least one. A
2-core machine thus always uses one thread, giving up the idle gain of big models.

Precedence: an explicit request (`mrp ... --threads N`, `Pipeline.load(threads=N)`) wins;
else OMP_NUM_THREADS or MKL_NUM_THREADS, when set, are left in force (torch has applied
them already; they are the standard OpenMP and MKL variables torch reads, and we add none
of our own); else the rule above. CUDA and other non-CPU devices are left alone.

Training (`mrp train head`, `mrp train backbone`, `--threads`) follows the same rule over
the parameters it runs (backbone and head), with the usable CPUs shared among the processes
of a CPU data-parallel run: the quick head's forwards are as small as inference's and
stalled the same way beside a busy process (docs/experiments.md, 2026-12-01).

Deliberately not here: inter-op threads (torch's default is kept) and process pinning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

PARAMS_PER_THREAD = 50_000_000  # a thread pays for its barrier from this much model per thread
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the variables torch itself honours


@dataclass(frozen=True)
class ThreadChoice:
    threads: int | None  # torch intra-op threads to set; None leaves torch's setting alone
    reason: str  # why, for the log


def auto_threads(parameters: int, cpus: int) -> int:
    """One thread per PARAMS_PER_THREAD parameters, between 1 and all CPUs but one."""
    return max(1, min(parameters // PARAMS_PER_THREAD, cpus - 1))


def choose_threads(requested: int | None, parameters: int, device: str,
                   environ: Mapping[str, str], cpus: int) -> ThreadChoice:
    """The thread count for a model of `parameters` on `device`; requested None or 0 is
    automatic. Pure: the caller passes the environment and the usable CPU count."""
    if requested is not None and requested < 0:
        raise ValueError(f"threads must be >= 0 (0 is automatic), got {requested}")
    if torch.device(device).type != "cpu":
        return ThreadChoice(None, f"device {device}: CPU threads left as they are")
    if requested:
        return ThreadChoice(requested, "requested")
    for name in THREAD_ENV_VARS:
        if environ.get(name, "").strip():
            return ThreadChoice(None, f"{name}={environ[name]} is set: torch's "
                                      f"{torch.get_num_threads()} threads kept")
    threads = auto_threads(parameters, cpus)
    return ThreadChoice(threads, f"{parameters / 1e6:.1f}M parameters, {cpus} usable CPUs: "
                                 f"1 thread per {PARAMS_PER_THREAD // 1_000_000}M parameters, "
                                 "at most all CPUs but one")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset or a cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_inference_threads(model: torch.nn.Module, device: str,
                          requested: int | None = None) -> ThreadChoice:
    """Choose the threads for inference with `model` on `device`, apply them, log why."""
    parameters = sum(param.numel() for param in model.parameters())
    return set_threads(parameters, device, requested, usable_cpus())


def set_training_threads(modules: list[torch.nn.Module], device: str, requested: int | None,
                         processes: int = 1) -> ThreadChoice:
    """The same rule for a training process running `modules` (a frozen backbone and the
    trained head, say), one of `processes` on this machine sharing its CPUs."""
    parameters = sum(param.numel() for module in modules for param in module.parameters())
    return set_threads(parameters, device, requested, max(1, usable_cpus() // processes))


def set_threads(parameters: int, device: str, requested: int | None, cpus: int) -> ThreadChoice:
    """Choose the threads for a model of `parameters` on `cpus`, apply them, log why."""
    choice = choose_threads(requested, parameters, device, os.environ, cpus)
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
        log.info("torch threads: %d (%s)", choice.threads, choice.reason)
    else:
        log.info("torch threads: unchanged (%s)", choice.reason)
    return choice
