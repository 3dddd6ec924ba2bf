"""The MoE backbone (SDAR-30B-A3B's layout): config.json fields, both expert layouts,
streamed loading, routing and dispatch, against transformers' Qwen3MoeForCausalLM."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import random_backbone, tiny_config
from mrp_dlm.model import moe
from mrp_dlm.model.files import CheckpointError, tensor_names, weight_files
from mrp_dlm.model.loading import load_backbone, read_config, save_backbone
from reference import MARGIN
from reference_moe import TINY_MOE, TransformersBackbone, as_qwen3_moe, load_qwen3_moe

transformers = pytest.importorskip("transformers", minversion="4.51")


def moe_model(seed: int = 0, **overrides):
    return random_backbone(tiny_config(**{**TINY_MOE, **overrides}), seed=seed)


def block_mask(T: int, block_size: int, B: int = 1) -> torch.Tensor:
    blocks = torch.arange(T) // block_size  # (T,)
    return (blocks[None, :] <= blocks[:, None]).expand(B, T, T)  # (B, T, T)


def test_published_layout_fields_are_read(tmp_path):
    save_backbone(moe_model(), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (raw["model_type"], raw["architectures"]) == ("sdar_moe", ["SDARMoeForCausalLM"])
    raw.update(head_dim=24, mlp_only_layers=[1], decoder_sparse_step=1)  # head_dim != H / nh
    raw.pop("norm_topk_prob")  # the config classes' default: false
    raw.pop("mask_token_id")  # as published: the mask comes from added_tokens.json
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "m" / "added_tokens.json").write_text(json.dumps({"<|MASK|>": 96}))
    config = read_config(tmp_path / "m")
    assert (config.head_dim, config.num_experts, config.num_experts_per_tok) == (24, 8, 2)
    assert (config.moe_intermediate_size, config.norm_topk_prob) == (16, False)
    assert (config.mask_token_id, config.mlp_only_layers) == (96, (1,))
    assert [config.is_sparse(i) for i in range(2)] == [True, False]
    assert read_config(tmp_path / "m", mask_token_id=95).mask_token_id == 95  # the flag wins


@pytest.mark.parametrize("step,only,sparse", [(1, (), [True, True, True, True]),
                                              (2, (), [False, True, False, True]),
                                              (1, (0, 2), [False, True, False, True])])
def test_the_backbone_picks_dense_or_sparse_per_layer(step, only, sparse):
    model = moe_model(num_layers=4, decoder_sparse_step=step, mlp_only_layers=only)
    assert [isinstance(layer.mlp, moe.SparseMLP) for layer in model.model.layers] == sparse


def test_an_moe_config_without_experts_fails_clearly(tmp_path):
    save_backbone(moe_model(), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    del raw["moe_intermediate_size"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="lacks the key 'moe_intermediate_size'"):
        read_config(tmp_path / "m")


def test_per_expert_round_trip_is_exact(tmp_path):
    model = moe_model()
    save_backbone(model, tmp_path / "m", max_shard_bytes=20_000)
    names = tensor_names(weight_files(tmp_path / "m"))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names  # as published
    assert not any(name.endswith("gate_up_proj") for name in names)
    assert len(weight_files(tmp_path / "m")) > 1
    loaded = load_backbone(tmp_path / "m")
    for (name, ours), (_, theirs) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("original_format", [True, False])  # per-expert; fused (E, 2I, H)
def test_both_layouts_transformers_writes_load_the_same(tmp_path, original_format):
    model = moe_model(seed=3)
    save_backbone(model, tmp_path / "ours")
    hf = load_qwen3_moe(as_qwen3_moe(tmp_path / "ours", tmp_path / "qwen"))
    hf.save_pretrained(tmp_path / "saved", save_original_format=original_format)
    fused = any(name.endswith("gate_up_proj") for name in tensor_names(
        weight_files(tmp_path / "saved")))
    assert fused == (not original_format)
    loaded = load_backbone(tmp_path / "saved")
    assert loaded.config.num_experts == 8  # transformers writes it as num_local_experts
    for (name, ours), (_, theirs) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(ours, theirs), name


@pytest.mark.exact_arithmetic
@pytest.mark.parametrize("block_size,normalize", [(1, True), (4, True), (4, False)])
def test_forward_equals_transformers_qwen3_moe(tmp_path, block_size, normalize):
    model = moe_model(seed=1, norm_topk_prob=normalize)
    save_backbone(model, tmp_path / "ours")
    reference = TransformersBackbone(load_qwen3_moe(as_qwen3_moe(tmp_path / "ours",
                                                                 tmp_path / "q")), model.config)
    B, T = 3, 11
    positions = torch.arange(T).expand(B, T)  # (B, T)
    mask = block_mask(T, block_size, B)  # (B, T, T)
    for draw in range(8):  # the first batch with no token near a routing tie
        generator = torch.Generator().manual_seed(100 * block_size + draw)
        ids = torch.randint(0, 97, (B, T), generator=generator)  # (B, T)
        reference.routing_margin = float("inf")
        with torch.no_grad():
            theirs = reference.logits(reference(ids, positions, mask))  # (B, T, V)
        if reference.routing_margin >= MARGIN:
            break
    assert reference.routing_margin >= MARGIN, "every draw has a routing near-tie"
    with torch.no_grad():
        ours = model.logits(model(ids, positions, mask))  # (B, T, V)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_sparse_mlp_equals_transformers_block():
    model = moe_model(seed=2)
    config = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=16, norm_topk_prob=True)
    theirs = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    ours = model.model.layers[0].mlp
    theirs.load_state_dict(ours.state_dict())  # same names, same fused shapes
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))  # (B, T, H)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_grouped_matmul_equals_one_matmul_per_expert(monkeypatch):
    if moe.GROUPED_MM is None:
        pytest.skip("this torch has no grouped_mm")
    mlp = moe_model(seed=4).model.layers[0].mlp
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))  # (N, H)
    with torch.no_grad():
        assert moe.can_group(x, mlp.experts.gate_up_proj)
        grouped = mlp(x[None])
        monkeypatch.setattr(moe, "can_group", lambda x, weight: False)
        looped = mlp(x[None])
    assert torch.equal(grouped, looped)


def test_dispatch_has_no_per_token_loop(monkeypatch):
    """One matmul per active expert on the fallback path, whatever the token count."""
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(moe, "can_group", lambda x, weight: False)
    monkeypatch.setattr(moe.F, "linear", lambda *a: calls.append(1) or linear(*a))
    mlp = moe_model(seed=4).model.layers[0].mlp
    with torch.no_grad():
        mlp(torch.randn(1, 200, 32))
    assert len(calls) == 1 + 2 * 8  # the router, then gate_up and down per expert


MEMORY_CHILD = textwrap.dedent("""
    import json, re, sys
    import torch
    from mrp_dlm.model.loading import load_backbone

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read())[1])

    load_backbone(sys.argv[2])  # a tiny load first: imports and lazy setup are not the load's
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from now
    before = kib("VmRSS")
    model = load_backbone(sys.argv[1])
    print(json.dumps({"before": before * 1024, "peak": kib("VmHWM") * 1024}))
""")


def test_loading_streams_shard_by_shard(tmp_path):
    """Peak RSS of a fresh interpreter's load grows by at most 1.3x the checkpoint (as for
    dense models: `benchmarks/decode.py --memory`): every expert lands in place. Experts
    are most of this checkpoint, so a load that held them twice would fail."""
    config = tiny_config(**{**TINY_MOE, "hidden_size": 256, "num_heads": 8, "head_dim": 32,
                            "num_experts": 64, "moe_intermediate_size": 128, "num_layers": 4,
                            "vocab_size": 512, "mask_token_id": 511, "stop_token_ids": (510,)})
    with torch.device("meta"):
        model = type(moe_model())(config)
    model.to_empty(device="cpu")
    save_backbone(model, tmp_path / "m", max_shard_bytes=8 * 2**20)
    del model
    size = sum(path.stat().st_size for path in weight_files(tmp_path / "m"))
    assert size > 100e6 and len(weight_files(tmp_path / "m")) > 5
    save_backbone(moe_model(), tmp_path / "tiny")
    child = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(tmp_path / "m"),
                            str(tmp_path / "tiny")],
                           check=True, capture_output=True, text=True)
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    ratio = (measured["peak"] - measured["before"]) / size
    print(f"MoE load: peak RSS +{ratio:.3f}x a {size / 1e6:.0f} MB checkpoint")
    assert ratio <= 1.3, (measured, size)


# SDAR-30B-A3B-Chat's config.json, its keys that matter (from the published file's copy in
# issue 35; no fixture of it is in ../shared): no block_size, no mask_token_id.
SDAR_30B_A3B = {"architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
                "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "tie_word_embeddings": False, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-6, "hidden_act": "silu", "eos_token_id": 151645}


def test_the_published_30b_a3b_shape_has_its_tensor_count_and_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SDAR_30B_A3B))
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|MASK|>": 151669}))
    config = read_config(tmp_path)
    assert (config.head_dim, config.mask_token_id, config.block_size) == (128, 151669, 4)
    with torch.device("meta"):
        model = type(moe_model())(config)
    tensors = moe.published_tensors(dict(model.named_parameters()))
    assert len(tensors) == 18_867  # the published index's tensor count
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in tensors
    assert tuple(tensors["model.layers.0.mlp.gate.weight"].shape) == (128, 2048)
    bf16_bytes = 2 * sum(tensor.numel() for tensor in tensors.values())
    assert round(bf16_bytes / 1e9, 2) == 61.06  # the published 61.06 GB
