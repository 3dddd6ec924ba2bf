"""The SDAR backbone: Qwen3 decoder layers with block-causal attention and no logit shift;
SDAR-MoE's layers take the sparse MLP of `moe.py` where the config says so.

Module and parameter names equal the Hugging Face Qwen3/SDAR names, so a checkpoint's
state dict loads without renaming. The forward returns the final hidden state (after the
final norm); `lm_head` turns it into same-position logits: the logits at position i
predict token i.

Deliberately not here: which positions may attend to which (callers pass a boolean mask,
see `model/masks.py`), the decoding loop, and checkpoint I/O.

Shapes: B batch, T query tokens, S key slots, H hidden, V vocab, nh/nkv heads, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mrp_dlm.config import BackboneConfig
from mrp_dlm.model.attention import attend
from mrp_dlm.model.cache import KVCache, LayerCache
from mrp_dlm.model.moe import SparseMLP

# DecoderLayer, RMSNorm and rotary_tables are the head's building blocks too (`model/head.py`
# imports them), not API.
__all__ = ["Backbone"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference does; bf16 variance loses too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, 1, T, hd) for absolute integer positions (B, T)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponent / head_dim))  # (hd/2,)
    freqs = positions.float()[..., None] * inv_freq  # (B, T, hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, n, T, hd)
    return x * cos + rotated * sin


class _Attention(nn.Module):
    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None, cache: LayerCache | None,
                start: int | torch.Tensor, query: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (B, T, H) of x (B, T, H); with `query` (B,) int64, that of the
        one token query[b] per row (B, 1, H), every token still giving keys and values."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        k = _apply_rotary(k, *rope)  # (B, nkv, T, hd)
        if query is not None:  # one query token per row: (B, 1, ...) from here on
            x, rope = pick(x, query, 1), tuple(pick(table, query, 2) for table in rope)
            mask = None if mask is None else pick(mask, query, 1)
        Q = x.shape[1]
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd)).transpose(1, 2)
        q = _apply_rotary(q, *rope)  # (B, nh, Q, hd)
        if cache is not None:
            k, v = cache.write_and_read(k, v, start, mask.shape[-1])  # (B, nkv, S, hd)
        y = attend(q, k, v, mask)  # (B, nh, Q, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


def pick(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x with one entry index[b] (B,) int64 along `dim` per row b, kept as a size-1 dim."""
    shape = [1] * x.dim()
    shape[0] = index.shape[0]
    at = index.view(shape).expand(*x.shape[:dim], 1, *x.shape[dim + 1:])
    return x.gather(dim, at)


class _MLP(nn.Module):
    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm Qwen3 layer, with the dense MLP or (`sparse`, Qwen3-MoE) the sparse
    one. The MRP head reuses this class, dense, for its own layers."""

    def __init__(self, config: BackboneConfig, sparse: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMLP(config) if sparse else _MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None, cache: LayerCache | None = None,
                start: int | torch.Tensor = 0, query: torch.Tensor | None = None
                ) -> torch.Tensor:
        """(B, T, H); with `query` (B,) int64 the output (B, 1, H) of token query[b] alone
        (every token still attended to): the MRP head's last layer where one position is read."""
        attended = self.self_attn(self.input_layernorm(x), rope, mask, cache, start, query)
        x = (x if query is None else pick(x, query, 1)) + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class _DecoderStack(nn.Module):
    """`model.*` in the checkpoint: embedding, layers and the final norm."""

    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, config.is_sparse(i))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    """SDARForCausalLM / Qwen3ForCausalLM (SDARMoeForCausalLM / Qwen3MoeForCausalLM when the
    config has experts) with same-position logits."""

    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Final hidden states (B, T, H) in the model dtype.

        input_ids, positions: (B, T) int64; positions are absolute.
        mask: (B, T, S) bool, True where query t may attend to key s. Without a cache
        S == T; with one, the T new keys are written at slots [start, start + T) and the
        queries attend to slots [0, S): S == start + T, or every slot of the cache (a
        static shape, with the unwritten slots masked). `start` may be a 0-dim tensor.
        """
        x = self.model.embed_tokens(input_ids)  # (B, T, H)
        rope = rotary_tables(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, rope, mask, cache.layer(index) if cache is not None else None, start)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Same-position logits (B, T, V) in float32."""
        return self.lm_head(hidden).float()
