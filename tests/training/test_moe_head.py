"""A head for an MoE backbone (SDAR-30B-A3B's layout): `mrp train head --model MOE_DIR`
trains dense head layers of the config's intermediate_size, `mrp export` writes head and
MoE backbone in the release layout, and `--model` reads that layout back (same tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_backbone, tiny_config
from mrp_dlm import cli
from mrp_dlm.config import DecodeConfig
from mrp_dlm.model.backbone import DecoderLayer
from mrp_dlm.model.files import tensor_names, weight_files
from mrp_dlm.model.loading import load_backbone, load_head, save_backbone
from mrp_dlm.model.moe import SparseMLP
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.training.data import task_texts
from mrp_dlm.training.tokenizer import save_tokenizer, train_tokenizer
from reference_moe import TINY_MOE


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny random SDAR-MoE backbone (block 4) with a trained tokenizer."""
    directory = tmp_path_factory.mktemp("moe")
    problems, targets = task_texts(("arith",), 40)
    tokenizer = train_tokenizer(problems + targets, 300)
    save_tokenizer(tokenizer, directory)
    config = tiny_config(**TINY_MOE, vocab_size=tokenizer.get_vocab_size(), mask_token_id=3,
                         stop_token_ids=(2, 0))
    save_backbone(random_backbone(config), directory)
    return directory


def test_train_export_and_reload_an_moe_head(moe_dir, tmp_path, capsys):
    head_dir = tmp_path / "head"
    assert cli.main(["train", "head", "--model", str(moe_dir), "--out", str(head_dir),
                     "--tasks", "arith", "--train-examples", "40", "--eval-examples", "4",
                     "--seq-len", "128", "--batch-size", "4", "--train-steps", "6", "--lr", "3e-3",
                     "--head-layers", "1", "--lookahead", "1", "--eval-every", "6"]) == 0
    metrics = [json.loads(line) for line in (head_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["kl_residual"][0] < metrics[-1]["kl_base"][0]  # it learned something
    backbone = load_backbone(moe_dir)
    assert all(isinstance(layer.mlp, SparseMLP) for layer in backbone.model.layers)
    head = load_head(head_dir, backbone)
    layer = head.layers[0]
    assert isinstance(layer, DecoderLayer) and not isinstance(layer.mlp, SparseMLP)
    assert layer.mlp.gate_proj.out_features == backbone.config.intermediate_size

    release = tmp_path / "release"
    assert cli.main(["export", "--model", str(moe_dir), "--head", str(head_dir),
                     "--out", str(release)]) == 0
    raw = json.loads((release / "config.json").read_text())
    assert raw["architectures"] == ["SDARMRPForCausalLM"] and raw["model_type"] == "sdar_moe"
    names = tensor_names(weight_files(release))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names  # as published
    assert "mrp_modules.0.model.layers.0.mlp.gate_proj.weight" in names  # the dense head

    ours, theirs = Pipeline.load(moe_dir, head=head_dir), Pipeline.load(release)
    for name, tensor in ours.model.state_dict().items():
        assert torch.equal(tensor, theirs.model.state_dict()[name]), name
    for name, tensor in ours.head.state_dict().items():
        assert torch.equal(tensor, theirs.head.state_dict()[name]), name
    for mode in ("speculative", "direct"):
        config = DecodeConfig(mode=mode, max_new_tokens=12, lookahead=2)
        want = ours.generate(["What is 7 + 5?"], config)
        assert theirs.generate(["What is 7 + 5?"], config).token_ids == want.token_ids, mode
