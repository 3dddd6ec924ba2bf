"""Counters of one decode call, returned with its tokens (never stashed on a model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DecodeStats:
    """What a decode cost. Forwards count batched backbone calls, not rows."""

    prefill_forwards: int = 0  # forwards over the prompts' full blocks
    denoise_forwards: int = 0  # forwards that propose tokens for the current block
    store_forwards: int = 0  # forwards that write a finished block's keys and values
    tokens: int = 0  # generated tokens returned, summed over rows, after stop trimming
    committed: int = 0  # positions revealed by the decoder, summed over rows
    seconds: float = 0.0  # wall time of the call

    @property
    def backbone_forwards(self) -> int:
        return self.prefill_forwards + self.denoise_forwards + self.store_forwards

    @property
    def tokens_per_forward(self) -> float:
        """Returned tokens per backbone forward, end to end (prefill and store included)."""
        return self.tokens / max(self.backbone_forwards, 1)

    @property
    def tokens_per_denoise_forward(self) -> float:
        return self.tokens / max(self.denoise_forwards, 1)

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        """Counts of two calls together (e.g. the batches of one evaluation)."""
        return DecodeStats(**{key: getattr(self, key) + getattr(other, key)
                              for key in asdict(self)})

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "backbone_forwards": self.backbone_forwards,
                "tokens_per_forward": round(self.tokens_per_forward, 4),
                "tokens_per_denoise_forward": round(self.tokens_per_denoise_forward, 4),
                "tokens_per_second": round(self.tokens_per_second, 2)}
