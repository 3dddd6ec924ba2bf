"""`--preferred-sampling-params` for the fields an OpenAI request leaves out.

SGLang 0.5.23 applies `--preferred-sampling-params` in its tokenizer manager, under a
request's own sampling params: a native `/generate` request that omits `temperature` gets
the preferred one. Its OpenAI endpoints fill every field before that merge (completions:
the request model's default temperature 1.0; chat: the model's generation_config under
`--sampling-defaults model`, else 1.0), so there the preferred params never apply. These
two hooks apply them after each endpoint built its params, to the fields the request did
not set, so the precedence is the same on every endpoint: the request, then the preferred
params, then SGLang's defaults. `mrp serve` passes `{"temperature": 0}`: a request without
`temperature` is greedy, which the MRP algorithms need (they refuse sampling).

Deliberately not here: the refusal of sampled requests (see `base.py`).
"""

from __future__ import annotations

import json
from typing import Any

CHAT_TARGET = "sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest.to_sampling_params"
COMPLETION_TARGET = ("sglang.srt.entrypoints.openai.serving_completions."
                     "OpenAIServingCompletion._build_sampling_params")


def apply_preferred(params: dict, request: Any, preferred: dict) -> dict:
    """params with each preferred value the request left out: a preferred key counts when
    it is also a field of the request (temperature, top_p, top_k, min_p, ...)."""
    fields, given = type(request).model_fields, request.model_fields_set
    for key, value in preferred.items():
        if key in params and key in fields and key not in given:
            params[key] = value
    return params


def preferred_params() -> dict:
    """The server's --preferred-sampling-params ({} when unset)."""
    from sglang.srt.runtime_context import get_serving

    raw = get_serving().preferred_sampling_params
    if isinstance(raw, str):
        raw = json.loads(raw)
    return dict(raw or {})


def chat_hook(result: dict, request: Any, *args, **kwargs) -> dict:
    """After `ChatCompletionRequest.to_sampling_params(self, ...)`."""
    return apply_preferred(result, request, preferred_params())


def completion_hook(result: dict, serving: Any, request: Any, *args, **kwargs) -> dict:
    """After `OpenAIServingCompletion._build_sampling_params(self, request)`."""
    return apply_preferred(result, request, preferred_params())


def register_request_defaults() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(CHAT_TARGET, chat_hook, HookType.AFTER)
    HookRegistry.register(COMPLETION_TARGET, completion_hook, HookType.AFTER)
