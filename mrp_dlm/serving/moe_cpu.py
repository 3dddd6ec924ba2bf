"""Qwen3-MoE's sparse MLP for SGLang's SDAR MoE blocks on a CPU without SGLang's CPU
kernels: the library's own `SparseMLP` over SGLang's weight tensors.

SGLang 0.5.23 cannot run an MoE layer on such a CPU: without AMX its router calls
`topk_softmax`, which `sglang/srt/layers/moe/topk.py` imports only on CUDA, HIP and XPU
(`NameError: name 'topk_softmax' is not defined`); with AMX it calls `sgl_kernel`'s CPU
kernels, which have no build here (`cpu_standins.py`). There the plugin's MoE model gives
every sparse block (`sglang_process.replace_moe_blocks`, the door) the forward of
`model/moe.py`'s `SparseMLP` (softmax over the experts in float32, top-k, renormalised
when `norm_topk_prob`, cast to the activation dtype, SwiGLU experts grouped by expert):
the library's code, on SGLang's own tensors, no copy. SGLang holds the experts fused as
the library does (w13 = [gate; up] (E, 2I, H), w2 (E, H, I)); under tensor parallelism
each rank holds a share of I, and the result is this rank's partial sum, which the decoder
layer's boundary all-reduces, exactly as for SGLang's own `FusedMoE`.

Deliberately not here: the model class (see `models/sdar_moe_mrp.py`), SGLang's names.

Shapes: T tokens, H hidden, E experts, I expert width (this rank's).
"""

from __future__ import annotations

import torch

from mrp_dlm.config import BackboneConfig
from mrp_dlm.model.moe import SparseMLP


def library_mlp(router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                config: BackboneConfig) -> SparseMLP:
    """The library's sparse MLP whose parameters are the given tensors (shared, no copy):
    router (E, H), gate_up (E, 2I, H), down (E, H, I)."""
    with torch.device("meta"):
        mlp = SparseMLP(config)
    mlp.gate.weight = router
    mlp.experts.gate_up_proj = gate_up
    mlp.experts.down_proj = down
    return mlp
