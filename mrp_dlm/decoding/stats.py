"""Counters of one decode call, returned with its tokens (never stashed on a model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mrp_dlm.model.invariant import BIT_EXACT, UP_TO_TIES


@dataclass
class DecodeStats:
    """What a decode cost. Forwards count batched calls, not rows; the other counts are
    summed over rows."""

    prefill_forwards: int = 0  # backbone forwards over the prompts' full blocks
    denoise_forwards: int = 0  # backbone forwards on one block state (a speculative seed too)
    verify_forwards: int = 0  # backbone forwards checking M block states at once
    lone_verify_forwards: int = 0  # of which ran each copy as a lone forward (bit-exact)
    store_forwards: int = 0  # denoise forwards that also wrote the previous block's keys/values
    head_forwards: int = 0  # MRP head forwards (each with one lm_head projection)
    head_store_forwards: int = 0  # head forwards that only wrote finished blocks' head keys
    head_skips: int = 0  # paper remask: steps that ran no head forward (no row had two
    # proposals, so no veto could change a reveal)
    vetoed: int = 0  # remask: proposals sent back to mask
    tokens: int = 0  # generated tokens returned, after stop trimming
    committed: int = 0  # positions revealed by the decoder
    row_forwards: int = 0  # backbone forwards times the rows still generating in each
    row_denoise_forwards: int = 0  # the same for denoise and verify forwards only
    row_query_tokens: int = 0  # block tokens those row forwards ran: L a denoise, M*L a verify
    rounds: int = 0  # speculative rounds (steps with later drafts, verified)
    accepted: int = 0  # later states (after the first) accepted in those rounds
    head_drafts: int = 0  # speculative: head drafts made (that revealed a position)
    head_drafts_accepted: int = 0  # of which accepted
    self_drafts: int = 0  # speculative: self-drafts made (the rule on the seed logits)
    self_drafts_accepted: int = 0  # of which accepted
    rescued: int = 0  # speculative: rounds that kept an alternative after their accepted
    # drafts
    graph_replays: int = 0  # backbone block forwards replayed from a captured CUDA graph
    # (`DecodeConfig.cuda_graphs` on a CUDA device; 0 where the steps ran eager)
    accept_histogram: list[int] = field(default_factory=list)  # rounds by drafts accepted
    seconds: float = 0.0  # wall time of the call

    @property
    def backbone_forwards(self) -> int:
        return self.prefill_forwards + self.denoise_forwards + self.verify_forwards

    @property
    def tokens_per_forward(self) -> float:
        """Tokens per backbone forward of a row, end to end (prefill included).

        Counted per row, so a batch reports what each of its rows got (batch 1: exact).
        """
        return self.tokens / max(self.row_forwards, 1)

    @property
    def tokens_per_denoise_forward(self) -> float:
        """Tokens per denoising backbone forward of a row (denoise and verify only)."""
        return self.tokens / max(self.row_denoise_forwards, 1)

    @property
    def query_tokens_per_forward(self) -> float:
        """Block tokens the backbone ran per denoising forward of a row (L x the copies,
        averaged; L for the rule alone): the verify width the tokens per forward cost."""
        return self.row_query_tokens / max(self.row_denoise_forwards, 1)

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per speculative round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def exactness(self) -> str:
        """What speculation's equality to its rule rests on: bit-exact when every verify ran
        its copies as lone forwards (or none ran), else exact up to float ties."""
        return BIT_EXACT if self.lone_verify_forwards == self.verify_forwards else UP_TO_TIES

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        """Counts of two calls together (e.g. the batches of one evaluation)."""
        total = {key: getattr(self, key) + getattr(other, key) for key in asdict(self)
                 if key != "accept_histogram"}
        width = max(len(self.accept_histogram), len(other.accept_histogram))
        pad = lambda h: h + [0] * (width - len(h))  # noqa: E731
        histogram = [a + b for a, b in zip(pad(self.accept_histogram), pad(other.accept_histogram))]
        return DecodeStats(**total, accept_histogram=histogram)

    def to_dict(self) -> dict:
        return {**asdict(self), "backbone_forwards": self.backbone_forwards,
                "tokens_per_forward": round(self.tokens_per_forward, 4),
                "tokens_per_denoise_forward": round(self.tokens_per_denoise_forward, 4),
                "query_tokens_per_forward": round(self.query_tokens_per_forward, 2),
                "mean_accepted": round(self.mean_accepted, 4), "exactness": self.exactness,
                "tokens_per_second": round(self.tokens_per_second, 2)}
