"""Checkpoint I/O: exact round trips, the published SDAR layouts, tokenizer, and bad input.

The SDAR-4B/8B fixtures (config, index, tokenizer; no weights) live in ../shared/fixtures and
the tests that read them skip when that folder is absent. Every bad checkpoint must fail
with a message that names the problem, and loading must never write into the directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mrp_dlm.config import SDAR_BLOCK_SIZE, SDAR_MASK_TOKEN_ID, SDAR_STOP_TOKEN_IDS
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.files import INDEX_FILE, SINGLE_FILE, CheckpointError
from mrp_dlm.model.loading import load_backbone, read_config, save_backbone
from mrp_dlm.model.tokenizer import load_tokenizer

SDAR_MODELS = ["sdar-4b-chat", "sdar-8b-chat"]


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under directory with its size and mtime (to prove nothing was written)."""
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def assert_same_weights(a: Backbone, b: Backbone) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


# --- round trips ----------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_exact(make_model, tmp_path, tied):
    model = make_model(tie_word_embeddings=tied, seed=3)
    save_backbone(model, tmp_path)
    assert (tmp_path / SINGLE_FILE).is_file() and not (tmp_path / INDEX_FILE).exists()
    loaded = load_backbone(tmp_path)
    assert loaded.config == model.config
    assert not loaded.training
    assert_same_weights(model, loaded)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 97, (2, 8))
    mask = torch.ones(2, 8, 8, dtype=torch.bool)
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        assert torch.equal(model(ids, positions, mask), loaded(ids, positions, mask))


def test_sharded_round_trip_is_exact(make_model, tmp_path):
    model = make_model(seed=4)
    save_backbone(model, tmp_path, max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(shards) > 2 and not (tmp_path / SINGLE_FILE).exists()
    assert set(index["weight_map"]) == set(dict(model.named_parameters()))
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    assert_same_weights(model, load_backbone(tmp_path))


def test_load_converts_dtype(make_model, tmp_path):
    model = make_model(seed=5)
    save_backbone(model, tmp_path)
    loaded = load_backbone(tmp_path, dtype=torch.bfloat16)
    for name, param in loaded.state_dict().items():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, model.state_dict()[name].to(torch.bfloat16)), name


def test_resave_switches_layout_cleanly(make_model, tmp_path):
    model = make_model(seed=6)
    save_backbone(model, tmp_path, max_shard_bytes=20_000)
    save_backbone(model, tmp_path)
    assert not (tmp_path / INDEX_FILE).exists()
    assert_same_weights(model, load_backbone(tmp_path))


# --- the published SDAR checkpoints ---------------------------------------------------------

@pytest.mark.parametrize("name", SDAR_MODELS)
def test_sdar_fixture_names_and_shapes_match_the_index(fixtures_dir, name):
    directory = fixtures_dir / name
    config = read_config(directory)
    raw = json.loads((directory / "config.json").read_text())
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]
    assert (config.block_size, config.mask_token_id) == (4, 151669)
    assert config.stop_token_ids == (151645, 151643)  # from generation_config.json
    with torch.device("meta"):
        model = Backbone(config)
    params = dict(model.named_parameters())
    index = json.loads((directory / INDEX_FILE).read_text())
    assert set(params) == set(index["weight_map"])
    assert ("lm_head.weight" in params) == (not config.tie_word_embeddings)
    # The index has no shapes, but its total byte count (bf16) pins them down in aggregate.
    assert sum(p.numel() * 2 for p in params.values()) == index["metadata"]["total_size"]
    H, V, hd = raw["hidden_size"], raw["vocab_size"], raw["head_dim"]
    layer = "model.layers.0."
    assert params["model.embed_tokens.weight"].shape == (V, H)
    assert params[layer + "self_attn.q_proj.weight"].shape == (raw["num_attention_heads"] * hd, H)
    assert params[layer + "self_attn.k_proj.weight"].shape == (raw["num_key_value_heads"] * hd, H)
    assert params[layer + "self_attn.q_norm.weight"].shape == (hd,)
    assert params[layer + "mlp.down_proj.weight"].shape == (H, raw["intermediate_size"])
    assert len(model.model.layers) == raw["num_hidden_layers"]


def copy_config(source: Path, target: Path, drop=(), **changes) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    raw = json.loads((source / "config.json").read_text())
    for key in drop:
        raw.pop(key)
    raw.update(changes)
    (target / "config.json").write_text(json.dumps(raw))
    if (source / "generation_config.json").is_file():
        shutil.copy(source / "generation_config.json", target / "generation_config.json")
    return target


def test_hub_config_without_block_and_mask_falls_back(fixtures_dir, tmp_path):
    # The configs published with the weights lack both keys; the SDAR defaults fill them.
    directory = copy_config(fixtures_dir / "sdar-4b-chat", tmp_path,
                            drop=("block_size", "mask_token_id"))
    config = read_config(directory)
    assert (config.block_size, config.mask_token_id) == (SDAR_BLOCK_SIZE, SDAR_MASK_TOKEN_ID)
    assert (config.block_size, config.mask_token_id) == (4, 151669)
    overridden = read_config(directory, mask_token_id=151670, block_size=16)
    assert (overridden.block_size, overridden.mask_token_id) == (16, 151670)


def test_flags_override_the_file(fixtures_dir, tmp_path):
    directory = copy_config(fixtures_dir / "sdar-8b-chat", tmp_path, block_size=8,
                            mask_token_id=151668)
    assert (read_config(directory).block_size, read_config(directory).mask_token_id) == (8, 151668)
    config = read_config(directory, mask_token_id=151669, block_size=4)
    assert (config.block_size, config.mask_token_id) == (4, 151669)


@pytest.mark.parametrize("block_size", [3, 7, 16])
def test_a_block_size_that_does_not_divide_the_trained_one_is_refused(fixtures_dir, tmp_path,
                                                                     block_size):
    directory = copy_config(fixtures_dir / "sdar-8b-chat", tmp_path, block_size=8)
    with pytest.raises(CheckpointError, match=rf"block size {block_size} does not divide the "
                       r"block size 8 .* trained with: .* use one of 1, 2, 4, 8$"):
        read_config(directory, block_size=block_size)


def test_stop_ids_fall_back_to_config_then_defaults(tmp_path, make_model):
    save_backbone(make_model(stop_token_ids=(97, 96)), tmp_path)
    assert read_config(tmp_path).stop_token_ids == (97, 96)  # config.json eos_token_id
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("eos_token_id")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_config(tmp_path).stop_token_ids == SDAR_STOP_TOKEN_IDS
    # ... which lie outside this tiny vocabulary: decoding would reject them, loading does not.


def test_fixture_tokenizer_loads_offline_and_renders_chat(fixtures_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    directory = fixtures_dir / "sdar-4b-chat"
    assert not (directory / "tokenizer.json").exists()  # the vocab.json + merges.txt path
    before = snapshot(directory)
    tokenizer = load_tokenizer(directory)
    assert tokenizer is not None
    assert tokenizer.token_id("<|MASK|>") == 151669
    assert tokenizer.token_id("<|im_end|>") == 151645
    assert tokenizer.token_id("<|endoftext|>") == 151643
    assert tokenizer.token_id("<|im_start|>") == 151644
    text = "Hello, world! 2 + 2 = 4.\n  def f(x): return x"
    ids = tokenizer.encode(text)
    assert 1 < len(ids) < len(text) and tokenizer.decode(ids) == text
    prompt = tokenizer.render_chat("What is 2+2?")
    assert prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tokenizer.encode(prompt)
    assert prompt_ids[0] == 151644 and prompt_ids.count(151645) == 1
    assert tokenizer.decode(prompt_ids, skip_special_tokens=False) == prompt
    assert snapshot(directory) == before


def test_no_tokenizer_gives_none(checkpoint_dir):
    assert load_tokenizer(checkpoint_dir) is None


# --- bad input ------------------------------------------------------------------------------

def break_missing_config(d: Path) -> None:
    (d / "config.json").unlink()


def break_corrupt_config(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "sdar", "hidden_size": 32,')


def edit_config(**changes):
    def edit(d: Path) -> None:
        raw = json.loads((d / "config.json").read_text())
        raw.update(changes)
        (d / "config.json").write_text(json.dumps(raw))
    return edit


def break_drop_key(d: Path) -> None:
    raw = json.loads((d / "config.json").read_text())
    raw.pop("num_hidden_layers")
    (d / "config.json").write_text(json.dumps(raw))


def break_missing_weights(d: Path) -> None:
    (d / SINGLE_FILE).unlink()


def break_corrupt_weights(d: Path) -> None:
    (d / SINGLE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")


def break_truncated_weights(d: Path) -> None:
    data = (d / SINGLE_FILE).read_bytes()
    (d / SINGLE_FILE).write_bytes(data[:len(data) // 2])


def break_missing_tensor(d: Path) -> None:
    model = load_backbone(d)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters() if n != "model.norm.weight"}
    save_file(tensors, str(d / SINGLE_FILE))


def break_shape(d: Path) -> None:
    edit_config(intermediate_size=41)(d)


def break_missing_shard(d: Path) -> None:
    model = load_backbone(d)
    (d / SINGLE_FILE).unlink()
    save_backbone(model, d, max_shard_bytes=20_000)
    next(iter(sorted(d.glob("model-*-of-*.safetensors")))).unlink()


BAD_CHECKPOINTS = {
    "missing config.json": (break_missing_config, r"missing file: .*config\.json"),
    "corrupt config JSON": (break_corrupt_config, r"config\.json is not valid JSON"),
    "unknown model_type": (edit_config(model_type="llama"),
                           r"unknown model_type 'llama'; mrp-dlm reads sdar and qwen3"),
    "unsupported setting": (edit_config(attention_bias=True), r"unsupported setting.*attention_bias"),
    "config lacks a key": (break_drop_key, r"config\.json lacks the key 'num_hidden_layers'"),
    "missing weights": (break_missing_weights, r"has neither model\.safetensors nor "
                                               r"model\.safetensors\.index\.json"),
    "corrupt safetensors": (break_corrupt_weights, r"model\.safetensors is not a readable "
                                                   r"safetensors file"),
    "truncated safetensors": (break_truncated_weights, r"model\.safetensors is not a readable "
                                                       r"safetensors file"),
    "missing tensor": (break_missing_tensor, r"missing tensor\(s\) model\.norm\.weight"),
    "shape mismatch": (break_shape, r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape "
                                    r"\(\d+, \d+\), the config implies \(\d+, \d+\)"),
    "missing shard": (break_missing_shard, r"missing shard\(s\): .*model-00001-of-"),
}


@pytest.mark.parametrize("case", BAD_CHECKPOINTS)
def test_bad_checkpoint_fails_clearly_and_writes_nothing(checkpoint_dir, case):
    breaker, message = BAD_CHECKPOINTS[case]
    breaker(checkpoint_dir)
    before = snapshot(checkpoint_dir)
    with pytest.raises(CheckpointError, match=message):
        load_backbone(checkpoint_dir)
    assert snapshot(checkpoint_dir) == before


@pytest.mark.parametrize("value", [None, "32"])
def test_config_value_of_the_wrong_type_fails_clearly(checkpoint_dir, value):
    edit_config(hidden_size=value)(checkpoint_dir)
    with pytest.raises(CheckpointError, match=r"config\.json.*hidden_size"):
        load_backbone(checkpoint_dir)


def test_missing_directory_fails_clearly_and_is_not_created(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(CheckpointError, match=r"model directory not found: .*no/such/model"):
        load_backbone(missing)
    with pytest.raises(CheckpointError, match=r"model directory not found"):
        read_config(missing)
    assert not (tmp_path / "no").exists()
