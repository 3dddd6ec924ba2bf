"""The one door to checkpoints: a directory in our layout (HF-format SDAR/Qwen3, heads saved
by `mrp train head`) or in the published MRP release layout, read the same way.

    read_config(dir)          BackboneConfig (a release's backbone keys included)
    load_backbone(dir)        Backbone in eval mode (a release's head tensors passed over)
    load_head(dir, backbone)  MRPHead: a saved head, or a release's own head
    save_backbone(model, dir) our layout (config.json + safetensors)

Loading builds the model on the meta device, allocates it once in the target dtype, then
reads tensors in shard by shard, tensor by tensor, straight into the parameters, so peak
memory is the model plus one tensor's conversion buffer (an 8B checkpoint never needs two
copies).

Imports flow one way: this module -> release.py -> head_loading.py, hf_config.py ->
files.py (the low-level helpers). Deliberately not here: tokenizers (`tokenizer.py`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from mrp_dlm.config import DEFAULT_DEVICE, DEFAULT_DTYPE, DTYPE_NAMES, BackboneConfig
from mrp_dlm.files import write_atomic
from mrp_dlm.model import release
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.device import resolve_device
from mrp_dlm.model.files import (CheckpointError, copy_tensors, read_json, save_tensors,
                                 tensor_names, weight_files)
from mrp_dlm.model.head import HeadBackbone, MRPHead
from mrp_dlm.model.head_loading import load_saved_head
from mrp_dlm.model.hf_config import config_from_dir, config_to_hf
from mrp_dlm.model.moe import expert_views, published_tensors

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # name -> torch dtype


def embedded_model_dir() -> Path:
    """The small SDAR-style model shipped inside the package."""
    return Path(str(resources.files("mrp_dlm") / "assets" / "embedded"))


def embedded_head_dir() -> Path:
    """The MRP head trained on the embedded model, shipped beside it."""
    return Path(str(resources.files("mrp_dlm") / "assets" / "embedded-head"))


def read_config(directory: str | Path, mask_token_id: int | None = None,
                block_size: int | None = None) -> BackboneConfig:
    """The backbone's config of a checkpoint in either layout; flags override the file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"model directory not found: {directory}")
    raw = release.backbone_config(read_json(directory / "config.json"), directory)
    return config_from_dir(directory, raw, mask_token_id, block_size)


def load_backbone(directory: str | Path, dtype: torch.dtype = DTYPES[DEFAULT_DTYPE],
                  device: torch.device | str = DEFAULT_DEVICE, mask_token_id: int | None = None,
                  block_size: int | None = None) -> Backbone:
    """Read a local HF-format SDAR/Qwen3 checkpoint (or a release's backbone) into a
    Backbone in eval mode."""
    directory, device = Path(directory), resolve_device(device)
    config = read_config(directory, mask_token_id, block_size)
    files = weight_files(directory)
    with torch.device("meta"):
        model = Backbone(config).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = {name: p.data for name, p in model.named_parameters()}  # tied weights appear once
    if config.num_experts:  # experts stored one by one (as published) or fused
        params = expert_views(params, tensor_names(files))
    copy_tensors(files, params, directory, skip=release.head_prefixes(directory))
    return model.eval()


def load_head(directory: str | Path, backbone: HeadBackbone, block_size: int | None = None,
              block_only: bool = False) -> MRPHead:
    """Load a head for `backbone` (same dtype and device), checking its fingerprint: a head
    saved by `mrp train head`, or a release's own head. `block_only`: also a head saved
    before heads attended to the context (to fine-tune it)."""
    directory = Path(directory)
    if release.is_release_dir(directory):
        return release.load_release_head(directory, backbone, block_size)
    return load_saved_head(directory, backbone, block_size, block_only)


def save_backbone(model: Backbone, directory: str | Path,
                  max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is set);
    an MoE model's experts one by one, as SDAR-30B-A3B is published."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    save_tensors(published_tensors(tensors), directory, max_shard_bytes)
    hf_config = config_to_hf(model.config, next(iter(tensors.values())).dtype)
    write_atomic(directory / "config.json",
                 lambda tmp: tmp.write_text(json.dumps(hf_config, indent=2)))
