"""Memory and tokens/s of one `mrp train head` step at a preset's shape (random weights).

Not a test (never collected by pytest). Builds the backbone of `--preset` (vocabulary
151,936, block 16, the SDAR-Chat mask id) with `--layers` of its decoder layers (default:
all; fewer when the whole does not fit: the result is then per that many layers, and the
table says so), a `--head-layers` MRP head in float32 with AdamW, and rows of `--seq-len`
tokens packed with synthetic chat samples (1,024 tokens each, a quarter prompt), then runs
the head loop's own `draw_step` + `train_step` (`training/head_loop.py`): `--warmup` steps
excluded, `--steps` timed.

    OMP_NUM_THREADS=1 python benchmarks/train_step_cost.py --layers 1 --seq-len 1024
    python benchmarks/train_step_cost.py --device cuda --bf16 --rows 2   # whole, one GPU

Reports seconds per step, sample tokens per second and peak memory (CUDA: the allocator's
peak; CPU: the process's peak resident set, weights included), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mrp_dlm.config import (BACKBONE_PRESETS, SDAR_MASK_TOKEN_ID, BackboneConfig,  # noqa: E402
                            HeadConfig, HeadTrainConfig)
from mrp_dlm.eval.provenance import git_commit  # noqa: E402
from mrp_dlm.model.backbone import Backbone  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from mrp_dlm.training import head_loop  # noqa: E402
from mrp_dlm.training.data import BatchSchedule, Sample  # noqa: E402
from mrp_dlm.training.distributed import World  # noqa: E402
from mrp_dlm.training.run import build_optimizer  # noqa: E402

VOCAB = 151936  # the SDAR (Qwen3) vocabulary
SAMPLE_TOKENS = 1024  # synthetic sample length: a quarter prompt, the rest response


def build_backbone(args: argparse.Namespace, dtype: torch.dtype) -> Backbone:
    shape = dict(BACKBONE_PRESETS[args.preset])
    layers = shape["num_layers"] if args.layers is None else args.layers
    shape["num_layers"] = layers
    config = BackboneConfig(vocab_size=VOCAB, block_size=16, mask_token_id=SDAR_MASK_TOKEN_ID,
                            max_position_embeddings=max(args.seq_len, 4096), **shape)
    with torch.device(args.device):
        backbone = Backbone(config).to(dtype)
    return backbone.requires_grad_(False).eval()


def synthetic_schedule(config: HeadTrainConfig) -> BatchSchedule:
    generator = torch.Generator().manual_seed(0)
    count = config.batch_size * (config.seq_len // SAMPLE_TOKENS) * 2
    samples = [Sample(torch.randint(0, VOCAB - 300, (SAMPLE_TOKENS,), generator=generator),
                      SAMPLE_TOKENS // 4) for _ in range(count)]
    return BatchSchedule(samples, config.seq_len, config.batch_size, 0, 0)


def peak_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sdar-1.7b", choices=sorted(BACKBONE_PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="backbone layers (default all)")
    parser.add_argument("--head-layers", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=1, help="rows per step (one process's)")
    parser.add_argument("--lookahead", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 backbone and autocast")
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    config = HeadTrainConfig(out="unused", head_layers=args.head_layers, init_std=0.2,
                             lookahead=args.lookahead, seq_len=args.seq_len,
                             batch_size=args.rows, train_steps=args.warmup + args.steps,
                             bf16=args.bf16, device=args.device,
                             grad_checkpointing=args.grad_checkpointing)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    backbone = build_backbone(args, dtype)
    head = MRPHead(backbone.config, HeadConfig(args.head_layers, 0.2)).to(args.device).train()
    if args.grad_checkpointing:
        head_loop.checkpoint_layers(head)
    world = World(0, 1, args.device, owns_group=False)
    run = head_loop.HeadRun(config, world, Path("unused"), backbone, head, head,
                            build_optimizer(head, config), dtype if args.bf16 else None)
    schedule = synthetic_schedule(config)
    timings, tokens = [], 0
    for step in range(config.train_steps):
        inputs = head_loop.draw_step(config, schedule, step, SDAR_MASK_TOKEN_ID, 16, world)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        head_loop.train_step(run, inputs, step)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if step >= args.warmup:
            timings.append(time.perf_counter() - started)
            tokens += inputs.tokens
    seconds = sum(timings) / len(timings)
    layers = backbone.config.num_layers
    whole = layers == BACKBONE_PRESETS[args.preset]["num_layers"]
    total = BACKBONE_PRESETS[args.preset]["num_layers"]
    label = "whole model" if whole else f"PER {layers} OF {total} LAYERS"
    result = {"preset": args.preset, "scope": label, "backbone_layers": layers,
              "head_layers": args.head_layers, "seq_len": args.seq_len, "rows": args.rows,
              "lookahead": args.lookahead, "dtype": str(dtype).removeprefix("torch."),
              "grad_checkpointing": args.grad_checkpointing,
              "seconds_per_step": round(seconds, 3),
              "tokens_per_s": round(tokens / sum(timings), 1),
              "peak_memory_gb": round(peak_memory_gb(args.device), 2),
              "head_parameters_m": round(sum(p.numel() for p in head.parameters()) / 1e6, 1),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "commit": git_commit()}
    print(f"| scope | seq | rows | K | s/step | tokens/s | peak GB |\n| --- | --- | --- | --- | "
          f"--- | --- | --- |\n| {label} | {args.seq_len} | {args.rows} | {args.lookahead} | "
          f"{seconds:.2f} | {result['tokens_per_s']:.0f} | {result['peak_memory_gb']:.2f} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
