"""What running verify copies as lone forwards (`--invariant-verify on`) costs, and whether
this machine's batched verify happens to give a lone forward's logits bit for bit anyway.

Not a test (never collected by pytest). For each model (tiny random block 4 and 16, the
embedded model), dtype (float32, bfloat16), batch and copy count M, on a block context
after a prefill and a stored block (tests/copies.py, as `driver.generate` builds it):
- equal: whether every copy's logits from one batched verify forward equal a lone denoise
  forward's, bit for bit (torch.equal), over `--cases` random states;
- the seconds of one verify forward, batched and copies-as-lone (median of `--repeats`),
  and their ratio (the option's cost on this machine).

Prints a table, then one JSON line last (config, git commit, hardware, rows).

    OMP_NUM_THREADS=1 python benchmarks/invariant_verify.py [--repeats 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import random_backbone, tiny_config  # noqa: E402
from copies import copy_and_lone_logits, random_states, stored_block_context  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402
from mrp_dlm.pipeline import Pipeline  # noqa: E402

LENGTHS = {1: [6], 3: [6, 13, 2], 8: [6, 13, 2, 9, 30, 1, 17, 4]}  # prompt lengths per batch


def models(names: list[str]) -> dict[str, torch.nn.Module]:
    out = {}
    for name in names:
        if name == "embedded":
            out[name] = Pipeline.load().model
        else:
            out[name] = random_backbone(tiny_config(block_size=int(name.removeprefix("tiny-L"))))
    return out


def seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(model, batch: int, copies: int, cases: int, repeats: int) -> dict:
    equal = 0
    for seed in range(cases):
        context = stored_block_context(model, LENGTHS[batch], copies, False, seed)
        verify, lone = copy_and_lone_logits(context, random_states(model, batch, copies, seed))
        equal += bool(torch.equal(verify, lone))
    states = random_states(model, batch, copies).reshape(batch, -1)  # (B, M*L)
    timed = {}
    for invariant in (False, True):
        context = stored_block_context(model, LENGTHS[batch], copies, invariant)
        timed[invariant] = seconds(lambda: context.verify(states), repeats)
    return dict(batch=batch, copies=copies, cases=cases, batched_equal=equal,
                batched_s=round(timed[False], 6), lone_s=round(timed[True], 6),
                cost=round(timed[True] / timed[False], 3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny-L4,tiny-L16,embedded")
    parser.add_argument("--batches", default="1,3")
    parser.add_argument("--copies", default="2,3,4")
    parser.add_argument("--cases", type=int, default=5, help="random states per setting")
    parser.add_argument("--repeats", type=int, default=20, help="timed verifies per setting")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for name, model in models(args.models.split(",")).items():
            for dtype in (torch.float32, torch.bfloat16):
                model = model.to(dtype)
                for batch in map(int, args.batches.split(",")):
                    for copies in map(int, args.copies.split(",")):
                        row = dict(model=name, dtype=str(dtype).removeprefix("torch."),
                                   **measure(model, batch, copies, args.cases, args.repeats))
                        rows.append(row)
                        print(f"{name:>9} {row['dtype']:>8} b{batch} M{copies}: batched equal "
                              f"{row['batched_equal']}/{row['cases']}, verify "
                              f"{row['batched_s'] * 1e3:.2f} ms batched, "
                              f"{row['lone_s'] * 1e3:.2f} ms as lone ({row['cost']}x)",
                              flush=True)
    result = dict(config=vars(args), commit=git_commit(), hardware=hardware("cpu"), rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
