"""What a sampled step costs against a greedy one, at the SDAR vocabulary.

Not a test (never collected by pytest). Times `sampling.propose` on logits (B, L, V) for
greedy and for sampled steps (temperature 0.7 alone; with top-k 50; with top-p 0.95; both),
and, in the same run, the same sampled steps computed the way `propose` computed them before
the CPU fast path: `truncate` over the whole vocabulary, then `race.race` (keyed noise for
every token, a float64 race) — the definition, which still runs on accelerators. Both must
give the same tokens (checked on every timed call's output). Two logit families:
- `lm-like`: Zipf over a random permutation of the vocabulary (logit = -a log rank), a
  peaked distribution with a top-p 0.95 nucleus of tens to hundreds of tokens;
- `flat`: standard normal logits, whose nucleus is most of the vocabulary (the worst case
  for top-p: too wide for candidates, it takes the nucleus floor, `decoding/nucleus.py`).

The greedy step is what `propose` does for greedy: the softmax confidence is measured on,
then the argmax. Every sampled step computes the same softmax (at its temperature), so a
ratio's excess over 1 is the sampling alone. Each time is the best of the repeats (warm-up
excluded; on a loaded machine the minimum is the steadiest statistic), steps interleaved so
that load on a shared machine hits every row alike. Prints a table, then one JSON line last
(config, git commit, hardware, results).

    python benchmarks/sampling_cost.py [--batches 1 8] [--repeats 5] [--threads 1]
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

from mrp_dlm.decoding.race import race, token_keys  # noqa: E402
from mrp_dlm.decoding.sampling import (GREEDY, SamplingConfig, full_distribution,  # noqa: E402
                                       propose, truncate)
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402

SAMPLED = {"T=0.7": dict(temperature=0.7),
           "T=0.7 top-k 50": dict(temperature=0.7, top_k=50),
           "T=0.7 top-p 0.95": dict(temperature=0.7, top_p=0.95),
           "T=0.7 top-k 50 top-p 0.95": dict(temperature=0.7, top_k=50, top_p=0.95)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 keeps the default")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--families", nargs="+", default=["lm-like", "flat"])
    parser.add_argument("--zipf", type=float, default=1.1, help="a of the lm-like logits")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per step (best of)")
    return parser.parse_args()


def make_logits(family: str, B: int, L: int, V: int, zipf: float, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(B)
    if family == "flat":
        return torch.randn(B, L, V, generator=generator).to(device)  # (B, L, V)
    ranks = torch.rand(B * L, V, generator=generator).argsort(dim=-1) + 1  # (B*L, V) in 1..V
    return (-zipf * ranks.float().log()).view(B, L, V).to(device)  # (B, L, V)


def before(logits: torch.Tensor, mask_token_id: int, sampling: SamplingConfig,
           positions: torch.Tensor, draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled tokens and confidence (B, L) as `propose` computed them before the CPU fast
    path."""
    B, L, V = logits.shape
    probs = full_distribution(logits, mask_token_id, sampling)  # (B, L, V)
    kept = truncate(probs, sampling.top_k, sampling.top_p)  # (B, L, V)
    tokens = race(kept.view(-1, V), token_keys(sampling.seed, positions, draw).view(-1))
    confidence = probs.view(-1, V).gather(-1, tokens[:, None])  # (B*L, 1)
    return tokens.view(B, L), confidence.view(B, L)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn) -> tuple[torch.Tensor, float]:
    sync(device)
    began = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - began


def nucleus_size(logits: torch.Tensor, mask_token_id: int) -> float:
    """Mean number of tokens the top-p 0.95 nucleus keeps at temperature 0.7."""
    sampling = SamplingConfig(**SAMPLED["T=0.7 top-p 0.95"])
    kept = truncate(full_distribution(logits, mask_token_id, sampling), 0, 0.95)
    return (kept > 0).sum(-1).float().mean().item()


def bench(family: str, B: int, args: argparse.Namespace) -> list[dict]:
    V, L, device = args.vocab, args.block, args.device
    logits = make_logits(family, B, L, V, args.zipf, device)
    mask_token_id = V - 1
    positions = (torch.arange(L, device=device) + 64)[None].expand(B, L)  # (B, L)
    draw = torch.arange(B, device=device) % L  # (B,)
    steps = {"greedy": lambda: propose(logits, mask_token_id, GREEDY, positions, draw).tokens}
    for name, knobs in SAMPLED.items():
        sampling = SamplingConfig(seed=7, **knobs)
        steps[name] = (lambda s=sampling: propose(logits, mask_token_id, s, positions,
                                                 draw).tokens)
        steps[name + " (before)"] = (lambda s=sampling: before(logits, mask_token_id, s,
                                                               positions, draw)[0])
    for step in steps.values():  # warm-up, not timed
        step()
    times = {name: [] for name in steps}
    outputs = {}
    for _ in range(args.repeats):
        for name, step in steps.items():
            outputs[name], seconds = timed(device, step)
            times[name].append(seconds)
    greedy = min(times["greedy"])
    nucleus = nucleus_size(logits, mask_token_id)
    rows = [dict(family=family, batch=B, step="greedy", ms=round(1000 * greedy, 2),
                 ratio=1.0, before_ms=None, before_ratio=None, identical=None,
                 nucleus=round(nucleus, 1))]
    for name in SAMPLED:
        after, old = min(times[name]), min(times[name + " (before)"])
        rows.append(dict(family=family, batch=B, step=name, ms=round(1000 * after, 2),
                         ratio=round(after / greedy, 2), before_ms=round(1000 * old, 2),
                         before_ratio=round(old / greedy, 2),
                         identical=bool(torch.equal(outputs[name], outputs[name + " (before)"])),
                         nucleus=round(nucleus, 1)))
    return rows


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row for family in args.families for B in args.batches
            for row in bench(family, B, args)]
    print(f"V = {args.vocab}, block {args.block}; ms: best of {args.repeats}; ratio: to the "
          "greedy step of the same batch and logits (target <= 2x)")
    print("| logits | batch | step | ms | x greedy | before: ms | before: x greedy | "
          "same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        old = "" if row["before_ms"] is None else f"{row['before_ms']:.1f}"
        old_ratio = "" if row["before_ratio"] is None else f"{row['before_ratio']:.1f}x"
        same = "" if row["identical"] is None else str(row["identical"])
        print(f"| {row['family']} (nucleus {row['nucleus']:.0f}) | {row['batch']} | "
              f"{row['step']} | {row['ms']:.1f} | {row['ratio']:.2f}x | {old} | {old_ratio} | "
              f"{same} |")
    print(json.dumps(dict(config=dict(vocab=args.vocab, block=args.block, batches=args.batches,
                                      families=args.families, zipf=args.zipf,
                                      repeats=args.repeats, threads=args.threads,
                                      device=args.device, dtype="float32"),
                          commit=git_commit(), hardware=hardware(args.device), rows=rows)))
    return 0 if all(row["identical"] is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
