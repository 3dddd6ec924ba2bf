"""The shared loops: prompt layout, prefill, the block loop with store and stop check, and
the step loop inside a block.

Every decoding mode runs through `generate`; a mode differs only in its decoder's `step`
(the `Decoder` protocol), which reveals some positions of one block state. Prefill, the
store forward, the step loop, the host check (at most one per step, the stop check riding
on it), stop handling and counting forwards and commits therefore exist once.

A finished block's store rides on the next block's first denoise forward, and the head's
cache (`head_cache.py`) gets the prefill's and each store's hidden states. Rows are
left-padded by whole blocks so that every row's current block occupies the same cache
slots, each at its own positions. docs/design.md ("Data flow of one `generate` call") has
the details.

Deliberately not here: commit rules (see `selection.py`) and what a mode does in a step
(see `strategies.py` and the MRP modes).

Shapes: B batch, L block size, S cache slots, M block copies in one forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mrp_dlm.config import BlockSchedule, DecodeConfig
from mrp_dlm.decoding.graphs import Bucket, batch_bucket, bucket, slot_bucket
from mrp_dlm.decoding.graphs import SLOT_BUCKET  # noqa: F401 (read here by benchmarks)
from mrp_dlm.decoding.head_cache import HeadCache
from mrp_dlm.decoding.logprobs import LogprobBuffer, TokenLogprob
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.decoding.step import Advance, BackboneStep, BlockRows, Step
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.invariant import copies_as_lone, invariant_enabled
from mrp_dlm.model.masks import block_causal_mask, copies_mask, store_and_next_mask


STORE_AND_NEXT = "store + next"  # the mask key of a forward that stores and denoises


@dataclass(frozen=True)
class Layout:
    """Where each row lives in the slot buffer."""

    pads: torch.Tensor  # (B,) int64, left padding of each row (a multiple of L)
    lengths: torch.Tensor  # (B,) int64, prompt length of each row
    prefix_slots: int  # slots of the prompts' full blocks (the prefill)
    num_blocks: int  # decode blocks the longest-running row needs
    block_size: int  # L

    @property
    def total_slots(self) -> int:
        return self.prefix_slots + self.num_blocks * self.block_size


def plan_layout(lengths: list[int], block_size: int, max_new_tokens: int) -> Layout:
    full = [n // block_size * block_size for n in lengths]
    prefix = max(full)
    blocks = max(-(-(n % block_size + max_new_tokens) // block_size) for n in lengths)
    return Layout(pads=torch.tensor([prefix - f for f in full]), lengths=torch.tensor(lengths),
                  prefix_slots=prefix, num_blocks=blocks, block_size=block_size)


@dataclass
class Counters:
    """Running counts of one call's forwards and commits, changed only through these
    methods; tensor counts stay on the device until the end. What only a mode counts, its
    decoder counts (`Decoder.stats`)."""

    stats: DecodeStats
    committed: torch.Tensor  # () int64
    row_forwards: torch.Tensor  # (2,) int64, row forwards: all, and denoise/verify only
    row_queries: torch.Tensor  # () int64, block tokens those denoise/verify row forwards ran

    @classmethod
    def start(cls, device: torch.device) -> "Counters":
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        return cls(DecodeStats(), zeros(), zeros(2), zeros())

    def add_prefill(self, rows: int) -> None:
        self.stats.prefill_forwards += 1
        self.row_forwards[0] += rows

    def add_denoise(self, active: torch.Tensor, width: int, store: bool = False) -> None:
        """One forward on one block state, `width` = L tokens, of the `active` (B,) rows;
        `store`: it also wrote the previous block's keys and values."""
        self.stats.denoise_forwards += 1
        self.stats.store_forwards += int(store)
        self.add_rows(active, width)

    def add_verify(self, active: torch.Tensor, width: int, lone: bool = False) -> None:
        """One forward on M block states, `width` = M*L tokens; `lone`: its copies ran as
        lone forwards (`BlockContext.invariant`)."""
        self.stats.verify_forwards += 1
        self.stats.lone_verify_forwards += int(lone)
        self.add_rows(active, width)

    def add_rows(self, active: torch.Tensor, width: int) -> None:
        rows = active.sum()
        self.row_forwards += rows
        self.row_queries += width * rows

    def add_commits(self, commit: torch.Tensor) -> None:
        self.committed += commit.sum()


@dataclass(frozen=True)
class Stops:
    """What the stop check reads: where each row's generation starts and ends."""

    prompt_ends: torch.Tensor  # (B,) int64, each row's first generated slot
    end_slots: torch.Tensor  # (B,) int64, the slot after each row's token budget
    stop_ids: torch.Tensor  # (n,) int64


@dataclass
class BlockContext:
    """What a block decoder may use for the current block (slots [start, start + L)).

    Every forward attends over all slots of the cache (static shapes: a compiled step
    compiles once per forward kind); its mask is built once per block.
    """

    model: Backbone
    cache: KVCache
    schedule: BlockSchedule
    start: int  # first slot of the current block
    positions: torch.Tensor  # (B, L) absolute positions of the block
    key_valid: torch.Tensor  # (B, S) False on padding slots
    active: torch.Tensor  # (B,) bool, rows still generating
    counters: Counters
    stops: Stops | None = None  # the stop check's (None: no row ever stops)
    head: HeadCache | None = None  # the MRP modes' head and its cache of earlier blocks
    pending: BackboneStep | None = None  # the block's first step, computed with the last store
    masks: dict[int | str, torch.Tensor] = field(default_factory=dict)  # by copies, or
    # STORE_AND_NEXT: the previous block's store with this block's first step
    invariant: bool = False  # verify copies as lone forwards (DecodeConfig.invariant_verify)
    bucket: Bucket | None = None  # runs the forwards over `cache` (None: eager ones)
    logprobs: LogprobBuffer | None = None  # the committing logprobs (DecodeConfig.logprobs)

    def __post_init__(self) -> None:
        if self.bucket is None:
            self.bucket = Bucket(self.cache)

    @property
    def width(self) -> int:
        return self.cache.keys.shape[3]  # every slot of the cache

    def mask(self, copies: int | str) -> torch.Tensor:
        """(B, T, width) mask of a forward over `copies` >= 1 block copies, or over the
        previous block and this one (`copies` = STORE_AND_NEXT, T = 2L)."""
        if copies not in self.masks:
            L = self.schedule.block_size
            self.masks[copies] = (
                store_and_next_mask(self.key_valid, self.start - L, L, self.width)
                if copies == STORE_AND_NEXT
                else copies_mask(self.key_valid, self.start, L, copies, self.width))
        return self.masks[copies]

    def slot(self, offset: int = 0) -> torch.Tensor:
        """0-dim int64 slot start + offset on the device (`KVCache.slot`: a view, no host
        copy; a tensor, so a compiled or captured step serves every block)."""
        return self.cache.slot(self.start + offset)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, M*L, H) of M copies of the block (M states) in one forward.

        blocks: (B, M*L). Each copy sees the cached prefix and itself only, at the
        block's own positions. Writes only scratch slots (see `model/cache.py`).
        """
        copies = blocks.shape[1] // self.schedule.block_size
        positions = self.positions.repeat(1, copies)  # (B, M*L)
        # Contiguous: a state sliced out of a stack of drafts would otherwise give a compiled
        # step a stride it has not seen (a recompile).
        return self.bucket.backbone(self.model, blocks.contiguous(), positions,
                                    self.mask(copies), self.slot())

    def eligible(self, block: torch.Tensor) -> torch.Tensor:
        """(B, L) masked positions of the rows still generating: what a step may reveal."""
        return (block == self.schedule.mask_token_id) & self.active[:, None]

    def still_active(self, block: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the active rows that go on after the block, were it done as block (B, L)."""
        if self.stops is None:
            return self.active
        L, stops = self.schedule.block_size, self.stops
        slots = torch.arange(self.start, self.start + L, device=block.device)  # (L,)
        generated = slots[None] >= stops.prompt_ends[:, None]  # (B, L)
        return self.active & ~finished_rows(block, generated, stops.end_slots, self.start + L,
                                            stops.stop_ids)

    def progress(self, block: torch.Tensor) -> torch.Tensor:
        """(2,) int64 on the device: the most eligible positions a row of block (B, L) has,
        and 1 if a row goes on after the block were it done now. A step that reads anyway
        puts it in its own read."""
        left = self.eligible(block).sum(dim=1).max()  # ()
        return torch.stack((left, self.still_active(block).any().long()))

    def denoise(self, block: torch.Tensor) -> BackboneStep:
        """The backbone on one block state (B, L); counted as a denoise forward.

        A decoder's first call gets the step the driver already ran on the block's initial
        state together with the previous block's store (see `store_and_denoise`).
        """
        if self.pending is not None:
            step, self.pending = self.pending, None
            return step
        self.counters.add_denoise(self.active, block.shape[1])
        base_hidden = self.forward(block)  # (B, L, H)
        return BackboneStep(base_hidden, self.model.logits(base_hidden))

    def verify(self, states: torch.Tensor) -> BackboneStep:
        """The backbone on M block states (B, M*L) in one verify forward; with `invariant`,
        each copy as a lone denoise forward (`model/invariant.py`: bit-equal logits)."""
        self.counters.add_verify(self.active, states.shape[1], self.invariant)
        if self.invariant:
            return BackboneStep(*copies_as_lone(self.forward, self.model.logits, states,
                                                self.schedule.block_size))
        base_hidden = self.forward(states)  # (B, M*L, H)
        return BackboneStep(base_hidden, self.model.logits(base_hidden))

    def store_and_denoise(self, finished: torch.Tensor, block: torch.Tensor) -> None:
        """One forward: store `finished` (B, L), the block before this one, and denoise `block`.

        The step on `block` (its initial state) becomes the result of the first `denoise`.
        Counted as one denoise forward that also stores.
        """
        L = self.schedule.block_size
        self.counters.add_denoise(self.active, L, store=True)
        positions = torch.cat((self.positions - L, self.positions), dim=1)  # (B, 2L)
        both = torch.cat((finished, block), dim=1)  # (B, 2L)
        both_hidden = self.bucket.backbone(self.model, both, positions,
                                           self.mask(STORE_AND_NEXT), self.slot(-L))  # (B, 2L, H)
        if self.head is not None:
            self.head.add(both_hidden[:, :L])  # clean_hidden: the finished block's store
        base_hidden = both_hidden[:, L:]  # (B, L, H)
        self.pending = BackboneStep(base_hidden, self.model.logits(base_hidden))


class Decoder(Protocol):
    copies: int  # most block copies one backbone forward holds (sizes the scratch slots)
    head: MRPHead | None  # the MRP modes' head: the driver keeps its cache (`HeadCache`)

    def begin(self) -> None:
        """A new call: the decoder's own counts start at zero."""

    def step(self, context: BlockContext, step: Step) -> Advance:
        """Reveal at least one eligible position of every active row that has one."""

    def stats(self) -> DecodeStats:
        """The decoder's own counts of this call (the driver counts forwards and commits)."""


def decode_block(context: BlockContext, block: torch.Tensor, decoder: Decoder,
                 left: int) -> tuple[torch.Tensor, bool]:
    """Steps of `decoder` until no active row of block (B, L) has a mask left: (the final
    block, whether a row goes on after it).

    `left`, the most masked positions an active row has, is known at the start. After a
    step the step says what is left, or the driver reads it together with the stop check
    (`BlockContext.progress`): the one host read per step. Every step reveals at least one
    position of each row that has one, so L steps suffice (one more: a step that only finds
    the block done). The backbone step on the block's state comes from the previous step
    when the mode ran it (speculative verification), else from one denoise forward.
    """
    schedule, base, going = context.schedule, None, None
    for index in range(schedule.block_size + 1):
        if left == 0:
            break
        eligible = context.eligible(block)  # (B, L)
        if base is None:
            base = context.denoise(block)
        rows = BlockRows(tokens=block, eligible=eligible, positions=context.positions)
        outcome: Advance = decoder.step(context, Step(index, schedule.quota(index), rows, base,
                                                      left))
        commit = eligible & (outcome.tokens != block)  # (B, L)
        context.counters.add_commits(commit)
        if context.logprobs is not None:
            committing = base.logits if outcome.committing is None else outcome.committing
            context.logprobs.record(context.start, commit, outcome.tokens, committing)
        block, base, left, going = outcome.tokens, outcome.base, outcome.left, outcome.going
        if left is None and not outcome.go_on:
            left, going = context.progress(block).tolist()  # the one host read per step
    if going is None:
        going = context.still_active(block).any()  # a step knew the block was done
    return block, bool(going)


@dataclass
class DecodeResult:
    token_ids: list[list[int]]  # generated ids per row, trimmed after the first stop id
    stats: DecodeStats = field(default_factory=DecodeStats)
    logprobs: list[list[TokenLogprob]] | None = None  # per output token (DecodeConfig.logprobs)


def check_prompts(prompts: list[list[int]], model: Backbone, config: DecodeConfig) -> None:
    cfg = model.config
    if not prompts:
        raise ValueError("no prompts given")
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty")
        if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
            raise ValueError(f"prompt {index} has token ids outside [0, {cfg.vocab_size})")
        if cfg.mask_token_id in prompt:
            raise ValueError(f"prompt {index} contains the mask token id {cfg.mask_token_id}")
        if len(prompt) + config.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"prompt {index} ({len(prompt)} tokens) + max_new_tokens "
                             f"({config.max_new_tokens}) exceeds the model's maximum length "
                             f"{cfg.max_position_embeddings}")


def build_buffers(prompts: list[list[int]], layout: Layout, mask_token_id: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token buffer, positions and key validity, all (B, S)."""
    B, S = len(prompts), layout.total_slots
    tokens = torch.full((B, S), mask_token_id, dtype=torch.long)  # (B, S)
    for row, prompt in enumerate(prompts):
        pad = int(layout.pads[row])
        tokens[row, pad:pad + len(prompt)] = torch.tensor(prompt)
    slots = torch.arange(S)  # (S,)
    positions = (slots[None] - layout.pads[:, None]).clamp_min(0)  # (B, S)
    key_valid = slots[None] >= layout.pads[:, None]  # (B, S)
    return tokens.to(device), positions.to(device), key_valid.to(device)


def kept(row_tokens: list[int], stop_ids: tuple[int, ...], mask_token_id: int) -> list[int]:
    """Indices of the output ids: up to the first stop id (kept), masks left out."""
    end = len(row_tokens)
    for index, token in enumerate(row_tokens):
        if token in stop_ids:
            end = index + 1
            break
    return [i for i in range(end) if row_tokens[i] != mask_token_id]


def finished_rows(block: torch.Tensor, generated: torch.Tensor, end_slots: torch.Tensor,
                  block_end: int, stop_ids: torch.Tensor) -> torch.Tensor:
    """(B,) rows that generated a stop id in this block or used up their token budget.

    generated: (B, L) bool, False on the prompt tail (a prompt may contain stop ids).
    """
    return (torch.isin(block, stop_ids) & generated).any(dim=1) | (end_slots <= block_end)


@torch.no_grad()
def generate(model: Backbone, prompts: list[list[int]], config: DecodeConfig,
             decoder: Decoder) -> DecodeResult:
    """Decode a batch of token-id prompts block by block with `decoder`'s steps."""
    check_prompts(prompts, model, config)
    began = time.perf_counter()
    schedule = config.resolve(model.config)
    L, device = schedule.block_size, model.lm_head.weight.device
    # With graphs a batch runs as its bucket's rows: the padding rows copy the first prompt
    # (the layout stays the real rows') and are inactive from the start.
    batch = batch_bucket(len(prompts)) if config.cuda_graphs else len(prompts)
    rows = prompts + prompts[:1] * (batch - len(prompts))
    layout = plan_layout([len(p) for p in rows], L, config.max_new_tokens)
    tokens, positions, key_valid = build_buffers(rows, layout, schedule.mask_token_id, device)
    slots = slot_bucket(layout.total_slots + (decoder.copies - 1) * L, config.cuda_graphs)
    caches = bucket(model, batch, slots, config.cuda_graphs)
    caches.graphs.replays.clear()  # this call's
    cache = caches.cache
    head = (HeadCache(decoder.head, model, tokens, positions, key_valid, caches)
            if decoder.head is not None else None)
    counters = Counters.start(device)
    logprobs = (LogprobBuffer(batch, layout.total_slots, config.logprobs, device)
                if config.logprobs else None)
    decoder.begin()
    if layout.prefix_slots:
        P = layout.prefix_slots
        mask = block_causal_mask(torch.arange(P, device=device) // L, key_valid[:, :P])
        # `forward`, not `__call__`: a compiled backbone (`nn.Module.compile`, see
        # benchmarks/compile.py) compiles its block steps, whose shapes repeat; prefill's
        # length differs every call.
        clean_hidden = model.forward(tokens[:, :P], positions[:, :P], mask, cache, 0)  # (B, P, H)
        if head is not None:
            head.add(clean_hidden)
        counters.add_prefill(len(prompts))
    prompt_ends = (layout.pads + layout.lengths).to(device)  # (B,) first generated slot
    end_slots = prompt_ends + config.max_new_tokens  # (B,)
    stop_ids = torch.tensor(schedule.stop_token_ids, dtype=torch.long, device=device)
    stops = Stops(prompt_ends, end_slots, stop_ids)
    active = torch.arange(batch, device=device) < len(prompts)  # (B,) bool
    finished = None  # the previous block, stored by the next block's first forward
    left = L - min(len(p) % L for p in prompts)  # masks of the first block
    invariant = invariant_enabled(config.invariant_verify, config.mode, device)
    for index in range(layout.num_blocks):
        start = layout.prefix_slots + index * L
        block_positions = positions[:, start:start + L].contiguous()  # (B, L)
        context = BlockContext(model, cache, schedule, start, block_positions, key_valid, active,
                               counters, stops, head, bucket=caches,
                               invariant=invariant, logprobs=logprobs)
        if head is not None:
            head.begin(start, block_positions)
        block = tokens[:, start:start + L].clone()  # (B, L)
        if finished is not None:
            context.store_and_denoise(finished, block)
        finished, going = decode_block(context, block, decoder, left)
        tokens[:, start:start + L] = finished
        active, left = context.still_active(finished), L  # a later block: L masks a row
        if not going:  # read with the block's last step
            break
    if head is not None:
        counters.stats.head_forwards = head.steps
        counters.stats.head_store_forwards = head.stores
    counters.stats.graph_replays = sum(caches.graphs.replays.values())
    counters.stats = counters.stats + decoder.stats()  # what only the mode counts
    return finish(tokens[:len(prompts)], layout, config, schedule, counters, began, logprobs)


def finish(tokens: torch.Tensor, layout: Layout, config: DecodeConfig, schedule: BlockSchedule,
           counters: Counters, began: float,
           logprobs: LogprobBuffer | None = None) -> DecodeResult:
    rows = tokens.cpu().tolist()
    out, slots = [], []
    for row, pad, length in zip(rows, layout.pads.tolist(), layout.lengths.tolist()):
        first = pad + length
        generated = row[first:first + config.max_new_tokens]
        indices = kept(generated, schedule.stop_token_ids, schedule.mask_token_id)
        out.append([generated[i] for i in indices])
        slots.append([first + i for i in indices])
    stats = counters.stats
    counts = torch.cat((counters.committed[None], counters.row_forwards,
                        counters.row_queries[None])).tolist()  # one read of the counts
    (stats.committed, stats.row_forwards, stats.row_denoise_forwards,
     stats.row_query_tokens) = counts
    stats.tokens = sum(len(ids) for ids in out)
    stats.seconds = time.perf_counter() - began
    return DecodeResult(token_ids=out, stats=stats,
                        logprobs=None if logprobs is None else logprobs.rows(out, slots))
