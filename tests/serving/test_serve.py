"""`mrp serve` end to end on this CPU, as a user runs it: the embedded model and head served
(`mrp serve --port P -- --enable-metrics`: MrpSpeculative at the default threshold), talked
to with the `openai` client, stopped with Ctrl-C (SIGINT), and started again on port P.

- the server prints its URL and the ready-to-paste curl and openai examples when ready;
- chat and completion requests, greedy (temperature 0) and with temperature left out,
  return the token ids of our own `mrp generate --mode dynamic` and `--mode speculative`
  at the same threshold (through the Pipeline API: the chat template for chat requests,
  the raw prompt for completions), on every prompt whose output survives perturbed logits
  (tests/margins.py; the engines compute the same logits with other kernels); the prompt
  ids the server made equal ours, chat template included;
- chat requests with temperature 0.7, top-p 0.95 and seed 5 return the token ids of our
  seeded sampled `mrp generate --mode dynamic --temperature 0.7 --top-p 0.95 --seed 5`
  (MrpSpeculative is exact under sampling), on every stable prompt;
- the plugin's counters on /metrics moved by exactly this test's requests: the tokens
  their usage reports, and the forwards SGLang itself logged ("Prefill batch" lines);
- after Ctrl-C no process of the server's tree is left (psutil);
- after a burst of concurrent requests and Ctrl-C, `mrp serve` starts again on the same
  port at once, while the burst's TIME-WAIT connections still hold it (a plain bind is
  refused), serving the embedded pair exported in the published MRP layout, answers as our
  decoders on that directory do, refuses requests for logprobs with HTTP 400, and stops
  (the second and last server start).
The SGLang subprocesses get the CPU stand-ins without the `.pth` hook: the server runs with
MRP_SGLANG_CPU_STANDINS unset.

Nothing here hard-codes an output: every comparison is between two decoders run here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (run .ci/install_sglang.sh)", allow_module_level=True)

from margins import stable_rows  # noqa: E402
from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.pipeline import Pipeline, embedded_head_dir  # noqa: E402
from mrp_dlm.serving.process import left_running, process_tree, time_wait_count  # noqa: E402
from sglang_env import request_forwards, trim_after_stop  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # two SGLang server starts: 40-90 s each here

PROMPTS = ["What is 12 + 7?", "Tom has 3 apples and buys 4 more. How many apples does he have?",
           "What is 6 * 8?", "Write a Python function that adds two numbers."]
MAX_NEW = 40
START_SECONDS = 400  # a start takes 40-90 s on the 2 shared cores here
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, log_path: Path, *flags: str) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items()
           if key not in ("MRP_SGLANG_CPU_STANDINS", "SGLANG_USE_CPU_ENGINE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "mrp_dlm.cli", "serve", "--port",
                                 str(port), *flags, "--", "--enable-metrics"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for_banner(process: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        text = log_path.read_text()
        if re.search(r"^ready: ", text, re.M):
            return text
        if process.poll() is not None:
            pytest.fail(f"mrp serve exited with {process.returncode}:\n{text[-3000:]}")
        time.sleep(1)
    pytest.fail(f"mrp serve was not ready after {START_SECONDS} s:\n{log_path.read_text()[-3000:]}")


def metrics(port: int) -> dict[str, float]:
    """The plugin's counters on /metrics, by name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^(mrp_dlm_\w+)_total\{algorithm="MrpSpeculative"\} (\S+)$',
                                 text, re.M)}


def ours(pipeline: Pipeline, chat: bool) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(dynamic ids, speculative ids, stable prompt indices) of our decoders at τ = 0.9."""
    rule_config = DecodeConfig(mode="dynamic", max_new_tokens=MAX_NEW)
    rule = pipeline.generate(PROMPTS, rule_config, chat=chat).token_ids
    stable = stable_rows(pipeline.model, lambda: pipeline.generate(PROMPTS, rule_config,
                                                                   chat=chat).token_ids, rule)
    spec = pipeline.generate(PROMPTS, DecodeConfig(mode="speculative", max_new_tokens=MAX_NEW),
                             chat=chat).token_ids
    return rule, spec, stable


def served(client, prompt: str, chat: bool, model: str = "embedded",
           **sampling) -> tuple[list[int], list[int], int]:
    """(prompt ids, output ids, completion tokens) of one request to the served `model`."""
    if chat:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_NEW, extra_body={"return_token_ids": True}, **sampling)
        extra = reply.choices[0].model_extra
        return (extra["prompt_token_ids"], extra["response_token_ids"],
                reply.usage.completion_tokens)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW,
                                      extra_body={"return_token_ids": True}, **sampling)
    extra = reply.choices[0].model_extra
    return extra["prompt_token_ids"], extra["token_ids"], reply.usage.completion_tokens


def check_requests(client, pipeline: Pipeline) -> int:
    """Chat and completions, greedy and with temperature left out, against our decoders;
    returns the completion tokens served."""
    stops, tokens = pipeline.model.config.stop_token_ids, 0
    for chat in (True, False):
        rule, spec, stable = ours(pipeline, chat)
        assert len(stable) >= len(PROMPTS) - 1, f"only prompts {stable} are stable"
        assert [spec[i] for i in stable] == [rule[i] for i in stable]
        for sampling in ({"temperature": 0}, {}):
            for index, prompt in enumerate(PROMPTS):
                prompt_ids, ids, count = served(client, prompt, chat, **sampling)
                tokens += count
                assert prompt_ids == pipeline.encode(prompt, chat=chat)
                if index in stable:
                    got = trim_after_stop(ids, stops, MAX_NEW)
                    assert got == rule[index], (f"chat={chat} {sampling} prompt {index}: "
                                                f"served {got}\n ours {rule[index]}")
    return tokens


SAMPLED = dict(temperature=0.7, top_p=0.95, seed=5)  # the OpenAI fields and our knobs alike


def check_sampled(client, pipeline: Pipeline) -> int:
    """Seeded sampled chat requests against our seeded sampled rule; returns the tokens."""
    config = DecodeConfig(mode="dynamic", max_new_tokens=MAX_NEW, **SAMPLED)
    rule = pipeline.generate(PROMPTS, config, chat=True).token_ids
    stable = stable_rows(pipeline.model,
                         lambda: pipeline.generate(PROMPTS, config, chat=True).token_ids, rule)
    assert len(stable) >= len(PROMPTS) - 1, f"only prompts {stable} are stable"
    stops, tokens = pipeline.model.config.stop_token_ids, 0
    for index, prompt in enumerate(PROMPTS):
        _, ids, count = served(client, prompt, True, **SAMPLED)
        tokens += count
        if index in stable:
            got = trim_after_stop(ids, stops, MAX_NEW)
            assert got == rule[index], f"sampled prompt {index}: served {got}\n ours {rule[index]}"
    return tokens


def burst(client, count: int = 16) -> None:
    """`count` short chat requests all at once: the load that leaves TIME-WAIT connections
    on the server's port when it stops."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(count) as pool:
        replies = list(pool.map(lambda i: served(client, PROMPTS[i % len(PROMPTS)], True),
                                range(count)))
    assert all(ids for _, ids, _ in replies)


def interrupt(process: subprocess.Popen, log_path: Path) -> None:
    """Ctrl-C to `mrp serve`: it exits with 0 within a minute."""
    stopped = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    print(f"stopped in {time.monotonic() - stopped:.1f} s")
    assert code == 0, log_path.read_text()[-3000:]


def test_mrp_serve_with_the_openai_client(tmp_path):
    import openai

    if not (embedded_head_dir() / "config.json").is_file():
        pytest.skip("this install has no embedded MRP head")
    pipeline = Pipeline.load()
    port, log_path = free_port(), tmp_path / "serve.log"
    began = time.monotonic()
    process = start_server(port, log_path)
    try:
        banner = wait_for_banner(process, log_path)
        print(f"mrp serve ready after {time.monotonic() - began:.1f} s")
        assert f"ready: http://127.0.0.1:{port}/v1" in banner
        assert "-H 'Content-Type: application/json'" in banner
        assert "from openai import OpenAI" in banner
        tree = process_tree(process.pid)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        before, log_offset = metrics(port), len(log_path.read_text())
        tokens = check_requests(client, pipeline) + check_sampled(client, pipeline)
        after, log_text = metrics(port), log_path.read_text()[log_offset:]
        delta = {name: after[name] - before.get(name, 0.0) for name in after}
        assert delta["mrp_dlm_requests"] == 5 * len(PROMPTS)
        assert delta["mrp_dlm_generated_tokens"] == tokens
        assert delta["mrp_dlm_forwards"] + delta["mrp_dlm_prefill_forwards"] \
            == request_forwards(log_text)
        assert delta["mrp_dlm_accepted_drafts"] <= delta["mrp_dlm_drafts"]
        print(f"served {tokens} tokens in {delta['mrp_dlm_forwards']:.0f} forwards "
              f"({tokens / delta['mrp_dlm_forwards']:.2f} tokens per forward), "
              f"{delta['mrp_dlm_accepted_drafts'] / max(delta['mrp_dlm_draft_rounds'], 1):.2f} "
              "drafts accepted per round")
        burst(client)
    finally:
        interrupt(process, log_path)
    assert left_running(tree) == []
    release = tmp_path / "release"
    subprocess.run([sys.executable, "-m", "mrp_dlm.cli", "export", "--out", str(release)],
                   check=True, capture_output=True)
    check_restart(port, tmp_path / "restart.log", release, pipeline)


def check_logprobs_refused(client, model: str) -> None:
    """A chat or completion request for logprobs gets HTTP 400 saying they are not
    supported, never an empty list."""
    import openai

    for chat, asks in ((True, dict(logprobs=True, top_logprobs=2)), (False, dict(logprobs=2))):
        with pytest.raises(openai.BadRequestError, match="logprobs are not supported"):
            served(client, PROMPTS[0], chat, model, **asks)


def check_restart(port: int, log_path: Path, release: Path, pipeline: Pipeline) -> None:
    """`mrp serve` on the same port at once, while the loaded run's TIME-WAIT connections
    hold it (a plain bind is refused), serving the embedded pair exported in the published
    MRP layout (`mrp export`): it answers as our decoders on that directory do, and stops."""
    import openai

    assert time_wait_count(port) > 0, "the loaded run left no TIME-WAIT connection to test"
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    process = start_server(port, log_path, "--model", str(release))
    try:
        wait_for_banner(process, log_path)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        rule, _, stable = ours(Pipeline.load(release), chat=True)
        stops = pipeline.model.config.stop_token_ids
        for index in stable:
            ids = served(client, PROMPTS[index], True, release.name, temperature=0)[1]
            assert trim_after_stop(ids, stops, MAX_NEW) == rule[index], f"prompt {index}"
        check_logprobs_refused(client, release.name)
    finally:
        interrupt(process, log_path)
