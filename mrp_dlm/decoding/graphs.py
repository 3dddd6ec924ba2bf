"""CUDA graphs of a decode's steps (`DecodeConfig.cuda_graphs`): one graph per forward
kind and bucket, captured at first use over static buffers and replayed.

A bucket is (rows, cache slots): the driver runs a batch as the next power of two rows (the
extra rows are inactive copies of the first prompt) and rounds the slots up
(`slot_bucket`). A backbone forward's kind is its token count T: denoise L, a verify
of M copies M*L, store + next 2L; a head step's is T with at most one pending block
(`head_cache.py`). A bucket keeps its KV caches from call to call, since a graph replays
the addresses it captured; a call reads only the slots it wrote (the masks hide the rest),
so another call's stale keys are never seen. Each forward copies its inputs (ids,
positions, mask, the 0-dim slot...) into the graph's static buffers, replays it and returns
a copy of its output; logits and every decision stay eager.

Where no graph can be captured (no CUDA device; an MoE layer, which reads its routing on
the host) the same steps, buckets and kept caches run eager: only the capture is skipped
(`capture_refusal` says why, logged once per bucket), so a CPU runs and tests the rest.

Deliberately not here: what a step computes (`model/`), its masks and slots (`driver.py`,
`head_cache.py`). Shapes: B rows (a bucket), T tokens of a forward, S slots, H hidden.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.head import MRPHead

logger = logging.getLogger(__name__)

# Buckets kept per model, most recent first: each holds a KV cache of its rows and slots.
KEPT_BUCKETS = 2


# Cache slots are rounded up to a multiple of this, so that calls with prompts of other
# lengths mostly share one static shape (a compiled step recompiles per shape).
SLOT_BUCKET = 256


def batch_bucket(rows: int) -> int:
    """Rows a batch of `rows` prompts runs as with graphs: the next power of two."""
    return 1 << (rows - 1).bit_length()


def slot_bucket(slots: int, graphs: bool) -> int:
    """Cache slots for a call that needs `slots`: a multiple of SLOT_BUCKET, with graphs a
    power-of-two multiple (a bucket captures its own graphs, so there are few)."""
    multiple = -(-slots // SLOT_BUCKET)
    return SLOT_BUCKET * (batch_bucket(multiple) if graphs else multiple)


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
    inputs: tuple[torch.Tensor, ...]  # static inputs, in the forward's order
    output: torch.Tensor  # static output


class Graphs:
    """Forwards over static buffers: eager, or (`capture`) one CUDA graph per key, captured
    at the key's first forward and replayed at the others."""

    def __init__(self, capture: bool = False) -> None:
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None  # the graphs' shared memory pool (replayed one at a time)
        self.replays: Counter[str] = Counter()  # by the key's first entry (the caller
        # clears them per call)

    def run(self, key: tuple | None, forward: Callable[..., torch.Tensor],
            inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """forward(*inputs), replayed from the key's graph (key None: always eager). A key
        names everything the forward reads besides `inputs` (weights, caches) and their
        shapes; its first entry is the kind counted in `replays`."""
        if not self.capture or key is None:
            return forward(*inputs)
        captured = self.graphs.get(key) or self.capture_graph(key, forward, inputs)
        if captured is None:  # the capture failed: eager from now on
            return forward(*inputs)
        for static, value in zip(captured.inputs, inputs):
            static.copy_(value)
        captured.graph.replay()
        self.replays[key[0]] += 1
        return captured.output.clone()  # the next replay overwrites the static output

    def capture_graph(self, key: tuple, forward: Callable[..., torch.Tensor],
                      inputs: tuple[torch.Tensor, ...]) -> _Graph | None:
        """The key's graph over static copies of `inputs`; None, and eager from then on, if
        the capture fails (logged: a first GPU run should see why, not stop)."""
        static = tuple(x.clone() for x in inputs)
        try:
            graph, output = self.record(lambda: forward(*static))
        except RuntimeError as error:
            logger.warning("cuda_graphs: capturing %s failed (%s); the steps run eager",
                           key[0], str(error).splitlines()[0] if str(error) else type(error))
            self.capture = False
            return None
        self.graphs[key] = _Graph(graph, static, output)
        return self.graphs[key]

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
            output = run()
        return graph, output


def new_cache(model: Backbone, layers: int, batch: int, slots: int) -> KVCache:
    """A KV cache of `layers` layers shaped as the backbone's, in its dtype and device."""
    c, weight = model.config, model.lm_head.weight
    return KVCache(layers, batch, c.num_kv_heads, slots, c.head_dim, weight.dtype,
                   weight.device)


class Bucket:
    """One decode call's KV caches (the backbone's, each head's) and graphs; with graphs on,
    kept for the model's later calls of the same rows and slots."""

    def __init__(self, cache: KVCache, capture: bool = False) -> None:
        self.cache = cache  # the backbone's (layers, B, nkv, S, hd)
        self.head_caches: dict[MRPHead, KVCache] = {}
        self.graphs = Graphs(capture)

    def head_cache(self, model: Backbone, head: MRPHead) -> KVCache:
        """The head's keys over the same rows and slots as the backbone's."""
        if head not in self.head_caches:
            batch, slots = self.cache.keys.shape[1], self.cache.keys.shape[3]
            self.head_caches[head] = new_cache(model, head.config.num_layers, batch, slots)
        return self.head_caches[head]

    def backbone(self, model: Backbone, ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, H) of ids, positions (B, T) int64 under mask (B, T, S),
        writing keys at slots [slot, slot + T); slot: 0-dim int64 on the device. One graph
        per token count T (a forward kind: denoise L, verify M*L, store + next 2L)."""
        return self.graphs.run(
            ("backbone", ids.shape[1]),
            lambda ids, positions, mask, slot: model(ids, positions, mask, self.cache, slot),
            (ids, positions, mask, slot))


# Per model, its kept buckets; weak, so a model's graphs and caches go with it.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bucket(model: Backbone, batch: int, slots: int, graphs: bool) -> Bucket:
    """The caches and graphs of one decode call over `batch` rows and `slots` cache slots.

    graphs (`DecodeConfig.cuda_graphs`): the bucket kept from an earlier call of this model
    (its caches, its graphs), else a new one kept for the next; captured where
    `capture_refusal` allows. Else a new eager one.
    """
    layers = model.config.num_layers
    if not graphs:
        return Bucket(new_cache(model, layers, batch, slots))
    weight = model.lm_head.weight
    kept = _KEPT.setdefault(model, OrderedDict())
    key = (batch, slots, weight.dtype, weight.device)
    if key not in kept:
        refusal = capture_refusal(model, weight.device)
        if refusal:
            logger.info("cuda_graphs: %s; the steps run eager", refusal)
        kept[key] = Bucket(new_cache(model, layers, batch, slots), capture=refusal is None)
        while len(kept) > KEPT_BUCKETS:
            kept.popitem(last=False)
    kept.move_to_end(key)
    return kept[key]


def release(model: Backbone) -> None:
    """Drop the buckets kept for `model` (their memory returns to the allocator). Call it
    after replacing the model's parameter tensors: a graph replays the addresses it captured."""
    _KEPT.pop(model, None)
