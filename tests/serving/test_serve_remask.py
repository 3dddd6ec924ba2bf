"""`mrp serve --algorithm MrpRemask` end to end on this CPU: the embedded model and head, the
chain rule by default (the library's), over HTTP with the `openai` client.

- the server says it serves the chain rule;
- completions and chat requests, greedy, return the token ids of our own `mrp generate
  --mode remask` (chain rule) at the same threshold, and seeded sampled chat requests those
  of our seeded sampled remask decode, on every prompt whose output survives perturbed
  logits (tests/margins.py: the engines compute the same logits with other kernels);
- the threshold is low enough that the head sends reveals back (the library's decode of
  these prompts counts vetoes), so the comparison is not dynamic decoding's.

Nothing here hard-codes an output: every comparison is between two decoders run here.
One SGLang server start (40-90 s here).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (run .ci/install_sglang.sh)", allow_module_level=True)

from margins import stable_rows  # noqa: E402
from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.pipeline import Pipeline, embedded_head_dir  # noqa: E402
from sglang_env import trim_after_stop  # noqa: E402
from test_serve import (MAX_NEW, PROMPTS, free_port, interrupt, served,  # noqa: E402
                        start_server, wait_for_banner)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

THRESHOLD = 0.5  # remask's regime: dynamic decoding alone loses accuracy here
SAMPLED = dict(temperature=0.7, top_p=0.95, seed=5)


def ours(pipeline: Pipeline, chat: bool, **sampling) -> tuple[list[list[int]], list[int]]:
    """(our chain-rule remask ids, the stable prompt indices) at THRESHOLD."""
    config = DecodeConfig(mode="remask", threshold=THRESHOLD, max_new_tokens=MAX_NEW,
                          **sampling)
    assert config.remask_rule == "chain"  # the library's default, as the server's

    def decode() -> list[list[int]]:
        return pipeline.generate(PROMPTS, config, chat=chat).token_ids

    want = decode()
    stable = stable_rows(pipeline.model, decode, want)
    assert len(stable) >= len(PROMPTS) - 1, f"only prompts {stable} are stable"
    return want, stable


def test_mrp_serve_remask_is_the_library_chain_rule(tmp_path):
    import openai

    if not (embedded_head_dir() / "config.json").is_file():
        pytest.skip("this install has no embedded MRP head")
    pipeline = Pipeline.load()
    vetoed = pipeline.generate(PROMPTS, DecodeConfig(mode="remask", threshold=THRESHOLD,
                                                     max_new_tokens=MAX_NEW)).stats.vetoed
    assert vetoed > 0  # not vacuous: the chain rule sends reveals back on these prompts
    port, log_path = free_port(), tmp_path / "serve.log"
    process = start_server(port, log_path, "--algorithm", "MrpRemask",
                           "--threshold", str(THRESHOLD))
    try:
        banner = wait_for_banner(process, log_path)
        assert f"MrpRemask (threshold {THRESHOLD}, the chain rule; lossy)" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        stops = pipeline.model.config.stop_token_ids
        for chat, sampling in ((False, {}), (True, {}), (True, SAMPLED)):
            want, stable = ours(pipeline, chat, **sampling)
            for index in stable:
                extra = sampling or {"temperature": 0}
                ids = served(client, PROMPTS[index], chat, **extra)[1]
                got = trim_after_stop(ids, stops, MAX_NEW)
                assert got == want[index], (f"chat={chat} {sampling} prompt {index}: "
                                            f"served {got}\n ours {want[index]}")
    finally:
        interrupt(process, log_path)
