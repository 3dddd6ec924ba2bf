"""What torch.compile of the decode hot path buys: the backbone's block steps (static
shapes, see `decoding/driver.py`) and the head, each `nn.Module.compile(dynamic=False)`.

Not a test (never collected by pytest). On the embedded model and head, static and
speculative (K = 3) decoding of held-out `arith` prompts at batch 1 and 8, eager against
compiled, in the same run: the compiled pipeline is first warmed up on prompts of other
lengths and batch sizes (its compile time is reported separately, it is paid once per
process), then both are timed on the same prompts; outputs must be identical.

Prints a table, then one JSON line last (config, git commit, hardware, results).

    python benchmarks/compile.py [--prompts 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402
from mrp_dlm.pipeline import Pipeline  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402

CONFIGS = {"static": DecodeConfig(mode="static", max_new_tokens=128),
           "speculative K=3": DecodeConfig(mode="speculative", lookahead=3, max_new_tokens=128)}


def decode_all(pipe: Pipeline, prompts: list[str], config: DecodeConfig, batch: int):
    """(token ids, seconds) of prompts decoded `batch` at a time."""
    began, ids = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        ids += pipe.generate(prompts[i:i + batch], config, chat=True).token_ids
    return ids, time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    problems = [e.problem for e in get_task("arith").examples("test", 3 * args.prompts)]
    warm, timed = problems[args.prompts:], problems[:args.prompts]
    eager, compiled = Pipeline.load(threads=args.threads), Pipeline.load(threads=args.threads)
    compiled.model.compile(dynamic=False)  # prefill runs `forward`, so it stays eager
    compiled.head.compile(dynamic=False)
    began = time.perf_counter()
    for config in CONFIGS.values():
        for batch in (1, 8, 3):
            decode_all(compiled, warm[:2 * batch], config, batch)
    compile_seconds = time.perf_counter() - began
    rows = []
    for name, config in CONFIGS.items():
        for batch in (1, 8):
            decode_all(eager, warm[:batch], config, batch)  # eager warm-up, not timed
            want, eager_seconds = decode_all(eager, timed, config, batch)
            got, compiled_seconds = decode_all(compiled, timed, config, batch)
            rows.append(dict(mode=name, batch=batch, eager_ms=1000 * eager_seconds / len(timed),
                             compiled_ms=1000 * compiled_seconds / len(timed),
                             speedup=eager_seconds / compiled_seconds, identical=got == want))
    print(f"compile warm-up: {compile_seconds:.1f} s (once per process)")
    print("| mode | batch | eager ms/prompt | compiled ms/prompt | speedup | identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['mode']} | {row['batch']} | {row['eager_ms']:.1f} | "
              f"{row['compiled_ms']:.1f} | {row['speedup']:.2f}x | {row['identical']} |")
    print(json.dumps(dict(config=dict(prompts=args.prompts, threads=args.threads),
                          compile_seconds=round(compile_seconds, 1), commit=git_commit(),
                          hardware=hardware("cpu"), rows=rows)))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
