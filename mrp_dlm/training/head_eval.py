"""Held-out metrics of an MRP head: how well A + sum C predicts the backbone's next logits.

The held-out set is fixed: the tasks' test-split samples, packed in order, each row noised
(and given random reveal priorities) with a seed of its own, so the set does not depend on
the batch size or the number of processes. Evaluation reveals one position per block per
step with either rule:
- static: the backbone's own pick, i.e. the trajectory that greedy static decoding and
  every accepted speculative draft follow. The revealed token is the one the backbone was
  already most sure of, so the other positions barely move (a small signal);
- random: a random masked position with its ground-truth token, the training objective's
  reveal, on held-out data.
Per lookahead step k it reports, over the positions still masked after the step's reveal:
- kl_base      mean KL(B_k || A): the signal, what a head that predicts no change leaves;
- kl_residual  mean KL(B_k || A + sum C): what the head leaves;
- argmax_agreement  argmax(A + sum C) == argmax(B_k);
- pick_agreement    the static pick on A + sum C (most confident still-masked position and
                    its token) equals the pick on B_k: speculative acceptance of draft k+1;
- base_pick_agreement  the same for A alone, the no-head baseline.
`accepted_drafts` is the mean number of leading steps whose picks all agree, per block
that still has masks after step 1: the drafts a speculative round with this lookahead
would accept beyond the backbone's own first pick.

Deliberately not here: the training objective (see `head_loss.py`).

Shapes: B rows, T tokens per row, N blocks, L block size, K lookahead, M positions, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mrp_dlm.config import HeadTrainConfig
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.training.data import (PackedBatch, Sample, SpecialIds, collate_rows, derive_seed,
                                   pack_rows)
from mrp_dlm.training.distributed import World, all_sum, map_record
from mrp_dlm.training.head_batch import CleanContext, NoisyBlocks, encode_batch
from mrp_dlm.training.head_loss import RevealPlan, chain_steps, confidence_grid, residual_kl
from mrp_dlm.training.losses import without_mask_token
from mrp_dlm.training.noise import NoisyBatch, add_noise
from mrp_dlm.training.sharding import lockstep

STEP_METRICS = ("kl_base", "kl_residual", "argmax_agreement", "pick_agreement",
                "base_pick_agreement")
EVAL_RULES = ("static", "random")  # reveal rules the metrics can be computed under


@dataclass(frozen=True)
class HeldOutBatch:
    batch: PackedBatch  # (B, T) x_0 rows
    noisy: NoisyBatch  # (B, T) their fixed noise
    keys: torch.Tensor  # (K, B, T) float32 fixed priorities of the random reveal rule


def noise_rows(batch: PackedBatch, row_ids: Sequence[int], seed: int,
               mask_token_id: int) -> NoisyBatch:
    """Noise row b with a seed derived from row_ids[b], its index in the held-out set."""
    parts = [add_noise(batch.input_ids[b:b + 1], batch.segment_ids[b:b + 1],
                       batch.response[b:b + 1], mask_token_id,
                       torch.Generator().manual_seed(derive_seed(seed, "held-out", row)))
             for b, row in enumerate(row_ids)]
    return NoisyBatch(*(torch.cat([getattr(p, name) for p in parts])  # (B, T)
                        for name in ("noisy_ids", "masked", "mask_rate")))


def reveal_keys(batch: PackedBatch, row_ids: Sequence[int], seed: int,
                lookahead: int) -> torch.Tensor:
    """(K, B, T) random reveal priorities, row b's drawn with a seed derived from row_ids[b]."""
    T = batch.input_ids.shape[1]
    return torch.cat([torch.rand(lookahead, 1, T, generator=torch.Generator().manual_seed(
        derive_seed(seed, "held-out-reveals", row))) for row in row_ids], dim=1)


def build_held_out(samples: Sequence[Sample], config: HeadTrainConfig, special: SpecialIds,
                   world: World) -> list[HeldOutBatch]:
    """This process's share of the held-out rows (on its device), in batches of at most
    config.batch_size rows of config.seq_len tokens."""
    seq_len = config.seq_len
    kept = [s for s in samples if len(s.ids) <= seq_len]
    rows = pack_rows([len(s.ids) for s in kept], range(len(kept)), seq_len)
    mine = list(range(world.rank, len(rows), world.size))
    batches = []
    for first in range(0, len(mine), config.batch_size):
        chosen = mine[first:first + config.batch_size]
        batch = collate_rows(kept, [rows[r] for r in chosen], seq_len, special.pad)
        noisy = noise_rows(batch, chosen, config.seed, special.mask)
        keys = reveal_keys(batch, chosen, config.seed, config.lookahead)
        batches.append(HeldOutBatch(map_record(batch, lambda t: t.to(world.device)),
                                    map_record(noisy, lambda t: t.to(world.device)),
                                    keys.to(world.device)))
    return batches


def pick_codes(logits: torch.Tensor, still: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """(N,) int64 position * V + token of each block's static pick; logits (M, V) at `still`."""
    confidence, tokens = confidence_grid(logits, still, mask_token_id)  # (N, L) each
    position = confidence.argmax(dim=-1)  # (N,), first of equal maxima
    return position * logits.shape[-1] + tokens.gather(1, position[:, None])[:, 0]


def step_sums(still: torch.Tensor, base: torch.Tensor, next_logits: torch.Tensor,
              corrected: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums (7,) float64 of one step: positions, the 5 metrics' sums, blocks with masks;
    and the per-block pick agreement (N,) bool (False for blocks without masks)."""
    has_mask = still.any(dim=1)  # (N,)
    agree = (pick_codes(corrected, still, mask_token_id)
             == pick_codes(next_logits, still, mask_token_id)) & has_mask  # (N,)
    base_agree = (pick_codes(base, still, mask_token_id)
                  == pick_codes(next_logits, still, mask_token_id)) & has_mask  # (N,)
    best = [without_mask_token(logits, mask_token_id).argmax(-1)  # (M,)
            for logits in (next_logits, corrected)]
    sums = torch.stack([torch.tensor(float(still.sum())),
                        residual_kl(next_logits, base, mask_token_id).sum().cpu(),
                        residual_kl(next_logits, corrected, mask_token_id).sum().cpu(),
                        (best[0] == best[1]).sum().cpu().float(),
                        agree.sum().cpu().float(), base_agree.sum().cpu().float(),
                        has_mask.sum().cpu().float()]).double()  # (7,)
    return sums, agree


def rule_sums(head: nn.Module, backbone: Backbone, blocks: NoisyBlocks, context: CleanContext,
              keys: torch.Tensor, rule: str, sums: torch.Tensor, accepted: torch.Tensor) -> None:
    """Add one part's per-step sums (K, 7) and accepted drafts / blocks (2,) under `rule`.

    keys: (K, N, L) random reveal priorities of the part's blocks (read by the random rule).
    """
    lookahead, N, _ = keys.shape
    device, mask_token_id = keys.device, backbone.config.mask_token_id
    plan = RevealPlan(rule, keys, torch.ones(lookahead, N, dtype=torch.int64, device=device))
    agreed = torch.ones(N, dtype=torch.bool, device=device)  # (N,) all picks so far agree
    for k, step in enumerate(chain_steps(head, backbone, blocks, context, plan)):
        base = backbone.logits(blocks.base_hidden[step.still])  # (M, V)
        step_sum, agree = step_sums(step.still, base, step.next_logits,
                                    step.corrected_logits, mask_token_id)
        sums[k] += step_sum
        agreed &= agree
        accepted[0] += float(agreed.sum())
        accepted[1] += float(step.still.any(dim=1).sum()) if k == 0 else 0.0


def finish_metrics(sums: torch.Tensor, accepted: torch.Tensor, world: World) -> dict:
    """Means over the whole held-out set (sums all-reduced): lists of K values."""
    lookahead = sums.shape[0]
    totals = all_sum(torch.cat((sums.flatten(), accepted)), world)
    sums, accepted = totals[:-2].view(lookahead, 7), totals[-2:]
    positions, blocks = sums[:, 0].clamp(min=1), sums[:, 6].clamp(min=1)  # (K,) each
    means = torch.cat((sums[:, 1:4] / positions[:, None], sums[:, 4:6] / blocks[:, None]), 1)
    metrics = {name: [round(float(v), 6) for v in means[:, i]]
               for i, name in enumerate(STEP_METRICS)}
    metrics["accepted_drafts"] = round(float(accepted[0] / max(accepted[1], 1)), 6)
    metrics["positions"] = [int(sums[k, 0]) for k in range(lookahead)]
    return metrics


@torch.no_grad()
def evaluate_head(head: nn.Module, backbone: Backbone, held_out: Sequence[HeldOutBatch],
                  lookahead: int, world: World,
                  rules: Sequence[str] = EVAL_RULES) -> dict[str, dict]:
    """Metrics per reveal rule (`EVAL_RULES`) over the whole held-out set, summed over
    processes; each part's A-pass is shared by the rules. Runs in the caller's autocast
    context, if any."""
    unknown = [rule for rule in rules if rule not in EVAL_RULES]
    if unknown:
        raise ValueError(f"unknown reveal rule {unknown[0]!r}; choose one of "
                         f"{', '.join(EVAL_RULES)}")
    sums = {rule: torch.zeros(lookahead, 7, dtype=torch.float64) for rule in rules}  # (K, 7)
    accepted = {rule: torch.zeros(2, dtype=torch.float64) for rule in rules}  # drafts, blocks
    with lockstep(backbone, world):  # ranks may hold different numbers of batches
        for part in held_out:
            blocks, context = encode_batch(backbone, part.batch, part.noisy)
            keys = torch.stack([context.layout.take(k)
                                for k in part.keys[:lookahead]])  # (K, N, L)
            for rule in rules:
                rule_sums(head, backbone, blocks, context, keys, rule, sums[rule],
                          accepted[rule])
    return {rule: finish_metrics(sums[rule], accepted[rule], world) for rule in rules}
