"""The MRP head objective: reveal, teach, correct, and the KL between them (as in the MRP paper).

Per lookahead step k = 1..K, on the noisy blocks of a batch:
    reveal   in every block that still holds masks, commit `counts` positions by the
             static, dynamic or random rule (docs/training.md, "MRP head", step 3);
    teach    B_k = backbone logits on the revealed blocks (no grad);
    correct  h_k = h_{k-1} + head(revealed blocks, h_{k-1}), h_0 = h_A, the head attending to
             its keys of the clean blocks before each block (`head_batch.head_prefix`);
    loss_k = sum over still-masked positions of KL(softmax(B_k) || softmax(A + sum C)) / p,
             plus commit_weight * the commit loss of step k (`commit_loss`), divided by
             the batch's response tokens; the loss is the mean of the K losses.
Both distributions have the [MASK] logit at -inf, as at inference. Gradients flow through
the whole chain of accumulators (the head is fed its own output, as when decoding).

Deliberately not here: the backbone passes themselves (see `head_batch.py`), metrics
(see `head_eval.py`) and the optimiser (see `head_loop.py`).

Shapes: N blocks, L block size, K lookahead, M still-masked positions, H hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.training.head_batch import CleanContext, NoisyBlocks, head_prefix, run_blocks, run_head
from mrp_dlm.training.losses import without_mask_token

@dataclass(frozen=True)
class RevealPlan:
    """What each lookahead step reveals; drawn before the chain runs."""

    rule: str  # static, dynamic (the backbone's step) or random (random position, true token)
    keys: torch.Tensor  # (K, N, L) float32, random priorities (the random rule reveals the largest)
    counts: torch.Tensor  # (K, N) int64 >= 1, reveals per block per step (fewer if fewer masks)
    threshold: float = 1.0  # τ of the backbone's step (dynamic rule, commit loss); 1.0: static

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


def top_positions(scores: torch.Tensor, masked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(N, L) bool: the counts (N,) highest-scoring masked positions per block, ties to the
    lower position (all of them when fewer remain)."""
    key = torch.where(masked, scores.float(), float("-inf"))  # (N, L)
    order = key.argsort(dim=-1, descending=True, stable=True)  # (N, L)
    leading = torch.arange(key.shape[1], device=key.device) < counts[:, None]  # (N, L)
    return masked & torch.zeros_like(masked).scatter(1, order, leading)


def backbone_step(logits: torch.Tensor, masked: torch.Tensor, counts: torch.Tensor,
                  threshold: float, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The threshold rule on logits (M, V) at `masked` (N, L): (chosen (N, L), tokens (N, L)).

    Every masked position whose confidence exceeds `threshold`, unless fewer than counts (N,)
    do: then the counts most confident (at 1.0 always: the static pick). `selection.
    select_dynamic` on a grid (training does not import `decoding`).
    """
    confidence, tokens = confidence_grid(logits, masked, mask_token_id)  # (N, L) each
    above = masked & (confidence > threshold)  # (N, L)
    enough = above.sum(dim=1) >= counts  # (N,)
    chosen = torch.where(enough[:, None], above, top_positions(confidence, masked, counts))
    return chosen, tokens


def choose_reveals(plan: RevealPlan, step: int, masked: torch.Tensor,
                   current_logits: torch.Tensor | None, targets: torch.Tensor,
                   mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (N, L) bool, tokens (N, L) int64) of lookahead step `step` (0-based).

    masked: (N, L) bool; current_logits: (M, V) backbone logits at the masked positions
    (static and dynamic rules); targets: (N, L) ground truth (random rule only). Each block
    reveals plan.counts[step] positions (the dynamic rule: at least that many), or all it
    has left when fewer.
    """
    if plan.rule == "random":
        return top_positions(plan.keys[step], masked, plan.counts[step]), targets
    threshold = plan.threshold if plan.rule == "dynamic" else 1.0
    return backbone_step(current_logits, masked, plan.counts[step], threshold, mask_token_id)


@torch.no_grad()
def advance_blocks(backbone: Backbone, blocks: NoisyBlocks, context: CleanContext,
                   steps: torch.Tensor, threshold: float) -> NoisyBlocks:
    """The blocks after steps (N,) int64 of the backbone's own threshold step each (a block
    whose count is spent, or that has no mask left, stays), with their new h_A.

    From fully masked blocks this is greedy threshold decoding of each block with the clean
    x_0 before it: the states `--mode dynamic/speculative --threshold τ` visits. One
    backbone pass per step up to steps.max().
    """
    tokens, masked, base_hidden = blocks.tokens, blocks.masked, blocks.base_hidden
    ones = torch.ones_like(steps)
    for index in range(int(steps.max())):
        logits = backbone.logits(base_hidden[masked])  # (M, V)
        chosen, proposed = backbone_step(logits, masked, ones, threshold,
                                         backbone.config.mask_token_id)  # (N, L) each
        chosen = chosen & (index < steps)[:, None]  # (N, L)
        tokens, masked = torch.where(chosen, proposed, tokens), masked & ~chosen  # (N, L)
        base_hidden = run_blocks(backbone, context, tokens)  # (N, L, H)
    return dataclasses.replace(blocks, tokens=tokens, masked=masked, base_hidden=base_hidden)


def chain_steps(head: nn.Module, backbone: Backbone, blocks: NoisyBlocks, context: CleanContext,
                plan: RevealPlan) -> Iterator[ChainStep]:
    """The K steps of reveal -> teach -> correct; `head` is an MRPHead (or its DDP wrapper)."""
    mask_token_id = backbone.config.mask_token_id
    tokens, masked, accumulator = blocks.tokens, blocks.masked, blocks.base_hidden
    prefix = head_prefix(head, backbone, context)
    current = None
    if plan.rule != "random":
        with torch.no_grad():
            current = backbone.logits(accumulator[masked])  # (M, V), A
    for k in range(plan.lookahead):
        chosen, proposed = choose_reveals(plan, k, masked, current, blocks.targets, mask_token_id)
        tokens = torch.where(chosen, proposed, tokens)  # (N, L)
        masked = masked & ~chosen  # (N, L)
        with torch.no_grad():
            next_logits = backbone.logits(run_blocks(backbone, context, tokens)[masked])  # (M, V)
        residual_hidden = run_head(head, backbone, context, prefix, tokens,
                                   accumulator)  # (N, L, H) h_C
        accumulator = accumulator + residual_hidden  # (N, L, H)
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


def confidence_logit(log_confidence: torch.Tensor) -> torch.Tensor:
    """log(c / (1 - c)) of log c (any shape): separates confidences near 1 that log c does
    not (0.99 and 0.999 are 4.6 and 6.9); capped at c = 1 - 1e-6."""
    confidence = log_confidence.exp().clamp(max=1 - 1e-6)
    return log_confidence - torch.log1p(-confidence)


def commit_loss(step: ChainStep, threshold: float, mask_token_id: int) -> torch.Tensor:
    """Summed over blocks (scalar): how far A + sum C is from taking the teacher's next step.

    Speculative decoding accepts draft k + 1 (the threshold step on A + sum C) only when the
    backbone's own step on the same state (on B_k) reveals the same positions with the same
    tokens. Three cross-entropies against the teacher's step, on the still-masked positions:
    - token: -log q(token) at each position the teacher reveals, q = softmax(A + sum C);
    - order: the teacher's most confident position (its pick when none exceeds τ), as a
      softmax over positions of the head's confidence logits log(c / (1 - c));
    - side of τ (τ < 1 only): per position, binary CE of logit(c) - logit(τ) against
      whether the teacher's confidence exceeds τ.
    """
    still = step.still  # (N, L)
    blocks = still.any(dim=1)  # (N,)
    ones = torch.ones(still.shape[0], dtype=torch.int64, device=still.device)
    teacher = step.next_logits.detach()  # (M, V)
    chosen, tokens = backbone_step(teacher, still, ones, threshold, mask_token_id)  # (N, L)
    student = F.log_softmax(without_mask_token(step.corrected_logits, mask_token_id), -1)  # (M, V)
    token_log_prob = student.gather(1, tokens[still][:, None])[:, 0]  # (M,)
    token_term = -(token_log_prob * chosen[still]).sum()
    scores = confidence_logit(student.max(dim=-1).values)  # (M,)
    grid = torch.full(still.shape, float("-inf"), device=still.device)  # (N, L)
    grid = grid.masked_scatter(still, scores)[blocks]  # (N', L), only blocks with masks
    teacher_confidence, _ = confidence_grid(teacher, still, mask_token_id)  # (N, L)
    best = teacher_confidence[blocks].argmax(dim=1)  # (N',)
    order_term = F.cross_entropy(grid, best, reduction="sum")
    if threshold >= 1.0:
        return token_term + order_term
    above = (teacher_confidence[still] > threshold).float()  # (M,)
    margin = scores - math.log(threshold / (1 - threshold))  # (M,)
    side_term = F.binary_cross_entropy_with_logits(margin, above, reduction="sum")
    return token_term + order_term + side_term


def chain_loss(steps: Iterable[ChainStep], rates: torch.Tensor, normaliser: float,
               mask_token_id: int, commit_weight: float = 0.0,
               threshold: float = 1.0) -> torch.Tensor:
    """Mean over steps of (sum(KL / p) + commit_weight * commit loss) / normaliser (scalar).

    rates: (N, L) float32 p per position; normaliser: response tokens the loss is spread
    over; threshold: τ of the commit loss's teacher step.
    """
    losses = []
    for step in steps:
        loss = (residual_kl(step.next_logits, step.corrected_logits, mask_token_id)
                / rates[step.still]).sum()
        if commit_weight:
            loss = loss + commit_weight * commit_loss(step, threshold, mask_token_id)
        losses.append(loss / normaliser)
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
