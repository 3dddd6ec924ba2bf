"""`--preferred-sampling-params` on SGLang's OpenAI endpoints (`request_defaults.py`), on
SGLang's own request classes: a field the request leaves out gets the preferred value, a
field it sets keeps its own; without preferred params, or on a server of another
algorithm, nothing changes (the hook targets are resolved in `test_door.py`). A request
that asks for logprobs is refused on a server of any dLLM algorithm, LowConfidence included,
through SGLang's own `_validate_request` (its message becomes an HTTP 400).
"""

from __future__ import annotations

import pytest

from sglang_env import require_sglang

require_sglang()

from sglang.srt.entrypoints.openai.protocol import (ChatCompletionRequest,  # noqa: E402
                                                    CompletionRequest)
from sglang.srt.entrypoints.openai.serving_completions import (  # noqa: E402
    OpenAIServingCompletion)

from mrp_dlm.serving import sglang_process  # noqa: E402
from mrp_dlm.serving.plugin import ALGORITHMS  # noqa: E402
from mrp_dlm.serving.sglang_process import (after_chat_params,  # noqa: E402
                                            after_completion_params, after_validate_request)

pytestmark = pytest.mark.sglang

GREEDY = {"temperature": 0, "max_new_tokens": 7}  # max_new_tokens is no request field


def chat_params(preferred: dict, generation_config: dict | None = None, **request) -> dict:
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 **request)
    params = chat.to_sampling_params(stop=[], model_generation_config=generation_config or {})
    return after_chat_params(params, chat)


def completion_params(**request) -> dict:
    completion = CompletionRequest(model="m", prompt="hi", **request)
    params = OpenAIServingCompletion._build_sampling_params(None, completion)
    return after_completion_params(params, None, completion)


@pytest.fixture
def preferred(monkeypatch):
    def use(params: dict, algorithm: str = "MrpSpeculative") -> None:
        monkeypatch.setattr(sglang_process, "preferred_params", lambda: dict(params))
        monkeypatch.setattr(sglang_process, "served_algorithm", lambda: (algorithm, None))
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


@pytest.mark.parametrize("algorithm", ["LowConfidence", None])
def test_a_server_of_another_algorithm_is_left_alone(preferred, algorithm):
    preferred(GREEDY, algorithm)  # None: no dLLM algorithm (a plain model)
    assert chat_params(GREEDY)["temperature"] == 1.0
    assert completion_params()["temperature"] == 1.0


def chat(**request) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 **request)


def completion(prompt: str = "hi", **request) -> CompletionRequest:
    return CompletionRequest(model="m", prompt=prompt, **request)


ASKING = [chat(logprobs=True), chat(logprobs=True, top_logprobs=2), chat(top_logprobs=2),
          completion(logprobs=0), completion(logprobs=3)]
NOT_ASKING = [chat(), chat(logprobs=False), completion()]


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "LowConfidence"])
def test_a_request_for_logprobs_is_refused(preferred, algorithm):
    preferred(GREEDY, algorithm)
    for request in ASKING:
        message = after_validate_request(None, None, request)
        assert message.startswith("logprobs are not supported by this server"), request
        assert algorithm in message and "\n" not in message
    # the completion endpoint's own check runs first, then the hook's
    empty = completion(prompt="")
    assert after_validate_request(OpenAIServingCompletion._validate_request(None, empty),
                                  None, empty) == "Prompt cannot be empty"
    assert [after_validate_request(None, None, request) for request in NOT_ASKING] \
        == [None] * len(NOT_ASKING)


def test_logprobs_are_left_to_a_plain_model(preferred):
    preferred(GREEDY, None)  # no dLLM algorithm: SGLang returns them itself
    assert [after_validate_request(None, None, request) for request in ASKING] \
        == [None] * len(ASKING)
