"""Cost of one MRP head step against one backbone denoise forward, and head training speed.

Not a test (never collected by pytest). For batch 1 and 8 it times:
- a backbone denoise forward: one block of L tokens against a cached prefix of ~100
  tokens (the KV of the prefix was written by a prefill; the block writes nothing);
- a head step: the head's forward on the block (attending to its keys of the prefix) plus
  one lm_head projection of the accumulator (what every direct/speculative draft pays);
- the same head step carrying the store of the block before (its L clean tokens as extra
  queries): what a block's head store adds to its first head step;
and reports the head step as a fraction of the denoise forward (target <= 25% at batch 1).
It then times `mrp train head` steps (the real `head_loop` step) on random packed rows and
reports training tokens/s.

The default backbone is random, with the embedded preset's shape (hidden 128, 8 layers,
4/2 heads, intermediate 384, vocab 939, block 16); `--model DIR` times a checkpoint
instead (such as mrp_dlm/assets/embedded). Warm-up runs are excluded; timers sync around
each run. Prints a table, then one JSON line last (config, git commit, hardware, results).

    python benchmarks/head.py [--model DIR] [--head-layers 2] [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from decode import git_commit, hardware, random_model, sync  # noqa: E402  (benchmarks/decode.py)
from mrp_dlm.config import (BACKBONE_PRESETS, BackboneConfig, HeadConfig,  # noqa: E402
                            HeadTrainConfig)
from mrp_dlm.model.backbone import Backbone  # noqa: E402
from mrp_dlm.model.cache import KVCache  # noqa: E402
from mrp_dlm.model.head import HeadAttention, MRPHead  # noqa: E402
from mrp_dlm.model.loading import load_backbone  # noqa: E402
from mrp_dlm.model.masks import block_causal_mask, copies_mask, store_and_next_mask  # noqa: E402
from mrp_dlm.training import head_loop  # noqa: E402
from mrp_dlm.training.data import BatchSchedule, Sample  # noqa: E402
from mrp_dlm.training.distributed import World  # noqa: E402
from mrp_dlm.training.run import build_optimizer  # noqa: E402

EMBEDDED_VOCAB = 939


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir; default: random "
                        "embedded-shape backbone")
    parser.add_argument("--head-layers", type=int,
                        default=HeadTrainConfig(model="-", out="-").head_layers,
                        help="head depth (default: the training default)")
    parser.add_argument("--block", type=int, default=16, help="block size of the random model")
    parser.add_argument("--prefix", type=int, default=96, help="cached prefix tokens "
                        "(rounded down to whole blocks)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=200,
                        help="timed runs per measurement (median)")
    parser.add_argument("--train-steps", type=int, default=6, help="timed head training steps")
    parser.add_argument("--train-batch", type=int, default=8, help="packed rows per training step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per packed training row")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 keeps the default")
    return parser.parse_args()


def build_backbone(args: argparse.Namespace) -> Backbone:
    if args.model:
        return load_backbone(args.model, device=args.device).eval()
    config = BackboneConfig(vocab_size=EMBEDDED_VOCAB, block_size=args.block,
                            mask_token_id=3, stop_token_ids=(2, 0), max_position_embeddings=4096,
                            **BACKBONE_PRESETS["embedded"])
    return random_model(config, 0.02, args.device)


def paired_medians(device: str, fns: list, repeats: int, warmup: int = 1) -> list[float]:
    """Median seconds of each fn, timed in turn within every repeat, so that load changes on
    a shared machine hit all of them alike; `warmup` untimed rounds of every fn first."""
    for _ in range(warmup):
        for fn in fns:
            fn()  # warm-up, not timed
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            sync(device)
            began = time.perf_counter()
            fn()
            sync(device)
            spent.append(time.perf_counter() - began)
    return [statistics.median(spent) for spent in times]


@torch.no_grad()
def step_costs(model: Backbone, head: MRPHead, batch: int, prefix: int, repeats: int,
               device: str) -> dict:
    """Median seconds of one denoise forward and one head step at this batch size."""
    c, L = model.config, model.config.block_size
    P = prefix // L * L
    cache = KVCache(c.num_layers, batch, c.num_kv_heads, P + L, c.head_dim, torch.float32, device)
    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(4, c.vocab_size, (batch, P), generator=generator).to(device)  # (B, P)
    positions = torch.arange(P + L, device=device).expand(batch, -1)  # (B, P + L)
    valid = torch.ones(batch, P, dtype=torch.bool, device=device)  # (B, P)
    if P:
        model(prompt, positions[:, :P], block_causal_mask(torch.arange(P, device=device) // L,
                                                          valid), cache, 0)
    block = torch.full((batch, L), c.mask_token_id, device=device)  # (B, L)
    block[:, ::3] = prompt[:, :1]  # some revealed tokens
    mask = copies_mask(valid, P, L, 1)  # (B, L, P + L)
    hidden = model(block, positions[:, P:], mask, cache, P)  # (B, L, H)
    keys = KVCache(head.config.num_layers, batch, c.num_kv_heads, P + L, c.head_dim,
                   torch.float32, device)  # the head's keys of the prefix (random)
    keys.keys.normal_()
    keys.values.normal_()
    attention = HeadAttention(keys, mask, P)
    # The step that also writes the head's keys of the block before (its store rides on the
    # block's first head step, decoding/head_cache.py): L more query tokens.
    both = torch.cat((block, block), dim=1)  # (B, 2L)
    twice = torch.cat((hidden, hidden), dim=1)  # (B, 2L, H)
    stored = HeadAttention(keys, store_and_next_mask(valid, P - L, L), P - L)
    denoise, step, with_store = paired_medians(device, [
        lambda: model.logits(model(block, positions[:, P:], mask, cache, P)),
        lambda: model.logits(hidden + head(model, block, hidden, positions[:, P:], attention)),
        lambda: model.logits(hidden + head(model, both, twice, positions[:, P - L:],
                                           stored)[:, L:])], repeats)
    return dict(batch=batch, prefix=P, denoise_ms=round(1e3 * denoise, 3),
                head_step_ms=round(1e3 * step, 3), head_fraction=round(step / denoise, 3),
                head_step_with_store_ms=round(1e3 * with_store, 3),
                store_fraction=round((with_store - step) / denoise, 3))


def random_samples(vocab: int, block: int, count: int = 256) -> list[Sample]:
    """Chat-like samples: 40-90 prompt tokens, 16-60 response tokens, padded to blocks."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(count):
        prompt, response = (int(torch.randint(lo, hi, (1,), generator=generator))
                            for lo, hi in ((40, 90), (16, 60)))
        length = -(-(prompt + response) // block) * block
        samples.append(Sample(torch.randint(4, vocab, (length,), generator=generator), prompt))
    return samples


def training_speed(model: Backbone, args: argparse.Namespace) -> dict:
    """Tokens/s of real head training steps (head_loop.train_step) on random rows."""
    config = HeadTrainConfig(model=args.model or "random", out="unused",
                             head_layers=args.head_layers,
                             seq_len=args.seq_len, batch_size=args.train_batch,
                             train_steps=args.train_steps + 1, device=args.device)
    world = World(0, 1, args.device, owns_group=False)
    model.requires_grad_(False)
    head = head_loop.build_head(config, model)
    run = head_loop.HeadRun(config, world, Path(config.out), model, head, head,
                            build_optimizer(head, config), precision=None)
    schedule = BatchSchedule(random_samples(model.config.vocab_size, model.config.block_size),
                             config.seq_len, config.batch_size, config.seed, 0)
    seconds, tokens = [], 0
    for step in range(config.train_steps):
        inputs = head_loop.draw_step(config, schedule, step, model.config.mask_token_id,
                                     model.config.block_size, world)
        sync(args.device)
        began = time.perf_counter()
        head_loop.train_step(run, inputs, step)
        sync(args.device)
        if step:  # step 0 is the warm-up
            seconds.append(time.perf_counter() - began)
            tokens += inputs.tokens
    return dict(rows=config.batch_size, seq_len=config.seq_len, steps=len(seconds),
                step_ms=round(1e3 * statistics.median(seconds), 1),
                tokens_per_s=round(tokens / sum(seconds), 1))


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_backbone(args)
    torch.manual_seed(0)
    head = MRPHead(model.config, HeadConfig(num_layers=args.head_layers)).to(args.device).eval()
    with torch.no_grad():
        head.norm.weight.fill_(1.0)  # a trained head's cost, not a zero residual's
    rows = [step_costs(model, head, int(b), args.prefix, args.repeats, args.device)
            for b in args.batches.split(",")]
    train = training_speed(model, args)
    backbone_params = sum(p.numel() for p in model.parameters())
    head_params = sum(p.numel() for p in head.parameters())
    print(f"backbone {backbone_params / 1e6:.2f}M parameters, head {head_params / 1e6:.2f}M "
          f"({args.head_layers} layers, {100 * head_params / backbone_params:.1f}% of the "
          "backbone)")
    print(f"{'batch':>6}{'prefix':>8}{'denoise ms':>12}{'head step ms':>14}{'head/denoise':>14}"
          f"{'+store ms':>11}{'store/denoise':>15}")
    for row in rows:
        print(f"{row['batch']:>6}{row['prefix']:>8}{row['denoise_ms']:>12.3f}"
              f"{row['head_step_ms']:>14.3f}{row['head_fraction']:>14.3f}"
              f"{row['head_step_with_store_ms']:>11.3f}{row['store_fraction']:>15.3f}")
    print(f"head step at batch {rows[0]['batch']}: {100 * rows[0]['head_fraction']:.1f}% of a "
          f"denoise forward (target <= 25%)")
    print(f"training: {train['tokens_per_s']:.0f} tokens/s ({train['rows']} rows x "
          f"{train['seq_len']} tokens, {train['step_ms']:.0f} ms/step, lookahead 1)")
    c = model.config
    summary = dict(config=dict(model=args.model or "random embedded-shape", vocab=c.vocab_size,
                               hidden=c.hidden_size, layers=c.num_layers, block=c.block_size,
                               head_layers=args.head_layers, prefix=args.prefix,
                               repeats=args.repeats, dtype="float32"),
                   commit=git_commit(), hardware=hardware(args.device),
                   parameters=dict(backbone=backbone_params, head=head_params),
                   step_costs=rows, training=train)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
