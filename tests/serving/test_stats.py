"""Serving stats without SGLang: which requests count."""

from __future__ import annotations

from types import SimpleNamespace

from mrp_dlm.serving.sglang_process import WARMUP_MAX_NEW_TOKENS, WARMUP_TEXT, is_server_probe


def request(rid: str, text: str = "Tom has 3 apples.", max_new: int = 64) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_text=text,
                           sampling_params=SimpleNamespace(max_new_tokens=max_new))


def test_warm_up_and_health_checks_are_not_client_requests():
    assert is_server_probe(request("HEALTH_CHECK_3f2a"))  # /health_generate
    assert is_server_probe(request("9c1d", WARMUP_TEXT, WARMUP_MAX_NEW_TOKENS))  # start-up
    assert not is_server_probe(request("9c1d"))
    assert not is_server_probe(request("9c1d", WARMUP_TEXT, 64))  # a client asking the same
    assert not is_server_probe(SimpleNamespace(rid="x"))  # a request without text (ids only)
