"""`MrpSpeculative`: lossless MRP speculative decoding as an SGLang dLLM algorithm (FDFO).

Each `run()` does one forward in which every request has one or more rows:
- a request with drafts pending verifies them all: its candidates S_1 .. S_M (M = K + 1)
  as extra rows plus its own row carrying S_M (see `verify_batch.py`); it accepts n >= 1
  drafts (`decoding.speculative.accept`), and the verify slice of S_n is the next seed;
- any other request (a fresh block, a finished block to store, or one whose scratch rows
  or slots ran short: the one-row static fallback) forwards its accepted state alone,
  which gives the seed.
Then, per request: the block is done when its accepted state has no masks left AND its
own row forwarded exactly that state (so the clean KV sits in the block's real slots; the
head's keys of the block are written then from that row's hidden states, one head forward
for all requests done in the call, see `head_pool.py`); a clean block whose own row held
another state is stored by one more single-row forward;
otherwise the head drafts S_1 .. S_m from the seed (m <= M: drafting stops once no
request has a mask left), S_1 (the backbone's own threshold step) is accepted at once, and
the own row carries S_m next round. So a request without
scratch rows still advances one exact threshold step per forward.

With `adaptive` (the YAML's, default on) the chain drafts only what pays, each later draft
a head draft or a self-draft (the rule's step on the seed logits, no head step), as
`decoding/drafting.py` plans it from the acceptance of each source measured so far against
the cost of a head step and a row per request, learnt per batch-size bucket from this
server's own timed forwards; with none, a request's next forward is its one row, as
`LowConfidence`'s.

Each drafting round's verified and accepted drafts go to the serving stats (`stats.py`).
Scratch rows and slots are freed inside the same call. Acceptance is per request: no
request waits for another. The rule is `LowConfidence`'s at the YAML's `threshold` (every
masked position above it, else the most confident; 1.0: static decoding, one token per
forward). Every committed state is the backbone's own step on the state before it, so the
output equals `LowConfidence` at that threshold, token for token.

Deliberately not here: the pure draft/accept phases (shared with the library decoder, see
`decoding/speculative.py`) and SGLang batch surgery (see `verify_batch.py`).

Shapes: B requests, N rows, L block size, H hidden, V vocab, M = K + 1 candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mrp_dlm.decoding.drafting import HEAD, SELF, CostProbe, DraftPlanner, Timer
from mrp_dlm.decoding.sampling import SamplingConfig, select_rows
from mrp_dlm.decoding.speculative import Drafts, accept, draft
from mrp_dlm.decoding.step import BackboneStep, BlockRows
from mrp_dlm.serving.base import MrpAlgorithm, prompt_mask_of, run_rows
from mrp_dlm.serving.head_pool import HeadContext
from mrp_dlm.serving.sampling import batch_sampling
from mrp_dlm.serving.stats import stats_of
from mrp_dlm.serving.verify_batch import Scratch, build_rows_batch, reserve


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
    verifying: bool  # the rows are the pending drafts (else: the accepted state alone)


class MrpSpeculative(MrpAlgorithm):
    needs_head = False  # without one it self-drafts

    def __init__(self, config) -> None:
        super().__init__(config)
        self.threshold = self.serving.speculative_threshold
        self.planner = DraftPlanner(self.lookahead, self.serving.adaptive,  # by size bucket
                                    head=self.serving.head is not None)
        self.last_draft = (0, 0, 0.0)  # drafts after the first, head steps, seconds: the last

    def run(self, model_runner, forward_batch, algo_states=None):
        B, L = forward_batch.batch_size, self.block_size
        bucket = 1 << (B - 1).bit_length()  # 1, 2, 4, 8, ...: costs are kept per bucket
        probe = self.planner.probe(bucket)
        timer = Timer(forward_batch.input_ids.device, enabled=probe is not None)
        states = self.carried_states(forward_batch, algo_states)
        scratch = Scratch(model_runner)
        try:
            rounds = self.plan_rounds(scratch, forward_batch, states)
            timer.start()
            out, logits, hidden = self.forward_rounds(model_runner, forward_batch, scratch,
                                                      rounds)
            seconds = timer.stop()
        finally:
            scratch.release()
        if probe is not None:
            self.sample(probe, bucket, rounds, seconds)
        positions = forward_batch.positions.view(B, L).long()  # (B, L)
        sampling = batch_sampling(forward_batch, positions.device)
        seeds = self.settle(states, rounds, logits, hidden, positions, sampling)
        done = self.finish_or_draft(model_runner, forward_batch, states, rounds, seeds,
                                    sampling, self.planner.plan(bucket), timer)
        self.store_done(model_runner, forward_batch, states, rounds, hidden, done)
        next_ids = [state.accepted if d or state.drafts is None else state.drafts.states[0, -1]
                    for state, d in zip(states, done)]
        forward_batch.input_ids.copy_(torch.stack(next_ids).view(-1))
        return (out.logits_output, [row.tolist() for row in next_ids],
                [L if d else 0 for d in done], [None if d else s for s, d in zip(states, done)],
                out.can_run_graph)

    def carried_states(self, forward_batch, algo_states) -> list[BlockState]:
        B, L = forward_batch.batch_size, self.block_size
        ids = forward_batch.input_ids.view(B, L)
        prompt = prompt_mask_of(forward_batch, L, self.mask_id)  # (B, L)
        algo_states = algo_states or [None] * B
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
                rounds.append(Round(state.drafts.states[0], verifying=True))
            else:
                state.drafts = None  # the fallback: one exact step from the accepted state
                rounds.append(Round(state.accepted[None], verifying=False))
        return rounds

    def forward_rounds(self, model_runner, forward_batch, scratch: Scratch,
                       rounds: list[Round]):
        """The one forward of this call: (output, logits (N, L, V), hidden (N, L, H))."""
        L = self.block_size
        if not scratch.reservations:
            own = torch.stack([r.states[-1] for r in rounds])  # (B, L)
            forward_batch.input_ids.copy_(own.view(-1).to(forward_batch.input_ids.dtype))
            return run_rows(model_runner, forward_batch, L)
        rows_ids = torch.cat([r.states for r in rounds])  # (N, L)
        rows, _ = build_rows_batch(model_runner, forward_batch, scratch.reservations,
                                   rows_ids, L)
        return run_rows(model_runner, rows, L)

    def settle(self, states: list[BlockState], rounds: list[Round], logits: torch.Tensor,
               hidden: torch.Tensor, positions: torch.Tensor, sampling: SamplingConfig
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Accept drafts per request; return each request's seed (logits (L, V), hidden (L, H))."""
        seeds, row = [], 0
        for index, (state, round_) in enumerate(zip(states, rounds)):
            m = round_.states.shape[0]
            if round_.verifying:
                n = int(accept(state.drafts, logits[None, row:row + m], state.prompt[None],
                               self.mask_id, positions[index:index + 1], self.threshold,
                               select_rows(sampling, [index]))[0])
                if m > 1:
                    later = state.drafts.valid[:, 1:]  # (1, m - 1)
                    self.planner.record(state.drafts.sources, torch.tensor([n - 1]), later)
                    self_drafted = sum(bool(ok) and source == SELF for ok, source
                                       in zip(later[0].tolist(), state.drafts.sources))
                    stats_of(self).record_round(int(later.sum()), n - 1, self_drafted)
                state.accepted = state.drafts.states[0, n - 1]
                seeds.append((logits[row + n - 1], hidden[row + n - 1]))
            else:
                seeds.append((logits[row], hidden[row]))
            row += m
        return seeds

    def finish_or_draft(self, model_runner, forward_batch, states: list[BlockState],
                        rounds: list[Round], seeds, sampling: SamplingConfig,
                        plan: tuple[str, ...], timer: Timer) -> list[bool]:
        """Done blocks, stores, and new drafts (one batched head chain) for the rest.

        Draft 1 is the backbone's own step on the seed, so it is accepted at once: even
        a request that never gets scratch rows advances one token per forward."""
        done, to_draft = [], []
        for index, (state, round_) in enumerate(zip(states, rounds)):
            state.drafts = None
            if bool(self.open_positions(state).any()):
                to_draft.append(index)
                done.append(False)
            elif bool((round_.states[-1] == state.accepted).all()):
                done.append(True)  # the own row forwarded the clean block: its KV is final
            else:
                done.append(False)  # store: the next round forwards the clean block alone
        if to_draft:
            timer.start()
            context = self.head_context(model_runner, forward_batch, to_draft) \
                if HEAD in plan else None
            index = torch.tensor(to_draft, device=forward_batch.positions.device)
            positions = forward_batch.positions.view(-1, self.block_size)[index].long()
            sources = self.draft_for(context, self.model_parts(model_runner)[1], positions,
                                     [states[i] for i in to_draft],
                                     [seeds[i] for i in to_draft],
                                     select_rows(sampling, to_draft), plan)
            self.last_draft = (len(sources), sources.count(HEAD), timer.stop())
        return done

    def open_positions(self, state: BlockState) -> torch.Tensor:
        return (state.accepted == self.mask_id) & ~state.prompt  # (L,)

    def store_done(self, model_runner, forward_batch, states: list[BlockState],
                   rounds: list[Round], hidden: torch.Tensor, done: list[bool]) -> None:
        """The head's keys of the blocks done in this call, from their own rows' hidden
        states (the own row comes last among a request's rows and forwarded the clean block)."""
        finished = [i for i, d in enumerate(done) if d]
        if not finished:
            return
        own = torch.tensor([r.states.shape[0] for r in rounds]).cumsum(0) - 1  # (B,) own rows
        self.store_blocks(model_runner, forward_batch, finished,
                          torch.stack([states[i].accepted for i in finished]),
                          hidden[own[finished].to(hidden.device)])

    def draft_for(self, context: HeadContext | None, host, positions: torch.Tensor,
                  states: list[BlockState], seeds, sampling: SamplingConfig,
                  plan: tuple[str, ...]) -> tuple[str, ...]:
        """Draft 1 and one candidate per entry of `plan` (fewer once no request has a mask
        left) for every request in one batched chain over `context` (the head on these
        requests' blocks, for the head drafts; None when the plan has none) with the model's
        `host` (its config, embedding and logits); positions (R, L) of the requests'
        blocks. Returns the later drafts' sources."""
        block = torch.stack([s.accepted for s in states])  # (R, L)
        eligible = torch.stack([self.open_positions(s) for s in states])  # (R, L)
        seed = BackboneStep(hidden=torch.stack([hidden for _, hidden in seeds]),
                            logits=torch.stack([logits for logits, _ in seeds]))
        rows = BlockRows(block, eligible, positions.to(block.device))
        drafts = draft(context, host, seed, rows, plan, self.threshold, sampling)
        for row, state in enumerate(states):
            state.accepted = drafts.states[row, 0]  # the backbone's own step: exact
            if bool(self.open_positions(state).any()):
                state.drafts = Drafts(drafts.states[row:row + 1], drafts.valid[row:row + 1],
                                      drafts.finished, drafts.sources)
        return drafts.sources

    def sample(self, probe: CostProbe, bucket: int, rounds: list[Round], seconds: float
               ) -> None:
        """A probe sample from this call's forward when every request held the same number
        of rows: one (a plain forward), or the m candidates of the last drafting."""
        sizes = {r.states.shape[0] for r in rounds}
        if len(sizes) != 1:
            return
        m = sizes.pop()
        if m == 1:
            probe.add_forward(seconds)
        elif all(r.verifying for r in rounds) and self.last_draft[0] == m - 1:
            probe.add_round(self.last_draft[1], self.last_draft[2], m, seconds)
        self.planner.learn(bucket)
