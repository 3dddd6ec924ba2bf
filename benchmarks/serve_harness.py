"""An `mrp serve` seen from its clients, for the serving benchmarks (`serve_openai.py`,
`serve_load.py`): start it on a free port and time it to the ready banner, read the
plugin's counters on /metrics, the memory and processes of its tree, one openai request
with its token ids, and Ctrl-C timed to exit.

Not a benchmark itself (no `main`). Deliberately not here: what to send and what to
compare (each benchmark decides), and the server's own supervision and port check
(`mrp_dlm/serving/process.py`, whose process-tree and TIME-WAIT helpers the benchmarks use
too).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mrp_dlm.serving.process import process_tree

START_SECONDS = 600  # a start takes 40-90 s on the 2 shared cores here
STOP_SECONDS = 120  # Ctrl-C -> exit; `mrp serve` kills its tree after 20 s of grace


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(algorithm: str, threshold: float, lookahead: int, port: int) -> list[str]:
    """`mrp serve` (this checkout's) for `algorithm`, with the metrics endpoint on.
    MrpDirect takes no threshold; LowConfidence no lookahead."""
    command = [sys.executable, "-m", "mrp_dlm.cli", "serve", "--algorithm", algorithm,
               "--port", str(port)]
    if algorithm != "MrpDirect":
        command += ["--threshold", str(threshold)]
    if algorithm != "LowConfidence":
        command += ["--lookahead", str(lookahead)]
    return command + ["--", "--enable-metrics"]


def start(command: list[str], log: Path) -> tuple[subprocess.Popen, float]:
    """The server, logging to `log`, once it printed its ready banner; with the seconds that
    took."""
    with open(log, "w") as handle:
        server = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)
    began = time.perf_counter()
    while "\nready: " not in log.read_text():
        if server.poll() is not None or time.perf_counter() - began > START_SECONDS:
            server.kill()
            raise RuntimeError(f"mrp serve did not get ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return server, time.perf_counter() - began


def stop(server: subprocess.Popen) -> tuple[int, float]:
    """Ctrl-C (SIGINT) to `mrp serve`: (its exit code, seconds to exit)."""
    began = time.perf_counter()
    server.send_signal(signal.SIGINT)
    try:
        code = server.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        server.kill()
        code = server.wait()
    return code, time.perf_counter() - began


def counters(port: int) -> dict[str, float]:
    """The plugin's counters on /metrics, by name without `mrp_dlm_` and `_total`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^mrp_dlm_(\w+)_total\{[^}]*\} (\S+)$", text, re.M)}


def tree_rss(pid: int) -> float:
    """GiB resident in the server's process tree."""
    return sum(p.memory_info().rss for p in process_tree(pid)) / 2**30


@dataclass(frozen=True)
class Reply:
    """One served request."""

    prompt_ids: list[int]  # the prompt as the server tokenized it (chat template included)
    ids: list[int]  # the output token ids
    tokens: int  # completion tokens its usage reports
    text: str  # the output text


def request(client, prompt: str, chat: bool, max_tokens: int, **sampling) -> Reply:
    """A chat (the prompt as the user's message) or completion request through the openai
    client, with its token ids (SGLang's `return_token_ids`)."""
    if chat:
        reply = client.chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens, extra_body={"return_token_ids": True}, **sampling)
        extra = reply.choices[0].model_extra
        return Reply(extra["prompt_token_ids"], extra["response_token_ids"],
                     reply.usage.completion_tokens, reply.choices[0].message.content)
    reply = client.completions.create(model="embedded", prompt=prompt, max_tokens=max_tokens,
                                      extra_body={"return_token_ids": True}, **sampling)
    extra = reply.choices[0].model_extra
    return Reply(extra["prompt_token_ids"], extra["token_ids"], reply.usage.completion_tokens,
                 reply.choices[0].text)
