"""The fused attention path (`model/attention.py`) against the reference SDPA call.

- The rule: fused on CUDA without grad, else the reference; `forced_path` overrides it.
- The fused arrangement is what lets a fused CUDA kernel run: one head count (no GQA
  flag), an additive mask in q's dtype with aligned rows, K and V untouched.
- Equal to the reference in float32 on this CPU on tiny shapes: GQA group sizes 1, 2, 4;
  the decode's masks (prefill, left-padded rows, denoise M = 1, verify copies M > 1,
  store + next, widened to every cache slot); whole backbone forwards with a cache; the
  head's masks (its context, and none).
- Whole decodes: `generate` with the fused path forced gives the slow reference decoder's
  tokens on margin-drawn prompts (static, dynamic, speculative with a head).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.model import attention
from mrp_dlm.model.attention import (ALIGN, arrange, attend, attention_path, forced_path,
                                     sdpa_kernel_name)
from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.head import HeadAttention
from mrp_dlm.model.masks import (block_causal_mask, copies_mask, store_and_next_mask,
                                 stored_blocks_mask)
from reference import reference_decode, robust_case
from reference_mrp import reference_mrp_generate

TOL = 1e-6  # float32 attention outputs of order 1: max abs difference between the paths


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got.double() - want.double()).abs().max().item()
    assert got.shape == want.shape and diff <= TOL, f"{what}: max abs diff {diff:.3g} > {TOL}"


# --- the rule -------------------------------------------------------------------------------

def test_the_rule_picks_fused_on_cuda_without_grad_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    with torch.no_grad():
        assert attention_path(cuda) == "fused"
        assert attention_path(cpu) == "reference"
    with torch.enable_grad():
        assert attention_path(cuda) == "reference"  # training keeps the reference
    with forced_path("fused"):
        assert attention_path(cpu) == "fused"
        with forced_path("reference"), torch.no_grad():
            assert attention_path(cuda) == "reference"
        assert attention_path(cpu) == "fused"
    assert attention._forced is None and attention_path(cpu) == "reference"


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="unknown attention path 'flex'"):
        with forced_path("flex"):
            pass
    q, k = torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match="unknown attention path"):
        attend(q, k, k, None, path="flash")


def test_the_fused_arrangement_is_what_fused_kernels_take():
    B, nh, nkv, T, S, hd = 2, 8, 2, 4, 13, 8
    q = torch.randn(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd), the backbone's layout
    k, v = torch.randn(B, nkv, S, hd), torch.randn(B, nkv, S, hd)
    mask = torch.rand(B, T, S) < 0.5
    call = arrange(q, k, v, mask, "fused")
    assert call.query.shape == (B, nkv, 4 * T, hd) and not call.enable_gqa
    assert call.key is k and call.value is v  # never repeated per query head
    assert call.mask.dtype == q.dtype and call.mask.shape == (B, 1, 4 * T, S)
    assert call.mask.stride(-2) % ALIGN == 0 and call.mask.stride(-1) == 1
    allowed = call.mask == 0  # (B, 1, 4T, S): query head group j's row t is mask row t
    assert torch.equal(allowed[:, 0], mask.repeat(1, 4, 1))
    assert torch.isneginf(call.mask[~allowed]).all()
    folded = call.query.reshape(B, nkv, 4, T, hd)  # head kv * 4 + j is group j of kv head kv
    assert torch.equal(folded[:, 1, 3], q[:, 7])
    reference = arrange(q, k, v, mask, "reference")
    assert reference.enable_gqa and reference.mask.dtype == torch.bool


def test_a_long_query_repeats_k_and_v_instead_of_the_mask():
    B, nh, nkv, T, S, hd = 1, 8, 2, 9, 9, 8  # g*T = 36 > 2*nkv*hd = 32
    q, k, v = torch.randn(B, nh, T, hd), torch.randn(B, nkv, S, hd), torch.randn(B, nkv, S, hd)
    mask = torch.rand(B, T, S) < 0.5
    call = arrange(q, k, v, mask, "fused")
    assert call.query is q and not call.enable_gqa and call.mask.shape == (B, 1, T, S)
    assert torch.equal(call.key, k.repeat_interleave(4, 1))  # head h reads key head h // 4
    assert call.mask.stride(-2) % ALIGN == 0
    assert arrange(q[:, :, :8], k, v, mask[:, :8], "fused").query.shape == (B, nkv, 32, hd)


def test_the_kernel_name_is_torchs_choice_on_this_machine():
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 9, 8)
    mask = torch.ones(1, 4, 9, dtype=torch.bool)
    for path in ("reference", "fused"):
        assert sdpa_kernel_name(q, k, k, mask, path) in ("flash", "math")  # a CPU's kernels
        with sdpa_kernel(SDPBackend.MATH):
            assert sdpa_kernel_name(q, k, k, mask, path) == "math"


# --- equal outputs --------------------------------------------------------------------------

def both_paths(q, k, v, mask) -> None:
    """The fused output equals the reference's, under torch's default CPU kernel and under
    the math kernel (the arithmetic of CUDA's fallback)."""
    assert_close(attend(q, k, v, mask, "fused"), attend(q, k, v, mask, "reference"), "default")
    with sdpa_kernel(SDPBackend.MATH):
        assert_close(attend(q, k, v, mask, "fused"), attend(q, k, v, mask, "reference"), "math")


def decode_masks(B: int = 3, L: int = 4, start: int = 8, width: int = 28):
    """The decode's masks over a left-padded batch (row 1 padded by one block, row 2 by two):
    name -> (B, T, S) bool, with T query rows and S keys as the driver builds them. The long
    prefill (T = 40) takes the fused path's other arrangement on the tiny shapes."""
    pads = torch.tensor([0, 4, 8])[:B, None]
    key_valid = torch.arange(max(width, 40))[None] >= pads  # (B, width or 40)
    return {
        "prefill": block_causal_mask(torch.arange(start) // L, key_valid[:, :start]),
        "long prefill": block_causal_mask(torch.arange(40) // L, key_valid[:, :40]),
        "denoise": copies_mask(key_valid, start, L, 1),
        "denoise, every slot": copies_mask(key_valid, start, L, 1, width),
        "verify M=3": copies_mask(key_valid, start, L, 3, width),
        "store + next": store_and_next_mask(key_valid, start, L, width),
        "stored blocks": stored_blocks_mask(key_valid, 4, start, L, width),
    }


@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("name", list(decode_masks()))
def test_fused_equals_reference_on_the_decode_masks(nh, nkv, name):
    mask = decode_masks()[name]
    B, T, S = mask.shape
    generator = torch.Generator().manual_seed(T + S + nh)
    q = torch.randn(B, T, nh, 8, generator=generator).transpose(1, 2)  # (B, nh, T, hd)
    k = torch.randn(B, nkv, S, 8, generator=generator)  # (B, nkv, S, hd)
    v = torch.randn(B, nkv, S, 8, generator=generator)
    both_paths(q, k, v, mask)
    both_paths(q, k, v, None)


@pytest.mark.exact_arithmetic
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_cpu_the_paths_are_bit_equal(dtype):
    """Torch's CPU kernels compute each query row alike however rows are grouped: at
    SDAR-8B's head shapes (32 query heads over 8 key heads, hd 128) the outputs are equal
    bit for bit."""
    generator = torch.Generator().manual_seed(9)
    for name, mask in decode_masks().items():
        B, T, S = mask.shape
        q = torch.randn(B, T, 32, 128, generator=generator).transpose(1, 2).to(dtype)
        k, v = torch.randn(2, B, 8, S, 128, generator=generator).to(dtype)
        for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
            with sdpa_kernel(kernel):
                assert torch.equal(attend(q, k, v, mask, "fused"),
                                   attend(q, k, v, mask, "reference")), f"{name}, {kernel}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_fused_path_runs_a_fused_kernel(dtype):
    """At SDAR-8B's head shapes, key counts around multiples of 32 included."""
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for width in (28, 33, 65, 129):
        for name, mask in decode_masks(width=width).items():
            mask = mask.cuda()
            B, T, S = mask.shape
            q = torch.randn(B, T, 32, 128, device="cuda", dtype=dtype).transpose(1, 2)
            k, v = torch.randn(2, B, 8, S, 128, device="cuda", dtype=dtype)
            with torch.no_grad():
                assert sdpa_kernel_name(q, k, v, mask) in ("efficient", "cudnn"), name
                assert sdpa_kernel_name(q, k, v, None) in ("flash", "efficient", "cudnn")
                got, want = attend(q, k, v, mask), attend(q, k, v, mask, "reference")
            assert (got.float() - want.float()).abs().max() <= tolerance, (name, width)


@torch.no_grad()
def test_backbone_forwards_with_a_cache_are_equal():
    """Prefill, then a verify of 3 copies and a store + next over every slot of the cache,
    on a left-padded batch: the same hidden states and the same cache on both paths."""
    model = random_backbone(tiny_config(), seed=3)
    c, masks = model.config, decode_masks()
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    positions = (torch.arange(28)[None] - torch.tensor([[0], [4], [8]])).clamp_min(0)
    results = {}
    for path in ("reference", "fused"):
        cache = KVCache(c.num_layers, 3, c.num_kv_heads, 28, c.head_dim, torch.float32, "cpu")
        with forced_path(path):
            hidden = [model(ids[:, :8], positions[:, :8], masks["prefill"], cache, 0),
                      model(ids.roll(1, 1), positions[:, 8:12].repeat(1, 3),
                            masks["verify M=3"], cache, 8),
                      model(ids[:, 4:], positions[:, 8:16], masks["store + next"], cache, 8)]
        results[path] = hidden + [cache.keys, cache.values]
    for name, got, want in zip(("prefill", "verify", "store + next", "keys", "values"),
                               results["fused"], results["reference"]):
        assert_close(got, want, name)


@torch.no_grad()
def test_head_forwards_are_equal():
    """The head alone over a block (no mask) and over its context (cache and mask)."""
    model = random_backbone(tiny_config(), seed=4)
    head = random_head(model, 4, norm=0.3)
    c, mask = model.config, decode_masks()["verify M=3"]
    tokens = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(2))
    hidden = torch.randn(3, 12, c.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(8, 20).expand(3, 12)
    outputs = {}
    for path in ("reference", "fused"):
        cache = KVCache(1, 3, c.num_kv_heads, 28, c.head_dim, torch.float32, "cpu")
        cache.keys.normal_(generator=torch.Generator().manual_seed(5))
        with forced_path(path):
            outputs[path] = (head(model, tokens, hidden, positions),
                             head(model, tokens, hidden, positions,
                                  HeadAttention(cache, mask, 8)))
    for name, got, want in zip(("alone", "context"), outputs["fused"], outputs["reference"]):
        assert_close(got, want, f"head {name}")


# --- whole decodes --------------------------------------------------------------------------

CONFIGS = [DecodeConfig(max_new_tokens=13, stop_token_ids=()),
           DecodeConfig(mode="dynamic", threshold=0.3, max_new_tokens=13, stop_token_ids=()),
           DecodeConfig(mode="speculative", lookahead=2, threshold=0.3, adaptive=False,
                        max_new_tokens=13, stop_token_ids=())]


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(7000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


@dataclass
class Expected:
    """A prompt's reference decodes: generated ids per config, the smallest margin of all."""

    token_ids: list[list[int]]
    margin: float


def expected(model, head, prompt: list[int]) -> Expected:
    decodes = [reference_mrp_generate(model, head, prompt, config)
               if config.mode == "speculative" else reference_decode(model, prompt, config)
               for config in CONFIGS]
    return Expected([d.token_ids for d in decodes], min(d.margin for d in decodes))


def test_generate_on_the_fused_path_gives_the_reference_tokens(monkeypatch):
    paths = set()  # the paths attention ran on inside generate
    arrange_one = attention.arrange
    monkeypatch.setattr(attention, "arrange",
                        lambda q, k, v, mask, path: paths.add(path) or arrange_one(q, k, v,
                                                                                    mask, path))
    model = random_backbone(tiny_config(), seed=5)
    head = random_head(model, 5, norm=0.3)
    cases = [robust_case(prompt_of, n, i, lambda p: expected(model, head, p))
             for i, n in enumerate((3, 8, 5))]
    prompts = [prompt for prompt, _ in cases]
    for index, config in enumerate(CONFIGS):
        want = [decoded.token_ids[index] for _, decoded in cases]
        decoder = make_decoder(config, head if config.mode == "speculative" else None)
        paths.clear()
        with forced_path("fused"):
            got = generate(model, prompts, config, decoder).token_ids
        assert paths == {"fused"}
        assert got == want, f"{config.mode}: fused {got} != reference {want}"
