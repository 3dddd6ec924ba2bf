"""The backbone forward: against transformers' Qwen3, a dense reference, and itself cached.

- Block size 1 is ordinary causal attention, so our logits must equal
  `transformers.Qwen3ForCausalLM` loaded from the same checkpoint (tied and untied lm_head).
- For larger blocks a dense float64 re-implementation written here (explicit mask, explicit
  RoPE, explicit GQA head mapping) is the reference.
- The cached protocol (prefill, denoise, store, verify with M copies, left padding) must
  equal a full recompute of the sequence.
Comparisons report max and mean absolute differences against a stated tolerance.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.loading import load_backbone, save_backbone
from mrp_dlm.model.masks import block_causal_mask, copies_mask

TOL = 1e-4  # float32 logits, max abs difference


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL, what: str = "logits"):
    diff = (got.double() - want.double()).abs()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert diff.max() <= tol, (f"{what}: max abs diff {diff.max():.3g} > {tol:g} "
                               f"(mean {diff.mean():.3g}, scale {want.abs().max():.3g})")


def explicit_mask(T: int, block_size: int) -> torch.Tensor:
    """(T, T) bool, written out: query q sees key k iff k // L <= q // L."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(T):
            mask[q, k] = k // block_size <= q // block_size
    return mask


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, T, n, hd): rotate pairs (i, i + hd/2) by angle pos * theta^(-2i/hd)."""
    hd = x.shape[-1]
    i = torch.arange(hd // 2, dtype=torch.float64)
    angle = positions.double()[..., None, None] * theta ** (-2 * i / hd)  # (B, T, 1, hd/2)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), -1)


@torch.no_grad()
def dense_reference(model, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    """Logits (B, T, V) in float64 from the parameters, with an explicit (B, T, T) mask."""
    c = model.config
    W = {name: p.double() for name, p in model.state_dict().items()}
    x = W["model.embed_tokens.weight"][ids]  # (B, T, H)
    B, T, _ = x.shape
    group = c.num_heads // c.num_kv_heads
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        h = rms(x, W[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(B, T, c.num_heads, c.head_dim)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).view(B, T, c.num_kv_heads, c.head_dim)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, T, c.num_kv_heads, c.head_dim)
        q = rope(rms(q, W[p + "self_attn.q_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
        k = rope(rms(k, W[p + "self_attn.k_norm.weight"], c.rms_norm_eps), positions, c.rope_theta)
        heads = []
        for head in range(c.num_heads):  # query head h reads kv head h // group
            scores = q[:, :, head] @ k[:, :, head // group].transpose(1, 2) / math.sqrt(c.head_dim)
            scores = scores.masked_fill(~mask, float("-inf"))  # (B, T, T)
            heads.append(torch.softmax(scores, -1) @ v[:, :, head // group])  # (B, T, hd)
        x = x + torch.cat(heads, -1) @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ W[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * (h @ W[p + "mlp.up_proj.weight"].T)) \
            @ W[p + "mlp.down_proj.weight"].T
    head_weight = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return rms(x, W["model.norm.weight"], c.rms_norm_eps) @ head_weight.T


def random_ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def full_logits(model, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Uncached logits (B, T, V) of whole sequences starting at position 0."""
    B, T = ids.shape
    positions = torch.arange(T).expand(B, T)
    mask = explicit_mask(T, block_size).expand(B, T, T)
    return model.logits(model(ids, positions, mask))


# --- against transformers -------------------------------------------------------------------

@pytest.mark.exact_arithmetic
@pytest.mark.parametrize("tied", [False, True])
def test_block_size_one_equals_transformers_qwen3(make_model, tmp_path, tied):
    transformers = pytest.importorskip("transformers", minversion="4.51")  # Qwen3 arrived in 4.51

    model = make_model(block_size=1, tie_word_embeddings=tied)
    save_backbone(model, tmp_path / "ours")
    qwen = tmp_path / "qwen3"
    shutil.copytree(tmp_path / "ours", qwen)
    config = json.loads((qwen / "config.json").read_text())
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (qwen / "config.json").write_text(json.dumps(config))
    # float32 weights load as float32 in every version (4.x: `torch_dtype`, 5.x: `dtype`)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(qwen, attn_implementation="eager").eval()
    assert next(hf.parameters()).dtype == torch.float32
    assert hf.config.tie_word_embeddings == tied

    B, T = 13, 7
    ids = random_ids(B, T)
    positions = torch.arange(T).expand(B, T)
    mask = block_causal_mask(torch.arange(T), torch.ones(B, T, dtype=torch.bool))  # L = 1
    assert torch.equal(mask, torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T))
    with torch.no_grad():
        ours = model.logits(model(ids, positions, mask))
        theirs = hf(input_ids=ids).logits.float()
        reloaded = load_backbone(tmp_path / "ours")
        ours_reloaded = reloaded.logits(reloaded(ids, positions, mask))
    assert_close(ours, theirs, what=f"ours vs Qwen3ForCausalLM (tied={tied})")
    assert torch.equal(ours, ours_reloaded)


# --- against a dense reference --------------------------------------------------------------

@pytest.mark.parametrize("block_size,T", [(1, 9), (4, 19), (16, 37)])
@pytest.mark.parametrize("tied", [False, True])
def test_block_causal_forward_equals_dense_reference(make_model, block_size, T, tied):
    model = make_model(block_size=block_size, tie_word_embeddings=tied, seed=block_size)
    B = 3
    ids = random_ids(B, T, seed=T)
    positions = torch.arange(T).expand(B, T)
    mask = explicit_mask(T, block_size).expand(B, T, T)
    library_mask = block_causal_mask(torch.arange(T) // block_size,
                                     torch.ones(B, T, dtype=torch.bool))
    assert torch.equal(library_mask, mask)
    with torch.no_grad():
        ours = model.logits(model(ids, positions, mask))
    assert ours.dtype == torch.float32 and ours.shape == (B, T, 99)
    assert_close(ours, dense_reference(model, ids, positions, mask),
                 what=f"ours vs dense reference (L={block_size}, tied={tied})")


def test_positions_come_from_the_caller(make_model):
    # RoPE is relative, so a uniform shift changes nothing; a gap between blocks does.
    model = make_model()
    ids = random_ids(1, 8)
    mask = explicit_mask(8, 4)[None]
    gapped = torch.tensor([[0, 1, 2, 3, 9, 10, 11, 12]])
    with torch.no_grad():
        plain = model.logits(model(ids, torch.arange(8)[None], mask))
        shifted = model.logits(model(ids, torch.arange(8)[None] + 5, mask))
        gap = model.logits(model(ids, gapped, mask))
    assert_close(shifted, plain, what="uniformly shifted positions")
    assert (gap - plain)[:, 4:].abs().max() > 1e-2
    assert_close(gap, dense_reference(model, ids, gapped, mask), what="gapped positions")


def test_tied_lm_head_shares_the_embedding(make_model):
    tied, untied = make_model(tie_word_embeddings=True), make_model(tie_word_embeddings=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" in dict(untied.named_parameters())


# --- cached == uncached ---------------------------------------------------------------------

@torch.no_grad()
def test_cached_protocol_equals_full_recompute(make_model):
    """Prefill, denoise, store and an M-copy verify, with a left-padded second row."""
    L, M, mask_token_id = 4, 3, 98
    model = make_model()
    c = model.config
    # Row 0: 8-token prompt (2 full blocks). Row 1: 4-token prompt, left-padded by one block.
    prompts = [random_ids(1, 8, seed=1)[0], random_ids(1, 4, seed=2)[0]]
    pads = [0, 4]
    P = 8  # prefill slots
    cache = KVCache(c.num_layers, 2, c.num_kv_heads, P + 2 * L + M * L, c.head_dim,
                    torch.float32, "cpu")
    tokens = torch.full((2, P), 0)
    tokens[0], tokens[1, 4:] = prompts[0], prompts[1]
    slots = torch.arange(P + 2 * L + M * L)
    positions = (slots[None] - torch.tensor(pads)[:, None]).clamp_min(0)  # (2, S)
    key_valid = slots[None] >= torch.tensor(pads)[:, None]  # (2, S)

    model(tokens, positions[:, :P], block_causal_mask(torch.arange(P) // L, key_valid[:, :P]),
          cache, 0)

    def denoise(block: torch.Tensor, start: int) -> torch.Tensor:
        copies = block.shape[1] // L
        mask = copies_mask(key_valid, start, L, copies)
        pos = positions[:, start:start + L].repeat(1, copies)
        return model.logits(model(block, pos, mask, cache, start))

    def expect(row: int, history: list[torch.Tensor], block: torch.Tensor) -> torch.Tensor:
        sequence = torch.cat([prompts[row], *history, block])[None]
        return full_logits(model, sequence, L)[0, -L:]

    # Denoise the first decode block (slots 8..11): partly masked, prefix untouched.
    prefix_before = cache.keys[:, :, :, :P].clone()
    noisy = torch.tensor([[5, mask_token_id, 7, mask_token_id],
                          [mask_token_id, 11, mask_token_id, mask_token_id]])
    got = denoise(noisy, P)
    for row in range(2):
        assert_close(got[row], expect(row, [], noisy[row]), what=f"denoise row {row}")
    assert torch.equal(cache.keys[:, :, :, :P], prefix_before)

    # Store the finished block, then denoise the next one (slots 12..15).
    final = torch.tensor([[5, 6, 7, 8], [9, 11, 13, 15]])
    got_final = denoise(final, P)
    nxt = torch.tensor([[mask_token_id] * 4, [21, mask_token_id, mask_token_id, 22]])
    got = denoise(nxt, P + L)
    for row in range(2):
        assert_close(got_final[row], expect(row, [], final[row]), what=f"store row {row}")
        assert_close(got[row], expect(row, [final[row]], nxt[row]), what=f"next block row {row}")

    # Verify M candidate states of that block in one forward: each copy sees the prefix
    # and itself only, at the block's own positions.
    stored = cache.keys[:, :, :, :P + L].clone()
    candidates = [torch.tensor([[1, mask_token_id, 3, mask_token_id], [mask_token_id] * 4]),
                  torch.tensor([[1, 2, 3, mask_token_id], [4, mask_token_id, 6, mask_token_id]]),
                  torch.tensor([[1, 2, 3, 4], [4, 5, 6, 7]])]
    got = denoise(torch.cat(candidates, dim=1), P + L).view(2, M, L, -1)
    for row in range(2):
        for m, candidate in enumerate(candidates):
            assert_close(got[row, m], expect(row, [final[row]], candidate[row]),
                         what=f"verify copy {m} row {row}")
    assert torch.equal(cache.keys[:, :, :, :P + L], stored), "verify touched stored slots"


def test_copies_mask_layout():
    key_valid = torch.tensor([[False, True, True, True, True, True, True]])
    mask = copies_mask(key_valid, start=3, block_size=2, copies=2)  # (1, 4, 7)
    expected = torch.tensor([[0, 1, 1, 1, 1, 0, 0],
                             [0, 1, 1, 1, 1, 0, 0],
                             [0, 1, 1, 0, 0, 1, 1],
                             [0, 1, 1, 0, 0, 1, 1]], dtype=torch.bool)[None]
    assert torch.equal(mask, expected)


# --- half precision -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_runs(make_model, dtype):
    model = make_model()
    B, T = 2, 12
    ids = random_ids(B, T)
    positions = torch.arange(T).expand(B, T)
    mask = explicit_mask(T, 4).expand(B, T, T)
    with torch.no_grad():
        want = model.logits(model(ids, positions, mask))
        model = model.to(dtype)
        hidden = model(ids, positions, mask)
        got = model.logits(hidden)
        cache = KVCache(2, B, 2, T, 8, dtype, "cpu")
        model(ids[:, :8], positions[:, :8], mask[:, :8, :8], cache, 0)
        tail = model.logits(model(ids[:, 8:], positions[:, 8:], mask[:, 8:], cache, 8))
    assert hidden.dtype == dtype and got.dtype == torch.float32
    assert torch.isfinite(got).all() and torch.isfinite(tail).all()
    # Half precision keeps ~3 significant digits; logits are O(10) here.
    assert_close(got, want, tol=0.05 * want.abs().max().item(), what=f"{dtype} vs float32")
    assert_close(tail, got[:, 8:], tol=0.05 * want.abs().max().item(), what=f"{dtype} cached")
