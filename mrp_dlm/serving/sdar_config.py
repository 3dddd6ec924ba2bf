"""SDAR's Hugging Face config: Qwen3's, under model_type `sdar` (SDAR is Qwen3 layers).

Registered with transformers by the plugin when no `sdar` config is known, so SDAR
checkpoints without custom code (ours) load in SGLang without --trust-remote-code. It
lives at module level because SGLang pickles configs into its subprocesses.

transformers 5 moves `rope_theta` into `rope_parameters`, but SGLang's SDAR model reads
`config.rope_theta` (and silently falls back to 10000, a different model): the attribute
is restored from `rope_parameters` here.

Deliberately not here: anything else about the model (see `models/sdar_mrp.py`).
"""

from transformers import Qwen3Config


class SDARConfig(Qwen3Config):
    model_type = "sdar"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        rope = getattr(self, "rope_parameters", None) or {}
        if getattr(self, "rope_theta", None) is None and "rope_theta" in rope:
            self.rope_theta = rope["rope_theta"]
