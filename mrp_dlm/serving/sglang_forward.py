"""Several block states of one request in ONE ordinary dLLM forward, as extra rows.

SGLang runs a dLLM forward with exactly L tokens per row, each row attending to its cached
prefix (through its request-table row) and to itself. A candidate state of a request gets
a temporary request-table row holding a copy of the request's prefix slot ids plus L
scratch KV slots; the request's own row carries its last candidate. Everything temporary
is freed before `run()` returns, so SGLang's scheduler never sees it. It could not be held
longer: SGLang sizes the request table to its running-request cap, and a dLLM request
admitted without a free row stalls every batch (prefill batches go first), so a row held
between calls can stop the server.

These are SGLang internals that changed twice in 2026 (`ReqToTokenPool.alloc_rows` /
`free_rows`, the KV location plan of a ForwardBatch): this module is the one place that
touches them, and it refuses any SGLang version it was not written against.

Deliberately not here: which states to verify and what to accept (see `speculative.py`).

Shapes: B requests of the batch, N rows of the built batch, L block size, P prefix slots.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

SUPPORTED_SGLANG = ("0.5.23",)


class UnsupportedSGLang(RuntimeError):
    pass


def check_sglang_version() -> None:
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version not in SUPPORTED_SGLANG:
        raise UnsupportedSGLang(f"the MRP plugin builds verify batches from SGLang "
                                f"{' / '.join(SUPPORTED_SGLANG)} internals; found SGLang "
                                f"{version}. Install mrp-dlm[sglang] (pins the version).")


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
    for name in ("seq_lens", "orig_seq_lens", "extend_seq_lens", "extend_prefix_lens",
                 "dllm_prompt_mask"):
        value = getattr(forward_batch, name)
        if value is not None:
            setattr(rows, name, value[owner.to(value.device)])
    if forward_batch.seq_lens_cpu is not None:
        rows.seq_lens_cpu = forward_batch.seq_lens_cpu[torch.tensor(owner_cpu)]
        rows.seq_lens_sum = int(rows.seq_lens_cpu.sum())
    for name in ("extend_prefix_lens_cpu", "extend_seq_lens_cpu", "extend_logprob_start_lens_cpu",
                 "lora_ids", "rids", "mm_inputs", "encoder_cached", "encoder_lens_cpu",
                 "top_logprobs_nums", "token_ids_logprobs"):
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
