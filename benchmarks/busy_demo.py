"""`mrp demo` on a machine that is not idle: its wall time alone and beside one busy process.

Not a test (never collected by pytest). Runs `mrp demo` (the embedded model, every demo
mode, --problems per task) in a fresh subprocess twice: unloaded, then while a pure-Python
spin loop runs pinned to one CPU (the last one this process may use). The check passes when
the loaded run takes at most --limit times the unloaded one; the script exits 1 otherwise.
A user's laptop is never idle: with torch's default of one thread per core, every small
matmul waited for the thread that shared its core with the spinner
(docs/experiments.md, 2026-11-30: CPU threads by model size).

Wall times include interpreter start and model load, as a user sees them. Each run also
reports the CPU seconds the demo used, the torch threads it chose (from its log), and
`background_cores`: how many cores other processes (not the demo, not our spinner) kept
busy meanwhile (Linux /proc/stat; null elsewhere), because "unloaded" is only as idle as
the machine. Prints a table, then one JSON line last (config, git commit, hardware, runs).

    python benchmarks/busy_demo.py [--problems 20] [--threads N] [--limit 2.0] [--timeout 900]

--threads N passes `--threads N` to the demo (0 or absent: its automatic choice); e.g.
--threads 2 reproduces the pre-fix behaviour on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mrp_dlm.eval.defaults import DEMO_PROBLEMS  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402

# The child: the CLI, with the thread choice logged at INFO so the parent can read it.
CHILD = ("import logging, sys; logging.getLogger('mrp_dlm.threads').setLevel(logging.INFO); "
         "from mrp_dlm.cli import main; sys.exit(main(sys.argv[1:]))")
SPINNER = "while True: pass"
BACKGROUND_WARNING = 0.5  # background cores above which the report says the machine was busy
THREADS_LOG = re.compile(r"torch threads: (\d+|unchanged)")


@dataclass
class Run:
    condition: str  # unloaded or loaded
    wall_s: float  # wall time of the whole `mrp demo` process
    demo_cpu_s: float  # user + system CPU seconds of the demo process
    threads: str  # torch threads the demo chose, as it logged them
    background_cores: float | None  # cores other processes kept busy on average
    returncode: int  # of the demo process (-9: killed at --timeout)


def busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux), else None."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a live process (Linux), else 0."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_spinner() -> subprocess.Popen:
    """A pure-Python busy loop pinned to the last CPU this process may use."""
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER])
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(spinner.pid, {max(os.sched_getaffinity(0))})
    time.sleep(0.2)  # let it reach its loop
    return spinner


def run_demo(condition: str, args: argparse.Namespace,
             spinner: subprocess.Popen | None) -> Run:
    argv = ["demo", "--problems", str(args.problems)]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    return run_mrp(condition, argv, args.timeout, spinner)


def run_mrp(condition: str, argv: list[str], timeout: float,
            spinner: subprocess.Popen | None) -> Run:
    """`mrp ARGV` in a fresh subprocess: its wall and CPU time, threads, background load."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, spinner_before = busy_seconds(), spinner and process_cpu_seconds(spinner.pid)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, stderr = -9, (expired.stderr or b"").decode(errors="replace")
    wall = time.perf_counter() - start
    busy_after, spinner_after = busy_seconds(), spinner and process_cpu_seconds(spinner.pid)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    demo_cpu = (children.ru_utime + children.ru_stime
                - children_before.ru_utime - children_before.ru_stime)
    background = None
    if busy_before is not None:
        spun = (spinner_after - spinner_before) if spinner else 0.0
        background = round(max(busy_after - busy_before - demo_cpu - spun, 0.0) / wall, 2)
    match = THREADS_LOG.search(stderr)
    if returncode != 0:
        print(f"{condition}: mrp {argv[0]} exited {returncode}\n{stderr[-2000:]}",
              file=sys.stderr)
    return Run(condition, round(wall, 2), round(demo_cpu, 2), match.group(1) if match else "?",
               background, returncode)


def table(runs: list[Run]) -> str:
    lines = ["| condition | threads | wall s | demo CPU s | background cores |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.condition} | {r.threads} | {r.wall_s:.1f} | {r.demo_cpu_s:.1f} | "
              f"{r.background_cores} |" for r in runs]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=DEMO_PROBLEMS, help="problems per task")
    parser.add_argument("--threads", type=int, default=None,
                        help="passed to `mrp demo --threads` (default: not passed, automatic)")
    parser.add_argument("--limit", type=float, default=2.0,
                        help="largest allowed loaded / unloaded wall-time ratio")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds before a demo run is killed (and the check fails)")
    args = parser.parse_args()

    runs = [run_demo("unloaded", args, None)]
    spinner = start_spinner()
    try:
        runs.append(run_demo("loaded", args, spinner))
    finally:
        spinner.kill()
        spinner.wait()
    ratio = runs[1].wall_s / runs[0].wall_s
    passed = ratio <= args.limit and all(run.returncode == 0 for run in runs)
    print(table(runs))
    print(f"\nloaded / unloaded: {ratio:.2f}x (limit {args.limit}x): "
          f"{'PASS' if passed else 'FAIL'}")
    background = max((run.background_cores or 0.0) for run in runs)
    if background > BACKGROUND_WARNING:
        print(f"note: other processes kept up to {background:.2f} cores busy, so the demo shared "
              "the machine with more than the spinner; the ratio counts them too")
    print(json.dumps(dict(config=dict(problems=args.problems, threads=args.threads,
                                      limit=args.limit, timeout=args.timeout,
                                      spinner_cpu=max(os.sched_getaffinity(0))
                                      if hasattr(os, "sched_getaffinity") else None),
                          commit=git_commit(), hardware=hardware("cpu"),
                          runs=[asdict(run) for run in runs], ratio=round(ratio, 3),
                          passed=passed)))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
