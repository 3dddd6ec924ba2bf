"""mrp-dlm: fast decoding for block-diffusion language models (SDAR) with Multi-token
Residual Prediction. Start with `mrp_dlm.pipeline.Pipeline` or the `mrp` command."""

__version__ = "0.2.0"  # the one version (pyproject.toml reads it); CHANGELOG.md says what changed
