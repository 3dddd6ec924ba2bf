"""Qwen3-MoE's sparse MLP for SGLang's `SDARMoeSparseMoeBlock` on a CPU without SGLang's
CPU kernels: the library's own `SparseMLP` over SGLang's weight tensors.

SGLang 0.5.23 cannot run an MoE layer on such a CPU: without AMX its router calls
`topk_softmax`, which `sglang/srt/layers/moe/topk.py` imports only on CUDA, HIP and XPU
(`NameError: name 'topk_softmax' is not defined`); with AMX it calls `sgl_kernel`'s CPU
kernels, which have no build here (`cpu_standins.py`). There the plugin's MoE model gives
every sparse block a `forward_normal` that runs `model/moe.py`'s `SparseMLP` (softmax over
the experts in float32, top-k, renormalised when `norm_topk_prob`, cast to the activation
dtype, SwiGLU experts grouped by expert): the library's code, on SGLang's own tensors, no
copy. SGLang holds the experts fused as the library does (w13 = [gate; up] (E, 2I, H), w2
(E, H, I)); under tensor parallelism each rank holds a share of I, and the result is this
rank's partial sum, which the decoder layer's boundary all-reduces, exactly as for SGLang's
own `FusedMoE`.

Deliberately not here: the model class (see `models/sdar_moe_mrp.py`).

Shapes: T tokens, H hidden, E experts, I expert width (this rank's).
"""

from __future__ import annotations

from typing import Any

import torch

from mrp_dlm.config import BackboneConfig
from mrp_dlm.model.moe import SparseMLP


def library_mlp(block: Any, config: BackboneConfig) -> SparseMLP:
    """The library's sparse MLP whose parameters are `block`'s SGLang tensors."""
    with torch.device("meta"):
        mlp = SparseMLP(config)
    mlp.gate.weight = block.gate.weight  # (E, H)
    mlp.experts.gate_up_proj = block.experts.w13_weight  # (E, 2I, H)
    mlp.experts.down_proj = block.experts.w2_weight  # (E, H, I)
    return mlp


def install(model: Any, config: BackboneConfig) -> int:
    """Make every sparse block of an SGLang SDAR MoE model run the library's sparse MLP;
    returns how many blocks."""
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for block in blocks:
        if block.experts.num_local_experts != block.experts.num_experts:
            raise ValueError("the MoE CPU path runs without expert parallelism (--ep 1)")
        block.forward_normal = library_mlp(block, config).forward  # (T, H) -> (T, H)
    return len(blocks)


def needs_stand_in(device: str) -> bool:
    """Whether SGLang's own CPU MoE path would call a kernel this machine lacks."""
    from sglang.srt.utils import cpu_has_amx_support

    return device == "cpu" and not cpu_has_amx_support()
