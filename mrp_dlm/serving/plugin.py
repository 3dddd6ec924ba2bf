"""The SGLang plugin entry point (`sglang.srt.plugins`: `mrp = mrp_dlm.serving.plugin:load`),
and what the plugin serves: its algorithms and model architectures, registered here only.

SGLang calls `load()` in every one of its processes before it resolves server arguments.
On any SGLang but the one the plugin is written against it logs one line and registers
nothing, so SGLang's own models and algorithms serve as usual. Otherwise it
- registers `MrpSpeculative`, `MrpDirect` and `MrpRemask` in SGLang's algorithm registry;
- points SGLang's external model package at `mrp_dlm.serving.models` (our model classes,
  `sglang_forward.MrpModel` on SGLang's own);
- registers model_types `sdar` and `sdar_moe` with transformers as Qwen3's and Qwen3-MoE's
  configs, so SDAR checkpoints without custom code load without --trust-remote-code;
- registers the hooks of `sglang_process.HOOKS`, each acting only where an MRP algorithm
  serves an MRP architecture (`block_facts`, `head_bytes`, and the adapters there); the
  stats also count `LowConfidence` on those models, the baseline `mrp serve` offers.
Nothing of SGLang is patched on disk. Importing this module imports no SGLang code.

Deliberately not here: the algorithms, the model classes, SGLang's names (the doors
`sglang_process.py` and `sglang_forward.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from mrp_dlm.serving import sglang_process as door

if TYPE_CHECKING:
    from mrp_dlm.serving.config import BlockFacts

log = logging.getLogger(__name__)

MODELS_PACKAGE = "mrp_dlm.serving.models"
ALGORITHMS = ("MrpSpeculative", "MrpDirect", "MrpRemask")  # the names `--dllm-algorithm` takes
HEAD_KEY_ALGORITHMS = ("MrpSpeculative", "MrpDirect")  # keep the head's keys of earlier blocks
MRP_ARCHITECTURES = tuple(door.MODEL_BASES)  # the model classes of `models/`, by name


def load() -> bool:
    """Register the algorithms, the model package and the hooks (SGLang calls this once per
    process, before it resolves server arguments or imports its model registry); False,
    having registered nothing, on an SGLang version the plugin is not written against."""
    if not door.supported():
        log.warning(door.unsupported_message(door.sglang_version()))
        return False
    door.use_model_package(MODELS_PACKAGE)
    register_algorithms()
    register_sdar_config()
    door.register_hooks()
    return True


def register_algorithms() -> None:
    from mrp_dlm.serving.direct import MrpDirect
    from mrp_dlm.serving.remask import MrpRemask
    from mrp_dlm.serving.speculative import MrpSpeculative

    algorithms = {cls.__name__: cls for cls in (MrpSpeculative, MrpDirect, MrpRemask)}
    assert tuple(algorithms) == ALGORITHMS
    door.register_algorithms(algorithms)


def register_sdar_config() -> None:
    from transformers import AutoConfig

    from mrp_dlm.serving.sdar_config import SDARConfig, SDARMoeConfig

    for config in (SDARConfig, SDARMoeConfig):
        try:
            AutoConfig.for_model(config.model_type)
        except ValueError:
            AutoConfig.register(config.model_type, config)


def is_mrp_architecture(hf_config: Any) -> bool:
    """Whether a Hugging Face config is of an MRP architecture (SDAR, dense or MoE)."""
    architectures = getattr(hf_config, "architectures", None) or []
    return architectures[:1] in [[name] for name in MRP_ARCHITECTURES]


def block_facts(hf_config: Any, yaml_path: Optional[str]) -> Optional["BlockFacts"]:
    """Block size and mask id of an MRP architecture: the YAML's, else the model's
    config.json, else SGLang's table (which alone gives mask 151669, wrong for a model with
    its own mask id); None for any other model (SGLang's own facts stand)."""
    from mrp_dlm.serving.config import read_yaml, resolve_block_facts

    if not is_mrp_architecture(hf_config):
        return None
    return resolve_block_facts(read_yaml(yaml_path), hf_config)


def head_bytes(yaml_path: Optional[str], num_kv_heads: int, head_dim: int, dtype: Any,
               backbone_bytes: int) -> int:
    """KV bytes per token the MRP head's pool adds (one row per KV slot, `head_pool.py`)
    when one of HEAD_KEY_ALGORITHMS serves: 0 without a head."""
    from mrp_dlm.model.release import head_layer_count
    from mrp_dlm.serving.config import load_serving_config
    from mrp_dlm.serving.head_pool import head_bytes_per_token

    directory = load_serving_config(yaml_path).head_directory()
    if directory is None:  # MrpSpeculative without a head: no head pool
        return 0
    layers = head_layer_count(directory)  # a saved head or a release
    extra = head_bytes_per_token(layers, num_kv_heads, head_dim, dtype)
    log.info("KV bytes per token: %d for the backbone + %d for the MRP head's %d layers",
             backbone_bytes, extra, layers)
    return extra
