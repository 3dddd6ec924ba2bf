"""Held-out metrics of saved MRP heads on a chosen number of test problems.

Not a test (never collected by pytest). `mrp train head` reports the same metrics on
`--eval-examples` problems while it trains (`metrics.jsonl`); this script measures finished
heads on a larger share of the test splits, e.g. all 500 problems per task:

    python benchmarks/head_heldout.py --model mrp_dlm/assets/embedded --examples 500 \
        --lookahead 3 runs/head-j mrp_dlm/assets/embedded-head

Each head is scored with `evaluate_head` under both reveal rules, in bf16 autocast as in
training. Prints one JSON line per head: per rule and lookahead step, the KL cut
1 - KL(B‖A+C) / KL(B‖A), both KLs, pick agreement (head and backbone alone), argmax
agreement and the number of positions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mrp_dlm.config import HeadTrainConfig  # noqa: E402
from mrp_dlm.model.loading import load_head  # noqa: E402
from mrp_dlm.training import head_loop  # noqa: E402
from mrp_dlm.training.conversations import ChatEncoder  # noqa: E402
from mrp_dlm.training.distributed import join_world, leave_world  # noqa: E402
from mrp_dlm.training.head_eval import build_held_out, evaluate_head  # noqa: E402
from mrp_dlm.training.sources import DataOptions, load_eval_sources, task_spec  # noqa: E402


def summary(metrics: dict) -> dict:
    cut = [round(1 - r / b, 4) for r, b in zip(metrics["kl_residual"], metrics["kl_base"])]
    return {"kl_cut": cut, "kl_base": metrics["kl_base"], "kl_residual": metrics["kl_residual"],
            "pick_agreement": metrics["pick_agreement"],
            "base_pick_agreement": metrics["base_pick_agreement"],
            "argmax_agreement": metrics["argmax_agreement"], "positions": metrics["positions"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="head directories trained on --model")
    parser.add_argument("--model", required=True, help="the backbone the heads were trained on")
    parser.add_argument("--examples", type=int, default=500, help="test problems per task")
    parser.add_argument("--lookahead", type=int, default=2, help="chained steps K to score")
    args = parser.parse_args()
    config = HeadTrainConfig(model=args.model, out="unused", lookahead=args.lookahead,
                             eval_examples=args.examples, bf16=True)
    world = join_world("cpu")
    try:
        backbone = head_loop.load_frozen_backbone(config, torch.bfloat16, "cpu")
        tokenizer, special = head_loop.model_tokenizer(config, backbone)
        encoder = ChatEncoder(tokenizer, special, backbone.config.block_size)
        options = DataOptions(config.seq_len, 0, args.examples, 0.0, False)
        held_out = build_held_out(load_eval_sources(task_spec(config.task_names), encoder,
                                                    options), config, special, world)
        for directory in args.heads:
            head = load_head(directory, backbone).float().eval()  # checks the fingerprint
            with torch.autocast("cpu", dtype=torch.bfloat16):
                by_rule = evaluate_head(head, backbone, held_out, args.lookahead, world)
            print(json.dumps({"head": directory, "examples": args.examples,
                              **{rule: summary(m) for rule, m in by_rule.items()}}), flush=True)
    finally:
        leave_world(world)


if __name__ == "__main__":
    main()
