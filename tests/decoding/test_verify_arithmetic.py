"""What the lossless claim rests on: a verify forward's logits for copy j against a denoise
forward on the same block state.

Speculative decoding commits the static rule's pick on verify logits (M block copies in
one forward of M*L tokens), static decoding picks on denoise logits (one copy). The two are
the same function of the same state, but not the same float arithmetic: the matrix kernels
see other row counts and each copy's keys sit at other slots. Measured here (fp32, CPU):
bit-identical on the embedded model's shapes, up to ~1.5e-5 apart on the tiny model's
(hidden 32, block 4). So the exact claim is "identical to static except where one of the
static rule's choices is within float noise of flipping"; `benchmarks/divergence.py`
measures how often that happens, and these tests bound the noise.

Shapes: B batch, L block size, M copies, P prefix slots, V vocab.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_backbone, tiny_config
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.masks import block_causal_mask, copies_mask
from mrp_dlm.pipeline import Pipeline


def verify_and_denoise(model: Backbone, batch: int, copies: int, prefix_blocks: int,
                       seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, M, L, V) of M random block states from one verify forward and from M
    denoise forwards, over the same cached prefix (row 0 left-padded by a block)."""
    cfg = model.config
    L, P = cfg.block_size, prefix_blocks * cfg.block_size
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.mask_token_id, (batch, P + L), generator=generator)  # (B, P+L)
    positions = torch.arange(P + L)[None].expand(batch, -1)  # (B, P+L)
    key_valid = torch.ones(batch, P + copies * L, dtype=torch.bool)  # (B, S)
    if batch > 1 and P:
        key_valid[0, :L] = False
    cache = KVCache(cfg.num_layers, batch, cfg.num_kv_heads, P + copies * L, cfg.head_dim,
                    torch.float32, "cpu")
    if P:
        model(tokens[:, :P], positions[:, :P],
              block_causal_mask(torch.arange(P) // L, key_valid[:, :P]), cache, 0)
    masked = torch.rand(batch, copies, L, generator=generator) < 0.5  # (B, M, L)
    states = torch.where(masked, cfg.mask_token_id, tokens[:, None, P:])  # (B, M, L)
    block_positions = positions[:, P:]  # (B, L)
    denoise = torch.stack([model.logits(model(states[:, j], block_positions,
                                              copies_mask(key_valid, P, L, 1), cache, P))
                           for j in range(copies)], dim=1)  # (B, M, L, V)
    hidden = model(states.view(batch, copies * L), block_positions.repeat(1, copies),
                   copies_mask(key_valid, P, L, copies), cache, P)  # (B, M*L, H)
    return model.logits(hidden).view(batch, copies, L, -1), denoise


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("copies", [2, 3, 4, 5])  # K = 1..4
@torch.no_grad()
def test_verify_logits_match_denoise_within_float_noise(batch, copies):
    model = random_backbone(tiny_config(), seed=0)
    for prefix_blocks in (0, 2, 7):
        verify, denoise = verify_and_denoise(model, batch, copies, prefix_blocks)
        scale = denoise.abs().max()
        diff = (verify - denoise).abs()
        assert diff.max() <= 1e-5 * scale, (
            f"prefix {prefix_blocks}: max diff {diff.max():.3g}, mean {diff.mean():.3g}, "
            f"logit scale {scale:.3g}")


@pytest.mark.parametrize("batch", [1, 8])
@torch.no_grad()
def test_verify_logits_on_the_embedded_model(batch):
    # Bit-identical on the machine we ran (fp32, CPU); asserted is only the noise bound, since
    # another machine's kernels may round differently.
    model = Pipeline.load().model
    for copies in (2, 4):
        verify, denoise = verify_and_denoise(model, batch, copies, prefix_blocks=3)
        diff = (verify - denoise).abs().max()
        assert diff <= 1e-5 * denoise.abs().max(), f"M={copies}: max diff {diff:.3g}"
