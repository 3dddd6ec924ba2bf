"""The MRP residual head: predicts how the backbone's logits change after new commits.

    e   = RMSNorm(embed(block tokens after the latest commit))    the fresh reveals enter here
    h   = RMSNorm(h_in)                  h_in: backbone hidden or accumulator
    z   = Linear(2H -> H, no bias)(concat(e, h))
    z   = N decoder layers of the backbone's class over the block and earlier blocks' keys
    h_C = RMSNorm(z)                     residual_hidden
    C   = lm_head(h_C), and since lm_head has no bias, A + C = lm_head(h_A + h_C)

The head's keys of an earlier block are the head run on its clean tokens with h_in = the
backbone's final hidden states there (docs/design.md, "The head's context"). The embedding
and lm_head are the backbone's own, frozen and shared: the head receives the backbone at
call time and never holds (or saves) a copy. The final norm's weight starts at zero, so an
untrained head predicts no change (A + C == A).

Deliberately not here: which slots hold which block and who may see them (the caller
passes the mask and the cache, as to the backbone), training (see `training/`), decoding
modes, checkpoint files (see `head_loading.py`).

Shapes: B batch (or blocks), T tokens of the call, S key slots, L block, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from mrp_dlm.config import BackboneConfig, HeadConfig
from mrp_dlm.model.backbone import DecoderLayer, RMSNorm, rotary_tables

# The head, what it attends to, and the protocols a caller's backbone and key store meet.
__all__ = ["HeadAttention", "HeadBackbone", "HeadKeys", "KeyRecorder", "LayerKeys", "MRPHead",
           "PrefixKeys", "TokenEmbedding"]


class TokenEmbedding(Protocol):
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # token ids (...) -> (..., H)


class HeadBackbone(Protocol):
    """What the head reads of a backbone: our `Backbone`, or the serving plugin's `HeadHost`
    over an SGLang model's shared weights."""

    config: BackboneConfig  # shape, block size and mask id

    @property
    def model(self) -> TokenEmbedding: ...  # `model.embed_tokens`, the shared embedding

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Same-position logits (..., V) float32 of hidden states (..., H): the shared lm_head."""


class LayerKeys(Protocol):
    def write_and_read(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Take this call's keys/values (B, nkv, T, hd); return the keys/values to attend
        over (B, nkv, S, hd), S the mask's key count (see `cache.LayerCache`)."""


class HeadKeys(Protocol):
    def layer(self, index: int) -> LayerKeys: ...  # the head layer's keys and values


@dataclass(frozen=True)
class HeadAttention:
    """What a head call attends to beyond its own tokens: the head's keys and values of
    earlier blocks (a `KVCache` of the head's layers, a `KeyRecorder` or `PrefixKeys`), where
    this call's keys go, and the mask over all of them."""

    keys: HeadKeys  # per head layer
    mask: torch.Tensor  # (B, T, S) bool, True where query t may attend to key slot s
    start: int | torch.Tensor = 0  # slot of the call's first token (0-dim tensor allowed)


@dataclass
class _RecordedLayer:
    """One head layer's keys and values of a pass, kept as plain tensors (no cache writes)."""

    keys: torch.Tensor | None = None  # (B, nkv, P, hd)
    values: torch.Tensor | None = None  # (B, nkv, P, hd)

    def write_and_read(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A recomputation (activation checkpointing) records the same values again.
        self.keys, self.values = k, v
        return k, v


@dataclass(frozen=True)
class _PrefixLayer:
    """One head layer's recorded prefix keys: a call attends to them and its own keys (laid
    out [prefix ; call]) and writes nothing, so autograd sees every use."""

    keys: torch.Tensor  # (B, nkv, P, hd)
    values: torch.Tensor  # (B, nkv, P, hd)

    def write_and_read(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = torch.cat((self.keys, k), dim=2), torch.cat((self.values, v), dim=2)
        return keys, values  # (B, nkv, P + T, hd) each


class KeyRecorder:
    """Records every head layer's keys of one pass (training's pass over the clean row x_0,
    or a test's whole sequence); `prefix()` then gives them to later passes to attend to."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [_RecordedLayer() for _ in range(num_layers)]

    def layer(self, index: int) -> _RecordedLayer:
        return self.layers[index]

    def prefix(self) -> "PrefixKeys":
        return PrefixKeys([_PrefixLayer(layer.keys, layer.values) for layer in self.layers])


@dataclass(frozen=True)
class PrefixKeys:
    """Recorded prefix keys per head layer, read-only (see `KeyRecorder`)."""

    layers: list[_PrefixLayer]

    def layer(self, index: int) -> _PrefixLayer:
        return self.layers[index]


class MRPHead(nn.Module):
    def __init__(self, backbone: BackboneConfig, config: HeadConfig = HeadConfig()) -> None:
        super().__init__()
        self.backbone_config = backbone
        self.config = config
        H = backbone.hidden_size
        self.embed_norm = RMSNorm(H, backbone.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, backbone.rms_norm_eps)
        self.fuse = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(backbone) for _ in range(config.num_layers))
        self.norm = RMSNorm(H, backbone.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.dim() == 2:
                    nn.init.normal_(param, std=self.config.init_std)
                else:
                    param.fill_(1.0)
            self.norm.weight.zero_()

    def layer_input(self, backbone: HeadBackbone, tokens: torch.Tensor, hidden_in: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The first layer's input x (B, T, H) and the RoPE tables of positions (B, T)."""
        embeds = backbone.model.embed_tokens(tokens)  # (B, T, H)
        fused = torch.cat((self.embed_norm(embeds), self.hidden_norm(hidden_in)),
                          dim=-1)  # (B, T, 2H)
        x = self.fuse(fused)  # (B, T, H)
        return x, rotary_tables(positions, self.backbone_config.head_dim,
                                self.backbone_config.rope_theta, x.dtype)

    def forward(self, backbone: HeadBackbone, tokens: torch.Tensor, hidden_in: torch.Tensor,
                positions: torch.Tensor, attention: HeadAttention | None = None,
                query: torch.Tensor | None = None) -> torch.Tensor:
        """residual_hidden h_C (B, T, H) for tokens (B, T) and h_in (B, T, H).

        positions: (B, T) absolute positions (RoPE). `attention`: the head's keys of earlier
        blocks, where this call's keys go and the mask; None: the T tokens see each other
        only, bidirectionally (one block with nothing before it, or a test of the layers).
        `query` (B,) int64: h_C (B, 1, H) of token query[b] alone; the last layer then runs
        its queries and MLP on that token only (every token still gives keys): what a check
        of one position costs (remask's chain rule).
        """
        x, rope = self.layer_input(backbone, tokens, hidden_in, positions)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            only = query if index == last else None
            if attention is None:  # no mask: every token sees every other
                x = layer(x, rope, None, query=only)
            else:
                x = layer(x, rope, attention.mask, attention.keys.layer(index), attention.start,
                          only)
        return self.norm(x)
