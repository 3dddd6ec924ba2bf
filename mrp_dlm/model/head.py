"""The MRP residual head: predicts how the backbone's logits change after new commits.

    e   = RMSNorm(embed(block tokens after the latest commit))   the fresh reveals enter here
    h   = RMSNorm(h_in)                                          h_in: backbone hidden or accumulator
    z   = Linear(2H -> H, no bias)(concat(e, h))
    z   = N decoder layers of the backbone's own class, bidirectional within the block
    h_C = RMSNorm(z)                                             residual_hidden
    C   = lm_head(h_C), and since lm_head has no bias, A + C = lm_head(h_A + h_C)

The embedding and lm_head are the backbone's own, frozen and shared: the head receives
the backbone at call time and never holds (or saves) a copy. Attention covers the current
block only; context reaches the head through h_A. The final norm's weight starts at zero,
so an untrained head predicts no change (A + C == A).

Deliberately not here: training (see `training/`), decoding modes, checkpoint files
(see `head_loading.py`).

Shapes: B batch (or blocks), L block size, H hidden, V vocab.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from mrp_dlm.config import BackboneConfig, HeadConfig
from mrp_dlm.model.backbone import DecoderLayer, RMSNorm, rotary_tables


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

    def forward(self, backbone: HeadBackbone, tokens: torch.Tensor, hidden_in: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """residual_hidden h_C (B, L, H) for block tokens (B, L) and h_in (B, L, H).

        positions: (B, L) absolute positions of the block (RoPE inside the block).
        """
        embeds = backbone.model.embed_tokens(tokens)  # (B, L, H)
        fused = torch.cat((self.embed_norm(embeds), self.hidden_norm(hidden_in)), dim=-1)  # (B, L, 2H)
        x = self.fuse(fused)  # (B, L, H)
        rope = rotary_tables(positions, self.backbone_config.head_dim,
                             self.backbone_config.rope_theta, x.dtype)
        mask = torch.ones(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool,
                          device=x.device)  # (B, L, L) bidirectional within the block
        for layer in self.layers:
            x = layer(x, rope, mask)
        return self.norm(x)

    def advance(self, backbone: HeadBackbone, tokens: torch.Tensor, accumulator: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """One chained MRP step: accumulator h_A + sum h_C (B, L, H) -> the next one.

        The corrected logits A + sum C are `backbone.logits(returned accumulator)`.
        """
        return accumulator + self(backbone, tokens, accumulator, positions)
