"""SGLang on this CPU with many concurrent requests: MrpSpeculative (adaptive and fixed K)
against LowConfidence at the same threshold, on the embedded model and head.

Not a test. One engine start per algorithm setting (30-70 s each on a CPU); every setting
decodes the same chat prompts of `arith` and `arith-code` submitted together, so that up
to `--concurrency` requests share each forward, after a warm-up batch. Prints the wall
time, tokens/s against LowConfidence's and whether every output equals LowConfidence's.
Needs SGLang installed for the CPU (`.ci/install_sglang.sh`).

    OMP_NUM_THREADS=1 python benchmarks/sglang_cpu_concurrency.py --requests 10

Deliberately not here: GPU serving (see `sglang_gpu_acceptance.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "serving"))

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.pipeline import Pipeline, embedded_head_dir, embedded_model_dir  # noqa: E402
from mrp_dlm.tasks.registry import get_task  # noqa: E402


def settings(threshold: float, lookahead: int, head: Path) -> dict[str, tuple[str, str]]:
    """Label -> (algorithm, YAML text)."""
    mrp = f"head: {head}\nlookahead: {lookahead}\nthreshold: {threshold}\n"
    return {"LowConfidence": ("LowConfidence", f"threshold: {threshold}\n"),
            "MrpSpeculative adaptive": ("MrpSpeculative", mrp + "adaptive: true\n"),
            "MrpSpeculative fixed K": ("MrpSpeculative", mrp + "adaptive: false\n")}


def serve(algorithm: str, config: Path, prompts: list[list[int]], warmup: list[list[int]],
          max_new: int, concurrency: int) -> tuple[list[list[int]], float]:
    from sglang_env import generate_ids, require_sglang, start_engine, stop_engine

    require_sglang()  # the CPU stand-ins SGLang needs here (the test suite's own helper)
    engine = start_engine(embedded_model_dir(), algorithm, config, concurrency)
    try:
        generate_ids(engine, warmup, max_new)
        began = time.perf_counter()
        outputs = generate_ids(engine, prompts, max_new)
        return outputs, time.perf_counter() - began
    finally:
        stop_engine(engine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10, help="prompts submitted together")
    parser.add_argument("--threshold", type=float, default=DecodeConfig.threshold)
    parser.add_argument("--lookahead", type=int, default=DecodeConfig.lookahead)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    pipe = Pipeline.load()
    problems = [e.problem for name in ("arith", "arith-code")
                for e in get_task(name).examples("test", args.requests + 2)]
    ids = [pipe.encode(p, chat=True) for p in problems]
    warmup, prompts = ids[:2], ids[2:2 + args.requests]
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for label, (algorithm, text) in settings(args.threshold, args.lookahead,
                                                 embedded_head_dir()).items():
            config = Path(tmp) / f"{label.replace(' ', '_')}.yaml"
            config.write_text(text)
            outputs, seconds = serve(algorithm, config, prompts, warmup, args.max_new_tokens,
                                     args.requests)
            tokens = sum(len(o) for o in outputs)
            reference = reference or (outputs, tokens / seconds)
            rows.append(dict(setting=label, seconds=round(seconds, 2),
                             tokens_per_second=round(tokens / seconds, 1),
                             vs_low_confidence=round(tokens / seconds / reference[1], 3),
                             identical=outputs == reference[0]))
            print(rows[-1], flush=True)
    print(json.dumps(dict(requests=args.requests, threshold=args.threshold,
                          lookahead=args.lookahead, rows=rows)))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
