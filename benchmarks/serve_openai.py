"""`mrp serve` as a user runs it, timed: LowConfidence and MrpSpeculative at the same
threshold on the embedded model, each behind its own `mrp serve` with the openai client.

Not a test. Per algorithm: one server start (timed to the ready banner), the resident
memory of its process tree, a 2-request warm-up, then `--requests` chat requests of
`arith` and `arith-code` sent `--concurrency` at a time (temperature left out: greedy),
then Ctrl-C (timed to exit). Reports tokens/s against LowConfidence's in the same run,
tokens per forward and accepted drafts per round from the plugin's counters on /metrics,
and whether every output equals LowConfidence's. Needs SGLang (`.ci/install_sglang.sh`
on a CPU) and the openai client.

    OMP_NUM_THREADS=1 python benchmarks/serve_openai.py --requests 16 --concurrency 8

Deliberately not here: the engine API (see `sglang_cpu_concurrency.py`); checks against the
library's decode, sampled and completion requests, and Ctrl-C under load (see
`serve_load.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402
from serve_harness import (counters, free_port, request, serve_command, start,  # noqa: E402
                           stop, tree_rss)


def ask(client, problems: list[str], max_tokens: int, concurrency: int) -> list:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda problem: request(client, problem, True, max_tokens),
                             problems))


def measure(algorithm: str, args, problems: list[str], warmup: list[str], tmp: Path) -> dict:
    import openai

    port = free_port()
    server, start_seconds = start(serve_command(algorithm, args.threshold, args.lookahead, port),
                                  tmp / f"{algorithm}.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        ask(client, warmup, args.max_tokens, args.concurrency)
        before = counters(port)
        began = time.perf_counter()
        replies = ask(client, problems, args.max_tokens, args.concurrency)
        seconds = time.perf_counter() - began
        delta = {k: v - before.get(k, 0.0) for k, v in counters(port).items()}
        rss = tree_rss(server.pid)
    finally:
        _, stop_seconds = stop(server)
    tokens = sum(r.tokens for r in replies)
    return dict(algorithm=algorithm, start_s=round(start_seconds, 1),
                stop_s=round(stop_seconds, 1), rss_gib=round(rss, 2),
                seconds=round(seconds, 2), tokens=tokens,
                tokens_per_second=round(tokens / seconds, 1),
                tokens_per_forward=round(delta["generated_tokens"] / delta["forwards"], 3),
                accepted_per_round=round(delta["accepted_drafts"]
                                         / max(delta["draft_rounds"], 1), 2),
                texts=[r.text for r in replies])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="chat requests measured")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--threshold", type=float, default=DecodeConfig.threshold)
    parser.add_argument("--lookahead", type=int, default=DecodeConfig.lookahead)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    half = args.requests // 2 + 1
    problems = [e.problem for name in ("arith", "arith-code")
                for e in get_task(name).examples("test", half + 1)]
    warmup, problems = problems[:2], problems[2:2 + args.requests]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ("LowConfidence", "MrpSpeculative"):
            rows.append(measure(algorithm, args, problems, warmup, Path(tmp)))
    texts = [row.pop("texts") for row in rows]
    for row, text in zip(rows, texts):
        row["vs_low_confidence"] = round(row["tokens_per_second"] / rows[0]["tokens_per_second"],
                                         3)
        row["identical"] = text == texts[0]
        print(row, flush=True)
    print(json.dumps(dict(requests=args.requests, concurrency=args.concurrency,
                          threshold=args.threshold, lookahead=args.lookahead,
                          max_tokens=args.max_tokens, commit=git_commit(),
                          hardware=hardware("cpu"), rows=rows)))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
