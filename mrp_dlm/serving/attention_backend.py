"""Which SGLang 0.5.23 attention backend `mrp serve` asks for: a pure function of the
device, the dtype, the model's head_dim and whether decode CUDA graphs stay on.

What SGLang's dLLM path does with the flag (`srt/arg_groups/overrides.py`,
`_dllm_attention_backend`): a backend the algorithm class lists in
`supported_attention_backends` is kept; otherwise, with decode CUDA graphs on, it is
replaced by FlashInfer. FlashInfer has no float32 kernels and its prebuilt prefill kernels
take head_dim 64, 128 and 256 only; Triton's extend kernels pad any head_dim to a power of
two and take float32 (`srt/layers/attention/triton_backend.py`, dLLM blocks included); on a
CPU only torch_native runs. So:
- CPU: torch_native (no graphs);
- CUDA, bf16/fp16 and a FlashInfer head_dim: flashinfer, SGLang's own dLLM choice;
- CUDA otherwise (the embedded model: head_dim 32): triton. The MRP algorithms list it
  (`MRP_BACKENDS`, on `base.MrpAlgorithm`), so graphs stay on; SGLang's LowConfidence lists
  nothing, so its decode graphs are turned off, else SGLang would force FlashInfer.

Deliberately not here: the rest of the launch (`launch.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # head_dims FlashInfer's prebuilt kernels take
HALF_DTYPES = ("bfloat16", "float16")  # the dtypes FlashInfer has kernels for
MRP_BACKENDS = ("flashinfer", "triton", "torch_native")  # the MRP algorithms run on these
NO_DECODE_GRAPHS = "--disable-decode-cuda-graph"  # SGLang's flag


@dataclass(frozen=True)
class AttentionChoice:
    backend: str  # SGLang's --attention-backend
    cuda_graphs: bool  # decode CUDA graphs stay on
    reason: str  # why, for the log and `mrp serve`'s startup line

    def flags(self, device: str) -> list[str]:
        graphs = [] if self.cuda_graphs or device == "cpu" else [NO_DECODE_GRAPHS]
        return ["--attention-backend", self.backend] + graphs

    def describe(self) -> str:
        graphs = "" if self.backend == "torch_native" else (
            ", CUDA graphs" if self.cuda_graphs else ", no decode CUDA graphs")
        return f"attention {self.backend}{graphs} ({self.reason})"


def choose_attention(device: str, dtype: str, head_dim: int, cuda_graphs: bool,
                     keeps_backend: bool) -> AttentionChoice:
    """The backend for a model of `head_dim` in `dtype` on `device`; `cuda_graphs`: decode
    graphs asked for; `keeps_backend`: the algorithm lists MRP_BACKENDS (SGLang keeps the
    choice with graphs on)."""
    if device == "cpu":
        return AttentionChoice("torch_native", False, "SGLang's CPU engine")
    if dtype in HALF_DTYPES and head_dim in FLASHINFER_HEAD_DIMS:
        return AttentionChoice("flashinfer", cuda_graphs,
                               f"{dtype}, head_dim {head_dim}: SGLang's dLLM backend")
    lacks = f"FlashInfer has no {dtype} kernels" if dtype not in HALF_DTYPES else \
        f"FlashInfer has no head_dim {head_dim} kernels"
    if cuda_graphs and not keeps_backend:
        return AttentionChoice("triton", False, f"{lacks}; with decode graphs on SGLang "
                                                "would force FlashInfer on this algorithm")
    return AttentionChoice("triton", cuda_graphs, f"{lacks}; Triton takes any head_dim")
