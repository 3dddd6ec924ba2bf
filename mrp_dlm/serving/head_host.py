"""The MRP head inside an SGLang model: a view of the backbone's shared weights that our
`MRPHead` and `load_head` accept in place of our own `Backbone`, and the head loading with
its fingerprint check.

`MRPHead` reads `model.embed_tokens` from the backbone it is given; `load_head` and the
fingerprint read `config` (a BackboneConfig) and `lm_head.weight`. SGLang may pad the
vocabulary rows of its embedding and lm_head; the view slices them back to V rows, so the
fingerprint hashes exactly the checkpoint's lm_head. Under tensor parallelism each rank
holds a vocabulary shard of the lm_head: the host then gathers the logits of every shard
(`gather`, SGLang's all-gather), and the head is loaded against the gathered lm_head.

Deliberately not here: SGLang's model class (`sglang_forward.MrpModel`) and any decoding.

Shapes: T tokens, H hidden, V vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from mrp_dlm.config import BackboneConfig
from mrp_dlm.model.files import read_json
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.hf_config import config_from_hf
from mrp_dlm.model.loading import load_head
from mrp_dlm.serving.config import BlockFacts, load_serving_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddingView:
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # token ids (...) -> (..., H)


@dataclass(frozen=True)
class LinearView:
    weight: torch.Tensor  # (V, H) the lm_head rows of the real vocabulary; a rank's shard under TP


@dataclass(frozen=True)
class HeadHost:
    """What the head needs of the backbone: config, embedding and lm_head (shared, frozen)."""

    config: BackboneConfig  # the backbone's shape, block size and mask id
    model: EmbeddingView  # `model.embed_tokens`, as `MRPHead.forward` reads it
    lm_head: LinearView  # weights of the backbone's lm_head (no bias)
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # TP: concatenates every
    # rank's (..., V_shard) along the last dim; None: the lm_head is whole

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Same-position logits (..., V) float32 of hidden states (..., H)."""
        local = hidden @ self.lm_head.weight.T  # (..., V) or this rank's (..., V_shard)
        if self.gather is None:
            return local.float()
        return self.gather(local)[..., :self.config.vocab_size].float()  # (..., V)


def raw_config(hf_config: Any) -> dict:
    """The checkpoint's own config.json when it is on disk (SGLang may adjust the loaded
    config for its kernels, e.g. pad widths on CPU), else the loaded config's dict."""
    path = Path(str(getattr(hf_config, "_name_or_path", "") or "")) / "config.json"
    if path.is_file():
        return read_json(path)
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)


def host_of(hf_config: Any, embed_tokens: Callable, lm_head_weight: torch.Tensor,
            facts: BlockFacts, gather: Optional[Callable] = None) -> HeadHost:
    """A HeadHost for an SGLang model's Hugging Face config and weights; with `gather`
    (tensor parallelism), lm_head_weight is this rank's vocabulary shard."""
    raw = raw_config(hf_config)
    config = config_from_hf(raw, stop_ids=(), mask_token_id=facts.mask_token_id,
                            block_size=facts.block_size)
    weight = lm_head_weight if gather is not None else lm_head_weight[:config.vocab_size]
    return HeadHost(config=config, model=EmbeddingView(embed_tokens),
                    lm_head=LinearView(weight), gather=gather)


def load_host_head(directory: Path, host: HeadHost) -> MRPHead:
    """The head in `directory`, checked against the served model and block size (under TP
    against the whole lm_head, gathered once)."""
    if host.gather is not None:
        shard = host.lm_head.weight.T.contiguous()  # (H, V_shard)
        whole = host.gather(shard).T[:host.config.vocab_size]  # (V, H)
        host = replace(host, lm_head=LinearView(whole), gather=None)
    return load_head(directory, host, host.config.block_size)


def attach_head(config_path: str | None, hf_config: Any, embed_tokens: Callable,
                lm_head_weight: torch.Tensor, facts: BlockFacts,
                gather: Optional[Callable] = None) -> tuple[HeadHost, MRPHead | None]:
    """(host, head) of a served model: the head named by the YAML, checked against the
    model (whole: the caller keeps its rank's share); None when it names none
    (MrpSpeculative self-drafts, only the host is needed). `gather`: as `host_of`'s."""
    serving = load_serving_config(config_path)
    host = host_of(hf_config, embed_tokens, lm_head_weight, facts, gather)
    if serving.head_directory() is None:
        log.info("no MRP head: MrpSpeculative self-drafts (the rule on the seed logits)")
        return host, None
    head = load_host_head(serving.head_directory(), host)
    log.info("MRP head loaded from %s (%d layers, block size %d)", serving.head,
             head.config.num_layers, facts.block_size)
    return host, head
