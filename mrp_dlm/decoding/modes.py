"""Mode name -> block decoder. The one place that knows every decoding mode."""

from __future__ import annotations

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.denoise import DenoiseDecoder
from mrp_dlm.decoding.driver import BlockDecoder


def make_decoder(config: DecodeConfig) -> BlockDecoder:
    return DenoiseDecoder(config)
