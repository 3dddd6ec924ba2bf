"""`mrp serve` under load: N requests at concurrency C through the openai client, every
answer checked against the library's decode of the same request, for each algorithm; then
Ctrl-C under load, and the next algorithm's server on the same port at once.

Not a test. Per algorithm (MrpSpeculative, MrpRemask (the paper's rule, δ = 2) and
LowConfidence at the same `--threshold`, MrpDirect at the same `--lookahead`), one `mrp
serve` on one port shared by all of them (so each start after the first is a restart right
after a loaded run):
- a warm-up of `--concurrency` requests (not measured);
- `--requests` requests, `--concurrency` in flight, through one openai client without
  retries, cycling through the request kinds and `--prompts` problems of `arith` and
  `arith-code`. Kinds: chat and completion, greedy (temperature 0) and, on MrpSpeculative
  and MrpRemask, seeded sampled (temperature 0.7, top-p 0.95, seed 5). LowConfidence is
  SGLang's own and greedy only (it ignores the temperature); MrpDirect answers sampling
  with HTTP 400 by design. Each answer's prompt and output ids are compared with the
  library's decode of the same request (`Pipeline.generate`: the chat template for chat,
  the raw prompt for completions; dynamic at the threshold for MrpSpeculative and
  LowConfidence, direct at the lookahead for MrpDirect, remask with the paper rule for
  MrpRemask; the same sampling and seed). Reports errors (by the client's exception and
  HTTP status), equal answers, p50/p99 latency, tokens/s, tokens per forward (the plugin's
  counters) and the tree's resident memory;
- Ctrl-C under load: `--concurrency` more requests, SIGINT to `mrp serve` once the first
  is answered; how each ended (answered, and equal or not; failed, with the client's
  error), the exit code and seconds, and the processes of the server's tree left running.
Exit status 0 when every algorithm had no error, only equal answers, exit code 0 and
nothing left.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/serve_load.py --requests 256 \
        --concurrency 64

Deliberately not here: the server's start, stop and counters (`serve_harness.py`); a
comparison of algorithms against each other (`serve_openai.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "serving"))

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402
from mrp_dlm.serving.process import left_running, process_tree, time_wait_count  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402
from serve_harness import (Reply, counters, free_port, request, serve_command,  # noqa: E402
                           start, stop, tree_rss)
from sglang_env import trim_after_stop  # noqa: E402

ALGORITHMS = ("MrpSpeculative", "MrpDirect", "MrpRemask", "LowConfidence")
SAMPLED = dict(temperature=0.7, top_p=0.95, seed=5)  # the OpenAI fields and our knobs alike
GREEDY = dict(temperature=0)
CLIENT_TIMEOUT = 600.0  # seconds: a request that long is an error, never a hang


@dataclass(frozen=True)
class Kind:
    """One kind of request."""

    chat: bool  # chat (the chat template) or completion (the raw prompt)
    sampled: bool  # SAMPLED, else GREEDY

    @property
    def name(self) -> str:
        return f"{'chat' if self.chat else 'completion'} {'sampled' if self.sampled else 'greedy'}"

    @property
    def sampling(self) -> dict:
        return SAMPLED if self.sampled else GREEDY


def kinds_of(algorithm: str) -> list[Kind]:
    samples = (False, True) if algorithm in ("MrpSpeculative", "MrpRemask") else (False,)
    return [Kind(chat, sampled) for sampled in samples for chat in (True, False)]


def library_config(algorithm: str, kind: Kind, args) -> DecodeConfig:
    """The library's decode of a request that `algorithm` serves."""
    mode = {"MrpDirect": "direct", "MrpRemask": "remask"}.get(algorithm, "dynamic")
    sampling = SAMPLED if kind.sampled else {}
    return DecodeConfig(mode=mode, threshold=args.threshold, lookahead=args.lookahead,
                        remask_rule="paper", max_new_tokens=args.max_tokens, **sampling)


@dataclass(frozen=True)
class Expected:
    """The library's answers to one kind of request, per problem."""

    prompt_ids: list[list[int]]  # as the library tokenizes them
    ids: list[list[int]]  # generated ids, trimmed after the first stop id


def library_answers(pipeline, problems: list[str], args) -> dict:
    """Expected per (algorithm, kind), each decode run once (MrpSpeculative's greedy
    requests and LowConfidence's share one)."""
    decoded, answers = {}, {}
    for algorithm in args.algorithms:
        for kind in kinds_of(algorithm):
            config = library_config(algorithm, kind, args)
            if (config, kind.chat) not in decoded:
                out = pipeline.generate(problems, config, chat=kind.chat)
                decoded[config, kind.chat] = Expected(
                    [pipeline.encode(p, kind.chat) for p in problems], out.token_ids)
            answers[algorithm, kind] = decoded[config, kind.chat]
    return answers


@dataclass(frozen=True)
class Outcome:
    """How one request ended."""

    seconds: float  # from send to answer or error
    reply: Reply | None  # None: failed
    error: str | None  # the client's exception and HTTP status, when it failed
    equal: bool = False  # prompt and output ids equal the library's


def send(client, problem: str, kind: Kind, args, expected: Expected, index: int) -> Outcome:
    began = time.perf_counter()
    try:
        reply = request(client, problem, kind.chat, args.max_tokens, **kind.sampling)
    except Exception as error:  # every failure is counted, by the client's own class
        status = getattr(error, "status_code", None)
        return Outcome(time.perf_counter() - began, None,
                       f"{type(error).__name__}{f' {status}' if status else ''}")
    seconds = time.perf_counter() - began
    got = trim_after_stop(reply.ids, args.stop_ids, args.max_tokens)
    equal = reply.prompt_ids == expected.prompt_ids[index] and got == expected.ids[index]
    return Outcome(seconds, reply, None, equal)


def plan(count: int, offset: int, problems: list[str], kinds: list[Kind]) -> list[tuple]:
    """(problem index, kind) of `count` requests: the kinds interleaved, then the problems."""
    return [((i // len(kinds)) % len(problems), kinds[i % len(kinds)])
            for i in range(offset, offset + count)]


def submit(pool, client, requests: list[tuple], problems, answers, algorithm, args) -> list:
    return [pool.submit(send, client, problems[index], kind, args, answers[algorithm, kind],
                        index) for index, kind in requests]


def tally(outcomes: list[Outcome]) -> dict:
    errors = {}
    for outcome in outcomes:
        if outcome.error:
            errors[outcome.error] = errors.get(outcome.error, 0) + 1
    answered = [o for o in outcomes if o.reply is not None]
    return dict(answered=len(answered), equal=sum(o.equal for o in answered), errors=errors)


@dataclass
class Run:
    """One algorithm's server: the load run and the Ctrl-C under load."""

    algorithm: str
    time_wait: int  # TIME-WAIT connections on the port at the start (the last run's)
    start_s: float  # to the ready banner
    load: dict = field(default_factory=dict)  # the measured requests
    stop: dict = field(default_factory=dict)  # Ctrl-C under load

    @property
    def clean(self) -> bool:
        return (not self.load["errors"] and self.load["equal"] == self.load["requests"]
                and self.stop["exit_code"] == 0 and not self.stop["left_running"]
                and self.stop["equal"] == self.stop["answered"])


def measure_load(client, port: int, pool, requests, problems, answers, algorithm, args):
    before = counters(port)
    began = time.perf_counter()
    outcomes = [f.result() for f in submit(pool, client, requests, problems, answers,
                                           algorithm, args)]
    seconds = time.perf_counter() - began
    delta = {k: v - before.get(k, 0.0) for k, v in counters(port).items()}
    latencies = sorted(o.seconds for o in outcomes if o.reply is not None)
    tokens = sum(o.reply.tokens for o in outcomes if o.reply is not None)
    return dict(requests=len(requests), **tally(outcomes), seconds=round(seconds, 1),
                p50_s=round(statistics.median(latencies), 2),
                p99_s=round(statistics.quantiles(latencies, n=100, method="inclusive")[98], 2),
                tokens=tokens, tokens_per_second=round(tokens / seconds, 1),
                tokens_per_forward=round(delta.get("generated_tokens", 0.0)
                                         / max(delta.get("forwards", 0.0), 1), 2),
                accepted_per_round=round(delta.get("accepted_drafts", 0.0)
                                         / max(delta.get("draft_rounds", 0.0), 1), 2))


def stop_under_load(server, client, pool, requests, problems, answers, algorithm, args):
    """Ctrl-C once the first of `requests` is answered; how every request and the tree
    ended."""
    tree = process_tree(server.pid)
    futures = submit(pool, client, requests, problems, answers, algorithm, args)
    wait(futures, timeout=CLIENT_TIMEOUT, return_when=FIRST_COMPLETED)
    in_flight = sum(not f.done() for f in futures)
    code, seconds = stop(server)
    outcomes = [f.result() for f in futures]
    time.sleep(1.0)  # let the kernel reap what SIGKILL hit
    return dict(requests=len(requests), in_flight_at_sigint=in_flight, **tally(outcomes),
                exit_code=code, stop_s=round(seconds, 1), left_running=left_running(tree))


def serve_one(algorithm: str, port: int, problems, answers, args, log: Path) -> Run:
    import openai

    time_wait = time_wait_count(port)
    server, start_seconds = start(serve_command(algorithm, args.threshold, args.lookahead,
                                                port), log)
    run = Run(algorithm, time_wait, round(start_seconds, 1))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=CLIENT_TIMEOUT)
    kinds = kinds_of(algorithm)
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            warmup = plan(args.concurrency, args.requests, problems, kinds)
            for future in submit(pool, client, warmup, problems, answers, algorithm, args):
                future.result()
            run.load = measure_load(client, port, pool, plan(args.requests, 0, problems, kinds),
                                    problems, answers, algorithm, args)
            run.load["rss_gib"] = round(tree_rss(server.pid), 2)
            run.stop = stop_under_load(server, client, pool,
                                       plan(args.concurrency, 0, problems, kinds), problems,
                                       answers, algorithm, args)
    finally:
        if server.poll() is None:
            stop(server)
    return run


def report(runs: list[Run]) -> None:
    print("| algorithm | TIME-WAIT at start | start s | requests | errors | equal | p50 s | "
          "p99 s | tokens/s | tok/fwd | acc/round | RSS GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        load = run.load
        print(f"| {run.algorithm} | {run.time_wait} | {run.start_s} | {load['requests']} | "
              f"{sum(load['errors'].values())} | {load['equal']}/{load['requests']} | "
              f"{load['p50_s']} | {load['p99_s']} | {load['tokens_per_second']} | "
              f"{load['tokens_per_forward']} | {load['accepted_per_round']} | "
              f"{load['rss_gib']} |")
    print("\n| algorithm | in flight at Ctrl-C | answered (equal) | failed | exit | stop s | "
          "left |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        stopped = run.stop
        print(f"| {run.algorithm} | {stopped['in_flight_at_sigint']} | {stopped['answered']} "
              f"({stopped['equal']}) | {stopped['errors'] or 0} | {stopped['exit_code']} | "
              f"{stopped['stop_s']} | {len(stopped['left_running'])} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="requests measured")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--prompts", type=int, default=64, help="distinct problems")
    parser.add_argument("--threshold", type=float, default=DecodeConfig.threshold)
    parser.add_argument("--lookahead", type=int, default=DecodeConfig.lookahead)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS),
                        choices=ALGORITHMS)
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from mrp_dlm.pipeline import Pipeline

    args = parse_args(argv)
    half = args.prompts // 2 + 1
    problems = [e.problem for name in ("arith", "arith-code")
                for e in get_task(name).examples("test", half)][:args.prompts]
    load_before = os.getloadavg()
    pipeline = Pipeline.load()
    args.stop_ids = pipeline.model.config.stop_token_ids
    answers = library_answers(pipeline, problems, args)
    port = args.port or free_port()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in args.algorithms:
            runs.append(serve_one(algorithm, port, problems, answers, args,
                                  Path(tmp) / f"{algorithm}.log"))
            print(f"{algorithm}: {json.dumps(runs[-1].__dict__)}", flush=True)
    report(runs)
    config = {k: v for k, v in vars(args).items() if k != "stop_ids"}
    print(json.dumps(dict(config=config, port=port, commit=git_commit(),
                          hardware=hardware("cpu"), load_average_before=load_before,
                          load_average_after=os.getloadavg(), runs=[r.__dict__ for r in runs],
                          clean=all(r.clean for r in runs))))
    return 0 if all(r.clean for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
