"""Tensor parallelism on the real SGLang engine, CPU, 2 ranks (gloo all-reduce; each rank
its own process and its share of the cores): the backbone split by SGLang, the MRP head
split by the plugin (`head_tp.py`: attention heads, MLP width, a head KV pool per rank) and
its logits gathered over the lm_head's vocabulary shards.

- `MrpDirect` with a random head (its output depends on the head's context attention, so
  on the per-rank pools) at --tp 2 returns what it returns at --tp 1, and both equal our
  own `--mode direct` decoder on the same checkpoint and head, each prompt solo and all
  prompts batched (prompts longer than a block: the head's keys of prompt blocks matter);
- `MrpSpeculative` with that head at --tp 2 equals our own dynamic rule at its threshold
  (lossless), solo and batched.

The tiny model's widths split over 2 ranks (4 q / 2 kv heads, MLP width 38). Three engine
starts (minutes each on a CPU).
"""

from __future__ import annotations

import functools

import pytest
import torch

from sglang_env import generate_ids, require_sglang, start_engine, stop_engine, trim_after_stop

require_sglang()

from conftest import random_backbone, random_head, tiny_config  # noqa: E402
from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.model.head_loading import save_head  # noqa: E402
from mrp_dlm.model.loading import save_backbone  # noqa: E402
from reference import reference_decode, robust_case  # noqa: E402
from reference_mrp import reference_mrp_generate  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

LENGTHS = (3, 8, 5, 13)
MAX_NEW = 12
STOP = 97
DIRECT = DecodeConfig(mode="direct", lookahead=2, max_new_tokens=MAX_NEW)
RULE = DecodeConfig(mode="dynamic", threshold=0.3, max_new_tokens=MAX_NEW)
SPECULATIVE = DecodeConfig(mode="speculative", threshold=0.3, lookahead=3, adaptive=False,
                           max_new_tokens=MAX_NEW)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(7000 + seed)
    return torch.randint(0, STOP, (length,), generator=generator).tolist()


@functools.lru_cache(maxsize=None)
def model_and_head():
    model = random_backbone(tiny_config(intermediate_size=38, stop_token_ids=(STOP,)), seed=3)
    with torch.no_grad():  # damped attention: the rule commits several tokens per step
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
    return model, random_head(model, 8, norm=0.3)


def direct_prompts() -> list[list[int]]:
    model, head = model_and_head()
    return [robust_case(prompt_of, n, i, lambda p: reference_mrp_generate(model, head, p,
                                                                          DIRECT))[0]
            for i, n in enumerate(LENGTHS)]


def rule_prompts() -> list[list[int]]:
    model = model_and_head()[0]
    return [robust_case(prompt_of, n, 20 + i, lambda p: reference_decode(model, p, RULE))[0]
            for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-tp")
    model, head = model_and_head()
    save_backbone(model, root / "model")
    save_head(head, model, root / "head")
    (root / "direct.yaml").write_text(f"head: {root / 'head'}\nlookahead: {DIRECT.lookahead}\n")
    (root / "spec.yaml").write_text(f"head: {root / 'head'}\nlookahead: 3\nthreshold: "
                                    f"{RULE.threshold}\nadaptive: false\n")
    return root


def served(checkpoint, algorithm: str, config: str, prompts, tp: int) -> list[list[int]]:
    """Each prompt solo, then all batched (equal), trimmed as our decoder trims."""
    engine = start_engine(checkpoint / "model", algorithm, checkpoint / config, tp_size=tp)
    try:
        solo = [generate_ids(engine, [prompt], MAX_NEW)[0] for prompt in prompts]
        batched = generate_ids(engine, prompts, MAX_NEW)
    finally:
        stop_engine(engine)
    solo, batched = ([trim_after_stop(row, (STOP,), MAX_NEW) for row in rows]
                     for rows in (solo, batched))
    assert solo == batched
    return solo


def test_direct_at_tp2_equals_tp1_and_our_decoder(checkpoint):
    model, head = model_and_head()
    prompts = direct_prompts()
    ours = generate(model, prompts, DIRECT, make_decoder(DIRECT, head)).token_ids
    assert any(len(p) > model.config.block_size for p in prompts)
    two = served(checkpoint, "MrpDirect", "direct.yaml", prompts, tp=2)
    assert two == ours
    assert served(checkpoint, "MrpDirect", "direct.yaml", prompts, tp=1) == two


def test_speculative_at_tp2_equals_the_rule(checkpoint):
    model, head = model_and_head()
    prompts = rule_prompts()
    rule = generate(model, prompts, RULE, make_decoder(RULE, None))
    assert rule.stats.row_denoise_forwards < rule.stats.committed  # several tokens per step
    assert generate(model, prompts, SPECULATIVE,
                    make_decoder(SPECULATIVE, head)).token_ids == rule.token_ids
    assert served(checkpoint, "MrpSpeculative", "spec.yaml", prompts, tp=2) == rule.token_ids
