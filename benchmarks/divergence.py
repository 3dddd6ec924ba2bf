"""How often speculative decoding departs from its rule, at scale, and why.

Not a test (never collected by pytest). Speculative decoding at τ commits its rule's pick
(static at τ = 1.0, else dynamic at τ) computed on verify logits (M block copies in one
forward); the rule computes it on denoise logits (one copy). With `--invariant-verify off`
those are equal up to float rounding (tests/decoding/test_verify_arithmetic.py), so the
two outputs can differ only where a choice is within float noise of flipping; `on` (each
copy a lone forward, `model/invariant.py`) makes them equal bit for bit. This script
counts the prompts where they differ, per option, over:
- sources: the embedded model and head on the held-out `arith` and `arith-code` prompts,
  and random tiny checkpoints (tests/conftest.py) with random heads, block 4 and 16;
- dtypes float32 and bfloat16, batch 1 and 8, lookahead K = 3, τ = `--threshold`;
- `--invariant-verify` off and on.
For each differing prompt it reports its noise margin: the smallest relative logit noise
(1e-7 ... 1e-2) that moves that prompt's own rule output (tests/margins.py). A
divergence with a large noise margin would be a bug, not rounding.

Prints a table, then one JSON line last (config, git commit, hardware, results).

    python benchmarks/divergence.py [--embedded-prompts 250] [--tiny-prompts 500]
        [--threshold 1.0] [--options off,on] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import random_backbone, random_head, tiny_config  # noqa: E402
from margins import perturbed_logits  # noqa: E402
from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.eval.grid import rule_of  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402
from mrp_dlm.pipeline import Pipeline  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402

LOOKAHEAD = 3
NOISE_LEVELS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
TINY_SEEDS = (0, 1, 2, 3, 4)
TINY_MAX_NEW = {4: 13, 16: 21}


@dataclass
class Source:
    name: str
    model: torch.nn.Module
    head: torch.nn.Module
    prompts: list[list[int]]
    max_new_tokens: int


def embedded_sources(per_task: int) -> list[Source]:
    pipe = Pipeline.load()
    prompts = [pipe.encode(e.problem, chat=True) for name in ("arith", "arith-code")
               for e in get_task(name).examples("test", per_task)]
    return [Source("embedded", pipe.model, pipe.head, prompts, 128)]


def tiny_sources(count: int) -> list[Source]:
    sources = []
    per_model = max(count // (2 * len(TINY_SEEDS)), 1)
    for block_size in (4, 16):
        for seed in TINY_SEEDS:
            model = random_backbone(tiny_config(block_size=block_size), seed=seed)
            generator = torch.Generator().manual_seed(7000 + seed)
            lengths = torch.randint(1, 21, (per_model,), generator=generator).tolist()
            prompts = [torch.randint(0, 97, (n,), generator=generator).tolist() for n in lengths]
            sources.append(Source(f"tiny-L{block_size}-s{seed}", model,
                                  random_head(model, seed, norm=0.3), prompts,
                                  TINY_MAX_NEW[block_size]))
    return sources


def decode_all(model, head, prompts, config, batch) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        out += generate(model, prompts[i:i + batch], config, make_decoder(config, head)).token_ids
    return out


def noise_margin(model, prompt, config, want) -> float:
    """Smallest relative logit noise of NOISE_LEVELS that moves this prompt's static output."""
    for level in NOISE_LEVELS:
        for seed in range(3):
            with perturbed_logits(model, level, seed):
                if decode_all(model, None, [prompt], config, 1)[0] != want:
                    return level
    return float("inf")


def compare(source: Source, dtype: torch.dtype, batch: int, threshold: float,
            option: str) -> dict:
    model, head = source.model.to(dtype), source.head.to(dtype)
    spec_config = DecodeConfig(mode="speculative", lookahead=LOOKAHEAD, threshold=threshold,
                               max_new_tokens=source.max_new_tokens, invariant_verify=option)
    static_config = rule_of(spec_config)  # the rule speculation must equal
    began = time.perf_counter()
    static = decode_all(model, None, source.prompts, static_config, batch)
    spec = decode_all(model, head, source.prompts, spec_config, batch)
    differ = [i for i, (a, b) in enumerate(zip(static, spec)) if a != b]
    divergences = []
    for i in differ:
        first = next((j for j, (a, b) in enumerate(zip(static[i], spec[i])) if a != b),
                     min(len(static[i]), len(spec[i])))
        divergences.append(dict(prompt=i, first_token=first, noise_margin=noise_margin(
            model, source.prompts[i], static_config, static[i])))
    return dict(source=source.name, dtype=str(dtype).removeprefix("torch."), batch=batch,
                invariant_verify=option,
                prompts=len(source.prompts), differ=len(differ), divergences=divergences,
                seconds=round(time.perf_counter() - began, 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedded-prompts", type=int, default=250, help="per embedded task")
    parser.add_argument("--tiny-prompts", type=int, default=500, help="over all tiny models")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--threshold", type=float, default=1.0, help="τ (1.0: static)")
    parser.add_argument("--options", default="off,on", help="--invariant-verify values")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sources = tiny_sources(args.tiny_prompts) + (
        embedded_sources(args.embedded_prompts) if args.embedded_prompts else [])
    rows = []
    with torch.no_grad():
        for dtype, batch, option, source in itertools.product(
                (torch.float32, torch.bfloat16), (1, 8), args.options.split(","), sources):
            rows.append(compare(source, dtype, batch, args.threshold, option))
            row = rows[-1]
            print(f"{row['source']:>14} {row['dtype']:>8} b{batch} {option:>3}: "
                  f"{row['differ']:4d} of "
                  f"{row['prompts']:4d} differ  margins "
                  f"{[d['noise_margin'] for d in row['divergences']][:8]}  "
                  f"({row['seconds']} s)", flush=True)
    summary = {}
    for row in rows:
        kind = "embedded" if row["source"] == "embedded" else "tiny"
        key = f"{kind} {row['dtype']} b{row['batch']} {row['invariant_verify']}"
        total = summary.setdefault(key, dict(prompts=0, differ=0, margins=[]))
        total["prompts"] += row["prompts"]
        total["differ"] += row["differ"]
        total["margins"] += [d["noise_margin"] for d in row["divergences"]]
    print("\n| source dtype batch option | prompts | differ | rate | noise margins of the "
          "differing |")
    print("| --- | --- | --- | --- | --- |")
    for key, total in summary.items():
        print(f"| {key} | {total['prompts']} | {total['differ']} | "
              f"{total['differ'] / total['prompts']:.2%} | {sorted(total['margins'])} |")
    report = dict(config=dict(lookahead=LOOKAHEAD, noise_levels=NOISE_LEVELS,
                              threshold=args.threshold, options=args.options,
                              embedded_prompts_per_task=args.embedded_prompts,
                              tiny_prompts=args.tiny_prompts, threads=args.threads),
                  commit=git_commit(), hardware=hardware("cpu"), summary=summary, rows=rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
