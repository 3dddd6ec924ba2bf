"""Exploration's gain (`drafting.EXPLORE_EVERY`), load-independent: counts, not seconds.

Not a test (never collected by pytest). Decodes the first `--problems` test problems of
arith and arith-code (chat, greedy, batch 1, K = 3, τ 0.9 and 1.0) with the embedded model
and head, adaptive, with the planner's costs fixed (no cost probe: the plan depends on the
measured acceptance only) at a CPU-like and a GPU-like pair, exploration on (every 8th
round) and off. One JSON line per setting: backbone and head forwards, drafts made and
accepted, and the planner's own cost model in denoise forwards (backbone forwards + copy *
drafts made + head_step * head forwards; exact at batch 1 up to chains that end early).

    OMP_NUM_THREADS=1 python benchmarks/exploration.py --problems 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mrp_dlm.decoding.drafting as drafting  # noqa: E402
from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.decoding.costs import RoundCosts  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.decoding.stats import DecodeStats  # noqa: E402
from mrp_dlm.pipeline import Pipeline  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402

COSTS = {"cpu": RoundCosts(head_step=0.23, copy=0.3), "gpu": RoundCosts(head_step=0.1, copy=0.05)}


def decode_all(pipe: Pipeline, prompts: list[list[int]], threshold: float,
               costs: RoundCosts) -> dict:
    config = DecodeConfig(mode="speculative", lookahead=3, threshold=threshold,
                          max_new_tokens=128)
    decoder = make_decoder(config, pipe.head_for(config))
    decoder.planner.costs[1] = costs
    total = DecodeStats()
    for prompt in prompts:
        total = total + generate(pipe.model, [prompt], config, decoder).stats
    drafts = total.head_drafts + total.self_drafts
    modelled = (total.backbone_forwards + costs.copy * drafts
                + costs.head_step * total.head_forwards)
    return dict(tokens=total.tokens, backbone_forwards=total.backbone_forwards,
                head_forwards=total.head_forwards, head_drafts=total.head_drafts,
                head_accepted=total.head_drafts_accepted, self_drafts=total.self_drafts,
                self_accepted=total.self_drafts_accepted, modelled_forwards=round(modelled, 1),
                tokens_per_modelled=round(total.tokens / modelled, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=20, help="first test problems per task")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = Pipeline.load()
    prompts = [pipe.encode(task.prompt(example), chat=True)
               for task in map(get_task, ("arith", "arith-code"))
               for example in task.examples("test", args.problems)]
    every = drafting.EXPLORE_EVERY
    for explore in (True, False):
        drafting.EXPLORE_EVERY = every if explore else 10**9
        for threshold in (0.9, 1.0):
            for regime, costs in COSTS.items():
                row = decode_all(pipe, prompts, threshold, costs)
                print(json.dumps(dict(explore=explore, tau=threshold, costs=regime,
                                      prompts=len(prompts), **row)), flush=True)


if __name__ == "__main__":
    main()
