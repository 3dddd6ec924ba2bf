"""SDAR's Hugging Face configs: Qwen3's under model_type `sdar` (SDAR is Qwen3 layers) and
Qwen3-MoE's under `sdar_moe` (SDAR-30B-A3B).

Registered with transformers by the plugin when no such config is known, so SDAR
checkpoints without custom code (ours) load in SGLang without --trust-remote-code. They
live at module level because SGLang pickles configs into its subprocesses.

transformers 5 moves `rope_theta` into `rope_parameters`, but SGLang's SDAR models read
`config.rope_theta` (and silently fall back to 10000, a different model): the attribute
is restored from `rope_parameters` here.

Deliberately not here: anything else about the models (see `models/`).
"""

from transformers import Qwen3Config, Qwen3MoeConfig


def restore_rope_theta(config) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_theta", None) is None and "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]


class SDARConfig(Qwen3Config):
    model_type = "sdar"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        restore_rope_theta(self)


class SDARMoeConfig(Qwen3MoeConfig):
    model_type = "sdar_moe"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        restore_rope_theta(self)
