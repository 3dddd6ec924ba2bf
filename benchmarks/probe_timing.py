"""How `benchmarks/gpu_probe.py` times one call: wall clock, CUDA events, a captured CUDA graph.

Not a test (never collected by pytest). A measurement is a number (milliseconds, the median
of `repeats` calls after `warmup` untimed ones) or a string that says why there is none
("skipped: no CUDA", "error: ..."), so one failed way never hides the others.
- wall: `time.perf_counter` around each call, the device synchronized before and after
  (host launch time and device time together);
- events: a CUDA event pair around each call, read after one synchronize at the end
  (the device's timeline: for a launch-bound call, about the host's launch time);
- graph: the call captured once with `torch.cuda.graph` (after warm-up calls on a side
  stream, as PyTorch requires) and replayed, each replay between an event pair. Its output
  is compared with an eager call's, bit for bit (`graph_equal_eager`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

SKIP_NO_CUDA = "skipped: no CUDA"


def why(error: BaseException) -> str:
    """A measurement's failure as one line: "error: <type>: <first line of the message>"."""
    lines = str(error).strip().splitlines()
    return f"error: {type(error).__name__}: {lines[0][:300] if lines else ''}"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable, device: str, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def event_ms(fn: Callable, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(repeats)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def captured(fn: Callable, warmup: int) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn captured in a CUDA graph, and the graph's static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_ms(fn: Callable, repeats: int, warmup: int) -> dict:
    """Replay time of fn's captured graph, and whether a replay's output equals an eager
    call's bit for bit."""
    graph, out = captured(fn, warmup)
    try:
        graph.replay()
        eager = fn()
        torch.cuda.synchronize()
        equal = bool(torch.equal(out, eager)) if torch.is_tensor(out) else "not a tensor"
        return dict(graph_ms=event_ms(graph.replay, repeats, warmup), graph_equal_eager=equal)
    finally:
        del graph


def time_three_ways(fn: Callable, device: str, repeats: int, warmup: int = 2) -> dict:
    """{"wall_ms", "event_ms", "graph_ms", "graph_equal_eager"}: numbers or why not."""
    out: dict = {}
    try:
        out["wall_ms"] = round(wall_ms(fn, device, repeats, warmup), 4)
    except Exception as error:  # noqa: BLE001 (recorded, never fatal)
        out["wall_ms"] = why(error)
    if not device.startswith("cuda"):
        return out | dict(event_ms=SKIP_NO_CUDA, graph_ms=SKIP_NO_CUDA,
                          graph_equal_eager=SKIP_NO_CUDA)
    try:
        out["event_ms"] = round(event_ms(fn, repeats, warmup), 4)
    except Exception as error:  # noqa: BLE001
        out["event_ms"] = why(error)
    try:
        timed = graph_ms(fn, repeats, warmup)
        out |= dict(graph_ms=round(timed["graph_ms"], 4),
                    graph_equal_eager=timed["graph_equal_eager"])
    except Exception as error:  # noqa: BLE001
        out |= dict(graph_ms=why(error), graph_equal_eager=why(error))
        try:
            torch.cuda.synchronize()  # a failed capture may leave work queued
        except Exception:  # noqa: BLE001 (the error above already says what broke)
            pass
    return out


def device_ms(fn: Callable, device: str, repeats: int, warmup: int = 2) -> float:
    """One number: CUDA events on a GPU, the wall clock elsewhere."""
    if device.startswith("cuda"):
        return event_ms(fn, repeats, warmup)
    return wall_ms(fn, device, repeats, warmup)
