"""`MrpSpeculative`: lossless MRP speculative decoding as an SGLang dLLM algorithm (FDFO).

Each call (`decode`) is one forward in which every request has one or more rows: a request
with drafts pending verifies its candidates S_1 .. S_M (M = K + 1) as extra rows plus its
own row carrying S_M (`sglang_forward.build_rows_batch`); any other request forwards its
accepted state alone. The round then runs batched over all requests, on the device, in the
library's phases (`decoding/speculative.py`): accept and seed (request b accepts n_b >= 1
candidates; the forward's row of S_n seeds it), then plan and draft one chain (S_1, the
rule's own step, is accepted at once: a request that drafts nothing still advances one
exact step per forward). Only as many drafts as the request table's free rows can verify
next call are drafted (`drafters`): at the running-request cap no row is free, and a call
is LowConfidence's forward and step.
A block is done when its accepted state has no masks and its own row forwarded exactly that
state; the head's keys of done blocks are written then (`head_pool.py`). The host reads the
round once: SGLang's answer, the pending drafts, and the verdicts for the planner and the
stats. Every committed state is the backbone's own step on the state before it, so the
output equals `LowConfidence` at the YAML's `threshold`, token for token; with `adaptive`
the planner drafts only what the acceptance and costs it measures say pay.

Not here: the pure draft/accept phases (`decoding/`); SGLang's names (`sglang_forward.py`).

Shapes: B requests, N rows, L block size, H hidden, V vocab, M = K + 1 candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mrp_dlm.decoding.costs import HEAD, SELF, Timer
from mrp_dlm.decoding.drafting import DraftPlanner
from mrp_dlm.decoding.sampling import SamplingConfig
from mrp_dlm.decoding.selection import Rule
from mrp_dlm.decoding.speculative import (Drafter, Drafts, count_accepted, draft,
                                          record_verdicts, rule_steps)
from mrp_dlm.decoding.step import BackboneStep, BlockRows, reads_free
from mrp_dlm.serving.base import MrpAlgorithm
from mrp_dlm.serving.head_pool import HeadContext
from mrp_dlm.serving.sglang_forward import (Answer, Scratch, batch_sampling, block_ids,
                                            block_positions, build_rows_batch, forward_rows,
                                            prompt_mask_of, reserve, served_model,
                                            spare_rows, write_block_ids)
from mrp_dlm.serving.stats import stats_of


@dataclass
class BlockState:
    """What a request carries between rounds of one block."""

    accepted: torch.Tensor  # (L,) the block as accepted so far
    prompt: torch.Tensor  # (L,) bool, prompt positions (never revealed)
    drafts: Optional[Drafts] = None  # (1, M, L) pending candidates; S_1 == accepted


@dataclass(frozen=True)
class Round:
    """One request's rows in this round's forward."""

    states: torch.Tensor  # (m, L) the rows' block states, the own row last
    valid: torch.Tensor  # (m,) bool, the candidate revealed a position (S_1: accepted)
    sources: tuple[str, ...] = ()  # m - 1 entries when verifying: the later drafts' sources


@dataclass(frozen=True)
class Chains:
    """Every request's rows of this call's forward as chains of states padded to the
    longest (`decoding.speculative.count_accepted`): padding repeats a request's own row,
    invalid."""

    rows: torch.Tensor  # (N, L) the forward's rows, each request's own row last
    index: torch.Tensor  # (B, M) int64, the row of each candidate; [:, -1]: the own row
    valid: torch.Tensor  # (B, M) bool, a candidate that may be accepted (S_1 always)
    stepped: torch.Tensor  # (E,) int64, the rows with a successor: S_1 .. S_{m-1} of each
    owner: torch.Tensor  # (E,) int64, the request of each stepped row
    step_of: torch.Tensor  # (B, M - 1) int64, the entry of `stepped` of each predecessor

    @classmethod
    def of(cls, rounds: list[Round]) -> "Chains":
        rows = torch.cat([r.states for r in rounds])  # (N, L)
        device = rows.device
        sizes = [r.states.shape[0] for r in rounds]
        counts, depth = torch.tensor(sizes), torch.arange(max(sizes))  # (B,), (M,)
        starts = counts.cumsum(0) - counts  # (B,)
        index = (starts[:, None] + torch.minimum(depth[None], counts[:, None] - 1)).to(device)
        valid = torch.cat([r.valid for r in rounds])[index]  # (B, M)
        valid = valid & (depth[None] < counts[:, None]).to(device)  # (B, M)
        valid[:, 0] = True  # S_1 is the accepted state: the rule's own step
        # Only a candidate followed by another needs the rule's step (an own row never
        # does): the steps are taken on those E rows alone, known here from the sizes.
        has_next = depth[None, :-1] < (counts - 1)[:, None]  # (B, M - 1)
        firsts = (counts - 1).cumsum(0) - (counts - 1)  # (B,) each request's first entry
        step_of = torch.where(has_next, firsts[:, None] + depth[None, :-1], 0)  # (B, M - 1)
        owner = torch.repeat_interleave(torch.arange(len(rounds)), counts - 1)  # (E,)
        stepped = starts[owner] + torch.arange(owner.shape[0]) - firsts[owner]  # (E,)
        # ^ on the host, from the sizes: S_1 .. S_{m-1} of each request (no device read)
        return cls(rows, index, valid, stepped.to(device), owner.to(device), step_of.to(device))


@dataclass(frozen=True)
class Settled:
    """Every request after this call's acceptance, on the device (no host read)."""

    accepted: torch.Tensor  # (B,) int64 candidates accepted, n >= 1
    block: torch.Tensor  # (B, L) the accepted state S_n
    seed: BackboneStep  # (B, L, H) / (B, L, V) the forward's row of S_n
    eligible: torch.Tensor  # (B, L) bool, masked positions of S_n
    done: torch.Tensor  # (B,) bool, S_n has no masks and the own row forwarded it


@dataclass(frozen=True)
class Drafted:
    """This call's drafting, for every request (the drafts of those that drafted)."""

    first: torch.Tensor  # (B, L) S_1, the backbone's own step on the seed (accepted)
    last: torch.Tensor  # (B, L) what the own row carries next: S_m (S_1 without drafts)
    pending: torch.Tensor  # (B,) bool, S_1 left masks: drafts to verify next round
    drafts: Optional[Drafts] = None  # (R, m, L), m > 1, of `requests`
    requests: tuple[int, ...] = ()  # R requests that drafted, in the order of drafts' rows

    def of(self, request: int) -> Drafts:
        """One request's pending drafts (1, m, L)."""
        row = self.requests.index(request)
        return Drafts(self.drafts.states[row:row + 1], self.drafts.valid[row:row + 1],
                      self.drafts.finished, self.drafts.sources)


@dataclass
class LazyHead:
    """The head's steps on the drafting requests' blocks (`HeadSteps`), their context over
    the head pool built at the first head step only: a chain that stops after S_1 (no
    masks left, as in a prompt block or a done one) builds none."""

    build: Callable[[], HeadContext]  # the context of the drafting requests
    context: Optional[HeadContext] = None  # once built

    def advance(self, tokens: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
        """accumulator (R, L, H) + the head's residual on tokens (R, L)."""
        if self.context is None:
            self.context = self.build()
        return self.context.advance(tokens, accumulator)


class MrpSpeculative(MrpAlgorithm):
    needs_head = False  # without one it self-drafts

    def __init__(self, config) -> None:
        super().__init__(config)
        self.threshold = self.serving.speculative_threshold
        self.planner = DraftPlanner(self.lookahead, self.serving.adaptive,  # by size bucket
                                    head=self.serving.head is not None)
        self.last_draft: tuple[tuple[str, ...], float] = ((), 0.0)  # sources, seconds: the last

    def decode(self, model_runner, forward_batch, algo_states):
        B, L = len(algo_states), self.block_size
        bucket = 1 << (B - 1).bit_length()  # 1, 2, 4, 8, ...: costs are kept per bucket
        probe = self.planner.probe(bucket)
        timer = Timer(block_ids(forward_batch, L).device, enabled=probe is not None)
        states = self.carried_states(forward_batch, algo_states)
        scratch = Scratch(model_runner)
        try:
            rounds = self.plan_rounds(scratch, forward_batch, states)
            chains = Chains.of(rounds)
            timer.start()
            out, logits, hidden = self.forward_rounds(model_runner, forward_batch, scratch,
                                                      chains.rows)
            seconds = timer.stop()
        finally:
            scratch.release()
        stats_of(self).record_rows(B, chains.rows.shape[0], L)
        if probe is not None:
            self.sample(bucket, rounds, self.agreed_seconds(model_runner, seconds))
        positions = block_positions(forward_batch, L)  # (B, L)
        sampling = batch_sampling(forward_batch, positions.device)
        prompt = torch.stack([s.prompt for s in states])  # (B, L)
        settled = self.settle(chains, prompt, logits, hidden, positions, sampling)
        free = spare_rows(model_runner, L)  # free rows for the next verify: none on a full table
        requests, plan = self.drafters(free, self.planner.plan(bucket).sources,
                                       settled.eligible, probe is not None)
        drafted = self.draft_all(model_runner, forward_batch, settled, positions, sampling,
                                 plan, timer, requests)
        write_block_ids(forward_batch, drafted.last)
        read = torch.cat([drafted.last, settled.done[:, None], drafted.pending[:, None],
                          settled.accepted[:, None], chains.valid], dim=1).long().tolist()
        # ^ the one host read: SGLang's answer (next ids, done), pending drafts, verdicts
        self.record(rounds, [row[L + 2:] for row in read])  # counts from the next plan on
        done = [bool(row[L]) for row in read]
        for i, state in enumerate(states):
            state.accepted = drafted.first[i]  # the backbone's own step: exact
            state.drafts = drafted.of(i) if read[i][L + 1] else None
        if free:  # on a full table no request drafts: the head's keys would go unread
            self.store_done(model_runner, forward_batch, settled, hidden[chains.index[:, -1]],
                            done)
        return Answer(out, [row[:L] for row in read], done, states)

    def drafters(self, rows: int, plan: tuple[str, ...], eligible: torch.Tensor,
                 probing: bool) -> tuple[list[int], tuple[str, ...]]:
        """The requests that draft this call and the plan they draft: only as many drafts
        as `rows`, the rows free now, can verify next call (one row each; drafts that find
        no rows are thrown away). With rows for the whole plan of every request, all draft
        it (a block without masks stops its chain at once). With fewer, and the costs of
        this batch size learnt, the requests with masks left share them (a second host
        read, only then), each the same first drafts of the plan: a first draft is the one
        most often accepted, so several requests' first drafts gain more than one
        request's deeper ones. While the costs are being learnt (`probing`) such a cut
        round would only cost: a probe times whole rounds, so none drafts. A request left
        out takes the rule's own step, as LowConfidence's. eligible: (B, L) bool, the
        masked positions of each accepted state."""
        B = eligible.shape[0]
        if rows >= len(plan) * B:
            return (list(range(B)), plan) if plan else ([], ())
        if probing or not rows:
            return [], ()
        masked = [i for i, left in enumerate(eligible.any(dim=1).tolist()) if left]  # host read
        depth = rows // max(len(masked), 1)
        return (masked, plan[:depth]) if depth else (masked[:rows], plan[:1])

    def rule(self, sampling: SamplingConfig) -> Rule:
        """The rule this algorithm reproduces, for the batch's sampling (one row each)."""
        return Rule(self.mask_id, self.threshold, sampling)

    def carried_states(self, forward_batch, algo_states) -> list[BlockState]:
        L = self.block_size
        ids = block_ids(forward_batch, L)  # (B, L)
        prompt = prompt_mask_of(forward_batch, L, self.mask_id)  # (B, L)
        return [state if state is not None else BlockState(ids[i].clone(), prompt[i])
                for i, state in enumerate(algo_states)]

    def plan_rounds(self, scratch: Scratch, forward_batch, states: list[BlockState]
                    ) -> list[Round]:
        """Verify pending drafts where rows and slots allow; otherwise one row (exact)."""
        rounds = []
        for index, state in enumerate(states):
            extra = 0 if state.drafts is None else state.drafts.states.shape[1] - 1
            if state.drafts is not None and (extra == 0 or reserve(
                    scratch, forward_batch, index, extra, self.block_size)):
                rounds.append(Round(state.drafts.states[0], state.drafts.valid[0],
                                    state.drafts.sources))
            else:
                state.drafts = None  # the fallback: one exact step from the accepted state
                rounds.append(Round(state.accepted[None], torch.ones(
                    1, dtype=torch.bool, device=state.accepted.device)))
        return rounds

    def forward_rounds(self, model_runner, forward_batch, scratch: Scratch,
                       rows_ids: torch.Tensor):
        """The one forward of this call over rows_ids (N, L): (output, logits (N, L, V),
        hidden (N, L, H))."""
        L = self.block_size
        if not scratch.reservations:  # one row per request: SGLang's own batch
            write_block_ids(forward_batch, rows_ids)
            return forward_rows(model_runner, forward_batch, L)
        rows, _ = build_rows_batch(model_runner, forward_batch, scratch.reservations,
                                   rows_ids, L)
        return forward_rows(model_runner, rows, L)

    def settle(self, chains: Chains, prompt: torch.Tensor, logits: torch.Tensor,
               hidden: torch.Tensor, positions: torch.Tensor, sampling: SamplingConfig
               ) -> Settled:
        """One batched accept over every request's chain (`decoding/speculative.py`); the verify
        slice of each accepted state S_n is its seed. prompt, positions: (B, L)."""
        B, M = chains.index.shape
        if M == 1:  # one row per request, its own: no copy of the logits
            eligible = (chains.rows == self.mask_id) & ~prompt  # (B, L)
            accepted = torch.ones(B, dtype=torch.long, device=chains.rows.device)  # (B,)
            return Settled(accepted, chains.rows, BackboneStep(hidden, logits), eligible,
                           ~eligible.any(dim=1))
        owner = chains.owner  # some request verifies: the rule's step on S_1 .. S_{m-1}
        states = chains.rows[chains.stepped]  # (E, L)
        eligible = (states == self.mask_id) & ~prompt[owner]  # (E, L)
        steps = rule_steps(logits[chains.stepped], states, eligible, positions[owner],
                           self.rule(sampling).rows(owner))
        accepted = count_accepted(chains.rows[chains.index], chains.valid,
                                  steps[chains.step_of])  # (B,)
        seed_rows = chains.index.gather(1, (accepted - 1)[:, None])[:, 0]  # (B,)
        block = chains.rows[seed_rows]  # (B, L)
        eligible = (block == self.mask_id) & ~prompt  # (B, L)
        own_clean = (chains.rows[chains.index[:, -1]] == block).all(dim=1)  # (B,)
        seed = BackboneStep(hidden[seed_rows], logits[seed_rows])  # (B, L, H), (B, L, V)
        return Settled(accepted, block, seed, eligible, ~eligible.any(dim=1) & own_clean)

    def draft_all(self, model_runner, forward_batch, settled: Settled, positions: torch.Tensor,
                  sampling: SamplingConfig, plan: tuple[str, ...], timer: Timer,
                  requests: list[int]) -> "Drafted":
        """Draft 1 (the backbone's own step on the seed, accepted at once: a request that
        drafts nothing advances one step per forward, as LowConfidence's) for every request,
        and the plan's later drafts in one batched chain over `requests` (a block without
        masks stops the chain at once: its drafts are invalid, none stays pending)."""
        B = settled.block.shape[0]
        none = torch.zeros(B, dtype=torch.bool, device=settled.block.device)  # (B,)
        drafting = set(requests)
        rest = [i for i in range(B) if i not in drafting]
        first = settled.block if not rest else self.rule_steps_of(settled, positions,
                                                                  sampling, rest)  # (B, L)
        if not requests:
            return Drafted(first, first, none)
        timer.start()
        index = torch.tensor(requests, device=settled.block.device)  # (R,)
        context = LazyHead(lambda: self.head_context(model_runner, forward_batch, requests)) \
            if HEAD in plan else None
        seed = BackboneStep(settled.seed.hidden[index], settled.seed.logits[index])
        rows = BlockRows(settled.block[index], settled.eligible[index], positions[index])
        drafter = Drafter(context, self.model_parts(model_runner)[1],
                          self.rule(sampling).rows(index))
        # Where a read costs a sync, the chain runs the plan through with no stop check (a
        # draft after a finished one reveals nothing and is never accepted).
        most = None if reads_free(rows.tokens.device) else rows.tokens.shape[1]
        drafts = draft(drafter, seed, rows, plan, most=most)  # (R, m, L)
        self.last_draft = (drafts.sources, timer.stop())
        first = first.index_copy(0, index, drafts.states[:, 0])  # (B, L)
        if drafts.states.shape[1] == 1:
            return Drafted(first, first, none)
        return Drafted(first, first.index_copy(0, index, drafts.states[:, -1]),
                       none.index_copy(0, index, drafts.valid[:, 1]), drafts, tuple(requests))

    def rule_steps_of(self, settled: Settled, positions: torch.Tensor,
                      sampling: SamplingConfig, rows: list[int]) -> torch.Tensor:
        """Every request's block (B, L), the rule's own step taken on `rows` of them."""
        if len(rows) == settled.block.shape[0]:
            return rule_steps(settled.seed.logits, settled.block, settled.eligible,
                              positions, self.rule(sampling))  # (B, L)
        index = torch.tensor(rows, device=settled.block.device)  # (R,)
        steps = rule_steps(settled.seed.logits[index], settled.block[index],
                           settled.eligible[index], positions[index],
                           self.rule(sampling).rows(index))  # (R, L)
        return settled.block.index_copy(0, index, steps)  # (B, L)

    def record(self, rounds: list[Round], verdicts: list[list[int]]) -> None:
        """The verify rounds' verdicts, from the host copy `verdicts` (per request:
        accepted, chain validity): the planner, per drafting plan, and the serving stats,
        per request."""
        by_sources: dict[tuple[str, ...], list[int]] = {}
        for i, round_ in enumerate(rounds):
            if round_.sources:
                by_sources.setdefault(round_.sources, []).append(i)
        for sources, requests in by_sources.items():
            m = len(sources) + 1
            accepted = [verdicts[i][0] for i in requests]  # (R,)
            valid = [verdicts[i][1:1 + m] for i in requests]  # (R, m)
            record_verdicts(self.planner, sources, torch.tensor(accepted),
                         torch.tensor(valid, dtype=torch.bool))  # host tensors: no device read
            for n, row in zip(accepted, valid):
                self_drafted = sum(ok and source == SELF for ok, source in zip(row[1:], sources))
                stats_of(self).record_round(sum(row[1:]), max(n - 1, 0), self_drafted)

    def store_done(self, model_runner, forward_batch, settled: Settled, own: torch.Tensor,
                   done: list[bool]) -> None:
        """The head's keys of the blocks done in this call, from their own rows' hidden
        states own (B, L, H) (the own row forwarded the clean block)."""
        finished = [i for i, d in enumerate(done) if d]
        if finished:
            self.store_blocks(model_runner, forward_batch, finished, settled.block[finished],
                              own[finished])

    def agreed_seconds(self, model_runner, seconds: float) -> float:
        """This call's forward time, and the last draft's, the same on every TP rank (their
        max), so that every rank learns the same costs and plans the same drafts."""
        agree = getattr(served_model(model_runner), "agree", None)
        if agree is None:
            return seconds
        seconds, drafted = agree([seconds, self.last_draft[1]])
        self.last_draft = (self.last_draft[0], drafted)
        return seconds

    def sample(self, bucket: int, rounds: list[Round], seconds: float) -> None:
        """A probe sample from this call's forward when every request held the same number
        of rows: one (a plain forward), or the m states of the last drafting."""
        sizes = {r.states.shape[0] for r in rounds}
        if len(sizes) != 1:
            return
        m = sizes.pop()
        if m == 1:
            self.planner.time(bucket, seconds, 1)
        elif all(r.sources for r in rounds) and len(self.last_draft[0]) == m - 1:
            self.planner.time(bucket, seconds, m, *self.last_draft)
