"""The MRP head split over 2 tensor-parallel ranks (`serving/head_tp.py`) computes what the
whole head computes: 2 gloo processes, each with its share of the attention heads, the
MLP's inner width and a head KV pool of its own kv heads, store a prompt block's keys in
their pools and run the head on the next block over them; every rank's h_C equals the
single-rank head's on the same pool protocol (float32, tolerance 1e-5: only the summation
order of the two all-reduced projections differs). Two shapes: kv heads split (4 q / 2 kv)
and a kv head replicated on both ranks (4 q / 1 kv, as SGLang replicates when tp > nkv).

The ranks all-reduce with torch.distributed, as SGLang's CPU path does without its
shared-memory kernel; SGLang is only imported (the head pool reads SGLang's pools through
the door, `sglang_forward.py`).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from sglang_env import require_sglang

require_sglang()

from conftest import random_backbone, random_head, tiny_config  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from mrp_dlm.serving.head_pool import HeadContext, HeadPool, Prefix  # noqa: E402
from mrp_dlm.serving.head_tp import Split, kv_heads_of, shard_head  # noqa: E402

pytestmark = pytest.mark.sglang

L = 4  # block size of the tiny model
TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_layer_head(num_kv_heads: int):
    """(backbone, a random 2-layer head with an even MLP width) for `num_kv_heads`."""
    model = random_backbone(tiny_config(num_kv_heads=num_kv_heads, intermediate_size=38), seed=3)
    return model, random_head(model, 9, layers=2)


def two_blocks(model, head: MRPHead) -> torch.Tensor:
    """h_C (R, L, H) of the head on block 1 of two requests, over its pool's keys of block 0
    (written by a store with the block's hidden states), as the serving plugin runs it."""
    generator = torch.Generator().manual_seed(11)
    R, H = 2, model.config.hidden_size
    tokens = torch.randint(0, 97, (R, 2 * L), generator=generator)  # (R, 2L)
    hidden = torch.randn(R, 2 * L, H, generator=generator)  # (R, 2L, H)
    slots = torch.arange(R * 2 * L).view(R, 2 * L)  # (R, 2L) pool slot of each token
    positions = torch.arange(2 * L).expand(R, 2 * L)  # (R, 2L)
    pool = HeadPool(head.config.num_layers, R * 2 * L, kv_heads_of(head),
                    model.config.head_dim, torch.float32, "cpu")
    none = torch.zeros(R, 0, dtype=torch.long)  # (R, 0)
    first = HeadContext(pool, head, model, Prefix.whole(none), positions[:, :L])
    first.store(tokens[:, :L], hidden[:, :L], slots[:, :L])
    second = HeadContext(pool, head, model, Prefix.whole(slots[:, :L]), positions[:, L:])
    return second.residual(tokens[:, L:], hidden[:, L:])  # (R, L, H)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def rank_worker(rank: int, world: int, port: int, num_kv_heads: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, head = two_layer_head(num_kv_heads)
        with torch.no_grad():
            expected = two_blocks(model, head)
            local = shard_head(head, rank, world, all_reduce)
            assert kv_heads_of(local) == max(1, num_kv_heads // world)
            assert local.layers[0].mlp.gate_proj.weight.shape[0] == 38 // world
            got = two_blocks(model, local)
        diff = (got - expected).abs().max().item()
        assert diff < TOLERANCE, f"rank {rank}: max diff {diff:.2e}"
        assert expected.abs().max().item() > 0.1  # not a trivially zero residual
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_two_rank_head_equals_one_rank_head(num_kv_heads):
    mp.spawn(rank_worker, args=(2, free_port(), num_kv_heads), nprocs=2, join=True)


def test_split_refuses_what_does_not_divide():
    with pytest.raises(ValueError, match="does not split over --tp 3"):
        Split(0, 3).part(4, "attention heads")
    with pytest.raises(ValueError, match="not a multiple"):
        Split(0, 3).kv_heads(2)
    assert Split(3, 4).kv_heads(2) == slice(1, 2)  # ranks 2, 3 replicate kv head 1
