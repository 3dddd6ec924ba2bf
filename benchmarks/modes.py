"""Accuracy and speed of every decoding mode on held-out `arith` and `arith-code` problems.

Not a test (never collected by pytest). The `mrp bench` machinery (`mrp_dlm/eval/bench.py`:
warm-up excluded, static first, every ratio against static in the same run) over the first
`--limit` test problems of each task, with: static, dynamic tau in {0.9, 0.7, 0.5, 0.3},
direct K in {1, 2}, speculative K in {2, 3, 4} and remask tau in {0.5, 0.7}. Rows per task
and over all tasks pooled; the columns are described in `mrp_dlm/eval/bench.py`. Prints a
markdown table, then one JSON line last (config, git commit, hardware, results).

    python benchmarks/modes.py [--model DIR --head DIR] [--limit 100] [--batch-size 1]
                               [--threads 1] [--device cpu] [--max-new-tokens 128]
                               [--modes static,speculative:3,...]

Without --model it uses the embedded model and head; without a head the MRP modes are left
out with a note.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.eval import bench  # noqa: E402
from mrp_dlm.eval.grid import parse_grid  # noqa: E402
from mrp_dlm.eval.provenance import head_dir  # noqa: E402
from mrp_dlm.model.loading import DEFAULT_DEVICE  # noqa: E402
from mrp_dlm.pipeline import Pipeline  # noqa: E402
from mrp_dlm.tasks.registry import EMBEDDED_TASKS, get_task  # noqa: E402

MODES = ("static,dynamic:0.9,dynamic:0.7,dynamic:0.5,dynamic:0.3,direct:1,direct:2,"
         "speculative:2,speculative:3,speculative:4,remask:0.5,remask:0.7")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint dir (default: the embedded model)")
    parser.add_argument("--head", default=None, help="MRP head dir (default: the embedded head "
                        "when --model is not given)")
    parser.add_argument("--limit", type=int, default=100, help="test problems per task")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per decode call")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 keeps the default")
    parser.add_argument("--device", default=DEFAULT_DEVICE)
    parser.add_argument("--dtype", default=None,
                        help="model dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tasks", default=",".join(EMBEDDED_TASKS),
                        help="comma-separated task names")
    parser.add_argument("--modes", default=MODES,
                        help="grid spec: comma-separated mode or mode:value entries "
                             "(static is always run)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.limit < 1 or args.batch_size < 1:
        sys.exit("benchmarks/modes.py: --limit and --batch-size must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = parse_grid(args.modes, DecodeConfig(max_new_tokens=args.max_new_tokens))
    pipe = Pipeline.load(args.model, args.dtype, args.device, head=args.head)
    configs, dropped = bench.split_by_head(configs, pipe.head is not None)
    if dropped:
        print(f"note: no MRP head (give --head DIR), so {', '.join(dropped)} are left out")
    tasks = [get_task(name.strip()) for name in args.tasks.split(",") if name.strip()]
    grids = bench.run_bench(pipe, [(task, task.examples("test", args.limit)) for task in tasks],
                            configs, args.batch_size)
    rows = [row for grid in grids for row in bench.bench_rows(grid.task, [grid])]
    if len(grids) > 1:
        rows += bench.bench_rows("all", grids)

    head = head_dir(pipe)
    print(f"model {pipe.directory}, head {head}, "
          f"{args.limit} problems per task, batch {args.batch_size}, {args.device} "
          f"{pipe.dtype}, max_new_tokens {args.max_new_tokens}\n")
    print(bench.markdown(rows))
    lossy = bench.lossless_violations(rows)
    if lossy:
        print(f"\nWARNING: lossless modes differ from static on some prompts: "
              f"{[(r['task'], r['label'], r['identical_to_static']) for r in lossy]}")
    setup = dict(model=str(pipe.directory), head=head, limit=args.limit,
                 batch_size=args.batch_size, tasks=[task.name for task in tasks],
                 dtype=pipe.dtype, device=args.device)
    print(json.dumps(bench.bench_report(rows, setup, configs)))


if __name__ == "__main__":
    main()
