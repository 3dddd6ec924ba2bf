"""The first thing to run on a GPU: what this machine's kernels do with our shapes, in one JSON.

Not a test (never collected by pytest). No downloads; under 5 minutes on one H200 (`--budget`
seconds, shared out among the sections). Sections, each in its own try/except with its own
time budget, the JSON rewritten after each (a timeout keeps what finished):
- environment: torch, CUDA, cuDNN, the device, and which GPU-ready options this checkout has
  (the lookups below: one place to rename them);
- sdpa: each SDPA kernel forced at SDAR-8B attention shapes on our mask layout, flex attention
  and the fused path beside them (`probe_attention.py`);
- forwards: random-weight bf16 backbones at SDAR-1.7B and 8B shapes, batch 1/8/32, a denoise
  forward and a 4-copy verify forward, each timed three ways (`probe_timing.py`);
- modes: every mode on the embedded model in bf16 and float32, the same prompts: speculative
  == its rule (prompts token-equal), host syncs per forward (`set_sync_debug_mode("warn")`).
SDAR shapes read ../shared/fixtures or a carried .fixtures (see benchmarks/device_check.sh);
without them the library's presets with the Qwen3 vocabulary, said in the JSON.
`--dry-run`: toy sizes on any device, CUDA-only calls recorded "skipped: no CUDA", and the
JSON checked against the schema (exit 1 if it fails).

    python benchmarks/gpu_probe.py --device cuda --out $OUT       # $OUT/gpu_probe.json
    python benchmarks/gpu_probe.py --dry-run --out /tmp/probe      # any machine, < 1 minute
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from mrp_dlm.config import BACKBONE_PRESETS, BackboneConfig, DecodeConfig  # noqa: E402
from mrp_dlm.eval.provenance import git_commit  # noqa: E402
from mrp_dlm.files import write_atomic  # noqa: E402
from probe_timing import SKIP_NO_CUDA  # noqa: E402

# ---------------------------------------------------------------------------------------
# Lookups: the names the GPU-ready branches give their options. Their APIs are not final;
# rename here (and only here) after merging. A name not found is recorded as "absent".
GRAPHS_FIELD = "cuda_graphs"  # DecodeConfig field: one captured CUDA graph per shape bucket
INVARIANT_FIELD = "invariant_verify"  # DecodeConfig field: verify copies as lone forwards
ATTENTION_MODULE = "mrp_dlm.model.attention"  # the fused attention path
ATTENTION_ENTRY = "attend"  # its function, called as attend(q, k, v, mask, path="fused"):
# q (B, nh, T, hd), k/v (B, nkv, S, hd), mask (B, T, S) bool -> (B, nh, T, hd)
# ---------------------------------------------------------------------------------------

SCHEMA_VERSION = 1
STATUSES = ("pending", "ok", "partial", "error", "skipped")
SHARES = {"environment": 0.02, "sdpa": 0.25, "forwards": 0.33, "modes": 0.40}  # of --budget
ROW_KEYS = {  # what every row of a section holds (the schema --dry-run checks)
    "sdpa": ("batch", "copies", "arrangement", "backend", "works", "ms", "max_abs_err"),
    "forwards": ("size", "layers_built", "layers_real", "batch", "kind", "copies", "wall_ms",
                 "event_ms", "graph_ms", "graph_equal_eager"),
    "modes": ("dtype", "label", "options", "prompts", "tokens", "backbone_forwards",
              "seconds", "syncs", "syncs_per_forward", "rule", "equal_to_rule")}
MODE_GRID = ("static,dynamic:0.9,sequential,entropy:0.5,direct:3,speculative:3@0.9,"
             "speculative:3@1,speculative-self:3@0.9,remask-chain:0.4,remask-paper:0.5")


def decode_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(DecodeConfig)}


def features() -> dict[str, str]:
    """Which of the lookups this checkout has: "present" or "absent"."""
    fields = decode_fields()
    has_module = importlib.util.find_spec(ATTENTION_MODULE) is not None
    return {f"DecodeConfig.{GRAPHS_FIELD}": "present" if GRAPHS_FIELD in fields else "absent",
            f"DecodeConfig.{INVARIANT_FIELD}":
                "present" if INVARIANT_FIELD in fields else "absent",
            f"{ATTENTION_MODULE}.{ATTENTION_ENTRY}":
                "present" if has_module and fused_attention() is not None else "absent"}


def fused_attention() -> Callable | None:
    """The fused path's function, or None when this checkout has none."""
    if importlib.util.find_spec(ATTENTION_MODULE) is None:
        return None
    attend = getattr(importlib.import_module(ATTENTION_MODULE), ATTENTION_ENTRY, None)
    return None if attend is None else functools.partial(attend, path="fused")


@dataclass(frozen=True)
class Setting:
    """The sizes one run uses: the real ones, or the dry run's toy ones."""

    sizes: tuple[str, ...]  # forwards: BACKBONE_PRESETS shapes timed
    batches: tuple[int, ...]  # forwards: B
    copies: tuple[int, ...]  # forwards and sdpa: M (1: denoise)
    attention_batches: tuple[int, ...]  # sdpa: B
    prefix: int  # cached tokens before the block
    repeats: int  # timed calls per measurement (median)
    prompts: int  # modes: embedded-task prompts decoded together
    max_new_tokens: int  # modes
    dtypes: tuple[str, ...]  # modes


FULL = Setting(sizes=("sdar-1.7b", "sdar-8b"), batches=(1, 8, 32), copies=(1, 4),
               attention_batches=(1, 8), prefix=512, repeats=20, prompts=8,
               max_new_tokens=128, dtypes=("bfloat16", "float32"))
DRY = Setting(sizes=("sdar-1.7b", "sdar-8b"), batches=(1, 2), copies=(1, 4),
              attention_batches=(2,), prefix=16, repeats=2, prompts=1, max_new_tokens=32,
              dtypes=("bfloat16", "float32"))
TOY = dict(vocab_size=99, mask_token_id=98, block_size=4, stop_token_ids=(97,),
           **BACKBONE_PRESETS["tiny"])  # what every SDAR shape becomes in a dry run


class Deadline:
    def __init__(self, seconds: float, end: float | None = None) -> None:
        """`seconds` from now, and never past `end` (time.monotonic())."""
        self.seconds = seconds
        self.end = min(time.monotonic() + seconds, end if end is not None else float("inf"))

    def passed(self) -> bool:
        return time.monotonic() >= self.end


def find_fixtures(given: Path | None) -> Path | None:
    """The folder holding sdar-8b-chat/config.json: --fixtures, a carried .fixtures, or
    ../shared/fixtures beside the checkout."""
    for folder in (given, REPO / ".fixtures", REPO.parent / "shared" / "fixtures"):
        if folder is not None and (folder / "sdar-8b-chat" / "config.json").is_file():
            return folder
    return None


def sdar_config(name: str, fixtures: Path | None, dry: bool) -> tuple[BackboneConfig, str]:
    """A size's config and where it came from."""
    if dry:
        return BackboneConfig(**TOY), "toy (dry run): BACKBONE_PRESETS['tiny']"
    from round_cost import SDAR_CONFIGS, size_config
    if fixtures is not None:
        return size_config(name, fixtures), f"{fixtures / SDAR_CONFIGS[name]} + preset shape"
    from train_step_cost import VOCAB
    return (BackboneConfig(vocab_size=VOCAB, **BACKBONE_PRESETS[name]),
            "no fixture config found: BACKBONE_PRESETS shape, Qwen3 vocabulary, SDAR defaults")


class Report:
    """The JSON, rewritten whole after every section."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.data = dict(schema_version=SCHEMA_VERSION, probe="gpu_probe", dry_run=args.dry_run,
                         device=args.device, budget_s=args.budget, commit=git_commit(),
                         started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         features=features(), notes=[],
                         sections={name: dict(status="pending") for name in SHARES})

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.data, indent=1, default=str)
        write_atomic(self.path, lambda tmp: tmp.write_text(text))

    def record(self, name: str, entry: dict) -> None:
        self.data["sections"][name] = entry
        self.write()


def run_section(report: Report, name: str, fn: Callable, budget: float, end: float) -> None:
    """fn(deadline) -> results (a dict with "rows" and whatever else), stopped at `budget`
    seconds or the probe's `end`; an exception is recorded as the section's error."""
    began, deadline = time.monotonic(), Deadline(budget, end)
    entry: dict = dict(status="ok", budget_s=round(budget, 1))
    try:
        entry["results"] = fn(deadline)
        if entry["results"].get("out_of_time"):
            entry["status"] = "partial"
    except Exception as error:  # noqa: BLE001 (one section's failure never loses the rest)
        from probe_timing import why
        entry |= dict(status="error", error=why(error))
    entry["seconds"] = round(time.monotonic() - began, 2)
    release()
    report.record(name, entry)
    print(f"gpu_probe: {name}: {entry['status']} in {entry['seconds']} s", file=sys.stderr,
          flush=True)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(args: argparse.Namespace) -> Callable:
    def section(deadline: Deadline) -> dict:
        import platform
        info = dict(torch=torch.__version__, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
                    else None, python=platform.python_version(),
                    cuda_available=torch.cuda.is_available(), threads=torch.get_num_threads())
        if not args.device.startswith("cuda"):
            return info | dict(gpu=SKIP_NO_CUDA)
        props, sdp = torch.cuda.get_device_properties(args.device), torch.backends.cuda
        return info | dict(gpu=props.name, capability=f"{props.major}.{props.minor}",
                           memory_gib=round(props.total_memory / 2**30, 1),
                           multiprocessors=props.multi_processor_count,
                           sdp_enabled=dict(flash=sdp.flash_sdp_enabled(),
                                            efficient=sdp.mem_efficient_sdp_enabled(),
                                            cudnn=sdp.cudnn_sdp_enabled(),
                                            math=sdp.math_sdp_enabled()))
    return section


def sdpa(args: argparse.Namespace, setting: Setting) -> Callable:
    def section(deadline: Deadline) -> dict:
        from probe_attention import case_rows, make_case, note_for
        config, source = sdar_config("sdar-8b", args.fixtures, args.dry_run)
        heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        rows, fused = [], fused_attention()
        for batch in setting.attention_batches:
            for copies in setting.copies:
                if deadline.passed():
                    return dict(rows=rows, out_of_time=f"stopped before B={batch} M={copies}")
                case = make_case(heads, batch, config.block_size, copies, setting.prefix,
                                 torch.bfloat16, args.device)
                flex = (batch, copies) == (setting.attention_batches[0], max(setting.copies))
                rows += [dict(batch=batch, copies=copies) | row
                         for row in case_rows(case, args.device, setting.repeats, fused, flex)]
        return dict(config_source=source, heads=dict(nh=heads[0], nkv=heads[1], hd=heads[2]),
                    block_size=config.block_size, prefix=setting.prefix,
                    note=note_for(args.device), rows=rows)
    return section


def built_backbone(config: BackboneConfig, device: str):
    """A random bf16 backbone of `config`, whole where it fits (twice its weights in free
    memory), else a quarter of its layers (the rows say how many)."""
    from round_cost import fits, random_backbone
    whole = not device.startswith("cuda") or fits(config, device)
    layers = config.num_layers if whole else max(1, config.num_layers // 4)
    return random_backbone(replace(config, num_layers=layers), device)


def forward_rows(model, name: str, layers: int, batch: int, setting: Setting,
                 device: str) -> list[dict]:
    """A denoise forward and verify forwards of M copies of a half-revealed block against a
    cache of `prefix` random tokens, each with its logits, timed three ways."""
    from probe_timing import time_three_ways
    from round_cost import Built, block_context, half_revealed
    config = model.config
    built = Built(name, model, {}, layers, config.block_size)
    context = block_context(built, batch, setting.prefix, device)
    block = half_revealed(config, batch, config.block_size, device)  # (B, L)
    start = context.slot()  # 0-dim, made before any capture (a host copy)
    rows = []
    for copies in setting.copies:
        states = block.repeat(1, copies)  # (B, M*L)
        positions = context.positions.repeat(1, copies)  # (B, M*L)
        mask = context.mask(copies)  # (B, M*L, S)
        call = lambda: model.logits(model(states, positions, mask, context.cache,  # noqa: E731
                                          start))  # (B, M*L, V)
        with torch.inference_mode():
            timed = time_three_ways(call, device, setting.repeats)
        rows.append(dict(size=name, layers_built=config.num_layers, layers_real=layers,
                         scale=round(layers / config.num_layers, 3), batch=batch,
                         kind="denoise" if copies == 1 else "verify", copies=copies,
                         block_size=config.block_size) | timed)
    return rows


def forwards(args: argparse.Namespace, setting: Setting) -> Callable:
    def section(deadline: Deadline) -> dict:
        rows, sources = [], {}
        for name in setting.sizes:
            config, sources[name] = sdar_config(name, args.fixtures, args.dry_run)
            model = built_backbone(config, args.device)
            for batch in setting.batches:
                if deadline.passed():
                    return dict(config_sources=sources, rows=rows,
                                out_of_time=f"stopped before {name} B={batch}")
                rows += forward_rows(model, name, config.num_layers, batch, setting,
                                     args.device)
            del model
            release()
        return dict(config_sources=sources, prefix=setting.prefix, dtype="bfloat16",
                    note="layers_built < layers_real: only that many layers fit; times are "
                         "of the built model, x scale estimates the whole (embedding and "
                         "lm_head counted scale times: an upper bound)", rows=rows)
    return section


def modes(args: argparse.Namespace, setting: Setting) -> Callable:
    def section(deadline: Deadline) -> dict:
        from probe_modes import mode_rows
        present = tuple(name for name in (GRAPHS_FIELD, INVARIANT_FIELD)
                        if name in decode_fields())
        toggles = {name: True for name in (GRAPHS_FIELD,) if name in present}
        return mode_rows(MODE_GRID, setting, args.device, deadline, toggles, present)
    return section


def main() -> int:
    args = parse_args()
    setting = DRY if args.dry_run else FULL
    torch.manual_seed(0)
    report = Report(args.out / "gpu_probe.json", args)
    if args.fixtures is None and not args.dry_run:
        report.data["notes"].append("no SDAR fixture configs: shapes from BACKBONE_PRESETS")
    report.write()
    sections = dict(environment=environment(args), sdpa=sdpa(args, setting),
                    forwards=forwards(args, setting), modes=modes(args, setting))
    end = time.monotonic() + args.budget  # a section that overran shortens the rest
    for name, section in sections.items():
        run_section(report, name, section, SHARES[name] * args.budget, end)
    problems = validate(report.data, strict=args.dry_run)
    report.data["schema_problems"] = problems
    report.write()
    print(f"gpu_probe: wrote {report.path}", file=sys.stderr)
    for problem in problems:
        print(f"gpu_probe: schema: {problem}", file=sys.stderr)
    return 1 if problems and args.dry_run else 0


def validate(data: dict, strict: bool = False) -> list[str]:
    """What in a report breaks the schema (empty: none). Each section is present with a
    known status; an ok or partial one has rows, each with its section's keys. `strict`
    (the dry run): every section also finished ("ok")."""
    problems = [f"missing top-level key {key!r}" for key in
                ("schema_version", "device", "features", "sections") if key not in data]
    for name in SHARES:
        entry = data.get("sections", {}).get(name)
        if not isinstance(entry, dict) or entry.get("status") not in STATUSES:
            problems.append(f"section {name}: missing or unknown status")
            continue
        if entry["status"] == "error" and not entry.get("error"):
            problems.append(f"section {name}: an error without its message")
        if strict and entry["status"] != "ok":
            problems.append(f"section {name}: {entry['status']} {entry.get('error', '')}")
        if entry["status"] not in ("ok", "partial") or name not in ROW_KEYS:
            continue
        rows = entry.get("results", {}).get("rows")
        if not rows:
            problems.append(f"section {name}: no rows")
            continue
        problems += [f"section {name} row {index}: missing {key!r}"
                     for index, row in enumerate(rows) for key in ROW_KEYS[name]
                     if key not in row]
    return problems


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for gpu_probe.json (default: $OUT, else runs/gpu_probe)")
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds for all sections together (each stops at its share)")
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="folder with sdar-8b-chat/config.json (default: .fixtures, then "
                             "../shared/fixtures)")
    parser.add_argument("--dry-run", action="store_true",
                        help="toy sizes, one prompt; check the JSON's schema")
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out = args.out or Path(os.environ.get("OUT") or REPO / "runs" / "gpu_probe")
    args.fixtures = find_fixtures(args.fixtures)
    return args


if __name__ == "__main__":
    sys.exit(main())
