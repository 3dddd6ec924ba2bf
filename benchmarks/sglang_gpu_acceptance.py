"""GPU acceptance of the SGLang plugin: MrpSpeculative is lossless and faster.

Launches an SGLang server four times on one GPU, on the same prompts, greedy:
  baseline     LowConfidence at --threshold (default 0.9; 1.0: static decoding, one token
               per forward)
  speculative  MrpSpeculative, lookahead K (default 3), at the same threshold
each with CUDA graphs on and off, all with --enable-deterministic-inference (a
batch-invariant forward: bf16 results must not depend on which requests share a batch) and
the attention backend `mrp serve` would choose for bf16 and the model's head_dim
(`mrp_dlm/serving/attention_backend.py`; the same for both algorithms, so SGLang overrides
neither; --attention-backend to force one). The request table holds
concurrency x (lookahead + 1) rows, so rows stay free for MrpSpeculative's verify copies
(with the cap at the concurrency none is free, nothing drafts, and both runs would time
LowConfidence). Asserts that every speculative output equals the baseline output of the
same graph setting and that MrpSpeculative drafted in the timed batch (the plugin's stats
line), then prints a table (tokens per forward, drafts, tokens/s, wall time) and one JSON
line last, with the attention backend each server ran (its /server_info).

Tokens per forward: output tokens / request forwards, where SGLang logs one
"Prefill batch, #new-seq: n" line per dLLM forward of n requests (a verify forward's extra
candidate rows are not requests, so they are not counted); only the timed batch counts.

Needs a GPU host with `pip install -e '.[sglang]'` (and network access to the model, or a
local path). It cannot run on a CPU-only machine; `--help` works everywhere.

    python benchmarks/sglang_gpu_acceptance.py --model JetLM/SDAR-8B-Chat-b16 \
        --head /models/sdar-8b-b16-mrp-head --block-size 16

Deliberately not here: accuracy on benchmarks (see `mrp_dlm/eval/`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from mrp_dlm.config import DecodeConfig

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
    "babysitting. How much did she earn?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the "
    "money she needs. Her parents decided to give her $15 for that purpose, and her "
    "grandparents twice as much as her parents. How much more money does Betty need?",
    "What is the sum of the first 20 positive odd numbers? Explain step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does "
    "he write a year?",
    "Find the remainder when 2^100 is divided by 7.",
]
FORWARDS = re.compile(r"Prefill batch.*?#new-seq: (\d+)")
DRAFT_ROUNDS = re.compile(r"\((\d+) rounds; drafts (\d+) head, (\d+) self\)")  # stats.py
SDAR_HEAD_DIM = 128  # when the model's config.json is not on disk (a hub id)


@dataclass(frozen=True)
class Run:
    algorithm: str  # LowConfidence or MrpSpeculative
    cuda_graph: bool  # CUDA graphs on
    outputs: list  # output token ids per prompt
    seconds: float  # wall time of the whole batch of requests
    tokens: int  # output tokens over all prompts
    tokens_per_forward: float | None  # end to end, decode blocks
    attention_backend: str  # what the server ran (its /server_info), "unknown" if unread
    draft_rounds: int  # rounds that verified drafts in the timed batch (MrpSpeculative)
    drafts: int  # drafts made for those rounds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="SDAR checkpoint (path or hub id)")
    parser.add_argument("--head", required=True, help="MRP head directory for this model")
    parser.add_argument("--block-size", type=int, default=16, help="L, the head's block size")
    parser.add_argument("--lookahead", type=int, default=3, help="K of MrpSpeculative")
    parser.add_argument("--threshold", type=float, default=DecodeConfig.threshold,
                        help="the LowConfidence threshold both runs use (1.0: static)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per prompt")
    parser.add_argument("--prompts", type=Path, help="JSONL file with a 'prompt' per line "
                        "(default: 8 built-in math and code prompts)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--port", type=int, default=30100)
    parser.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds")
    parser.add_argument("--attention-backend", default=None, help="default: `mrp serve`'s "
                        "choice for bf16 and the model's head_dim")
    parser.add_argument("--extra-server-args", default="", help="appended to every launch")
    return parser.parse_args(argv)


def request_rows(args: argparse.Namespace) -> int:
    """--max-running-requests: each request in flight plus a verify copy per draft."""
    return args.concurrency * (args.lookahead + 1)


def head_dim_of(model: str) -> int:
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return SDAR_HEAD_DIM
    raw = json.loads(config.read_text())
    return int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])


def attention_flags(args: argparse.Namespace, cuda_graph: bool) -> list[str]:
    """The backend both algorithms run (graphs off when SGLang would override it)."""
    from mrp_dlm.serving.attention_backend import choose_attention

    if args.attention_backend:
        return ["--attention-backend", args.attention_backend]
    choice = choose_attention("cuda", "bfloat16", head_dim_of(args.model), cuda_graph, False)
    return choice.flags("cuda")


def draft_rounds(text: str) -> tuple[int, int]:
    """(rounds, drafts) of the last stats line in `text` (cumulative per server)."""
    found = DRAFT_ROUNDS.findall(text)
    if not found:
        return 0, 0
    rounds, head, self_drafts = (int(n) for n in found[-1])
    return rounds, head + self_drafts


def find_key(value, key: str):
    """The first value of `key` anywhere in a JSON value, else None."""
    if isinstance(value, dict):
        if key in value:
            return value[key]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def served_backend(args: argparse.Namespace) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/server_info",
                                    timeout=30) as response:
            return str(find_key(json.loads(response.read()), "attention_backend") or "unknown")
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return "unknown"


def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return PROMPTS
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def launch(args: argparse.Namespace, algorithm: str, config: Path, cuda_graph: bool,
           log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
               "--trust-remote-code", "--port", str(args.port),
               "--dllm-algorithm", algorithm, "--dllm-algorithm-config", str(config),
               "--enable-deterministic-inference", *attention_flags(args, cuda_graph),
               "--max-running-requests", str(request_rows(args)), "--log-level", "info"]
    if not cuda_graph:
        command.append("--disable-cuda-graph")
    command += args.extra_server_args.split()
    handle = open(log_path, "w")
    return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)


def wait_ready(args: argparse.Namespace, server: subprocess.Popen, log_path: Path) -> None:
    deadline = time.time() + args.startup_timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(5)
    raise TimeoutError(f"the server did not become ready; see {log_path}")


def generate(args: argparse.Namespace, prompt: str) -> list[int]:
    body = json.dumps({"text": prompt, "sampling_params": {
        "max_new_tokens": args.max_new_tokens, "temperature": 0}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{args.port}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        answer = json.loads(response.read())
    if "output_ids" not in answer:
        raise RuntimeError(f"unexpected answer: {answer}")
    return answer["output_ids"]


def read_log(log_path: Path, offset: int) -> tuple[str, str]:
    """(the log before `offset` bytes, the log after)."""
    with open(log_path, errors="replace") as handle:
        text = handle.read()
    return text[:offset], text[offset:]


def tokens_per_forward(outputs: list[list[int]], timed: str) -> float | None:
    """Output tokens per request forward, from the timed part of the log."""
    forwards = sum(int(n) for n in FORWARDS.findall(timed))
    return sum(len(ids) for ids in outputs) / forwards if forwards else None


def serve_once(args: argparse.Namespace, algorithm: str, config: Path, cuda_graph: bool,
               prompts: list[str], workdir: Path) -> Run:
    log_path = workdir / f"{algorithm}-graph{int(cuda_graph)}.log"
    server = launch(args, algorithm, config, cuda_graph, log_path)
    try:
        wait_ready(args, server, log_path)
        backend = served_backend(args)
        generate(args, prompts[0])  # warm-up, excluded from the timing
        time.sleep(1.0)  # let the warm-up's log lines land before the offset is taken
        offset = log_path.stat().st_size
        began = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            outputs = list(pool.map(lambda p: generate(args, p), prompts))
        seconds = time.perf_counter() - began
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    time.sleep(1.0)  # the last requests' stats lines
    before, timed = read_log(log_path, offset)
    (rounds_before, drafts_before), (rounds, drafts) = draft_rounds(before), draft_rounds(
        before + timed)
    return Run(algorithm, cuda_graph, outputs, seconds, sum(len(o) for o in outputs),
               tokens_per_forward(outputs, timed), backend, rounds - rounds_before,
               drafts - drafts_before)


def write_configs(args: argparse.Namespace, workdir: Path) -> dict[str, Path]:
    baseline = workdir / "low_confidence.yaml"
    baseline.write_text(f"threshold: {args.threshold}\nblock_size: {args.block_size}\n")
    speculative = workdir / "mrp.yaml"
    speculative.write_text(f"head: {args.head}\nlookahead: {args.lookahead}\n"
                           f"threshold: {args.threshold}\nblock_size: {args.block_size}\n")
    return {"LowConfidence": baseline, "MrpSpeculative": speculative}


def report(runs: list[Run], args: argparse.Namespace) -> None:
    print(f"{'algorithm':<16}{'graphs':>7}{'attention':>12}{'tok/fwd':>9}{'drafts':>8}"
          f"{'tok/s':>9}{'seconds':>9}{'tokens':>8}")
    for run in runs:
        rate = "n/a" if run.tokens_per_forward is None else f"{run.tokens_per_forward:.3f}"
        print(f"{run.algorithm:<16}{'on' if run.cuda_graph else 'off':>7}"
              f"{run.attention_backend:>12}{rate:>9}{run.drafts:>8}"
              f"{run.tokens_per_second:>9.1f}{run.seconds:>9.2f}{run.tokens:>8}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    summary = {"config": {k: str(v) for k, v in vars(args).items()}, "commit": commit,
               "hardware": gpu_name(),
               "runs": [{k: v for k, v in asdict(r).items() if k != "outputs"}
                        | {"tokens_per_second": round(r.tokens_per_second, 2)} for r in runs]}
    print(json.dumps(summary))


def gpu_name() -> str:
    result = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                            capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def check_drafted(speculative: Run, baseline: Run, workdir: Path) -> None:
    """MrpSpeculative verified drafts in the timed batch, on the baseline's backend."""
    if speculative.draft_rounds <= 0:
        raise AssertionError(f"MrpSpeculative verified no drafts (graphs "
                             f"{'on' if speculative.cuda_graph else 'off'}): no request-table "
                             f"row was free for a verify copy? logs: {workdir}")
    if speculative.attention_backend != baseline.attention_backend:
        raise AssertionError(f"the two servers ran different attention backends "
                             f"({baseline.attention_backend}, {speculative.attention_backend})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts)
    workdir = Path(tempfile.mkdtemp(prefix="sglang-acceptance-"))
    configs = write_configs(args, workdir)
    runs = []
    for cuda_graph in (True, False):
        for algorithm in ("LowConfidence", "MrpSpeculative"):
            runs.append(serve_once(args, algorithm, configs[algorithm], cuda_graph, prompts,
                                   workdir))
        baseline, speculative = runs[-2], runs[-1]
        check_drafted(speculative, baseline, workdir)
        for index, (want, got) in enumerate(zip(baseline.outputs, speculative.outputs)):
            if want != got:
                raise AssertionError(f"graphs {'on' if cuda_graph else 'off'}, prompt {index}: "
                                     f"MrpSpeculative differs from the static baseline\n"
                                     f"baseline {want}\nspeculative {got}\nlogs: {workdir}")
    report(runs, args)
    print(f"logs: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
