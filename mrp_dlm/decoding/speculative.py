"""Speculative MRP decoding (lossless): drafts from the head or from the seed logits, the
backbone verifies; the output is the threshold rule's (`--mode dynamic --threshold τ`,
`selection.threshold_pick`), greedy or seeded sampled, token for token.

One round (`SpeculativeDecoder.step`, one step of the driver's loop), from the backbone's
logits A on the block state S_0 (the seed):
- look: S_1 = the rule's step on A; the round's one host read (what is left of S_0, S_1);
- plan: the later drafts' sources and the candidate set size (`drafting.DraftPlanner`);
- draft: each later state the rule's step on A + sum C after one more head step (HEAD) or
  on A itself (SELF), on the positions still masked (`draft`);
- verify: one backbone forward over S_1 .. S_v side by side; accept: S_{j+1} stands while
  it equals the rule's step on S_j (`count_accepted`); the block becomes the last accepted
  S_n, whose verify slice seeds the next round;
- record: the verdicts to the planner (read by the next look), the counts to `DecodeStats`.
A sampled step draws with the state's own key (`sampling.draw_index`), so a draft on S_j
draws what the verifier's step on S_j draws. docs/design.md walks the round, beside the
SGLang plugin's, which shares `draft`, `rule_steps`, `count_accepted` and `record_verdicts`.

Shapes: B batch (or requests), N block states, L block size, H hidden, V vocab, K lookahead,
m <= K + 1 drafted states, v <= m verified, D = m - 1 later drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding import candidates
from mrp_dlm.decoding.candidates import Alternatives, Rescue
from mrp_dlm.decoding.costs import HEAD, SELF, SOURCES, Timer
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.drafting import DraftPlanner
from mrp_dlm.decoding.head_cache import HeadSteps
from mrp_dlm.decoding.logprobs import chain_committing
from mrp_dlm.decoding.sampling import Proposal, draw_index, propose
from mrp_dlm.decoding.selection import Rule, select_dynamic, threshold_pick
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.decoding.step import Advance, BackboneStep, BlockRows, Step, reads_free, revealing
from mrp_dlm.decoding.strategies import sampling_of
from mrp_dlm.model.head import HeadBackbone, MRPHead


def rule_steps(logits: torch.Tensor, states: torch.Tensor, eligible: torch.Tensor,
               positions: torch.Tensor, rule: Rule) -> torch.Tensor:
    """The rule's step (`selection.threshold_pick`) on each of N block states: the states
    after it (N, L) int64.

    logits: (N, L, V) the backbone on `states` (N, L); eligible: (N, L) bool what may be
    revealed; positions: (N, L) int64; rule: its sampling one row per state."""
    commit, tokens = threshold_pick(logits, states, eligible, positions, rule)  # (N, L) x2
    return torch.where(commit, tokens, states)  # (N, L)


def count_accepted(states: torch.Tensor, valid: torch.Tensor, steps: torch.Tensor
                   ) -> torch.Tensor:
    """States accepted per chain (B,) int64: 1 + the leading later states that equal the
    rule's step on the one before (0 when S_1 is invalid). A chain is one row's states
    S_1 .. S_M; the plugin pads its chains with invalid states, never accepted.

    states: (B, M, L); valid: (B, M) bool, the state revealed a position; steps:
    (B, M - 1, L) the rule's step on S_1 .. S_{M-1} (verify logits)."""
    agree = (steps == states[:, 1:]).all(dim=2) & valid[:, 1:]  # (B, M - 1)
    return valid[:, 0].long() * (1 + agree.long().cumprod(dim=1).sum(dim=1))  # (B,)


def record_verdicts(planner: DraftPlanner, sources: tuple[str, ...], accepted: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """Give the planner one round's verdicts (`DraftPlanner.observe`); returns the later
    drafts accepted per chain (B,). accepted: (B,) from `count_accepted`; valid: (B, M) of
    the same chains, whose later states came from `sources` (M - 1 entries)."""
    later = (accepted - 1).clamp_min(0)  # (B,)
    planner.observe(sources, later, valid[:, 1:])
    return later


@dataclass(frozen=True)
class Drafts:
    states: torch.Tensor  # (B, m, L) drafted block states S_1 .. S_m
    valid: torch.Tensor  # (B, m) bool, the draft revealed a position
    finished: bool  # no row has a masked position left in S_m
    sources: tuple[str, ...] = ()  # m - 1 entries: HEAD or SELF, the source of S_2 .. S_m
    alternatives: Alternatives | None = None  # of S_2 .. S_m (`candidates.py`), if built
    open: torch.Tensor | None = None  # (B, m) bool, the state leaves a position to reveal

    @property
    def verified(self) -> int:
        """v: the states a verify forward must hold (S_m only if some row goes on)."""
        return self.states.shape[1] - self.finished


@dataclass(frozen=True)
class Drafter:
    """Where drafts come from: the head (None: self-drafts only), the backbone's output
    layer (A + sum C for a head draft's logits) and the rule every draft follows."""

    head: HeadSteps | None
    backbone: HeadBackbone
    rule: Rule

    def proposal(self, logits: torch.Tensor, state: torch.Tensor,
                 positions: torch.Tensor) -> Proposal:
        """The rule's proposal on logits (B, L, V) for `state`'s draw key."""
        mask = self.rule.mask_token_id
        return propose(logits, mask, self.rule.sampling, positions, draw_index(state, mask))


def draft(drafter: Drafter, seed: BackboneStep, rows: BlockRows, sources: tuple[str, ...],
          alternatives: bool = False, on_seed: Proposal | None = None,
          most: int | None = None) -> Drafts:
    """Draft 1: the rule's step on the seed logits A; then one draft per entry of `sources`,
    none once no row has a masked position left. HEAD: a head step on the drafts so far,
    then the rule's step on A + sum C; SELF: the rule's step on A itself (no head forward).
    Each step runs on the positions still masked after the draft before it, sampled with
    that state's draw key, as the verifier's step on it is. `alternatives`: each later
    draft's alternatives too (`candidates.alternatives`, no forward).

    No later draft reveals in a row with one position left: a draft that finishes its row
    needs no logits of its own, so its acceptance saves no forward (the verify that checks
    it is the forward the rule runs on the state before it); such a row's later drafts
    reveal nothing (never accepted, no round), and no draft is made for a batch of them.

    seed: the backbone on rows.tokens; on_seed: the rule's proposal on it, if the caller
    has it. most: the most masked positions a row has after draft 1, if the host knows it:
    every draft reveals one at least, so min(D, most - 1) later drafts and no host check (one
    that finishes early leaves the rest revealing nothing, never accepted); None: one host
    check per draft stops the chain where at most one position is left in every row. One
    head step per HEAD draft made.
    """
    accumulator, state, left = seed.hidden, rows.tokens, rows.eligible  # left: (B, L)
    threshold = drafter.rule.threshold
    if most is not None:
        sources = sources[:max(most - 1, 0)]
    # The rule's proposal on A for S_0's draw key; greedy proposals ignore the key, so every
    # greedy self-draft reuses it (a sampled one draws anew with its own state's key).
    if on_seed is None:
        on_seed = drafter.proposal(seed.logits, state, rows.positions)

    def on_seed_at(state: torch.Tensor) -> Proposal:
        """The rule's proposal on A for `state`'s draw key."""
        return on_seed if drafter.rule.sampling.greedy else drafter.proposal(
            seed.logits, state, rows.positions)

    states, valid, opened, made, found = [], [], [], [], []
    for source in (SELF, *sources):
        # A later draft reveals only in rows with two positions left or more (B, L).
        eligible = left & (left.sum(dim=1, keepdim=True) > 1) if made else left
        if source == HEAD:
            accumulator = drafter.head.advance(state, accumulator)  # (B, L, H)
            proposal = drafter.proposal(drafter.backbone.logits(accumulator), state,
                                        rows.positions)  # A + sum C
        else:
            proposal = on_seed_at(state) if made else on_seed
        before, state = state, rule_step(proposal, state, eligible, threshold)  # (B, L)
        commit = state != before  # (B, L) the step's reveals
        if alternatives and made:
            self_draft = None if source == SELF else rule_step(
                on_seed_at(before), before, eligible, threshold)  # (B, L)
            found.append(candidates.alternatives(before, state, eligible, proposal.confidence,
                                                 proposal.tokens, self_draft))
        states.append(state)
        valid.append(commit.any(dim=1))
        made.append(source)
        left = left & ~commit
        opened.append(left.any(dim=1))
        if most is None:
            most_left = int(left.sum(dim=1).max())  # the host check
            finished = most_left == 0
            if most_left <= 1:  # done, or the next draft would finish every row
                break
        else:
            finished = most == 0  # draft 1 finished the block (else the last is verified)
    return Drafts(torch.stack(states, dim=1), torch.stack(valid, dim=1), finished,
                  tuple(made[1:]), candidates.stack(found) if found else None,
                  torch.stack(opened, dim=1))


def gaining(later: torch.Tensor, opened: torch.Tensor) -> torch.Tensor:
    """The later drafts accepted that saved a forward (B,): all of `later` (B,) but one
    that left no position (opened (B, D) False there, `Drafts.open`), always the last
    accepted: its own logits are never needed, so the forward that checked it is the one
    the rule runs on the state before it. The planner learns from these (`record`)."""
    if opened.shape[1] == 0:
        return later
    rows = torch.arange(later.shape[0], device=later.device)  # (B,)
    finished = (later > 0) & ~opened[rows, (later - 1).clamp_min(0)]  # (B,)
    return later - finished.long()


def rule_step(proposal: Proposal, state: torch.Tensor, eligible: torch.Tensor,
              threshold: float) -> torch.Tensor:
    """The rule's next state (B, L) from state (B, L) with `proposal`'s tokens."""
    commit = select_dynamic(proposal.confidence, eligible, 1, threshold)  # (B, L)
    return torch.where(commit, proposal.tokens, state)


def backbone_steps(drafts: Drafts, logits: torch.Tensor, frozen: torch.Tensor,
                   positions: torch.Tensor, rule: Rule) -> torch.Tensor:
    """The backbone's own step (B, K, L) on each of S_1 .. S_K, K = m - 1.

    logits: (B, v, L, V) backbone logits of the verify states S_1 .. S_v, v >= m - 1;
    frozen: (B, L) bool positions the rule never reveals (prompt, finished rows);
    positions: (B, L); rule: its sampling one row per batch row.
    """
    B, M, L = drafts.states.shape
    K = M - 1
    states = drafts.states[:, :-1].reshape(B * K, L)  # S_1 .. S_K as rows
    rows_logits = logits[:, :K].reshape(B * K, L, -1)  # (B*K, L, V)
    eligible = (states == rule.mask_token_id) & ~frozen.repeat_interleave(K, dim=0)  # (B*K, L)
    return rule_steps(rows_logits, states, eligible, positions.repeat_interleave(K, dim=0),
                      rule.repeated(K)).view(B, K, L)  # its S_{j+1}


def take_accepted(drafts: Drafts, check: BackboneStep, accepted: torch.Tensor,
                  block: torch.Tensor, seed: BackboneStep) -> Advance:
    """The last accepted state S_n and its verify slice as the next seed (n = 0 keeps all).

    A row whose S_n was not verified (n = m > v) has no mask left: its seed is never used.
    """
    index = (accepted - 1).clamp_min(0)  # (B,)
    moved = accepted > 0  # (B,)
    rows = torch.arange(block.shape[0], device=block.device)
    tokens = torch.where(moved[:, None], drafts.states[rows, index], block)  # (B, L)
    checked = index.clamp_max(drafts.verified - 1)  # (B,)
    return Advance(tokens, slice_or(check, checked, moved, seed))


def slice_or(check: BackboneStep, index: torch.Tensor, keep: torch.Tensor,
             other: BackboneStep) -> BackboneStep:
    """Of a forward over several block copies per row (hidden (B, n*L, H), logits
    (B, n*L, V)): each row's copy `index` (B,) where `keep` (B,) bool, else `other`'s row
    (B, L, ·)."""
    B, L = other.logits.shape[:2]
    rows = torch.arange(B, device=index.device)  # (B,)
    hidden = check.hidden.view(B, -1, L, check.hidden.shape[-1])[rows, index]  # (B, L, H)
    logits = check.logits.view(B, -1, L, check.logits.shape[-1])[rows, index]  # (B, L, V)
    keep = keep[:, None, None]  # (B, 1, 1)
    return BackboneStep(torch.where(keep, hidden, other.hidden),
                        torch.where(keep, logits, other.logits))


@dataclass(frozen=True)
class Verdict:
    """What a round's verify forward decided."""

    advance: Advance  # the block after the round and the next seed
    accepted: torch.Tensor  # (B,) states accepted (1 + later drafts), without rescues
    rescued: torch.Tensor  # (B,) int64, 1 where an alternative was kept after them
    rescue: Rescue | None  # the alternatives at each row's first rejection, if built
    copies: int  # block copies the verify forward held


@dataclass
class RoundCounts:
    """The decoder's counts of one call, on the device until `stats`."""

    histogram: torch.Tensor  # (K + 1,) int64, rounds by later states accepted (rescues too)
    drafts: torch.Tensor  # (2, 2) int64, later drafts by source (SOURCES): made, accepted
    rescued: torch.Tensor  # () int64, rounds that kept an alternative

    @classmethod
    def zeros(cls, outcomes: int, device: torch.device) -> "RoundCounts":
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        return cls(zeros(outcomes), zeros(2, 2), zeros())

    def add(self, sources: tuple[str, ...], later: torch.Tensor, valid: torch.Tensor,
            rescued: torch.Tensor) -> None:
        """A verified round: later (B,) drafts accepted after the first, of D = `sources`
        later drafts that revealed a position where valid (B, D); rescued (B,) int64."""
        counted = valid[:, 0]  # (B,) rows that ran a round
        self.histogram.scatter_add_(0, later + rescued, counted.long())  # no host read
        depth = torch.arange(len(sources), device=valid.device)  # (D,)
        stood = valid & (depth[None] < later[:, None])  # (B, D)
        per_depth = torch.stack((valid.sum(dim=0), stood.sum(dim=0)), dim=1)  # (D, 2)
        for d, source in enumerate(sources):  # host-known sources: no index tensor to copy
            self.drafts[SOURCES.index(source)] += per_depth[d]
        self.rescued += rescued.sum()

    def stats(self) -> DecodeStats:
        values = torch.cat((self.histogram, self.drafts.flatten(), self.rescued[None])).tolist()
        histogram, rescued = values[:-5], values[-1]  # one host read per call
        head, head_accepted, own, own_accepted = values[-5:-1]
        return DecodeStats(rounds=sum(histogram),
                           accepted=sum(i * n for i, n in enumerate(histogram)),
                           accept_histogram=histogram, head_drafts=head,
                           head_drafts_accepted=head_accepted, self_drafts=own,
                           self_drafts_accepted=own_accepted, rescued=rescued)


@dataclass(frozen=True)
class Pending:
    """A verified round's verdicts for the planner, on the device until the next look."""

    sources: tuple[str, ...]
    record: torch.Tensor  # `DraftPlanner.record`, with the alternatives' hits if `hits`
    hits: bool


@dataclass(frozen=True)
class Look:
    """What the host knows before a round's plan (`SpeculativeDecoder.look`)."""

    left: int  # the most masked positions an active row has
    first: int  # the same after draft 1, the rule's own step
    going: bool | None = None  # a row goes on after the block, were it done now
    first_going: bool | None = None  # the same after draft 1
    realized: int | None = None  # the lockstep block before's steps, read at a block's start
    read: bool = True  # the look read from the device (its queue is empty after it)


class SpeculativeDecoder:
    """Keeps, across the calls it serves, the acceptance of each draft source and the round
    costs per batch size (its `DraftPlanner`, see `drafting.py`). Without a head it
    self-drafts only."""

    def __init__(self, config: DecodeConfig, head: MRPHead | None) -> None:
        self.config, self.head = config, head
        self.planner = DraftPlanner(config.lookahead, config.adaptive, head is not None,
                                    config.set_size)
        self.sampling = sampling_of(config)
        self.counts: RoundCounts | None = None  # this call's, from its first verified round
        self.pending: Pending | None = None  # the last verified round's, for the planner

    @property
    def copies(self) -> int:
        """Most block copies a verify forward holds (sizes the scratch slots): the drafts'
        and, where the planner may run candidate sets, their alternatives'."""
        return self.config.lookahead * self.planner.most_size + 1

    def begin(self) -> None:
        self.counts = None

    def stats(self) -> DecodeStats:
        if self.counts is None:
            return DecodeStats(accept_histogram=[0] * (self.config.lookahead + 1))
        return self.counts.stats()

    def step(self, context: BlockContext, step: Step) -> Advance:
        rows = step.rows
        B, L = rows.tokens.shape
        rule = Rule(context.schedule.mask_token_id, self.config.threshold, self.sampling)
        drafter = Drafter(context.head, context.model, rule)
        on_seed = drafter.proposal(step.base.logits, rows.tokens, rows.positions)  # on A
        first = rule_step(on_seed, rows.tokens, rows.eligible, rule.threshold)  # S_1 (B, L)
        look = self.look(context, step, first)
        if look.left == 0:  # a verified round's block had nothing left
            return Advance(rows.tokens, step.base, left=0, going=look.going)
        behind = context.head is not None and context.head.behind > L
        plan = self.planner.plan(B, (context.width - context.start) // L, step.index == 0,
                                 look.realized, behind)
        if not plan.sources and plan.probe is None:  # the rule's own step (the driver denoises)
            self.planner.observe((), advanced=(first != rows.tokens).any(dim=1))
            return Advance(first, left=look.first, going=look.first_going)
        timer = Timer(rows.tokens.device, plan.timed)
        timer.start(drained=look.read)
        most = None if reads_free(rows.tokens.device) else look.first
        drafts = draft(drafter, step.base, rows, plan.sources, plan.alternatives, on_seed, most)
        draft_seconds = timer.lap()
        m, v = drafts.states.shape[1], drafts.verified
        if v == 0 or (m == 1 and plan.probe is None):  # no later draft: the rule's own step
            self.planner.observe((), advanced=drafts.valid[:, 0])
            return Advance(first, left=look.first, going=look.first_going)
        verdict = self.verify(context, step, drafts, plan.size, rule)
        if plan.timed:
            self.planner.time(B, timer.lap(), verdict.copies, drafts.sources, draft_seconds,
                              plan.size)
        later = (verdict.accepted - 1).clamp_min(0)  # (B,) later drafts accepted
        self.planner.advance_block(drafts.sources, verdict.accepted + verdict.rescued)
        record = self.planner.record(drafts.sources, gaining(later, drafts.open[:, 1:]),
                                     drafts.valid[:, 1:], verdict.rescue)
        if record is not None:  # read with the next step's look
            self.pending = Pending(drafts.sources, record, verdict.rescue is not None)
        if m > 1:
            self.count(drafts.sources, later, drafts.valid[:, 1:], verdict.rescued)
        return replace(verdict.advance, go_on=True)  # the next step reads what is left

    def look(self, context: BlockContext, step: Step, first: torch.Tensor) -> "Look":
        """What the host knows before the plan; where it does not, the round's one host read:
        what is left of draft 1, `first` (B, L), and of the block where the host does not
        know it (after a verified round), with the stop check of each
        (`BlockContext.progress`), the last round's verdicts, at a block's start the
        block before's steps (`DraftPlanner.block_steps`). None at τ = 1 with the block
        known: draft 1 reveals one position per row."""
        left = step.left
        after = revealing(left, 1) if self.config.threshold >= 1.0 else None
        steps = self.planner.block_steps() if step.index == 0 else None
        if left is not None and after is not None and self.pending is None and steps is None:
            return Look(left, after, read=False)
        pending, self.pending = self.pending, None
        parts = [] if left is not None else [context.progress(step.rows.tokens)]  # known: > 0
        parts += [context.progress(first)]
        parts += [steps[None]] if steps is not None else []
        parts += [pending.record] if pending is not None else []
        values = torch.cat(parts).tolist()  # the round's one host read
        going = None
        if left is None:
            left, going, values = values[0], bool(values[1]), values[2:]
        if pending is not None:
            self.planner.add_record(pending.sources, values[2 + (steps is not None):],
                                    pending.hits)
        return Look(left, values[0], going, bool(values[1]),
                    values[2] if steps is not None else None)

    def count(self, sources: tuple[str, ...], later: torch.Tensor, valid: torch.Tensor,
              rescued: torch.Tensor) -> None:
        """A verified round with later drafts to this call's counts (`RoundCounts.add`)."""
        if self.counts is None:
            self.counts = RoundCounts.zeros(self.config.lookahead + 1, later.device)
        self.counts.add(sources, later, valid, rescued)

    def verify(self, context: BlockContext, step: Step, drafts: Drafts, size: int,
               rule: Rule) -> Verdict:
        """One forward over S_1 .. S_v and, with a set of `size` > 1, the alternatives'
        copies; accept; keep the last accepted state or the alternative after it."""
        B, M, L = drafts.states.shape
        found, v = drafts.alternatives, drafts.verified
        states = drafts.states[:, :v]  # (B, v, L)
        if size > 1 and found is not None:
            states = torch.cat((states, candidates.copies(found, size)), dim=1)  # (B, n, L)
        check = context.verify(states.reshape(B, -1))
        rescued, rescue = torch.zeros(B, dtype=torch.long, device=states.device), None
        if M == 1:
            accepted = drafts.valid[:, 0].long()  # (B,)
        else:
            frozen = ~context.active[:, None].expand(B, L)  # finished rows reveal nothing
            steps = backbone_steps(drafts, check.logits.view(B, states.shape[1], L, -1),
                                   frozen, step.rows.positions, rule)  # (B, M-1, L)
            accepted = count_accepted(drafts.states, drafts.valid, steps)  # (B,)
            if found is not None:
                rescue = candidates.check(found, steps, accepted, drafts.valid[:, 1:])
        advance = take_accepted(drafts, check, accepted, step.rows.tokens, step.base)
        if rescue is not None and states.shape[1] > v:
            kept = candidates.keep_rescued(found, rescue, size, v)
            advance = Advance(torch.where(kept.rescued[:, None], kept.states, advance.tokens),
                              slice_or(check, kept.copy, kept.rescued, advance.base))
            rescued = kept.rescued.long()
        if self.config.logprobs:  # the committing logits along the chain (`logprobs.py`)
            verified = check.logits.view(B, states.shape[1], L, -1)[:, :v]  # (B, v, L, V)
            advance = replace(advance, committing=chain_committing(
                drafts.states, accepted, rule.mask_token_id, step.base.logits, verified))
        return Verdict(advance, accepted, rescued, rescue, states.shape[1])
