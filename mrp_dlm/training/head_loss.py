"""The MRP head objective: reveal, teach, correct, and the KL between them (brief §3).

Per lookahead step k = 1..K, on the noisy blocks of a batch:
    reveal   in every block that still holds masks, commit `counts` positions:
             static: the backbone's own pick on its current logits (A, then B_{k-1}):
                     the most confident masked positions and their argmax tokens,
                     exactly what static decoding (and speculative acceptance) commits;
             random: uniformly random masked positions with their ground-truth tokens;
    teach    B_k = backbone logits on the revealed blocks (no grad);
    correct  h_k = h_{k-1} + head(revealed blocks, h_{k-1}), h_0 = h_A; A + sum C = lm_head(h_k);
    loss_k = sum over still-masked positions of KL(softmax(B_k) || softmax(A + sum C)) / p,
             divided by the batch's response tokens; the loss is the mean of the K losses.
Both distributions have the [MASK] logit at -inf, as at inference. Gradients flow through
the whole chain of accumulators (the head is fed its own output, as when decoding).

Deliberately not here: the backbone passes themselves (see `head_batch.py`), metrics
(see `head_eval.py`) and the optimiser (see `head_loop.py`).

Shapes: N blocks, L block size, K lookahead, M still-masked positions, H hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.training.head_batch import CleanContext, NoisyBlocks, run_blocks
from mrp_dlm.training.losses import without_mask_token

@dataclass(frozen=True)
class RevealPlan:
    """What each lookahead step reveals; drawn before the chain runs."""

    rule: str  # "static" (the backbone's pick) or "random" (a random position, true token)
    keys: torch.Tensor  # (K, N, L) float32, random priorities (the random rule reveals the largest)
    counts: torch.Tensor  # (K, N) int64 >= 1, reveals per block per step (fewer if fewer masks)

    @property
    def lookahead(self) -> int:
        return self.counts.shape[0]


@dataclass(frozen=True)
class ChainStep:
    """One lookahead step's logits at the positions still masked after its reveals."""

    still: torch.Tensor  # (N, L) bool, masked after this step's reveals
    next_logits: torch.Tensor  # (M, V) float32, B_k, the teacher (no grad)
    corrected_logits: torch.Tensor  # (M, V) float32, A + sum C, the head's prediction


def confidence_grid(logits: torch.Tensor, where: torch.Tensor,
                    mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Static-decoding confidence and argmax token on an (N, L) grid.

    logits: (M, V) at the M True positions of `where` (N, L), in row-major order.
    Returns confidence (N, L) float32 (max softmax probability, -inf off `where`) and
    tokens (N, L) int64 (0 off `where`).
    """
    logits = without_mask_token(logits, mask_token_id)  # (M, V)
    best, token = logits.max(dim=-1)  # (M,)
    probability = (best - logits.logsumexp(dim=-1)).exp()  # (M,)
    confidence = torch.full(where.shape, float("-inf"), device=where.device)
    tokens = torch.zeros(where.shape, dtype=torch.int64, device=where.device)
    return confidence.masked_scatter(where, probability), tokens.masked_scatter(where, token)


def choose_reveals(plan: RevealPlan, step: int, masked: torch.Tensor,
                   current_logits: torch.Tensor | None, targets: torch.Tensor,
                   mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (N, L) bool, tokens (N, L) int64) of lookahead step `step` (0-based).

    masked: (N, L) bool; current_logits: (M, V) backbone logits at the masked positions
    (static rule only); targets: (N, L) ground truth (random rule only). Each block reveals
    plan.counts[step] positions, or all it has left when fewer.
    """
    if plan.rule == "static":
        scores, tokens = confidence_grid(current_logits, masked, mask_token_id)
    else:
        scores, tokens = plan.keys[step], targets
    key = torch.where(masked, scores.float(), float("-inf"))  # (N, L)
    order = key.argsort(dim=-1, descending=True, stable=True)  # (N, L), ties to the lower position
    leading = torch.arange(key.shape[1], device=key.device) < plan.counts[step][:, None]  # (N, L)
    return masked & torch.zeros_like(masked).scatter(1, order, leading), tokens


def chain_steps(head: nn.Module, backbone: Backbone, blocks: NoisyBlocks, context: CleanContext,
                plan: RevealPlan) -> Iterator[ChainStep]:
    """The K steps of reveal -> teach -> correct; `head` is an MRPHead (or its DDP wrapper)."""
    mask_token_id = backbone.config.mask_token_id
    tokens, masked, accumulator = blocks.tokens, blocks.masked, blocks.base_hidden
    current = None
    if plan.rule == "static":
        with torch.no_grad():
            current = backbone.logits(accumulator[masked])  # (M, V), A
    for k in range(plan.lookahead):
        chosen, proposed = choose_reveals(plan, k, masked, current, blocks.targets, mask_token_id)
        tokens = torch.where(chosen, proposed, tokens)  # (N, L)
        masked = masked & ~chosen  # (N, L)
        with torch.no_grad():
            next_logits = backbone.logits(run_blocks(backbone, context, tokens)[masked])  # (M, V)
        residual = head(backbone, tokens, accumulator, blocks.positions)  # (N, L, H) h_C
        accumulator = accumulator + residual  # (N, L, H)
        yield ChainStep(masked, next_logits, backbone.logits(accumulator[masked]))
        current = next_logits


def residual_kl(next_logits: torch.Tensor, corrected_logits: torch.Tensor,
                mask_token_id: int) -> torch.Tensor:
    """Forward KL(softmax(B) || softmax(A + C)) per position (M,) float32, [MASK] excluded.

    next_logits, corrected_logits: (M, V).
    """
    index = torch.tensor([mask_token_id], device=next_logits.device)
    teacher = F.log_softmax(without_mask_token(next_logits, mask_token_id), dim=-1)  # (M, V)
    student = F.log_softmax(without_mask_token(corrected_logits, mask_token_id), dim=-1)  # (M, V)
    # The [MASK] column is -inf in both; zero it in both so that it adds 1 * (0 - 0), never NaN.
    teacher, student = teacher.index_fill(-1, index, 0.0), student.index_fill(-1, index, 0.0)
    return (teacher.exp() * (teacher - student)).sum(dim=-1)


def chain_loss(steps: Iterable[ChainStep], rates: torch.Tensor, normaliser: float,
               mask_token_id: int) -> torch.Tensor:
    """Mean over steps of sum(KL / p) / normaliser (scalar float32).

    rates: (N, L) float32 p per position; normaliser: response tokens the loss is spread over.
    """
    losses = [(residual_kl(step.next_logits, step.corrected_logits, mask_token_id)
               / rates[step.still]).sum() / normaliser for step in steps]
    return torch.stack(losses).mean()


def draw_reveals(generator: torch.Generator, rows: int, seq_len: int, block_size: int,
                 lookahead: int, reveal_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random priorities and counts for every x_0 slot of a (rows, seq_len) batch.

    Returns keys (K, rows, T) float32 and counts (K, rows, T) int64, constant within each
    block, uniform in 1..reveal_max. Drawn in the row layout of the whole (global) batch, so
    a row's draws do not depend on how the batch is split over processes.
    """
    keys = torch.rand(lookahead, rows, seq_len, generator=generator)  # (K, rows, T)
    per_block = torch.randint(1, reveal_max + 1, (lookahead, rows, seq_len // block_size),
                              generator=generator)  # (K, rows, T/L)
    return keys, per_block.repeat_interleave(block_size, dim=2)  # (K, rows, T)
