"""MRP head training: objective by hand, reveal rules, passes, overfit, loop, resume, DDP,
errors, CLI."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from mrp_dlm import cli
from mrp_dlm.config import HeadConfig, HeadTrainConfig
from mrp_dlm.model.files import CheckpointError
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.loading import load_backbone, load_head, save_backbone
from mrp_dlm.training import head_loop
from mrp_dlm.training.data import Sample, collate_rows, task_texts
from mrp_dlm.training.head_batch import encode_batch, run_blocks
from mrp_dlm.training.head_eval import evaluate_head
from mrp_dlm.training.head_loss import (ChainStep, RevealPlan, advance_blocks, chain_loss,
                                        chain_steps, choose_reveals, commit_loss, residual_kl)
from mrp_dlm.training.masks import build_dual_inputs, select_noisy_slots
from mrp_dlm.training.noise import add_noise
from mrp_dlm.training.tokenizer import save_tokenizer, train_tokenizer

from conftest import random_backbone, tiny_config

MASK = 98  # the tiny model's mask id
L = 4
OVERFIT_STEPS = 60  # the loss is below 10% of its start after ~25 Adam steps


def packed_batch(seed: int = 0):
    """Two rows of four samples (prompt lengths 2-5) of the tiny model's vocabulary, noised."""
    generator = torch.Generator().manual_seed(seed)
    samples = [Sample(torch.randint(0, 97, (n,), generator=generator), p)
               for n, p in ((12, 3), (16, 5), (8, 2), (20, 4))]
    batch = collate_rows(samples, [[0, 1], [2, 3]], 32, 0)
    noisy = add_noise(batch.input_ids, batch.segment_ids, batch.response, MASK,
                      torch.Generator().manual_seed(seed + 1))
    return batch, noisy


def random_plan(rule: str, blocks, lookahead: int = 1, seed: int = 0) -> RevealPlan:
    N = blocks.tokens.shape[0]
    generator = torch.Generator().manual_seed(seed)
    return RevealPlan(rule, torch.rand(lookahead, N, L, generator=generator),
                      torch.ones(lookahead, N, dtype=torch.int64))


def by_hand_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL over the tokens other than [MASK], spelled out."""
    keep = [v for v in range(p_logits.shape[0]) if v != MASK]
    p = torch.softmax(p_logits[keep].double(), 0)
    q = torch.softmax(q_logits[keep].double(), 0)
    return float((p * (p / q).log()).sum())


def test_residual_kl_by_hand_ignores_the_mask_logit():
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(3, 99, generator=generator)  # (M, V)
    student = torch.randn(3, 99, generator=generator)  # (M, V)
    kl = residual_kl(teacher, student, MASK)
    for i in range(3):
        assert kl[i].item() == pytest.approx(by_hand_kl(teacher[i], student[i]), rel=1e-5)
    teacher[:, MASK], student[:, MASK] = 50.0, -50.0  # a huge mask logit changes nothing
    assert torch.allclose(residual_kl(teacher, student, MASK), kl, atol=1e-6)
    assert residual_kl(teacher, teacher + 3.0, MASK).abs().max() < 1e-5  # shift-invariant
    assert residual_kl(teacher[:0], student[:0], MASK).shape == (0,)


def test_reveal_rules_on_hand_built_blocks():
    masked = torch.tensor([[True, True, False, True],
                           [False, False, False, False],  # nothing left to reveal
                           [True, True, True, True],
                           [False, True, False, False]])
    tokens = torch.full((4, L), MASK)
    targets = torch.arange(16).view(4, L)
    # Static: the most confident masked position and its argmax token, ties to the lower one.
    logits = torch.zeros(int(masked.sum()), 99)  # (M, V), rows in row-major order of `masked`
    logits[1, 7] = 3.0  # block 0, position 1: confident in token 7
    logits[2, MASK] = 9.0  # block 0, position 3: only [MASK] is likely, which never counts
    logits[3:7, 5] = 2.0  # block 2: four equal confidences -> position 0 (the lowest)
    logits[7, 11] = 1.0  # block 3: its only masked position
    plan = RevealPlan("static", torch.zeros(1, 4, L), torch.ones(1, 4, dtype=torch.int64))
    chosen, proposed = choose_reveals(plan, 0, masked, logits, targets, MASK)
    assert chosen.tolist() == [[False, True, False, False], [False] * 4,
                               [True, False, False, False], [False, True, False, False]]
    assert proposed[chosen].tolist() == [7, 5, 11]
    # Random: the masked positions with the largest keys, ground-truth tokens; count capped.
    keys = torch.tensor([[0.1, 0.9, 0.99, 0.5], [0.9] * 4, [0.3, 0.2, 0.8, 0.1], [0.0] * 4])
    plan = RevealPlan("random", keys[None], torch.tensor([[2, 2, 3, 4]]))
    chosen, proposed = choose_reveals(plan, 0, masked, None, targets, MASK)
    assert chosen.tolist() == [[False, True, False, True], [False] * 4,
                               [True, True, True, False], [False, True, False, False]]
    assert torch.equal(proposed, targets)


def test_dynamic_reveal_is_the_threshold_step():
    masked = torch.tensor([[True, True, True, False], [True, True, False, False],
                           [False] * 4])
    logits = torch.zeros(int(masked.sum()), 99)  # (M, V)
    logits[0, 4], logits[1, 6], logits[2, 8] = 10.0, 10.0, 4.0  # block 0: two above 0.9
    logits[3, 1], logits[4, 2] = 4.0, 5.0  # block 1: none above 0.9 -> the most confident
    plan = RevealPlan("dynamic", torch.zeros(1, 3, L), torch.ones(1, 3, dtype=torch.int64), 0.9)
    chosen, proposed = choose_reveals(plan, 0, masked, logits, None, MASK)
    assert chosen.tolist() == [[True, True, False, False], [False, True, False, False],
                               [False] * 4]
    assert proposed[chosen].tolist() == [4, 6, 2]
    static = dataclasses.replace(plan, rule="static")  # static ignores the threshold
    chosen, _ = choose_reveals(static, 0, masked, logits, None, MASK)
    assert chosen.tolist() == [[True, False, False, False], [False, True, False, False],
                               [False] * 4]
    at_one = dataclasses.replace(plan, threshold=1.0)  # dynamic at 1.0 is static
    assert torch.equal(choose_reveals(at_one, 0, masked, logits, None, MASK)[0], chosen)


def by_hand_commit(teacher: torch.Tensor, student: torch.Tensor, threshold: float) -> float:
    """The commit loss of one block whose every position is masked, spelled out."""
    keep = [v for v in range(teacher.shape[1]) if v != MASK]
    p = torch.softmax(teacher[:, keep].double(), -1)  # (L, V-1)
    q = torch.log_softmax(student[:, keep].double(), -1)  # (L, V-1)
    confidence, token = p.max(-1)
    log_c = q.max(-1).values
    score = log_c - torch.log1p(-log_c.exp())  # logit of the head's confidence
    above = confidence > threshold
    chosen = above if above.any() else confidence == confidence.max()
    total = -sum(float(q[i, token[i]]) for i in range(len(token)) if chosen[i])
    total -= float(torch.log_softmax(score, 0)[confidence.argmax()])
    if threshold < 1:
        margin = score - math.log(threshold / (1 - threshold))
        total += float(torch.nn.functional.binary_cross_entropy_with_logits(
            margin, above.double(), reduction="sum"))
    return total


def test_commit_loss_by_hand():
    generator = torch.Generator().manual_seed(5)
    still = torch.tensor([[True] * L, [False] * L, [True] * L])  # a block without masks
    teacher = torch.randn(2 * L, 99, generator=generator) * 3  # (M, V)
    teacher[0, 7] = 12.0  # block 0, position 0: above 0.9
    student = torch.randn(2 * L, 99, generator=generator)  # (M, V)
    step = ChainStep(still, teacher, student)
    for threshold in (0.9, 1.0):
        expected = sum(by_hand_commit(teacher[b * L:(b + 1) * L], student[b * L:(b + 1) * L],
                                      threshold) for b in (0, 1))
        assert commit_loss(step, threshold, MASK).item() == pytest.approx(expected, rel=1e-5)
    agreeing = ChainStep(still, teacher, teacher * 50)  # sharp copy of the teacher: tokens
    sharp = commit_loss(agreeing, 1.0, MASK).item()  # certain, order right
    assert 0 <= sharp < commit_loss(step, 1.0, MASK).item()


def test_burn_in_follows_the_backbones_own_steps(tiny_model):
    batch, _ = packed_batch(seed=6)
    blocks, context = encode_batch(tiny_model, batch, head_loop.fully_masked(batch, MASK))
    assert torch.equal(blocks.masked, blocks.tokens == MASK)
    N = blocks.tokens.shape[0]
    steps = torch.arange(N) % 3  # 0, 1 or 2 steps per block
    after = advance_blocks(tiny_model, blocks, context, steps, 0.05)
    plan = RevealPlan("dynamic", torch.zeros(2, N, L), torch.ones(2, N, dtype=torch.int64), 0.05)
    tokens, masked, hidden = blocks.tokens, blocks.masked, blocks.base_hidden
    for index in range(2):  # the same steps one by one, each block stopping at its count
        chosen, proposed = choose_reveals(plan, index, masked,
                                          tiny_model.logits(hidden[masked]), None, MASK)
        chosen &= (index < steps)[:, None]
        tokens, masked = torch.where(chosen, proposed, tokens), masked & ~chosen
        hidden = run_blocks(tiny_model, context, tokens)
    assert torch.equal(after.tokens, tokens) and torch.equal(after.masked, masked)
    assert torch.equal(after.base_hidden, run_blocks(tiny_model, context, after.tokens))
    unchanged = steps == 0
    assert torch.equal(after.tokens[unchanged], blocks.tokens[unchanged])
    revealed = blocks.masked.sum(1) - after.masked.sum(1)  # (N,)
    assert torch.equal(revealed >= steps.clamp(max=1), torch.ones(N, dtype=torch.bool))
    assert (revealed >= blocks.masked.sum(1).clamp(max=2))[steps == 2].all()


def test_chain_loss_adds_the_weighted_commit_loss(tiny_model):
    batch, noisy = packed_batch(seed=3)
    blocks, context = encode_batch(tiny_model, batch, noisy)
    head = MRPHead(tiny_model.config, HeadConfig(num_layers=1))
    with torch.no_grad():
        head.norm.weight.fill_(0.5)
    plan = dataclasses.replace(random_plan("dynamic", blocks, lookahead=2), threshold=0.3)
    steps = list(chain_steps(head, tiny_model, blocks, context, plan))
    kl_only = chain_loss(iter(steps), blocks.rates, 7.0, MASK)
    both = chain_loss(iter(steps), blocks.rates, 7.0, MASK, commit_weight=0.5, threshold=0.3)
    commit = sum(commit_loss(step, 0.3, MASK) for step in steps) / 7.0 / 2
    assert both.item() == pytest.approx(kl_only.item() + 0.5 * commit.item(), rel=1e-5)
    both.backward()
    assert head.fuse.weight.grad.abs().sum() > 0


def test_cached_passes_equal_the_dual_forward(tiny_model):
    batch, noisy = packed_batch()
    blocks, context = encode_batch(tiny_model, batch, noisy)
    slots = select_noisy_slots(noisy.masked, L)
    Tn = slots.index.shape[1]
    for tokens in (blocks.tokens, blocks.targets):  # x_t, and every block fully revealed
        noisy_ids, values = noisy.noisy_ids.clone(), context.layout.scatter(tokens, MASK)
        for b, valid in enumerate(slots.valid):
            noisy_ids[b, slots.index[b, valid]] = values[b, valid]
        inputs = build_dual_inputs(batch, noisy_ids, slots, L)
        with torch.no_grad():
            dual = tiny_model(inputs.input_ids, inputs.positions, inputs.mask)[:, :Tn]
        expected = context.layout.blocks(dual)  # (N, L, H)
        diff = (run_blocks(tiny_model, context, tokens) - expected).abs()
        assert diff.max() < 1e-5, f"max {diff.max():.2e}, mean {diff.mean():.2e} (tolerance 1e-5)"
    diff = (blocks.base_hidden - run_blocks(tiny_model, context, blocks.tokens)).abs()
    assert diff.max() == 0
    assert blocks.masked.any(1).all()  # only blocks with a mask are kept
    assert torch.equal(blocks.tokens == MASK, blocks.masked)


def test_zero_head_loss_is_kl_of_next_to_base(tiny_model):
    batch, noisy = packed_batch()
    blocks, context = encode_batch(tiny_model, batch, noisy)
    plan = random_plan("random", blocks)
    head = MRPHead(tiny_model.config, HeadConfig(num_layers=1))  # zero final norm: C == 0
    steps = chain_steps(head, tiny_model, blocks, context, plan)
    loss = chain_loss(steps, blocks.rates, 17.0, MASK)
    chosen, _ = choose_reveals(plan, 0, blocks.masked, None, blocks.targets, MASK)
    revealed = torch.where(chosen, blocks.targets, blocks.tokens)
    still = blocks.masked & ~chosen
    with torch.no_grad():
        base = tiny_model.logits(blocks.base_hidden)  # (N, L, V)
        after = tiny_model.logits(run_blocks(tiny_model, context, revealed))  # (N, L, V)
    expected = sum(by_hand_kl(after[n, i], base[n, i]) / float(blocks.rates[n, i])
                   for n, i in still.nonzero().tolist()) / 17.0
    assert still.any() and chosen.sum(1).eq(1).all()
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert loss.item() > 0.01


@pytest.mark.exact_arithmetic
def test_lookahead_chains_and_averages(tiny_model):
    batch, noisy = packed_batch(seed=4)
    blocks, context = encode_batch(tiny_model, batch, noisy)
    head = MRPHead(tiny_model.config, HeadConfig(num_layers=1)).train()
    with torch.no_grad():
        head.norm.weight.fill_(0.5)  # a non-zero residual, so the chain matters
    for rule in ("static", "random"):
        plan = random_plan(rule, blocks, lookahead=3, seed=2)
        steps = list(chain_steps(head, tiny_model, blocks, context, plan))
        before = blocks.masked
        for step in steps:  # one reveal per block that still had a mask, nothing else changes
            assert not (step.still & ~before).any()
            assert torch.equal((before & ~step.still).sum(1), before.any(1).long())
            before = step.still
        first = random_plan(rule, blocks, lookahead=1, seed=2)
        single = chain_loss(chain_steps(head, tiny_model, blocks, context, first),
                            blocks.rates, 10.0, MASK)
        triple = chain_loss(iter(steps), blocks.rates, 10.0, MASK)
        step_losses = [chain_loss(iter([s]), blocks.rates, 10.0, MASK) for s in steps]
        assert single.item() == pytest.approx(step_losses[0].item(), rel=1e-6)
        assert triple.item() == pytest.approx(sum(x.item() for x in step_losses) / 3, rel=1e-6)
        triple.backward()  # gradients flow through the chain of accumulators
        assert head.fuse.weight.grad.abs().sum() > 0
        head.zero_grad()


def test_overfit_one_batch_cuts_the_loss_by_90_percent(tiny_model):
    batch, noisy = packed_batch(seed=7)
    blocks, context = encode_batch(tiny_model, batch, noisy)
    plan = random_plan("random", blocks, lookahead=2, seed=3)
    torch.manual_seed(0)
    head = MRPHead(tiny_model.config, HeadConfig(num_layers=1, init_std=0.1)).train()
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(OVERFIT_STEPS):
        loss = chain_loss(chain_steps(head, tiny_model, blocks, context, plan), blocks.rates,
                          float(batch.response.sum()), MASK)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] <= 0.1 * losses[0], f"{losses[0]:.4f} -> {losses[-1]:.4f}"


@pytest.mark.exact_arithmetic
def test_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    batch, noisy = packed_batch(seed=2)
    blocks, context = encode_batch(tiny_model, batch, noisy)
    plan = random_plan("static", blocks, lookahead=2)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        head = MRPHead(tiny_model.config, HeadConfig(num_layers=2))
        head.load_state_dict({k: v + 0.1 for k, v in head.state_dict().items()})
        if checkpointed:
            head_loop.checkpoint_layers(head)
        chain_loss(chain_steps(head, tiny_model, blocks, context, plan), blocks.rates, 9.0,
                   MASK).backward()
        grads.append({name: p.grad for name, p in head.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name


# ----------------------------------------------------------------------------- the loop


def write_model_dir(directory: Path, **overrides) -> Path:
    """A tiny random backbone (block 4; `overrides` of its config) with a trained tokenizer,
    as `mrp train head` reads it."""
    problems, targets = task_texts(("arith",), 40)
    tokenizer = train_tokenizer(problems + targets, 300)
    save_tokenizer(tokenizer, directory)
    config = tiny_config(vocab_size=tokenizer.get_vocab_size(), mask_token_id=3,
                         stop_token_ids=(2, 0), **overrides)
    save_backbone(random_backbone(config), directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("backbone"))


def run_config(model: Path, out: Path, **changes) -> HeadTrainConfig:
    base = HeadTrainConfig(model=str(model), out=str(out), head_layers=1, tasks="arith",
                           train_examples=40, eval_examples=6, seq_len=256, batch_size=4,
                           train_steps=6, lr=3e-3, log_every=2, eval_every=3, save_every=100)
    return dataclasses.replace(base, **changes)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_run_writes_head_logs_and_metrics(model_dir, tmp_path):
    out = head_loop.train_head(run_config(model_dir, tmp_path / "run", lookahead=2,
                                          reveal_rule="static"))
    for name in ("config.json", "model.safetensors", "train_state.pt", "train_config.json",
                 "train_log.jsonl", "metrics.jsonl", "loss_curve.png"):
        assert (out / name).is_file(), name
    assert [r["step"] for r in read_jsonl(out / "train_log.jsonl")] == [2, 4, 6]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [3, 6]
    for key in ("kl_base", "kl_residual", "argmax_agreement", "pick_agreement",
                "base_pick_agreement", "positions"):
        assert len(metrics[-1][key]) == 2, key  # one value per lookahead step
    assert 0 <= metrics[-1]["accepted_drafts"] <= 2
    assert metrics[-1]["kl_residual"][0] < metrics[-1]["kl_base"][0], metrics
    random = metrics[-1]["random_reveal"]  # the same metrics, training's reveal rule
    assert random["positions"] == metrics[-1]["positions"]  # one reveal per block either way
    assert len(random["kl_base"]) == 2 and random["kl_base"] != metrics[-1]["kl_base"]
    head = load_head(out, load_backbone(model_dir))
    assert head.config == HeadConfig(num_layers=1, init_std=0.02)


def test_init_from_starts_from_a_saved_head(model_dir, tmp_path):
    source = head_loop.train_head(run_config(model_dir, tmp_path / "source", train_steps=2))
    config = run_config(model_dir, tmp_path / "tuned", init_from=str(source), train_steps=2,
                        reveal_rule="dynamic", commit_weight=1.0, burn_in_max=3)
    backbone = head_loop.load_frozen_backbone(config, torch.float32, "cpu")
    expected = load_file(str(source / "model.safetensors"))
    started = head_loop.build_head(config, backbone).state_dict()
    assert all(torch.equal(started[name], expected[name]) for name in expected)
    tuned = load_file(str(head_loop.train_head(config) / "model.safetensors"))
    assert not torch.equal(tuned["fuse.weight"], expected["fuse.weight"])
    with pytest.raises(ValueError, match="has 1 layers, not head_layers"):
        head_loop.build_head(dataclasses.replace(config, head_layers=2), backbone)


class Killed(Exception):
    pass


@pytest.mark.exact_arithmetic
def test_resume_gives_identical_weights(model_dir, tmp_path, monkeypatch, caplog):
    straight = head_loop.train_head(run_config(model_dir, tmp_path / "straight"))
    real_step = head_loop.train_step

    def dying_step(run, inputs, step):
        if step == 5:  # one step after the checkpoint at step 4, as if killed
            raise Killed
        return real_step(run, inputs, step)

    interrupted = run_config(model_dir, tmp_path / "resumed", save_every=4)
    monkeypatch.setattr(head_loop, "train_step", dying_step)
    with pytest.raises(Killed):
        head_loop.train_head(interrupted)
    monkeypatch.setattr(head_loop, "train_step", real_step)
    caplog.set_level(logging.INFO, logger="mrp_dlm.training")
    resumed = head_loop.train_head(dataclasses.replace(interrupted, resume=True, eval_every=2))
    assert f"resuming from step 4 of {interrupted.train_steps}" in caplog.text
    expected, actual = (load_file(str(out / "model.safetensors")) for out in (straight, resumed))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    logs = [read_jsonl(out / "train_log.jsonl") for out in (straight, resumed)]
    assert [(r["step"], r["loss"]) for r in logs[0]] == [(r["step"], r["loss"]) for r in logs[1]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ddp_worker(rank: int, world_size: int, port: int, config: HeadTrainConfig) -> None:
    """One torchrun-like process: the env:// variables, then the ordinary entry point."""
    import os

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    head_loop.train_head(config)


@pytest.mark.exact_arithmetic
def test_two_process_ddp_matches_one_process(model_dir, tmp_path):
    """Same global batch of 4 rows: 1 process with 4 rows vs 2 gloo processes with 2 each.

    Tolerance: logged losses rel 1e-5, weights abs 1e-5 after 3 AdamW steps at lr 3e-3 (the
    two runs differ only in float summation order: padding width and gradient all-reduce).
    """
    one, two = one_and_two_processes(run_config(model_dir, tmp_path / "one", train_steps=3,
                                                log_every=1, eval_every=3, lookahead=2))
    assert one["positions"] == two["positions"]
    assert two["kl_residual"] == pytest.approx(one["kl_residual"], rel=1e-4)
    assert two["random_reveal"]["kl_residual"] == pytest.approx(
        one["random_reveal"]["kl_residual"], rel=1e-4)  # reveal keys are per row, not per rank


def one_and_two_processes(config: HeadTrainConfig, worker=ddp_worker,
                          **two_changes) -> tuple[dict, dict]:
    """Train `config` in 1 process and in 2 gloo processes (run by `worker`, with
    `two_changes`); check that the losses and the weights agree and return the last
    metrics of each."""
    single = head_loop.train_head(config)
    double = dataclasses.replace(config, out=str(Path(config.out).parent / "two"), **two_changes)
    mp.spawn(worker, args=(2, free_port(), double), nprocs=2, join=True)
    double_out = Path(double.out)
    logs = [read_jsonl(out / "train_log.jsonl") for out in (single, double_out)]
    for a, b in zip(*logs):
        assert a["step"] == b["step"] and b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    expected, actual = (load_file(str(out / "model.safetensors")) for out in (single, double_out))
    for name in expected:
        diff = (expected[name] - actual[name]).abs().max().item()
        assert diff < 1e-5, f"{name}: max diff {diff:.2e} (tolerance 1e-5)"
    one, two = (read_jsonl(out / "metrics.jsonl")[-1] for out in (single, double_out))
    return one, two


def chat_files(directory: Path) -> str:
    """Arithmetic problems as two chat JSONL files (messages, and prompt/response), a glob."""
    directory.mkdir(parents=True, exist_ok=True)
    problems, targets = task_texts(("arith",), 40)
    for part in range(2):
        rows = [{"id": f"{part}-{i}", "messages": [{"role": "user", "content": problem},
                                                  {"role": "assistant", "content": target}]}
                if part else {"id": f"{part}-{i}", "prompt": problem, "response": target}
                for i, (problem, target) in enumerate(zip(problems[part::2], targets[part::2]))]
        (directory / f"chats-{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(directory / "chats-*.jsonl")


@pytest.mark.exact_arithmetic
def test_resume_from_files_gives_identical_weights(model_dir, tmp_path, monkeypatch):
    """--data read from disk batch by batch: a killed and resumed run equals a straight one;
    the held-out split's acceptance is logged."""
    config = run_config(model_dir, tmp_path / "straight", data=chat_files(tmp_path / "data"),
                        held_out_frac=0.1, eval_prompts=2, eval_new_tokens=8, lookahead=2)
    straight = head_loop.train_head(config)
    acceptance = read_jsonl(straight / "metrics.jsonl")[-1]["acceptance"]
    assert acceptance["prompts"] == 2 and acceptance["rounds"] > 0
    assert 0 <= acceptance["accepted_per_round"] <= 2 and acceptance["lookahead"] == 2
    real_step = head_loop.train_step

    def dying_step(run, inputs, step):
        if step == 5:
            raise Killed
        return real_step(run, inputs, step)

    interrupted = dataclasses.replace(config, out=str(tmp_path / "resumed"), save_every=4)
    monkeypatch.setattr(head_loop, "train_step", dying_step)
    with pytest.raises(Killed):
        head_loop.train_head(interrupted)
    monkeypatch.setattr(head_loop, "train_step", real_step)
    resumed = head_loop.train_head(dataclasses.replace(interrupted, resume=True))
    expected, actual = (load_file(str(out / "model.safetensors")) for out in (straight, resumed))
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.mark.exact_arithmetic
def test_two_process_ddp_on_files_matches_one_process(model_dir, tmp_path):
    """As the test above it, on --data files and with the acceptance metric split over ranks."""
    one, two = one_and_two_processes(run_config(
        model_dir, tmp_path / "one", train_steps=2, log_every=1, eval_every=2,
        data=chat_files(tmp_path / "data"), held_out_frac=0.1, eval_prompts=3,
        eval_new_tokens=8))
    for key in ("accepted_per_round", "rounds", "prompts"):  # tokens per forward counts the
        assert one["acceptance"][key] == two["acceptance"][key]  # batch's rows: not compared


def test_evaluation_rejects_an_unknown_reveal_rule():
    with pytest.raises(ValueError, match="unknown reveal rule 'best'"):
        evaluate_head(None, None, [], 1, None, rules=("static", "best"))


def test_bad_inputs_give_clear_errors(model_dir, tmp_path):
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        run_config(model_dir, tmp_path, lookahead=0)
    with pytest.raises(ValueError, match="unknown reveal_rule"):
        run_config(model_dir, tmp_path, reveal_rule="oracle")
    with pytest.raises(ValueError, match="threshold must be in"):
        run_config(model_dir, tmp_path, threshold=0.0)
    with pytest.raises(ValueError, match="model directory not found"):
        head_loop.train_head(run_config(tmp_path / "nowhere", tmp_path / "a"))
    with pytest.raises(ValueError, match="multiple of the block size"):
        head_loop.train_head(run_config(model_dir, tmp_path / "b", seq_len=126))
    no_tokenizer = tmp_path / "bare"
    save_backbone(load_backbone(model_dir), no_tokenizer)
    with pytest.raises(ValueError, match="no tokenizer"):
        head_loop.train_head(run_config(no_tokenizer, tmp_path / "c"))
    config = run_config(model_dir, tmp_path / "d", train_steps=1)
    head_loop.train_head(config)
    with pytest.raises(ValueError, match="--resume"):
        head_loop.train_head(config)
    with pytest.raises(ValueError, match="lookahead"):
        head_loop.train_head(dataclasses.replace(config, resume=True, lookahead=2))
    other = tmp_path / "other"  # same shapes and tokenizer, other weights
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).parent.mkdir(exist_ok=True)
        (other / name).write_bytes((model_dir / name).read_bytes())
    save_backbone(random_backbone(load_backbone(model_dir).config, seed=9), other)
    with pytest.raises(CheckpointError, match="lm_head_sha256"):
        head_loop.train_head(dataclasses.replace(config, resume=True, model=str(other)))


def test_cli_train_head(model_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    code = cli.main(["train", "head", "--model", str(model_dir), "--out", str(out),
                     "--tasks", "arith", "--train-examples", "40", "--eval-examples", "4",
                     "--seq-len", "128", "--batch-size", "4", "--train-steps", "2",
                     "--head-layers", "1", "--lookahead", "2", "--reveal-rule", "random",
                     "--reveal-max", "2", "--grad-checkpointing", "--bf16"])
    assert code == 0
    assert str(out) in capsys.readouterr().out
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["lookahead"] == 2 and saved["reveal_rule"] == "random"
    assert saved["grad_checkpointing"] and saved["bf16"]
    weights = load_file(str(out / "model.safetensors"))  # float32 even with a bfloat16 backbone
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    assert cli.main(["train", "head", "--model", str(model_dir), "--out", str(tmp_path / "x"),
                     "--lookahead", "0"]) == 2
    assert math.isfinite(read_jsonl(out / "train_log.jsonl")[-1]["loss"])
