"""README's quick head on a machine that is not idle: `mrp train head`'s wall time alone and
beside one busy process, for each thread setting.

Not a test (never collected by pytest). The approach of `busy_demo.py`, applied to training:
runs README's quick head (the embedded model, --train-steps, --train-examples,
--eval-examples; defaults: README's command) in a fresh subprocess into a fresh folder, for
each --threads setting (`auto`: the flag left out, the rule of `mrp_dlm/threads.py`; N:
`--threads N`), unloaded and then beside a pure-Python spin loop pinned to one CPU. Each
setting passes when its loaded run takes at most --limit times its unloaded one; the script
exits 1 when one fails. Wall times include interpreter start and model load, as a user sees
them; the columns are `busy_demo.py`'s (CPU seconds, threads logged, background cores).
Prints a table, then one JSON line last (config, git commit, hardware, runs).

    python benchmarks/busy_train.py [--threads auto,1,2] [--train-steps 100]
        [--train-examples 2000] [--eval-examples 32] [--limit 2.0] [--timeout 1800]

A tiny check that it runs: --train-steps 2 --train-examples 50 --eval-examples 4.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from busy_demo import Run, run_mrp, start_spinner, table  # noqa: E402

from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402


def train_argv(args: argparse.Namespace, out: Path, threads: str) -> list[str]:
    """README's quick head into `out`, with `--threads` unless `threads` is auto."""
    argv = ["train", "head", "--out", str(out), "--train-steps", str(args.train_steps),
            "--train-examples", str(args.train_examples), "--eval-examples",
            str(args.eval_examples), "--eval-every", str(args.train_steps)]
    return argv if threads == "auto" else [*argv, "--threads", threads]


def run_setting(args: argparse.Namespace, threads: str, scratch: Path) -> list[Run]:
    """The quick head with `threads`, unloaded then beside the spinner."""
    runs = [run_mrp(f"unloaded, --threads {threads}",
                    train_argv(args, scratch / f"unloaded-{threads}", threads), args.timeout,
                    None)]
    spinner = start_spinner()
    try:
        runs.append(run_mrp(f"loaded, --threads {threads}",
                            train_argv(args, scratch / f"loaded-{threads}", threads),
                            args.timeout, spinner))
    finally:
        spinner.kill()
        spinner.wait()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="auto,1,2",
                        help="comma-separated settings: auto (flag left out) or N")
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--train-examples", type=int, default=2000)
    parser.add_argument("--eval-examples", type=int, default=32)
    parser.add_argument("--limit", type=float, default=2.0,
                        help="largest allowed loaded / unloaded wall-time ratio per setting")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before a training run is killed (and the check fails)")
    args = parser.parse_args()

    settings = [part.strip() for part in args.threads.split(",") if part.strip()]
    runs, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="busy-train-") as scratch:
        for threads in settings:
            unloaded, loaded = run_setting(args, threads, Path(scratch))
            runs += [unloaded, loaded]
            ratios[threads] = round(loaded.wall_s / unloaded.wall_s, 3)
    passed = all(ratio <= args.limit for ratio in ratios.values()) and \
        all(run.returncode == 0 for run in runs)
    print(table(runs))
    for threads, ratio in ratios.items():
        print(f"--threads {threads}: loaded / unloaded {ratio:.2f}x (limit {args.limit}x)")
    print(f"{'PASS' if passed else 'FAIL'}")
    spinner_cpu = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(json.dumps(dict(config=dict(vars(args), spinner_cpu=spinner_cpu),
                          commit=git_commit(), hardware=hardware("cpu"),
                          runs=[asdict(run) for run in runs], ratios=ratios, passed=passed)))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
