"""The attention part of `benchmarks/gpu_probe.py`: each SDPA kernel forced on our mask layout.

Not a test (never collected by pytest). One case is a verify (or, with M = 1, denoise)
forward's attention: queries (B, nh, M*L, hd) of M block copies against every cache slot
(B, nkv, S, hd), with the library's own mask (`model/masks.py` copies_mask: each copy sees
the valid cached prefix and itself; rows left-padded by whole blocks, as the driver lays
them out). Every arrangement computes the same attention:
- bool_gqa: a boolean mask and `enable_gqa`, as `model/backbone.py` calls SDPA today;
- bool_expanded / float_expanded: K/V repeated to nh heads, a boolean / additive float mask;
- bool_folded / float_folded: the query-head groups folded into the query length (queries
  (B, nkv, G*M*L, hd), the mask repeated G times), K/V left at nkv heads;
- flex: `flex_attention` with a block mask from the same boolean mask (compiled on CUDA,
  one case only: each compiles anew);
- fused: the library's fused path (`ATTENTION_MODULE` in gpu_probe.py), when present.
Each SDPA arrangement runs under every backend forced with `sdpa_kernel` (and unforced);
a row says whether it ran, its time and its largest difference from float32 math.

Shapes: B batch, nh/nkv heads, G = nh / nkv, L block, M copies, T = M*L queries, S slots.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mrp_dlm.decoding.driver import SLOT_BUCKET
from mrp_dlm.model.masks import copies_mask
from probe_timing import SKIP_NO_CUDA, device_ms, why

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH}


@dataclass(frozen=True)
class Case:
    """One attention call's inputs."""

    q: torch.Tensor  # (B, nh, T, hd)
    k: torch.Tensor  # (B, nkv, S, hd)
    v: torch.Tensor  # (B, nkv, S, hd)
    mask: torch.Tensor  # (B, T, S) bool, True = may attend

    @property
    def groups(self) -> int:
        return self.q.shape[1] // self.k.shape[1]


def make_case(heads: tuple[int, int, int], batch: int, block: int, copies: int, prefix: int,
              dtype: torch.dtype, device: str) -> Case:
    """Random q, k, v and the real mask of M copies of a block at slot `prefix`; row b is
    left-padded by (b mod 4) blocks."""
    nh, nkv, hd = heads
    T = copies * block
    slots = -(-(prefix + T) // SLOT_BUCKET) * SLOT_BUCKET
    pads = (torch.arange(batch) % 4 * block).clamp_max(prefix)  # (B,)
    key_valid = (torch.arange(slots)[None] >= pads[:, None]).to(device)  # (B, S)
    generator = torch.Generator(device="cpu").manual_seed(batch * 100 + copies)
    draw = lambda *shape: torch.randn(shape, generator=generator).to(device, dtype)  # noqa: E731
    return Case(q=draw(batch, nh, T, hd), k=draw(batch, nkv, slots, hd),
                v=draw(batch, nkv, slots, hd),
                mask=copies_mask(key_valid, prefix, block, copies, slots))  # (B, T, S)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where True, -inf where False, in `dtype`."""
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, float("-inf"))


def expanded(case: Case, float_mask: bool) -> Callable:
    k = case.k.repeat_interleave(case.groups, dim=1)  # (B, nh, S, hd)
    v = case.v.repeat_interleave(case.groups, dim=1)  # (B, nh, S, hd)
    mask = additive(case.mask, case.q.dtype) if float_mask else case.mask
    return lambda: F.scaled_dot_product_attention(case.q, k, v, attn_mask=mask[:, None])


def folded(case: Case, float_mask: bool) -> Callable:
    B, nh, T, hd = case.q.shape
    nkv = case.k.shape[1]
    q = case.q.reshape(B, nkv, case.groups * T, hd)  # (B, nkv, G*T, hd): head h = kv*G + g
    mask = case.mask.repeat(1, case.groups, 1)  # (B, G*T, S)
    mask = additive(mask, case.q.dtype) if float_mask else mask

    def call() -> torch.Tensor:
        y = F.scaled_dot_product_attention(q, case.k, case.v, attn_mask=mask[:, None])
        return y.reshape(B, nh, T, hd)  # (B, nh, T, hd)
    return call


def flex(case: Case, compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = case.mask
    B, _, T, _ = case.q.shape
    block_mask = create_block_mask(lambda b, h, q, k: mask[b, q, k], B, None, T,
                                   mask.shape[2], device=str(mask.device))
    attend = torch.compile(flex_attention) if compiled else flex_attention

    def call() -> torch.Tensor:
        with warnings.catch_warnings():  # eager flex (a CPU) warns that it is unfused
            warnings.simplefilter("ignore", UserWarning)
            return attend(case.q, case.k, case.v, block_mask=block_mask, enable_gqa=True)
    return call


def arrangements(case: Case) -> dict[str, Callable]:
    """The SDPA arrangements, each forced under every backend."""
    return {"bool_gqa": lambda: F.scaled_dot_product_attention(
                case.q, case.k, case.v, attn_mask=case.mask[:, None], enable_gqa=True),
            "bool_expanded": expanded(case, False), "float_expanded": expanded(case, True),
            "bool_folded": folded(case, False), "float_folded": folded(case, True)}


def reference(case: Case) -> torch.Tensor:
    """(B, nh, T, hd) float32 attention by the math backend, the rows' yardstick."""
    k, v = (x.float().repeat_interleave(case.groups, dim=1) for x in (case.k, case.v))
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(case.q.float(), k, v, attn_mask=case.mask[:, None])


def measure(call: Callable, backend: SDPBackend | None, truth: torch.Tensor, device: str,
            repeats: int) -> dict:
    """{"works", "ms", "max_abs_err", "first_call_s"} of one call under one forced backend
    (None: unforced); max_abs_err against float32 math."""
    def forced() -> torch.Tensor:
        if backend is None:
            return call()
        with sdpa_kernel(backend):
            return call()
    began = time.perf_counter()
    try:
        error = (forced().float() - truth).abs().max().item()  # the first call: plans, compiles
        first = round(time.perf_counter() - began, 3)
        return dict(works=True, ms=round(device_ms(forced, device, repeats), 4),
                    max_abs_err=round(error, 6), first_call_s=first)
    except Exception as failure:  # noqa: BLE001 (a kernel that refuses is a result)
        return dict(works=False, ms=why(failure), max_abs_err=None, first_call_s=None)


def case_rows(case: Case, device: str, repeats: int, fused: Callable | None,
              with_flex: bool) -> list[dict]:
    """Every arrangement under every backend, then flex (`with_flex`) and the fused path,
    on one case."""
    truth = reference(case)
    rows = [dict(arrangement=name, backend=backend_name)
            | measure(call, backend, truth, device, repeats)
            for name, call in arrangements(case).items()
            for backend_name, backend in BACKENDS.items()]
    if with_flex:
        rows.append(flex_row(case, truth, device, repeats))
    if fused is None:
        rows.append(dict(arrangement="fused", backend="-", works=False, ms="absent",
                         max_abs_err=None))
    else:
        call = lambda: fused(case.q, case.k, case.v, case.mask)  # noqa: E731
        rows.append(dict(arrangement="fused", backend=fused_kernel(case))
                    | measure(call, None, truth, device, repeats))
    return rows


def fused_kernel(case: Case) -> str:
    """The SDPA kernel PyTorch picks for the fused path's call ("flash", "cudnn"...)."""
    try:
        from mrp_dlm.model.attention import sdpa_kernel_name
        return sdpa_kernel_name(case.q, case.k, case.v, case.mask, path="fused")
    except Exception as failure:  # noqa: BLE001 (a private chooser may be missing)
        return f"unknown ({why(failure)})"


def flex_row(case: Case, truth: torch.Tensor, device: str, repeats: int) -> dict:
    try:
        flex_call = flex(case, compiled=device.startswith("cuda"))
        return dict(arrangement="flex", backend="compiled" if device.startswith("cuda")
                    else "eager") | measure(flex_call, None, truth, device, repeats)
    except Exception as failure:  # noqa: BLE001 (building the block mask failed)
        return dict(arrangement="flex", backend="-", works=False, ms=why(failure),
                    max_abs_err=None, first_call_s=None)


def note_for(device: str) -> str:
    return ("times: CUDA events, median" if device.startswith("cuda")
            else f"times: wall clock on a CPU (CUDA-only kernels refuse; events {SKIP_NO_CUDA})")
