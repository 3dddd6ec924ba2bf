"""Test helpers for the SGLang plugin: skip without SGLang, CPU stand-ins, tiny checkpoints.

`require_sglang()` is called at the top of every test module here, before any SGLang
import: it skips the module when SGLang is not installed (install it with
`.ci/install_sglang.sh`), and otherwise installs the CPU import stand-ins (shipped in the
package, `mrp_dlm/serving/cpu_standins.py`) in this process and exports
MRP_SGLANG_CPU_STANDINS so that SGLang's subprocesses install them too (through the `.pth`
hook the install script writes; `mrp serve` needs no hook, see `mrp_dlm/serving/server.py`).

Deliberately not here: expected outputs (every test compares two decoders it runs).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
from pathlib import Path

import pytest

STANDINS = Path(importlib.util.find_spec("mrp_dlm.serving.cpu_standins").origin)  # packaged
NEEDS_STANDINS = False  # no real triton here: SGLang's subprocesses need the .pth hook
HOOK_NAME = "mrp_dlm_sglang_cpu.pth"


def require_sglang() -> None:
    global NEEDS_STANDINS
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (run .ci/install_sglang.sh)", allow_module_level=True)
    if "MRP_SGLANG_CPU_STANDINS" not in os.environ:
        NEEDS_STANDINS = importlib.util.find_spec("triton") is None
    os.environ["MRP_SGLANG_CPU_STANDINS"] = str(STANDINS)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    runpy.run_path(str(STANDINS))


def subprocess_hook_installed() -> bool:
    """True when the `.pth` hook that installs the stand-ins in SGLang's subprocesses exists."""
    import site

    return any((Path(d) / HOOK_NAME).is_file() for d in site.getsitepackages())


def start_engine(model_path, algorithm: str, config_path, max_running_requests: int = 8,
                 tp_size: int = 1):
    """SGLang's offline Engine on CPU (float32, torch_native attention, token ids only);
    with tp_size > 1, that many rank processes (their cores as `mrp serve` binds them)."""
    from importlib.metadata import entry_points

    import sglang

    if "mrp" not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}:
        pytest.fail("the mrp-dlm SGLang plugin is not registered: reinstall with "
                    "`pip install -e .` (a stale mrp_dlm.egg-info in the checkout shadows it)")
    if NEEDS_STANDINS and not subprocess_hook_installed():
        pytest.fail("SGLang's subprocesses need the CPU stand-ins: run .ci/install_sglang.sh")

    sizes = {}
    if tp_size > 1:  # SGLang cannot size the KV pool of a rank bound to a share of the cores
        from mrp_dlm.serving.launch import CPU_BIND_VAR, cpu_binding

        os.environ.setdefault(CPU_BIND_VAR, cpu_binding(sorted(os.sched_getaffinity(0)),
                                                        tp_size))
        sizes = {"max_total_tokens": 16384}
    return sglang.Engine(model_path=str(model_path), device="cpu",
                         attention_backend="torch_native", disable_cuda_graph=True,
                         dtype="float32", skip_tokenizer_init=True, dllm_algorithm=algorithm,
                         dllm_algorithm_config=str(config_path),
                         max_running_requests=max_running_requests, mem_fraction_static=0.05,
                         log_level="info", tp_size=tp_size, **sizes)


def stop_engine(engine) -> None:
    """Shut the engine down, then detach the log handlers SGLang bound to pytest's capture
    streams (its exit hooks log again after pytest closed them)."""
    import logging
    import sys

    engine.shutdown()
    for logger in (logging.getLogger(), logging.getLogger("sglang")):
        for handler in list(logger.handlers):
            stream = getattr(handler, "stream", None)
            if stream is not None and stream not in (sys.__stdout__, sys.__stderr__):
                logger.removeHandler(handler)


def generate_ids(engine, prompts: list[list[int]], max_new_tokens: int,
                 sampling: dict | None = None) -> list[list[int]]:
    """Output ids per prompt, decoded together in one batch: greedy, or with the SGLang
    sampling params `sampling` (temperature, top_p, sampling_seed, ...)."""
    outputs = engine.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": max_new_tokens, "temperature": 0, **(sampling or {})})
    return [list(out["output_ids"]) for out in outputs]


def trim_after_stop(ids: list[int], stop_ids, limit: int) -> list[int]:
    """ids cut to `limit`, then after the first stop id (which stays), as our decoder does."""
    ids = ids[:limit]
    for index, token in enumerate(ids):
        if token in stop_ids:
            return ids[:index + 1]
    return ids


def request_forwards(log_text: str) -> int:
    """Forwards per request, summed: SGLang logs one 'Prefill batch, #new-seq: n' line per
    dLLM forward of n requests (extra verify rows are not requests, so not counted)."""
    import re

    return sum(int(n) for n in re.findall(r"Prefill batch.*?#new-seq: (\d+)", log_text))


def tokens_per_forward(outputs: list[list[int]], log_text: str) -> float:
    """Output tokens per request forward (prefill chunks included), as our stats count."""
    return sum(len(row) for row in outputs) / max(request_forwards(log_text), 1)
