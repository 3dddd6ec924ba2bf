"""Remask by residual veto: the v2 MRP paper's remask rule (`--remask-rule paper`), as the
authors' code runs it (`_generate_residual_remask`, `residual_remask_transfer`).

Per denoising step of a block:

    propose  the dynamic rule on A: every masked position above τ, else the most confident;
    residual one head forward on the block as it was BEFORE this step's proposals, from
             h_in = h_A; C = lm_head(h_C), raw logits, read alone (not A + C);
    veto     each proposal whose |C at its proposed token| exceeds δ (either sign); a row
             whose every proposal is vetoed keeps the one of smallest |C|;
    commit   the survivors; vetoed positions stay masked and compete again next step.

The head never commits a token; a step where no row has two proposals needs no head forward
(a lone proposal survives either way): a CPU skips it (`DecodeStats.head_skips`), an
accelerator runs it rather than wait to ask. As the official loop, the head sees its block
alone; the rule needs steps == block_size. `veto_step` is the one definition of the step.
docs/design.md ("Remask rules") has more.

Deliberately not here: the chain rule (see `remask.py`), the dynamic proposal itself (see
`selection.threshold_pick`).

Shapes: B batch, L block size, H hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.sampling import GREEDY, SamplingConfig
from mrp_dlm.decoding.selection import Rule, threshold_pick
from mrp_dlm.decoding.step import Advance, Step, Vetoing, reads_free
from mrp_dlm.decoding.strategies import sampling_of
from mrp_dlm.model.head import HeadBackbone, MRPHead

# h_C (B, L, H) of one head step on block tokens (B, L) from h_in (B, L, H).
Residual = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def veto_unstable(proposed: torch.Tensor, residual: torch.Tensor, delta: float) -> torch.Tensor:
    """The proposals (B, L) that survive the veto: |residual| <= delta; a row that proposed
    something and lost it all keeps its smallest-|residual| proposal (ties: lower position).

    proposed: (B, L) bool; residual: (B, L) float, C at each position's proposed token.
    """
    magnitude = residual.abs()  # (B, L)
    survive = proposed & (magnitude <= delta)  # (B, L)
    stable = torch.where(proposed, magnitude, float("inf")).argmin(dim=1)  # (B,) first minimum
    lost = proposed.any(dim=1) & ~survive.any(dim=1)  # (B,)
    fallback = torch.zeros_like(proposed).scatter_(1, stable[:, None], lost[:, None])  # (B, L)
    return survive | fallback


@dataclass(frozen=True)
class Veto:
    """One step of the rule."""

    tokens: torch.Tensor  # (B, L) the block after the survivors are committed
    proposed: torch.Tensor  # (B, L) bool, the dynamic rule's proposals
    kept: torch.Tensor  # (B, L) bool, the survivors
    head_ran: bool  # False: no row had two proposals, so the head forward was skipped


def veto_step(residual: Residual, backbone: HeadBackbone, step: Step, threshold: float,
              delta: float, sampling: SamplingConfig = GREEDY) -> Veto:
    """One step of the paper's rule on the block before it (see the module docstring).

    The head runs on every row (static shapes); a row with fewer than two proposals keeps
    them either way (`veto_unstable` keeps a row's last proposal). So where a host read is
    free (`step.reads_free`) one asks first whether any row has two proposals, and skips
    the head where none has; an accelerator runs it without asking.
    """
    rows, mask_token_id = step.rows, backbone.config.mask_token_id
    proposed, tokens = threshold_pick(step.base.logits, rows.tokens, rows.eligible,
                                      rows.positions, Rule(mask_token_id, threshold, sampling))
    kept, contested = proposed, True
    if reads_free(proposed.device):
        contested = bool((proposed.sum(dim=1) > 1).any())
    if contested:
        residual_logits = backbone.logits(residual(rows.tokens, step.base.hidden))  # (B, L, V)
        at_token = residual_logits.gather(-1, tokens[..., None])[..., 0]  # (B, L)
        kept = veto_unstable(proposed, at_token, delta)
    return Veto(torch.where(kept, tokens, rows.tokens), proposed, kept, contested)


class VetoDecoder(Vetoing):
    copies = 1

    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.sampling = sampling_of(config)

    def step(self, context: BlockContext, step: Step) -> Advance:
        def residual(tokens: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
            return context.head.residual(tokens, hidden_in)

        veto = veto_step(residual, context.model, step, self.config.threshold,
                         self.config.remask_delta, self.sampling)
        self.count_vetoes(veto.proposed, veto.kept, veto.head_ran)
        return Advance(veto.tokens)
