"""Where a flat top-p step's time goes, stage by stage, at the SDAR vocabulary (CPU).

Not a test (never collected by pytest). On standard normal logits at temperature 0.7 (a
top-p 0.95 nucleus of ~89k tokens) times, interleaved, best of the repeats: the greedy step
(softmax + max), the tempered softmax, and each stage `cpu_sampling.top_p_tokens` runs (the
screen's set maxima and the largest probability from them: the wideness test; the screened
race given the set maxima; `nucleus.inside_nucleus`; the floor path on the rows whose winner
it cannot keep, given their screen bounds), and the stages that path replaced (the
candidate attempt and the nucleus floor on every row). Run it once as is and once with
`MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296`: glibc's default
returns each freed tensor to the OS, and the page faults that follow can dominate the
softmax. Prints a table, then one JSON line last.

    python benchmarks/top_p_stages.py [--batches 1 8] [--repeats 15]
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

from mrp_dlm.decoding.nucleus import inside_nucleus, nucleus  # noqa: E402
from mrp_dlm.decoding.race import (race_screened, row_maxima, screen_bounds,  # noqa: E402
                                   set_maxima, token_keys)
from mrp_dlm.decoding.cpu_sampling import truncated_top_tokens, unsettled_tokens  # noqa: E402
from mrp_dlm.decoding.sampling import GREEDY, SamplingConfig, full_distribution  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402

TOP_P = 0.95


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per stage (best of)")
    return parser.parse_args()


def stages(B: int, L: int, V: int) -> dict:
    """The stages (name -> call) on flat logits (B, L, V), and how many rows the floor takes."""
    logits = torch.randn(B, L, V, generator=torch.Generator().manual_seed(B))  # (B, L, V)
    sampling = SamplingConfig(temperature=0.7, top_p=TOP_P, seed=7)
    probs = full_distribution(logits, V - 1, sampling).view(-1, V)  # (R, V)
    keys = token_keys(7, (torch.arange(L) + 64)[None].expand(B, L), torch.arange(B) % L)
    keys = keys.view(-1)  # (R,)
    maxima = set_maxima(probs)  # (R, SET, G)
    bounds = screen_bounds(probs, keys, maxima)  # (R, G)
    winners = race_screened(probs, keys, bounds=bounds)  # (R,)
    outside = (~inside_nucleus(probs, winners, TOP_P)).nonzero()[:, 0]  # (n,)
    return {"greedy (softmax + max)": lambda: full_distribution(logits, V - 1, GREEDY).max(-1),
            "softmax T=0.7": lambda: full_distribution(logits, V - 1, sampling),
            "set maxima, largest (wide test)": lambda: row_maxima(probs, set_maxima(probs)),
            "screened race (set maxima given)":
                lambda: race_screened(probs, keys, bounds=screen_bounds(probs, keys, maxima)),
            "inside_nucleus": lambda: inside_nucleus(probs, winners, TOP_P),
            f"floor path ({len(outside)} rows)":
                lambda: unsettled_tokens(probs[outside], keys[outside], sampling, bounds[outside]),
            "replaced: candidate attempt": lambda: truncated_top_tokens(probs, 0, TOP_P),
            "replaced: nucleus floor": lambda: nucleus(probs, TOP_P)}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    rows = []
    for B in args.batches:
        calls = stages(B, args.block, args.vocab)
        for call in calls.values():  # warm-up, not timed
            call()
        times = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                began = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - began)
        rows += [dict(batch=B, stage=name, ms=round(1000 * min(t), 2)) for name, t in times.items()]
    print(f"V = {args.vocab}, block {args.block}, flat logits, top-p {TOP_P}; ms: best of "
          f"{args.repeats}")
    print("| batch | stage | ms |\n| --- | --- | --- |")
    for row in rows:
        print(f"| {row['batch']} | {row['stage']} | {row['ms']:.2f} |")
    print(json.dumps(dict(config=dict(vocab=args.vocab, block=args.block, batches=args.batches,
                                      repeats=args.repeats, top_p=TOP_P),
                          commit=git_commit(), hardware=hardware("cpu"), rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
