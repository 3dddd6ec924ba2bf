"""Candidate sets (`decoding/candidates.py`) on a real model: how often the set holds the
backbone's step against the draft alone, and what forced set sizes cost in wall clock.

Not a test (never collected by pytest). Decodes the first `--problems` test problems of
each task (chat template, greedy, batch `--batch`) with speculative decoding, K = 3, at
each τ and draft source (`--drafters`: head drafts or self-drafts), once per set size:
- `c` = 1..4: every round drafts K from the source (a fixed plan) with a set of c
  candidates per later draft (`tests/planners.py`: FixedSets);
- `auto`: the library's own decoder (adaptive: plan and set size from its measured
  acceptance, hit rates and costs).
Every config is decoded `--repeats` times, interleaved (all configs once, then again), and
its fastest pass counts, so load on a shared machine hits all alike; speed is reported
against c = 1 of the same τ and source. Hit rates come from the planner's counts over all
passes: per later draft tried, the share accepted (the draft alone) and the share where
the draft or one of the first c - 1 alternatives equals the backbone's step (the set of
size c), each counted up to a row's first rejection.

Every config must give the same ids as c = 1 (speculation is lossless; `differ` counts
rows that do not). One JSON line last.

    OMP_NUM_THREADS=1 python benchmarks/candidate_sets.py --problems 20
    python benchmarks/candidate_sets.py --device cuda --batch 8 --out $OUT/candidate_sets

Deliberately not here: timing single forwards (`benchmarks/round_cost.py`), accuracy
(`mrp bench`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.decoding.costs import HEAD, SELF  # noqa: E402
from mrp_dlm.decoding.drafting import MOST_SET  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.decoding.speculative import SpeculativeDecoder  # noqa: E402
from mrp_dlm.decoding.stats import DecodeStats  # noqa: E402
from mrp_dlm.eval import provenance  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402
from mrp_dlm.pipeline import Pipeline  # noqa: E402
from planners import FixedSets  # noqa: E402

LOOKAHEAD = 3
AUTO = "auto"


def fixed_decoder(config: DecodeConfig, pipe: Pipeline, size: int,
                  batch: int) -> SpeculativeDecoder:
    """A decoder whose every round drafts K from config's source with sets of `size`; its
    planner still counts verdicts and alternative hits (adaptive, no cost probe)."""
    decoder = make_decoder(config, pipe.head_for(config))
    source = HEAD if decoder.head is not None else SELF
    decoder.planner = FixedSets(size, LOOKAHEAD, adaptive=True, head=decoder.head is not None,
                                sources=(source,) * LOOKAHEAD, keys=range(1, batch + 1))
    return decoder


def decode_pass(pipe: Pipeline, prompts: list[list[int]], batch: int, config: DecodeConfig,
                decoder: SpeculativeDecoder) -> tuple[float, DecodeStats, list[list[int]]]:
    """Every prompt once, `batch` at a time: seconds, summed stats and ids."""
    total, ids = DecodeStats(), []
    began = time.perf_counter()
    for start in range(0, len(prompts), batch):
        result = generate(pipe.model, prompts[start:start + batch], config, decoder)
        total, ids = total + result.stats, ids + result.token_ids
    return time.perf_counter() - began, total, ids


def hit_rates(decoder: SpeculativeDecoder, size: int) -> tuple[float, float]:
    """(draft alone, set of `size`): shares of later drafts tried whose draft, or whose set,
    equals the backbone's step, pooled over sources and depths."""
    planner = decoder.planner
    tried = sum(sum(a.tried) for a in planner.acceptance.values())
    accepted = sum(sum(a.accepted) for a in planner.acceptance.values())
    rescued = sum(sum(s.hits[:size - 1]) for s in planner.hits.values())
    return accepted / max(tried, 1), (accepted + rescued) / max(tried, 1)


def measure(pipe: Pipeline, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    settings = [(t, d, s) for t in args.thresholds for d in args.drafters for s in args.sizes]
    decoders, best, runs = {}, {}, {}
    for key in settings:
        threshold, drafter, size = key
        config = DecodeConfig(mode="speculative", lookahead=LOOKAHEAD, threshold=threshold,
                              drafter=drafter)
        decoders[key] = (config, make_decoder(config, pipe.head_for(config)) if size == AUTO
                         else fixed_decoder(config, pipe, size, args.batch))
        decode_pass(pipe, prompts[:2], args.batch, *decoders[key])  # warm-up, excluded
    for _ in range(args.repeats):
        for key in settings:
            seconds, stats, ids = decode_pass(pipe, prompts, args.batch, *decoders[key])
            best[key] = min(best.get(key, seconds), seconds)
            runs[key] = (stats, ids)
    rows = []
    for threshold, drafter, size in settings:
        key, base = (threshold, drafter, size), (threshold, drafter, 1)
        stats, ids = runs[key]
        decoder = decoders[key][1]
        alone, in_set = hit_rates(decoder, MOST_SET if size == AUTO else size)
        rows.append({"threshold": threshold, "drafter": drafter, "size": size,
                     "draft_hit": round(alone, 4), "set_hit": round(in_set, 4),
                     "rescued_rounds": stats.rescued, "rounds": stats.rounds,
                     "tokens_per_forward": round(stats.tokens_per_forward, 4),
                     "seconds": round(best[key], 4),
                     "speed_vs_size_1": round(best[base] / best[key], 3) if base in best else None,
                     "differ": sum(a != b for a, b in zip(ids, runs.get(base, runs[key])[1]))})
    return rows


COLUMNS = (  # table heading, a row's cell
    ("τ", lambda r: f"{r['threshold']}"), ("drafter", lambda r: r["drafter"]),
    ("set size", lambda r: f"{r['size']}"), ("draft = step", lambda r: f"{r['draft_hit']:.1%}"),
    ("set ∋ step", lambda r: f"{r['set_hit']:.1%}"),
    ("rescued / rounds", lambda r: f"{r['rescued_rounds']} / {r['rounds']}"),
    ("tok/fwd", lambda r: f"{r['tokens_per_forward']:.3f}"),
    ("seconds (best)", lambda r: f"{r['seconds']:.3f}"),
    ("speed vs size 1", lambda r: f"{r['speed_vs_size_1'] or '-'}x"),
    ("differ", lambda r: f"{r['differ']}"))


def table(rows: list[dict]) -> str:
    lines = [[name for name, _ in COLUMNS], ["---"] * len(COLUMNS)]
    lines += [[cell(row) for _, cell in COLUMNS] for row in rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: the embedded one)")
    parser.add_argument("--tasks", default="arith,arith-code", help="comma-separated tasks")
    parser.add_argument("--problems", type=int, default=20, help="first test problems per task")
    parser.add_argument("--thresholds", default="0.9,1.0", help="comma-separated τ values")
    parser.add_argument("--drafters", default="head,self", help="comma-separated sources")
    parser.add_argument("--sizes", default=f"1,2,3,4,{AUTO}",
                        help=f"comma-separated set sizes (1-{MOST_SET}) or {AUTO!r}")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed passes")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--dtype", default=None,
                        help="model dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    parser.add_argument("--out", type=Path, default=None, help="also write DIR/candidate_sets.json")
    args = parser.parse_args()
    args.thresholds = [float(value) for value in args.thresholds.split(",")]
    args.drafters = args.drafters.split(",")
    args.sizes = [value if value == AUTO else int(value) for value in args.sizes.split(",")]
    return args


def main() -> None:
    args = parse_args()
    pipe = Pipeline.load(args.model, args.dtype, args.device)
    tasks = [get_task(name) for name in args.tasks.split(",")]
    prompts = [pipe.encode(task.prompt(example), chat=True)
               for task in tasks for example in task.examples("test", args.problems)]
    rows = measure(pipe, prompts, args)
    print(table(rows))
    line = json.dumps({"rows": rows, "problems": len(prompts), "batch": args.batch,
                       "repeats": args.repeats, "git": provenance.git_commit(),
                       "hardware": provenance.hardware(args.device)})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "candidate_sets.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
