"""A deliberately slow reference decoder for block-diffusion LMs: the specification in code.

Every denoising step recomputes the whole sequence (prompt, finished blocks, current
block) with no KV cache and a dense block-causal mask built here; token choice, the four
commit rules, stop handling and trimming are explicit Python loops over positions. It
shares nothing with `mrp_dlm.decoding` except `uniform_noise`, the counter-based random
numbers, so a seeded sampling decode can be reproduced draw for draw.

Semantics (MRP_BRIEF §1):
- Blocks are counted from the row's position 0; the prompt's trailing partial block is
  the first decode block with its prompt tokens fixed.
- Greedy: argmax of the full softmax with the mask logit at -inf; confidence = max prob.
- Sampling: tempered softmax; top-k, then top-p on the renormalised top-k distribution
  (as the SDAR reference's `top_k_logits` then `top_p_logits`); exponential race
  argmax p_kept / (-log u); confidence = tempered probability before truncation.
- Commit rules (ties to the lower position, never more than the masks left):
  static top-n_s; dynamic: all > threshold, else top-n_s; sequential leftmost n_s;
  entropy: lowest entropy first while the sum stays <= bound, at least one.
  n_s is the even split of the block over `steps` (earlier steps get the remainder);
  steps past `steps` reuse the last quota.
- Stop: a block is checked for stop ids among its generated tokens once it is fully
  revealed; the output is trimmed after the first stop (kept) and to max_new_tokens.

Deliberately not here: batching (one prompt at a time), speed, anything MRP.
"""

from __future__ import annotations

import math

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.sampling import uniform_noise
from mrp_dlm.model.backbone import Backbone


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
    return model.logits(hidden)[0, start:start + block_size]  # (L, V)


def truncated(probs: list[float], top_k: int, top_p: float) -> list[float]:
    """Top-k, then top-p on the renormalised survivors; unnormalised kept mass."""
    V = len(probs)
    kept = list(probs)
    if 0 < top_k < V:
        kth = sorted(probs, reverse=True)[top_k - 1]
        kept = [p if p >= kth else 0.0 for p in kept]
    if top_p < 1.0:
        total = sum(kept)
        order = sorted(range(V), key=lambda v: -kept[v])
        before = 0.0
        keep = [False] * V
        for v in order:
            keep[v] = before < top_p
            before += kept[v] / total
        kept = [p if keep[v] else 0.0 for v, p in enumerate(kept)]
    return kept


def choose(logits: torch.Tensor, mask_id: int, config: DecodeConfig, position: int,
           step: int) -> tuple[int, float, float]:
    """(token, confidence, entropy) for one position's logits (V,)."""
    logits = logits.clone().float()
    logits[mask_id] = float("-inf")
    temperature = config.temperature if config.temperature > 0 else 1.0
    probs = torch.softmax(logits / temperature, dim=0).tolist()
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    if config.temperature == 0:
        token = 0
        for v in range(len(probs)):
            if probs[v] > probs[token]:
                token = v
        return token, probs[token], entropy
    kept = truncated(probs, config.top_k, config.top_p)
    noise = uniform_noise(config.seed, torch.tensor([[position]]), step, len(probs))[0, 0].tolist()
    token, best = 0, -1.0
    for v in range(len(probs)):
        score = kept[v] / -math.log(noise[v])
        if score > best:
            token, best = v, score
    return token, probs[token], entropy


def by_score(masked: list[int], score: list[float], descending: bool) -> list[int]:
    """Masked positions sorted by score; ties to the lower position."""
    sign = -1.0 if descending else 1.0
    return sorted(masked, key=lambda j: (sign * score[j], j))


def commit_positions(config: DecodeConfig, masked: list[int], confidence: list[float],
                     entropy: list[float], quota: int) -> list[int]:
    """Positions of the block that take their proposal this step."""
    quota = min(quota, len(masked))
    if config.mode == "static":
        return by_score(masked, confidence, True)[:quota]
    if config.mode == "dynamic":
        above = [j for j in masked if confidence[j] > config.threshold]
        return above if len(above) >= quota else by_score(masked, confidence, True)[:quota]
    if config.mode == "sequential":
        return sorted(masked)[:quota]
    if config.mode == "entropy":
        chosen, total = [], 0.0
        for j in by_score(masked, entropy, False):
            if chosen and total + entropy[j] > config.entropy_bound:
                break
            chosen.append(j)
            total += entropy[j]
        return chosen
    raise ValueError(f"reference has no rule {config.mode!r}")


def denoise_block(model: Backbone, sequence: list[int], start: int, config: DecodeConfig,
                  block_size: int, steps: int, mask_id: int) -> list[int]:
    """Reveal every mask of sequence[start:start + L] in place; return the steps used."""
    quotas = even_quotas(block_size, steps)
    step = 0
    while mask_id in sequence[start:start + block_size]:
        logits = block_logits(model, sequence, start, block_size)  # (L, V)
        proposals = [choose(logits[j], mask_id, config, start + j, step) for j in range(block_size)]
        masked = [j for j in range(block_size) if sequence[start + j] == mask_id]
        chosen = commit_positions(config, masked, [p[1] for p in proposals],
                                  [p[2] for p in proposals], quotas[min(step, steps - 1)])
        assert chosen and set(chosen) <= set(masked), "reference rule made no progress"
        for j in chosen:
            sequence[start + j] = proposals[j][0]
        step += 1
    return step


def run_blocks(model: Backbone, prompt: list[int], config: DecodeConfig, decode_block) -> list[int]:
    """The block loop shared by the reference decoders: pad each block with masks, let
    `decode_block(sequence, start, block_size, steps, mask_id)` reveal it, stop after a
    block that generated a stop id; return the generated ids trimmed after the first stop."""
    block_size = config.block_size or model.config.block_size
    steps = config.steps or block_size
    mask_id = model.config.mask_token_id
    stops = model.config.stop_token_ids if config.stop_token_ids is None else config.stop_token_ids
    n = len(prompt)
    sequence = list(prompt)
    start = n // block_size * block_size
    while start < n + config.max_new_tokens:
        sequence += [mask_id] * (start + block_size - len(sequence))
        decode_block(sequence, start, block_size, steps, mask_id)
        if any(t in stops for t in sequence[max(start, n):start + block_size]):
            break
        start += block_size
    generated = sequence[n:n + config.max_new_tokens]
    for index, token in enumerate(generated):
        if token in stops:
            return generated[:index + 1]
    return generated


def reference_generate(model: Backbone, prompt: list[int], config: DecodeConfig) -> list[int]:
    """Generated ids for one prompt, trimmed after the first stop id (kept)."""
    return run_blocks(model, prompt, config,
                      lambda sequence, start, block_size, steps, mask_id:
                      denoise_block(model, sequence, start, config, block_size, steps, mask_id))
