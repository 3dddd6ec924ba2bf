"""`--shard-backbone`: the frozen backbone sharded with FSDP2 over 2 gloo processes trains the
same head as 1 process, holds half the layers per rank, and resumes bit for bit."""

from __future__ import annotations

import dataclasses
import json
import resource
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from mrp_dlm.training import head_loop, sharding
from mrp_dlm.training.distributed import join_world, leave_world

from conftest import random_backbone, tiny_config
from reference_moe import TINY_MOE
from training.test_head_training import (Killed, ddp_worker, free_port, model_dir,  # noqa: F401
                                         one_and_two_processes, read_jsonl, run_config,
                                         write_model_dir)



def replicated_bytes(backbone) -> int:
    """Bytes of the embedding, final norm and lm_head (once when tied): whole on every rank."""
    names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    return sum(p.numel() * p.element_size() for p in {backbone.get_parameter(n) for n in names})


def memory_file(config, rank: int) -> Path:
    return Path(config.out).parent / f"memory-{config.shard_backbone}-{rank}.json"


def sharded_worker(rank: int, world_size: int, port: int, config) -> None:
    """`ddp_worker` that also writes what its rank holds of the backbone once sharded, and
    its peak RSS at the end."""
    real = head_loop.shard_backbone
    report = {}

    def measured(backbone, world):
        report["full"] = sharding.full_bytes(backbone)
        report["shared"] = replicated_bytes(backbone)
        backbone = real(backbone, world)
        report["resident"] = sharding.resident_bytes(backbone)
        report["sharded_names"] = [name for name, p in backbone.named_parameters()
                                   if isinstance(p, DTensor)]
        return backbone

    head_loop.shard_backbone = measured
    ddp_worker(rank, world_size, port, config)
    report["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    memory_file(config, rank).write_text(json.dumps(report))


def sharded_config(model_dir: Path, out: Path, **changes):
    """Burn-in and dynamic reveals: per-rank backbone step counts in training; held-out
    batches and acceptance decodes split unevenly over the ranks in evaluation."""
    return run_config(model_dir, out, train_steps=4, log_every=1, eval_every=2, lookahead=2,
                      burn_in_max=3, reveal_rule="dynamic", eval_examples=7, **changes)


def check_half_per_rank(config) -> list[str]:
    """Each rank holds the replicated embedding, final norm and lm_head and half of the
    rest (+- 1 row of each sharded tensor: dim 0 splits unevenly when odd); returns the
    names of the sharded parameters (layers only)."""
    reports = [json.loads(memory_file(config, rank).read_text()) for rank in range(2)]
    sharded = reports[0]["full"] - reports[0]["shared"]
    own = [r["resident"] - r["shared"] for r in reports]  # this rank's layer shards
    assert sum(own) == sharded
    for part in own:
        assert abs(part - sharded / 2) < 0.03 * sharded, (part, sharded)
    names = reports[0]["sharded_names"]
    assert names and all(name.startswith("model.layers.") for name in names)
    return names


@pytest.mark.exact_arithmetic
def test_sharded_backbone_matches_one_process(model_dir, tmp_path):
    """1 process (whole backbone) vs 2 gloo processes with the layers sharded and the head
    data-parallel: the same tolerance as the DDP test (logged losses rel 1e-5, weights abs
    1e-5). Sharding itself is exact (an all-gather copies the weights bit for bit); what
    differs is the data-parallel part's float summation order (row split, gradient
    all-reduce), as under DDP."""
    config = sharded_config(model_dir, tmp_path / "one")
    one, two = one_and_two_processes(config, sharded_worker, shard_backbone=True)
    assert one["positions"] == two["positions"]
    assert two["kl_residual"] == pytest.approx(one["kl_residual"], rel=1e-4)
    for key in ("accepted_per_round", "rounds", "prompts"):
        assert one["acceptance"][key] == two["acceptance"][key]
    check_half_per_rank(dataclasses.replace(config, out=str(tmp_path / "two"),
                                            shard_backbone=True))


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint with SDAR-30B-A3B's MoE layers (8 experts, top 2, fused)."""
    return write_model_dir(tmp_path_factory.mktemp("moe"), **TINY_MOE)


@pytest.mark.exact_arithmetic
def test_sharded_moe_backbone_matches_one_process(moe_model_dir, tmp_path):
    """As above on an MoE backbone: the experts live in the layers, so each rank holds half
    of them (the fused expert tensors split on dim 0, the expert axis); the head is dense.
    Same tolerance, for the same reason (routing is per token; no choice sat within the
    rows' float differences here)."""
    config = run_config(moe_model_dir, tmp_path / "one", train_steps=3, log_every=1,
                        eval_every=3, eval_examples=5)
    one, two = one_and_two_processes(config, sharded_worker, shard_backbone=True)
    assert one["positions"] == two["positions"]
    assert two["kl_residual"] == pytest.approx(one["kl_residual"], rel=1e-4)
    names = check_half_per_rank(dataclasses.replace(config, out=str(tmp_path / "two"),
                                                    shard_backbone=True))
    for layer in range(2):
        for part in ("gate_up_proj", "down_proj"):
            assert f"model.layers.{layer}.mlp.experts.{part}" in names


def dying_worker(rank: int, world_size: int, port: int, config) -> None:
    """`sharded_worker` killed at the start of step 3, one step after a save."""
    real_step = head_loop.train_step

    def dying_step(run, inputs, step):
        if step == 3:
            raise Killed
        return real_step(run, inputs, step)

    head_loop.train_step = dying_step
    sharded_worker(rank, world_size, port, config)


def spawn(worker, config) -> None:
    mp.spawn(worker, args=(2, free_port(), config), nprocs=2, join=True)


@pytest.mark.exact_arithmetic
def test_sharded_resume_gives_identical_weights(model_dir, tmp_path):
    """2 sharded processes killed after a checkpoint and resumed equal 2 uninterrupted ones
    bit for bit (same world, same arithmetic)."""
    straight = sharded_config(model_dir, tmp_path / "straight", shard_backbone=True)
    spawn(sharded_worker, straight)
    interrupted = dataclasses.replace(straight, out=str(tmp_path / "resumed"), save_every=2)
    with pytest.raises(mp.ProcessRaisedException, match="Killed"):
        spawn(dying_worker, interrupted)
    spawn(sharded_worker, dataclasses.replace(interrupted, resume=True))
    expected, actual = (load_file(str(Path(c.out) / "model.safetensors"))
                        for c in (straight, interrupted))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    logs = [read_jsonl(Path(c.out) / "train_log.jsonl") for c in (straight, interrupted)]
    assert [(r["step"], r["loss"]) for r in logs[0]] == [(r["step"], r["loss"]) for r in logs[1]]


def mesh_worker(rank: int, world_size: int, port: int, reports: Path) -> None:
    """A rank of 2 nodes x 2 processes (LOCAL_WORLD_SIZE=2): shards the tiny backbone and
    runs rank + 1 forwards in lockstep; writes what it holds and whether they matched."""
    import os

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % 2), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = join_world("cpu")
    backbone = random_backbone(tiny_config()).requires_grad_(False)
    ids = torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(0))  # (B, T)
    args = (ids, torch.arange(8).expand(2, 8), torch.ones(2, 8, 8, dtype=torch.bool))
    expected, full = backbone(*args), sharding.full_bytes(backbone)
    layers = full - replicated_bytes(backbone)  # what is sharded
    backbone = sharding.shard_backbone(backbone, world)
    with sharding.lockstep(backbone, world):
        # `forward` skips the root's hooks (as decoding's prefill does), never a layer's
        outputs = [backbone.forward(*args) if i % 2 else backbone(*args) for i in range(rank + 1)]
    report = {"equal": all(torch.equal(out, expected) for out in outputs), "full": full,
              "own": sharding.resident_bytes(backbone) - (full - layers), "layers": layers,
              "checksum": sum(float(sharding.local(p).double().sum())
                              for p in backbone.parameters()),
              "mesh": list(next(p.device_mesh.shape for p in backbone.parameters()
                                if isinstance(p, DTensor)))}
    (reports / f"{rank}.json").write_text(json.dumps(report))
    leave_world(world)


def test_several_nodes_shard_within_a_node_and_forwards_pair_up(tmp_path):
    """4 processes as 2 nodes x 2: each layer split over a node's 2 processes and
    replicated across nodes (HSDP); ranks running 1..4 forwards in `lockstep` (through
    `__call__` and `forward`) all finish and every forward equals the unsharded backbone's
    bit for bit."""
    mp.spawn(mesh_worker, args=(4, free_port(), tmp_path), nprocs=4, join=True)
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(4)]
    assert all(r["equal"] and r["mesh"] == [2, 2] for r in reports)
    assert reports[0]["checksum"] == reports[2]["checksum"] != reports[1]["checksum"]
    assert reports[1]["checksum"] == reports[3]["checksum"]  # replicas across nodes
    for node in (reports[:2], reports[2:]):  # a node's ranks split the layers
        assert node[0]["own"] + node[1]["own"] == node[0]["layers"]
        assert abs(node[0]["own"] - node[1]["own"]) < 0.06 * node[0]["layers"]
