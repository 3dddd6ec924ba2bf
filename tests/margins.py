"""Float-noise robustness of a fast decode: which rows keep their output when the logits
are perturbed.

The slow reference (`reference.py`) records a margin for every decision and is how the
tiny-model tests draw their cases. On the embedded model that margin is useless: the
model is so sure of most tokens that many masked positions have confidence 1 - 1e-7 or
closer, where float32 probabilities are one ulp apart or exactly equal and the static rule
falls back to its position tie-break; the probability gap says "0" although the decision
is stable. There the test is direct: decode again with every backbone logit multiplied by
(1 + `RELATIVE` * N(0, 1)), ten times the noise the exactness tests must survive, and keep
the rows whose output does not move in any of `RUNS` perturbed decodes.

Deliberately not here: margins of single decisions (see `reference.py`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from mrp_dlm.model.backbone import Backbone

RELATIVE = 1e-5  # relative noise of a perturbed decode (10x the suite's noise run)
RUNS = 2  # perturbed decodes a stable row must survive


def noisy(logits_of: Callable[..., torch.Tensor], relative: float,
          generator: torch.Generator) -> Callable[..., torch.Tensor]:
    """`logits_of` returning its logits (B, T, V) * (1 + relative * N(0, 1)), the noise
    drawn from `generator`."""
    def perturbed(*args: torch.Tensor) -> torch.Tensor:
        logits = logits_of(*args)  # (B, T, V)
        noise = torch.randn(logits.shape, generator=generator, device=generator.device)
        return logits * (1 + relative * noise.to(logits.device))

    return perturbed


@contextmanager
def perturbed_logits(model: Backbone, relative: float, seed: int) -> Iterator[None]:
    """Within the block, model.logits returns logits * (1 + relative * N(0, 1)), seeded."""
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    model.logits = noisy(model.logits, relative, generator)
    try:
        yield
    finally:
        del model.logits


def stable_rows(model: Backbone, decode: Callable[[], list[list[int]]],
                want: list[list[int]]) -> list[int]:
    """Indices of the rows of `want` (decode()'s exact output) that every perturbed decode
    reproduces."""
    stable = set(range(len(want)))
    for run in range(RUNS):
        with perturbed_logits(model, RELATIVE, seed=run):
            got = decode()
        stable &= {i for i, (a, b) in enumerate(zip(got, want)) if a == b}
    return sorted(stable)
