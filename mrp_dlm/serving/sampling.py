"""Per-request sampling for `MrpSpeculative` inside SGLang: each request's temperature,
top-k, top-p and seed as the per-row `SamplingConfig` the library's draft and accept take.

SGLang hands a request's sampling parameters over as it normalised them: temperature 0
arrives as (temperature 1.0, top_k 1), and "all tokens" as top_k = 1 << 30. A row with
top_k 1 is greedy here. The seed is the request's `sampling_seed` (`seed` in the OpenAI
API, `sampling_params.sampling_seed` in `/generate`); a request without one gets a fresh
random seed the first time it is batched, kept on the request for its whole life, so every
round of every block draws from one seed. Seeds are used modulo 2**32, as the library's.

The rows' parameters are read on the host from the batch's requests by a hook after
`ForwardBatch.init_new` (`sglang_process.after_forward_batch_init`, on batches an MRP
algorithm serves), so no device value is read back to decide whether a batch is greedy.

Deliberately not here: the draws themselves (`decoding/sampling.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from mrp_dlm.decoding.sampling import GREEDY, SamplingConfig

BATCH_ATTRIBUTE = "mrp_sampling"  # the ForwardBatch's rows' SamplingConfig (host tensors)


def rows_sampling(params: list[Any], seeds: list[int]) -> SamplingConfig:
    """The requests' SamplingConfig from their SGLang sampling params and seeds: GREEDY when
    all are greedy, else (B,) CPU tensors."""
    greedy = [p.top_k == 1 for p in params]
    if all(greedy):
        return GREEDY
    return SamplingConfig(
        temperature=torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy, params)]),
        top_k=torch.tensor([0 if g or p.top_k >= 1 << 30 else p.top_k
                            for g, p in zip(greedy, params)]),
        top_p=torch.tensor([1.0 if g else p.top_p for g, p in zip(greedy, params)]),
        seed=torch.tensor([seed & 0xFFFFFFFF for seed in seeds]))


def attach_sampling(forward_batch: Any, params: list[Any], seeds: list[int]) -> Any:
    """forward_batch with its rows' SamplingConfig attached (read back by
    `sglang_forward.batch_sampling`)."""
    setattr(forward_batch, BATCH_ATTRIBUTE, rows_sampling(params, seeds))
    return forward_batch

