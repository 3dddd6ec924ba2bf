"""The frozen backbone sharded over the processes with FSDP2 (`--shard-backbone`).

Each decoder layer is its own `fully_shard` group: every rank keeps 1 / N of each layer's
weights (a dim-0 `DTensor` shard; N the processes of a node when there are several nodes,
see `shard_mesh`) and all-gathers a layer just before its forward, freeing it after. The
root (the backbone) is sharded last and keeps the rest whole on every rank
(`ignored_params`): the embedding and lm_head, which the head reads outside the backbone's
forward (its embedding of the revealed tokens, its logits A + C, the gradient through
lm_head; the head's fingerprint hashes lm_head), and the final norm, which decoding's
prefill reaches through `forward` without the root's hooks. The head itself stays
data-parallel (`distributed.py`).

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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.training.distributed import World

log = logging.getLogger(__name__)


def shard_backbone(backbone: Backbone, world: World) -> Backbone:
    """`backbone` (frozen, on any device) sharded over `world` in place, its shards and the
    whole embedding, final norm and lm_head on world.device; whole in a 1-process world."""
    if world.size == 1:
        log.info("--shard-backbone in a 1-process world: the backbone stays whole")
        return backbone.to(world.device)
    mesh = shard_mesh(world)
    for layer in backbone.model.layers:
        fully_shard(layer, mesh=mesh)  # moves the layer to world.device, then shards it
    fully_shard(backbone, mesh=mesh, ignored_params=set(whole_params(backbone)))
    for module in (backbone.model.embed_tokens, backbone.model.norm, backbone.lm_head):
        module.to(world.device)
    stand_in_forward(backbone, world.device)  # FSDP's lazy init, from the root, on all ranks
    log.info("backbone sharded over %s processes: %.1f of %.1f MB of weights on rank %d",
             " x ".join(map(str, mesh.shape)), resident_bytes(backbone) / 1e6,
             full_bytes(backbone) / 1e6, world.rank)
    return backbone


def whole_params(backbone: Backbone) -> list[torch.nn.Parameter]:
    """The parameters every rank keeps whole: embedding, final norm, lm_head (tied: once)."""
    modules = (backbone.model.embed_tokens, backbone.model.norm, backbone.lm_head)
    return list({p: None for module in modules for p in module.parameters()})


def shard_mesh(world: World) -> DeviceMesh:
    """The processes a layer is split over: all of them (1-D), or with several nodes
    (torchrun's local world smaller than the world) those of this node, the layers
    replicated across nodes (2-D, HSDP): a frozen backbone then never all-gathers over
    the network between nodes."""
    kind = torch.device(world.device).type
    nodes = world.size // world.local_size
    if nodes > 1 and world.local_size > 1 and nodes * world.local_size == world.size:
        return init_device_mesh(kind, (nodes, world.local_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (world.size,))


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

    # On the first layer, before its all-gather: decoding's prefill calls `forward`
    # directly, which skips the root's hooks, never a layer's.
    handle = backbone.model.layers[0].register_forward_pre_hook(announce, prepend=True)
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
