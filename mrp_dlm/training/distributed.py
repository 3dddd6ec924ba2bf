"""Data-parallel scale-out on torch.distributed: process group, row sharding, reductions.

`mrp train head` under `torchrun --nproc-per-node N` trains with DistributedDataParallel:
every process builds the same global batch (a pure function of seed and step), draws the
noise for all of it, and keeps its own B / N rows; DDP averages the gradients. Rank 0
alone writes checkpoints and logs. Backend: nccl for CUDA devices, gloo on the CPU.

torchrun passes the world to its processes through the environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: torch.distributed's `env://`
protocol); this module is the one place that reads it. Without WORLD_SIZE > 1 everything
is a plain 1-process run.

Deliberately not here: what is trained (see `head_loop.py`).

Shapes: B rows of the global batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel processes."""

    rank: int  # 0 .. size - 1
    size: int  # number of processes
    device: str  # this process's torch device (cuda:LOCAL_RANK under torchrun on CUDA)
    owns_group: bool  # True when this module created the process group (and destroys it)
    local_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def join_world(device: str) -> World:
    """The running torchrun world (initialising its process group), or a 1-process world."""
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        return World(dist.get_rank(), size, device, owns_group=False,
                     local_size=local_world_size(size))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(0, 1, device, owns_group=False)
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    log.info("rank %d of %d on %s", dist.get_rank(), size, device)
    return World(dist.get_rank(), size, device, owns_group=True,
                 local_size=local_world_size(size))


def local_world_size(size: int) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", size))


def finish_together(world: World) -> None:
    """Barrier after a successful run: no rank tears its process group down while another
    still works (rank 0 writing the last checkpoint). A rank that tore down early aborted
    inside gloo now and then ("terminate called without an active exception")."""
    if world.size > 1:
        dist.barrier()


def leave_world(world: World) -> None:
    """Destroy the process group this module created. No barrier here: after a failure on
    one rank the others may never reach it (success paths call `finish_together` first)."""
    if world.owns_group:
        dist.destroy_process_group()


def shard_rows(rows: torch.Tensor, world: World, dim: int = 0) -> torch.Tensor:
    """This rank's contiguous slice of the B rows along `dim` (B a multiple of world.size)."""
    if rows.shape[dim] % world.size:
        raise ValueError(f"{rows.shape[dim]} rows do not split over {world.size} processes")
    share = rows.shape[dim] // world.size
    return rows.narrow(dim, world.rank * share, share)


def map_record(record, fn):
    """A dataclass of tensors (positional fields) with fn applied to every field."""
    return type(record)(*(fn(getattr(record, f.name)) for f in dataclasses.fields(record)))


def shard_record(record, world: World):
    """A dataclass of (B, ...) row tensors with every field sharded and on world.device."""
    return map_record(record, lambda rows: shard_rows(rows, world).to(world.device))


def all_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    """values summed over all processes, as a new tensor on values' device (the reduction
    itself runs on world.device: nccl reduces CUDA tensors only)."""
    if world.size == 1:
        return values.clone()
    total = values.to(world.device, copy=True)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.to(values.device)


def wrap_module(module: nn.Module, world: World) -> nn.Module:
    """DDP around `module` in a multi-process world; the module itself otherwise.

    device_ids stays None: the module lives on one device and its inputs (including the
    backbone it receives as an argument) are already there, so DDP must not move them.
    """
    if world.size == 1:
        return module
    return DistributedDataParallel(module, device_ids=None)
