"""`mrp serve --model` a tiny random checkpoint in SDAR-30B-A3B's layout (`SDARMoeForCausalLM`,
model_type `sdar_moe`, experts stored per expert, written by the library's own writer),
over HTTP with the `openai` client, with every algorithm, each equal to the library's
decoder of the same checkpoint (and head) on every prompt whose output survives perturbed
logits (tests/margins.py: the engines compute the same logits with other kernels):

| server | the library's decoder |
| --- | --- |
| `LowConfidence` at τ | `--mode dynamic` at τ |
| `MrpSpeculative` at τ, `--tp 2` | `--mode dynamic` at τ (lossless), and `--mode speculative` |
| `MrpDirect` K = 2 | `--mode direct` K = 2 |
| `MrpRemask --remask-rule paper` at τ, δ | `--mode remask --remask-rule paper` at τ, δ |

The head is a random (dense) one, so the head-driven outputs depend on it. Prompts are token
ids (`/v1/completions` takes them), some longer than a block, sent one by one. On this CPU
each sparse layer runs the plugin's MoE stand-in (`serving/moe_cpu.py`): the log says so.
Four server starts (minutes each here).
"""

from __future__ import annotations

import functools

import pytest
import torch

from test_serve import free_port, interrupt, start_server, wait_for_banner  # noqa: E402

from conftest import random_backbone, random_head, tiny_config  # noqa: E402
from margins import stable_rows  # noqa: E402
from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.model.head_loading import save_head  # noqa: E402
from mrp_dlm.model.loading import load_backbone, load_head, save_backbone  # noqa: E402
from mrp_dlm.training.tokenizer import save_tokenizer, train_tokenizer  # noqa: E402
from sglang_env import trim_after_stop  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 12
THRESHOLD, DELTA, K = 0.3, 2.0, 2
STOP, MASK = 2, 3
LENGTHS = (3, 9, 6, 14, 5)
TEXTS = ["What is 7 + 5? 7 + 5 = 12\n#### 12", "Tom has 3 apples and buys 4 more.",
         "def solve():\n    return 3 * 4"] * 4


def moe_config(vocab_size: int):
    """SDAR-30B-A3B's layout, tiny: every layer sparse, 6 experts, 2 per token, renormalised."""
    return tiny_config(vocab_size=vocab_size, mask_token_id=MASK, stop_token_ids=(STOP,),
                       intermediate_size=38, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=12, norm_topk_prob=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-moe")
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    model = random_backbone(moe_config(tokenizer.get_vocab_size()), seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.15)
    save_backbone(model, root / "model")
    save_tokenizer(tokenizer, root / "model")
    save_head(random_head(model, 6, norm=0.3), model, root / "head")
    return root


@functools.lru_cache(maxsize=None)
def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(31)
    return [torch.randint(MASK + 1, vocab_size, (n,), generator=generator).tolist()
            for n in LENGTHS]


def ours(checkpoint, config: DecodeConfig) -> tuple[list[list[int]], list[int]]:
    """(the library's ids, the rows stable under perturbed logits) on the saved files."""
    model = load_backbone(checkpoint / "model")
    head = load_head(checkpoint / "head", model) if config.mode != "dynamic" else None
    rows = prompts(model.config.vocab_size)

    def decode() -> list[list[int]]:
        return generate(model, rows, config, make_decoder(config, head)).token_ids

    want = decode()
    return want, stable_rows(model, decode, want)


def serve(checkpoint, tmp_path, algorithm: str, *flags: str) -> tuple[list[list[int]], str]:
    """Each prompt's ids from `mrp serve --algorithm ALGORITHM`, and the server's log."""
    import openai

    port, log_path = free_port(), tmp_path / f"{algorithm}.log"
    process = start_server(port, log_path, "--model", str(checkpoint / "model"),
                           "--algorithm", algorithm, *flags)
    try:
        wait_for_banner(process, log_path)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        rows = []
        for prompt in prompts(load_backbone(checkpoint / "model").config.vocab_size):
            reply = client.completions.create(model="model", prompt=prompt, max_tokens=MAX_NEW,
                                              temperature=0,
                                              extra_body={"return_token_ids": True})
            ids = reply.choices[0].model_extra["token_ids"]
            rows.append(trim_after_stop(ids, (STOP,), MAX_NEW))
    finally:
        interrupt(process, log_path)
    return rows, log_path.read_text()


def check(served: list[list[int]], want: list[list[int]], stable: list[int]) -> None:
    assert len(stable) >= len(want) - 1, f"only prompts {stable} are stable"
    for index in stable:
        assert served[index] == want[index], f"prompt {index}"


def test_low_confidence_and_speculative_at_tp2(checkpoint, tmp_path):
    rule = DecodeConfig(mode="dynamic", threshold=THRESHOLD, max_new_tokens=MAX_NEW)
    want, stable = ours(checkpoint, rule)
    low, log = serve(checkpoint, tmp_path, "LowConfidence", "--threshold", str(THRESHOLD))
    assert "route and run their experts as Qwen3-MoE does" in log
    check(low, want, stable)
    speculative = DecodeConfig(mode="speculative", threshold=THRESHOLD, lookahead=3,
                               max_new_tokens=MAX_NEW)
    assert ours(checkpoint, speculative)[0] == want
    spec, log = serve(checkpoint, tmp_path, "MrpSpeculative", "--threshold", str(THRESHOLD),
                      "--head", str(checkpoint / "head"), "--tp", "2")
    assert "TP rank 1 of 2" in log
    check(spec, want, stable)


def test_direct_and_remask(checkpoint, tmp_path):
    head = ("--head", str(checkpoint / "head"))
    direct = DecodeConfig(mode="direct", lookahead=K, max_new_tokens=MAX_NEW)
    served, _ = serve(checkpoint, tmp_path, "MrpDirect", "--lookahead", str(K), *head)
    check(served, *ours(checkpoint, direct))
    remask = DecodeConfig(mode="remask", remask_rule="paper", threshold=THRESHOLD,
                          remask_delta=DELTA, max_new_tokens=MAX_NEW)
    served, _ = serve(checkpoint, tmp_path, "MrpRemask", "--threshold", str(THRESHOLD),
                      "--remask-rule", "paper", "--remask-delta", str(DELTA), *head)
    check(served, *ours(checkpoint, remask))
