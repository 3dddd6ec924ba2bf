"""The paper's remask rule, the residual veto (`decoding/veto.py`), on tiny random models.

- `veto_unstable` on hand-built tensors: either sign, the boundary, the smallest-|C|
  fallback and its tie, rows without proposals;
- library == the slow reference (`reference_mrp.veto_block`), greedy and sampled, both head
  contexts, on cases drawn with a decision margin, including steps where every proposal is
  vetoed and the fallback decides;
- a head that predicts no change, or a δ nothing exceeds: the rule is dynamic decoding;
- batch rows == solo rows; the counts; config errors; the CLI.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from conftest import random_head, run_cli
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.veto import veto_unstable
from reference import robust_case
from reference_mrp import reference_mrp_generate
from test_mrp_modes import (LENGTHS, MAX_NEW, backbone, check_reference, decode,
                            describe_mismatch, prompt_of, robust_batch, zero_head)

RULES = ("paper",)


# --- the veto on hand-built tensors ---------------------------------------------------------

def test_veto_drops_large_residuals_of_either_sign():
    proposed = torch.tensor([[True, True, True, False], [True, False, True, True]])
    residual = torch.tensor([[0.5, -2.5, 2.0, 9.0], [-1.0, 0.0, 3.0, -2.0]])
    kept = veto_unstable(proposed, residual, 2.0)
    # |C| == δ survives (the official `<=`); a position not proposed never becomes a reveal.
    assert kept.tolist() == [[True, False, True, False], [True, False, False, True]]


def test_all_vetoed_keeps_the_smallest_residual():
    proposed = torch.tensor([[True, True, True, False], [False, True, False, True],
                             [False, False, False, False]])
    residual = torch.tensor([[3.0, -2.5, 4.0, 0.0], [-5.0, 6.0, 0.1, -6.0],
                             [0.0, 0.0, 0.0, 0.0]])
    kept = veto_unstable(proposed, residual, 1.0)
    assert kept.tolist() == [[False, True, False, False],  # |-2.5| is the smallest proposed
                             [False, True, False, False],  # tie |6| == |-6|: lower position
                             [False, False, False, False]]  # nothing proposed, nothing kept


def test_veto_keeps_at_least_one_per_proposing_row():
    generator = torch.Generator().manual_seed(0)
    proposed = torch.rand(13, 7, generator=generator) < 0.5
    residual = 4 * torch.randn(13, 7, generator=generator)
    kept = veto_unstable(proposed, residual, 0.5)
    assert not (kept & ~proposed).any()
    assert torch.equal(kept.any(dim=1), proposed.any(dim=1))


# --- against the slow reference -------------------------------------------------------------

def paper_config(rule: str, threshold: float, delta: float, **overrides) -> DecodeConfig:
    knobs = {**dict(max_new_tokens=13, stop_token_ids=()), **overrides}
    return DecodeConfig(mode="remask", remask_rule=rule, remask_delta=delta,
                        threshold=threshold, **knobs)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("threshold,delta,sampling", [
    (0.2, 2.0, {}), (0.3, 0.5, {}), (0.2, 0.02, {}),
    (0.2, 1.0, dict(temperature=0.8, top_k=6, seed=3)),
])
def test_veto_matches_reference(rule, threshold, delta, sampling):
    model = backbone(7, 4)
    config = paper_config(rule, threshold, delta, **sampling)
    traces = [trace for _, trace in check_reference(model, random_head(model, 7, norm=0.3),
                                                     config, lengths=(8, 6, 3, 5))]
    # Not vacuous: proposals were vetoed, and some steps needed no head run.
    assert sum(t.revoked for t in traces) > 0
    assert sum(t.head_skips for t in traces) > 0
    if delta < 0.1:  # a δ this small vetoes everything: the fallback decides
        assert sum(t.fallbacks for t in traces) > 0


# --- when the head cannot veto, this is dynamic decoding ------------------------------------

@pytest.mark.parametrize("block_size,threshold,head_kind,sampling", [
    (4, 0.3, "zero", {}), (16, 0.2, "zero", {}), (16, 0.5, "huge-delta", {}),
    (4, 0.3, "zero", dict(temperature=0.8, top_p=0.8, seed=2)),
])
def test_no_veto_is_dynamic(block_size, threshold, head_kind, sampling):
    model = backbone(0, block_size)
    common = dict(block_size=block_size, threshold=threshold, max_new_tokens=MAX_NEW[block_size],
                  stop_token_ids=(), **sampling)
    dynamic_config = DecodeConfig(mode="dynamic", **common)
    prompts = robust_batch(0, block_size, False, dynamic_config)
    dynamic = decode(model, prompts, dynamic_config)
    head, delta = ((zero_head(model), 0.0) if head_kind == "zero"
                   else (random_head(model, 0), 1e9))
    for rule in RULES:
        config = DecodeConfig(mode="remask", remask_rule=rule, remask_delta=delta, **common)
        result = decode(model, prompts, config, head)
        assert result.token_ids == dynamic.token_ids, describe_mismatch(result.token_ids,
                                                                        dynamic.token_ids)
        stats = result.stats
        assert stats.vetoed == 0
        assert stats.denoise_forwards == dynamic.stats.denoise_forwards
        # Every step runs the head, unless no row has two proposals.
        assert stats.head_forwards + stats.head_skips == stats.denoise_forwards
        assert stats.head_forwards > 0 and stats.head_skips > 0


# --- batches, counts, errors, CLI -----------------------------------------------------------

@pytest.mark.parametrize("rule", RULES)
def test_batch_rows_equal_solo_rows(rule):
    # Rows of other prompt lengths (left padding), each stopping at its own stop id.
    model = backbone(3, 4)
    head = random_head(model, 3, norm=0.3)
    probe = paper_config(rule, 0.2, 0.5)
    prompts = [robust_case(prompt_of, n, 80 + i,
                           lambda prompt: reference_mrp_generate(model, head, prompt, probe))[0]
               for i, n in enumerate(LENGTHS)]
    free = decode(model, prompts, probe, head).token_ids
    stop = Counter(token for row in free for token in set(row[3:])).most_common(1)[0][0]
    config = paper_config(rule, 0.2, 0.5, stop_token_ids=(stop,))
    batch = decode(model, prompts, config, head)
    solos = [decode(model, [prompt], config, head) for prompt in prompts]
    for index, solo in enumerate(solos):
        assert batch.token_ids[index] == solo.token_ids[0], f"row {index}"
    assert batch.stats.vetoed > 0
    assert len({len(row) for row in batch.token_ids}) > 1, "rows should stop at different lengths"


def test_counts():
    model = backbone(0, 4)
    config = paper_config("paper", 0.2, 0.5)
    result = decode(model, [prompt_of(9, 1)], config, random_head(model, 0, norm=0.3))
    stats = result.stats
    assert stats.tokens == 13 and stats.verify_forwards == 0
    assert stats.head_forwards + stats.head_skips == stats.denoise_forwards
    assert stats.head_store_forwards == 0  # the head alone never writes its keys
    assert stats.vetoed > 0
    assert stats.committed == -(-(9 % 4 + 13) // 4) * 4 - 9 % 4  # every block filled
    summary = stats.to_dict()
    assert summary["head_skips"] == stats.head_skips and summary["vetoed"] == stats.vetoed


@pytest.mark.parametrize("kwargs,message", [
    (dict(remask_rule="nope"), "unknown remask_rule"),
    (dict(remask_delta=-1.0), "remask_delta must be >= 0"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(mode="remask", **kwargs)


def test_paper_rule_needs_one_step_per_position():
    config = DecodeConfig(mode="remask", remask_rule="paper", block_size=4, steps=2)
    with pytest.raises(ValueError, match="steps must equal block_size"):
        config.resolve(backbone(0, 4).config)
    DecodeConfig(mode="remask", remask_rule="chain", steps=2).resolve(backbone(0, 4).config)


def test_cli_generate_paper_rule(saved_model_and_head, capsys):
    model_dir, head_dir = saved_model_and_head
    common = ["generate", "--model", str(model_dir), "--prompt", "What is 7 + 5?",
              "--max-new-tokens", "11", "--json", "--threshold", "0.3"]
    code, out, err = run_cli(capsys, *common, "--mode", "remask", "--remask-rule", "paper",
                             "--remask-delta", "1e9", "--head", str(head_dir))
    assert code == 0, err
    paper = json.loads(out.strip().splitlines()[-1])
    assert paper["stats"]["vetoed"] == 0
    code, out, err = run_cli(capsys, *common, "--mode", "dynamic")
    assert code == 0, err
    assert paper["token_ids"] == json.loads(out.strip().splitlines()[-1])["token_ids"]
