"""What the plugin does to OpenAI requests: preferred params, and the logprobs refusal.

SGLang 0.5.23 applies `--preferred-sampling-params` in its tokenizer manager, under a
request's own sampling params: a native `/generate` request that omits `temperature` gets
the preferred one. Its OpenAI endpoints fill every field before that merge (completions:
the request model's default temperature 1.0; chat: the model's generation_config under
`--sampling-defaults model`, else 1.0), so there the preferred params never apply. These
two hooks apply them after each endpoint built its params, to the fields the request did
not set, so the precedence is the same on every endpoint: the request, then the preferred
params, then SGLang's defaults. `mrp serve` passes `{"temperature": 0}`: a request without
`temperature` is greedy, which MrpDirect needs (it refuses sampling). The hooks act only
on a server of an MRP algorithm (`sglang_process.with_preferred`).

logprobs: SGLang's dLLM path answers a request for them with an empty list. Until the
server returns them, a request that asks for logprobs (chat `logprobs: true` or
`top_logprobs`, completions `logprobs: N`) on a server of any dLLM algorithm, `LowConfidence`
included, is refused with HTTP 400 (`logprobs_refusal`, through SGLang's `_validate_request`).

Deliberately not here: the refusal of sampled requests (see `base.py`); reading SGLang's
request models and server args (`sglang_process.py`).
"""

from __future__ import annotations

from typing import Any


def apply_preferred(params: dict, fields: Any, given: Any, preferred: dict) -> dict:
    """params with each preferred value the request left out: a preferred key counts when
    it is also a field of the request (`fields`: temperature, top_p, top_k, min_p, ...) and
    the request did not set it (`given`)."""
    for key, value in preferred.items():
        if key in params and key in fields and key not in given:
            params[key] = value
    return params


def logprobs_refusal(asked: bool, algorithm: str | None) -> str | None:
    """The HTTP 400 message for a request that asks for logprobs on a server of a dLLM
    algorithm (None: the request is served; a server of a plain model returns them)."""
    if not asked or algorithm is None:
        return None
    return (f"logprobs are not supported by this server yet (dLLM algorithm {algorithm}): "
            "send the request without logprobs and top_logprobs")
