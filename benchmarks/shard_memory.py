"""Memory per process of a backbone sharded with `--shard-backbone`, against a whole one.

Not a test (never collected by pytest), and not a timing: it measures memory, so it may run
on a busy machine. Saves a random float32 backbone of the given shape, then in 1 process
(whole) and in N gloo processes (sharded, `training/sharding.py`) each process loads it,
shards it, and runs one forward of a (1, 256) row; every process reports its parameter
bytes (a DTensor's local shard), and its RSS after loading, after sharding, after the
forward, and at peak. The loader reads the whole checkpoint in every process before
sharding, so the peak holds a whole backbone; the resident set after sharding is what
training then keeps. The processes run with glibc's mmap threshold fixed at 64 KiB, so a
freed tensor goes back to the OS (by default glibc keeps the layers' all-gather buffers
cached: RSS then grows by ~0.6 GB at the first forwards, and `malloc_trim` takes it back).
Prints a table, then one JSON line.

    python benchmarks/shard_memory.py [--hidden 1024] [--layers 16] [--intermediate 3072]
                                      [--vocab 32000] [--processes 2] [--device cuda]

On CUDA (a GPU per process) it also reports each process's peak GPU memory
(`torch.cuda.max_memory_allocated`): the shards, the whole embedding and lm_head, and one
layer in flight, never the whole backbone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mrp_dlm.config import BackboneConfig  # noqa: E402
from mrp_dlm.model.backbone import Backbone  # noqa: E402
from mrp_dlm.model.loading import load_backbone, save_backbone  # noqa: E402
from mrp_dlm.training import sharding  # noqa: E402
from mrp_dlm.training.distributed import join_world, leave_world  # noqa: E402

MB = 1e6


def rss() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(rank: int, size: int, port: int, model: str, reports: str, device: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = join_world(device)  # cuda: nccl, one GPU per process
    report = {"processes": size, "rank": rank, "start": rss()}
    backbone = load_backbone(model, dtype=torch.float32, device="cpu").requires_grad_(False)
    report.update(loaded=rss(), full_params=sharding.full_bytes(backbone))
    backbone = sharding.shard_backbone(backbone, world)
    report.update(sharded=rss(), params=sharding.resident_bytes(backbone))
    ids = torch.zeros(1, 256, dtype=torch.int64, device=world.device)  # (B, T)
    with torch.no_grad():
        backbone(ids, torch.arange(256, device=world.device)[None],
                 torch.ones(1, 256, 256, dtype=torch.bool, device=world.device))
    report.update(forward=rss(), peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if world.device.startswith("cuda"):
        report["gpu_peak"] = torch.cuda.max_memory_allocated(world.device)
    Path(reports, f"{size}-{rank}.json").write_text(json.dumps(report))
    leave_world(world)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 1024), ("layers", 16), ("intermediate", 3072),
                          ("vocab", 32000), ("processes", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, a GPU each)")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned processes' glibc
    config = BackboneConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                            num_layers=args.layers, num_heads=16, num_kv_heads=4,
                            intermediate_size=args.intermediate, block_size=16,
                            mask_token_id=args.vocab - 1, stop_token_ids=(args.vocab - 2,))
    with tempfile.TemporaryDirectory() as root:
        save_backbone(Backbone(config), Path(root, "model"))
        for size in (1, args.processes):
            mp.spawn(worker, args=(size, free_port(), str(Path(root, "model")), root,
                                   args.device), nprocs=size, join=True)
        reports = [json.loads(p.read_text()) for p in sorted(Path(root).glob("*.json"))]
    print("procs rank  params MB  RSS loaded  sharded  forward  peak  GPU peak (MB)")
    for r in reports:
        print(f"{r['processes']:5d} {r['rank']:4d} {r['params'] / MB:10.1f} "
              f"{r['loaded'] / MB:11.1f} {r['sharded'] / MB:8.1f} {r['forward'] / MB:8.1f} "
              f"{r['peak'] / MB:6.1f} {r.get('gpu_peak', 0) / MB:9.1f}")
    print(json.dumps({"config": vars(args), "results": reports}))


if __name__ == "__main__":
    main()
