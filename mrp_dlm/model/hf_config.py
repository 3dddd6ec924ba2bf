"""config.json <-> BackboneConfig: the Hugging Face keys of SDAR and Qwen3 checkpoints.

A loader takes block_size and mask_token_id from the flags, else the file, else the SDAR
family defaults (the published config.json files lack both); the stop ids from
generation_config.json, else config.json, else the SDAR defaults.

Deliberately not here: reading weights (`files.py`, `loading.py`) and the published MRP
layout's own keys (`release.py`, which hands this module a backbone's view of them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mrp_dlm.config import (SDAR_BLOCK_SIZE, SDAR_MASK_TOKEN_ID, SDAR_STOP_TOKEN_IDS,
                            BackboneConfig, check_block_divides)
from mrp_dlm.model.files import CheckpointError, read_json

SUPPORTED_MODEL_TYPES = ("sdar", "qwen3")


def read_stop_ids(directory: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, else the SDAR defaults."""
    generation = directory / "generation_config.json"
    eos = read_json(generation).get("eos_token_id") if generation.is_file() else None
    eos = raw.get("eos_token_id") if eos is None else eos
    if eos is None:
        return SDAR_STOP_TOKEN_IDS
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{directory}: eos_token_id must be a token id or a list of ids, "
                              f"got {eos!r}")
    return tuple(ids)


def check_supported(raw: dict, path: Path) -> None:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path}: unknown model_type {model_type!r}; mrp-dlm reads "
                              f"{' and '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
    unsupported = {"hidden_act": raw.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(raw.get("attention_bias", False)),
                   "rope_scaling": raw.get("rope_scaling") not in (None, {}),
                   "use_sliding_window": bool(raw.get("use_sliding_window", False))}
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise CheckpointError(f"{path}: unsupported setting(s) {', '.join(bad)}")


def config_from_hf(raw: dict, stop_ids: tuple[int, ...], mask_token_id: int | None = None,
                   block_size: int | None = None, path: Path = Path("config.json")) -> BackboneConfig:
    """BackboneConfig from a config.json dict; flags override the file, the file the defaults."""
    check_supported(raw, path)
    if block_size is not None and raw.get("block_size"):  # a file without it: trained block unknown
        try:
            check_block_divides(block_size, raw["block_size"], str(path.parent))
        except ValueError as error:
            raise CheckpointError(str(error)) from None
    try:
        return BackboneConfig(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
            num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"], head_dim=raw.get("head_dim") or 0,
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            block_size=block_size or raw.get("block_size") or SDAR_BLOCK_SIZE,
            mask_token_id=raw.get("mask_token_id", SDAR_MASK_TOKEN_ID) if mask_token_id is None
            else mask_token_id,
            stop_token_ids=stop_ids)
    except KeyError as error:
        raise CheckpointError(f"{path} lacks the key {error.args[0]!r}") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from error


def config_to_hf(config: BackboneConfig, dtype: torch.dtype) -> dict:
    return {"architectures": ["SDARForCausalLM"], "model_type": "sdar",
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size, "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings,
            "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False,
            "rope_scaling": None, "block_size": config.block_size,
            "mask_token_id": config.mask_token_id, "eos_token_id": list(config.stop_token_ids),
            "torch_dtype": str(dtype).removeprefix("torch.")}




def config_from_dir(directory: Path, raw: dict, mask_token_id: int | None = None,
                    block_size: int | None = None) -> BackboneConfig:
    """BackboneConfig of the checkpoint in `directory` whose config.json reads as `raw`."""
    return config_from_hf(raw, read_stop_ids(directory, raw), mask_token_id, block_size,
                          directory / "config.json")
