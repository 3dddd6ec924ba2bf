"""Accepted head drafts per speculative round for saved MRP heads, against a C = 0 head.

Not a test (never collected by pytest). Decodes the first `--problems` test problems of
each task (pooled; chat template, greedy, batch 1, one thread unless OMP_NUM_THREADS says
otherwise) with `--mode speculative --lookahead K --no-adaptive` (every round drafts K) at
each K and threshold τ, once per head, and dynamic τ = 0.9 (no head) as the wall-clock
reference:

    OMP_NUM_THREADS=1 python benchmarks/acceptance.py zero mrp_dlm/assets/embedded-head runs/h1

`zero` is a fresh 1-layer `MRPHead` (its final norm starts at zero, so C = 0: it predicts
no change; its drafts are the rule's steps on the stale seed logits). Per head, K and τ it
prints accepted drafts per round, the ratio to the zero head's (same K and τ), tokens per
backbone forward (end to end) and the speed (tokens/s) over dynamic 0.9, measured just
before in the same run: wall clock, noisy when other work shares the machine. One JSON
line last.

Speculative decoding is lossless: every head gives the same tokens (checked here: a row
whose ids differ from the first head's is counted in `differ`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mrp_dlm.config import DecodeConfig, HeadConfig  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.decoding.stats import DecodeStats  # noqa: E402
from mrp_dlm.distill import prompt_turns, read_prompts  # noqa: E402
from mrp_dlm.eval import provenance  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from mrp_dlm.model.loading import load_head  # noqa: E402
from mrp_dlm.pipeline import Pipeline  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402

ZERO = "zero"  # the head name that means C = 0
REFERENCE = DecodeConfig(mode="dynamic", threshold=0.9)  # the wall-clock reference


def head_named(name: str, pipe: Pipeline) -> MRPHead:
    if name == ZERO:
        weight = pipe.model.lm_head.weight
        return MRPHead(pipe.model.config, HeadConfig(num_layers=1)).to(weight.device,
                                                                       weight.dtype).eval()
    # A head saved before heads attended to the context runs here as the context-attending
    # head it now is (its weights were trained for its block only).
    return load_head(name, pipe.model, block_only=True).eval()


def decode_all(pipe: Pipeline, prompts: list[list[int]], config: DecodeConfig,
               head: MRPHead | None) -> tuple[DecodeStats, list[list[int]]]:
    """Every prompt alone (batch 1); the summed stats and each row's ids."""
    total, outputs = DecodeStats(), []
    decoder = make_decoder(config, head)
    for ids in prompts:
        result = generate(pipe.model, [ids], config, decoder)
        total, outputs = total + result.stats, outputs + result.token_ids
    return total, outputs


def measure(pipe: Pipeline, prompts: list[list[int]], heads: list[str], thresholds: list[float],
            lookaheads: list[int]) -> list[dict]:
    """One row per (head, K, τ), with the reference's tokens/s measured just before each."""
    rows, first_ids = [], {}
    settings = [(k, t) for k in lookaheads for t in thresholds]
    for name in heads:
        head = head_named(name, pipe)
        for lookahead, threshold in settings:
            config = DecodeConfig(mode="speculative", lookahead=lookahead, threshold=threshold,
                                  adaptive=False)  # a fixed K: the head's drafts, every round
            decode_all(pipe, prompts[:2], config, head)  # warm-up, excluded
            reference, _ = decode_all(pipe, prompts, REFERENCE, None)
            stats, ids = decode_all(pipe, prompts, config, head)
            expected = first_ids.setdefault(threshold, ids)
            rows.append({"head": name, "layers": head.config.num_layers, "lookahead": lookahead,
                         "threshold": threshold,
                         "accepted_per_round": round(stats.mean_accepted, 4),
                         "tokens_per_forward": round(stats.tokens_per_forward, 4),
                         "speed_vs_dynamic_0.9": round(stats.tokens_per_second
                                                       / reference.tokens_per_second, 3),
                         "differ": sum(a != b for a, b in zip(ids, expected))})
    zero = {(row["lookahead"], row["threshold"]): row["accepted_per_round"]
            for row in rows if row["head"] == ZERO}
    for row in rows:
        base = zero.get((row["lookahead"], row["threshold"]))
        row["vs_zero"] = round(row["accepted_per_round"] / base, 3) if base else None
    return rows


def print_table(rows: list[dict]) -> None:
    print("| head | layers | K | τ | accepted/round | vs C=0 | tok/fwd | speed vs dynamic 0.9 "
          "| differ |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['head']} | {r['layers']} | {r['lookahead']} | {r['threshold']} "
              f"| {r['accepted_per_round']:.3f} "
              f"| {r['vs_zero'] or '-'} | {r['tokens_per_forward']:.3f} "
              f"| {r['speed_vs_dynamic_0.9']:.3f}x | {r['differ']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help=f"head directories, or {ZERO!r} for C = 0")
    parser.add_argument("--model", default=None, help="backbone dir (default: the embedded one)")
    parser.add_argument("--tasks", default="arith,arith-code", help="comma-separated tasks")
    parser.add_argument("--problems", type=int, default=50, help="first test problems per task")
    parser.add_argument("--thresholds", default="0.9,1.0", help="comma-separated τ values")
    parser.add_argument("--lookaheads", default="3", help="comma-separated K (head steps)")
    parser.add_argument("--prompts", default=None,
                        help="held-out chat prompts in the --data syntax (docs/training.md), "
                             "the first --problems rows of each source, instead of --tasks")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--dtype", default=None,
                        help="model dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    args = parser.parse_args()
    pipe = Pipeline.load(args.model, args.dtype, args.device)
    if args.prompts:
        prompts = [pipe.tokenizer.encode(pipe.tokenizer.render_messages(prompt_turns(row)))
                   for row in read_prompts(args.prompts, args.problems)
                   if not isinstance(row, Exception)]
    else:
        tasks = [get_task(name) for name in args.tasks.split(",")]
        prompts = [pipe.encode(task.prompt(example), chat=True)
                   for task in tasks for example in task.examples("test", args.problems)]
    thresholds = [float(value) for value in args.thresholds.split(",")]
    lookaheads = [int(value) for value in args.lookaheads.split(",")]
    rows = measure(pipe, prompts, args.heads, thresholds, lookaheads)
    print_table(rows)
    print(json.dumps({"rows": rows, "problems": len(prompts),
                      "git": provenance.git_commit(),
                      "hardware": provenance.hardware(args.device)}))


if __name__ == "__main__":
    main()
