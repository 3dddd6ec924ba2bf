"""`benchmarks/sglang_gpu_acceptance.py`'s decisions, without a GPU: rows left free for
verify copies, one attention backend for both algorithms, the drafts read from the
plugin's own stats line, the backend read from SGLang's /server_info."""

from __future__ import annotations

import importlib.util
import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from mrp_dlm.model.loading import embedded_model_dir
from mrp_dlm.serving.attention_backend import NO_DECODE_GRAPHS
from mrp_dlm.serving.stats import ServingStats

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "sglang_gpu_acceptance.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("sglang_gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_rows_stay_free_for_verify_copies(script):
    args = script.parse_args(["--model", "m", "--head", "h", "--concurrency", "8"])
    assert script.request_rows(args) == 8 * (args.lookahead + 1)
    launched = []

    class Popen:
        def __init__(self, command, **kwargs):
            launched.append(command)

    script.subprocess.Popen, original = Popen, script.subprocess.Popen
    try:
        script.launch(args, "MrpSpeculative", Path("c.yaml"), True, Path("/dev/null"))
    finally:
        script.subprocess.Popen = original
    command = launched[0]
    cap = int(command[command.index("--max-running-requests") + 1])
    assert cap > args.concurrency  # rows free for drafts' verify copies


def test_one_backend_for_both_algorithms(script):
    """SDAR (bf16, head_dim 128 when no config is on disk): FlashInfer, graphs as asked;
    the embedded model (head_dim 32): Triton, decode graphs off (else SGLang would force
    FlashInfer on LowConfidence and the two runs would differ in kernels)."""
    sdar = Namespace(model="JetLM/SDAR-8B-Chat-b16", attention_backend=None)
    assert script.attention_flags(sdar, True) == ["--attention-backend", "flashinfer"]
    embedded = Namespace(model=str(embedded_model_dir()), attention_backend=None)
    assert script.attention_flags(embedded, True) == ["--attention-backend", "triton",
                                                      NO_DECODE_GRAPHS]
    forced = Namespace(model="m", attention_backend="fa3")
    assert script.attention_flags(forced, False) == ["--attention-backend", "fa3"]


def test_drafts_come_from_the_stats_line(script):
    stats = ServingStats("MrpSpeculative")
    assert script.draft_rounds(f"server: {stats.summary()}") == (0, 0)
    stats.record_round(3, 2, self_drafted=1)
    stats.record_round(2, 0)
    log = f"x\nMrpSpeculative: request a ...; server: {stats.summary()}\n"
    assert script.draft_rounds(log) == (2, 5)


def test_the_backend_is_found_in_server_info(script):
    info = json.loads('{"a": 1, "internal_states": [{"x": 2}], '
                      '"server_args": {"attention_backend": "triton"}}')
    assert script.find_key(info, "attention_backend") == "triton"
    assert script.find_key({"a": [1, {"b": None}]}, "attention_backend") is None
