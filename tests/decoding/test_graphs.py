"""`DecodeConfig.cuda_graphs` on a CPU: the bucketed path (padding rows, kept caches, static
buffers) decodes the reference's tokens in every mode, with the eager path's counts.

A CPU cannot capture a CUDA graph, so the option runs the same steps eager there
(`graph_replays` stays 0); a stand-in graph that reruns the forward over the static buffers
at each replay covers the replay path (inputs copied in, output copied out, one graph per
forward kind) everywhere but the capture call itself.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding import graphs
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from reference import reference_decode, robust_case
from reference_mrp import reference_mrp_generate

MRP = ("speculative", "direct", "remask")
CONFIGS = [DecodeConfig(max_new_tokens=11, stop_token_ids=()),
           DecodeConfig(mode="dynamic", threshold=0.3, max_new_tokens=11, stop_token_ids=()),
           DecodeConfig(mode="speculative", lookahead=2, threshold=0.3, adaptive=False,
                        max_new_tokens=11, stop_token_ids=()),
           DecodeConfig(mode="direct", lookahead=2, max_new_tokens=11, stop_token_ids=()),
           DecodeConfig(mode="remask", threshold=0.3, max_new_tokens=11, stop_token_ids=())]
COUNTS = ("prefill_forwards", "denoise_forwards", "verify_forwards", "store_forwards",
          "head_forwards", "committed", "row_forwards", "rounds", "accepted", "tokens")


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(7000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


def reference_margin(model, head, prompt) -> SimpleNamespace:
    """The smallest decision margin of a prompt's reference decodes under every config."""
    return SimpleNamespace(margin=min(
        reference_mrp_generate(model, head, prompt, config).margin if config.mode in MRP
        else reference_decode(model, prompt, config).margin for config in CONFIGS))


@pytest.fixture(scope="module")
def case():
    model = random_backbone(tiny_config(), seed=4)
    head = random_head(model, 4, norm=0.3)
    prompts = [robust_case(prompt_of, n, i, lambda p: reference_margin(model, head, p))[0]
               for i, n in enumerate((3, 9, 6))]  # batch 3: bucket 4, one padding row
    return model, head, prompts


def decode(model, head, prompts, config):
    decoder = make_decoder(config, head if config.mode in MRP else None)
    return generate(model, prompts, config, decoder)


class EagerReplay:
    """A CPU stand-in for a captured graph: each replay reruns the forward, which reads the
    static inputs, into the static output."""

    def __init__(self, run):
        self.run, self.hidden = run, run()

    def replay(self) -> None:
        self.hidden.copy_(self.run())


def record_eager(self, run):
    graph = EagerReplay(run)
    return graph, graph.hidden


def test_batch_bucket_is_the_next_power_of_two():
    assert [graphs.batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 31, 33)] == [
        1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_slot_buckets_are_few_with_graphs():
    assert [graphs.slot_bucket(n, False) for n in (1, 256, 257, 700)] == [256, 256, 512, 768]
    assert [graphs.slot_bucket(n, True) for n in (1, 256, 257, 700, 1100)] == [
        256, 256, 512, 1024, 2048]


def test_refusal_names_the_reason():
    model = random_backbone(tiny_config(), seed=1)
    assert "no CUDA graphs" in graphs.capture_refusal(model, torch.device("cpu"))
    assert graphs.capture_refusal(model, torch.device("cuda")) is None
    moe = random_backbone(tiny_config(num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=11), seed=1)
    assert "MoE" in graphs.capture_refusal(moe, torch.device("cuda"))


def test_kept_buckets_per_model():
    model = random_backbone(tiny_config(), seed=1)
    first = graphs.bucket(model, 4, 256, graphs=True)
    assert graphs.bucket(model, 4, 256, graphs=True) is first  # its caches, its graphs
    assert not first.graphs.capture  # a CPU: eager, explicitly
    assert graphs.bucket(model, 4, 256, graphs=False) is not first  # off: new caches
    for batch in (1, 2):
        graphs.bucket(model, batch, 256, graphs=True)
    assert graphs.bucket(model, 4, 256, graphs=True) is not first  # evicted


@pytest.mark.parametrize("replay", [False, True], ids=["cpu-eager", "stand-in-graph"])
def test_graphs_option_decodes_the_reference_tokens(case, replay, monkeypatch):
    model, head, prompts = case
    graphs.release(model)  # the other parametrization's kept steps
    if replay:
        monkeypatch.setattr(graphs, "capture_refusal", lambda model, device: None)
        monkeypatch.setattr(graphs.Graphs, "record", record_eager)
    for config in CONFIGS:
        eager = decode(model, head, prompts, config)
        graphed = dataclasses.replace(config, cuda_graphs=True)
        # Twice: the second call reuses the bucket's cache (and graphs) from the first, and
        # its other prompts see none of the first call's keys.
        for batch in (prompts, prompts[::-1]):
            result = decode(model, head, batch, graphed)
            want = [eager.token_ids[prompts.index(p)] for p in batch]
            assert result.token_ids == want, config.mode
            # Padding rows never generate: every count is the real rows' alone.
            for name in COUNTS:
                assert getattr(result.stats, name) == getattr(eager.stats, name), (config, name)
            replays = graphs.bucket(model, 4, 256, graphs=True).graphs.replays
            assert result.stats.graph_replays == sum(replays.values())
            assert replays["backbone"] == (result.stats.denoise_forwards
                                           + result.stats.verify_forwards if replay else 0)
            # The head's steps with at most one pending block replay; the others run eager.
            assert replays["head"] <= result.stats.head_forwards
            assert (replays["head"] > 0) == (replay and config.mode in ("speculative", "direct"))
        if replay:  # one graph per forward kind (token count): denoise, store + next, verify
            kinds = {key[-1] for key in graphs.bucket(model, 4, 256, True).graphs.graphs
                     if key[0] == "backbone"}
            assert {4, 8} <= kinds <= {4, 8, 12}


def test_a_failed_capture_falls_back_to_eager(case, monkeypatch, caplog):
    model, head, prompts = case
    graphs.release(model)

    def fail(self, run):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "capture_refusal", lambda model, device: None)
    monkeypatch.setattr(graphs.Graphs, "record", fail)
    config = CONFIGS[2]  # speculative: backbone and head steps
    eager = decode(model, head, prompts, config)
    with caplog.at_level("WARNING", logger=graphs.__name__):
        result = decode(model, head, prompts, dataclasses.replace(config, cuda_graphs=True))
    assert result.token_ids == eager.token_ids and result.stats.graph_replays == 0
    assert "capturing backbone failed (operation not permitted" in caplog.text
    assert not graphs.bucket(model, 4, 256, graphs=True).graphs.capture


def test_every_step_slot_is_a_view_of_the_slot_range(case, monkeypatch):
    # No tensor made from a host integer per forward (a synchronizing copy on CUDA): every
    # block step's and head step's write slot is a view of its cache's slot range.
    model, head, prompts = case
    seen = []
    run = graphs.Graphs.run

    def spy(self, key, forward, inputs):
        seen.append(inputs[-1])
        return run(self, key, forward, inputs)

    monkeypatch.setattr(graphs.Graphs, "run", spy)
    decode(model, head, prompts, CONFIGS[2])  # speculative: block steps and head steps
    assert seen and all(slot.dim() == 0 and slot._base is not None for slot in seen)
    assert len({slot.untyped_storage().data_ptr() for slot in seen}) <= 2  # backbone, head
