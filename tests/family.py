"""Tiny checkpoints in the published layout of each SDAR-family checkpoint README's table names.

Each `Member` states what its published files say (model_type, architectures, auto_map,
tie_word_embeddings, sharding, the mask token's text in added_tokens.json) and what a
loader must supply because config.json lacks it (block size, mask id). `write_member`
writes a random tiny model of that layout (tiny dims, the published vocab, so that the
special ids exist) into a directory: config.json with the published keys and no
`block_size` / `mask_token_id` (the hub copies lack both), generation_config.json,
added_tokens.json, special_tokens_map.json and safetensors (an index and shards where the
release is sharded). Nothing is copied from ../shared/fixtures; `test_family.py` compares
the generated key sets with those copies when they are present.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from conftest import random_backbone
from mrp_dlm.config import BackboneConfig
from mrp_dlm.model.loading import save_backbone

VOCAB = 151936  # every member's vocab_size
MASK_ID = 151669  # the mask token of every member (the released config.json files lack it)
STOP_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|> (generation_config.json)
SDAR_DEFAULT_BLOCK = 4  # what the family's engines assume when config.json says nothing
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
           "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647,
           "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
           "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
           "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
           "<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659,
           "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
           "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665,
           "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
TINY = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, intermediate_size=24)  # every member's dims, shrunk
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)


@dataclass(frozen=True)
class Member:
    """One checkpoint of the family, as published."""

    name: str  # the checkpoint's name
    hub_id: str  # where it comes from
    model_type: str  # config.json's model_type: sdar (dense) or sdar_moe
    block_size: int  # the block it was trained with; config.json does not say it
    tied: bool  # tie_word_embeddings
    sharded: bool  # model.safetensors.index.json + shards (else one model.safetensors)
    mask_text: str = "<MASK>"  # the mask token's text in added_tokens.json (id MASK_ID)

    @property
    def moe(self) -> bool:
        return self.model_type == "sdar_moe"


FAMILY = (
    Member("SDAR-1.7B-Chat", "JetLM/SDAR-1.7B-Chat", "sdar", 4, tied=True, sharded=False),
    Member("SDAR-4B-Chat", "JetLM/SDAR-4B-Chat", "sdar", 4, tied=False, sharded=True),
    Member("SDAR-8B-Chat", "JetLM/SDAR-8B-Chat", "sdar", 4, tied=False, sharded=True),
    Member("SDAR-1.7B-Chat-b8", "JetLM/SDAR-1.7B-Chat-b8", "sdar", 8, tied=True, sharded=False),
    Member("SDAR-1.7B-Chat-b16", "JetLM/SDAR-1.7B-Chat-b16", "sdar", 16, tied=True,
           sharded=False),
    Member("SDAR-8B-Chat-b32", "JetLM/SDAR-8B-Chat-b32", "sdar", 32, tied=False, sharded=True),
    Member("SDAR-4B-Chat-b64", "JetLM/SDAR-4B-Chat-b64", "sdar", 64, tied=False, sharded=True),
    Member("TraDo-4B-Instruct", "Gen-Verse/TraDo-4B-Instruct", "sdar", 4, tied=False,
           sharded=True, mask_text="<|MASK|>"),
    Member("TraDo-8B-Instruct", "Gen-Verse/TraDo-8B-Instruct", "sdar", 4, tied=False,
           sharded=True, mask_text="<|MASK|>"),
    Member("SDAR-30B-A3B-Chat", "JetLM/SDAR-30B-A3B-Chat", "sdar_moe", 4, tied=False,
           sharded=True, mask_text="<|MASK|>"),
    Member("SDAR-30B-A3B-Sci", "JetLM/SDAR-30B-A3B-Sci", "sdar_moe", 4, tied=False,
           sharded=True, mask_text="<|MASK|>"),
)
DENSE = tuple(member for member in FAMILY if not member.moe)
MOE = tuple(member for member in FAMILY if member.moe)


def published_config(member: Member) -> dict:
    """config.json with the keys of the published file (values for the tiny dims); no
    block_size or mask_token_id, as on the hub."""
    prefix = "sdar_moe" if member.moe else "sdar"
    kind = "SDARMoe" if member.moe else "SDAR"
    raw = {"architectures": [f"{kind}ForCausalLM"],
           "auto_map": {"AutoConfig": f"configuration_{prefix}.{kind}Config",
                        "AutoModel": f"modeling_{prefix}.{kind}Model",
                        "AutoModelForCausalLM": f"modeling_{prefix}.{kind}ForCausalLM"},
           "attention_bias": False, "attention_dropout": 0.0,
           "attn_implementation": "flex_attention", "bos_token_id": 151643, "debug": False,
           "eos_token_id": 151643, "ep_size": 1, "fuse_cross_entropy": True,
           "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
           "max_window_layers": TINY["num_hidden_layers"], "micro_forward": False,
           "model_type": member.model_type, "rms_norm_eps": 1e-06, "rope_scaling": None,
           "rope_theta": 1000000, "skip_checkpoint": False, "sliding_window": None,
           "tie_word_embeddings": member.tied, "torch_dtype": "bfloat16",
           "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
           "use_sliding_window": False, "vocab_size": VOCAB, **TINY}
    if member.moe:  # every layer sparse, no shared experts; intermediate_size used by none
        raw.update(TINY_MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                   output_router_logits=False, router_aux_loss_coef=0.001)
    return raw


def tokenizer_files(member: Member) -> dict[str, dict]:
    """added_tokens.json, special_tokens_map.json and generation_config.json."""
    added = {**SPECIAL, member.mask_text: MASK_ID}
    specials = [token for token in SPECIAL if token.startswith("<|") and "_pad|" not in token
                and "fim" not in token and token not in ("<|endoftext|>", "<|repo_name|>",
                                                         "<|file_sep|>")]
    return {"added_tokens.json": dict(sorted(added.items())),
            "special_tokens_map.json": {"additional_special_tokens": specials + [member.mask_text],
                                        "eos_token": "<|endoftext|>",
                                        "pad_token": "<|endoftext|>"},
            "generation_config.json": {"bos_token_id": 151643, "do_sample": True,
                                       "eos_token_id": list(STOP_IDS), "pad_token_id": 151643,
                                       "temperature": 0.6, "top_k": 20, "top_p": 0.95}}


def tiny_dense_config(member: Member) -> BackboneConfig:
    """The BackboneConfig a loader should read from the member's files (given its block)."""
    return BackboneConfig(vocab_size=VOCAB, hidden_size=TINY["hidden_size"],
                          num_layers=TINY["num_hidden_layers"],
                          num_heads=TINY["num_attention_heads"],
                          num_kv_heads=TINY["num_key_value_heads"],
                          intermediate_size=TINY["intermediate_size"], head_dim=TINY["head_dim"],
                          tie_word_embeddings=member.tied, block_size=member.block_size,
                          mask_token_id=MASK_ID, stop_token_ids=STOP_IDS)


def moe_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the published MoE names (per-expert layout), float32."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = TINY["hidden_size"], TINY_MOE["moe_intermediate_size"]
    heads = TINY["head_dim"]
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (VOCAB, hidden)}
    for n in range(TINY["num_hidden_layers"]):
        layer = f"model.layers.{n}"
        shapes.update({
            f"{layer}.self_attn.q_proj.weight": (TINY["num_attention_heads"] * heads, hidden),
            f"{layer}.self_attn.k_proj.weight": (TINY["num_key_value_heads"] * heads, hidden),
            f"{layer}.self_attn.v_proj.weight": (TINY["num_key_value_heads"] * heads, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, TINY["num_attention_heads"] * heads),
            f"{layer}.self_attn.q_norm.weight": (heads,),
            f"{layer}.self_attn.k_norm.weight": (heads,),
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate.weight": (TINY_MOE["num_experts"], hidden)})
        for e in range(TINY_MOE["num_experts"]):
            shapes.update({f"{layer}.mlp.experts.{e}.gate_proj.weight": (inter, hidden),
                           f"{layer}.mlp.experts.{e}.up_proj.weight": (inter, hidden),
                           f"{layer}.mlp.experts.{e}.down_proj.weight": (hidden, inter)})
    return {name: (1.0 + 0.1 * torch.randn(shape, generator=generator)) if len(shape) == 1
            else 0.5 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_sharded(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Two shards and an index, named as the releases name them."""
    names = list(tensors)
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({name: tensors[name].contiguous() for name in part}, str(directory / file),
                  metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in tensors.values())},
             "weight_map": {name: file for file, part in halves.items() for name in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_member(member: Member, directory: Path, seed: int = 0):
    """The member's tiny checkpoint in `directory`; returns the dense Backbone written (for
    a dense member) or the MoE tensors (for an sdar_moe one)."""
    directory.mkdir(parents=True, exist_ok=True)
    if member.moe:
        written = moe_tensors(seed)
        write_sharded(written, directory)
    else:
        written = random_backbone(tiny_dense_config(member), seed=seed)
        if member.sharded:
            tensors = {name: p.detach().contiguous() for name, p in written.named_parameters()}
            write_sharded(tensors, directory)
        else:
            save_backbone(written, directory)
    files = {"config.json": published_config(member), **tokenizer_files(member)}
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=2))
    return written
