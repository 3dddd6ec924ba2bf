"""A deliberately slow reference decoder for block-diffusion LMs: the specification in code.

Every denoising step recomputes the whole sequence (prompt, finished blocks, current
block) with no KV cache and a dense block-causal mask built here; token choice, the four
commit rules, stop handling and trimming are explicit Python loops over positions. It
shares nothing with `mrp_dlm.decoding` except `uniform_noise`, the counter-based random
numbers, so a seeded sampling decode can be reproduced draw for draw.

Semantics (SDAR block diffusion):
- Blocks are counted from the row's position 0; the prompt's trailing partial block is
  the first decode block with its prompt tokens fixed.
- Greedy: argmax of the full softmax with the mask logit at -inf; confidence = max prob.
- Sampling: tempered softmax; top-k, then top-p on the renormalised top-k distribution
  (as the SDAR reference's `top_k_logits` then `top_p_logits`); exponential race
  argmax p_kept / (-log u); confidence = tempered probability before truncation. u is keyed
  by (seed, draw, position, token), draw = how many positions of the block are revealed
  in the state the step proposes on (`revealed`).
- Commit rules (ties to the lower position, never more than the masks left):
  static top-n_s; dynamic: all > threshold, else top-n_s; sequential leftmost n_s;
  entropy: lowest entropy first while the sum stays <= bound, at least one.
  n_s is the even split of the block over `steps` (earlier steps get the remainder);
  steps past `steps` reuse the last quota.
- Stop: a block is checked for stop ids among its generated tokens once it is fully
  revealed; the output is trimmed after the first stop (kept) and to max_new_tokens.
- Margins: every decision that compares floats records how far it was from flipping (a
  token's gap to the runner-up, a confidence's distance from the threshold, the gap at a
  rank cut, the distance of a running entropy sum from its bound). A fast decode computes
  "the same" numbers with other float arithmetic (cache, batching, kernels), so tests
  compare only cases whose smallest margin clears `MARGIN` (see `robust_case`).

Deliberately not here: batching (one prompt at a time), speed, anything MRP.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.race import uniform_noise
from mrp_dlm.model.backbone import Backbone


# Smallest decision margin (probabilities, relative race scores, nats) a compared case may
# have: float noise between two computations of the same logits is ~1e-7 here, and a test
# run that perturbs the fast path's logits by 1e-6 relative noise must still pass.
MARGIN = 1e-4
CASES = {"drawn": 0, "kept": 0}  # tally over the session, printed in the test summary
CANDIDATES = 8  # prompts drawn per exactness case before the case counts as failed


def robust_case(prompt_of, length: int, seed: int, decode) -> tuple[list[int], object]:
    """The first prompt `prompt_of(length, seed + 100 * j)`, j < CANDIDATES, whose
    `decode(prompt)` (anything with a `.margin`) keeps every decision at least MARGIN from
    flipping, with that decode. Deterministic; fails if no candidate qualifies."""
    for j in range(CANDIDATES):
        prompt = prompt_of(length, seed + 100 * j)
        CASES["drawn"] += 1
        decoded = decode(prompt)
        if decoded.margin >= MARGIN:
            CASES["kept"] += 1
            return prompt, decoded
    raise AssertionError(f"none of {CANDIDATES} candidate prompts of length {length} (seed "
                         f"{seed}) has every decision margin >= {MARGIN}")


def even_quotas(block_size: int, steps: int) -> list[int]:
    return [block_size // steps + (1 if s < block_size % steps else 0) for s in range(steps)]


def dense_block_causal_mask(length: int, block_size: int) -> torch.Tensor:
    """(1, T, T) bool: query q sees key k iff k's block <= q's block."""
    rows = [[k // block_size <= q // block_size for k in range(length)] for q in range(length)]
    return torch.tensor(rows, dtype=torch.bool)[None]


@torch.no_grad()
def block_logits(model: Backbone, sequence: list[int], start: int, block_size: int) -> torch.Tensor:
    """Logits (L, V) of positions [start, start + L) from a full recompute of `sequence`."""
    T = len(sequence)
    ids = torch.tensor([sequence])  # (1, T)
    positions = torch.arange(T)[None]  # (1, T)
    hidden = model(ids, positions, dense_block_causal_mask(T, block_size))  # (1, T, H)
    return exact_logits(model, hidden)[0, start:start + block_size]  # (L, V)


def exact_logits(model: Backbone, hidden: torch.Tensor) -> torch.Tensor:
    """lm_head(hidden) in float32, computed here so that a test run which perturbs the
    library's logits (MRP_TEST_LOGIT_NOISE) leaves the reference exact."""
    return model.lm_head(hidden).float()


def truncated(probs: list[float], top_k: int, top_p: float) -> tuple[list[float], float]:
    """Top-k, then top-p on the renormalised survivors: (unnormalised kept mass, margin).

    margin: how far the cut was from moving (the gap between the k-th and the next
    probability; the smallest |mass before a token - top_p|); inf without a cut.
    """
    V = len(probs)
    kept, margin = list(probs), math.inf
    if 0 < top_k < V:
        ranked = sorted(probs, reverse=True)
        kth = ranked[top_k - 1]
        kept = [p if p >= kth else 0.0 for p in kept]
        margin = ranked[top_k - 1] - ranked[top_k]
    if top_p < 1.0:
        total = sum(kept)
        order = sorted(range(V), key=lambda v: -kept[v])
        before = 0.0
        keep = [False] * V
        for v in order:
            keep[v] = before < top_p
            margin = min(margin, abs(before - top_p))
            before += kept[v] / total
        kept = [p if keep[v] else 0.0 for v, p in enumerate(kept)]
    return kept, margin


class Choice(NamedTuple):
    token: int
    confidence: float  # probability of the token before truncation
    entropy: float  # of the full tempered distribution
    margin: float  # how far the choice was from going to another token (see `choose`)


def top_two_gap(scores: list[float]) -> float:
    """Gap between the largest and the second largest score (inf for one score)."""
    top = heapq.nlargest(2, scores)
    return top[0] - top[1] if len(top) == 2 else math.inf


def revealed(block: list[int], mask_token_id: int) -> int:
    """The draw key of a block state: how many of its positions are not masked."""
    return sum(1 for token in block if token != mask_token_id)


def choose(logits: torch.Tensor, mask_token_id: int, config: DecodeConfig, position: int,
           draw: int) -> Choice:
    """Token, confidence, entropy and decision margin for one position's logits (V,).

    Margin: greedy, the gap between the two largest probabilities; sampling, the relative
    gap between the two best race scores, or the truncation margin if smaller.
    """
    logits = logits.clone().float()
    logits[mask_token_id] = float("-inf")
    temperature = config.temperature if config.temperature > 0 else 1.0
    probs = torch.softmax(logits / temperature, dim=0).tolist()
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    if config.temperature == 0:
        token = 0
        for v in range(len(probs)):
            if probs[v] > probs[token]:
                token = v
        return Choice(token, probs[token], entropy, top_two_gap(probs))
    kept, margin = truncated(probs, config.top_k, config.top_p)
    noise = uniform_noise(config.seed, torch.tensor([[position]]), torch.tensor([draw]),
                          len(probs))[0, 0].tolist()
    scores = [kept[v] / -math.log(noise[v]) for v in range(len(probs))]
    token, best = 0, -1.0
    for v in range(len(probs)):
        if scores[v] > best:
            token, best = v, scores[v]
    return Choice(token, probs[token], entropy, min(margin, top_two_gap(scores) / best))


def by_score(masked: list[int], score: list[float], descending: bool) -> list[int]:
    """Masked positions sorted by score; ties to the lower position."""
    sign = -1.0 if descending else 1.0
    return sorted(masked, key=lambda j: (sign * score[j], j))


def rank_gap(ranked: list[int], score: list[float], count: int) -> float:
    """|score| gap between the last of the first `count` ranked positions and the next."""
    if count == 0 or count >= len(ranked):
        return math.inf
    return abs(score[ranked[count - 1]] - score[ranked[count]])


def commit_positions(config: DecodeConfig, masked: list[int], confidence: list[float],
                     entropy: list[float], quota: int) -> tuple[list[int], float]:
    """Positions of the block that take their proposal this step, and the rule's margin:
    how far a score was from changing the chosen set (inf if nothing could)."""
    quota = min(quota, len(masked))
    ranked = by_score(masked, confidence, True)
    if config.mode == "static":
        return ranked[:quota], rank_gap(ranked, confidence, quota)
    if config.mode == "dynamic":
        return above_threshold(config.threshold, masked, confidence, quota)
    if config.mode == "sequential":
        return sorted(masked)[:quota], math.inf
    if config.mode == "entropy":
        return entropy_bounded(config.entropy_bound, masked, entropy)
    raise ValueError(f"reference has no rule {config.mode!r}")


def above_threshold(threshold: float, masked: list[int], confidence: list[float],
                    quota: int) -> tuple[list[int], float]:
    """The dynamic rule (all above threshold, else the top `quota`) and its margin."""
    quota = min(quota, len(masked))
    above = [j for j in masked if confidence[j] > threshold]
    # No probability exceeds 1.0: at threshold 1.0 no confidence is near a decision.
    margin = min((abs(confidence[j] - threshold) for j in masked if threshold < 1.0),
                 default=math.inf)
    if len(above) >= quota:
        return above, margin
    ranked = by_score(masked, confidence, True)
    return ranked[:quota], min(margin, rank_gap(ranked, confidence, quota))


def entropy_bounded(bound: float, masked: list[int],
                    entropy: list[float]) -> tuple[list[int], float]:
    """Lowest entropy first while the sum stays <= bound (at least one), and the margin."""
    ranked = by_score(masked, entropy, False)
    chosen, total, margin = [], 0.0, math.inf
    for j in ranked:
        if chosen:
            margin = min(margin, abs(total + entropy[j] - bound))
            if total + entropy[j] > bound:
                break
        chosen.append(j)
        total += entropy[j]
    return chosen, min(margin, rank_gap(ranked, entropy, len(chosen)))


@dataclass
class Margins:
    """The smallest decision margin a reference decode saw (inf: nothing could flip)."""

    smallest: float = math.inf

    def add(self, value: float) -> None:
        self.smallest = min(self.smallest, value)


def denoise_block(model: Backbone, sequence: list[int], start: int, config: DecodeConfig,
                  block_size: int, steps: int, mask_token_id: int, margins: Margins,
                  committing: dict[int, torch.Tensor] | None = None) -> int:
    """Reveal every mask of sequence[start:start + L] in place; return the steps used.
    `committing` gets, per revealed position, the logits (V,) of the step that revealed it."""
    quotas = even_quotas(block_size, steps)
    step = 0
    while mask_token_id in sequence[start:start + block_size]:
        logits = block_logits(model, sequence, start, block_size)  # (L, V)
        draw = revealed(sequence[start:start + block_size], mask_token_id)
        proposals = [choose(logits[j], mask_token_id, config, start + j, draw)
                     for j in range(block_size)]
        masked = [j for j in range(block_size) if sequence[start + j] == mask_token_id]
        chosen, margin = commit_positions(config, masked, [p.confidence for p in proposals],
                                          [p.entropy for p in proposals],
                                          quotas[min(step, steps - 1)])
        assert chosen and set(chosen) <= set(masked), "reference rule made no progress"
        margins.add(margin)
        for j in chosen:
            margins.add(proposals[j].margin)
            sequence[start + j] = proposals[j].token
            if committing is not None:
                committing[start + j] = logits[j]
        step += 1
    return step


def run_blocks(model: Backbone, prompt: list[int], config: DecodeConfig, decode_block) -> list[int]:
    """The block loop shared by the reference decoders: pad each block with masks, let
    `decode_block(sequence, start, block_size, steps, mask_token_id)` reveal it, stop after a
    block that generated a stop id; return the generated ids trimmed after the first stop."""
    block_size = config.block_size or model.config.block_size
    steps = config.steps or block_size
    mask_token_id = model.config.mask_token_id
    stops = model.config.stop_token_ids if config.stop_token_ids is None else config.stop_token_ids
    n = len(prompt)
    sequence = list(prompt)
    start = n // block_size * block_size
    while start < n + config.max_new_tokens:
        sequence += [mask_token_id] * (start + block_size - len(sequence))
        decode_block(sequence, start, block_size, steps, mask_token_id)
        if any(t in stops for t in sequence[max(start, n):start + block_size]):
            break
        start += block_size
    generated = sequence[n:n + config.max_new_tokens]
    for index, token in enumerate(generated):
        if token in stops:
            return generated[:index + 1]
    return generated


@dataclass
class Decoded:
    token_ids: list[int]  # generated ids, trimmed after the first stop id (kept)
    margin: float  # the smallest decision margin on the way (see `Margins`)
    committing: list[torch.Tensor] | None = None  # per generated id, the logits (V,) of the
    # step that committed it


def reference_decode(model: Backbone, prompt: list[int], config: DecodeConfig) -> Decoded:
    """One prompt's generated ids and the smallest decision margin of its decode."""
    margins, committing = Margins(), {}
    ids = run_blocks(model, prompt, config,
                     lambda sequence, start, block_size, steps, mask_token_id:
                     denoise_block(model, sequence, start, config, block_size, steps,
                                   mask_token_id, margins, committing))
    n = len(prompt)
    return Decoded(ids, margins.smallest, [committing[n + i] for i in range(len(ids))])


def reference_generate(model: Backbone, prompt: list[int], config: DecodeConfig) -> list[int]:
    """Generated ids for one prompt, trimmed after the first stop id (kept)."""
    return reference_decode(model, prompt, config).token_ids
