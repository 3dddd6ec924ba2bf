"""One-shot `mrp generate`: speculative vs dynamic at one threshold, one process per prompt.

Each prompt is an `arith` story from seeds outside the train and test splits (and not in
the test split's texts), decoded by `mrp generate --json --chat` --repeats times per mode,
each in a process of its own, the modes alternating. A speculative process starts from the
round costs and acceptance the cost cache holds (`decoding/cost_cache.py`): the run uses
its own cache folder ($XDG_CACHE_HOME in a temporary directory), filled first by WARMING
untimed speculative processes on other stories (--cold: no cache, `--no-cost-cache`, each
process learns afresh). Per prompt: each mode's median decode seconds over its processes
(`stats.seconds`; a process's speed on this machine varies by a third from one to the next,
whatever it runs), speculative's speed over dynamic's, and whether the tokens are
identical; in all: summed dynamic over summed speculative seconds, and the median ratio.
Extra flags go to `mrp generate`.

    python benchmarks/one_shot.py --prompts 16 --repeats 3 --threshold 0.9 [--cold] \
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mrp_dlm.tasks.arith import ArithTask

OUTSIDE_SEED = 3_000_000_000  # stories from here on: neither the train seeds nor the test's
WARMING = 8  # untimed processes that fill the cost cache before the timed ones


def stories(count: int) -> list[str]:
    """`count` + WARMING distinct story prompts outside the test split (the last WARMING
    for warming the cache)."""
    task = ArithTask()
    test = {example.problem for example in task.test_examples}
    found: list[str] = []
    seed = OUTSIDE_SEED
    while len(found) < count + WARMING:
        text = task.prompt(task.make_example(seed))
        if text not in test and text not in found:
            found.append(text)
        seed += 1
    return found


def run(prompt: str, mode: str, threshold: float, extra: list[str], env: dict) -> dict:
    """One `mrp generate` process: its JSON (text, token_ids, stats)."""
    argv = [sys.executable, "-m", "mrp_dlm.cli", "generate", "--json", "--chat", "--mode", mode,
            "--threshold", str(threshold), "--prompt", prompt, *extra]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"mrp generate --mode {mode} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm(prompts: list[str], threshold: float, extra: list[str], env: dict,
         cache: Path) -> None:
    """Untimed speculative processes on other stories, one each: the cache holds learnt
    costs (not only a probe's samples) and the acceptance they saw."""
    for prompt in prompts:
        run(prompt, "speculative", threshold, extra, env)
    if not any(json.loads(path.read_text())["costs"]
               for path in (cache / "mrp-dlm" / "costs").glob("*.json")):
        raise SystemExit(f"{len(prompts)} warm-up processes learnt no round costs; give more "
                         "--max-new-tokens")


def timed(prompt: str, threshold: float, repeats: int, extra: dict[str, list[str]],
          env: dict) -> dict:
    """One prompt's row: per mode the median decode seconds of `repeats` processes (the
    modes alternating), and whether every process gave the same tokens."""
    seconds: dict[str, list[float]] = {"dynamic": [], "speculative": []}
    tokens = []
    for _ in range(repeats):
        for mode in seconds:
            out = run(prompt, mode, threshold, extra[mode], env)
            seconds[mode].append(out["stats"]["seconds"])
            tokens.append(out["token_ids"])
    row = {f"{mode}_s": statistics.median(values) for mode, values in seconds.items()}
    row["identical"] = all(ids == tokens[0] for ids in tokens)
    row["speed"] = row["dynamic_s"] / max(row["speculative_s"], 1e-9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="processes per prompt and mode")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--cold", action="store_true", help="no cost cache (--no-cost-cache)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args, extra = parser.parse_known_args()
    prompts = stories(args.prompts)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        speculative = [*extra, "--no-cost-cache"] if args.cold else extra
        if not args.cold:
            warm(prompts[args.prompts:], args.threshold, extra, env, Path(cache))
        rows = []
        for index, prompt in enumerate(prompts[:args.prompts]):
            row = {"prompt": index, **timed(prompt, args.threshold, args.repeats,
                                            {"dynamic": extra, "speculative": speculative},
                                            env)}
            rows.append(row)
            print(f"prompt {index:2d}: dynamic {row['dynamic_s']:.3f} s, speculative "
                  f"{row['speculative_s']:.3f} s, {row['speed']:.2f}x, identical "
                  f"{row['identical']}", flush=True)
    speeds = [row["speed"] for row in rows]
    summed = sum(r["dynamic_s"] for r in rows) / sum(r["speculative_s"] for r in rows)
    print(f"speculative / dynamic speed: summed {summed:.3f}x, median "
          f"{statistics.median(speeds):.3f}x, min {min(speeds):.2f}x, all identical "
          f"{all(r['identical'] for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps({"cold": args.cold, "threshold": args.threshold,
                                         "repeats": args.repeats, "summed": summed,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
