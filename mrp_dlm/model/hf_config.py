"""config.json <-> BackboneConfig: the Hugging Face keys of SDAR and Qwen3 checkpoints, dense
(`sdar`, `qwen3`) and MoE (`sdar_moe` as SDAR-30B-A3B, `qwen3_moe` as transformers saves).

A loader takes block_size and mask_token_id from the flags, else the file, else (the mask)
`<|MASK|>` in added_tokens.json, else the SDAR family defaults (the published config.json
files lack both); the stop ids from generation_config.json, else config.json, else the SDAR
defaults. MoE configs must name their experts; their other MoE keys default as in the
config classes.

Deliberately not here: reading weights (`files.py`, `loading.py`) and the published MRP
layout's own keys (`release.py`, which hands this module a backbone's view of them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mrp_dlm.config import (SDAR_BLOCK_SIZE, SDAR_MASK_TOKEN_ID, SDAR_STOP_TOKEN_IDS,
                            BackboneConfig, check_block_divides)
from mrp_dlm.model.files import CheckpointError, read_json

MOE_MODEL_TYPES = ("sdar_moe", "qwen3_moe")  # SDAR-30B-A3B and transformers' Qwen3-MoE
SUPPORTED_MODEL_TYPES = ("sdar", "qwen3", *MOE_MODEL_TYPES)
MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
# The other MoE keys default as in the config classes (norm_topk_prob false: SDAR-30B-A3B's
# file says true, so it must be read, never assumed).
MOE_DEFAULTS = {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": ()}
MASK_TOKEN = "<|MASK|>"  # the SDAR tokenizers' mask token, in added_tokens.json


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


def rope_parameters(raw: dict) -> dict:
    """transformers 5's `rope_parameters` (its configs' home of rope_theta), or {}."""
    value = raw.get("rope_parameters")
    return value if isinstance(value, dict) else {}


def check_supported(raw: dict, path: Path) -> None:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path}: unknown model_type {model_type!r}; mrp-dlm reads "
                              f"{' and '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
    unsupported = {"hidden_act": raw.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(raw.get("attention_bias", False)),
                   "rope_scaling": raw.get("rope_scaling") not in (None, {}),
                   "rope_parameters": rope_parameters(raw).get("rope_type", "default")
                   != "default",
                   "use_sliding_window": bool(raw.get("use_sliding_window", False))}
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise CheckpointError(f"{path}: unsupported setting(s) {', '.join(bad)}")


def config_from_hf(raw: dict, stop_ids: tuple[int, ...], mask_token_id: int | None = None,
                   block_size: int | None = None,
                   path: Path = Path("config.json")) -> BackboneConfig:
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
            rope_theta=float(raw.get("rope_theta")
                             or rope_parameters(raw).get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            block_size=block_size or raw.get("block_size") or SDAR_BLOCK_SIZE,
            mask_token_id=raw.get("mask_token_id", SDAR_MASK_TOKEN_ID) if mask_token_id is None
            else mask_token_id,
            stop_token_ids=stop_ids, **moe_fields(raw))
    except KeyError as error:
        raise CheckpointError(f"{path} lacks the key {error.args[0]!r}") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from error


def moe_fields(raw: dict) -> dict:
    """The MoE keys of an sdar_moe / qwen3_moe config.json (none for a dense one)."""
    if raw.get("model_type") not in MOE_MODEL_TYPES:
        return {}
    if "num_experts" not in raw and "num_local_experts" in raw:  # as transformers 5 writes it
        raw = {**raw, "num_experts": raw["num_local_experts"]}
    fields = {key: raw[key] for key in MOE_REQUIRED}  # KeyError: the caller names the key
    fields.update({key: raw.get(key, default) for key, default in MOE_DEFAULTS.items()})
    if not isinstance(fields["mlp_only_layers"], (list, tuple)):
        raise TypeError(f"mlp_only_layers must be a list, got {fields['mlp_only_layers']!r}")
    return {**fields, "norm_topk_prob": bool(fields["norm_topk_prob"])}


def moe_to_hf(config: BackboneConfig) -> dict:
    if not config.num_experts:
        return {"architectures": ["SDARForCausalLM"], "model_type": "sdar"}
    return {"architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
            **{key: getattr(config, key) for key in (*MOE_REQUIRED, *MOE_DEFAULTS)},
            "mlp_only_layers": list(config.mlp_only_layers)}


def config_to_hf(config: BackboneConfig, dtype: torch.dtype) -> dict:
    return {**moe_to_hf(config),
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
    """BackboneConfig of the checkpoint in `directory` whose config.json reads as `raw`; a
    config without mask_token_id takes `<|MASK|>` from added_tokens.json when it has one."""
    mask = added_mask_id(directory)
    if "mask_token_id" not in raw and mask is not None:
        raw = {**raw, "mask_token_id": mask}
    return config_from_hf(raw, read_stop_ids(directory, raw), mask_token_id, block_size,
                          directory / "config.json")


def added_mask_id(directory: Path) -> int | None:
    """The id of `<|MASK|>` in the checkpoint's added_tokens.json (None without one)."""
    path = directory / "added_tokens.json"
    mask = read_json(path).get(MASK_TOKEN) if path.is_file() else None
    if mask is not None and (not isinstance(mask, int) or isinstance(mask, bool)):
        raise CheckpointError(f"{path}: {MASK_TOKEN} must be a token id, got {mask!r}")
    return mask
