"""What `mrp serve` takes (`ServeConfig`) and how it refuses (`ServeError`).

Light to import (no torch, no SGLang): the CLI builds `mrp serve`'s flags from this class
and answers `--help` and argument errors without importing torch.

Deliberately not here: what the config turns into (the SGLang command, see `launch.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mrp_dlm.config import REMASK_RULES, DecodeConfig
from mrp_dlm.serving.plugin import ALGORITHMS as MRP_ALGORITHMS

ALGORITHMS = (*MRP_ALGORITHMS, "LowConfidence")  # what `mrp serve --algorithm` takes
HOST = "127.0.0.1"  # the server listens on this machine only


class ServeError(ValueError):
    """A serve request that cannot run, with a message that says what to do."""


@dataclass(frozen=True)
class ServeConfig:
    """What `mrp serve` takes; everything else it chooses."""

    model: str | None = field(default=None, metadata={"help": (
        "checkpoint directory (HF format); unset: the embedded model")})
    head: str | None = field(default=None, metadata={"help": (
        "MRP head directory; unset: the embedded head with the embedded model")})
    algorithm: str = field(default="MrpSpeculative", metadata={"help": (
        "MrpSpeculative (lossless), MrpDirect, MrpRemask (--remask-rule) or LowConfidence")})
    threshold: float | None = field(default=None, metadata={"help": (
        "the rule MrpSpeculative reproduces, LowConfidence runs (1.0: static); unset: mrp "
        "generate's")})
    lookahead: int = field(default=DecodeConfig.lookahead, metadata={"help": (
        "K: head drafts per round (speculative), commits per forward (direct)")})
    adaptive: bool = field(default=DecodeConfig.adaptive, metadata={"help": (
        "MrpSpeculative: run only the head drafts that pay")})
    remask_rule: str = field(default=DecodeConfig.remask_rule, metadata={"help": (
        "MrpRemask: chain (each reveal kept while the head, run on the reveals before it, "
        "still finds it above threshold) or paper (the v2 paper's residual veto)")})
    remask_delta: float = field(default=DecodeConfig.remask_delta, metadata={"help": (
        "MrpRemask, paper rule: δ, a proposal whose |C| at its token exceeds it goes back to "
        "mask")})
    tp: int = field(default=1, metadata={"help": (
        "tensor-parallel size: the backbone and the head split over this many GPUs (or CPU "
        "processes)")})
    port: int = field(default=30000, metadata={"help": "HTTP port on 127.0.0.1"})
    device: str = field(default="auto", metadata={"help": (
        "cpu or cuda; auto: cuda when this machine has one, else cpu")})
    revision: str | None = field(default=None, metadata={"help": (
        "branch, tag or commit of a hub id (org/name) --model; unset: main")})
    head_revision: str | None = field(default=None, metadata={"help": (
        "branch, tag or commit of a hub id --head; unset: main")})

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ServeError(f"unknown algorithm {self.algorithm!r}; choose one of "
                             f"{', '.join(ALGORITHMS)}")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ServeError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.lookahead < 1:
            raise ServeError(f"lookahead must be >= 1, got {self.lookahead}")
        if self.tp < 1:
            raise ServeError(f"tp must be >= 1, got {self.tp}")
        if not 0 < self.port < 65536:
            raise ServeError(f"port must be in 1..65535, got {self.port}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ServeError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.algorithm == "MrpDirect" and self.threshold is not None:
            raise ServeError("MrpDirect takes no threshold (it commits the static pick and K "
                             "head picks per forward); --threshold is for MrpSpeculative and "
                             "LowConfidence")
        if self.remask_rule not in REMASK_RULES:
            raise ServeError(f"unknown remask rule {self.remask_rule!r}; choose one of "
                             f"{', '.join(REMASK_RULES)}")
        if self.remask_delta < 0:
            raise ServeError(f"remask_delta must be >= 0, got {self.remask_delta}")
        if self.algorithm == "LowConfidence" and self.head is not None:
            raise ServeError("LowConfidence uses no MRP head; leave out --head")

    @property
    def rule_threshold(self) -> float:
        """The threshold of the rule MrpSpeculative reproduces and LowConfidence runs."""
        return DecodeConfig.threshold if self.threshold is None else self.threshold
