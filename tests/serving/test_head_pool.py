"""The serving head reads its pool in place: a head call's memory does not grow with the
requests' context length, and its output equals the library's head over whole prefixes.

Memory is measured as the peak of the bytes held by tensors the call creates and keeps
alive (every new tensor an operator returns, counted until Python frees it), under a
`TorchDispatchMode`: the gather of whole prefixes the plugin used to make (layers x
requests x prefix x kv heads x head dim, keys and values) shows as growth here.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sglang_env import require_sglang

require_sglang()

from conftest import random_backbone, random_head, tiny_config  # noqa: E402
from mrp_dlm.model.head import HeadAttention, KeyRecorder  # noqa: E402
from mrp_dlm.serving.head_pool import HeadContext, HeadPool, Prefix  # noqa: E402

pytestmark = pytest.mark.sglang

L, CHUNK = 4, 8  # block size; prefix slots read per attention step


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors operators create while the mode is on (views and in-place
    results excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and storage(tensor) not in inputs:
                self.count(tensor)  # a new tensor, not a view or an in-place result
        return out

    def count(self, tensor: torch.Tensor) -> None:
        size = tensor.untyped_storage().nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self.release, size)

    def release(self, size: int) -> None:
        self.live -= size


def two_layer_head():
    model = random_backbone(tiny_config(num_kv_heads=2), seed=3)
    return model, random_head(model, 9, layers=2)


def filled_pool(model, head, slots: int) -> HeadPool:
    pool = HeadPool(head.config.num_layers, slots, 2, model.config.head_dim, torch.float32,
                    "cpu")
    generator = torch.Generator().manual_seed(5)
    pool.keys.copy_(torch.randn(pool.keys.shape, generator=generator))
    pool.values.copy_(torch.randn(pool.values.shape, generator=generator))
    return pool


def peak_bytes_of_a_step(prefix: int, requests: int = 3) -> int:
    """Peak live bytes of one head step of `requests` requests with `prefix` earlier slots."""
    model, head = two_layer_head()
    pool = filled_pool(model, head, requests * prefix + 1)
    table = torch.arange(requests * prefix).view(requests, prefix)  # (R, P)
    positions = (prefix + torch.arange(L)).expand(requests, L)  # (R, L)
    context = HeadContext(pool, head, model, Prefix.whole(table), positions, chunk=CHUNK)
    tokens = torch.randint(0, 97, (requests, L), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(requests, L, model.config.hidden_size)
    meter = LiveBytes()
    with torch.no_grad(), meter:
        context.advance(tokens, hidden)
    return meter.peak


def test_a_head_step_holds_the_same_memory_at_any_context_length():
    short, long = peak_bytes_of_a_step(4 * CHUNK), peak_bytes_of_a_step(32 * CHUNK)
    model, head = two_layer_head()
    per_token = head.config.num_layers * 2 * 2 * model.config.head_dim * 4  # head KV bytes
    gathered = 3 * (32 - 4) * CHUNK * per_token  # what whole-prefix copies would add
    assert long - short <= 1024, (short, long)  # Python-side scalars at most
    assert gathered > 50 * 1024 and short < gathered  # the meter would see whole copies


def test_the_meter_sees_a_whole_prefix_gather():
    """The measurement is not blind: a gather of whole prefixes from the pool grows it."""
    model, head = two_layer_head()
    pools = [filled_pool(model, head, 3 * P + 1) for P in (4 * CHUNK, 32 * CHUNK)]
    peaks = []
    for pool, P in zip(pools, (4 * CHUNK, 32 * CHUNK)):
        meter = LiveBytes()
        with meter:
            gathered = pool.keys[:, torch.arange(3 * P).view(3, P)]  # (layers, R, P, nkv, hd)
            del gathered
        peaks.append(meter.peak)
    assert peaks[1] - peaks[0] >= 3 * 28 * CHUNK * 2 * 2 * model.config.head_dim * 4


def library_residual(model, head, tokens, hidden, lengths: list[int]) -> torch.Tensor:
    """h_C (R, L, H) of the library's head on the block after each request's prefix: the
    prefix's keys recorded by a pass over the whole prefix, padded, SDPA over all."""
    rows = []
    for r, P in enumerate(lengths):
        recorder = KeyRecorder(head.config.num_layers)
        earlier = torch.arange(P)[None]  # (1, P)
        blocks = torch.arange(P) // L  # (P,)
        mask = (blocks[None, :] <= blocks[:, None])[None]  # (1, P, P) block-causal
        head(model, tokens[r:r + 1, :P], hidden[r:r + 1, :P], earlier,
             HeadAttention(recorder, mask))
        own = torch.arange(P, P + L)[None]  # (1, L)
        see = torch.ones(1, L, P + L, dtype=torch.bool)  # (1, L, P + L)
        rows.append(head(model, tokens[r:r + 1, P:P + L], hidden[r:r + 1, P:P + L], own,
                         HeadAttention(recorder.prefix(), see)))
    return torch.cat(rows)


def test_chunked_reads_equal_the_library_head_over_whole_prefixes():
    """Ragged prefixes (one empty), chunks smaller than, equal to and larger than them."""
    model, head = two_layer_head()
    lengths = [3 * L, 0, 5 * L]
    R, S = len(lengths), max(lengths) + L
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 97, (R, S), generator=generator)
    hidden = torch.randn(R, S, model.config.hidden_size, generator=generator)
    with torch.no_grad():
        expected = library_residual(model, head, tokens, hidden, lengths)
        for chunk in (3, L, 64):
            got = serving_residual(model, head, tokens, hidden, lengths, chunk)
            diff = (got - expected).abs().max().item()
            assert diff < 1e-5, (chunk, diff)
    assert expected.abs().max().item() > 0.1


def serving_residual(model, head, tokens, hidden, lengths: list[int], chunk: int):
    """The same through the pool: each request's prefix blocks stored block by block (as
    the plugin stores done blocks), then the step on the block after them."""
    R, width = len(lengths), max(lengths)
    pool = HeadPool(head.config.num_layers, R * width + 1, 2, model.config.head_dim,
                    torch.float32, "cpu")
    table = torch.arange(R * width).view(R, width)  # (R, P) pool slot of each position
    rows = torch.arange(R)
    for start in range(0, width, L):
        live = [r for r, P in enumerate(lengths) if start < P]
        index = torch.tensor(live)
        done = Prefix(table, index, torch.full((len(live),), start), start)
        positions = (start + torch.arange(L)).expand(len(live), L)
        HeadContext(pool, head, model, done, positions, chunk).store(
            tokens[index, start:start + L], hidden[index, start:start + L],
            table[index, start:start + L])
    prefix = Prefix(table, rows, torch.tensor(lengths), width)
    positions = torch.tensor(lengths)[:, None] + torch.arange(L)  # (R, L)
    block = torch.stack([tokens[r, P:P + L] for r, P in enumerate(lengths)])
    block_hidden = torch.stack([hidden[r, P:P + L] for r, P in enumerate(lengths)])
    return HeadContext(pool, head, model, prefix, positions, chunk).residual(block,
                                                                             block_hidden)


def test_the_head_pool_is_allocated_with_the_kv_pool_and_counted_in_its_cell_size(
        tmp_path, monkeypatch):
    """Through SGLang's own hook registry, on its own `ModelRunner.alloc_memory_pool` (the
    KV pool only: SGLang's scheduler initialises attention backends and captures graphs
    after it returns): the head pool exists when it returns, a row per KV slot, and its
    bytes per slot are what the cell-size hook adds to SGLang's per-token KV size."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import mrp_dlm.serving.sglang_process as door
    from fake_engine import FakeRunner
    from mrp_dlm.serving.head_pool import POOL_ATTRIBUTE
    from test_algorithms import host_of_model, saved_head

    model, head = two_layer_head()
    yaml = tmp_path / "mrp.yaml"
    yaml.write_text(f"head: {saved_head(tmp_path, model, head)}\n")
    monkeypatch.setattr(door, "served_algorithm", lambda: ("MrpSpeculative", str(yaml)))
    monkeypatch.setattr(door, "tensor_parallel_size", lambda: 1)
    target = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"
    assert door.HOOKS[target] == (door.after_alloc_memory_pool, "AFTER")
    monkeypatch.setattr(HookRegistry, "_hooks", {target: []})
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(ModelRunner, "alloc_memory_pool", ModelRunner.alloc_memory_pool)
    HookRegistry.register(target, door.after_alloc_memory_pool, HookType.AFTER)
    HookRegistry.apply_hooks()

    fake = FakeRunner(model, L, slots=64, model_parts=SimpleNamespace(
        mrp_host=host_of_model(model), mrp_head=head))
    runner = stub_model_runner(ModelRunner, fake)
    assert getattr(fake.model, POOL_ATTRIBUTE, None) is None
    runner.alloc_memory_pool()
    pool = getattr(fake.model, POOL_ATTRIBUTE)
    assert pool.slots == 64 + 1  # every slot id the allocator hands out (size + page size)
    config = SimpleNamespace(get_num_kv_heads=lambda tp: 2, head_dim=model.config.head_dim,
                             dtype=torch.float32)
    cell = door.after_cell_size(1000, None, SimpleNamespace(is_draft_worker=False,
                                                            model_config=config))
    assert cell - 1000 == (pool.keys.nbytes + pool.values.nbytes) // pool.slots > 0
    runner.alloc_memory_pool()  # again (a re-allocation): the same pool
    assert getattr(fake.model, POOL_ATTRIBUTE) is pool


def stub_model_runner(model_runner_class, fake):
    """A ModelRunner (SGLang's class, not initialised) whose KV configurator hands back the
    fake runner's pools, so that its own `alloc_memory_pool` runs."""
    runner = object.__new__(model_runner_class)
    pools = SimpleNamespace(max_total_num_tokens=64, max_running_requests=8,
                            req_to_token_pool=fake.req_to_token_pool, token_to_kv_pool=None,
                            token_to_kv_pool_allocator=fake.token_to_kv_pool_allocator,
                            memory_pool_config=None, unified_memory_pool=None)
    configurator = SimpleNamespace(configure=lambda **kwargs: pools)
    runner.__dict__.update(
        model=fake.model, is_draft_worker=False, is_hybrid_swa=False,
        pre_model_load_memory=0, memory_pool_config=None,
        init_kv_cache_configurator=lambda layout: setattr(runner, "kv_cache_configurator",
                                                          configurator),
        _init_post_memory_pool_components=lambda: None)
    return runner
