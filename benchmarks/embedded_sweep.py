"""Train candidate embedded backbones side by side on one GPU, grade them, train heads.

Every candidate recipe is CPU-feasible: the same model preset and the same tokens as the
90-minute CPU recipe of docs/experiments.md (4200 steps of 16 x 256, or the same tokens
in bigger batches); the GPU only runs the recipes faster and in parallel. Phases, each
with a deadline measured from the start (`--budget` seconds in all):

  1. `mrp train backbone` for every variant in `--variants` (default: all of VARIANTS),
     all at once (until `--train-until`, default 62% of the budget);
  2. `mrp bench` of each backbone that saved a checkpoint, on arith and arith-code, 500
     held-out problems, static and dynamic decoding (until 80%, or halfway between
     `--train-until` and the end when that is later);
  3. `mrp train head` variants on the best backbone: the most arith accuracy among those
     with arith-code >= 80% (until 97%; `--no-heads` skips it).

What it writes into `--out` (flat, at most 8 files): `backbone-NAME.tar.gz` per variant
(weights, tokenizer, logs, bench results; no optimizer state), `heads-logs.tar.gz` (heads
and process logs) and `summary.json` (per variant: steps/s, final loss, accuracy per mode).
Processes that miss a deadline are killed; their last checkpoint still comes back.
Measured on one H200 (2026-11-29): six backbone runs side by side take ~12-14 steps/s each
(4200 steps of 16 x 256 in ~5 min), a 500-problem bench of five modes a few seconds.

    python benchmarks/embedded_sweep.py --out $OUT --budget 540     # on the device machine
    python benchmarks/embedded_sweep.py --out /tmp/sweep --smoke     # CPU dry run, ~2 min

Deliberately not here: the training and decoding code (`mrp train`, `mrp bench`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

BASE = ["--preset", "embedded", "--bf16", "--tasks", "arith,arith-code",
        "--train-examples", "100000", "--train-steps", "4200", "--save-every", "500"]
VARIANTS = {  # edit to taste; each entry adds to or overrides BASE
    "base": [],  # the shipped recipe (docs/experiments.md)
    "lr3": ["--lr", "3e-3"],
    "b32": ["--batch-size", "32", "--train-steps", "2100"],
    "b32-lr3": ["--batch-size", "32", "--train-steps", "2100", "--lr", "3e-3"],
}
HEAD_BASE = ["--bf16", "--train-steps", "1000", "--eval-every", "250", "--save-every", "250"]
HEADS = {
    "d2-k1": ["--lookahead", "1"],
    "d2-k2": ["--lookahead", "2"],
    "d3-k2": ["--head-layers", "3", "--lookahead", "2"],
    "d2-k1-static": ["--lookahead", "1", "--reveal-rule", "static"],
}
GRID = "static,dynamic:0.9,dynamic:0.7,dynamic:0.5,dynamic:0.3"
BENCH_TASKS = ("arith", "arith-code")
SMOKE = {"backbone": ["--preset", "tiny", "--train-examples", "100", "--train-steps", "6",
                      "--save-every", "3"],
         "head": ["--train-steps", "4", "--eval-every", "2", "--save-every", "2",
                  "--eval-examples", "4"],
         "limit": "6"}
KEEP = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "train_config.json", "train_log.jsonl", "loss_curve.png", "metrics.jsonl",
        "bench.json", "bench.md")


def mrp(*args: str) -> list[str]:
    return [sys.executable, "-m", "mrp_dlm.cli", *args]


def launch(command: list[str], log: Path, threads: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    with log.open("w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)


def wait_all(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, int | None]:
    """Exit codes by name; None for a process killed at the deadline."""
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(2)
    codes = {}
    for name, proc in procs.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            codes[name] = None
        else:
            codes[name] = proc.returncode
    return codes


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def without_schedule(flags: list[str]) -> list[str]:
    """The flags less --train-steps and --batch-size (a smoke run keeps its tiny schedule)."""
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ("--train-steps", "--batch-size"):
            skip = True
        else:
            kept.append(flag)
    return kept


def train_backbones(work: Path, args, deadline: float) -> dict[str, dict]:
    extra = SMOKE["backbone"] if args.smoke else BASE
    procs = {}
    for name in args.variants.split(","):
        flags = VARIANTS[name]
        if args.smoke:
            flags = without_schedule(flags)
        command = mrp("train", "backbone", "--out", str(work / name), "--device", args.device,
                      *extra, *flags)
        procs[name] = launch(command, work / f"train-{name}.log", args.threads)
    codes = wait_all(procs, deadline)
    report = {}
    for name, code in codes.items():
        log = read_jsonl(work / name / "train_log.jsonl")
        last = log[-1] if log else {}
        report[name] = {"exit": code, "step": last.get("step"), "loss": last.get("loss"),
                        "elapsed": last.get("elapsed"), "tokens_per_s": last.get("tokens_per_s")}
    return report


def bench_backbones(work: Path, names: list[str], args, deadline: float) -> dict[str, dict]:
    limit = SMOKE["limit"] if args.smoke else "500"
    procs = {}
    for name in names:
        for task in BENCH_TASKS:
            out = work / name / f"bench-{task}"
            command = mrp("bench", "--model", str(work / name), "--task", task, "--limit", limit,
                          "--batch-size", limit, "--grid", GRID, "--device", args.device,
                          "--out", str(out))
            procs[f"{name}/{task}"] = launch(command, work / f"bench-{name}-{task}.log",
                                             args.threads)
    wait_all(procs, deadline)
    results = {}
    for name in names:
        for task in BENCH_TASKS:
            path = work / name / f"bench-{task}" / "bench.json"
            if path.is_file():
                rows = json.loads(path.read_text())["rows"]
                results.setdefault(name, {})[task] = {
                    row["label"]: [row["accuracy"], row["tokens_per_forward"]] for row in rows}
    return results


def pick_best(bench: dict[str, dict], report: dict[str, dict]) -> str | None:
    def score(name: str) -> tuple:
        tasks = bench.get(name, {})
        arith = tasks.get("arith", {}).get("static", [0.0])[0]
        code = tasks.get("arith-code", {}).get("static", [0.0])[0]
        return (code >= 0.8, arith, code, -(report[name]["loss"] or 9.0))
    candidates = [name for name in report if report[name]["step"] is not None]
    return max(candidates, key=score) if candidates else None


def train_heads(work: Path, backbone: str, args, deadline: float) -> dict[str, dict]:
    extra = SMOKE["head"] if args.smoke else HEAD_BASE
    procs = {name: launch(mrp("train", "head", "--model", str(work / backbone),
                              "--out", str(work / f"head-{name}"), "--device", args.device,
                              *extra, *flags), work / f"head-{name}.log", args.threads)
             for name, flags in HEADS.items()}
    codes = wait_all(procs, deadline)
    return {name: {"exit": code, "metrics": read_jsonl(work / f"head-{name}" / "metrics.jsonl")}
            for name, code in codes.items()}


def pack(out: Path, name: str, folders: dict[str, Path], pattern_logs: list[Path]) -> None:
    with tarfile.open(out / name, "w:gz") as tar:
        for arcname, folder in folders.items():
            for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
                if path.is_file() and path.name in KEEP:
                    tar.add(path, arcname=f"{arcname}/{path.relative_to(folder)}")
        for path in pattern_logs:
            if path.is_file():
                tar.add(path, arcname=f"logs/{path.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/embedded-sweep"))
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all phases")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads per process")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU dry run")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="names from VARIANTS")
    parser.add_argument("--train-until", type=float, default=0.62,
                        help="share of the budget for phase 1")
    parser.add_argument("--no-heads", action="store_true", help="skip phase 3")
    args = parser.parse_args()
    if args.smoke:
        args.device = "cpu"
        args.threads = 1
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    chosen = args.variants.split(",")
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    summary: dict = {"variants": {name: VARIANTS[name] for name in chosen}, "heads": HEADS}

    def save() -> None:
        summary["elapsed"] = round(time.time() - start, 1)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))

    report = train_backbones(args.work, args, start + args.train_until * args.budget)
    summary["train"] = report
    save()
    print(json.dumps(report), flush=True)
    trained = [name for name, row in report.items() if row["step"] is not None]
    for name in trained:  # packed now, and again with the bench results
        pack(args.out, f"backbone-{name}.tar.gz", {name: args.work / name}, [])
    bench_until = max(0.80, (1 + args.train_until) / 2)
    bench = bench_backbones(args.work, trained, args, start + bench_until * args.budget)
    summary["bench"] = bench
    save()
    print(json.dumps(bench), flush=True)
    for name in trained:
        pack(args.out, f"backbone-{name}.tar.gz", {name: args.work / name}, [])
    best = pick_best(bench, report)
    summary["best"] = best
    if best is not None and not args.no_heads:
        summary["head_runs"] = train_heads(args.work, best, args, start + 0.97 * args.budget)
        save()
    pack(args.out, "heads-logs.tar.gz",
         {f"head-{name}": args.work / f"head-{name}" for name in HEADS},
         sorted(args.work.glob("*.log")))
    save()
    print(json.dumps({k: summary.get(k) for k in ("best", "elapsed")}), flush=True)


if __name__ == "__main__":
    main()
