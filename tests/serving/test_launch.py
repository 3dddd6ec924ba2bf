"""`mrp serve` without starting SGLang: the flags, environment and YAML it chooses (CPU and
CUDA), the KV pool and thread rules, the dtype read from the checkpoint, every error,
the ready message, and the process supervision on stand-in process trees.

The real server, end to end with the openai client, is `test_serve.py` (slow).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
import yaml

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.cli import main
from mrp_dlm.config import DecodeConfig
from mrp_dlm.model.head_loading import save_head
from mrp_dlm.model.loading import save_backbone
from mrp_dlm.model.release import export_release
from mrp_dlm.pipeline import embedded_head_dir, embedded_model_dir
from mrp_dlm.serving import launch, process
from mrp_dlm.serving.attention_backend import MRP_BACKENDS, NO_DECODE_GRAPHS, choose_attention
from mrp_dlm.serving.config import MrpServingConfig
from mrp_dlm.serving.launch import (CPU_KV_MEMORY_SHARE, CPU_MAX_RUNNING_REQUESTS, Checkpoint,
                                    ServeConfig, ServeError, cpu_kv_tokens, describe,
                                    plan_launch, read_checkpoint, ready_message)

GIB = 1 << 30


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def cpu_machine(monkeypatch):
    """A CPU machine with 8 GiB of memory available."""
    monkeypatch.setattr(launch, "resolve_device",
                        lambda name: "cpu" if name in ("auto", "cpu") else "cuda")
    monkeypatch.setattr(launch, "available_memory", lambda: 8 * GIB)


def test_cpu_plan_for_the_embedded_model(tmp_path, cpu_machine):
    plan = plan_launch(ServeConfig(), tmp_path / "a.yaml", ["--enable-metrics"], {})
    argv, model = plan.argv, embedded_model_dir().resolve()
    assert argv[:3] == [sys.executable, "-m", "mrp_dlm.serving.server"]
    assert flag(argv, "--model-path") == str(model)
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "30000")
    assert flag(argv, "--dtype") == "float32"  # the checkpoint's, never SGLang's auto
    assert flag(argv, "--device") == "cpu"
    assert flag(argv, "--attention-backend") == "torch_native"
    assert flag(argv, "--dllm-algorithm") == "MrpSpeculative"
    assert flag(argv, "--dllm-algorithm-config") == str(tmp_path / "a.yaml")
    assert json.loads(flag(argv, "--preferred-sampling-params")) == {"temperature": 0}
    # 8 contexts of 4096 tokens: 128 MiB of float32 KV for 8 layers x 2 KV heads x 32 dims
    assert int(flag(argv, "--max-total-tokens")) == CPU_MAX_RUNNING_REQUESTS * 4096
    assert int(flag(argv, "--max-running-requests")) == CPU_MAX_RUNNING_REQUESTS
    assert argv[-1] == "--enable-metrics"
    assert plan.env == {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    assert plan.head == embedded_head_dir().resolve()
    assert plan.served_name == "embedded" and plan.base_url == "http://127.0.0.1:30000"
    yaml_config = MrpServingConfig.from_mapping(yaml.safe_load(plan.yaml_text))
    assert yaml_config == MrpServingConfig(head=str(plan.head), lookahead=DecodeConfig.lookahead,
                                           threshold=DecodeConfig.threshold,
                                           adaptive=DecodeConfig.adaptive)


def test_threads_set_by_the_user_are_kept(tmp_path, cpu_machine):
    plan = plan_launch(ServeConfig(), tmp_path / "a.yaml", [], {"OMP_NUM_THREADS": "2"})
    assert plan.env == {"SGLANG_USE_CPU_ENGINE": "1"}


def test_tensor_parallel_plan(tmp_path, cpu_machine, monkeypatch):
    """--tp 2: SGLang's --tp-size; on a CPU each rank gets its share of the threads and a
    run of the cores (SGLang otherwise wants one NUMA node per rank)."""
    assert "--tp-size" not in plan_launch(ServeConfig(), tmp_path / "a.yaml", [], {}).argv
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 6, 7})
    monkeypatch.setattr(launch, "usable_cpus", lambda: 6)
    plan = plan_launch(ServeConfig(tp=2), tmp_path / "a.yaml", [], {})
    assert flag(plan.argv, "--tp-size") == "2"
    assert plan.env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-2|3,6-7"
    assert launch.cpu_binding([0], 2) == "0|0"  # fewer cores than ranks: they share
    kept = plan_launch(ServeConfig(tp=2), tmp_path / "a.yaml", [],
                       {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in kept.env


def test_cuda_plan_is_bf16_on_a_backend_that_takes_the_head_dim(tmp_path, cpu_machine, caplog):
    """The embedded model (float32, head_dim 32) on CUDA: bfloat16, and Triton (FlashInfer
    has no head_dim 32 kernels), CUDA graphs on for the MRP algorithms, off for
    LowConfidence (SGLang would force FlashInfer on it); said in the startup line and
    logged. A backend the user passes after `--` is left as given."""
    caplog.set_level("INFO", logger=launch.__name__)
    config = ServeConfig(device="cuda", port=8001)
    plan = plan_launch(config, tmp_path / "a.yaml", [], {})
    for cpu_only in ("--device", "--max-total-tokens", "--max-running-requests"):
        assert cpu_only not in plan.argv
    assert flag(plan.argv, "--dtype") == "bfloat16" and flag(plan.argv, "--port") == "8001"
    assert plan.checkpoint.head_dim == 32 and plan.env == {}
    assert flag(plan.argv, "--attention-backend") == "triton"
    assert NO_DECODE_GRAPHS not in plan.argv
    line = describe(config, plan)
    assert "cuda bfloat16, attention triton, CUDA graphs (FlashInfer has no head_dim 32" in line
    assert "attention triton" in caplog.text
    low = plan_launch(ServeConfig(device="cuda", algorithm="LowConfidence"),
                      tmp_path / "a.yaml", [], {})
    assert flag(low.argv, "--attention-backend") == "triton" and NO_DECODE_GRAPHS in low.argv
    given = plan_launch(config, tmp_path / "a.yaml", ["--attention-backend", "fa3"], {})
    assert given.argv.count("--attention-backend") == 1 and flag(given.argv,
                                                                 "--attention-backend") == "fa3"
    assert "attention as given" in describe(config, given)


@pytest.mark.parametrize("device, dtype, head_dim, graphs, ours, want", [
    ("cpu", "float32", 32, True, True, ("torch_native", False)),
    ("cuda", "bfloat16", 128, True, True, ("flashinfer", True)),
    ("cuda", "float16", 64, True, False, ("flashinfer", True)),
    ("cuda", "bfloat16", 128, False, True, ("flashinfer", False)),
    ("cuda", "float32", 128, True, True, ("triton", True)),
    ("cuda", "bfloat16", 32, True, True, ("triton", True)),
    ("cuda", "bfloat16", 32, True, False, ("triton", False)),
    ("cuda", "float32", 32, False, False, ("triton", False)),
])
def test_attention_choice(device, dtype, head_dim, graphs, ours, want):
    choice = choose_attention(device, dtype, head_dim, graphs, ours)
    assert (choice.backend, choice.cuda_graphs) == want
    assert choice.backend in MRP_BACKENDS and choice.reason
    assert (NO_DECODE_GRAPHS in choice.flags(device)) == (device == "cuda" and not want[1])


def test_the_mrp_algorithms_list_the_backends_mrp_serve_chooses():
    """SGLang keeps an algorithm's listed backend with CUDA graphs on
    (`_dllm_attention_backend`); the MRP algorithms list every one `choose_attention`
    gives."""
    from sglang_env import require_sglang

    require_sglang()
    from mrp_dlm.serving.base import MrpAlgorithm

    assert MrpAlgorithm.supported_attention_backends == MRP_BACKENDS


@pytest.mark.parametrize("config, want", [
    (ServeConfig(algorithm="LowConfidence"), {"threshold": DecodeConfig.threshold}),
    (ServeConfig(algorithm="LowConfidence", threshold=1.0), {"threshold": 1.0}),
    (ServeConfig(algorithm="MrpDirect", lookahead=2), {"lookahead": 2}),
    (ServeConfig(threshold=0.5, lookahead=4, adaptive=False),
     {"lookahead": 4, "threshold": 0.5, "adaptive": False}),
    (ServeConfig(algorithm="MrpRemask", threshold=0.4),
     {"lookahead": DecodeConfig.lookahead, "threshold": 0.4, "remask_rule": "chain",
      "remask_delta": DecodeConfig.remask_delta}),
    (ServeConfig(algorithm="MrpRemask", remask_rule="paper", remask_delta=1.5),
     {"lookahead": DecodeConfig.lookahead, "threshold": DecodeConfig.threshold,
      "remask_rule": "paper", "remask_delta": 1.5}),
])
def test_algorithm_yaml(tmp_path, cpu_machine, config, want):
    plan = plan_launch(config, tmp_path / "a.yaml", [], {})
    written = yaml.safe_load(plan.yaml_text)
    if config.algorithm != "LowConfidence":
        assert written.pop("head") == str(embedded_head_dir().resolve())
        MrpServingConfig.from_mapping({"head": "h", **written})  # the plugin accepts it
    assert written == want
    assert flag(plan.argv, "--dllm-algorithm") == config.algorithm


def test_dtype_and_sizes_come_from_the_checkpoint(tmp_path):
    config = tiny_config()
    save_backbone(random_backbone(config).to(torch.bfloat16), tmp_path / "model")
    checkpoint = read_checkpoint(tmp_path / "model")
    assert checkpoint.dtype == "bfloat16"
    assert checkpoint.kv_bytes_per_token == 2 * config.num_layers * config.num_kv_heads \
        * config.head_dim * 2
    assert checkpoint.parameters == sum(p.numel() for p in random_backbone(config).parameters())
    assert checkpoint.context_len == config.max_position_embeddings


def test_kv_pool_is_bounded_by_contexts_and_by_memory():
    small = Checkpoint(directory=None, dtype="float32", parameters=0, kv_bytes_per_token=4096,
                       context_len=4096)
    assert cpu_kv_tokens(small, 8 * GIB) == CPU_MAX_RUNNING_REQUESTS * 4096
    big = Checkpoint(directory=None, dtype="bfloat16", parameters=0,
                     kv_bytes_per_token=147456, context_len=32768)  # SDAR-8B in bf16
    tokens = cpu_kv_tokens(big, 16 * GIB, block_size=16)
    assert tokens % 16 == 0
    assert tokens * big.kv_bytes_per_token <= CPU_KV_MEMORY_SHARE * 16 * GIB
    assert (tokens + 16) * big.kv_bytes_per_token > CPU_KV_MEMORY_SHARE * 16 * GIB


@pytest.mark.parametrize("changes, message", [
    (dict(algorithm="Medusa"), "unknown algorithm 'Medusa'"),
    (dict(algorithm="MrpDirect", threshold=0.9), "MrpDirect takes no threshold"),
    (dict(algorithm="LowConfidence", head="h"), "LowConfidence uses no MRP head"),
    (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
    (dict(lookahead=0), "lookahead must be >= 1"),
    (dict(port=0), "port must be"),
    (dict(tp=0), "tp must be >= 1"),
    (dict(device="tpu"), "device must be auto, cpu or cuda"),
    (dict(algorithm="MrpRemask", remask_rule="veto"),
     "unknown remask rule 'veto'; choose one of chain, paper"),
])
def test_bad_serve_configs(changes, message):
    with pytest.raises(ServeError, match=message):
        ServeConfig(**changes)


def test_heads_are_required_and_checked(tmp_path, cpu_machine):
    save_backbone(random_backbone(tiny_config()), tmp_path / "model")
    other = ServeConfig(model=str(tmp_path / "model"), algorithm="MrpDirect")
    with pytest.raises(ServeError, match="needs the MRP head trained on .*give --head DIR"):
        plan_launch(other, tmp_path / "a.yaml", [], {})
    # MrpSpeculative without a head self-drafts: the YAML names none.
    plan = plan_launch(ServeConfig(model=str(tmp_path / "model")), tmp_path / "s.yaml", [], {})
    assert plan.head is None and not any(line.startswith("head:")
                                         for line in plan.yaml_text.splitlines())
    assert "no head: self-drafts" in describe(ServeConfig(model=str(tmp_path / "model")), plan)
    with pytest.raises(ServeError, match="MRP head directory not found"):
        plan_launch(ServeConfig(head=str(tmp_path / "nowhere")), tmp_path / "a.yaml", [], {})
    plan = plan_launch(ServeConfig(model=str(tmp_path / "model"), algorithm="LowConfidence"),
                       tmp_path / "a.yaml", [], {})
    assert plan.head is None and flag(plan.argv, "--served-model-name") == "model"


def test_a_head_from_another_model_is_refused_before_sglang_starts(tmp_path, cpu_machine,
                                                                  monkeypatch):
    """The fingerprint check of `mrp generate`, in the plan: one line, no SGLang."""
    model = random_backbone(tiny_config())
    save_backbone(model, tmp_path / "model")
    save_head(random_head(model, 0), model, tmp_path / "fits")
    other = random_backbone(tiny_config(), seed=5)  # same shapes, other weights
    save_head(random_head(other, 0), other, tmp_path / "other")
    plan = plan_launch(ServeConfig(model=str(tmp_path / "model"), head=str(tmp_path / "fits")),
                       tmp_path / "a.yaml", [], {})
    assert plan.head == (tmp_path / "fits").resolve()
    monkeypatch.setattr(process, "check_sglang", lambda: None)
    monkeypatch.setattr(process, "start", lambda plan: pytest.fail("the server was started"))
    wrong = ServeConfig(model=str(tmp_path / "model"), head=str(tmp_path / "other"))
    assert main(["serve", "--model", wrong.model, "--head", wrong.head]) == 2
    with pytest.raises(ServeError, match=r"^the head in \S+other was trained on another "
                       r"backbone: lm_head_sha256: head '\w+' vs backbone '\w+'$"):
        plan_launch(wrong, tmp_path / "a.yaml", [], {})


def test_a_release_is_served_as_sdar_with_its_own_head(tmp_path, cpu_machine, monkeypatch):
    model = random_backbone(tiny_config(block_size=16))
    release = tmp_path / "sdar-mrp"
    export_release(model, random_head(model, 0), release)
    plan = plan_launch(ServeConfig(model=str(release)), tmp_path / "run" / "a.yaml", [], {})
    assert plan.view_of == release and plan.head == release  # the head beside the backbone
    assert plan.model_path == tmp_path / "run" / "sdar-view" and plan.served_name == "sdar-mrp"
    assert MrpServingConfig.from_mapping(yaml.safe_load(plan.yaml_text)).head == str(release)
    assert int(flag(plan.argv, "--max-total-tokens")) % 16 == 0  # the release's block size
    plan = plan_launch(ServeConfig(model=str(release), algorithm="LowConfidence"),
                       tmp_path / "a.yaml", [], {})
    assert plan.head is None and plan.view_of == release

    seen = {}

    def fake_start(plan):  # what `serve` has written when SGLang would start
        seen["config"] = json.loads((plan.model_path / "config.json").read_text())
        seen["links"] = sorted(p.name for p in plan.model_path.iterdir() if p.is_symlink())
        raise ServeError("SGLang is not started in this test")

    monkeypatch.setattr(process, "check_sglang", lambda: None)
    monkeypatch.setattr(process, "port_is_free", lambda port: True)
    monkeypatch.setattr(process, "start", fake_start)
    with pytest.raises(ServeError, match="not started"):
        process.serve(ServeConfig(model=str(release)), [], lambda text: None)
    assert seen["config"]["architectures"] == ["SDARForCausalLM"]
    assert seen["config"]["block_size"] == 16
    assert seen["links"] == ["model.safetensors"]


def test_cuda_on_a_machine_without_it():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ServeError, match="no CUDA device"):
        launch.resolve_device("cuda")


def test_missing_sglang_names_the_install_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "sglang" else real(name, *args))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "needs SGLang 0.5.23, which is not installed" in err
    assert "pip install 'mrp-dlm[sglang]'" in err and ".ci/install_sglang.sh" in err


def test_serve_cli_smoke(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    assert "--algorithm" in capsys.readouterr().out


def test_a_port_in_use_is_refused_before_the_server_starts(monkeypatch, cpu_machine):
    monkeypatch.setattr(process, "check_sglang", lambda: None)
    monkeypatch.setattr(process, "start", lambda plan: pytest.fail("the server was started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ServeError, match=f"port {port} on 127.0.0.1 is in use "
                                             f"\\(process {os.getpid()} \\(.*pytest"):
            process.serve(ServeConfig(port=port), [], print)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_listening_port_is_not_free(reuse):
    """Busy whether or not the listener set SO_REUSEADDR (uvicorn does)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert not process.port_is_free(port)
        assert process.port_listeners(port) == [
            f"process {os.getpid()} ({shlex.join(psutil.Process().cmdline())[:160]})"]
    assert process.port_is_free(port)


def time_wait_port() -> int:
    """A port that holds only TIME-WAIT connections, as a server leaves after load: a
    listener with SO_REUSEADDR (as uvicorn's; Linux lets a bind through a TIME-WAIT
    connection only when both sockets set it) accepts a few connections and closes its ends
    first (TIME-WAIT stays on the side that closes first, here the side that owns the
    port), then stops listening."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        for client in clients:
            accepted, _ = listener.accept()
            accepted.close()
            assert client.recv(1) == b""  # the server's FIN arrived: its end is FIN-WAIT-2
            client.close()  # ... and now TIME-WAIT
    return port


def test_a_port_with_only_time_wait_connections_is_free():
    port = time_wait_port()
    states = {c.status for c in psutil.net_connections(kind="tcp")
              if c.laddr and c.laddr.port == port}
    assert states == {"TIME_WAIT"}, states
    assert process.time_wait_count(port) == 3
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the old probe did, and was refused
    assert process.port_is_free(port)
    assert process.port_listeners(port) == []


def test_a_port_that_cannot_be_probed_says_why(monkeypatch):
    def refuse(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    with pytest.raises(ServeError, match="cannot listen on port 80 on 127.0.0.1: Permission"):
        process.port_is_free(80)


def test_ready_message_is_ready_to_paste(tmp_path, cpu_machine):
    plan = plan_launch(ServeConfig(port=30123), tmp_path / "a.yaml", [], {})
    message = ready_message(plan)
    lines = message.splitlines()
    assert lines[0].startswith("ready: http://127.0.0.1:30123/v1")
    curl = next(i for i, line in enumerate(lines) if line.startswith("curl"))
    words = shlex.split(lines[curl].rstrip("\\") + lines[curl + 1])
    assert words[:5] == ["curl", "-s", "http://127.0.0.1:30123/v1/chat/completions", "-H",
                         "Content-Type: application/json"]
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "embedded" and body["messages"][0]["role"] == "user"
    script = message[message.index("from openai"):message.rindex("EOF")]
    compile(script, "<ready message>", "exec")
    assert "base_url='http://127.0.0.1:30123/v1'" in script


# --- the process tree -----------------------------------------------------------------------

TREE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
{ignore}
time.sleep(300)
"""


def tree_of(ignore_sigterm: bool) -> tuple[subprocess.Popen, list]:
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_sigterm \
        else ""
    child = subprocess.Popen([sys.executable, "-c", TREE.format(ignore=ignore)],
                             start_new_session=True)
    deadline = time.monotonic() + 30
    while not process.descendants(child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = process.process_tree(child.pid)
    assert len(tree) == 2
    return child, tree


def gone(tree: list) -> bool:
    return process.left_running(tree) == []


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_stop_leaves_no_process(monkeypatch, ignore_sigterm):
    monkeypatch.setattr(process, "GRACE_SECONDS", 1.0)
    child, tree = tree_of(ignore_sigterm)
    process.stop(child, process.descendants(child.pid))
    deadline = time.monotonic() + 10
    while not gone(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(tree)


def test_wait_ready_reports_an_early_exit():
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(ServeError, match="SGLang exited with code 3 before it was ready"):
        process.wait_ready(child, f"http://127.0.0.1:{port}")
