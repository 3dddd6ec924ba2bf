"""What one denoising step of a block sees and returns: the data the driver's step loop and
every mode share (the `Decoder` protocol a mode implements is the driver's).

A mode differs from another only in its decoder's `step`: given the block, the positions it
may reveal and the backbone's logits and hidden states on the block (`base`), it returns the
block after this step's reveals. Everything around the step (the loop, the first backbone
forward, counting forwards and reveals) is the driver's; what only a mode counts (drafts,
vetoes), the decoder counts and returns (`driver.Decoder.stats`).

Host reads: what is left of a block (`Step.left`, `Advance.left`) is host knowledge. A step
that knows it without looking (a rule that reveals a known number) says so; else the driver
reads it after the step, with its stop check: one read per step, and a step that reads
anyway (to size its own work) carries both in that one read (docs/design.md, "Host reads").

Deliberately not here: the loop itself (see `driver.py`) and any commit rule (see
`selection.py`).

Shapes: B batch, L block size, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from mrp_dlm.decoding.stats import DecodeStats

# Device types whose host reads drain no queue (a CPU computes in order, on the caller's
# thread): there a step may read once more to save work (the drafting chain's stop). Tests
# empty it to count what an accelerator reads.
HOST_READS_FREE = frozenset({"cpu"})


def reads_free(device: torch.device) -> bool:
    """Whether a host read on `device` costs no more than the work it may save."""
    return device.type in HOST_READS_FREE


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
    left: int | None = None  # the most eligible positions a row has (> 0), if the host
    # knows it; None: unknown (a step that depends on it reads it)


@dataclass(frozen=True)
class Advance:
    """The output of one step."""

    tokens: torch.Tensor  # (B, L) the block after this step's reveals
    base: BackboneStep | None = None  # the backbone on `tokens`, if the step already ran it
    left: int | None = None  # the most eligible positions a row of `tokens` has, if the
    # step knows it on the host; None: the driver reads it, unless `go_on`
    going: bool | None = None  # where left == 0: whether a row goes on after the block
    # (None: the driver reads it)
    go_on: bool = False  # left is None, yet the driver calls the next step without a read:
    # a row surely has a masked position, or the decoder's next step reads what is left
    committing: torch.Tensor | None = None  # (B, L, V) per position the logits whose rule
    # step committed it here (None: the step's base logits); read only for logprobs


def revealing(left: int | None, count: int) -> int | None:
    """What is left after a step that reveals `count` positions of each row that has as
    many (fewer where fewer are left), when `left` is known."""
    return None if left is None else max(left - count, 0)


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
