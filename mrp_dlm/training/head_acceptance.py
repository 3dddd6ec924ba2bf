"""Acceptance, the metric heads are ranked by: accepted drafts per speculative round.

At each evaluation the head in training decodes held-out prompts with `--mode speculative`
at the run's threshold τ (1.0 under `--reveal-rule static`) and lookahead K, every round
drafting K (no adaptive skipping), greedy; the rounds' accepted drafts over their count is
what a deployment of this head gets on these prompts. Speculative decoding is lossless, so
the generated tokens do not depend on the head: only how many drafts stand.

The prompts are split over the processes and the counters summed, so the number does not
depend on how many processes train.

Deliberately not here: the KL proxies (see `head_eval.py`); decoding itself (the public
`decoding.driver.generate`, nothing of its internals).

Shapes: P prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mrp_dlm.config import DecodeConfig, HeadTrainConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.head import MRPHead
from mrp_dlm.training.data import Sample
from mrp_dlm.training.distributed import World, all_sum
from mrp_dlm.training.sharding import lockstep


def prompt_ids(samples: Sequence[Sample], count: int) -> list[list[int]]:
    """The prompts (token ids before the first response token) of the first `count` samples."""
    return [sample.ids[:sample.prompt_length].tolist() for sample in samples[:count]]


def acceptance_config(config: HeadTrainConfig) -> DecodeConfig:
    """The decode the metric runs: the rule the head was trained for, K drafts per round."""
    threshold = 1.0 if config.reveal_rule == "static" else config.threshold
    return DecodeConfig(mode="speculative", lookahead=config.lookahead, threshold=threshold,
                        adaptive=False, max_new_tokens=config.eval_new_tokens)


def decoding_copy(head: MRPHead, backbone: Backbone) -> MRPHead:
    """The head in the backbone's dtype (a float32 head trained on a bfloat16 backbone is
    copied; decoding writes the head's keys into caches of the backbone's dtype)."""
    dtype = backbone.lm_head.weight.dtype
    if next(head.parameters()).dtype == dtype:
        return head
    copy = MRPHead(backbone.config, head.config).to(backbone.lm_head.weight.device)
    copy.load_state_dict(head.state_dict())
    return copy.to(dtype).eval()


@torch.no_grad()
def measure_acceptance(head: MRPHead, backbone: Backbone, prompts: list[list[int]],
                       config: HeadTrainConfig, world: World) -> dict:
    """Accepted drafts per round, rounds, tokens per backbone forward (summed over ranks)."""
    decode = acceptance_config(config)
    mine = prompts[world.rank::world.size]
    counts = torch.zeros(4, dtype=torch.float64)  # accepted, rounds, tokens, row forwards
    with lockstep(backbone, world):  # decodes run different numbers of forwards per rank
        if mine:
            decoder = make_decoder(decode, decoding_copy(head, backbone))
            stats = generate(backbone, mine, decode, decoder).stats
            counts = torch.tensor([stats.accepted, stats.rounds, stats.tokens,
                                   stats.row_forwards], dtype=torch.float64)
    accepted, rounds, tokens, forwards = all_sum(counts, world).tolist()
    return {"accepted_per_round": round(accepted / max(rounds, 1), 4), "rounds": int(rounds),
            "tokens_per_forward": round(tokens / max(forwards, 1), 4),
            "threshold": decode.threshold, "lookahead": decode.lookahead,
            "prompts": len(prompts)}
