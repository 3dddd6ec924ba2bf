"""Mode name -> block decoder. The one place that knows every decoding mode."""

from __future__ import annotations

from mrp_dlm.config import MRP_MODES, DecodeConfig
from mrp_dlm.decoding.direct import DirectDecoder
from mrp_dlm.decoding.driver import Decoder
from mrp_dlm.decoding.remask import RemaskDecoder
from mrp_dlm.decoding.speculative import SpeculativeDecoder
from mrp_dlm.decoding.strategies import StrategyDecoder
from mrp_dlm.decoding.veto import VetoDecoder
from mrp_dlm.model.head import MRPHead

__all__ = ["make_decoder"]

_MRP_DECODERS = {"direct": DirectDecoder, "speculative": SpeculativeDecoder,
                 "remask": RemaskDecoder}


def make_decoder(config: DecodeConfig, head: MRPHead | None = None) -> Decoder:
    if config.mode not in MRP_MODES:
        return StrategyDecoder(config)
    if config.mode == "speculative":  # without a head (or drafter self): self-drafts only
        return SpeculativeDecoder(config, head if config.uses_head else None)
    if head is None:
        raise ValueError(f"mode {config.mode!r} needs an MRP head (--head DIR)")
    if config.vetoes:
        return VetoDecoder(config, head)
    return _MRP_DECODERS[config.mode](config, head)
