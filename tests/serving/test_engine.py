"""The real SGLang engine on CPU (stand-ins for triton, torchvision and sgl_kernel) with a
tiny random SDAR model and an MRP head: `MrpSpeculative` == `LowConfidence` at the same
threshold (0.3: several tokens per step on this model), token for token, each prompt solo
and all prompts batched; and both == our own dynamic decoder at that threshold on the same
checkpoint, and == our own speculative decoder. (Threshold 1.0, static decoding, is tested
with the fake engine in `test_algorithms.py`, and against the embedded model in
`test_cross_engine.py`.) The backbone's attention is damped and the head is a fresh
(zero) one, so that long draft runs are accepted and the verify rows really carry several
candidates.

`MrpDirect` with a random head (its output depends on the head's context attention) ==
our own `--mode direct` decoder on the same checkpoint and head, solo and batched. Prompts
longer than one block are in both sets, so the head's keys of prompt blocks matter; the
batched run follows the solo runs on the same engine, so its prompt blocks come from
SGLang's prefix cache, with the head's keys the solo runs wrote.

Three engine start-ups in all (one per algorithm); each serves the solo and batched runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from sglang_env import (generate_ids, require_sglang, start_engine, stop_engine,
                        tokens_per_forward, trim_after_stop)

require_sglang()

from conftest import random_backbone, random_head, tiny_config  # noqa: E402
from mrp_dlm.config import DecodeConfig, HeadConfig  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.model.loading import load_backbone  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from mrp_dlm.model.head_loading import save_head  # noqa: E402
from mrp_dlm.model.loading import load_head, save_backbone  # noqa: E402
from reference import reference_decode, robust_case  # noqa: E402
from mrp_dlm.serving.head_pool import head_bytes_per_token  # noqa: E402
from reference_mrp import reference_mrp_generate  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # an SGLang engine start: 30-70 s

LENGTHS = (3, 8, 5, 13, 1)
MAX_NEW = 14
THRESHOLD = 0.3
RULE = DecodeConfig(mode="dynamic", threshold=THRESHOLD, max_new_tokens=MAX_NEW)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(4000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


@functools.lru_cache(maxsize=None)
def damped_backbone():
    model = random_backbone(tiny_config(stop_token_ids=(97,)), seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.15)
    return model


# One prompt per length whose reference decode under the rule has no decision within float
# noise of flipping (the engine computes the same logits with other kernels).
PROMPTS = [robust_case(prompt_of, n, i,
                       lambda prompt: reference_decode(damped_backbone(), prompt, RULE))[0]
           for i, n in enumerate(LENGTHS)]


DIRECT = DecodeConfig(mode="direct", lookahead=2, max_new_tokens=MAX_NEW)


@functools.lru_cache(maxsize=None)
def direct_head():
    return random_head(damped_backbone(), 7, norm=0.3)


DIRECT_PROMPTS = [robust_case(prompt_of, n, 10 + i,
                              lambda prompt: reference_mrp_generate(
                                  damped_backbone(), direct_head(), prompt, DIRECT))[0]
                  for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-tiny")
    model = damped_backbone()
    save_backbone(model, root / "model")
    save_head(MRPHead(model.config, HeadConfig(num_layers=1)), model, root / "head")
    (root / "mrp.yaml").write_text(f"head: {root / 'head'}\nlookahead: 3\n"
                                   f"threshold: {THRESHOLD}\nadaptive: false\n")
    (root / "low.yaml").write_text(f"threshold: {THRESHOLD}\n")
    save_head(direct_head(), model, root / "random-head")
    (root / "direct.yaml").write_text(f"head: {root / 'random-head'}\n"
                                      f"lookahead: {DIRECT.lookahead}\n")
    return root


def our_rule(checkpoint):
    """Our own greedy dynamic decode of the saved checkpoint at THRESHOLD (and its stats)."""
    model = load_backbone(checkpoint / "model")
    return generate(model, PROMPTS, RULE, make_decoder(RULE, None))


@dataclass(frozen=True)
class Served:
    solo: list[list[int]]  # each prompt alone
    batched: list[list[int]]  # all prompts in one batch, after the solo runs
    rate: float  # tokens per forward of the batched run
    log: str  # the engine's log up to the batched run (start-up and solo runs)


def serve_solo_and_batched(checkpoint, algorithm: str, config: str, capfd,
                           prompts=PROMPTS) -> Served:
    engine = start_engine(checkpoint / "model", algorithm, checkpoint / config)
    try:
        solo = [generate_ids(engine, [prompt], MAX_NEW)[0] for prompt in prompts]
        log = capfd.readouterr().err
        batched = generate_ids(engine, prompts, MAX_NEW)
        rate = tokens_per_forward(batched, capfd.readouterr().err)
    finally:
        stop_engine(engine)
    return Served(solo, batched, rate, log)


def test_speculative_equals_low_confidence_solo_and_batched(checkpoint, capfd):
    low = serve_solo_and_batched(checkpoint, "LowConfidence", "low.yaml", capfd)
    low_solo, low_batched, low_rate = low.solo, low.batched, low.rate
    assert low_solo == low_batched
    assert all(len(row) > 0 for row in low_solo)
    spec = serve_solo_and_batched(checkpoint, "MrpSpeculative", "mrp.yaml", capfd)
    spec_solo, spec_batched, spec_rate = spec.solo, spec.batched, spec.rate
    assert spec_solo == low_solo
    assert spec_batched == low_batched
    ours = our_rule(checkpoint)
    assert [trim_after_stop(row, (97,), MAX_NEW) for row in low_batched] == ours.token_ids
    model = load_backbone(checkpoint / "model")
    speculative = DecodeConfig(mode="speculative", threshold=THRESHOLD, lookahead=3,
                               adaptive=False, max_new_tokens=MAX_NEW)
    head = load_head(checkpoint / "head", model)
    assert generate(model, PROMPTS, speculative,
                    make_decoder(speculative, head)).token_ids == ours.token_ids
    # Not static decoding again: the rule commits several tokens per step here.
    assert ours.stats.row_denoise_forwards < ours.stats.committed
    assert spec_rate > low_rate, "the zero head on a damped backbone gained nothing"
    print(f"tokens per forward on the real engine: LowConfidence {low_rate:.3f}, "
          f"MrpSpeculative {spec_rate:.3f}")


def test_direct_equals_our_direct_decoder_solo_and_batched(checkpoint, capfd):
    served = serve_solo_and_batched(checkpoint, "MrpDirect", "direct.yaml", capfd,
                                    DIRECT_PROMPTS)
    model = load_backbone(checkpoint / "model")
    head = load_head(checkpoint / "random-head", model)
    ours = generate(model, DIRECT_PROMPTS, DIRECT, make_decoder(DIRECT, head)).token_ids
    assert any(len(p) > model.config.block_size for p in DIRECT_PROMPTS)
    assert [trim_after_stop(row, (97,), MAX_NEW) for row in served.solo] == ours
    assert [trim_after_stop(row, (97,), MAX_NEW) for row in served.batched] == ours
    # The head's pool is planned into SGLang's per-token KV size, and allocated (1 layer
    # x 2 x 2 kv heads x 8 head dim x 4 bytes = 128 bytes per token here).
    per_token = head_bytes_per_token(1, model.config.num_kv_heads, model.config.head_dim,
                                     torch.float32)
    assert f"+ {per_token} for the MRP head's 1 layers" in served.log
    assert f"x {per_token} bytes per token" in served.log
