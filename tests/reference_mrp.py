"""Deliberately slow reference decoders of the MRP modes: direct, speculative and remask.

The specification in code, next to `reference.py` (whose helpers it reuses: the dense
block-causal mask built with Python loops, token choice, quotas, tie-broken sorting).
One prompt at a time; every backbone call recomputes the whole sequence (prompt, finished
blocks, current block) with no KV cache. The MRP head is the unit under reuse, not
re-implemented: every head call also recomputes the whole sequence, the earlier blocks'
clean tokens with the backbone's hidden states of them as h_in, then the current block with
its h_in, under the dense block-causal mask (the head attends to its own keys of every
earlier block, as the published head does); the chained accumulator is summed here
explicitly.

Semantics (the MRP paper's three modes):
- direct: per backbone forward, commit the n_s most confident masked positions of A, then
  up to K head steps (none once the block has no mask left); step k commits the single most
  confident remaining masked position of A + sum C (the head sees the block after every
  commit so far; h_in is h_A + sum h_C).
  Each pick samples with the draw key of the block state it proposes on.
- speculative (naive): the rule is the threshold step with quota 1 (every masked position
  above threshold, else the most confident; threshold 1.0: static, one token), greedy or
  sampled with the draw key of the state it steps from (`reference.revealed`). Each round
  runs the backbone on the current state, drafts S_1 (the backbone's own step) and
  S_2..S_{K+1} (chained head steps, each the rule's step on A + sum C; none after a state
  with one mask left or none: a draft that finishes the block saves no forward; a step
  with S_1 alone is the rule's own), then checks every draft by running the full backbone on
  each candidate state S_j separately: draft j+1 stands while the backbone's own step on
  S_j gives S_{j+1}. The block becomes the last accepted state. Without a head
  (self-drafts), S_2..S_{K+1} are the rule's steps on the seed logits A themselves, each
  over the positions still masked and sampled with its own state's draw key.
- remask: dynamic proposal (every masked position above threshold, the top n_s when fewer
  qualify); the reveals in order of confidence
  (highest first, ties to the lower position); the first is kept, and each next reveal that
  was above threshold is kept while its probability under A + C, with the head run on the
  block holding only the reveals kept before it (h_in = h_A), stays above threshold; the
  first that does not ends the step's reveals (fallback reveals, below threshold, and
  trusted ones, above `remask.TRUSTED_CONFIDENCE`, are kept unchecked).
- remask, paper rules (`decoding/veto.py`): each step proposes as remask above (steps ==
  block size, so the quota is 1: every masked position above threshold, else the most
  confident); with two or
  more proposals one head run on the block before the step, the block alone (h_in = h_A),
  gives C = lm_head(h_C); every
  proposal with |C at its token| > remask_delta goes back to mask, and if none survives the
  one with the smallest |C| stays (ties to the lower position). A lone proposal is kept
  without a head run (a head skip).
- Blocks, stop handling and trimming are those of `reference.py`.

Deliberately not here: batching, caches, speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding import remask
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.head import HeadAttention, KeyRecorder, MRPHead
from reference import (above_threshold, by_score, choose, dense_block_causal_mask, even_quotas,
                       exact_logits, rank_gap, revealed, run_blocks)



@dataclass
class Trace:
    """One prompt's output and what the decode did."""

    token_ids: list[int] = field(default_factory=list)  # generated ids, trimmed
    blocks: int = 0  # decode blocks run
    steps: int = 0  # direct / remask: backbone steps; speculative: rounds with head drafts
    head_calls: int = 0  # head forwards
    histogram: list[int] = field(default_factory=list)  # speculative rounds by head drafts accepted
    lone: int = 0  # speculative: steps of S_1 alone that left a mask (the rule's own forward)
    revoked: int = 0  # remask: proposals sent back to mask
    confirmed: int = 0  # remask: reveals the head's check kept
    trusted: int = 0  # remask: reveals kept unchecked for their confidence
    head_skips: int = 0  # paper remask: steps with one proposal, so no head run
    fallbacks: int = 0  # paper remask: steps whose every proposal was vetoed
    margin: float = math.inf  # the smallest decision margin seen (see `reference.Margins`)

    def add_margin(self, value: float) -> None:
        self.margin = min(self.margin, value)


@torch.no_grad()
def block_state(model: Backbone, sequence: list[int], start: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (L, H) and logits (L, V) of positions [start, start + L), recomputed."""
    T = len(sequence)
    hidden = model(torch.tensor([sequence]), torch.arange(T)[None],
                   dense_block_causal_mask(T, block_size))  # (1, T, H)
    block_hidden = hidden[0, start:start + block_size]  # (L, H)
    return block_hidden, exact_logits(model, block_hidden[None])[0]


@torch.no_grad()
def head_residual(model: Backbone, head: MRPHead, sequence: list[int], block: list[int],
                  hidden_in: torch.Tensor, start: int) -> torch.Tensor:
    """The head's residual hidden h_C (L, H) for one block's tokens and h_in (L, H) at
    `start`, after the clean tokens sequence[:start] with the backbone's hidden states."""
    L = len(block)
    T = start + L
    prefix = torch.tensor([sequence[:start]], dtype=torch.long)  # (1, start)
    prefix_hidden = model(prefix, torch.arange(start)[None],
                          dense_block_causal_mask(start, L))  # (1, start, H)
    mask = dense_block_causal_mask(T, L)  # (1, T, T)
    residual = head(model, torch.cat((prefix, torch.tensor([block])), dim=1),
                    torch.cat((prefix_hidden, hidden_in[None]), dim=1), torch.arange(T)[None],
                    HeadAttention(KeyRecorder(head.config.num_layers), mask))  # (1, T, H)
    return residual[0, start:]


def probability(logits: torch.Tensor, token: int, mask_token_id: int,
                config: DecodeConfig) -> float:
    """Probability of `token` under the tempered softmax of one position's logits (V,)."""
    logits = logits.clone().float()
    logits[mask_token_id] = float("-inf")
    temperature = config.temperature if config.temperature > 0 else 1.0
    return torch.softmax(logits / temperature, dim=0)[token].item()


def threshold_step(logits: torch.Tensor, block: list[int], start: int, mask_token_id: int,
                   config: DecodeConfig, trace: Trace) -> list[int] | None:
    """The block (at absolute position start) after one step of the threshold rule with
    quota 1 (every masked position above config.threshold, else the most confident; 1.0:
    the static one-token pick), sampled as config says; None if nothing is masked."""
    masked = [j for j in range(len(block)) if block[j] == mask_token_id]
    if not masked:
        return None
    draw = revealed(block, mask_token_id)
    picks = {j: choose(logits[j], mask_token_id, config, start + j, draw) for j in masked}
    confidence = {j: picks[j].confidence for j in masked}
    chosen, margin = above_threshold(config.threshold, masked, confidence, 1)
    trace.add_margin(min([margin] + [picks[j].margin for j in chosen]))
    return [picks[j].token if j in chosen else t for j, t in enumerate(block)]


def direct_block(model: Backbone, head: MRPHead, sequence: list[int], start: int,
                 config: DecodeConfig, block_size: int, steps: int, mask_token_id: int,
                 trace: Trace) -> None:
    K = config.lookahead
    quotas = even_quotas(block_size, steps)
    step = 0
    while mask_token_id in sequence[start:start + block_size]:
        hidden, logits = block_state(model, sequence, start, block_size)
        accumulator = hidden  # h_A, then h_A + sum h_C
        for k in range(K + 1):
            if k > 0:
                block = sequence[start:start + block_size]
                if mask_token_id not in block:
                    break
                accumulator = accumulator + head_residual(model, head, sequence, block,
                                                          accumulator, start)
                trace.head_calls += 1
                logits = exact_logits(model, accumulator[None])[0]  # A + sum C
            masked = [j for j in range(block_size) if sequence[start + j] == mask_token_id]
            quota = quotas[min(step, steps - 1)] if k == 0 else 1
            draw = revealed(sequence[start:start + block_size], mask_token_id)
            proposals = {j: choose(logits[j], mask_token_id, config, start + j, draw)
                         for j in masked}
            confidence = {j: p.confidence for j, p in proposals.items()}
            ranked = by_score(masked, confidence, True)
            chosen = ranked[:quota]
            trace.add_margin(rank_gap(ranked, confidence, min(quota, len(masked))))
            for j in chosen:
                trace.add_margin(proposals[j].margin)
                sequence[start + j] = proposals[j].token
        step += 1
    trace.steps += step


def speculative_block(model: Backbone, head: MRPHead | None, sequence: list[int], start: int,
                      config: DecodeConfig, block_size: int, steps: int, mask_token_id: int,
                      trace: Trace) -> None:
    assert steps == block_size
    K = config.lookahead
    while mask_token_id in sequence[start:start + block_size]:
        current = sequence[start:start + block_size]
        hidden, logits = block_state(model, sequence, start, block_size)
        # Draft: S_1 from the backbone, then chained head steps (without a head, the rule
        # again on the seed logits) while masks remain.
        drafts: list[list[int]] = []
        state, accumulator = current, hidden
        for index in range(K + 1):
            state = threshold_step(logits, state, start, mask_token_id, config, trace)
            drafts.append(state)
            if state.count(mask_token_id) <= 1 or index == K:
                break
            if head is None:
                continue
            accumulator = accumulator + head_residual(model, head, sequence, state,
                                                      accumulator, start)
            trace.head_calls += 1
            logits = exact_logits(model, accumulator[None])[0]
        # Verify: the full backbone on each candidate state separately.
        accepted = 1  # S_1 is the backbone's own step
        for j in range(1, len(drafts)):
            candidate = sequence[:start] + drafts[j - 1] + sequence[start + block_size:]
            _, check = block_state(model, candidate, start, block_size)
            if threshold_step(check, drafts[j - 1], start, mask_token_id, config,
                              trace) != drafts[j]:
                break
            accepted += 1
        sequence[start:start + block_size] = drafts[accepted - 1]
        if len(drafts) > 1:  # a round: head drafts were made and verified in one forward
            trace.histogram[accepted - 1] += 1
            trace.steps += 1
        elif mask_token_id in drafts[0]:
            trace.lone += 1


def remask_block(model: Backbone, head: MRPHead, sequence: list[int], start: int,
                 config: DecodeConfig, block_size: int, steps: int, mask_token_id: int,
                 trace: Trace) -> None:
    quotas = even_quotas(block_size, steps)
    step = 0
    while mask_token_id in sequence[start:start + block_size]:
        block = sequence[start:start + block_size]
        hidden, logits = block_state(model, sequence, start, block_size)
        masked = [j for j in range(block_size) if block[j] == mask_token_id]
        draw = revealed(block, mask_token_id)
        proposals = {j: choose(logits[j], mask_token_id, config, start + j, draw) for j in masked}
        confidence = {j: p.confidence for j, p in proposals.items()}
        commit, margin = above_threshold(config.threshold, masked, confidence,
                                         quotas[min(step, steps - 1)])
        trace.add_margin(margin)
        keep = veto_keep if config.vetoes else chain_keep
        kept = keep(model, head, sequence, start, hidden, proposals, commit, config, trace)
        assert kept and set(kept) <= set(commit), "reference remask made no progress"
        trace.revoked += len(commit) - len(kept)
        for j in kept:
            trace.add_margin(proposals[j].margin)
            sequence[start + j] = proposals[j].token
        step += 1
    trace.steps += step


def chain_keep(model: Backbone, head: MRPHead, sequence: list[int], start: int,
               hidden: torch.Tensor, proposals: dict, commit: list[int], config: DecodeConfig,
               trace: Trace) -> list[int]:
    """The reveals remask keeps: one head run per checked reveal, on the ones kept."""
    block = sequence[start:start + len(hidden)]
    confidence = {j: p.confidence for j, p in proposals.items()}
    order = by_score(commit, confidence, True)
    trace.add_margin(min((rank_gap(order, confidence, n) for n in range(1, len(order))),
                         default=math.inf))
    kept, checked = order[:1], False
    for j in order[1:]:
        trusted = remask.TRUSTED_CONFIDENCE  # read at call time: a test may lower it
        trace.add_margin(abs(confidence[j] - trusted))
        if confidence[j] > trusted:
            trace.trusted += 1
        elif confidence[j] > config.threshold:
            state = [proposals[i].token if i in kept else t for i, t in enumerate(block)]
            corrected_hidden = hidden + head_residual(model, head, sequence, state, hidden,
                                                      start)
            corrected = exact_logits(model, corrected_hidden[None])[0]  # A + C
            rescored = probability(corrected[j], proposals[j].token, model.config.mask_token_id,
                                   config)
            trace.add_margin(abs(rescored - config.threshold))
            checked = True
            if rescored <= config.threshold:
                break
            trace.confirmed += 1
        kept.append(j)
    trace.head_calls += checked
    return kept


@torch.no_grad()
def veto_keep(model: Backbone, head: MRPHead, sequence: list[int], start: int,
              hidden: torch.Tensor, proposals: dict, proposed: list[int], config: DecodeConfig,
              trace: Trace) -> list[int]:
    """The proposals that survive |C at the token| <= remask_delta, else the smallest |C|;
    a lone proposal without a head run."""
    trace.add_margin(min(proposals[j].margin for j in proposed))  # C is read at the token
    if len(proposed) == 1:
        trace.head_skips += 1
        return proposed
    L = len(hidden)
    block = sequence[start:start + L]
    residual = head(model, torch.tensor([block]), hidden[None],
                    torch.arange(start, start + L)[None])[0]  # (L, H), the block alone
    trace.head_calls += 1
    C = exact_logits(model, residual[None])[0]  # (L, V)
    magnitude = {j: abs(C[j, proposals[j].token].item()) for j in proposed}
    delta = config.remask_delta
    trace.add_margin(min(abs(magnitude[j] - delta) for j in proposed))
    kept = [j for j in proposed if magnitude[j] <= delta]
    if kept:
        return kept
    trace.fallbacks += 1
    ranked = sorted(proposed, key=lambda j: (magnitude[j], j))
    trace.add_margin(magnitude[ranked[1]] - magnitude[ranked[0]])
    return ranked[:1]


BLOCK_DECODERS = {"direct": direct_block, "speculative": speculative_block,
                  "remask": remask_block}


def reference_mrp_generate(model: Backbone, head: MRPHead | None, prompt: list[int],
                           config: DecodeConfig) -> Trace:
    """Decode one prompt with the MRP mode named by config.mode; see the module docstring."""
    decode_block = BLOCK_DECODERS[config.mode]
    trace = Trace(histogram=[0] * (config.lookahead + 1) if config.mode == "speculative" else [])

    def one_block(sequence, start, block_size, steps, mask_token_id):
        decode_block(model, head, sequence, start, config, block_size, steps, mask_token_id,
                     trace)
        trace.blocks += 1

    trace.token_ids = run_blocks(model, prompt, config, one_block)
    return trace
