"""Speculative MRP decoding (lossless): drafts from the head or from the seed logits, the
backbone verifies.

The rule it reproduces is threshold decoding, one step per forward (`--mode dynamic
--threshold τ`): a step commits every masked position whose confidence exceeds τ, else the
most confident one (`selection.threshold_pick`). At τ = 1.0 no confidence exceeds it, so
the rule is static decoding with one token per step.

Greedy or sampled: a sampled step draws its random numbers from (seed, the state's draw
key, position, token), where the draw key is a function of the block state alone
(`sampling.draw_index`). A draft on state S_j and the verifier's step on S_j therefore use
the same numbers, so "the backbone's own step on S_j" below is the seeded sampled step the
rule takes there, and the output is the seeded sampled decode itself, token for token.

Each round (one step of the driver's loop), from the backbone's logits on the current
block state S_0 (the seed):
- draft: draft 1 is the backbone's own step on S_0; each later draft is the rule's step,
  on the positions still masked after the draft before it, either on A + sum C after one
  more head step (a head draft) or on the seed logits A themselves (a self-draft: no head
  forward, only its verify copy). This gives candidate states S_1 .. S_m; drafting stops
  early once no row has a masked position left. Which source each later draft comes from,
  and how many there are, is the round's plan (`drafting.py`: with `adaptive`, the plan
  its measured acceptance and costs say pays most; without a head, self-drafts only). A
  round without later drafts is the rule's own step: no verify forward, the driver's
  denoise forward on S_1 seeds the next round, as in the rule.
- verify: one backbone forward over the candidates S_1 .. S_v side by side (each sees the
  cached prefix and itself only). A last candidate without masks in any row is not
  verified (v = m - 1): its check could only seed a round that never comes.
- accept: draft j+1 stands while the backbone's own step on S_j equals it (same
  positions, same tokens). Every row advances by its own acceptance; no row waits for
  another.
- commit: the block becomes the last accepted state S_n, and the verify slice of S_n seeds
  the next round, so its first draft is the backbone's free bonus step (no extra forward).
- candidate sets (`candidates.py`, a size the planner picks, 1 = none): the verify forward
  also holds alternatives of each later draft; where S_{n+1} was rejected, an alternative
  equal to the backbone's step on S_n is kept as S_{n+1} and seeds the next round.

Every committed state is the backbone's own step (with the rule's own draws) on the state
before it, so the output equals the rule's decode token for token (up to float rounding:
the step is computed on verify logits, see README); a bad head or poor self-drafts only
lower acceptance.

Shapes: B batch, L block size, H hidden, V vocab, K lookahead, m <= K + 1 drafts,
v <= m verified candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding import candidates
from mrp_dlm.decoding.candidates import Alternatives, Rescue
from mrp_dlm.decoding.drafting import HEAD, SELF, DraftPlanner, Timer
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.head_cache import HeadSteps
from mrp_dlm.decoding.round import count_accepted, record_round, rule_steps
from mrp_dlm.decoding.sampling import Proposal, draw_index, propose
from mrp_dlm.decoding.selection import Rule, select_dynamic
from mrp_dlm.decoding.step import Advance, BackboneStep, BlockRows, Step
from mrp_dlm.decoding.strategies import sampling_of
from mrp_dlm.model.head import HeadBackbone, MRPHead


@dataclass(frozen=True)
class Drafts:
    states: torch.Tensor  # (B, m, L) candidate block states S_1 .. S_m
    valid: torch.Tensor  # (B, m) bool, the draft revealed a position
    finished: bool  # no row has a masked position left in S_m
    sources: tuple[str, ...] = ()  # m - 1 entries: HEAD or SELF, the source of S_2 .. S_m
    alternatives: Alternatives | None = None  # of S_2 .. S_m (`candidates.py`), if built

    @property
    def verified(self) -> int:
        """v: the candidates a verify forward must hold (S_m only if some row goes on)."""
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
        mask_token_id = self.rule.mask_token_id
        return propose(logits, mask_token_id, self.rule.sampling, positions,
                       draw_index(state, mask_token_id))


def draft(drafter: Drafter, seed: BackboneStep, rows: BlockRows, sources: tuple[str, ...],
          spares: bool = False) -> Drafts:
    """Draft 1: the rule's step on the seed logits A; then one draft per entry of `sources`,
    none once no row has a masked position left. HEAD: a head step on the drafts so far,
    then the rule's step on A + sum C; SELF: the rule's step on A itself (no head forward).
    Each step runs on the positions still masked after the draft before it, sampled with
    that state's draw key, as the verifier's step on it is. `spares`: each later draft's
    alternatives too (`candidates.alternatives`, no forward).

    seed: the backbone on rows.tokens. Runs one head step per HEAD draft made (one host
    check per draft).
    """
    accumulator, state, eligible = seed.hidden, rows.tokens, rows.eligible
    threshold = drafter.rule.threshold
    # The rule's proposal on A for S_0's draw key; greedy proposals ignore the key, so every
    # greedy self-draft reuses it (a sampled one draws anew with its own state's key).
    on_seed = drafter.proposal(seed.logits, state, rows.positions)

    def on_seed_at(state: torch.Tensor) -> Proposal:
        """The rule's proposal on A for `state`'s draw key."""
        return on_seed if drafter.rule.sampling.greedy else drafter.proposal(
            seed.logits, state, rows.positions)

    states, valid, made, spare = [], [], [], []
    for source in (SELF, *sources):
        if source == HEAD:
            accumulator = drafter.head.advance(state, accumulator)  # (B, L, H)
            proposal = drafter.proposal(drafter.backbone.logits(accumulator), state,
                                        rows.positions)  # A + sum C
        else:
            proposal = on_seed_at(state) if made else on_seed
        before, state = state, rule_step(proposal, state, eligible, threshold)  # (B, L)
        commit = state != before  # (B, L) the step's reveals
        if spares and made:
            self_draft = None if source == SELF else rule_step(
                on_seed_at(before), before, eligible, threshold)  # (B, L)
            spare.append(candidates.alternatives(before, state, eligible, proposal.confidence,
                                                 proposal.tokens, self_draft))
        states.append(state)
        valid.append(commit.any(dim=1))
        made.append(source)
        eligible = eligible & ~commit
        finished = not bool(eligible.any())
        if finished:
            break
    return Drafts(torch.stack(states, dim=1), torch.stack(valid, dim=1), finished,
                  tuple(made[1:]), candidates.stack(spare) if spare else None)


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
    return Advance(tokens, check.copy_or(checked, moved, seed))


@dataclass(frozen=True)
class Verdict:
    """What a round's verify forward decided."""

    advance: Advance  # the block after the round and the next seed
    accepted: torch.Tensor  # (B,) states accepted (1 + later drafts), without rescues
    rescued: torch.Tensor  # (B,) int64, 1 where an alternative was kept after them
    rescue: Rescue | None  # the alternatives at each row's first rejection, if built
    copies: int  # block copies the verify forward held


@dataclass
class BlockProgress:
    """One lockstep block so far, for the planner's `acceptance.Lockstep`: the rule's steps
    each row advanced and the steps the rounds' plans predicted."""

    key: int  # the batch key (batch size)
    steps: torch.Tensor  # (B,) int64
    predicted: float = 0.0
    drafted: bool = False  # some round verified drafts

    def add(self, steps: torch.Tensor, predicted: float, drafted: bool = False) -> None:
        """A round: steps (B,) each row advanced; what its plan predicted for a row."""
        self.steps += steps
        self.predicted += predicted
        self.drafted |= drafted


@dataclass(frozen=True)
class RoundPlan:
    """How one round's verify forward is built and timed."""

    size: int  # candidate set size (1: no alternatives)
    timer: Timer  # on when the round feeds a cost probe or a set's timing


class SpeculativeDecoder:
    """Keeps, across the calls it serves, the acceptance of each draft source and the round
    costs per batch size (its `DraftPlanner`, see `drafting.py`). Without a head it
    self-drafts only."""

    def __init__(self, config: DecodeConfig, head: MRPHead | None) -> None:
        self.config, self.head = config, head
        self.outcomes = config.lookahead + 1  # rounds by head drafts accepted: 0..K
        self.planner = DraftPlanner(config.lookahead, config.adaptive, head is not None)
        self.sampling = sampling_of(config)
        self.block: BlockProgress | None = None  # the block being decoded

    @property
    def copies(self) -> int:
        """Most block copies a verify forward holds (sizes the scratch slots): the drafts'
        and, where the planner may run candidate sets, their alternatives'."""
        return self.config.lookahead * self.planner.most_size + 1

    def step(self, context: BlockContext, step: Step) -> Advance:
        rows = step.rows
        B = rows.tokens.shape[0]
        rule = Rule(context.schedule.mask_token_id, self.config.threshold, self.sampling)
        self.track_block(step)
        probe, sources = self.planner.probe(B), self.planner.plan(B)
        if not sources and probe is None:  # the rule's own step, as the rule runs it (no
            self.block.add(rows.eligible.any(dim=1), 1.0)  # host check: the driver
            return Advance(rule_steps(  # denoises the result next)
                step.base.logits, rows.tokens, rows.eligible, rows.positions, rule))  # (B, L)
        plan = self.round_plan(context, rows, sources, probe is not None)
        plan.timer.start()
        drafts = draft(Drafter(context.head, context.model, rule), step.base, rows, sources,
                       spares=plan.size > 1 or self.planner.may_set(B, sources))
        draft_seconds = plan.timer.stop()
        m, v = drafts.states.shape[1], drafts.verified
        if v == 0 or (m == 1 and probe is None):  # no later draft: the rule's own step, as
            self.block.add(drafts.valid[:, 0], 1.0)  # the rule runs it (the driver
            return Advance(drafts.states[:, 0])  # denoises next)
        plan.timer.start()
        verdict = self.verify(context, step, drafts, plan.size, rule)
        self.learn_costs(B, plan, probe, drafts, draft_seconds, verdict.copies)
        self.block.add(verdict.accepted + verdict.rescued,
                       self.planner.plan_steps(drafts.sources), drafted=m > 1)
        if m > 1:
            self.record(context, drafts, verdict)
        return verdict.advance

    def track_block(self, step: Step) -> None:
        """At a block's first step, the block before it to the planner (one host read per
        block) and a new count."""
        if step.index:
            return
        self.end_block()
        rows = step.rows.tokens
        self.block = BlockProgress(rows.shape[0], torch.zeros(
            rows.shape[0], dtype=torch.long, device=rows.device))

    def end_block(self) -> None:
        """The block tracked so far to the planner, if it drafted and the planner adapts
        (the read of its rows' steps is the block's one host read)."""
        block, self.block = self.block, None
        if block is not None and block.drafted and self.planner.adaptive:
            self.planner.add_block(block.key, int(block.steps.max()), block.predicted)

    def round_plan(self, context: BlockContext, rows: BlockRows, sources: tuple[str, ...],
                   probing: bool) -> RoundPlan:
        """The set size that fits the scratch slots and whether the round is timed."""
        B, L = rows.tokens.shape
        size = candidates.fitting(self.planner.set_size(B, sources), len(sources),
                                  (context.width - context.start) // L)
        copies = len(sources) + 1 + len(sources) * (size - 1)  # unless drafting stops early
        enabled = probing or self.planner.times_sets(B, size, copies)
        return RoundPlan(size, Timer(rows.tokens.device, enabled=enabled))

    def learn_costs(self, batch: int, plan: RoundPlan, probe, drafts: Drafts,
                    draft_seconds: float, copies: int) -> None:
        """A timed round's costs to the planner: a probe's (a round's verify time includes
        its accept: what a verify copy adds), or a candidate set's own."""
        if probe:
            seconds = plan.timer.stop()
            if drafts.states.shape[1] == 1:
                probe.add_forward(seconds)
            else:
                probe.add_round(drafts.sources.count(HEAD), draft_seconds, copies, seconds)
            self.planner.learn(batch)
        elif plan.size > 1 and plan.timer.enabled:
            self.planner.add_set_round(batch, copies, plan.timer.stop())

    def record(self, context: BlockContext, drafts: Drafts, verdict: "Verdict") -> None:
        """A round's verdicts to the planner (acceptance per source) and the counters."""
        later = record_round(self.planner, drafts.sources, verdict.accepted,
                             drafts.valid)  # (B,) drafts after the first accepted
        context.counters.add_rounds(later + verdict.rescued, drafts.valid[:, 1])
        context.counters.add_drafts(drafts.sources, later, drafts.valid[:, 1:])
        context.counters.add_rescued(verdict.rescued)
        if verdict.rescue is not None:
            self.planner.record_spares(drafts.sources, verdict.rescue)

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
            advance, kept = candidates.keep_rescued(advance, found, rescue, size, check, v)
            rescued = kept.long()
        return Verdict(advance, accepted, rescued, rescue, states.shape[1])
