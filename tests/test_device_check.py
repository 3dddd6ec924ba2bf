"""The GPU probe and the one-command GPU check, on a CPU: the probe's dry run fills every
section and passes its schema, its attention arrangements compute the same attention, a
part that overruns is stopped with its whole process group while the summary keeps what
finished, and CI runs the check's dry run (.ci/run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_check  # noqa: E402
import gpu_probe  # noqa: E402
from probe_attention import BACKENDS, arrangements, make_case, reference  # noqa: E402
from probe_modes import counting_syncs  # noqa: E402
from probe_timing import SKIP_NO_CUDA, time_three_ways  # noqa: E402


def test_every_arrangement_computes_the_models_attention():
    """Folded query-head groups, expanded K/V and float masks equal float32 math of the
    model's own call (boolean mask + enable_gqa), padded rows and copies included."""
    for copies in (1, 3):
        case = make_case((6, 2, 8), 5, 4, copies, 12, torch.float32, "cpu")
        assert not case.mask.all() and case.mask.any(dim=2).all()  # padded keys, no empty row
        truth = reference(case)
        for name, call in arrangements(case).items():
            assert torch.allclose(call(), truth, atol=1e-5), name


def test_a_cpu_measures_the_wall_clock_and_says_why_not_the_rest():
    timed = time_three_ways(lambda: torch.ones(3) * 2, "cpu", repeats=2, warmup=1)
    assert isinstance(timed["wall_ms"], float)
    assert {timed[k] for k in ("event_ms", "graph_ms", "graph_equal_eager")} == {SKIP_NO_CUDA}
    failed = time_three_ways(lambda: 1 / 0, "cpu", repeats=1, warmup=0)
    assert failed["wall_ms"].startswith("error: ZeroDivisionError")
    with counting_syncs("cpu") as syncs:
        torch.ones(2).sum().item()
    assert syncs == []


def report(**sections) -> dict:
    return dict(schema_version=1, device="cpu", features={}, sections={
        name: sections.get(name, dict(status="skipped")) for name in gpu_probe.SHARES})


def test_the_schema_check_finds_what_is_missing():
    row = {key: 1 for key in gpu_probe.ROW_KEYS["sdpa"]}
    assert gpu_probe.validate(report(sdpa=dict(status="ok", results=dict(rows=[row])))) == []
    broken = dict(row)
    del broken["max_abs_err"]
    assert gpu_probe.validate(report(sdpa=dict(status="ok", results=dict(rows=[row, broken])))) \
        == ["section sdpa row 1: missing 'max_abs_err'"]
    assert gpu_probe.validate(report(modes=dict(status="ok", results=dict(rows=[])))) \
        == ["section modes: no rows"]
    assert gpu_probe.validate(report(forwards=dict(status="error"))) \
        == ["section forwards: an error without its message"]
    assert gpu_probe.validate(report(forwards=dict(status="done"))) \
        == ["section forwards: missing or unknown status"]
    assert gpu_probe.validate(report(), strict=True)  # a dry run wants every section ok


def sleeper(pid_file: Path) -> device_check.Step:
    """A step that starts a grandchild, writes its pid, and sleeps past any budget."""
    code = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '120']); "
            "open(sys.argv[1], 'w').write(str(child.pid)); print('started', flush=True); "
            "time.sleep(120)")
    return device_check.Step("sleeper", [sys.executable, "-c", code, str(pid_file)])


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie is gone
    except FileNotFoundError:
        return True


def test_a_part_that_overruns_is_stopped_and_the_summary_keeps_the_rest(tmp_path, monkeypatch):
    quick = device_check.Step("quick", [sys.executable, "-c",
                                        "print('hi'); print('{\"answer\": 42}')"])
    fails = device_check.Step("fails", [sys.executable, "-c", "raise SystemExit(3)"])
    parts = [(device_check.Part("probe", [sleeper(tmp_path / "pid"), quick]), 3.0),
             (device_check.Part("costs", [quick]), 30.0),
             (device_check.Part("serve", skip="SGLang is not installed"), 30.0),
             (device_check.Part("train", [quick, fails]), 30.0)]
    monkeypatch.setattr(device_check, "plan", lambda args: parts)
    began = time.monotonic()
    rc = device_check.main(["probe", "costs", "serve", "train", "--out", str(tmp_path)])
    assert time.monotonic() - began < 40
    assert rc == 1  # a step failed
    summary = json.loads((tmp_path / "device_check.json").read_text())
    probe, costs, serve, train = (summary["parts"][name]
                                  for name in ("probe", "costs", "serve", "train"))
    assert [s["status"] for s in probe["steps"]] == ["timed out", "not run: out of time"]
    assert probe["status"] == "timed out" and "started" in probe["steps"][0]["tail"]
    assert train["status"] == "failed" and train["steps"][1]["rc"] == 3
    assert gone(int((tmp_path / "pid").read_text()))  # the grandchild was stopped too
    assert costs["status"] == "ok" and costs["steps"][0]["result"] == {"answer": 42}
    assert serve == dict(status="skipped", note="SGLang is not installed", seconds=0.0,
                         budget_s=30.0, steps=[])
    assert "===== quick" in (tmp_path / "device_check.log").read_text()


def test_parts_and_their_seconds():
    budgets = device_check.BUDGETS
    assert device_check.parse_parts([], dry_run=True) == budgets
    default = device_check.parse_parts([])
    assert list(default) == list(device_check.DEFAULT_PARTS) and "sets" not in default
    assert sum(default.values()) <= device_check.TOTAL < 8 * 60  # the check fits 8 minutes
    assert device_check.parse_parts(["train=300", "costs"]) == {"train": 300.0,
                                                               "costs": budgets["costs"]}
    with pytest.raises(SystemExit, match="unknown part 'gpu'"):
        device_check.parse_parts(["gpu"])


def test_ci_runs_the_dry_run():
    assert "bash benchmarks/device_check.sh --dry-run" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_the_probe_dry_run_fills_every_section(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_probe.py"),
                           "--dry-run", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_probe.json").read_text())
    assert data["schema_problems"] == [] and data["dry_run"]
    sections = data["sections"]
    assert {name: entry["status"] for name, entry in sections.items()} == dict.fromkeys(
        gpu_probe.SHARES, "ok")
    sdpa = sections["sdpa"]["results"]["rows"]
    model_call = [r for r in sdpa if r["arrangement"] == "bool_gqa" and r["backend"] == "math"]
    assert model_call and all(r["works"] and r["max_abs_err"] < 0.05 for r in model_call)
    assert {r["arrangement"] for r in sdpa} >= {"bool_folded", "float_folded", "flex", "fused"}
    assert {r["backend"] for r in sdpa} >= set(BACKENDS)
    forwards = sections["forwards"]["results"]["rows"]
    assert len(forwards) == len(gpu_probe.DRY.sizes) * len(gpu_probe.DRY.batches) * len(
        gpu_probe.DRY.copies)
    assert all(isinstance(r["wall_ms"], float) and r["graph_ms"] == SKIP_NO_CUDA
               for r in forwards)
    modes = sections["modes"]["results"]["rows"]
    lossless = [r for r in modes if r["rule"] is not None]
    assert {r["dtype"] for r in modes} == {"bfloat16", "float32"}
    assert len(lossless) >= 8 and all(r["equal_to_rule"] == "1/1" for r in lossless)
