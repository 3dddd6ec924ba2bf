"""Accuracy and speed of every decoding mode on held-out `arith` and `arith-code` problems.

Not a test (never collected by pytest). One run decodes the first `--limit` test problems
of each task with: static (one token per step), dynamic tau in {0.9, 0.7, 0.5}, direct
K in {1, 2}, speculative K in {2, 3, 4} and remask tau in {0.5, 0.7} (confidence rule),
through `mrp_dlm.eval.runner.evaluate`, and reports per task and overall:
- accuracy (the task's grader);
- tokens per backbone forward, end to end (prefill and store included) and denoising only;
- tokens/s (decode wall time only, grading excluded) and the speedup: tokens/s over the
  static tokens/s measured in the same run on the same problems (the paper's throughput
  speedup);
- mean head drafts accepted per speculative round;
- identical-to-static: the fraction of prompts whose generated token ids equal static's
  (speculative must give 1.0: it is lossless).
Wall-clock speedups are judged at batch 1 (the default). A warm-up pass (every config on
two problems) runs first and is excluded. Prints a markdown table, then one JSON line last
(config, git commit, hardware, results).

    python benchmarks/modes.py [--model DIR --head DIR] [--limit 100] [--batch-size 1]
                               [--threads 1] [--device cpu] [--max-new-tokens 128]

Without --model it uses the embedded model and head (mrp_dlm/assets/embedded and
mrp_dlm/assets/embedded-head) and fails with a clear message when they are not built.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from decode import git_commit, hardware  # noqa: E402  (benchmarks/decode.py)
from mrp_dlm.config import MRP_MODES, DecodeConfig  # noqa: E402
from mrp_dlm.eval.runner import EvalResult, evaluate  # noqa: E402
from mrp_dlm.eval.tasks.common import TASK_NAMES, get_task  # noqa: E402
from mrp_dlm.pipeline import GenerateOutput, Pipeline, embedded_head_dir, embedded_model_dir  # noqa: E402

WARMUP_PROBLEMS = 2
MODES = {  # row name -> decode knobs (max_new_tokens is added from the flag)
    "static": dict(mode="static"),
    "dynamic t=0.9": dict(mode="dynamic", threshold=0.9),
    "dynamic t=0.7": dict(mode="dynamic", threshold=0.7),
    "dynamic t=0.5": dict(mode="dynamic", threshold=0.5),
    "dynamic t=0.3": dict(mode="dynamic", threshold=0.3),
    "direct K=1": dict(mode="direct", lookahead=1),
    "direct K=2": dict(mode="direct", lookahead=2),
    "speculative K=2": dict(mode="speculative", lookahead=2),
    "speculative K=3": dict(mode="speculative", lookahead=3),
    "speculative K=4": dict(mode="speculative", lookahead=4),
    "remask t=0.5": dict(mode="remask", threshold=0.5),
    "remask t=0.7": dict(mode="remask", threshold=0.7),
}


@dataclass
class RecordingPipeline(Pipeline):
    """A Pipeline that keeps every generated row's token ids, in call order."""

    token_ids: list[list[int]] = field(default_factory=list)

    def generate(self, prompts: list[str], config: DecodeConfig, chat: bool = False) -> GenerateOutput:
        out = super().generate(prompts, config, chat)
        self.token_ids += out.token_ids
        return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    parser.add_argument("--head", default=None, help="MRP head dir (default: the embedded head "
                        "when --model is not given)")
    parser.add_argument("--limit", type=int, default=100, help="test problems per task")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per decode call")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 keeps the default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tasks", default=",".join(TASK_NAMES), help="comma-separated task names")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated row names to run (static is always run)")
    return parser.parse_args()


def resolve_dirs(model: str | None, head: str | None,
                 need_head: bool) -> tuple[Path, Path | None]:
    model_dir = Path(model) if model else embedded_model_dir()
    if head:
        head_dir = Path(head)
    elif not need_head:
        head_dir = None
    elif model is None:
        head_dir = embedded_head_dir()
    else:
        sys.exit("benchmarks/modes.py: --model needs --head (the MRP modes need a head "
                 "trained on that model)")
    for kind, path, flag, given in (("model", model_dir, "--model", model),
                                    ("head", head_dir, "--head", head)):
        if path is not None and not (path / "config.json").is_file():
            where = f"the {kind}" if given else f"the embedded {kind}"
            sys.exit(f"benchmarks/modes.py: {where} is missing: no config.json in {path}. "
                     f"Build it first, or pass {flag} DIR.")
    return model_dir, head_dir


def peak_memory(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_mode(pipe: RecordingPipeline, task, examples, config: DecodeConfig,
             batch_size: int) -> tuple[EvalResult, list[list[int]]]:
    pipe.token_ids = []
    result = evaluate(pipe, task, examples, config, batch_size)
    return result, pipe.token_ids


def summarise(name: str, task: str, results: list[EvalResult], ids: list[list[int]],
              static_ids: list[list[int]], static_rate: float) -> dict:
    stats = results[0].stats
    for result in results[1:]:
        stats = stats + result.stats
    samples = [s for result in results for s in result.samples]
    rate = stats.tokens / stats.seconds if stats.seconds > 0 else 0.0
    row = dict(task=task, mode=name, n=len(samples),
               accuracy=round(sum(s.correct for s in samples) / max(len(samples), 1), 4),
               tokens_per_forward=round(stats.tokens_per_forward, 3),
               tokens_per_denoise_forward=round(stats.tokens_per_denoise_forward, 3),
               tokens_per_s=round(rate, 1),
               speedup=round(rate / static_rate, 3) if static_rate else None,
               mean_accepted=round(stats.mean_accepted, 3) if stats.rounds else None,
               identical_to_static=round(sum(a == b for a, b in zip(ids, static_ids))
                                         / max(len(ids), 1), 4),
               tokens=stats.tokens, seconds=round(stats.seconds, 3),
               backbone_forwards=stats.backbone_forwards, head_forwards=stats.head_forwards)
    if stats.rounds:
        row["accept_histogram"] = stats.accept_histogram
    return row


def markdown(rows: list[dict]) -> str:
    columns = [("task", "task"), ("mode", "mode"), ("accuracy", "acc"),
               ("tokens_per_forward", "tok/fwd"), ("tokens_per_denoise_forward", "tok/denoise"),
               ("tokens_per_s", "tok/s"), ("speedup", "speedup"),
               ("mean_accepted", "accepted/round"), ("identical_to_static", "same as static")]
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = ["-" if row[key] is None else str(row[key]) for key, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.limit < 1 or args.batch_size < 1:
        sys.exit("benchmarks/modes.py: --limit and --batch-size must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = ["static"] + [name.strip() for name in args.modes.split(",")
                           if name.strip() and name.strip() != "static"]
    unknown = [name for name in chosen if name not in MODES]
    if unknown:
        sys.exit(f"benchmarks/modes.py: unknown mode row(s) {unknown}; choose from {list(MODES)}")
    configs = {name: DecodeConfig(max_new_tokens=args.max_new_tokens, **MODES[name])
               for name in chosen}
    need_head = any(config.mode in MRP_MODES for config in configs.values())
    model_dir, head_dir = resolve_dirs(args.model, args.head, need_head)
    pipe = RecordingPipeline.load(model_dir, args.dtype, args.device, head=head_dir)
    tasks = [get_task(name.strip()) for name in args.tasks.split(",") if name.strip()]

    # Warm-up, excluded: every config on a few problems (allocator, caches, lazy imports).
    warm = tasks[0].examples("test", min(WARMUP_PROBLEMS, args.limit))
    for config in configs.values():
        run_mode(pipe, tasks[0], warm, config, args.batch_size)

    results: dict[str, dict[str, tuple[EvalResult, list[list[int]]]]] = {}
    for task in tasks:
        examples = task.examples("test", args.limit)
        results[task.name] = {name: run_mode(pipe, task, examples, config, args.batch_size)
                              for name, config in configs.items()}

    rows = []
    scopes = [(task.name, [task.name]) for task in tasks]
    if len(tasks) > 1:
        scopes.append(("all", [task.name for task in tasks]))
    for scope, names in scopes:
        static_ids = [i for n in names for i in results[n]["static"][1]]
        static_stats = [results[n]["static"][0].stats for n in names]
        static_rate = (sum(s.tokens for s in static_stats)
                       / max(sum(s.seconds for s in static_stats), 1e-9))
        for name in configs:
            rows.append(summarise(name, scope, [results[n][name][0] for n in names],
                                  [i for n in names for i in results[n][name][1]],
                                  static_ids, static_rate))

    print(f"model {model_dir}, head {head_dir}, {args.limit} problems per task, "
          f"batch {args.batch_size}, {args.device} {args.dtype}, "
          f"max_new_tokens {args.max_new_tokens}\n")
    print(markdown(rows))
    lossy = [r for r in rows if r["mode"].startswith("speculative") and r["identical_to_static"] < 1]
    if lossy:
        print(f"\nWARNING: speculative differs from static on some prompts: "
              f"{[(r['task'], r['mode'], r['identical_to_static']) for r in lossy]}")
    summary = dict(config=dict(model=str(model_dir), head=str(head_dir), limit=args.limit,
                               batch_size=args.batch_size, tasks=[t.name for t in tasks],
                               max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                               warmup_problems=WARMUP_PROBLEMS,
                               modes={name: MODES[name] for name in configs}),
                   commit=git_commit(), hardware=hardware(args.device),
                   peak_memory_bytes=peak_memory(args.device), results=rows)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
