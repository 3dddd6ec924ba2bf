"""The serving YAML, the block-size / mask-id rules, the `sdar` config, the registry.

Pure parts run without SGLang; the registry test needs it (marker `sglang`).
"""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import pytest

from mrp_dlm.config import DecodeConfig
from mrp_dlm.serving.config import (BlockFacts, MrpServingConfig, ServingConfigError,
                                    load_serving_config, resolve_block_facts)
from mrp_dlm.serving.sdar_config import SDARConfig


def test_yaml_is_parsed_into_a_frozen_config(tmp_path):
    path = tmp_path / "mrp.yaml"
    path.write_text("head: /models/head\nlookahead: 4\nblock_size: 16\n")
    config = load_serving_config(str(path))
    assert config == MrpServingConfig(head="/models/head", lookahead=4, block_size=16)
    with pytest.raises(AttributeError):
        config.lookahead = 2


@pytest.mark.parametrize("raw, message", [
    ({"head": "h", "lookahed": 3}, "unknown key"),
    ({"head": "h", "lookahead": 0}, "lookahead"),
    ({"head": "h", "lookahead": True}, "lookahead"),
    ({"head": "h", "block_size": "16"}, "block_size"),
    ({"head": "h", "mask_token_id": -1}, "mask_token_id"),
    ({"head": "h", "mask_id": 5, "mask_token_id": 5}, "both `mask_id` and `mask_token_id`"),
    (["head"], "YAML mapping"),
    ({"candidates": 4}, r"^candidates must be auto or 1, got 4: candidate sets \(N > 1\) are "
                        "library-only"),
    ({"candidates": "two"}, "candidates must be auto or 1, got 'two'"),
])
def test_bad_yaml_values_name_the_key(raw, message):
    with pytest.raises(ServingConfigError, match=message):
        MrpServingConfig.from_mapping(raw)


@pytest.mark.parametrize("value", ["auto", 1, "1"])
def test_serving_takes_candidates_auto_or_1(value):
    assert MrpServingConfig.from_mapping({"candidates": value}).candidates == value


def test_lookahead_default_is_the_library_default():
    assert MrpServingConfig(head="h").lookahead == DecodeConfig().lookahead


def test_missing_yaml_and_missing_head_directory(tmp_path):
    with pytest.raises(ServingConfigError, match="dllm-algorithm-config"):
        load_serving_config(None)
    with pytest.raises(ServingConfigError, match="head directory not found"):
        MrpServingConfig(head=str(tmp_path / "nope")).head_directory()


def test_block_facts_yaml_then_config_then_sdar_table():
    with_facts = SimpleNamespace(block_size=16, mask_token_id=3)
    published = SimpleNamespace()  # SDAR's config.json has neither key
    assert resolve_block_facts({}, published) == BlockFacts(4, 151669)
    assert resolve_block_facts({}, with_facts) == BlockFacts(16, 3)
    assert resolve_block_facts({"block_size": 8, "mask_token_id": 5}, with_facts) \
        == BlockFacts(8, 5)


def test_mask_id_is_a_deprecated_alias_of_mask_token_id(caplog):
    with caplog.at_level(logging.WARNING, logger="mrp_dlm.serving.config"):
        config = MrpServingConfig.from_mapping({"head": "h", "mask_id": 5})
    assert config == MrpServingConfig(head="h", mask_token_id=5)
    assert "`mask_id` is deprecated; write `mask_token_id`" in caplog.text
    assert resolve_block_facts({"mask_id": 5}, SimpleNamespace()) == BlockFacts(4, 5)
    with pytest.raises(ServingConfigError, match="both `mask_id` and `mask_token_id`"):
        resolve_block_facts({"mask_id": 5, "mask_token_id": 6}, SimpleNamespace())


def test_sdar_config_keeps_rope_theta():
    """SGLang's SDAR model reads config.rope_theta; transformers 5 would hide it (-> 10000)."""
    config = SDARConfig(rope_theta=1_000_000.0, hidden_size=64, num_attention_heads=4)
    assert config.rope_theta == 1_000_000.0
    assert config.model_type == "sdar"


@pytest.mark.sglang
def test_plugin_registers_the_algorithms():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (run .ci/install_sglang.sh)")
    from sglang_env import require_sglang

    require_sglang()
    from sglang.srt.dllm.algorithm import get_algorithm_cls

    from mrp_dlm.serving.plugin import register_algorithms

    register_algorithms()
    assert get_algorithm_cls("MrpSpeculative").__name__ == "MrpSpeculative"
    assert get_algorithm_cls("MrpDirect").__name__ == "MrpDirect"
