"""What both MRP algorithms share inside SGLang: their YAML, the launch- and request-time
errors for what they do not support, the model's head, and the per-request block state.

Errors, each with a message that says what to do:
- at launch: `--no-dllm-fdfo` (the algorithms are written for first-done-first-out
  scheduling), a bad YAML, a missing head directory, a head whose fingerprint does not
  match the model or the block size (raised while the model loads);
- per request: sampling (`sampling_refusal`, the one place that decides it).
  `MrpSpeculative` serves greedy and sampled requests (temperature, top_k, top_p, seed;
  see `sampling.py`) but not min_p. `MrpDirect` decodes greedily; SGLang turns temperature
  0 into top_k 1, so a request with top_k != 1 is refused there with HTTP 400 and a message
  that says how to fix it.

The head's keys of earlier blocks live in a pool of the plugin's own (`head_pool.py`),
allocated right after SGLang's KV pool (the plugin's hook; a runner without it, at the
first call): every call builds the head steps of its requests over it (`head_context`)
and writes the keys of the blocks it reports done (`store_blocks`).

Deliberately not here: the per-round logic (see `speculative.py`, `direct.py`).

Shapes: L block size, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mrp_dlm.decoding.step import BackboneStep, BlockRows, Step
from mrp_dlm.serving.attention_backend import MRP_BACKENDS
from mrp_dlm.serving.config import MrpServingConfig, ServingConfigError
from mrp_dlm.serving.head_pool import HeadContext, attach_pool, block_slots, request_context
from mrp_dlm.serving.sglang_forward import (Answer, SGLangAlgorithm, block_ids,
                                            block_positions, forward_rows, prompt_mask_of,
                                            served_model, write_block_ids)
from mrp_dlm.serving.plugin import MRP_ARCHITECTURES
from mrp_dlm.serving.sglang_process import LaunchArgs


class MrpAlgorithm(SGLangAlgorithm):
    """Base of MrpSpeculative, MrpDirect and MrpRemask (FDFO only; which requests each
    serves: `sampling_refusal`). Under tensor parallelism every rank runs the same
    algorithm on the same batch and logits, so every rank takes the same decisions.

    `self.mask_id` and `self.block_size` are SGLang's (its `DllmAlgorithm.__init__` sets
    them from its DllmConfig), so they keep SGLang's names; ours is `mask_token_id`."""

    supported_architectures = MRP_ARCHITECTURES
    supported_attention_backends = MRP_BACKENDS  # SGLang keeps these with CUDA graphs on
    needs_head = True  # MrpSpeculative self-drafts without one

    def setup(self, algorithm_config: dict, fdfo: bool) -> None:
        if not fdfo:
            raise ServingConfigError(no_fdfo_message(type(self).__name__))
        self.serving = MrpServingConfig.from_mapping(algorithm_config)
        if self.serving.head_directory() is None and self.needs_head:
            raise ServingConfigError(f"{type(self).__name__} needs `head: <directory>` in "
                                     "the dLLM algorithm config (the MRP head)")
        self.lookahead = self.serving.lookahead

    @classmethod
    def check_launch(cls, args: LaunchArgs) -> None:
        if not args.fdfo:
            raise ServingConfigError(no_fdfo_message(cls.__name__))
        if args.config_path is None:
            raise ServingConfigError(f"{cls.__name__} needs --dllm-algorithm-config mrp.yaml "
                                     "(`head: <directory>`; MrpSpeculative may leave it out)")

    @classmethod
    def refusal(cls, params: Any) -> Optional[str]:
        return sampling_refusal(cls.__name__, params)

    def model_parts(self, model_runner: Any):
        """(head, host) of the served model (head None when the YAML names none); a clear
        error if it is not ours."""
        model = served_model(model_runner)
        head, host = getattr(model, "mrp_head", None), getattr(model, "mrp_host", None)
        if host is None or (head is None and self.serving.head is not None):
            raise RuntimeError(f"{type(self).__name__} needs the mrp-dlm SDAR model class "
                               "with its head loaded; is the mrp-dlm plugin installed and "
                               "SGLANG_PLUGINS (if set) naming it?")
        return head, host

    def head_context(self, model_runner: Any, forward_batch: Any, requests: list[int],
                     prefix: bool = True) -> HeadContext:
        """The head on the current block of the batch's `requests`, over the head pool (its
        keys of earlier blocks; without `prefix`, none: see `request_context`)."""
        head, host = self.model_parts(model_runner)
        return request_context(attach_pool(model_runner), head, host, model_runner,
                               forward_batch, requests, prefix)

    def store_blocks(self, model_runner: Any, forward_batch: Any, requests: list[int],
                     tokens: torch.Tensor, clean_hidden: torch.Tensor) -> None:
        """The head's keys of the blocks this call reports done, in one head forward: the
        requests' clean blocks tokens (R, L) and clean_hidden (R, L, H), the hidden states
        of the forward that wrote their clean KV, to the blocks' KV slots. A one-layer
        head's keys depend on the block alone, so its store gathers no earlier keys."""
        if not requests or self.serving.head is None:  # no head: no head keys to keep
            return
        deep = self.model_parts(model_runner)[0].config.num_layers > 1
        context = self.head_context(model_runner, forward_batch, requests, prefix=deep)
        context.store(tokens, clean_hidden, block_slots(model_runner, forward_batch, requests,
                                                  self.block_size))


GREEDY_REASONS = {  # why an algorithm decodes greedily, for its refusal of sampling
    "MrpDirect": "commits the top pick of the backbone and of K head steps per forward",
}


def sampling_refusal(algorithm: str, params: Any) -> Optional[str]:
    """Why `algorithm` refuses a request's sampling params; None when it serves them.

    SGLang turns temperature 0 into top_k 1, so any other top_k samples. This is the one
    place that decides which requests the MRP algorithms serve."""
    if algorithm not in GREEDY_REASONS:  # MrpSpeculative: exact under sampling too
        min_p = getattr(params, "min_p", 0.0)
        if min_p:
            return (f"{algorithm} samples with temperature, top_k, top_p and seed; min_p is "
                    f"not supported (got min_p {min_p}): leave it at 0")
        return None
    if params.top_k == 1:
        return None
    return (f"{algorithm} decodes greedily (it {GREEDY_REASONS[algorithm]}): send temperature "
            f"0, or leave temperature out on a server started with --preferred-sampling-params "
            f"'{{\"temperature\": 0}}' (as `mrp serve` does); got temperature "
            f"{params.temperature}, top_k {params.top_k}")


def no_fdfo_message(name: str) -> str:
    return (f"{name} runs with first-done-first-out scheduling only (SGLang's default); "
            "remove --no-dllm-fdfo")


@dataclass(frozen=True)
class OneStep:
    """One forward of every request's block, as MrpDirect and MrpRemask run it: the step
    the library's decoder would take on it, and what the round returns to SGLang."""

    out: Any  # the model runner's output
    step: Step  # the block, its open positions and the backbone's logits and hidden states
    prompt: torch.Tensor  # (B, L) bool, prompt positions (never revealed)
    done: list[bool]  # per request: the forward saw its block without masks (its KV is clean)

    @classmethod
    def run(cls, model_runner: Any, forward_batch: Any, algo_states: Any, block_size: int,
            mask_token_id: int) -> "OneStep":
        L = block_size
        block = block_ids(forward_batch, L).clone()  # (B, L)
        fresh = prompt_mask_of(forward_batch, L, mask_token_id)  # (B, L)
        prompt = torch.stack([fresh[i] if s is None else s for i, s in enumerate(algo_states)])
        out, logits, hidden = forward_rows(model_runner, forward_batch, L)
        eligible = (block == mask_token_id) & ~prompt  # (B, L)
        positions = block_positions(forward_batch, L)  # (B, L)
        masks = eligible.sum(dim=1).tolist()  # the one read: each request's masks left
        step = Step(index=0, quota=1, rows=BlockRows(block, eligible, positions),
                    base=BackboneStep(hidden, logits), left=max(masks) or None)
        return cls(out, step, prompt, [m == 0 for m in masks])

    def finish(self, forward_batch: Any, block: torch.Tensor) -> Answer:
        """The round's answer to SGLang with the blocks (B, L) after this step (a done block
        is kept as it was); the next round's input ids are the new blocks."""
        done = torch.tensor(self.done, device=block.device)
        block = torch.where(done[:, None], self.step.rows.tokens, block)  # (B, L)
        write_block_ids(forward_batch, block)
        return Answer(self.out, block.tolist(), self.done, list(self.prompt))
