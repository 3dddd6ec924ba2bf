"""The forward door: what one dLLM forward touches of SGLang 0.5.23 (the other door,
`sglang_process.py`, holds the hooks, registries and version gate).

- `SGLangAlgorithm`: SGLang's dLLM algorithm contract (`DllmAlgorithm`: constructor,
  launch and request checks, `run` and its answer) around the MRP algorithms' own
  `setup`, `check_launch`, `refusal` and `decode`;
- the ForwardBatch's block ids, positions and prompt mask, and the model runner's forward;
- the request table (`req_to_token`) and the KV allocator: the head pool's slot ids, and
  the verify rows: several block states of one request in one forward, as extra rows.
  A candidate gets a temporary request-table row (a copy of the request's prefix slot ids
  plus L scratch KV slots); the request's own row carries its last candidate. Everything
  temporary is freed before `run()` returns: SGLang sizes the request table to its
  running-request cap, and a row held between calls can stall its scheduler;
- `MrpModel`, mixed into SGLang's model classes (`models/`): hidden states and SUBS on
  dLLM forwards, the MRP head attached after the weights load.
docs/serving.md lists every touch with the SGLang file it mirrors.

Deliberately not here: which states to verify and what to accept (`speculative.py`).

Shapes: B requests of the batch, N rows of the built batch, L block size, P prefix slots,
R requests of a head call, C columns, T tokens, H hidden, V vocab.
"""

from __future__ import annotations

import copy
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm

from mrp_dlm.decoding.sampling import SamplingConfig, map_rows
from mrp_dlm.serving.sampling import BATCH_ATTRIBUTE
from mrp_dlm.serving.sglang_process import (MODEL_BASES, all_reduce, check_version,
                                            gather_vocab, launch_args, max_over_ranks,
                                            served_algorithm, tensor_parallel_rank)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """What `decode` returns: SGLang's run answer without its encoding."""

    out: Any  # the model runner's output of the call's forward
    blocks: list[list[int]]  # (B, L) every request's next block ids
    done: list[bool]  # per request: the block is committed (its KV is clean)
    states: list[Any]  # per request: what it carries to the next call (dropped when done)


class SGLangAlgorithm(DllmAlgorithm):
    """SGLang's dLLM algorithm contract (sglang/srt/dllm/algorithm/base.py). SGLang's base
    sets `self.block_size` and `self.mask_id`; subclasses define `setup(algorithm_config,
    fdfo)`, `check_launch(LaunchArgs)`, `refusal(sampling_params)` and `decode`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        check_version()
        self.setup(dict(config.algorithm_config), config.first_done_first_out_mode)

    @classmethod
    def configure_server_args(cls, server_args: Any) -> None:
        cls.check_launch(launch_args(server_args))

    @classmethod
    def validate_request(cls, req: Any) -> Optional[str]:
        return cls.refusal(req.sampling_params)

    def run(self, model_runner, forward_batch, algo_states=None):
        states = algo_states or [None] * forward_batch.batch_size
        answer = self.decode(model_runner, forward_batch, states)
        return (answer.out.logits_output, answer.blocks,
                [self.block_size if d else 0 for d in answer.done],
                [None if d else s for s, d in zip(answer.states, answer.done)],
                answer.out.can_run_graph)


def block_ids(forward_batch: Any, block_size: int) -> torch.Tensor:
    """(B, L) the batch's block ids (a view: `write_block_ids` changes it)."""
    return forward_batch.input_ids.view(-1, block_size)


def write_block_ids(forward_batch: Any, blocks: torch.Tensor) -> None:
    """The batch's input ids := blocks (B, L), as SGLang's next call reads them."""
    forward_batch.input_ids.copy_(blocks.reshape(-1).to(forward_batch.input_ids.dtype))


def block_positions(forward_batch: Any, block_size: int) -> torch.Tensor:
    """(B, L) int64 positions of the batch's blocks."""
    return forward_batch.positions.view(-1, block_size).long()


def prompt_mask_of(forward_batch: Any, block_size: int, mask_token_id: int) -> torch.Tensor:
    """(B, L) bool: block positions that are prompt (never revealed)."""
    mask = forward_batch.dllm_prompt_mask
    if mask is not None:
        return mask.view(-1, block_size).clone()
    return block_ids(forward_batch, block_size) != mask_token_id


def forward_rows(model_runner: Any, forward_batch: Any, block_size: int
                 ) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One forward: (output, logits (N, L, V) float32, hidden (N, L, H))."""
    out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
    logits = out.logits_output.full_logits
    hidden = out.logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("the served model returned no hidden states; the MRP algorithms "
                           "need the mrp-dlm model class")
    N = logits.shape[0] // block_size
    return out, logits.float().view(N, block_size, -1), hidden.view(N, block_size, -1)


def served_model(model_runner: Any) -> Any:
    return model_runner.model


def kv_slot_count(model_runner: Any) -> int:
    """Slot ids the runner's KV allocator hands out are below this (size + page size)."""
    allocator = model_runner.token_to_kv_pool_allocator
    return allocator.size + getattr(allocator, "page_size", 1)


def prefix_lengths(forward_batch: Any, requests: list[int]) -> list[int]:
    """Tokens before the current block, per request of `requests` (batch indices)."""
    return [int(forward_batch.extend_prefix_lens_cpu[i]) for i in requests]


def request_rows(model_runner: Any, forward_batch: Any, requests: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's request table (rows, max context) of KV slot ids, and the requests' rows
    (R,) int64 in it."""
    table = model_runner.req_to_token_pool.req_to_token  # (rows, max context)
    index = torch.tensor(requests, dtype=torch.long, device=table.device)  # (R,)
    return table, forward_batch.req_pool_indices.to(table.device)[index].long()  # (R,)


def request_slots(model_runner: Any, forward_batch: Any, requests: list[int],
                  columns: torch.Tensor) -> torch.Tensor:
    """(R, C) int64 KV slot ids at columns (R, C) of the requests' request-table rows."""
    table, rows = request_rows(model_runner, forward_batch, requests)
    return table[rows[:, None], columns.to(table.device)].long()  # (R, C)


@dataclass
class Reservation:
    """Temporary rows and scratch slots of one request's extra candidates."""

    request: int  # index of the request in the batch
    rows: list[int]  # request-table rows, one per extra candidate
    slots: torch.Tensor  # (len(rows) * L,) scratch KV slots


@dataclass
class Scratch:
    """All reservations of one `run()`; `release` frees them (idempotent)."""

    runner: object  # SGLang ModelRunner (its pools)
    reservations: list[Reservation] = field(default_factory=list)

    def release(self) -> None:
        for item in self.reservations:
            self.runner.req_to_token_pool.free_rows(item.rows)
            self.runner.token_to_kv_pool_allocator.free(item.slots)
        self.reservations = []


def spare_rows(runner, block_size: int) -> int:
    """How many extra rows `reserve` could give now: free request-table rows, each with L
    free KV slots. Counted at draft time for the next call's verify: SGLang's scheduler
    keeps the request table as large as its running-request cap, so rows are free only
    while fewer requests run (a request admitted between the calls may take one)."""
    pool, allocator = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    if block_size % getattr(allocator, "page_size", 1):
        return 0
    return min(pool.available_size(), allocator.available_size() // block_size)


def reserve(scratch: Scratch, forward_batch, request: int, count: int, block_size: int
            ) -> Reservation | None:
    """`count` extra rows for `request` with the prefix copied in, or None when rows or
    slots run short (nothing is kept then)."""
    pool, allocator = scratch.runner.req_to_token_pool, scratch.runner.token_to_kv_pool_allocator
    if count * block_size % getattr(allocator, "page_size", 1):
        return None
    rows = pool.alloc_rows(count)
    if rows is None:
        return None
    slots = allocator.alloc(count * block_size)
    if slots is None:
        pool.free_rows(rows)
        return None
    prefix = int(forward_batch.extend_prefix_lens_cpu[request])
    own_row = int(forward_batch.req_pool_indices_cpu[request]) \
        if forward_batch.req_pool_indices_cpu is not None \
        else int(forward_batch.req_pool_indices[request])
    table = pool.req_to_token  # (rows, max context)
    index = torch.tensor(rows, dtype=torch.long, device=table.device)
    table[index, :prefix] = table[own_row, :prefix]
    table[index, prefix:prefix + block_size] = slots.view(count, block_size).to(table.dtype)
    item = Reservation(request=request, rows=rows, slots=slots)
    scratch.reservations.append(item)
    return item


@dataclass(frozen=True)
class RowLayout:
    """Which request each row of the built batch belongs to; a request's extra rows come
    first and its own row last."""

    owner: list[int]  # (N,) request index per row
    own: list[bool]  # (N,) True on the request's own row


def layout_of(batch_size: int, reservations: list[Reservation]) -> RowLayout:
    extra = {item.request: len(item.rows) for item in reservations}
    owner, own = [], []
    for request in range(batch_size):
        owner += [request] * (extra.get(request, 0) + 1)
        own += [False] * extra.get(request, 0) + [True]
    return RowLayout(owner=owner, own=own)


ROW_TENSORS = ("seq_lens", "orig_seq_lens", "extend_seq_lens", "extend_prefix_lens",
               "dllm_prompt_mask")  # per-request tensors: each row takes its request's
ROW_LISTS = ("extend_prefix_lens_cpu", "extend_seq_lens_cpu", "extend_logprob_start_lens_cpu",
             "lora_ids", "rids", "mm_inputs", "encoder_cached", "encoder_lens_cpu",
             "top_logprobs_nums", "token_ids_logprobs")  # per-request host lists, the same
ROW_FIELDS = ("batch_size", "input_ids", "positions", "req_pool_indices",
              "req_pool_indices_cpu", "out_cache_loc", "seq_lens_cpu", "seq_lens_sum",
              *ROW_TENSORS, *ROW_LISTS, "extend_num_tokens", "extend_start_loc",
              "global_num_token_non_padded_cpu", "global_num_token_non_padded",
              "forward_metadata_ready")  # every ForwardBatch field build_rows_batch writes


def build_rows_batch(runner, forward_batch, reservations: list[Reservation],
                     input_ids: torch.Tensor, block_size: int):
    """A copy of `forward_batch` with N rows: each reservation's rows before its request's
    own row. input_ids: (N, L) the state of every row."""
    layout = layout_of(forward_batch.batch_size, reservations)
    by_request = {item.request: item for item in reservations}
    device = forward_batch.input_ids.device
    owner = torch.tensor(layout.owner, dtype=torch.long, device=device)  # (N,)
    own_pool = forward_batch.req_pool_indices_cpu  # (B,) on the host, when SGLang keeps it
    own_pool = (forward_batch.req_pool_indices if own_pool is None else own_pool).tolist()
    pool_rows, slots = [], []
    written = forward_batch.out_cache_loc_virtual  # the allocator's ids, when translated
    written = forward_batch.out_cache_loc if written is None else written
    own_slots = written.view(forward_batch.batch_size, block_size)  # (B, L)
    for request in range(forward_batch.batch_size):
        item = by_request.get(request)
        if item is not None:
            pool_rows += item.rows
            slots.append(item.slots.to(own_slots.dtype))
        pool_rows.append(own_pool[request])
        slots.append(own_slots[request])
    rows = copy.copy(forward_batch)
    N = len(layout.owner)
    owner_cpu = layout.owner
    rows.batch_size = N
    rows.input_ids = input_ids.reshape(-1).to(forward_batch.input_ids.dtype)  # (N*L,)
    rows.positions = forward_batch.positions.view(-1, block_size)[owner].reshape(-1)  # (N*L,)
    rows.req_pool_indices = torch.tensor(pool_rows, dtype=forward_batch.req_pool_indices.dtype,
                                         device=device)  # (N,)
    rows.req_pool_indices_cpu = torch.tensor(pool_rows, dtype=torch.int64)
    rows.out_cache_loc = torch.cat(slots)  # (N*L,)
    for name in ROW_TENSORS:
        value = getattr(forward_batch, name)
        if value is not None:
            setattr(rows, name, value[owner.to(value.device)])
    if forward_batch.seq_lens_cpu is not None:
        rows.seq_lens_cpu = forward_batch.seq_lens_cpu[torch.tensor(owner_cpu)]
        lengths = forward_batch.seq_lens_cpu.tolist()  # SGLang's host copy: no device read
        rows.seq_lens_sum = sum(lengths[i] for i in owner_cpu)
    for name in ROW_LISTS:
        value = getattr(forward_batch, name)
        if value is not None:
            setattr(rows, name, [value[i] for i in owner_cpu])
    rows.extend_num_tokens = N * block_size
    rows.extend_start_loc = torch.arange(0, N * block_size, block_size, dtype=torch.int32,
                                         device=device)  # (N,)
    rows.global_num_token_non_padded_cpu = N * block_size
    if forward_batch.global_num_token_non_padded is not None:
        rows.global_num_token_non_padded = torch.tensor(
            N * block_size, dtype=forward_batch.global_num_token_non_padded.dtype, device=device)
    rows.forward_metadata_ready = False
    translator = runner.kv_index_translator
    translator.own_plan(rows).bind(rows, translator)
    return rows, layout


def sglang_model_class(architecture: str) -> type:
    """SGLang's own model class of an MRP architecture (`MODEL_BASES`)."""
    return getattr(importlib.import_module(MODEL_BASES[architecture]), architecture)


class MrpModel:
    """Mixed into SGLang's model class of an MRP architecture (first base, see `models/`).

    For dLLM forwards only: the output's `hidden_states` carries the final hidden states
    (after the final norm, h_A) for the head, and the mask token's logit is -inf (SUBS, as
    in our decoder: [MASK] is never committed). `load_weights` skips a release's head
    tensors (`mrp_modules.*`, which SGLang's loader would misname) and, when an MRP
    algorithm serves, attaches the head named by the YAML (`head_host.attach_head`); under
    tensor parallelism, this rank's share of it (`head_tp.py`), its logits gathered over
    the lm_head's vocabulary shards, and `agree` (timings' max over the ranks)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        from mrp_dlm.serving.config import read_yaml, resolve_block_facts

        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.block_facts = resolve_block_facts(read_yaml(served_algorithm()[1]), config)
        self.mask_token_id = self.block_facts.mask_token_id
        self.mrp_head = None  # MRPHead, set by load_weights when the YAML names one
        self.mrp_host = None  # HeadHost, set by load_weights for the MRP algorithms

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None,
                pp_proxy_tensors=None):
        hidden = self.model(input_ids=input_ids, positions=positions,
                            forward_batch=forward_batch, input_embeds=input_embeds,
                            pp_proxy_tensors=pp_proxy_tensors)  # (T, H) after the final norm
        output = self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)
        if forward_batch.forward_mode.is_dllm_extend():
            output.full_logits[:, self.mask_token_id] = float("-inf")  # (T, V)
            output.hidden_states = hidden
        return output

    def load_weights(self, weights: Iterable) -> None:
        from mrp_dlm.model.release import is_head_tensor
        from mrp_dlm.serving.head_host import attach_head
        from mrp_dlm.serving.head_tp import shard_head
        from mrp_dlm.serving.plugin import ALGORITHMS

        super().load_weights((name, tensor) for name, tensor in weights
                             if not is_head_tensor(name))
        algorithm, config_path = served_algorithm()
        if algorithm not in ALGORITHMS:
            return
        rank, world = tensor_parallel_rank()
        self.mrp_host, head = attach_head(config_path, self.config, self.model.embed_tokens,
                                          self.lm_head.weight, self.block_facts,
                                          gather_vocab if world > 1 else None)
        if head is not None:  # this rank's share of it, a submodule (the model's device)
            self.mrp_head = shard_head(head, rank, world, all_reduce)
            if world > 1:
                log.info("MRP head on TP rank %d of %d: its share of the attention heads "
                         "and the MLP width", rank, world)

    def agree(self, values: list[float]) -> list[float]:
        """Each of this rank's measurements (times) as their max over the TP ranks, so that
        what the MRP algorithms decide from them is the same on every rank."""
        return max_over_ranks(values)


def batch_sampling(forward_batch: Any, device: torch.device) -> SamplingConfig:
    """The rows' SamplingConfig on `device` (a clear error if the plugin hook is missing)."""
    sampling = getattr(forward_batch, BATCH_ATTRIBUTE, None)
    if sampling is None:
        raise RuntimeError("the mrp-dlm plugin's sampling hook did not run on this batch; "
                           "is the plugin loaded in the scheduler process (SGLANG_PLUGINS)?")
    return map_rows(sampling, lambda value: value.to(device))
