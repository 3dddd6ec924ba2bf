"""`--preferred-sampling-params` on SGLang's OpenAI endpoints (`request_defaults.py`), on
SGLang's own request classes: a field the request leaves out gets the preferred value, a
field it sets keeps its own; without preferred params nothing changes; the hook targets
exist in this SGLang.
"""

from __future__ import annotations

import pkgutil

import pytest

from sglang_env import require_sglang

require_sglang()

from sglang.srt.entrypoints.openai.protocol import (ChatCompletionRequest,  # noqa: E402
                                                    CompletionRequest)
from sglang.srt.entrypoints.openai.serving_completions import (  # noqa: E402
    OpenAIServingCompletion)

from mrp_dlm.serving import request_defaults  # noqa: E402
from mrp_dlm.serving.request_defaults import (CHAT_TARGET, COMPLETION_TARGET,  # noqa: E402
                                              chat_hook, completion_hook)

pytestmark = pytest.mark.sglang

GREEDY = {"temperature": 0, "max_new_tokens": 7}  # max_new_tokens is no request field


def chat_params(preferred: dict, generation_config: dict | None = None, **request) -> dict:
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 **request)
    params = chat.to_sampling_params(stop=[], model_generation_config=generation_config or {})
    return chat_hook(params, chat)


def completion_params(**request) -> dict:
    completion = CompletionRequest(model="m", prompt="hi", **request)
    params = OpenAIServingCompletion._build_sampling_params(None, completion)
    return completion_hook(params, None, completion)


@pytest.fixture
def preferred(monkeypatch):
    def use(params: dict) -> None:
        monkeypatch.setattr(request_defaults, "preferred_params", lambda: dict(params))
    return use


def test_an_omitted_temperature_gets_the_preferred_one(preferred):
    preferred(GREEDY)
    assert chat_params(GREEDY)["temperature"] == 0
    assert completion_params()["temperature"] == 0
    # over the model's generation_config too (--sampling-defaults model)
    assert chat_params(GREEDY, {"temperature": 0.6})["temperature"] == 0
    assert completion_params()["max_new_tokens"] == 16  # the request's own default stays


@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_a_given_temperature_is_kept(preferred, temperature):
    preferred(GREEDY)
    assert chat_params(GREEDY, temperature=temperature)["temperature"] == temperature
    assert completion_params(temperature=temperature)["temperature"] == temperature


def test_without_preferred_params_nothing_changes(preferred):
    preferred({})
    assert chat_params({})["temperature"] == 1.0  # SGLang's OpenAI default
    assert completion_params()["temperature"] == 1.0
    preferred({"top_p": 0.5})
    assert chat_params({})["top_p"] == 0.5 and completion_params(top_p=0.9)["top_p"] == 0.9


def test_hook_targets_exist_in_this_sglang():
    for target in (CHAT_TARGET, COMPLETION_TARGET):
        owner, name = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(owner), name)), target
