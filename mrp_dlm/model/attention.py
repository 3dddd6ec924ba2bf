"""Attention over the block-causal layout: the reference SDPA call and a fused arrangement.

Both take q (B, nh, T, hd), k and v (B, nkv, S, hd) and a boolean mask (B, T, S) (True:
may attend; None: every key) and return (B, nh, T, hd) in q's dtype.

- reference: `F.scaled_dot_product_attention` with the boolean mask and `enable_gqa`. On
  CUDA a mask with GQA can leave only the math kernel, which repeats K and V per query head.
- fused: the g = nh / nkv query heads of a key head are folded into the query length,
  (B, nkv, g*T, hd), so K and V are read once, never repeated, and q, k, v have one head
  count; the mask becomes additive in q's dtype (0 or -inf, (B, 1, g*T, S)) with rows at
  multiples of ALIGN elements, so the mem-efficient kernel takes it without a padded copy.
  On CUDA, SDPA then runs cuDNN (first on Hopper/Blackwell with a recent cuDNN) or
  mem-efficient (float32 too); without a mask, flash. Equal to the reference up to float
  rounding. A long query (prefill: g*T > 2*nkv*hd), where g copies of the mask would
  outweigh K and V, repeats K and V per query head instead.

`attention_path` is the rule: fused on CUDA while no gradient is recorded (training keeps
the reference: a backward would keep the g-times larger mask per layer); `forced_path`
overrides it (tests, the GPU probe); `sdpa_kernel_name` names the SDPA kernel a path runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["ALIGN", "PATHS", "SdpaCall", "arrange", "attend", "attention_path", "forced_path",
           "sdpa_kernel_name"]

PATHS = ("reference", "fused")
ALIGN = 8  # elements: the fused mask's row stride is a multiple of this (mem-efficient's need)
KERNEL_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_forced: str | None = None  # set only by `forced_path`


def attention_path(device: torch.device) -> str:
    """The path attention on `device` runs now: the forced one, else fused on CUDA while no
    gradient is recorded, else the reference."""
    if _forced is not None:
        return _forced
    if device.type == "cuda" and not torch.is_grad_enabled():
        return "fused"
    return "reference"


@contextlib.contextmanager
def forced_path(name: str | None) -> Iterator[None]:
    """Every attention call inside runs path `name` (None: the rule) on any device."""
    global _forced
    if name is not None and name not in PATHS:
        raise ValueError(f"unknown attention path {name!r}; choose one of {', '.join(PATHS)}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


@dataclass(frozen=True)
class SdpaCall:
    """The arguments one path hands to `F.scaled_dot_product_attention`."""

    query: torch.Tensor  # (B, n, T', hd): (nh, T) (reference, long fused); (nkv, g*T) (fused)
    key: torch.Tensor  # (B, nkv, S, hd); (B, nh, S, hd) for a long fused query
    value: torch.Tensor  # as key
    mask: torch.Tensor | None  # bool (B, 1, T, S) or additive (B, 1, T', S); None: all keys
    enable_gqa: bool


def arrange(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            path: str) -> SdpaCall:
    """The SDPA arguments of `path` for q (B, nh, T, hd), k and v (B, nkv, S, hd) and mask
    (B, T, S) bool or None."""
    if path == "reference":
        return SdpaCall(q, k, v, None if mask is None else mask[:, None],
                        enable_gqa=q.shape[1] != k.shape[1])
    if path != "fused":
        raise ValueError(f"unknown attention path {path!r}; choose one of {', '.join(PATHS)}")
    B, nh, T, hd = q.shape
    groups = nh // k.shape[1]
    if mask is not None and groups * T > 2 * k.shape[1] * hd:  # a long query (prefill)
        # g copies of the mask would outweigh K and V repeated per query head
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # (B, nh, S, hd)
        return SdpaCall(q, k, v, additive_mask(mask, 1, q.dtype), enable_gqa=False)
    folded = q.reshape(B, k.shape[1], groups * T, hd)  # (B, nkv, g*T, hd): row j*T + t
    bias = None if mask is None else additive_mask(mask, groups, q.dtype)
    return SdpaCall(folded, k, v, bias, enable_gqa=False)


def additive_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, g*T, S) in `dtype`: 0 where mask (B, T, S) is True, -inf elsewhere, repeated
    for each of the g folded query heads; rows ALIGN-aligned in memory."""
    B, T, S = mask.shape
    width = -(-S // ALIGN) * ALIGN
    bias = torch.full((B, groups, T, width), float("-inf"), dtype=dtype,
                      device=mask.device)  # (B, g, T, W)
    bias[..., :S].masked_fill_(mask[:, None], 0.0)
    return bias.view(B, 1, groups * T, width)[..., :S]  # (B, 1, g*T, S)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           path: str | None = None) -> torch.Tensor:
    """Attention (B, nh, T, hd) of q (B, nh, T, hd) over k, v (B, nkv, S, hd) (nkv divides
    nh; query head h reads key head h // (nh / nkv)) where mask (B, T, S) bool is True
    (None: every key). `path`: "reference" or "fused"; None: `attention_path`'s rule."""
    call = arrange(q, k, v, mask, path or attention_path(q.device))
    y = F.scaled_dot_product_attention(call.query, call.key, call.value, attn_mask=call.mask,
                                       enable_gqa=call.enable_gqa)  # (B, n, T', hd)
    return y.reshape(q.shape)  # (B, nh, T, hd)


def sdpa_kernel_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, path: str | None = None) -> str:
    """The SDPA kernel ("flash", "efficient", "cudnn", "math") that `attend` runs on these
    inputs on this machine, as torch's own dispatcher chooses it (`path` as in `attend`)."""
    call = arrange(q, k, v, mask, path or attention_path(q.device))
    choice = torch._fused_sdp_choice(call.query, call.key, call.value, call.mask, 0.0, False,
                                     enable_gqa=call.enable_gqa)
    return KERNEL_NAMES.get(int(choice), f"backend {int(choice)}")
