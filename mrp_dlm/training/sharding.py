"""The frozen backbone sharded over the processes with FSDP2 (`--shard-backbone`).

Each decoder layer is its own `fully_shard` group and the root holds the final norm: every
rank keeps 1 / N of each layer's weights (a dim-0 `DTensor` shard) and all-gathers a layer
just before its forward, freeing it after. The embedding and lm_head stay whole on every
rank (`ignored_params`): the head reads them directly, outside the backbone's forward (its
embedding of the revealed tokens, its logits A + C, the gradient through lm_head), and the
head's fingerprint hashes lm_head. The head itself stays data-parallel (`distributed.py`).

A layer's all-gather is a collective, so every rank must run the same number of backbone
forwards. Training steps do, bar the burn-in's per-rank step count; evaluation and the
acceptance decode run data-dependent counts per rank. `lockstep` brackets such a stretch:
each forward first tells the other ranks it is coming, and a rank that is done runs
one-token stand-in forwards until every rank is done. Nothing else collective may run
inside the stretch.

Deliberately not here: the data-parallel head and the process group (see `distributed.py`).

Shapes: B rows, T tokens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.training.distributed import World

log = logging.getLogger(__name__)


def shard_backbone(backbone: Backbone, world: World) -> Backbone:
    """`backbone` (frozen, on any device) sharded over `world` in place, its shards and the
    replicated embedding and lm_head on world.device; unchanged in a 1-process world."""
    if world.size == 1:
        log.info("--shard-backbone in a 1-process world: the backbone stays whole")
        return backbone.to(world.device)
    mesh = init_device_mesh(torch.device(world.device).type, (world.size,))
    shared = {backbone.model.embed_tokens.weight, backbone.lm_head.weight}  # one when tied
    for layer in backbone.model.layers:
        fully_shard(layer, mesh=mesh)  # moves the layer to world.device, then shards it
    fully_shard(backbone, mesh=mesh, ignored_params=shared)
    for module in (backbone.model.embed_tokens, backbone.lm_head):
        module.to(world.device)
    log.info("backbone sharded over %d processes: %.1f of %.1f MB of weights on rank %d",
             world.size, resident_bytes(backbone) / 1e6, full_bytes(backbone) / 1e6, world.rank)
    return backbone


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters this rank holds: a sharded one's local shard."""
    return sum(local(p).numel() * p.element_size() for p in module.parameters())


def full_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters unsharded (what one process holds without sharding)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor on this rank: a DTensor's local shard, else itself."""
    return param.to_local() if isinstance(param, DTensor) else param


def is_sharded(backbone: torch.nn.Module) -> bool:
    return isinstance(backbone, FSDPModule)


@contextlib.contextmanager
def lockstep(backbone: Backbone, world: World) -> Iterator[None]:
    """A stretch in which ranks may run different numbers of backbone forwards (a no-op for
    an unsharded backbone): each forward first adds 1 to an all-reduced count of ranks that
    still work; on leaving, a rank adds 0 and runs a stand-in forward while the count is
    non-zero. The layers' all-gathers thus pair up over the ranks."""
    if not is_sharded(backbone):
        yield
        return
    def announce(module: torch.nn.Module, args: tuple) -> None:
        report_working(1, world)

    handle = backbone.register_forward_pre_hook(announce, prepend=True)  # before FSDP's
    try:
        yield
    finally:
        handle.remove()
    while report_working(0, world):
        stand_in_forward(backbone, world.device)


def report_working(flag: int, world: World) -> int:
    """The number of ranks that report 1 (all ranks call this together)."""
    count = torch.tensor([flag], dtype=torch.int64, device=world.device)
    dist.all_reduce(count)
    return int(count.item())


@torch.no_grad()
def stand_in_forward(backbone: Backbone, device: str) -> None:
    """One token through every layer: the same all-gathers as any forward."""
    ids = torch.zeros(1, 1, dtype=torch.int64, device=device)  # (B, T) = (1, 1)
    mask = torch.ones(1, 1, 1, dtype=torch.bool, device=device)  # (B, T, T)
    backbone(ids, ids, mask)
