"""The published MRP layout (`SDARMRPForCausalLM`): read as it is, written by `mrp export`.

The release directories here are written by the test itself with plain safetensors and the
official key names (config keys and tensor names as in the official release), never by our
exporter, so that reading is checked against the layout and not against our own writer:
- a release (one file, or two shards with an index) loads with no conversion and decodes
  token for token as the same backbone + head from our own layouts, in every mode;
- export -> load gives back identical tensors, and the exporter writes the official names;
- bad releases fail with a message that names the problem;
- the real SDAR-4B config (../shared/fixtures) translates once marked as a release.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.files import CheckpointError
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.head_loading import save_head
from mrp_dlm.model.loading import load_backbone, load_head, read_config, save_backbone
from mrp_dlm.model.release import (RELEASE_BLOCK_SIZE, export_release, is_release_dir,
                                   release_names, sdar_view_config, write_sdar_view)
from mrp_dlm.pipeline import Pipeline

# The official names of our head's modules, as the release's modeling file spells them.
OFFICIAL = {"embed_norm": "enorm", "hidden_norm": "hnorm", "fuse": "eh_proj", "layers": "layers",
            "norm": "norm"}
PROMPTS = [[5, 17, 33], [8, 9, 10, 11, 12, 40, 2]]
MODES = [DecodeConfig(mode="static", max_new_tokens=13),
         DecodeConfig(mode="direct", lookahead=2, max_new_tokens=13),
         DecodeConfig(mode="speculative", lookahead=3, max_new_tokens=13),
         DecodeConfig(mode="remask", threshold=0.4, max_new_tokens=13)]


def official_tensors(model: Backbone, head: MRPHead) -> dict[str, torch.Tensor]:
    tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, p in head.named_parameters():
        module, _, rest = name.partition(".")
        tensors[f"mrp_modules.0.model.{OFFICIAL[module]}.{rest}"] = p.detach().clone()
    return tensors


def official_config(model: Backbone, head: MRPHead, **changes) -> dict:
    """The official config.json's keys for this shape (None in changes drops a key)."""
    c = model.config
    config = {"architectures": ["SDARMRPForCausalLM"], "attention_bias": False,
              "auto_map": {"AutoModelForCausalLM": "modeling_sdar_mrp.SDARMRPForCausalLM"},
              "block_size": c.block_size, "eos_token_id": c.stop_token_ids[0],
              "head_dim": c.head_dim, "hidden_act": "silu", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "mask_token_id": c.mask_token_id,
              "max_position_embeddings": c.max_position_embeddings, "model_type": "sdar",
              "num_attention_heads": c.num_heads, "num_hidden_layers": c.num_layers,
              "num_key_value_heads": c.num_kv_heads,
              "num_nextn_predict_layers": head.config.num_layers, "num_mrp_heads": 1,
              "rms_norm_eps": c.rms_norm_eps, "rope_scaling": None, "rope_theta": c.rope_theta,
              "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": "float32",
              "use_sliding_window": False, "vocab_size": c.vocab_size}
    config.update(changes)
    return {key: value for key, value in config.items() if value is not None}


def write_release(directory: Path, tensors: dict[str, torch.Tensor], config: dict,
                  shards: int = 1) -> Path:
    """A release directory, written with plain safetensors as the official one is."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    names, weight_map = list(tensors), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[i::shards]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.fixture
def pair(tmp_path):
    """A tiny backbone and a random 1-layer head, saved in our layouts."""
    model = random_backbone(tiny_config(), seed=4)
    head = random_head(model, 4, norm=0.3)
    save_backbone(model, tmp_path / "ours")
    save_head(head, model, tmp_path / "ours-head")
    return model, head


def decode_all(pipe: Pipeline) -> list[list[list[int]]]:
    return [generate(pipe.model, PROMPTS, config, pipe.decoder(config)).token_ids
            for config in MODES]


# --- reading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 2])
def test_a_release_decodes_as_our_layout_in_every_mode(pair, tmp_path, shards):
    model, head = pair
    release = write_release(tmp_path / "release", official_tensors(model, head),
                            official_config(model, head), shards)
    ours = Pipeline.load(tmp_path / "ours", head=tmp_path / "ours-head")
    theirs = Pipeline.load(release)
    assert theirs.head_dir == release and theirs.tokenizer is None
    assert theirs.model.config == ours.model.config
    for name, tensor in ours.head.state_dict().items():
        assert torch.equal(theirs.head.state_dict()[name], tensor), name
    assert decode_all(theirs) == decode_all(ours)


def test_release_parts_load_through_our_entry_points(pair, tmp_path, caplog):
    model, head = pair
    tensors = official_tensors(model, head)  # with the official class's tied aliases too
    tensors["mrp_modules.0.lm_head.weight"] = tensors["lm_head.weight"].clone()
    embed = tensors["model.embed_tokens.weight"]
    tensors["mrp_modules.0.model.embed_tokens.weight"] = embed.clone()
    release = write_release(tmp_path / "release", tensors, official_config(model, head))
    assert is_release_dir(release) and not is_release_dir(tmp_path / "ours")
    backbone = load_backbone(release)
    loaded = load_head(release, backbone)
    assert loaded.config.num_layers == head.config.num_layers
    ours = dict(head.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in loaded.named_parameters())
    on_ours = load_head(release, load_backbone(tmp_path / "ours"))  # --model ours --head release
    assert torch.equal(on_ours.fuse.weight, head.fuse.weight)
    assert not caplog.records  # no tensor of the release is "unexpected"


def test_text_without_a_tokenizer_is_a_clear_error(pair, tmp_path):
    model, head = pair
    release = write_release(tmp_path / "r", official_tensors(model, head),
                            official_config(model, head))
    with pytest.raises(ValueError, match="has no tokenizer; pass token ids"):
        Pipeline.load(release).generate(["hi"], DecodeConfig())


def test_token_ids_without_a_tokenizer_decode(pair, tmp_path):
    """Ids in, ids out: `texts` is None (it raised AttributeError on None.decode)."""
    model, head = pair
    release = write_release(tmp_path / "r", official_tensors(model, head),
                            official_config(model, head))
    out = Pipeline.load(release).generate_ids([[5, 6, 7]], DecodeConfig(max_new_tokens=4,
                                                                      stop_token_ids=()))
    assert out.texts is None and len(out.token_ids[0]) == 4


def test_block_size_missing_from_the_config_is_the_published_16(pair, tmp_path):
    model, head = pair
    release = write_release(tmp_path / "r", official_tensors(model, head),
                            official_config(model, head, block_size=None))
    assert read_config(release).block_size == RELEASE_BLOCK_SIZE
    with pytest.raises(CheckpointError, match="block_size: head 16 vs backbone 4"):
        load_head(release, model)  # the head is for block 16, the model decodes at 4


# --- bad releases ----------------------------------------------------------------------------

def drop(tensors: dict, name: str) -> dict:
    return {key: value for key, value in tensors.items() if key != name}


BAD = {
    "two heads": (lambda t: t, {"num_mrp_heads": 2}, "num_mrp_heads is 2; only the single-head"),
    "no depth": (lambda t: t, {"num_nextn_predict_layers": 0},
                 "num_nextn_predict_layers must be an integer >= 1, got 0"),
    "missing eh_proj": (lambda t: drop(t, "mrp_modules.0.model.eh_proj.weight"), {},
                        "missing tensor.*mrp_modules.0.model.eh_proj.weight"),
    "deeper than its file": (lambda t: t, {"num_nextn_predict_layers": 2},
                             "missing tensor.*mrp_modules.0.model.layers.1."),
    "eh_proj halved": (lambda t: {**t, "mrp_modules.0.model.eh_proj.weight": torch.zeros(32, 32)},
                       {}, r"eh_proj.weight has shape \(32, 32\), the config implies \(32, 64\)"),
    "no lm_head": (lambda t: drop(t, "lm_head.weight"), {}, "missing tensor lm_head.weight"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_releases_fail_with_a_message_that_names_the_problem(pair, tmp_path, case):
    model, head = pair
    edit, changes, message = BAD[case]
    release = write_release(tmp_path / "r", edit(official_tensors(model, head)),
                            official_config(model, head, **changes))
    with pytest.raises(CheckpointError, match=message):
        load_head(release, model)


def test_two_heads_stop_the_backbone_load_too(pair, tmp_path):
    model, head = pair
    release = write_release(tmp_path / "r", official_tensors(model, head),
                            official_config(model, head, num_mrp_heads=2))
    with pytest.raises(CheckpointError, match="num_mrp_heads is 2"):
        Pipeline.load(release)


def test_a_release_head_on_another_backbone_is_refused(pair, tmp_path):
    model, head = pair
    release = write_release(tmp_path / "r", official_tensors(model, head),
                            official_config(model, head))
    with pytest.raises(CheckpointError, match="trained on another backbone: lm_head_sha256"):
        load_head(release, random_backbone(tiny_config(), seed=5))


# --- writing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_export_then_load_gives_identical_tensors(tmp_path, tied):
    model = random_backbone(tiny_config(tie_word_embeddings=tied), seed=6)
    head = random_head(model, 6)
    export_release(model, head, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["num_nextn_predict_layers"], config["num_mrp_heads"],
            config["block_size"], config["mask_token_id"]) == (["SDARMRPForCausalLM"], 1, 1, 4, 98)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(official_tensors(model, head)) - (
            {"lm_head.weight"} if tied else set())
    backbone = load_backbone(tmp_path / "out")
    loaded = load_head(tmp_path / "out", backbone)
    for ours, theirs in ((model, backbone), (head, loaded)):
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        for name, tensor in ours.state_dict().items():
            assert torch.equal(theirs.state_dict()[name], tensor), name
    assert (backbone.lm_head.weight is backbone.model.embed_tokens.weight) == tied


def test_release_names_map_both_ways(pair):
    _, head = pair
    names = release_names(head)
    assert names["fuse.weight"] == "mrp_modules.0.model.eh_proj.weight"
    assert names["layers.0.self_attn.q_norm.weight"] == \
        "mrp_modules.0.model.layers.0.self_attn.q_norm.weight"
    assert len({theirs: ours for ours, theirs in names.items()}) == len(names)


# --- serving view and the published config ---------------------------------------------------

def test_the_sdar_view_renames_the_architecture_and_links_the_weights(pair, tmp_path):
    model, head = pair
    release = write_release(tmp_path / "r", official_tensors(model, head),
                            official_config(model, head, block_size=None), shards=2)
    write_sdar_view(release, tmp_path / "view")
    view = json.loads((tmp_path / "view" / "config.json").read_text())
    assert view["architectures"] == ["SDARForCausalLM"] and "auto_map" not in view
    assert view["block_size"] == RELEASE_BLOCK_SIZE
    written = json.loads((release / "config.json").read_text())
    assert written["architectures"] == ["SDARMRPForCausalLM"]
    linked = sorted(p.name for p in (tmp_path / "view").iterdir() if p.is_symlink())
    assert linked == sorted(p.name for p in release.iterdir() if p.name != "config.json")
    assert read_config(tmp_path / "view") == read_config(release)


def test_the_published_sdar_config_translates(fixtures_dir, tmp_path):
    raw = json.loads((fixtures_dir / "sdar-4b-chat" / "config.json").read_text())
    release = tmp_path / "sdar-4b-mrp"
    release.mkdir()
    raw.update(architectures=["SDARMRPForCausalLM"], num_nextn_predict_layers=3, num_mrp_heads=1)
    (release / "config.json").write_text(json.dumps(raw))
    config = read_config(release)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.intermediate_size, config.head_dim, config.vocab_size) == \
        (2560, 36, 32, 8, 9728, 128, 151936)
    assert (config.block_size, config.mask_token_id, config.tie_word_embeddings) == \
        (4, 151669, False)
    raw.pop("block_size")
    assert sdar_view_config(raw, release)["block_size"] == RELEASE_BLOCK_SIZE


@pytest.mark.parametrize("case", ["missing eh_proj", "deeper than its file", "eh_proj halved"])
def test_a_release_with_a_broken_head_is_refused_before_any_mode_decodes(pair, tmp_path, case):
    """Static decoding never reads the head, but the release is refused as a whole (from
    the file headers) when it loads, with the message load_head gives."""
    model, head = pair
    edit, changes, message = BAD[case]
    release = write_release(tmp_path / "r", edit(official_tensors(model, head)),
                            official_config(model, head, **changes))
    with pytest.raises(CheckpointError, match=message.replace("missing tensor", "missing head")):
        Pipeline.load(release)
    Pipeline.load(release, head=tmp_path / "ours-head")  # another head: the release's is unused
