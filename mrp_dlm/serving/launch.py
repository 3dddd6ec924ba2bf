"""`mrp serve`: what to run to serve a checkpoint through SGLang 0.5.23, flags chosen here.

One command serves a checkpoint (default: the embedded model and its head) with SGLang's
OpenAI-compatible API on 127.0.0.1: a `ServeConfig` becomes a `LaunchPlan` (the SGLang
command, its environment and the algorithm's YAML). It chooses:
- the dLLM algorithm and its YAML; LowConfidence gets the library's default threshold, the
  rule MrpSpeculative reproduces (SGLang's own default differs);
- on a CPU the checkpoint's own dtype (`--dtype auto` would run a float32 checkpoint in
  float16), on CUDA bfloat16 (`config.dtype_for`);
- an attention backend for the head_dim and dtype (`attention_backend.py`, said and logged);
- on a CPU: `--device cpu`, SGLANG_USE_CPU_ENGINE=1, the import
  stand-ins (`cpu_standins.py`), a KV pool of at most CPU_MAX_RUNNING_REQUESTS contexts and
  CPU_KV_MEMORY_SHARE of the available memory (SGLang sizes it from the total memory), and
  the library's CPU thread rule unless OMP_NUM_THREADS or MKL_NUM_THREADS is set; on CUDA,
  SGLang's defaults;
- for a release (`model/release.py`), an SDAR view of it (SGLang has no SDARMRP class);
- the head checked against the checkpoint (the fingerprint `mrp generate` checks), so a
  wrong head is refused in one line before SGLang starts;
- greedy requests when `temperature` is left out (`--preferred-sampling-params`).

Deliberately not here: running and stopping the process (`process.py`), the server
process's entry point (`server.py`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from mrp_dlm.config import dtype_for
from mrp_dlm.model.files import INDEX_FILE, SINGLE_FILE, CheckpointError, read_json
from mrp_dlm.model.release import backbone_config, is_release_dir, release_fingerprint
from mrp_dlm.pipeline import embedded_head_dir, embedded_model_dir
from mrp_dlm.serving import sglang_process as door
from mrp_dlm.serving.attention_backend import (NO_DECODE_GRAPHS, AttentionChoice,
                                               choose_attention)
from mrp_dlm.serving.plugin import ALGORITHMS as MRP_ALGORITHMS
from mrp_dlm.serving.serve_config import ALGORITHMS, HOST, ServeConfig, ServeError  # noqa: F401
from mrp_dlm.threads import choose_threads, usable_cpus

log = logging.getLogger(__name__)

GREEDY_DEFAULTS = {"temperature": 0}  # what a request gets for the fields it leaves out
CPU_MAX_RUNNING_REQUESTS = 8  # on a CPU, every request of a batch shares each forward's cost
CPU_KV_MEMORY_SHARE = 0.25  # at most this share of the available memory goes to the KV pool
STANDINS_FILE = Path(__file__).with_name("cpu_standins.py")  # the CPU import stand-ins
INSTALL_HINT = ("install it with `pip install 'mrp-dlm[sglang]'` on a CUDA host, or on a "
                "CPU-only machine, from a checkout of mrp-dlm, `bash .ci/install_sglang.sh` "
                "(SGLang without its CUDA torch; see docs/serving.md)")
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors -> torch
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_BIND_VAR = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's cores per TP rank on a CPU
VIEW_NAME = "sdar-view"  # a release's SDAR view, written beside the algorithm's YAML


@dataclass(frozen=True)
class Checkpoint:
    """What the launch needs of a checkpoint, read from its files (no weights loaded)."""

    directory: Path  # the HF-format checkpoint
    dtype: str  # float32, bfloat16 or float16: the weights' own dtype
    parameters: int  # number of weights (for the CPU thread rule)
    kv_bytes_per_token: int  # K and V of every layer for one token, in `dtype`
    context_len: int  # max_position_embeddings
    head_dim: int = 0  # the attention heads' width (0: not read)


@dataclass(frozen=True)
class LaunchPlan:
    """The SGLang server process `mrp serve` runs."""

    argv: list[str]  # the command, `python -m mrp_dlm.serving.server <SGLang flags>`
    env: dict[str, str]  # variables added to this process's environment
    yaml_text: str  # the dLLM algorithm's YAML, written where argv says
    device: str  # cpu or cuda
    checkpoint: Checkpoint  # what is served
    dtype: str  # what SGLang loads it in (`--dtype`)
    attention: AttentionChoice | None  # `--attention-backend` and decode graphs; None:
    # the user's own --attention-backend, as given
    head: Path | None  # the MRP head, for the MRP algorithms
    view_of: Path | None = None  # a release-layout checkpoint, shown to SGLang as SDAR

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--port") + 1])

    @property
    def served_name(self) -> str:
        return self.argv[self.argv.index("--served-model-name") + 1]

    @property
    def model_path(self) -> Path:
        return Path(self.argv[self.argv.index("--model-path") + 1])


def check_sglang() -> None:
    """A clear error when SGLang, its supported version or this package's plugin
    registration is missing."""
    version = door.sglang_version()
    if version is None:
        raise ServeError(f"`mrp serve` needs SGLang 0.5.23, which is not installed: "
                         f"{INSTALL_HINT}")
    if not door.supported():
        raise ServeError(door.unsupported_message(version))
    if not door.plugin_registered("mrp"):
        raise ServeError("the mrp-dlm SGLang plugin is not registered (mrp-dlm is not "
                         "installed in this Python, or a stale mrp_dlm.egg-info shadows it): "
                         "reinstall with `pip install -e .` from the checkout")


def safetensors_files(directory: Path) -> list[Path]:
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    index = read_json(directory / INDEX_FILE)
    return [directory / name for name in sorted(set(index.get("weight_map", {}).values()))]


def tensor_facts(files: list[Path]) -> tuple[int, str]:
    """(number of weights, dtype of the first tensor) from the safetensors headers."""
    from safetensors import safe_open

    parameters, dtype = 0, None
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                parameters += math.prod(piece.get_shape())
                dtype = dtype or DTYPE_NAMES.get(piece.get_dtype())
    return parameters, dtype or "float32"


def read_checkpoint(directory: Path) -> Checkpoint:
    """The checkpoint's dtype (config.json's torch_dtype or dtype, else the weights'), size,
    KV bytes per token and context length."""
    raw = read_json(directory / "config.json")
    parameters, stored = tensor_facts(safetensors_files(directory))
    dtype = raw.get("torch_dtype") or raw.get("dtype") or stored
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{directory / 'config.json'}: dtype {dtype!r} is not one of "
                              f"{', '.join(DTYPE_BYTES)}")
    try:
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        kv_heads = raw.get("num_key_value_heads") or heads
        kv_bytes = 2 * raw["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]
    except KeyError as error:
        raise CheckpointError(f"{directory / 'config.json'} lacks the key "
                              f"{error.args[0]!r}") from error
    return Checkpoint(directory=directory, dtype=dtype, parameters=parameters,
                      kv_bytes_per_token=kv_bytes,
                      context_len=int(raw.get("max_position_embeddings", 32768)),
                      head_dim=int(head_dim))


def local_dir(name: str, revision: str | None, what: str) -> Path:
    """The directory a --model / --head name stands for (`hub.py`), absolute."""
    from mrp_dlm.hub import HubError, resolve_checkpoint

    try:
        return resolve_checkpoint(name, revision, what).resolve()
    except HubError as error:
        raise ServeError(str(error)) from None


def head_for(config: ServeConfig, model_dir: Path) -> Path | None:
    """The MRP head directory of the MRP algorithms: --head, else the embedded head when the
    embedded model is served, else a release's own directory (it holds its head), else
    None for MrpSpeculative (it self-drafts: the rule's steps on the seed logits)."""
    if config.algorithm not in MRP_ALGORITHMS:
        return None
    if config.head is not None:
        head = local_dir(config.head, config.head_revision, "MRP head")
    elif model_dir == embedded_model_dir().resolve():
        head = embedded_head_dir().resolve()
    elif is_release_dir(model_dir):
        head = model_dir
    elif config.algorithm == "MrpSpeculative":
        return None
    else:
        raise ServeError(f"{config.algorithm} needs the MRP head trained on {model_dir}: give "
                         "--head DIR (or --algorithm LowConfidence, which needs none)")
    if not (head / "config.json").is_file():
        raise ServeError(f"MRP head directory not found (or without config.json): {head}")
    return head


def check_head_fits(head: Path, model_dir: Path, dtype: str) -> None:
    """Refuse a head trained on another backbone now, in one line, instead of in SGLang's
    traceback after it has started (half a minute on a CPU). The same fingerprint check as
    `loading.load_head`, on the checkpoint's files: its config and its lm_head tensor
    (the one tensor read; no model is built)."""
    import torch

    from mrp_dlm.model.head_loading import mismatch_message, read_head_meta

    saved = release_fingerprint(head) if is_release_dir(head) else read_head_meta(head)[1]
    differences = saved.differences(release_fingerprint(model_dir))
    if differences:
        raise ServeError(mismatch_message(head, differences, getattr(torch, dtype)))


def algorithm_yaml(config: ServeConfig, head: Path | None) -> str:
    """The dLLM algorithm config SGLang reads (`--dllm-algorithm-config`)."""
    if config.algorithm == "LowConfidence":
        return f"threshold: {config.rule_threshold}\n"
    text = (f"head: {json.dumps(str(head))}\n" if head is not None else "") \
        + f"lookahead: {config.lookahead}\n"
    if config.algorithm == "MrpSpeculative":
        text += (f"threshold: {config.rule_threshold}\n"
                 f"adaptive: {'true' if config.adaptive else 'false'}\n")
    if config.algorithm == "MrpRemask":
        text += (f"threshold: {config.rule_threshold}\nremask_rule: {config.remask_rule}\n"
                 f"remask_delta: {config.remask_delta}\n")
    return text


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ServeError("--device cuda: this machine (or this PyTorch) has no CUDA device")
    return name


def cpu_kv_tokens(checkpoint: Checkpoint, available_bytes: int, block_size: int = 16) -> int:
    """KV pool size on a CPU: CPU_MAX_RUNNING_REQUESTS full contexts, at most
    CPU_KV_MEMORY_SHARE of the available memory, a whole number of blocks (SGLang's page)."""
    by_memory = int(available_bytes * CPU_KV_MEMORY_SHARE) // checkpoint.kv_bytes_per_token
    tokens = min(CPU_MAX_RUNNING_REQUESTS * checkpoint.context_len, by_memory)
    return max(tokens // block_size, 1) * block_size


def available_memory() -> int:
    import psutil  # an SGLang dependency

    return int(psutil.virtual_memory().available)


def cpu_flags(checkpoint: Checkpoint, block_size: int) -> list[str]:
    return ["--device", "cpu",
            "--max-total-tokens", str(cpu_kv_tokens(checkpoint, available_memory(), block_size)),
            "--max-running-requests", str(CPU_MAX_RUNNING_REQUESTS)]


def cpu_env(checkpoint: Checkpoint, environ: dict[str, str], tp: int = 1) -> dict[str, str]:
    """SGLang's CPU engine switch, and the library's CPU thread rule unless set already;
    with tp ranks, each rank gets its share of the threads and of the usable cores."""
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    choice = choose_threads(None, checkpoint.parameters, "cpu", environ, usable_cpus())
    if choice.threads is not None:
        env["OMP_NUM_THREADS"] = str(max(choice.threads // tp, 1))
    if tp > 1 and not environ.get(CPU_BIND_VAR):
        env[CPU_BIND_VAR] = cpu_binding(sorted(os.sched_getaffinity(0)), tp)
    return env


def cpu_binding(cpus: list[int], tp: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for tp ranks: the cores split into tp runs ('0-7|8-15');
    with fewer cores than ranks, ranks share them. SGLang otherwise wants a NUMA node per
    rank and refuses more ranks than nodes."""
    groups = [cpus[rank * len(cpus) // tp:(rank + 1) * len(cpus) // tp] or
              [cpus[rank % len(cpus)]] for rank in range(tp)]
    return "|".join(",".join(cpu_ranges(group)) for group in groups)


def cpu_ranges(cpus: list[int]) -> list[str]:
    """Sorted core ids as ranges: [0, 1, 2, 5] -> ['0-2', '5']."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]


def block_size_of(directory: Path) -> int:
    from mrp_dlm.config import SDAR_BLOCK_SIZE

    raw = backbone_config(read_json(directory / "config.json"), directory)
    return int(raw.get("block_size") or SDAR_BLOCK_SIZE)


def served_name(config: ServeConfig, model_dir: Path) -> str:
    """The name clients send: a hub id as given, else the directory's name."""
    local = config.model is None or Path(config.model).expanduser().is_dir()
    return model_dir.name if local else config.model


def plan_launch(config: ServeConfig, yaml_path: Path, extra_args: list[str],
                environ: dict[str, str]) -> LaunchPlan:
    """The SGLang server command for `config`; the YAML is to be written at yaml_path, and
    a release's SDAR view (SGLang has no `SDARMRPForCausalLM`) beside it, at VIEW_NAME."""
    if config.model is None and config.revision is not None:
        raise ServeError(f"a revision ({config.revision}) needs a hub id as the model")
    model_dir = local_dir(config.model, config.revision, "model") if config.model \
        else embedded_model_dir().resolve()
    checkpoint = read_checkpoint(model_dir)
    head = head_for(config, model_dir)
    if head is not None and head != model_dir:  # a release's own head fits by construction
        check_head_fits(head, model_dir, checkpoint.dtype)
    device = resolve_device(config.device)
    dtype = checkpoint.dtype if device == "cpu" else dtype_for(device)
    attention = choose_attention(device, dtype, checkpoint.head_dim,
                                 NO_DECODE_GRAPHS not in extra_args,
                                 config.algorithm in MRP_ALGORITHMS)
    view_of = model_dir if is_release_dir(model_dir) else None
    served = yaml_path.with_name(VIEW_NAME) if view_of else model_dir
    argv = [sys.executable, "-m", "mrp_dlm.serving.server",
            "--model-path", str(served), "--served-model-name", served_name(config, model_dir),
            "--host", HOST, "--port", str(config.port), "--dtype", dtype,
            "--dllm-algorithm", config.algorithm, "--dllm-algorithm-config", str(yaml_path),
            "--preferred-sampling-params", json.dumps(GREEDY_DEFAULTS)]
    if config.tp > 1:
        argv += ["--tp-size", str(config.tp)]
    if "--attention-backend" in extra_args:  # the user's, as given
        attention = None
    else:
        argv += attention.flags(device)
        log.info("mrp serve: %s", attention.describe())
    env = {}
    if device == "cpu":
        argv += cpu_flags(checkpoint, block_size_of(model_dir))
        env = cpu_env(checkpoint, environ, config.tp)
    return LaunchPlan(argv=argv + list(extra_args), env=env,
                      yaml_text=algorithm_yaml(config, head), device=device,
                      checkpoint=checkpoint, dtype=dtype, attention=attention, head=head,
                      view_of=view_of)


def describe(config: ServeConfig, plan: LaunchPlan) -> str:
    """One line: what is served, how."""
    if config.algorithm == "MrpSpeculative":
        setting = (f"threshold {config.rule_threshold}, lookahead {config.lookahead}"
                   f"{', adaptive' if config.adaptive else ''}; lossless: LowConfidence's "
                   f"output at threshold {config.rule_threshold}")
    elif config.algorithm == "MrpDirect":
        setting = f"lookahead {config.lookahead}; lossy"
    elif config.algorithm == "MrpRemask":
        rule = ("the chain rule" if config.remask_rule == "chain" else
                f"the paper's residual veto, delta {config.remask_delta}")
        setting = f"threshold {config.rule_threshold}, {rule}; lossy"
    else:
        setting = f"threshold {config.rule_threshold}"
    head = f", head {plan.head}" if plan.head else (
        ", no head: self-drafts" if config.algorithm == "MrpSpeculative" else "")
    attention = plan.attention.describe() if plan.attention else "attention as given"
    return (f"{config.algorithm} ({setting}) on {plan.checkpoint.directory}{head}, "
            f"{plan.device} {plan.dtype}, {attention}")


EXAMPLE_PROMPT = ("Tom has 3 apples. He buys 5 more. Then he eats 2 of them. "
                  "How many apples are left?")


def ready_message(plan: LaunchPlan) -> str:
    """The URL and ready-to-paste curl and openai examples."""
    url, name = plan.base_url, plan.served_name
    body = json.dumps({"model": name, "max_tokens": 64,
                       "messages": [{"role": "user", "content": EXAMPLE_PROMPT}]})
    return "\n".join([
        f"ready: {url}/v1 (OpenAI API, model {name!r}; a request without temperature is "
        "greedy; Ctrl-C stops the server)",
        "",
        f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"  -d {shlex.quote(body)}",
        "",
        "python - <<'EOF'",
        "from openai import OpenAI",
        f"client = OpenAI(base_url={url + '/v1'!r}, api_key='none')",
        f"reply = client.chat.completions.create(model={name!r}, max_tokens=64,",
        f"    messages=[{{'role': 'user', 'content': {EXAMPLE_PROMPT!r}}}])",
        "print(reply.choices[0].message.content)",
        "EOF",
    ])
