"""Torch device names -> the devices this machine has, or an error that lists them.

`torch.device("foo")` raises a RuntimeError listing two dozen backends, and a CUDA device
on a CPU-only PyTorch fails only when the first tensor moves, with an AssertionError. Both
become one ValueError here that names the device and what is available.

Deliberately not here: dtypes (see `loading.DTYPES`) and thread settings.
"""

from __future__ import annotations

import torch

SUPPORTED_TYPES = ("cpu", "cuda", "mps")  # device types mrp-dlm runs on


def available_devices() -> list[str]:
    """The device names this machine accepts: cpu, then cuda:N for each GPU, then mps."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def unavailable_reason(device: torch.device) -> str | None:
    """Why this machine cannot run on `device`; None when it can."""
    if device.type not in SUPPORTED_TYPES:
        return f"mrp-dlm runs on {', '.join(SUPPORTED_TYPES[:-1])} or {SUPPORTED_TYPES[-1]}"
    if device.type == "cuda" and torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) was built without CUDA"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        return None if index < count else f"this machine has {count} CUDA device(s)"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available on this machine"
    return None


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device `name` names, if this machine has it; ValueError otherwise."""
    available = ", ".join(available_devices())
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(name)!r}; available: {available}") from None
    reason = unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"device {str(name)!r} is not available: {reason}; "
                         f"available: {available}")
    return device
