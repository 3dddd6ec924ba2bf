"""SDAR block-diffusion training: mask, noising, loss normalisation, packing, smoke, resume."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mrp_dlm.config import BackboneConfig, TrainConfig
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.tokenizer import load_tokenizer
from mrp_dlm.training import loop, run
from mrp_dlm.training.data import (BatchSchedule, PackedBatch, Sample, collate_rows, pack_rows,
                                   render_prompts)
from mrp_dlm.training.losses import block_diffusion_loss, diffusion_loss
from mrp_dlm.training.masks import all_noisy_slots, build_dual_inputs, select_noisy_slots
from mrp_dlm.training.noise import add_noise

BLOCK = 4
PAD, MASK = 0, 3


def make_sample(length: int, prompt_length: int, first_id: int = 10) -> Sample:
    return Sample(torch.arange(first_id, first_id + length), prompt_length)


def reference_mask(row_lengths: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    """The three-part mask (2T, 2T) of one row, spelled out pair by pair from sample lengths."""
    owner, offset = [], []  # sample index (-1 filler) and offset within the sample, per slot
    for index, length in enumerate(row_lengths):
        owner += [index] * length
        offset += list(range(length))
    owner += [-1] * (seq_len - len(owner))
    offset += [0] * (seq_len - len(offset))
    mask = torch.zeros(2 * seq_len, 2 * seq_len, dtype=torch.bool)
    for q in range(2 * seq_len):
        for k in range(2 * seq_len):
            qs, ks = q % seq_len, k % seq_len
            if q == k:
                mask[q, k] = True
                continue
            if owner[qs] < 0 or owner[qs] != owner[ks]:
                continue
            q_block, k_block = offset[qs] // block_size, offset[ks] // block_size
            q_noisy, k_noisy = q < seq_len, k < seq_len
            if q_noisy and k_noisy:
                mask[q, k] = q_block == k_block
            elif q_noisy:
                mask[q, k] = k_block < q_block
            elif not k_noisy:
                mask[q, k] = k_block <= q_block
    return mask


def packed_example(seq_len: int = 24) -> tuple[list[list[int]], PackedBatch]:
    rows = [[8, 12], [4, 16, 4], [20]]  # the last row ends with 4 filler slots
    samples, row_indices = [], []
    for lengths in rows:
        row_indices.append(list(range(len(samples), len(samples) + len(lengths))))
        samples += [make_sample(n, 2) for n in lengths]
    return rows, collate_rows(samples, row_indices, seq_len, PAD)


def test_training_mask_matches_slow_reference():
    rows, batch = packed_example()
    B, T = batch.input_ids.shape
    slots = all_noisy_slots(B, T)
    inputs = build_dual_inputs(batch, batch.input_ids, slots, BLOCK)
    assert inputs.mask.shape == (B, 2 * T, 2 * T)
    assert torch.equal(inputs.positions[:, :T], inputs.positions[:, T:])
    for b, lengths in enumerate(rows):
        expected = reference_mask(lengths, T, BLOCK)
        differ = int((inputs.mask[b] != expected).sum())
        assert differ == 0, f"row {b}: {differ} pairs differ"


def test_kept_noisy_blocks_mask_is_the_reference_restricted():
    rows, batch = packed_example()
    B, T = batch.input_ids.shape
    masked = torch.zeros(B, T, dtype=torch.bool)
    masked[0, [5, 9, 18]] = True  # blocks 1, 2, 4 of row 0
    masked[2, 13] = True  # block 3 of row 2
    slots = select_noisy_slots(masked, BLOCK)
    assert slots.index.shape == (B, 12)
    assert slots.index[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19]
    assert slots.valid.sum(1).tolist() == [12, 0, 4]
    inputs = build_dual_inputs(batch, batch.input_ids, slots, BLOCK)
    Tn = slots.index.shape[1]
    for b, lengths in enumerate(rows):
        expected = reference_mask(lengths, T, BLOCK)
        kept = torch.cat((slots.index[b][slots.valid[b]], T + torch.arange(T)))
        valid = torch.cat((slots.valid[b], torch.ones(T, dtype=torch.bool)))
        assert torch.equal(inputs.mask[b][valid][:, valid], expected[kept][:, kept]), f"row {b}"
        padding = (~slots.valid[b]).nonzero().flatten()
        for q in padding.tolist():  # padding slots see only themselves and are never seen
            assert inputs.mask[b, q].nonzero().flatten().tolist() == [q]
            assert inputs.mask[b, :, q].nonzero().flatten().tolist() == [q]
    assert inputs.input_ids.shape == (B, Tn + T)


def test_packing_restarts_positions_and_labels_pads():
    samples = [make_sample(8, 3), make_sample(12, 5), make_sample(4, 1)]
    batch = collate_rows(samples, [[0, 1], [2]], 24, PAD)
    assert batch.positions[0].tolist() == list(range(8)) + list(range(12)) + [0] * 4
    assert batch.segment_ids[1].tolist() == [0] * 4 + [-1] * 20
    expected_response = [False] * 3 + [True] * 5 + [False] * 5 + [True] * 7 + [False] * 4
    assert batch.response[0].tolist() == expected_response
    assert batch.num_tokens == 24
    rows = pack_rows([16, 16, 8, 8], [0, 1, 2, 3], 24)
    assert rows == [[0, 2], [1, 3]]


def test_batch_order_is_a_pure_function_of_seed_and_step():
    samples = [make_sample(4 * (1 + i % 5), 2, first_id=i) for i in range(40)]
    first, second = (BatchSchedule(samples, 32, 2, seed=7, pad_id=PAD) for _ in range(2))
    later = [first.batch(step) for step in (0, 3, 11, 40)]
    for step, batch in zip((40, 11, 3, 0), reversed(later)):
        assert torch.equal(second.batch(step).input_ids, batch.input_ids)
    other_seed = BatchSchedule(samples, 32, 2, seed=8, pad_id=PAD)
    assert not torch.equal(other_seed.batch(0).input_ids, later[0].input_ids)


def test_noising_never_masks_prompt_or_filler():
    samples = [make_sample(12, 5), make_sample(8, 7), make_sample(16, 9), make_sample(4, 0)]
    batch = collate_rows(samples, [[0, 1], [2, 3]], 24, PAD)
    masked_any = torch.zeros_like(batch.response)
    for seed in range(200):
        noisy = add_noise(batch.input_ids, batch.segment_ids, batch.response, MASK,
                          torch.Generator().manual_seed(seed))
        assert not (noisy.masked & ~batch.response).any()
        assert torch.equal(noisy.noisy_ids == MASK, noisy.masked)
        assert torch.equal(noisy.noisy_ids[~noisy.masked], batch.input_ids[~noisy.masked])
        rates = noisy.mask_rate[batch.segment_ids >= 0]
        assert rates.min() >= 1e-3 and rates.max() <= 1.0
        masked_any |= noisy.masked
    assert torch.equal(masked_any, batch.response)  # every response token gets masked sometimes


def test_diffusion_loss_normalisation_by_hand():
    V = 6
    logits = torch.zeros(2, V)  # uniform over the V - 1 tokens that are not [MASK]
    logits[1, 4] = math.log(3.0)  # target 4 has weight 3 among 1+1+1+3+1 (mask excluded)
    targets = torch.tensor([1, 4])
    rates = torch.tensor([0.5, 0.25])
    loss = diffusion_loss(logits, targets, rates, num_response_tokens=7, mask_token_id=MASK)
    expected = (math.log(5) / 0.5 + math.log(7 / 3) / 0.25) / 7
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_block_diffusion_loss_counts_response_tokens_only():
    config = BackboneConfig(vocab_size=99, hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=48, block_size=BLOCK,
                            mask_token_id=MASK)
    model = Backbone(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: CE is log(V - 1) at every masked position
    batch = collate_rows([make_sample(8, 3), make_sample(8, 6), make_sample(12, 2)],
                         [[0, 1], [2]], 20, PAD)
    noisy = add_noise(batch.input_ids, batch.segment_ids, batch.response, MASK,
                      torch.Generator().manual_seed(3))
    loss = block_diffusion_loss(model, batch, noisy)
    expected = (math.log(98) / noisy.mask_rate[noisy.masked]).sum() / (5 + 2 + 10)
    assert int(batch.response.sum()) == 17
    assert noisy.masked.any()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_dropping_unmasked_noisy_blocks_keeps_the_loss(make_model):
    model = make_model(block_size=BLOCK, std=0.2).train()
    mask_token_id = model.config.mask_token_id
    samples = [make_sample(n, p, first_id=5) for n, p in ((12, 6), (8, 5), (16, 9), (8, 2))]
    batch = collate_rows(samples, [[0, 1], [2, 3]], 28, PAD)
    for seed in range(3):
        noisy = add_noise(batch.input_ids, batch.segment_ids, batch.response, mask_token_id,
                          torch.Generator().manual_seed(seed))
        full = block_diffusion_loss(model, batch, noisy, all_noisy_slots(2, 28))
        kept = block_diffusion_loss(model, batch, noisy)
        assert select_noisy_slots(noisy.masked, BLOCK).index.shape[1] < 28
        assert kept.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)


def test_learning_rate_schedule():
    config = TrainConfig(out="unused", preset="tiny", train_steps=100, lr=1e-3,
                         warmup_frac=0.1, min_lr_ratio=0.1)
    assert run.learning_rate(config, 0) == pytest.approx(1e-4)
    assert run.learning_rate(config, 9) == pytest.approx(1e-3)
    assert run.learning_rate(config, 99) == pytest.approx(1e-4)
    rates = [run.learning_rate(config, s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_train_config_validation():
    with pytest.raises(ValueError, match="multiple of block_size"):
        TrainConfig(out="x", seq_len=100, block_size=16)
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig(out="x", preset="huge")


def tiny_config(out: Path, **changes) -> TrainConfig:
    base = TrainConfig(out=str(out), preset="tiny", block_size=BLOCK, tasks="arith",
                       train_examples=40, seq_len=256, batch_size=2, train_steps=8, lr=3e-3,
                       warmup_frac=0.1, vocab_size=400, log_every=2, save_every=100)
    return dataclasses.replace(base, **changes)


def read_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def test_training_smoke_loss_falls(tmp_path):
    config = tiny_config(tmp_path / "run", train_examples=100, batch_size=4, train_steps=60,
                         lr=5e-3, log_every=10, save_every=30)
    out = loop.train_backbone(config)
    history = [json.loads(line) for line in (out / run.LOG_FILE).read_text().splitlines()]
    losses = [r["loss"] for r in history]
    assert [r["step"] for r in history] == [10, 20, 30, 40, 50, 60]
    assert (losses[-1] + losses[-2]) / 2 < 0.65 * losses[0], losses  # about 5.0 -> 2.7
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 run.STATE_FILE, run.CONFIG_FILE, run.CURVE_FILE):
        assert (out / name).is_file(), name
    state = torch.load(out / run.STATE_FILE, weights_only=True)
    assert state["progress"]["step"] == 60
    tokenizer = load_tokenizer(out)
    problems = ["What is 2 + 3?", "A jar holds 7 coins.\nHow many?"]
    assert render_prompts(problems, tokenizer) == [tokenizer.render_chat(p) for p in problems]


class Killed(Exception):
    pass


@pytest.mark.exact_arithmetic
def test_resume_gives_identical_weights(tmp_path, monkeypatch):
    straight = loop.train_backbone(tiny_config(tmp_path / "straight"))
    real_step = loop.train_step

    def dying_step(model, optimizer, batch, config, step, precision):
        if step == 6:  # two steps after the checkpoint at step 4, as if killed
            raise Killed
        return real_step(model, optimizer, batch, config, step, precision)

    interrupted = tiny_config(tmp_path / "resumed", save_every=4)
    monkeypatch.setattr(loop, "train_step", dying_step)
    with pytest.raises(Killed):
        loop.train_backbone(interrupted)
    monkeypatch.setattr(loop, "train_step", real_step)
    resumed = loop.train_backbone(dataclasses.replace(interrupted, resume=True))
    expected, actual = read_weights(straight), read_weights(resumed)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    logs = [[json.loads(line) for line in (out / run.LOG_FILE).read_text().splitlines()]
            for out in (straight, resumed)]
    assert [(r["step"], r["loss"]) for r in logs[0]] == [(r["step"], r["loss"]) for r in logs[1]]


def test_resume_guards(tmp_path):
    config = tiny_config(tmp_path / "run", train_steps=2)
    loop.train_backbone(config)
    with pytest.raises(ValueError, match="--resume"):
        loop.train_backbone(config)
    with pytest.raises(ValueError, match="lr"):
        loop.train_backbone(dataclasses.replace(config, resume=True, lr=1e-2))


def test_resume_reads_runs_saved_before_the_renames():
    """A run saved with `steps` and `init_from` resumes under train_steps and model; a real
    change to a renamed field still fails."""
    config = TrainConfig(out="x", preset="tiny", model="source", train_steps=5)
    saved = dataclasses.asdict(config)
    saved["steps"], saved["init_from"] = saved.pop("train_steps"), saved.pop("model")
    run.check_resumable(saved, config, renamed=loop.RENAMED_FIELDS)
    with pytest.raises(ValueError, match="train_steps: 5 -> 6"):
        run.check_resumable(saved, dataclasses.replace(config, train_steps=6),
                            renamed=loop.RENAMED_FIELDS)
    with pytest.raises(ValueError, match="model: 'source' -> 'other'"):
        run.check_resumable(saved, dataclasses.replace(config, model="other"),
                            renamed=loop.RENAMED_FIELDS)
