"""What one denoising step of a block sees and returns: the data the driver's step loop and
every mode share, and the `Decoder` protocol a mode's decoder implements.

A mode differs from another only in its decoder's `step`: given the block, the positions it may
reveal and the backbone's logits and hidden states on the block (`base`), it returns the
block after this step's reveals. Everything around the step (the loop, the one host check
per step, the first backbone forward, counting the reveals) is the driver's.

Deliberately not here: the loop itself (see `driver.py`) and any commit rule (see
`selection.py`).

Shapes: B batch, L block size, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from mrp_dlm.decoding.driver import BlockContext
    from mrp_dlm.model.head import MRPHead


@dataclass(frozen=True)
class BackboneStep:
    """The backbone on one block state."""

    hidden: torch.Tensor  # (B, L, H) final hidden states (base_hidden)
    logits: torch.Tensor  # (B, L, V) float32 same-position logits (base_logits)

    def copy_or(self, index: torch.Tensor, keep: torch.Tensor,
                other: "BackboneStep") -> "BackboneStep":
        """Of a forward over several block copies per row (hidden (B, n*L, H), logits
        (B, n*L, V)): each row's copy `index` (B,) where `keep` (B,) bool, else `other`'s
        row (B, L, ·)."""
        B, L = other.logits.shape[:2]
        rows = torch.arange(B, device=index.device)  # (B,)
        hidden = self.hidden.view(B, -1, L, self.hidden.shape[-1])[rows, index]  # (B, L, H)
        logits = self.logits.view(B, -1, L, self.logits.shape[-1])[rows, index]  # (B, L, V)
        keep = keep[:, None, None]  # (B, 1, 1)
        return BackboneStep(torch.where(keep, hidden, other.hidden),
                            torch.where(keep, logits, other.logits))


@dataclass(frozen=True)
class BlockRows:
    """The block as a step finds it."""

    tokens: torch.Tensor  # (B, L) int64 block tokens, masks included
    eligible: torch.Tensor  # (B, L) bool, masked positions of active rows: what may be revealed
    positions: torch.Tensor  # (B, L) int64 absolute positions of the block


@dataclass(frozen=True)
class Step:
    """The input of one step of a mode."""

    index: int  # steps taken in this block before this one
    quota: int  # n_s, how many positions the base rule commits at this step
    rows: BlockRows  # the block before this step
    base: BackboneStep  # the backbone on rows.tokens


@dataclass(frozen=True)
class Advance:
    """The output of one step."""

    tokens: torch.Tensor  # (B, L) the block after this step's reveals
    base: BackboneStep | None = None  # the backbone on `tokens`, if the step already ran it


class Decoder(Protocol):
    copies: int  # most block copies one backbone forward holds (sizes the scratch slots)
    head: "MRPHead | None"  # the MRP modes' head: the driver keeps its cache (`HeadCache`)

    def step(self, context: "BlockContext", step: Step) -> Advance:
        """Reveal at least one eligible position of every active row that has one."""
