"""A fake SGLang model runner and a fake FDFO scheduler around SGLang's own classes.

The runner holds our tiny `Backbone` and, instead of a KV cache, a table slot -> token id:
a forward writes each row's block tokens at the row's `out_cache_loc` slots, and a row
reads its prefix as the tokens at `req_to_token[row, :prefix]` (SGLang's real
`ReqToTokenPool`), then runs the backbone on prefix + block with the block-causal mask.
So a scratch row whose prefix copy or slots were wrong, or a block whose real slots last
held another state than the committed one, changes the output.

The scheduler drives `DllmAlgorithm.run` like SGLang's FDFO loop: every request forwards
its current block each round; accept length L commits the block (prompt tail excluded),
0 carries the returned block and state to the next round. As in SGLang 0.5.23 for SDAR
(no separate context encoding), a prompt's full blocks are forwarded one block per round
through the algorithm, each reported done at once, before the block the prompt's tail
shares with the first masks; so the algorithms write the head's keys of prompt blocks in
those calls, as they do in SGLang (`mrp_dlm/serving/head_pool.py`). After each round it reports the
round's requests to the algorithm's serving stats (`mrp_dlm.serving.stats`), as the
plugin's hook on SGLang's scheduler does.

Deliberately not here: assertions (see the test modules).

Shapes: B requests (rows), L block size, H hidden, V vocab, S sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.masks import block_causal_mask
from mrp_dlm.serving.sglang_process import after_forward_batch_init
from mrp_dlm.serving.stats import RequestForward, stats_of


class PlainPlan:
    """The KV location plan of a pool without translation: write ids are the slots."""

    def bind(self, batch, reader, cols=None) -> None:
        batch.kv_loc_plan, batch.kv_loc_cols = self, cols
        batch.out_cache_loc_virtual, batch.out_cache_loc_is_physical = None, True


class PlainTranslator:
    def own_plan(self, forward_batch) -> PlainPlan:
        return PlainPlan()


class FakeRunner:
    def __init__(self, model: Backbone, block_size: int, max_rows: int = 64,
                 slots: int = 4096, model_parts: Any = None) -> None:
        self.backbone, self.block_size = model, block_size
        self.req_to_token_pool = ReqToTokenPool(size=max_rows, max_context_len=512,
                                                device="cpu", enable_memory_saver=False)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            size=slots, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False)
        self.kv_index_translator = PlainTranslator()
        self.free_rows = self.req_to_token_pool.available_size()  # rows free at the start
        self.slot_tokens = torch.full((slots + 1,), -1, dtype=torch.long)  # (slots,)
        self.model = model_parts  # what the algorithms read: mrp_head, mrp_host
        self.forwards = 0  # forward calls
        self.rows = 0  # rows over all forwards

    def forward(self, forward_batch, pp_proxy_tensors=None):
        B, L = forward_batch.batch_size, self.block_size
        ids = forward_batch.input_ids.view(B, L).long()  # (B, L)
        hidden = torch.cat([self.row_hidden(forward_batch, i, ids[i]) for i in range(B)])
        self.slot_tokens[forward_batch.out_cache_loc.long()] = ids.reshape(-1)
        logits = self.backbone.logits(hidden).float()  # (B*L, V)
        logits[:, self.backbone.config.mask_token_id] = float("-inf")
        self.forwards += 1
        self.rows += B
        return SimpleNamespace(logits_output=LogitsProcessorOutput(
            next_token_logits=None, full_logits=logits, hidden_states=hidden), can_run_graph=False)

    @torch.no_grad()
    def row_hidden(self, forward_batch, index: int, block: torch.Tensor) -> torch.Tensor:
        """Hidden states (L, H) of one row: its prefix (via req_to_token) + its block."""
        L = self.block_size
        row = int(forward_batch.req_pool_indices[index])
        prefix = int(forward_batch.extend_prefix_lens[index])
        assert int(forward_batch.seq_lens[index]) == prefix + L
        table = self.req_to_token_pool.req_to_token[row]  # (max context,)
        written = forward_batch.out_cache_loc.view(-1, L)[index]
        assert torch.equal(table[prefix:prefix + L].long(), written.long()), "row slots mismatch"
        assert torch.equal(forward_batch.positions.view(-1, L)[index].long(),
                           torch.arange(prefix, prefix + L)), "positions mismatch"
        past = self.slot_tokens[table[:prefix].long()]  # (prefix,)
        assert bool((past >= 0).all()), "a prefix slot was never written"
        tokens = torch.cat([past, block])[None]  # (1, S)
        S = tokens.shape[1]
        mask = block_causal_mask(torch.arange(S) // L, torch.ones(1, S, dtype=torch.bool))
        return self.backbone(tokens, torch.arange(S)[None], mask)[0, prefix:]  # (L, H)


GREEDY_PARAMS = SimpleNamespace(temperature=1.0, top_k=1, top_p=1.0, sampling_seed=None)


@dataclass
class FakeRequest:
    prompt: list[int]
    max_new: int
    # SGLang's form (greedy: top_k 1)
    sampling_params: Any = field(default_factory=lambda: GREEDY_PARAMS)
    row: int = -1  # request-table row
    offset: int = 0  # first position of the current block
    block: list[int] | None = None  # the carried block (FDFO), None at a block start
    state: Any = None  # the algorithm's carried state
    output: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new


def start_block(runner: FakeRunner, request: FakeRequest, mask_token_id: int) -> None:
    L = runner.block_size
    fill = request.prompt + request.output + [mask_token_id] * L
    request.block = fill[request.offset:request.offset + L]
    slots = runner.token_to_kv_pool_allocator.alloc(L)
    runner.req_to_token_pool.req_to_token[request.row, request.offset:request.offset + L] = slots


def batch_of(runner: FakeRunner, requests: list[FakeRequest], algorithm: str) -> ForwardBatch:
    L, B = runner.block_size, len(requests)
    table = runner.req_to_token_pool.req_to_token
    rows = torch.tensor([r.row for r in requests])  # (B,)
    prefix = [r.offset for r in requests]
    seq = torch.tensor([p + L for p in prefix])  # (B,)
    out_loc = torch.cat([table[r.row, r.offset:r.offset + L] for r in requests]).long()
    batch = ForwardBatch(
        forward_mode=ForwardMode.DLLM_EXTEND, batch_size=B,
        input_ids=torch.tensor([t for r in requests for t in r.block]),  # (B*L,)
        req_pool_indices=rows, seq_lens=seq, out_cache_loc=out_loc, seq_lens_sum=int(seq.sum()),
        seq_lens_cpu=seq.clone(), req_pool_indices_cpu=rows.clone(), orig_seq_lens=seq.clone(),
        positions=torch.tensor([i for p in prefix for i in range(p, p + L)], dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_seq_lens=torch.full((B,), L, dtype=torch.int32),
        extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=[L] * B,
        extend_num_tokens=B * L)
    # What the plugin's hook after ForwardBatch.init_new attaches in SGLang.
    schedule = SimpleNamespace(reqs=requests, dllm_config=SimpleNamespace(algorithm=algorithm))
    return after_forward_batch_init(batch, ForwardBatch, schedule, runner)


def serve(runner: FakeRunner, algorithm, prompts: list[list[int]], max_new: int,
          mask_token_id: int, max_rounds: int = 2000, params: list[Any] | None = None,
          admit: Callable[[int], None] | None = None) -> list[list[int]]:
    """Decode all prompts together in FDFO rounds (sampling params per request, default
    greedy); the first max_new tokens of each. `admit(round)` runs before each round's
    call, where SGLang's scheduler admits other requests into free request-table rows."""
    L = runner.block_size
    params = params or [GREEDY_PARAMS] * len(prompts)
    requests = [FakeRequest(prompt, max_new, p) for prompt, p in zip(prompts, params)]
    rows = runner.req_to_token_pool.alloc_rows(len(requests))
    for request, row in zip(requests, rows):
        request.row = row
    for round_ in range(max_rounds):
        active = [r for r in requests if not r.finished]
        if not active:
            return [r.output[:max_new] for r in requests]
        for request in active:
            if request.block is None:
                start_block(runner, request, mask_token_id)
        if admit is not None:
            admit(round_)
        batch = batch_of(runner, active, type(algorithm).__name__)
        _, next_ids, accepted, states, _ = algorithm.run(runner, batch, [r.state for r in active])
        generating = [r.offset + L > len(r.prompt) for r in active]  # else prompt-only
        for request, ids, length, state in zip(active, next_ids, accepted, states):
            ids = list(ids)
            if length == L:
                first = max(len(request.prompt), request.offset) - request.offset
                request.output += ids[first:]
                request.offset += L
                request.block, request.state = None, None
            else:
                request.block, request.state = ids, state
        stats_of(algorithm).record([
            RequestForward(rid=str(requests.index(r)), generating=g, finished=r.finished,
                           returned=min(len(r.output), max_new) if r.finished else 0)
            for r, g in zip(active, generating)])
    raise AssertionError("the fake scheduler ran out of rounds")
