"""What one denoising step of a block sees and returns: the data the driver's step loop and
every mode share (the `Decoder` protocol a mode implements is the driver's).

A mode differs from another only in its decoder's `step`: given the block, the positions it
may reveal and the backbone's logits and hidden states on the block (`base`), it returns the
block after this step's reveals. Everything around the step (the loop, the one host check
per step, the first backbone forward, counting forwards and reveals) is the driver's; what
only a mode counts (drafts, vetoes), the decoder counts and returns
(`driver.Decoder.stats`).

Deliberately not here: the loop itself (see `driver.py`) and any commit rule (see
`selection.py`).

Shapes: B batch, L block size, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from mrp_dlm.decoding.stats import DecodeStats


@dataclass(frozen=True)
class BackboneStep:
    """The backbone on one block state."""

    hidden: torch.Tensor  # (B, L, H) final hidden states (base_hidden)
    logits: torch.Tensor  # (B, L, V) float32 same-position logits (base_logits)


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


class Uncounted:
    """A decoder that counts nothing of its own."""

    def begin(self) -> None:
        pass

    def stats(self) -> DecodeStats:
        return DecodeStats()


class Vetoing:
    """A remask decoder's counts of one call: proposals sent back to mask, and steps that
    ran no head forward (the paper's rule)."""

    vetoed: torch.Tensor | None = None  # () int64 on the device, from the first step on
    head_skips: int = 0

    def begin(self) -> None:
        self.vetoed, self.head_skips = None, 0

    def count_vetoes(self, proposed: torch.Tensor, kept: torch.Tensor,
                     head_ran: bool = True) -> None:
        """proposed, kept: (B, L) a step's proposals and the reveals it kept."""
        vetoed = (proposed & ~kept).sum()
        self.vetoed = vetoed if self.vetoed is None else self.vetoed + vetoed
        self.head_skips += not head_ran

    def stats(self) -> DecodeStats:
        vetoed = 0 if self.vetoed is None else int(self.vetoed)
        return DecodeStats(vetoed=vetoed, head_skips=self.head_skips)
