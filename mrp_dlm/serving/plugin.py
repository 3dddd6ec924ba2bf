"""The SGLang plugin entry point (`sglang.srt.plugins`: `mrp = mrp_dlm.serving.plugin:load`).

SGLang calls `load()` in every one of its processes before it resolves server arguments.
It then
- registers `MrpSpeculative`, `MrpDirect` and `MrpRemask` in SGLang's algorithm registry (a module
  dict read at call time), so `--dllm-algorithm MrpSpeculative` finds them;
- points SGLANG_EXTERNAL_MODEL_PACKAGE at `mrp_dlm.serving.models`, so our
  `SDARForCausalLM` and `SDARMoeForCausalLM` (SGLang's, plus the head, hidden states and
  SUBS) serve SDAR checkpoints; it must be set before SGLang's model registry is imported;
- wraps `DllmConfig.from_server_args` so that, for SDAR, the block size and the mask id
  come from the YAML, else from the model's config.json, else from SGLang's table (SGLang
  alone always takes mask 151669, which is wrong for any model with its own mask id);
- registers model_types `sdar` and `sdar_moe` with transformers as Qwen3's and Qwen3-MoE's
  configs (SDAR is Qwen3 layers), so SDAR checkpoints without custom code (ours) load
  without --trust-remote-code;
- hooks `ForwardBatch.init_new` to attach each batch's per-request sampling parameters and
  seeds (`sampling.py`), which `MrpSpeculative` samples with;
- hooks the scheduler's dLLM result processing to count the serving stats of
  MrpSpeculative, MrpDirect and LowConfidence on SDAR models (`stats.py`: log and metrics);
- hooks the OpenAI endpoints so `--preferred-sampling-params` applies to the fields a
  request leaves out, as it does on `/generate` (`request_defaults.py`);
- hooks SGLang's per-token KV size (`DefaultPoolConfigurator._compute_cell_size`) to add
  the head's keys and values per token when an MRP algorithm serves, so that the KV pool
  SGLang sizes from free memory leaves room for the head's pool (`head_pool.py`: one row
  per KV slot).
Nothing of SGLang is patched on disk. Importing this module imports no SGLang code.

Deliberately not here: the algorithms and the model class.
"""

from __future__ import annotations

import logging
import os

from mrp_dlm.serving.request_defaults import register_request_defaults
from mrp_dlm.serving.stats import register_stats_hook

log = logging.getLogger(__name__)

MODELS_PACKAGE = "mrp_dlm.serving.models"
ALGORITHMS = ("MrpSpeculative", "MrpDirect", "MrpRemask")  # the names `--dllm-algorithm` takes
HEAD_KEY_ALGORITHMS = ("MrpSpeculative", "MrpDirect")  # keep the head's keys of earlier blocks


def load() -> None:
    """Register the algorithms, the model package and the hooks (SGLang calls this once per
    process, before it resolves server arguments or imports its model registry)."""
    existing = os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE")
    if existing and existing != MODELS_PACKAGE:
        log.warning("SGLANG_EXTERNAL_MODEL_PACKAGE=%s is set; the MRP model class is not "
                    "registered, so the MRP algorithms will refuse to run", existing)
    else:
        os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = MODELS_PACKAGE
    register_algorithms()
    register_block_facts_hook()
    register_sampling_hook()
    register_sdar_config()
    register_stats_hook()
    register_request_defaults()
    register_head_pool_hook()


def register_algorithms() -> None:
    from sglang.srt.dllm import algorithm as registry

    from mrp_dlm.serving.direct import MrpDirect
    from mrp_dlm.serving.remask import MrpRemask
    from mrp_dlm.serving.speculative import MrpSpeculative

    algorithms = {cls.__name__: cls for cls in (MrpSpeculative, MrpDirect, MrpRemask)}
    assert tuple(algorithms) == ALGORITHMS
    registry.algo_name_to_cls.update(algorithms)


def register_sdar_config() -> None:
    from transformers import AutoConfig

    from mrp_dlm.serving.sdar_config import SDARConfig, SDARMoeConfig

    for config in (SDARConfig, SDARMoeConfig):
        try:
            AutoConfig.for_model(config.model_type)
        except ValueError:
            AutoConfig.register(config.model_type, config)


def register_block_facts_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.dllm.config.DllmConfig.from_server_args",
                          block_facts_hook, HookType.AFTER)


def register_sampling_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from mrp_dlm.serving.sampling import FORWARD_BATCH_INIT, attach_sampling

    HookRegistry.register(FORWARD_BATCH_INIT, attach_sampling, HookType.AFTER)


def block_facts_hook(result, server_args, *args, **kwargs):
    """After SGLang's own DllmConfig: block size and mask id for SDAR from YAML/config."""
    if result is None:
        return result
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig

    from mrp_dlm.serving.config import is_sdar, read_yaml, resolve_block_facts

    cfg = resolving_view(server_args)
    model_config = ModelConfig.from_server_args(server_args, model_path=cfg.model_path,
                                                model_revision=cfg.revision)
    if not is_sdar(model_config.hf_config):
        return result
    facts = resolve_block_facts(read_yaml(cfg.dllm_algorithm_config), model_config.hf_config)
    # `mask_id` is SGLang's DllmConfig field (its algorithms and requests read it): not ours
    result.block_size, result.mask_id = facts.block_size, facts.mask_token_id
    return result


CELL_SIZE = ("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator."
             "_compute_cell_size")


def register_head_pool_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(CELL_SIZE, head_cell_size_hook, HookType.AFTER)


def head_cell_size_hook(result, configurator, kvc, *args, **kwargs):
    """After SGLang's KV bytes per token: plus the MRP head's (its pool has a row per slot)."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    from mrp_dlm.model.release import head_layer_count
    from mrp_dlm.serving.config import load_serving_config
    from mrp_dlm.serving.head_pool import head_bytes_per_token

    dllm = get_exec().dllm
    if result is None or dllm.dllm_algorithm not in HEAD_KEY_ALGORITHMS or kvc.is_draft_worker:
        return result
    directory = load_serving_config(dllm.dllm_algorithm_config).head_directory()
    if directory is None:  # MrpSpeculative without a head: no head pool
        return result
    # The head directory is a saved head or a release (whose config is the backbone's).
    layers = head_layer_count(directory)
    model = kvc.model_config
    # per TP rank: its share of the head's kv heads, as SGLang's own per-token size
    tp = get_parallel().tp_size
    extra = head_bytes_per_token(layers, model.get_num_kv_heads(tp), model.head_dim, model.dtype)
    log.info("KV bytes per token: %d for the backbone + %d for the MRP head's %d layers",
             result, extra, layers)
    return result + extra
