"""The MRP algorithms' YAML (`--dllm-algorithm-config mrp.yaml`) as a frozen dataclass.

    lookahead: 3            # optional, default DecodeConfig's; K: head drafts per round
                            # (speculative) / commits per forward (direct)
    threshold: 0.9          # optional, default DecodeConfig's: the LowConfidence threshold
                            # MrpSpeculative reproduces (1.0: static), MrpRemask's proposals
    adaptive: true          # MrpSpeculative only, optional, default DecodeConfig's: run only
                            # the head drafts that measured acceptance and cost say pay off
    candidates: auto        # MrpSpeculative, optional: auto or 1; sets (N > 1): library-only
    remask_rule: chain      # MrpRemask, optional, default DecodeConfig's: chain or paper
    head: /path/to/head     # MRP head directory (config.json + model.safetensors); required
                            # but by MrpSpeculative, which self-drafts without it
    block_size: 16          # optional; else the model's config.json, else the SDAR default 4
    mask_token_id: 151669   # optional; else the model's config.json, else the SDAR default

SGLang reads `block_size` from the same file; the mask id it would take from its own table
(151669 for SDAR), which is why the plugin resolves both here (see `resolve_block_facts`).
Unknown keys are errors: a typo must never be silently ignored. `mask_id` is a deprecated
alias of `mask_token_id` (it logs a warning; giving both is an error).

Deliberately not here: loading the head (see `models/sdar_mrp.py`) and SGLang's own keys
beyond `block_size` (e.g. `threshold` belongs to LowConfidence).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mrp_dlm.config import REMASK_RULES, SDAR_BLOCK_SIZE, SDAR_MASK_TOKEN_ID, DecodeConfig

log = logging.getLogger(__name__)

DEPRECATED_KEYS = {"mask_id": "mask_token_id"}  # old YAML key -> its one current name
YAML_SOURCE = "the dLLM algorithm config"  # how messages name the YAML when no path is known


class ServingConfigError(ValueError):
    """A bad MRP serving configuration, with a message that names the offending key."""


@dataclass(frozen=True)
class MrpServingConfig:
    """What the MRP algorithms need beyond SGLang's own server arguments."""

    # MRP head directory, trained on this model at this block size (None: MrpSpeculative
    # self-drafts; MrpDirect refuses)
    head: str | None = None
    lookahead: int = DecodeConfig.lookahead  # K: head steps per round (the library's default)
    threshold: float | None = None  # MrpSpeculative's rule; None: the library's default
    adaptive: bool = DecodeConfig.adaptive  # MrpSpeculative: draft only what pays (as the library)
    candidates: str | int = DecodeConfig.candidates  # auto or 1: serving verifies no sets
    remask_rule: str = DecodeConfig.remask_rule  # MrpRemask: chain or paper (as the library)
    remask_delta: float | None = None  # MrpRemask: δ of the veto; None: the library's default
    block_size: int | None = None  # L; None: the model's config.json, else SDAR's 4
    mask_token_id: int | None = None  # [MASK] id; None: the model's config.json, else SDAR's
    capture_input_preparation: bool = True  # SGLang's own key; accepted and passed through

    def __post_init__(self) -> None:
        if self.head is not None and (not isinstance(self.head, str) or not self.head):
            raise ServingConfigError("head must name the MRP head directory")
        if not isinstance(self.lookahead, int) or isinstance(self.lookahead, bool) \
                or self.lookahead < 1:
            raise ServingConfigError(f"lookahead must be an integer >= 1, got {self.lookahead!r}")
        if not isinstance(self.adaptive, bool):
            raise ServingConfigError(f"adaptive must be true or false, got {self.adaptive!r}")
        if str(self.candidates).strip().lower() not in (DecodeConfig.candidates, "1"):
            raise ServingConfigError(
                f"candidates must be auto or 1, got {self.candidates!r}: candidate sets "
                "(N > 1) are library-only (`mrp generate/eval/bench --candidates N`); serving "
                "verifies each draft alone")
        if self.threshold is not None and (
                not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool)
                or not 0.0 < self.threshold <= 1.0):
            raise ServingConfigError(f"threshold must be a number in (0, 1], got "
                                     f"{self.threshold!r}")
        if self.remask_rule not in REMASK_RULES:
            raise ServingConfigError(f"remask_rule must be one of {', '.join(REMASK_RULES)}, "
                                     f"got {self.remask_rule!r}")
        if self.remask_delta is not None and (
                not isinstance(self.remask_delta, (int, float))
                or isinstance(self.remask_delta, bool) or self.remask_delta < 0):
            raise ServingConfigError(f"remask_delta must be a number >= 0, got "
                                     f"{self.remask_delta!r}")
        for name in ("block_size", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < (1 if name == "block_size" else 0)):
                raise ServingConfigError(f"{name} must be a non-negative integer, got {value!r}")

    @classmethod
    def from_mapping(cls, raw: Any, source: str = YAML_SOURCE
                     ) -> "MrpServingConfig":
        if not isinstance(raw, dict):
            raise ServingConfigError(f"{source} must be a YAML mapping, got {type(raw).__name__}")
        raw = current_keys(raw, source)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ServingConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                                     f"the MRP algorithms read {', '.join(sorted(known))}")
        return cls(**raw)

    @property
    def speculative_threshold(self) -> float:
        """The LowConfidence threshold MrpSpeculative reproduces."""
        return DecodeConfig.threshold if self.threshold is None else float(self.threshold)

    @property
    def remask(self) -> DecodeConfig:
        """The library's remask config MrpRemask reproduces (greedy; sampling per request)."""
        return DecodeConfig(mode="remask", threshold=self.speculative_threshold,
                            remask_rule=self.remask_rule,
                            remask_delta=(DecodeConfig.remask_delta if self.remask_delta is None
                                          else float(self.remask_delta)))

    def head_directory(self) -> Path | None:
        """The head's directory, checked; None when the YAML names none."""
        if self.head is None:
            return None
        path = Path(self.head).expanduser()
        if not (path / "config.json").is_file():
            raise ServingConfigError(f"MRP head directory not found (or without config.json): "
                                     f"{path}")
        return path


def current_keys(raw: dict, source: str = YAML_SOURCE) -> dict:
    """raw with each deprecated key renamed to its current name (a logged warning); an
    error when a mapping gives both spellings."""
    renamed = dict(raw)
    for old, new in DEPRECATED_KEYS.items():
        if old not in renamed:
            continue
        if new in renamed:
            raise ServingConfigError(f"{source} gives both `{old}` and `{new}`; keep only "
                                     f"`{new}` (`{old}` is its deprecated alias)")
        log.warning("%s: `%s` is deprecated; write `%s` instead", source, old, new)
        renamed[new] = renamed.pop(old)
    return renamed


def read_yaml(path: str | None) -> dict:
    """The YAML mapping at path; {} when no path is given."""
    if path is None:
        return {}
    import yaml  # SGLang needs PyYAML for this file too

    with open(path) as handle:
        raw = yaml.safe_load(handle) or {}
    if not isinstance(raw, dict):
        raise ServingConfigError(f"{path} must hold a YAML mapping")
    return raw


def load_serving_config(path: str | None) -> MrpServingConfig:
    if path is None:
        raise ServingConfigError("the MRP algorithms need --dllm-algorithm-config mrp.yaml "
                                 "(`head: <directory>`; MrpSpeculative may leave it out)")
    return MrpServingConfig.from_mapping(read_yaml(path), path)


@dataclass(frozen=True)
class BlockFacts:
    block_size: int  # L the server decodes with
    mask_token_id: int  # [MASK] id


def resolve_block_facts(yaml_values: dict, hf_config: Any,
                        table: BlockFacts = BlockFacts(SDAR_BLOCK_SIZE, SDAR_MASK_TOKEN_ID)
                        ) -> BlockFacts:
    """YAML first, then the model's config.json, then SGLang's SDAR table."""
    yaml_values = current_keys(yaml_values)
    block_size = yaml_values.get("block_size") or getattr(hf_config, "block_size", None) \
        or table.block_size
    mask_token_id = yaml_values.get("mask_token_id")
    if mask_token_id is None:
        mask_token_id = getattr(hf_config, "mask_token_id", None)
    return BlockFacts(int(block_size),
                      table.mask_token_id if mask_token_id is None else int(mask_token_id))
