"""Every decoding mode on tiny random MoE checkpoints (SDAR-30B-A3B's layout) against
independent decoders built on transformers' `Qwen3MoeForCausalLM` under the block-causal
mask (`reference_moe.TransformersBackbone`), and speculative decoding against its rule.

The library decodes with our backbone loaded from the checkpoint; the references
(`reference.py`, `reference_mrp.py`) run on transformers' layers, router and experts from
the same files. A case counts only when its reference decode keeps every decision at least
MARGIN from flipping: token choices and rule cuts as for the dense model, and every
token's top-k expert choice (the k-th against the (k+1)-th router logit). Each test
asserts how many cases survived.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig, HeadConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.loading import load_backbone, save_backbone
from reference import CASES, MARGIN, reference_decode
from reference_moe import TINY_MOE, TransformersBackbone, as_qwen3_moe, load_qwen3_moe
from reference_mrp import reference_mrp_generate

pytest.importorskip("transformers", minversion="4.51")

MAX_NEW = {4: 13, 8: 13}  # per block size, never a multiple of it
# Prompts drawn per case before it fails: routing adds near-ties (2 layers x every token).
DRAWS = 24
SAMPLED = dict(temperature=0.8, top_k=6, top_p=0.9, seed=5)
ROOT = Path(tempfile.mkdtemp(prefix="mrp-moe-"))  # checkpoints shared by this module's tests
atexit.register(shutil.rmtree, ROOT, True)


@functools.lru_cache(maxsize=None)
def models(seed: int, block_size: int, damped: bool = False) -> tuple:
    """(ours loaded from a saved SDAR-MoE checkpoint, transformers' Qwen3-MoE from it);
    `damped` scales attention outputs by 0.15, so that a reveal changes the other positions'
    logits little and drafts are accepted."""
    directory = ROOT / f"s{seed}-b{block_size}-d{damped:d}"
    model = random_backbone(tiny_config(**TINY_MOE, block_size=block_size), seed=seed)
    with torch.no_grad():
        for layer in model.model.layers if damped else ():
            layer.self_attn.o_proj.weight.mul_(0.15)
    save_backbone(model, directory / "sdar_moe")
    ours = load_backbone(directory / "sdar_moe")
    hf = load_qwen3_moe(as_qwen3_moe(directory / "sdar_moe", directory / "qwen3_moe"))
    return ours, TransformersBackbone(hf, ours.config)


def prompt_of(length: int, seed: int) -> list[int]:
    """Random ids below the stop id 97 (no prompt holds a stop or the mask 98)."""
    generator = torch.Generator().manual_seed(3000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


def with_routing(reference: TransformersBackbone, run):
    """`run(prompt)`'s result with its margin lowered to the routing margin it saw."""

    def decode(prompt):
        reference.routing_margin = float("inf")
        result = run(prompt)
        result.margin = min(result.margin, reference.routing_margin)
        return result

    return decode


def library(model, prompts, config, head=None):
    return generate(model, prompts, config, make_decoder(config, head))


def robust_cases(reference, run, lengths, seed: int) -> list[tuple[list[int], object]]:
    """Per length, the first of up to DRAWS prompts whose reference decode `run(prompt)`
    clears MARGIN everywhere (tokens and routing), with that decode; asserts that every
    length found one and returns them."""
    decode, cases = with_routing(reference, run), []
    for n in lengths:
        for draw in range(DRAWS):
            prompt = prompt_of(n, seed + 100 * draw + n)
            result = decode(prompt)
            CASES["drawn"] += 1  # the session's tally, printed in the test summary
            if result.margin >= MARGIN:
                CASES["kept"] += 1
                cases.append((prompt, result))
                break
    assert len(cases) == len(lengths), f"{len(cases)} of {len(lengths)} lengths survived"
    return cases


HEADS = {
    "zero": lambda model: MRPHead(model.config, HeadConfig(num_layers=1)).eval(),
    "bad": lambda model: random_head(model, 7),
    "mild": lambda model: random_head(model, 7, norm=0.3),
    "none": lambda model: None,  # speculation self-drafts
}


# --- the backbone-only strategies -----------------------------------------------------------

@pytest.mark.parametrize("block_size,steps", [(4, 4), (8, 3)])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["static", "dynamic", "sequential", "entropy"])
def test_strategies_equal_the_transformers_reference(mode, sampling, block_size, steps):
    ours, reference = models(0, block_size)
    config = DecodeConfig(mode=mode, block_size=block_size, steps=steps, threshold=0.3,
                          entropy_bound=4.0, max_new_tokens=MAX_NEW[block_size],
                          stop_token_ids=(), **(SAMPLED if sampling == "sampled" else {}))
    run = functools.partial(reference_decode, reference, config=config)
    for prompt, decoded in robust_cases(reference, run, (8, 6, 3), seed=10):
        assert library(ours, [prompt], config).token_ids[0] == decoded.token_ids


# --- the MRP modes ------------------------------------------------------------------------

MRP_CASES = [  # (mode, block_size, knobs, head)
    ("direct", 4, dict(lookahead=2), "mild"),
    ("direct", 8, dict(lookahead=3, **SAMPLED), "mild"),
    ("speculative", 4, dict(lookahead=3, adaptive=False), "bad"),
    ("speculative", 8, dict(lookahead=2, threshold=0.2, adaptive=False), "mild"),
    ("speculative", 4, dict(lookahead=3, adaptive=False, **SAMPLED), "mild"),
    ("speculative", 8, dict(lookahead=4, threshold=0.2, adaptive=False), "none"),
    ("speculative", 4, dict(lookahead=3, adaptive=False, temperature=1.0, seed=2), "none"),
    ("remask", 4, dict(threshold=0.3), "bad"),
    ("remask", 4, dict(threshold=0.3, remask_rule="paper", remask_delta=2.0), "bad"),
]


@pytest.mark.parametrize("mode,block_size,knobs,head_kind", MRP_CASES)
def test_mrp_modes_equal_the_transformers_reference(mode, block_size, knobs, head_kind):
    ours, reference = models(1, block_size)
    head = HEADS[head_kind](ours)
    config = DecodeConfig(mode=mode, block_size=block_size, max_new_tokens=MAX_NEW[block_size],
                          stop_token_ids=(), **knobs)
    run = functools.partial(reference_mrp_generate, reference, head, config=config)
    for prompt, trace in robust_cases(reference, run, (8, 5), seed=40):
        assert library(ours, [prompt], config, head).token_ids[0] == trace.token_ids, config


# --- speculative decoding equals its rule -----------------------------------------------------

@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
# τ = 1.0: the static rule; τ = 0.6: dynamic steps of several tokens that still leave drafts
# to accept (at 0.2 these damped models commit most of a block per step: no round drafts).
@pytest.mark.parametrize("threshold", [1.0, 0.6])
@pytest.mark.parametrize("block_size", [4, 8])
def test_speculative_equals_its_rule_on_moe(block_size, threshold, sampling):
    ours, reference = models(2, block_size, damped=True)
    knobs = SAMPLED if sampling == "sampled" else {}
    rule = DecodeConfig(mode="dynamic", threshold=threshold, block_size=block_size,
                        max_new_tokens=MAX_NEW[block_size], stop_token_ids=(), **knobs)
    run = functools.partial(reference_decode, reference, config=rule)
    prompts = [prompt for prompt, _ in robust_cases(reference, run, (3, 8, 5, 12), seed=70)]
    want = library(ours, prompts, rule)
    accepted = 0
    for lookahead in (1, 3):
        config = DecodeConfig(mode="speculative", lookahead=lookahead, threshold=threshold,
                              block_size=block_size, max_new_tokens=MAX_NEW[block_size],
                              stop_token_ids=(), adaptive=False, **knobs)
        for name, make_head in HEADS.items():
            got = library(ours, prompts, config, make_head(ours))
            assert got.token_ids == want.token_ids, f"K {lookahead} head {name}"
            assert got.stats.committed == want.stats.committed
            accepted += sum(got.stats.accept_histogram[1:])
    assert accepted > 0  # not vacuous: drafts were accepted

