"""The GPU check in one command (`bash benchmarks/device_check.sh` runs this): parts in order,
each with a hard stop, one JSON summary rewritten after every part.

Not a test (never collected by pytest). Parts (seconds of each in `BUDGETS`; each part's
steps in order until its seconds are spent, so a part given more runs its whole sweep):
- probe: benchmarks/gpu_probe.py (its own JSON lands in OUT as well);
- costs: benchmarks/round_cost.py at SDAR-1.7B, 8B, 30B-A3B (then embedded, 4B) shapes,
  batch 1/8/32: verify copies 2-8, head steps; one run per size (fixture configs carried);
- tests: the tests marked `gpu` (none: said so);
- serve: benchmarks/sglang_gpu_acceptance.py, MrpSpeculative vs LowConfidence on the
  embedded model and head at 1, 8 and 32 concurrent requests (SGLang absent: skipped);
- train: benchmarks/train_step_cost.py, head training steps at the SDAR-1.7B shape;
- sets (only when named): benchmarks/candidate_sets.py on the embedded model, batch 1, 8.
Each command runs in its own process session, stopped (the whole group) at min(its part's
time left, the check's). OUT gets device_check.json, device_check.log and gpu_probe.json.
`--dry-run`: every part at toy sizes on a CPU (serve only checks the script's flags); any
part not ok fails it (exit 1). A real run exits 1 when a step failed.

    bash benchmarks/device_check.sh [--dry-run] [PART[=SECONDS] ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

BUDGETS = {"probe": 200, "costs": 120, "tests": 40, "serve": 40, "train": 60, "sets": 300}
DEFAULT_PARTS = ("probe", "costs", "tests", "serve", "train")  # sets: only when named
TOTAL = 470  # seconds for the default check: under 8 minutes, with room to write the summary
PROBE_SHARE = 0.85  # of the probe part's seconds given to gpu_probe.py --budget
# Each part's steps in order of priority: a default check runs the first few, a part given
# more seconds (PART=SECONDS) the rest.
COST_SIZES = ("sdar-1.7b", "sdar-8b", "sdar-30b-a3b", "embedded", "sdar-4b")
TRAIN_SETTINGS = (("2", "1"), ("2", "3", "--grad-checkpointing"), ("1", "1"), ("4", "1"),
                  ("2", "3"), ("4", "3", "--grad-checkpointing"))  # rows, head layers, flags
SET_BATCHES = (1, 8)
SERVE_CONCURRENCY = (1, 8, 32)
GPU_MARK = "pytest.mark.gpu"


@dataclass(frozen=True)
class Step:
    label: str  # what the step is, in the summary
    argv: list[str]  # the command
    result_file: Path | None = None  # JSON it writes; else its last output line that is JSON


@dataclass(frozen=True)
class Part:
    name: str  # a BUDGETS key
    steps: list[Step] = field(default_factory=list)
    skip: str | None = None  # why the part does not run
    note: str | None = None  # what a reader of its results should know


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / script), *args]


def probe_part(args: argparse.Namespace, seconds: float) -> Part:
    extra = ["--fixtures", str(args.fixtures)] if args.fixtures else []
    budget = ["--dry-run"] if args.dry_run else ["--budget", str(round(PROBE_SHARE * seconds))]
    return Part("probe", [Step("gpu_probe", python(
        "gpu_probe.py", "--device", args.device, "--out", str(args.out), *budget, *extra),
        args.out / "gpu_probe.json")])


def costs_part(args: argparse.Namespace) -> Part:
    if args.dry_run:
        return Part("costs", [Step("embedded", python(
            "round_cost.py", "--device", args.device, "--sizes", "embedded", "--batches", "1",
            "--repeats", "1", "--warmup", "0", "--prefix", "32"))], note="dry run: embedded, B=1")
    sizes, note = COST_SIZES, None
    if args.fixtures is None:  # round_cost.py reads the SDAR shapes' vocabulary there
        sizes, note = ("embedded",), "no SDAR fixture configs (.fixtures): embedded model only"
    fixtures = ["--fixtures", str(args.fixtures)] if args.fixtures else []
    return Part("costs", [Step(size, python(
        "round_cost.py", "--device", args.device, "--sizes", size, "--batches", "1,8,32",
        "--repeats", "10", *fixtures)) for size in sizes], note=note)


def gpu_test_files() -> list[str]:
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                  if GPU_MARK in path.read_text())


def tests_part(args: argparse.Namespace) -> Part:
    files = gpu_test_files()
    if not files:
        return Part("tests", skip=f"no test is marked gpu ({GPU_MARK})")
    return Part("tests", [Step("pytest -m gpu", [
        sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files])])


def serve_args(concurrency: int) -> list[str]:
    from mrp_dlm.pipeline import embedded_head_dir, embedded_model_dir
    return ["--model", str(embedded_model_dir()), "--head", str(embedded_head_dir()),
            "--block-size", "16", "--concurrency", str(concurrency), "--max-new-tokens", "64"]


def serve_part(args: argparse.Namespace) -> Part:
    if args.dry_run:  # the script needs a GPU: check that it takes the flags the check gives
        check = ("import sys; sys.path[:0] = ['benchmarks']; import sglang_gpu_acceptance as s; "
                 "s.parse_args(sys.argv[1:])")
        return Part("serve", [Step(f"flags, {c} requests", [sys.executable, "-c", check,
                                                           *serve_args(c)])
                              for c in SERVE_CONCURRENCY],
                    note="dry run: the script's flags checked, no server started")
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        return Part("serve", skip="SGLang is not installed on this machine")
    return Part("serve", [Step(f"{c} requests", python("sglang_gpu_acceptance.py",
                                                       *serve_args(c)))
                          for c in SERVE_CONCURRENCY])


def train_part(args: argparse.Namespace) -> Part:
    if args.dry_run:
        return Part("train", [Step("tiny", python(
            "train_step_cost.py", "--device", args.device, "--preset", "tiny", "--seq-len",
            "1024", "--rows", "1", "--head-layers", "1", "--lookahead", "1", "--warmup", "0",
            "--steps", "1"))], note="dry run: the tiny preset")
    return Part("train", [Step(f"rows {rows}, head {head} {' '.join(rest)}".strip(), python(
        "train_step_cost.py", "--device", args.device, "--bf16", "--preset", "sdar-1.7b",
        "--seq-len", "4096", "--lookahead", "3", "--rows", rows, "--head-layers", head,
        "--warmup", "1", "--steps", "2", *rest)) for rows, head, *rest in TRAIN_SETTINGS])


def sets_part(args: argparse.Namespace) -> Part:
    if args.dry_run:
        return Part("sets", [Step("batch 1", python(
            "candidate_sets.py", "--device", args.device, "--problems", "1", "--repeats", "1",
            "--sizes", "1,2", "--batch", "1", "--tasks", "arith", "--thresholds", "1.0",
            "--drafters", "self"))], note="dry run: one problem, self-drafts, sizes 1 and 2")
    return Part("sets", [Step(f"batch {batch}", python(
        "candidate_sets.py", "--device", args.device, "--problems", "3", "--repeats", "2",
        "--sizes", "1,2,4,auto", "--batch", str(batch))) for batch in SET_BATCHES])


def plan(args: argparse.Namespace) -> list[tuple[Part, float]]:
    """The parts asked for, each with its seconds."""
    makers = dict(probe=lambda s: probe_part(args, s), costs=lambda s: costs_part(args),
                  tests=lambda s: tests_part(args), serve=lambda s: serve_part(args),
                  train=lambda s: train_part(args), sets=lambda s: sets_part(args))
    return [(makers[name](seconds), seconds) for name, seconds in args.parts.items()]


def last_json(text: str) -> dict | None:
    """The last line of a command's output that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_step(step: Step, seconds: float, log: Path) -> dict:
    """The step's command, stopped with its whole process group after `seconds`."""
    began = time.monotonic()
    with open(log, "a") as handle:
        handle.write(f"\n===== {step.label}: {' '.join(step.argv)} (stop at {seconds:.0f} s)\n")
        offset = handle.tell()
        handle.flush()
        env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
            filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        child = subprocess.Popen(step.argv, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        try:
            rc, status = child.wait(timeout=max(seconds, 1)), None
        except subprocess.TimeoutExpired:
            rc, status = stop(child), "timed out"
    with open(log) as handle:
        handle.seek(offset)
        output = handle.read()
    status = status or ("ok" if rc == 0 else "failed")
    result = (json.loads(step.result_file.read_text())
              if step.result_file is not None and step.result_file.is_file()
              else last_json(output))
    return dict(label=step.label, status=status, rc=rc,
                seconds=round(time.monotonic() - began, 2), result=result,
                tail=None if status == "ok" else output.strip().splitlines()[-5:])


def stop(child: subprocess.Popen) -> int:
    """Ends the child's process group: SIGTERM, then SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            return child.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return child.wait()


def run_part(part: Part, seconds: float, deadline: float, log: Path) -> dict:
    """The part's steps in order until its seconds (or the check's) are spent. Its status:
    failed (a step exited non-zero, or none ran), timed out (a step was stopped), or ok."""
    if part.skip:
        return dict(status="skipped", note=part.skip, seconds=0.0, budget_s=seconds, steps=[])
    began, steps = time.monotonic(), []
    end = min(began + seconds, deadline)
    for step in part.steps:
        left = end - time.monotonic()
        if left < 1:
            steps.append(dict(label=step.label, status="not run: out of time"))
            continue
        steps.append(run_step(step, left, log))
    ran = {step["status"] for step in steps if not step["status"].startswith("not run")}
    status = ("failed" if not ran or "failed" in ran
              else "timed out" if "timed out" in ran else "ok")
    return dict(status=status, note=part.note, seconds=round(time.monotonic() - began, 2),
                budget_s=seconds, steps=steps)


def machine() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip() or "nvidia-smi printed nothing"
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"no nvidia-smi ({type(error).__name__})"


def write_summary(path: Path, summary: dict) -> None:
    from mrp_dlm.files import write_atomic
    text = json.dumps(summary, indent=1, default=str)
    write_atomic(path, lambda tmp: tmp.write_text(text))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log, path = args.out / "device_check.log", args.out / "device_check.json"
    total = sum(args.parts.values()) if args.named else TOTAL  # named parts: their seconds
    deadline = time.monotonic() + total
    summary = dict(check="device_check", schema_version=1, dry_run=args.dry_run,
                   device=args.device, machine=machine(), fixtures=args.fixtures,
                   budget_s=total, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   parts={name: dict(status="pending") for name in args.parts})
    write_summary(path, summary)
    for part, seconds in plan(args):
        summary["parts"][part.name] = run_part(part, seconds, deadline, log)
        write_summary(path, summary)
        print(f"device_check: {part.name}: {summary['parts'][part.name]['status']} in "
              f"{summary['parts'][part.name]['seconds']} s", file=sys.stderr, flush=True)
    statuses = {name: part["status"] for name, part in summary["parts"].items()}
    print(f"device_check: wrote {path}; {statuses}", file=sys.stderr)
    bad = ("failed",) if not args.dry_run else ("failed", "timed out")  # a dry run must finish
    return 1 if set(statuses.values()) & set(bad) else 0


def parse_parts(items: list[str], dry_run: bool = False) -> dict[str, float]:
    """["costs", "train=300"] -> {"costs": 120, "train": 300.0}; none: `DEFAULT_PARTS` (a dry
    run: every part)."""
    parts = {}
    for item in items or (list(BUDGETS) if dry_run else DEFAULT_PARTS):
        name, _, seconds = item.partition("=")
        if name not in BUDGETS:
            raise SystemExit(f"device_check: unknown part {name!r}; choose from "
                             f"{', '.join(BUDGETS)}")
        parts[name] = float(seconds) if seconds else BUDGETS[name]
    return parts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="PART[=SECONDS]",
                        help=f"parts to run, in order, with their seconds: {BUDGETS}; "
                             f"default: {', '.join(DEFAULT_PARTS)}")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on a CPU")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: $OUT, else runs/device_check)")
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="folder with the SDAR configs (default: .fixtures, then "
                             "../shared/fixtures)")
    args = parser.parse_args(argv)
    args.named = bool(args.parts)
    args.parts = parse_parts(args.parts, args.dry_run)
    args.out = args.out or Path(os.environ.get("OUT") or REPO / "runs" / "device_check")
    from gpu_probe import find_fixtures
    import torch
    args.fixtures = find_fixtures(args.fixtures)
    args.device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    return args


if __name__ == "__main__":
    sys.exit(main())
