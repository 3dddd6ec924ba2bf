"""The process door: where SGLang's processes call the plugin, and what it reads there.

- the version gate (`supported`, `check_version`): SGLang 0.5.23 only;
- SGLang's registries: the dLLM algorithms and the external model package;
- the nine hooks (`HOOKS`: target -> adapter, `HookType`); each adapter reads SGLang's
  objects (server args, the pool configurator, a ScheduleBatch, the scheduler, its
  requests, OpenAI request models) into plain values for the plugin's own functions;
- the runtime context (`served_algorithm`, `tensor_parallel_size`), launch-time server
  args (`launch_args`), SGLang's server main (`run_server`), the SGLang model classes
  ours extend (`MODEL_BASES`), and the one name of its platform stub module the CPU
  stand-ins use (`triton_mock_finder`);
- the tensor-parallel group's collectives (the head's all-reduces, the vocabulary gather,
  the timings' max) and SGLang's MoE blocks, which `moe_cpu.py` runs on a CPU.
The other door is `sglang_forward.py` (one dLLM forward). docs/serving.md lists every
touch with the SGLang file it mirrors; tests/serving/test_door.py resolves each one.
Importing this module imports neither SGLang nor torch (the CPU stand-ins import it at
interpreter start); every SGLang import is inside the function that needs it.

Deliberately not here: what the hooks decide (`plugin.py`, `sampling.py`, `stats.py`,
`request_defaults.py`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

SUPPORTED_SGLANG = ("0.5.23",)
MODEL_PACKAGE_VARIABLE = "SGLANG_EXTERNAL_MODEL_PACKAGE"  # SGLang's external model package
MODEL_BASES = {  # each MRP architecture -> the SGLang module of its model class (our base)
    "SDARForCausalLM": "sglang.srt.models.sdar",
    "SDARMoeForCausalLM": "sglang.srt.models.sdar_moe",
}
SEED_ATTRIBUTE = "mrp_sampling_seed"  # on a Req: the fresh seed of a request sent without one
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants: /health_generate's requests
WARMUP_TEXT = "The capital city of France is"  # what SGLang's server warm-up decodes
WARMUP_MAX_NEW_TOKENS = 8  # and how many tokens it asks for (http_server._execute_server_warmup)


class UnsupportedSGLang(RuntimeError):
    pass


def sglang_version() -> Optional[str]:
    """The installed SGLang's version ("unknown" without one), None when not installed."""
    if importlib.util.find_spec("sglang") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def unsupported_message(version: Optional[str]) -> str:
    return (f"the mrp-dlm SGLang plugin is written against SGLang "
            f"{' / '.join(SUPPORTED_SGLANG)} internals and found SGLang {version}: it registers "
            "nothing (SGLang's own models and algorithms serve as usual). Install "
            "mrp-dlm[sglang], which pins the version.")


def supported() -> bool:
    return sglang_version() in SUPPORTED_SGLANG


def check_version() -> None:
    if not supported():
        raise UnsupportedSGLang(unsupported_message(sglang_version()))


def plugin_registered(name: str) -> bool:
    """Whether an installed package registers SGLang plugin `name` (its entry point group)."""
    from importlib.metadata import entry_points

    return name in {ep.name for ep in entry_points(group="sglang.srt.plugins")}


# ---- registries ------------------------------------------------------------------------

def register_algorithms(classes: dict[str, type]) -> None:
    """Into the registry `--dllm-algorithm` reads (sglang/srt/dllm/algorithm/__init__.py)."""
    from sglang.srt.dllm import algorithm as registry

    registry.algo_name_to_cls.update(classes)


def use_model_package(package: str) -> bool:
    """Point SGLang's model registry at `package` (before SGLang imports the registry);
    False, with a warning, when the variable names another package already."""
    existing = os.environ.get(MODEL_PACKAGE_VARIABLE)
    if existing and existing != package:
        log.warning("%s=%s is set; the MRP model class is not registered, so the MRP "
                    "algorithms will refuse to run", MODEL_PACKAGE_VARIABLE, existing)
        return False
    os.environ[MODEL_PACKAGE_VARIABLE] = package
    return True


# ---- runtime context and server args ---------------------------------------------------

def served_algorithm() -> tuple[Optional[str], Optional[str]]:
    """(the server's --dllm-algorithm, its --dllm-algorithm-config); (None, None) outside a
    server process (runtime context not published)."""
    from sglang.srt.runtime_context import get_exec

    try:
        dllm = get_exec().dllm
    except ValueError:
        return None, None
    return dllm.dllm_algorithm, dllm.dllm_algorithm_config


def tensor_parallel_size() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_size


# ---- the tensor-parallel group (SGLang's, sglang/srt/distributed/parallel_state.py) -----

def tensor_parallel_rank() -> tuple[int, int]:
    """(this rank, the TP world size)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return group.rank_in_group, group.world_size


def gather_vocab(shard: Any) -> Any:
    """Every TP rank's (..., V_shard) concatenated along the last dim."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    return get_tp_group().all_gather(shard.contiguous(), dim=-1)


def all_reduce(partial: Any) -> Any:
    """The sum over the TP ranks of each rank's partial (..., H)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    return get_tp_group().all_reduce(partial)


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's max over the TP ranks (on the host: the group's gloo side)."""
    import torch
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return values
    agreed = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX,
                                 group=group.cpu_group)
    return agreed.tolist()


# ---- SGLang's MoE blocks (sglang/srt/models/sdar_moe.py, layers/moe/) --------------------

def cpu_lacks_moe_kernels(device: str) -> bool:
    """Whether SGLang's own CPU MoE path would call a kernel this machine lacks (without
    AMX its router calls `topk_softmax`, imported only on CUDA, HIP and XPU)."""
    from sglang.srt.utils import cpu_has_amx_support

    return device == "cpu" and not cpu_has_amx_support()


def replace_moe_blocks(model: Any, mlp_of: Callable[..., Any]) -> int:
    """Every sparse block of an SGLang MoE model runs `mlp_of(router (E, H), gate_up
    (E, 2I, H), down (E, H, I))` (SGLang's own tensors) instead of its kernels; returns
    how many blocks. Under TP each rank's I is its share; the layer all-reduces after."""
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for block in blocks:
        experts = block.experts
        if experts.num_local_experts != experts.num_experts:
            raise ValueError("the MoE CPU path runs without expert parallelism (--ep 1)")
        mlp = mlp_of(block.gate.weight, experts.w13_weight, experts.w2_weight)
        block.forward_normal = mlp.forward  # (T, H) -> (T, H)
    return len(blocks)


@dataclass(frozen=True)
class LaunchArgs:
    """The server args an MRP algorithm checks at launch."""

    tp_size: int  # --tp
    fdfo: bool  # first-done-first-out scheduling (not --no-dllm-fdfo)
    config_path: Optional[str]  # --dllm-algorithm-config


def launch_args(server_args: Any) -> LaunchArgs:
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    return LaunchArgs(getattr(cfg, "tp_size", 1), getattr(cfg, "dllm_fdfo", True),
                      cfg.dllm_algorithm_config)


def preferred_params() -> dict:
    """The server's --preferred-sampling-params ({} when unset)."""
    import json

    from sglang.srt.runtime_context import get_serving

    raw = get_serving().preferred_sampling_params
    if isinstance(raw, str):
        raw = json.loads(raw)
    return dict(raw or {})


def run_server(argv: list[str]) -> None:
    """What `python -m sglang.launch_server` does: plugins, server, its tree killed after."""
    from sglang.launch_server import run_server as sglang_run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        sglang_run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


# ---- the hooks ---------------------------------------------------------------------------

def after_dllm_config(result, server_args, *args, **kwargs):
    """After `DllmConfig.from_server_args`: block size and mask id of an MRP model."""
    if result is None:
        return result
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig

    from mrp_dlm.serving.plugin import block_facts

    cfg = resolving_view(server_args)
    model_config = ModelConfig.from_server_args(server_args, model_path=cfg.model_path,
                                                model_revision=cfg.revision)
    facts = block_facts(model_config.hf_config, cfg.dllm_algorithm_config)
    if facts is not None:  # `mask_id` is SGLang's DllmConfig field: not ours
        result.block_size, result.mask_id = facts.block_size, facts.mask_token_id
    return result


def after_cell_size(result, configurator, kvc, *args, **kwargs):
    """After SGLang's KV bytes per token: plus the MRP head's (its pool has a row per slot)."""
    from mrp_dlm.serving.plugin import HEAD_KEY_ALGORITHMS, head_bytes

    algorithm, config_path = served_algorithm()
    if result is None or kvc.is_draft_worker or algorithm not in HEAD_KEY_ALGORITHMS:
        return result
    model = kvc.model_config  # per TP rank: its share of the kv heads, as SGLang's own size
    return result + head_bytes(config_path, model.get_num_kv_heads(tensor_parallel_size()),
                               model.head_dim, model.dtype, result)


def after_alloc_memory_pool(result, model_runner, *args, **kwargs):
    """After `ModelRunner.alloc_memory_pool` (SGLang's KV pool, before its attention
    backends and graph capture): the MRP head's pool beside it, sized as planned."""
    from mrp_dlm.serving.head_pool import attach_pool
    from mrp_dlm.serving.plugin import HEAD_KEY_ALGORITHMS

    algorithm, _ = served_algorithm()
    if not getattr(model_runner, "is_draft_worker", False) and algorithm in HEAD_KEY_ALGORITHMS:
        attach_pool(model_runner)
    return result


def request_seed(req: Any) -> int:
    """The request's own seed, else its fresh one (drawn once, then kept on the request)."""
    seed = req.sampling_params.sampling_seed
    if seed is None:
        seed = getattr(req, SEED_ATTRIBUTE, None)
        if seed is None:
            seed = secrets.randbits(32)
            setattr(req, SEED_ATTRIBUTE, seed)
    return seed


def after_forward_batch_init(result, cls, batch, *args, **kwargs):
    """After the classmethod `ForwardBatch.init_new(cls, batch, ...)`: the rows' sampling,
    on a batch an MRP algorithm serves."""
    from mrp_dlm.serving.plugin import ALGORITHMS
    from mrp_dlm.serving.sampling import attach_sampling

    config = getattr(batch, "dllm_config", None)
    if result is None or config is None or config.algorithm not in ALGORITHMS:
        return result
    reqs = batch.reqs
    return attach_sampling(result, [req.sampling_params for req in reqs],
                           [request_seed(req) for req in reqs])


def counted_algorithm(scheduler: Any) -> Any:
    """The scheduler's dLLM algorithm object when its results are counted, else None."""
    from mrp_dlm.serving.plugin import is_mrp_architecture
    from mrp_dlm.serving.stats import COUNTED_ALGORITHMS

    config = getattr(scheduler, "dllm_config", None)
    if config is None or not config.first_done_first_out_mode \
            or config.algorithm not in COUNTED_ALGORITHMS:
        return None
    if not is_mrp_architecture(scheduler.model_config.hf_config):
        return None
    return scheduler.tp_worker.dllm_algorithm


def returned_tokens(req: Any) -> int:
    """Tokens a finished request returns: its output up to the stop SGLang found."""
    limit = getattr(req, "finished_len", None)
    return len(req.output_ids) if limit is None else min(len(req.output_ids), limit)


def is_server_probe(req: Any) -> bool:
    """A request SGLang sends itself (start-up warm-up, health check), not a client's."""
    if str(req.rid).startswith(HEALTH_CHECK_RID_PREFIX):
        return True
    params = getattr(req, "sampling_params", None)
    return getattr(req, "origin_input_text", None) == WARMUP_TEXT \
        and getattr(params, "max_new_tokens", None) == WARMUP_MAX_NEW_TOKENS


def around_dllm_result(original, scheduler, batch, result, *args, **kwargs):
    """Around `process_batch_result_dllm`: the forward's requests to the serving stats."""
    from mrp_dlm.serving.stats import RequestForward, count_forward

    algorithm = counted_algorithm(scheduler)
    if algorithm is None:
        return original(scheduler, batch, result, *args, **kwargs)
    generating = [req.extend_end > len(req.origin_input_ids) for req in batch.reqs]
    output = original(scheduler, batch, result, *args, **kwargs)
    rows = [RequestForward(rid=str(req.rid), generating=gen, finished=req.finished(),
                           returned=returned_tokens(req) if req.finished() else 0)
            for req, gen in zip(batch.reqs, generating) if not is_server_probe(req)]
    count_forward(algorithm, rows, scheduler.metrics_reporter.enable_metrics)
    return output


def with_preferred(params: dict, request: Any) -> dict:
    """An OpenAI endpoint's params with the preferred ones the request left out, on a
    server of an MRP algorithm."""
    from mrp_dlm.serving.plugin import ALGORITHMS
    from mrp_dlm.serving.request_defaults import apply_preferred

    if served_algorithm()[0] not in ALGORITHMS:
        return params
    return apply_preferred(params, type(request).model_fields, request.model_fields_set,
                           preferred_params())


def after_chat_params(result: dict, request: Any, *args, **kwargs) -> dict:
    """After `ChatCompletionRequest.to_sampling_params(self, ...)`."""
    return with_preferred(result, request)


def after_completion_params(result: dict, serving: Any, request: Any, *args, **kwargs) -> dict:
    """After `OpenAIServingCompletion._build_sampling_params(self, request)`."""
    return with_preferred(result, request)


def asks_logprobs(request: Any) -> bool:
    """Whether an OpenAI request asks for logprobs: chat `logprobs: true` or `top_logprobs`,
    completions `logprobs: N` (0 included: the chosen tokens' own)."""
    asked = getattr(request, "logprobs", None)
    return (asked is not None and asked is not False) or bool(getattr(request, "top_logprobs",
                                                                      None))


def after_validate_request(result: Any, serving: Any, request: Any, *args, **kwargs) -> Any:
    """After `OpenAIServingChat/Completion._validate_request(self, request)`: its message,
    else the logprobs refusal (SGLang answers a message with HTTP 400)."""
    from mrp_dlm.serving.request_defaults import logprobs_refusal

    return result or logprobs_refusal(asks_logprobs(request), served_algorithm()[0])


HOOKS: dict[str, tuple[Callable, str]] = {  # target -> (adapter, HookType name)
    "sglang.srt.dllm.config.DllmConfig.from_server_args": (after_dllm_config, "AFTER"),
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size":
        (after_cell_size, "AFTER"),
    "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool":
        (after_alloc_memory_pool, "AFTER"),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new":
        (after_forward_batch_init, "AFTER"),
    "sglang.srt.dllm.mixin.scheduler.SchedulerDllmMixin.process_batch_result_dllm":
        (around_dllm_result, "AROUND"),
    "sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest.to_sampling_params":
        (after_chat_params, "AFTER"),
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion."
    "_build_sampling_params": (after_completion_params, "AFTER"),
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request":
        (after_validate_request, "AFTER"),
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion."
    "_validate_request": (after_validate_request, "AFTER"),
}


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (adapter, kind) in HOOKS.items():
        HookRegistry.register(target, adapter, HookType[kind])


# ---- SGLang's platform stub module (CPU stand-ins only) --------------------------------

def platform_stubs() -> Optional[types.ModuleType]:
    """sglang/_platform_stubs.py loaded by path (importing `sglang` first would need triton
    already), or None when SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "_platform_stubs.py"
    file_spec = importlib.util.spec_from_file_location("mrp_sglang_platform_stubs", path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[file_spec.name] = module  # its dataclasses look their module up by name
    file_spec.loader.exec_module(module)
    return module


def triton_mock_finder() -> Optional[Any]:
    """SGLang's macOS triton mock (`_TritonFinder`, the one name of the stub module used):
    a meta-path finder answering every `triton.*` import with a pass-through mock."""
    stubs = platform_stubs()
    return None if stubs is None else stubs._TritonFinder()
