"""The MRP head inside an SGLang model: a view of the backbone's shared weights that our
`MRPHead` and `load_head` accept in place of our own `Backbone`, and the head loading with
its fingerprint check.

`MRPHead` reads `model.embed_tokens` from the backbone it is given; `load_head` and the
fingerprint read `config` (a BackboneConfig) and `lm_head.weight`. SGLang may pad the
vocabulary rows of its embedding and lm_head; the view slices them back to V rows, so the
fingerprint hashes exactly the checkpoint's lm_head.

Deliberately not here: SGLang's model class (see `models/sdar_mrp.py`) and any decoding.

Shapes: T tokens, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mrp_dlm.config import BackboneConfig
from mrp_dlm.model.files import read_json
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.hf_config import config_from_hf
from mrp_dlm.model.loading import load_head
from mrp_dlm.serving.config import BlockFacts


@dataclass(frozen=True)
class EmbeddingView:
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # token ids (...) -> (..., H)


@dataclass(frozen=True)
class LinearView:
    weight: torch.Tensor  # (V, H) the lm_head rows of the real vocabulary


@dataclass(frozen=True)
class HeadHost:
    """What the head needs of the backbone: config, embedding and lm_head (shared, frozen)."""

    config: BackboneConfig  # the backbone's shape, block size and mask id
    model: EmbeddingView  # `model.embed_tokens`, as `MRPHead.forward` reads it
    lm_head: LinearView  # weights of the backbone's lm_head (no bias)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Same-position logits (..., V) float32 of hidden states (..., H)."""
        return (hidden @ self.lm_head.weight.T).float()


def raw_config(hf_config: Any) -> dict:
    """The checkpoint's own config.json when it is on disk (SGLang may adjust the loaded
    config for its kernels, e.g. pad widths on CPU), else the loaded config's dict."""
    path = Path(str(getattr(hf_config, "_name_or_path", "") or "")) / "config.json"
    if path.is_file():
        return read_json(path)
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)


def host_of(hf_config: Any, embed_tokens: Callable, lm_head_weight: torch.Tensor,
            facts: BlockFacts) -> HeadHost:
    """A HeadHost for an SGLang model's Hugging Face config and weights."""
    raw = raw_config(hf_config)
    config = config_from_hf(raw, stop_ids=(), mask_token_id=facts.mask_token_id,
                            block_size=facts.block_size)
    V = config.vocab_size
    return HeadHost(config=config, model=EmbeddingView(embed_tokens),
                    lm_head=LinearView(lm_head_weight[:V]))


def load_host_head(directory: Path, host: HeadHost) -> MRPHead:
    """The head in `directory`, checked against the served model and block size."""
    return load_head(directory, host, host.config.block_size)
