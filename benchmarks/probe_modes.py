"""The modes part of `benchmarks/gpu_probe.py`: every decoding mode on the embedded model.

Not a test (never collected by pytest). For each dtype, `Pipeline.load()` (the embedded
model and head), one untimed warm-up decode, then every config of the grid on the same
prompts (the first test problems of `arith`, chat template, greedy, decoded together), and
again with each option the probe found (a DecodeConfig field such as `cuda_graphs`, set
True). A row holds the decode's tokens, backbone forwards and seconds; the host syncs it
made, counted on CUDA with `torch.cuda.set_sync_debug_mode("warn")` (each synchronizing
call warns once), and per backbone forward; and for a lossless config (speculative, its
options) how many prompts came out token-equal to its rule (dynamic at τ, static at 1.0,
decoded without options).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Iterator

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.eval.grid import grid_label, parse_grid, rule_of
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.registry import get_task
from probe_timing import SKIP_NO_CUDA

SYNC_WARNING = "synchroniz"  # in the message of every warning set_sync_debug_mode gives


@contextlib.contextmanager
def counting_syncs(device: str) -> Iterator[list]:
    """Yields a list that holds, on exit, the sync warnings raised inside (CUDA only)."""
    found: list = []
    if not device.startswith("cuda"):
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
            found += [w for w in caught if SYNC_WARNING in str(w.message)]


def decode_row(pipe: Pipeline, prompts: list[str], config: DecodeConfig, device: str,
               recorded: tuple[str, ...]) -> tuple[dict, list[list[int]]]:
    """One decode of every prompt together: its row (with the values of the `recorded`
    options) and its token ids."""
    with counting_syncs(device) as syncs:
        out = pipe.generate(prompts, config, chat=True)
    forwards = out.stats.backbone_forwards
    counted = device.startswith("cuda")
    options = {name: getattr(config, name) for name in recorded}
    row = dict(label=grid_label(config), options=options, prompts=len(prompts),
               tokens=out.stats.tokens, backbone_forwards=forwards,
               head_forwards=out.stats.head_forwards, seconds=round(out.stats.seconds, 4),
               syncs=len(syncs) if counted else SKIP_NO_CUDA,
               syncs_per_forward=round(len(syncs) / max(forwards, 1), 3) if counted
               else SKIP_NO_CUDA)
    return row, out.token_ids


def equal_count(got: list[list[int]], want: list[list[int]] | None) -> str | None:
    if want is None:
        return None
    return f"{sum(a == b for a, b in zip(got, want))}/{len(want)}"


INVARIANT = "invariant_verify"  # DecodeConfig field: verify copies as lone forwards (auto: on
# for speculative on CUDA); each speculative config runs again with it "off"


def dtype_rows(dtype: str, grid: str, setting, device: str, deadline, toggles: dict,
               recorded: tuple[str, ...]) -> tuple[list[dict], str | None]:
    """Rows of every config (and again with the `toggles` set) in one dtype; why it stopped
    early, if so."""
    pipe = Pipeline.load(None, dtype, device)
    examples = get_task("arith").examples("test", setting.prompts)
    prompts = [get_task("arith").prompt(example) for example in examples]
    base = DecodeConfig(max_new_tokens=setting.max_new_tokens)
    pipe.generate(prompts[:1], base, chat=True)  # warm-up: CUDA context, kernels, caches
    configs = parse_grid(grid, base)
    variants = [(c, {}) for c in configs] + [
        (dataclasses.replace(c, **toggles), toggles) for c in configs if toggles]
    outputs, rows = {}, []  # ids by (label, options)
    for config, opts in variants:
        label = grid_label(config)
        if deadline.passed():
            return rows, f"stopped before {dtype} {label} {opts or ''}"
        row, outputs[label, bool(opts)] = decode_row(pipe, prompts, config, device, recorded)
        rule = label if opts else grid_label(rule_of(config)) if rule_of(config) else None
        rule = None if (rule, False) == (label, bool(opts)) else rule
        rows.append(row | dict(dtype=dtype, toggled=opts, rule=rule, equal_to_rule=equal_count(
            outputs[label, bool(opts)], outputs.get((rule, False)))))
    for config in configs:  # speculation's batched verify against its rule (divergence)
        if config.mode != "speculative" or INVARIANT not in recorded:
            continue
        if deadline.passed():
            return rows, f"stopped before {dtype} {grid_label(config)} batched verify"
        batched = dataclasses.replace(config, **{INVARIANT: "off"})
        row, ids = decode_row(pipe, prompts, batched, device, recorded)
        rule = grid_label(rule_of(config))
        rows.append(row | dict(dtype=dtype, toggled={INVARIANT: "off"}, rule=rule,
                               equal_to_rule=equal_count(ids, outputs.get((rule, False)))))
    return rows, None


def mode_rows(grid: str, setting, device: str, deadline, toggles: dict,
              recorded: tuple[str, ...]) -> dict:
    """The section's results: rows for every dtype of `setting`."""
    began, rows = time.monotonic(), []
    for dtype in setting.dtypes:
        found, stopped = dtype_rows(dtype, grid, setting, device, deadline, toggles, recorded)
        rows += found
        if stopped:
            return dict(rows=rows, out_of_time=stopped)
    return dict(grid=grid, task="arith", max_new_tokens=setting.max_new_tokens,
                seconds=round(time.monotonic() - began, 2),
                note="equal_to_rule: prompts token-equal to the rule's decode (a config with "
                     "options: to itself without them)", rows=rows)
