"""Compiled == eager, token for token (torch.compile of the backbone's block steps and the
head, as benchmarks/compile.py does), on the tiny model with a random head, for every mode family,
batched and solo, on prompts whose reference decode has no decision within float noise of
flipping (compiled kernels round differently).

Slow: compiling takes tens of seconds on a CPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from reference import reference_decode, robust_case
from reference_mrp import reference_mrp_generate

pytestmark = pytest.mark.slow

LENGTHS = (3, 8, 5, 12)
CONFIGS = [DecodeConfig(max_new_tokens=13, stop_token_ids=()),
           DecodeConfig(mode="dynamic", threshold=0.3, max_new_tokens=13, stop_token_ids=()),
           DecodeConfig(mode="speculative", lookahead=2, threshold=0.3, adaptive=False,
                        max_new_tokens=13, stop_token_ids=()),
           DecodeConfig(mode="direct", lookahead=1, max_new_tokens=13, stop_token_ids=())]


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(5000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


class Worst:
    """The smallest margin of a prompt's reference decodes under every config."""

    def __init__(self, model, head, prompt):
        self.margin = min(reference_mrp_generate(model, head, prompt, config).margin
                          if config.mode in ("speculative", "direct")
                          else reference_decode(model, prompt, config).margin
                          for config in CONFIGS)


def decode_all(model, head, prompts):
    out = []
    for config in CONFIGS:
        mode = make_decoder(config, head if config.mode in ("speculative", "direct") else None)
        out.append(generate(model, prompts, config, mode).token_ids)
        out.append([generate(model, [p], config, mode).token_ids[0] for p in prompts[:2]])
    return out


def test_compiled_equals_eager():
    model = random_backbone(tiny_config(), seed=2)
    head = random_head(model, 2, norm=0.3)
    prompts = [robust_case(prompt_of, n, i, lambda p: Worst(model, head, p))[0]
               for i, n in enumerate(LENGTHS)]
    with torch.no_grad():
        eager = decode_all(model, head, prompts)
        model.compile(dynamic=False)
        head.compile(dynamic=False)
        compiled = decode_all(model, head, prompts)
    assert compiled == eager
