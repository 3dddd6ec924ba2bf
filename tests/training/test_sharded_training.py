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

from mrp_dlm.training import head_loop, sharding

from training.test_head_training import (Killed, ddp_worker, free_port, model_dir,  # noqa: F401
                                         one_and_two_processes, read_jsonl, run_config)

SHARED = ("model.embed_tokens.weight", "lm_head.weight")  # replicated on every rank


def memory_file(config, rank: int) -> Path:
    return Path(config.out).parent / f"memory-{config.shard_backbone}-{rank}.json"


def sharded_worker(rank: int, world_size: int, port: int, config) -> None:
    """`ddp_worker` that also writes what its rank holds of the backbone once sharded, and
    its peak RSS at the end."""
    real = head_loop.shard_backbone
    report = {}

    def measured(backbone, world):
        shared = {backbone.get_parameter(name) for name in SHARED}
        report["full"] = sharding.full_bytes(backbone)
        report["shared"] = sum(p.numel() * p.element_size() for p in shared)
        backbone = real(backbone, world)
        report["resident"] = sharding.resident_bytes(backbone)
        report["dtensors"] = sum(isinstance(p, torch.distributed.tensor.DTensor)
                                 for p in backbone.parameters())
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


def check_half_per_rank(config) -> None:
    """Each rank holds the replicated embedding and lm_head and half of the rest (+- 1 row
    of each sharded tensor: dim 0 splits unevenly when odd)."""
    reports = [json.loads(memory_file(config, rank).read_text()) for rank in range(2)]
    sharded = reports[0]["full"] - reports[0]["shared"]
    own = [r["resident"] - r["shared"] for r in reports]  # this rank's layer shards
    assert sum(own) == sharded and reports[0]["dtensors"] > 0
    for part in own:
        assert abs(part - sharded / 2) < 0.03 * sharded, (part, sharded)


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
