"""The block step compiles whole and once per forward kind: `torch.compile(fullgraph=True)`
of the backbone's block steps and the head's forwards breaks no graph, compiles one graph
per distinct shape (never one per block: slots, start positions and masks are device
tensors), and a whole decode of other prompts in the same bucket compiles nothing
(`error_on_recompile`), in static, dynamic, speculative and direct decoding.

Dynamo's eager backend: graph breaks and recompiles are decided before a backend runs, and
it keeps the test fast (the slow tests/decoding/test_compile.py checks inductor's tokens).
Remask is left out: its checks gather a data-dependent number of rows (not capturable).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder

# Threshold 1.0: the rule reveals one position per step, so two prompt sets of the same
# lengths run the same forwards (same kinds and shapes) whatever their tokens.
COMMON = dict(max_new_tokens=10, stop_token_ids=(), cuda_graphs=True)
CONFIGS = [DecodeConfig(**COMMON),
           DecodeConfig(mode="dynamic", threshold=0.5, **COMMON),
           DecodeConfig(mode="speculative", lookahead=2, threshold=1.0, adaptive=False, **COMMON),
           DecodeConfig(mode="direct", lookahead=2, **COMMON)]
LENGTHS = (3, 9, 6)  # batch 3 runs as its bucket of 4 rows


def prompts_of(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=generator).tolist() for n in LENGTHS]


def shapes_seen(model, head, config) -> set:
    """The distinct (module, ids shape) of the block steps and head forwards of an eager
    decode (prefill calls `forward`, which compiles separately, if at all)."""
    seen = set()
    hooks = [module.register_forward_pre_hook(
        lambda module, args, name=name: seen.add((name, tuple(args[0 if name == "backbone"
                                                                  else 1].shape))))
             for name, module in (("backbone", model), ("head", head))]
    decode(model, head, prompts_of(1), config)
    for hook in hooks:
        hook.remove()
    return seen


def decode(model, head, prompts, config):
    decoder = make_decoder(config, head if config.mode in ("speculative", "direct") else None)
    with torch.no_grad():
        return generate(model, prompts, config, decoder)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.mode for c in CONFIGS])
def test_step_compiles_once_per_kind_without_breaks(config, fresh_dynamo):
    model = random_backbone(tiny_config(), seed=6)
    head = random_head(model, 6, norm=0.3)
    kinds = shapes_seen(model, head, config)
    eager = decode(model, head, prompts_of(2), config).token_ids
    for module in (model, head):
        module.compile(fullgraph=True, dynamic=False, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=64):
        decode(model, head, prompts_of(1), config)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == len(kinds), sorted(kinds)
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = decode(model, head, prompts_of(2), config).token_ids
    assert counters["stats"]["unique_graphs"] == len(kinds)  # the second decode compiled none
    assert compiled == eager
