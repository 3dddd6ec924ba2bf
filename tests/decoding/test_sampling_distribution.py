"""Sampled decoding has the distribution it claims, checked against exact enumeration.

On a tiny backbone with an 8-token vocabulary and one block of 3 generated tokens, the
exact distribution of complete outputs under the sampled threshold rule (tempered
softmax, top-k then top-p, every masked position sampled, the rule commits every sampled
token whose probability exceeds τ, else the most probable one) is enumerated: every step's
joint draw over the masked positions, recursively over states. The library's sampled
decode (one row per seed, 4,000 seeds in one batch) must match it by a chi-square test at
the 0.999 level; speculative decoding with a random head must match it too (it equals the
sampled decode seed by seed; this checks the claim end to end). A decode at another
temperature must fail the same test (the test can tell).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter

import pytest
import torch

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.decoding.sampling import SamplingConfig
from reference import above_threshold, block_logits, truncated

VOCAB, MASK, BLOCK = 8, 7, 3
PROMPT = [1, 4, 2]  # one whole block: the generated block is the second
SEEDS = 4000
# A draw whose rule decision lies within DECISION_MARGIN of flipping (a confidence that close
# to τ or to another's) is at risk from float noise; their total probability must stay far
# below what 4,000 samples can see.
DECISION_MARGIN = 1e-4
MAX_MASS_AT_RISK = 1e-4


@functools.lru_cache(maxsize=None)
def model():
    config = tiny_config(vocab_size=VOCAB, mask_token_id=MASK, stop_token_ids=(6,),
                         block_size=BLOCK)
    return random_backbone(config, seed=3, std=0.8)


def step_outcomes(logits: torch.Tensor, state: tuple[int, ...], config: DecodeConfig):
    """(next state, probability) of one sampled threshold step on state, and the
    probability of the draws whose decision lies within DECISION_MARGIN of flipping."""
    masked = [j for j, t in enumerate(state) if t == MASK]
    full, kept = {}, {}
    for j in masked:
        row = logits[j].clone()
        row[MASK] = float("-inf")
        full[j] = torch.softmax(row / config.temperature, dim=0).tolist()
        mass, _ = truncated(full[j], config.top_k, config.top_p)
        kept[j] = [m / sum(mass) for m in mass]
    outcomes, at_risk = Counter(), 0.0
    supports = [[v for v in range(VOCAB) if kept[j][v] > 0] for j in masked]
    for draw in itertools.product(*supports):
        probability = math.prod(kept[j][v] for j, v in zip(masked, draw))
        confidence = {j: full[j][v] for j, v in zip(masked, draw)}
        chosen, margin = above_threshold(config.threshold, masked, confidence, 1)
        at_risk += probability if margin < DECISION_MARGIN else 0.0
        after = list(state)
        for j, v in zip(masked, draw):
            if j in chosen:
                after[j] = v
        outcomes[tuple(after)] += probability
    return outcomes, at_risk


def exact_distribution(config: DecodeConfig) -> tuple[dict[tuple[int, ...], float], float]:
    """Probability of every complete block, and the probability of reaching a decision
    within DECISION_MARGIN of flipping."""
    start = (MASK,) * BLOCK
    frontier, final, at_risk = {start: 1.0}, Counter(), 0.0
    while frontier:
        nxt = Counter()
        for state, mass in frontier.items():
            with torch.no_grad():
                logits = block_logits(model(), PROMPT + list(state), len(PROMPT), BLOCK)
            outcomes, step_risk = step_outcomes(logits, state, config)
            at_risk += mass * step_risk
            for after, probability in outcomes.items():
                (final if MASK not in after else nxt)[after] += mass * probability
        frontier = nxt
    return dict(final), at_risk


def sampled_outputs(config: DecodeConfig, head=None) -> Counter:
    """Counts of the decoded blocks over SEEDS seeds, one row per seed in one batch (the
    decoder's sampling takes per-row seeds, as a server's batch of requests does)."""
    decoder = make_decoder(config, head)
    decoder.sampling = SamplingConfig(config.temperature, config.top_k, config.top_p,
                                      torch.arange(SEEDS))
    result = generate(model(), [PROMPT] * SEEDS, config, decoder)
    return Counter(tuple(row) for row in result.token_ids)


def chi_square(counts: Counter, exact: dict, total: int) -> tuple[float, int]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled), and its
    degrees of freedom."""
    cells, pooled_expected, pooled_count = [], 0.0, 0
    for outcome, probability in exact.items():
        expected = total * probability
        if expected >= 5:
            cells.append((counts.get(outcome, 0), expected))
        else:
            pooled_expected += expected
            pooled_count += counts.get(outcome, 0)
    pooled_count += sum(n for outcome, n in counts.items() if outcome not in exact)
    if pooled_expected > 0 or pooled_count:
        cells.append((pooled_count, max(pooled_expected, 1e-12)))
    return sum((n - e) ** 2 / e for n, e in cells), len(cells) - 1


def chi_square_quantile(df: int, z: float = 3.0902) -> float:
    """The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


CASES = {
    "static t1.0": dict(mode="dynamic", threshold=1.0, temperature=1.0),
    "dynamic 0.35 t0.7 top_k": dict(mode="dynamic", threshold=0.35, temperature=0.7, top_k=4),
    "static t1.0 top_p": dict(mode="dynamic", threshold=1.0, temperature=1.0, top_p=0.95),
}


@pytest.mark.parametrize("mode", ["rule", "speculative"])
@pytest.mark.parametrize("case", CASES)
def test_sampled_decode_matches_the_enumerated_distribution(case, mode):
    knobs = CASES[case]
    rule = DecodeConfig(block_size=BLOCK, max_new_tokens=BLOCK, stop_token_ids=(), **knobs)
    exact, at_risk = exact_distribution(rule)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-9)
    assert at_risk <= MAX_MASS_AT_RISK, f"{case}: {at_risk:.2e} of the mass is at a near-tie"
    assert len(exact) >= 20, "too few outcomes to tell distributions apart"
    if mode == "rule":
        counts = sampled_outputs(rule)
    else:
        config = DecodeConfig(**{**vars(rule), "mode": "speculative", "lookahead": 2,
                                 "adaptive": False})
        counts = sampled_outputs(config, random_head(model(), 1, norm=0.1))
    statistic, df = chi_square(counts, exact, SEEDS)
    assert statistic < chi_square_quantile(df), (case, mode, statistic, df)


def test_the_check_rejects_a_wrong_temperature():
    rule = DecodeConfig(block_size=BLOCK, max_new_tokens=BLOCK, stop_token_ids=(),
                        **CASES["static t1.0"])
    exact, _ = exact_distribution(rule)
    counts = sampled_outputs(DecodeConfig(**{**vars(rule), "temperature": 0.7}))
    statistic, df = chi_square(counts, exact, SEEDS)
    assert statistic > chi_square_quantile(df), (statistic, df)
