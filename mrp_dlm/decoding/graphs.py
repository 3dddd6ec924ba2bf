"""The backbone's block steps as CUDA graphs: one graph per forward kind and bucket,
captured at first use over static buffers and replayed (`DecodeConfig.cuda_graphs`).

A bucket is (rows, cache slots): the driver runs a batch as the next power of two rows (the
extra rows are inactive copies of the first prompt) and rounds the slots up
(`driver.SLOT_BUCKET`). A forward kind is its token count T: denoise L, a verify of M
copies M*L, store + next 2L. A bucket's steps keep their KV cache from call to call, since
a graph replays the addresses it captured; a call reads only the slots it wrote (the masks
hide the rest), so another call's stale keys are never seen. Each forward copies its
inputs (ids, positions, mask, the 0-dim slot) into the graph's static buffers, replays it
and returns a copy of its hidden states.

Where a graph cannot be captured (no CUDA device; an MoE layer, which reads its routing on
the host) the same steps, buckets and kept caches run eager: only the capture call is
skipped (`capture_refusal` says why, logged once per bucket), so a CPU runs and tests
everything else.

Deliberately not here: what a step computes (`model/backbone.py`), its masks and slots
(`driver.BlockContext`), the head's steps (eager: their pending stores vary in length).

Shapes: B rows (a bucket), T tokens of a forward, S cache slots, H hidden.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.cache import KVCache

logger = logging.getLogger(__name__)

# Buckets kept per model, most recent first: each holds a KV cache of its rows and slots.
KEPT_BUCKETS = 2


def batch_bucket(rows: int) -> int:
    """Rows a batch of `rows` prompts runs as with graphs: the next power of two."""
    return 1 << (rows - 1).bit_length()


def capture_refusal(model: Backbone, device: torch.device) -> str | None:
    """Why block steps on `device` cannot be captured; None when they can."""
    if device.type != "cuda":
        return f"device {device} has no CUDA graphs"
    if model.config.num_experts:
        return "an MoE layer reads its expert routing on the host"
    return None


class Replayable(Protocol):
    def replay(self) -> None: ...  # `torch.cuda.CUDAGraph`: rerun what it captured


@dataclass
class _Graph:
    graph: Replayable
    inputs: tuple[torch.Tensor, ...]  # static ids (B, T), positions (B, T), mask (B, T, S), slot
    hidden: torch.Tensor  # (B, T, H) static output


class BlockSteps:
    """Backbone forwards over one bucket's KV cache: eager, or (`capture`) one CUDA graph
    per token count, captured at its first forward."""

    def __init__(self, cache: KVCache, capture: bool = False) -> None:
        self.cache, self.capture = cache, capture
        self.graphs: dict[int, _Graph] = {}  # by T
        self.pool = None  # the graphs' shared memory pool (replayed one at a time)
        self.replays = 0  # forwards replayed from a graph since `block_steps` handed it out

    def __call__(self, model: Backbone, ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, H) of ids, positions (B, T) int64 under mask (B, T, S),
        writing keys at slots [slot, slot + T); slot: 0-dim int64 on the device."""
        if not self.capture:
            return model(ids, positions, mask, self.cache, slot)
        inputs = (ids, positions, mask, slot)
        captured = self.graphs.get(ids.shape[1]) or self.capture_graph(model, inputs)
        for static, value in zip(captured.inputs, inputs):
            static.copy_(value)
        captured.graph.replay()
        self.replays += 1
        return captured.hidden.clone()  # the next replay overwrites the static output

    def capture_graph(self, model: Backbone, inputs: tuple[torch.Tensor, ...]) -> _Graph:
        """The graph of the forward over static copies of `inputs`, kept by token count."""
        static = tuple(x.clone() for x in inputs)
        ids, positions, mask, slot = static
        graph, hidden = self.record(lambda: model(ids, positions, mask, self.cache, slot))
        self.graphs[ids.shape[1]] = _Graph(graph, static, hidden)
        return self.graphs[ids.shape[1]]

    def record(self, run: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        """A CUDA graph of `run` and its static output. A warm-up runs first, on a side
        stream, so that lazy library set-up (cuBLAS workspaces) happens outside the capture;
        it writes the keys each replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = run()  # (B, T, H)
        return graph, hidden


# Per model, its kept buckets' steps; weak, so a model's graphs and caches go with it.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_steps(model: Backbone, batch: int, slots: int, graphs: bool) -> BlockSteps:
    """The block steps of one decode call over `batch` rows and `slots` cache slots.

    graphs (`DecodeConfig.cuda_graphs`): the bucket's steps kept from an earlier call of
    this model (its cache, its graphs), else new ones kept for the next; captured where
    `capture_refusal` allows. Else new eager steps over a new cache.
    """
    c, weight = model.config, model.lm_head.weight
    if not graphs:
        return BlockSteps(KVCache(c.num_layers, batch, c.num_kv_heads, slots, c.head_dim,
                                  weight.dtype, weight.device))
    kept = _KEPT.setdefault(model, OrderedDict())
    key = (batch, slots, weight.dtype, weight.device)
    if key not in kept:
        refusal = capture_refusal(model, weight.device)
        if refusal:
            logger.info("cuda_graphs: %s; block steps run eager", refusal)
        kept[key] = BlockSteps(KVCache(c.num_layers, batch, c.num_kv_heads, slots, c.head_dim,
                                       weight.dtype, weight.device), capture=refusal is None)
        while len(kept) > KEPT_BUCKETS:
            kept.popitem(last=False)
    kept.move_to_end(key)
    kept[key].replays = 0
    return kept[key]


def release(model: Backbone) -> None:
    """Drop the graphs and caches kept for `model` (their memory returns to the allocator)."""
    _KEPT.pop(model, None)
