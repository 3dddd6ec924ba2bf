"""Where the time of a speculative round goes, at real sizes: one denoise forward, one verify
forward of M block copies and one MRP head step, in bfloat16.

Not a test (never collected by pytest). For each size and batch it times the calls that
decoding makes, through the library's own code paths (`decoding/driver.py` BlockContext):
- denoise: `BlockContext.denoise`, the backbone on one block of L tokens against a cached
  prefix of `--prefix` tokens, with its logits;
- verify M: `BlockContext.verify` on M = 2..6 and 8 copies of the block side by side, each
  seeing the cached prefix and itself only (`model/masks.py` copies_mask), with their
  logits (M = 8: a candidate set as large as FreeDave's eight draft branches);
- head step: `MRPHead` over its keys of the prefix + `backbone.logits`, what each head draft
  costs (heads of 1 and 3 layers on the SDAR shapes; the shipped 3-layer head on the
  embedded model).
Sizes: `embedded` (mrp_dlm/assets/embedded and its head, block 16) and randomly initialised
backbones of the `BACKBONE_PRESETS` shapes sdar-1.7b, sdar-4b, sdar-8b and sdar-30b-a3b (the
MoE: 48 sparse layers, 8 of 128 experts per token, random routing; block 4, SDAR's
default). Their vocabulary, special ids, RoPE and norm settings come from the published
configs in ../shared/fixtures (`--fixtures`); no 1.7B or 30B-A3B config is published there,
so those shapes take the 4B one's (the same Qwen3 tokenizer). The 30B-A3B head is dense
(layers of `intermediate_size` 6144, docs/design.md), so its head step is timed next to a
verify copy of the sparse backbone.

Whole or per-layer-scaled. A CPU cannot run the SDAR shapes whole in reasonable time, so
there the backbone is built with ONE decoder layer at full width and each forward is timed
twice: that one-layer backbone (embedding, RoPE tables, one layer, final norm, lm_head) and
its layer alone; the reported time is one-layer backbone + (layers - 1) x layer, and every
output marks it `per-layer-scaled`. On CUDA the whole model is built when it fits in free
memory. `--per-layer` scales every size, the embedded model too (to check the scaling
against a whole model). Head steps are always timed whole.

The KV cache holds random keys and values instead of a prefill's (a forward's cost does
not depend on them, and a 512-token prefill at batch 32 would dominate a CPU run). Every
forward attends over all cache slots: prefix + 8 blocks, rounded up to 256 as
`driver.generate` allocates. Timing: `--warmup` untimed rounds, then the median of
`--repeats` rounds in which every call is timed in turn, synced around each call
(`paired_medians` of benchmarks/head.py, so load changes on a shared machine hit all alike).

Costs are reported in denoise forwards (verify M = x denoise forwards, head step = y) and in
milliseconds. From them and a given acceptance (`--accepted`, default: what the embedded
model and head accept) it PROJECTS the speedup of speculative decoding over the rule it
reproduces: a round of a fixed lookahead K (`--no-adaptive`) costs verify(K+1) + K head
steps and advances 1 + accepted steps of the rule; the rule costs one denoise forward per
step. Self-drafts (the rule's steps on the seed logits, no head: `--accepted-self`) are
projected the same way with no head steps (head layers 0): a round costs verify(K+1).
A projection, not a measured speed: it leaves out the rounds cut short at a block's
end, the pick and accept arithmetic, host syncs and prefill, and assumes the embedded
model's acceptance at every size.

Prints both tables, then one JSON line last (config, commit, hardware, results); `--out DIR`
also writes DIR/round_cost.json and DIR/round_cost.md.

    OMP_NUM_THREADS=1 python benchmarks/round_cost.py --sizes embedded,sdar-1.7b --batches 1,8
    python benchmarks/round_cost.py --device cuda --out $OUT/round_cost   # every size, batch

Deliberately not here: measuring acceptance (`mrp bench`), decoding whole prompts
(`benchmarks/modes.py`), torch.compile (`benchmarks/compile.py`).

Shapes: B batch, L block size, M block copies, S cache slots, H hidden, K lookahead.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from head import paired_medians  # noqa: E402  (benchmarks/head.py)
from mrp_dlm.config import (BACKBONE_PRESETS, BackboneConfig, BlockSchedule,  # noqa: E402
                            DecodeConfig, HeadConfig)
from mrp_dlm.decoding.driver import SLOT_BUCKET, BlockContext, Counters  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware, peak_memory  # noqa: E402
from mrp_dlm.model.backbone import Backbone, rotary_tables  # noqa: E402
from mrp_dlm.model.cache import KVCache  # noqa: E402
from mrp_dlm.model.head import HeadAttention, MRPHead  # noqa: E402
from mrp_dlm.model.loading import load_backbone, load_head, read_config  # noqa: E402
from mrp_dlm.pipeline import embedded_head_dir, embedded_model_dir  # noqa: E402

DTYPE = torch.bfloat16
COPIES = (2, 3, 4, 5, 6, 8)  # M of the timed verify forwards (8: a FreeDave-sized candidate set)
SDAR_CONFIGS = {"sdar-1.7b": "sdar-4b-chat", "sdar-4b": "sdar-4b-chat",
                "sdar-8b": "sdar-8b-chat",
                "sdar-30b-a3b": "sdar-4b-chat"}  # shape -> published config (fixtures folder)
SIZES = ("embedded", *SDAR_CONFIGS)
SDAR_HEAD_LAYERS = (1, 3)  # head depths timed on the SDAR shapes
EMBEDDED_HEAD_LAYERS = 1  # the shipped head (mrp_dlm/assets/embedded-head)
INIT_STD = 0.02  # random weights' std (costs do not depend on it)
PROJECTION = "PROJECTION from the cost model and the given acceptance; not a measured speed"


@dataclass(frozen=True)
class Built:
    """One size, ready to time."""

    name: str  # a SIZES entry
    model: Backbone  # the whole backbone, or one decoder layer of it at full width
    heads: dict[int, MRPHead]  # MRP heads by layer count
    layers: int  # decoder layers of the real model (a per-layer time is scaled by these)
    block_size: int  # L timed

    @property
    def whole(self) -> bool:
        return self.model.config.num_layers == self.layers


@dataclass(frozen=True)
class Costs:
    """Median milliseconds of one size at one batch."""

    size: str  # a SIZES entry
    batch: int  # B
    block_size: int  # L
    layers: int  # decoder layers of the backbone
    scaling: str  # "whole" (timed as is) or "per-layer-scaled"
    forward_ms: dict[int, float]  # a forward over M copies with its logits; M = 1: denoise
    head_ms: dict[int, float]  # one head step by head layers
    one_layer_ms: dict[int, float]  # per-layer-scaled only: the one-layer backbone, by M
    layer_ms: dict[int, float]  # per-layer-scaled only: its decoder layer alone, by M

    def verify_x(self, copies: int) -> float:
        return self.forward_ms[copies] / self.forward_ms[1]

    def head_x(self, head_layers: int) -> float:
        return self.head_ms[head_layers] / self.forward_ms[1]

    def to_json(self) -> dict:
        out = dict(size=self.size, batch=self.batch, block_size=self.block_size,
                   layers=self.layers, scaling=self.scaling,
                   denoise_ms=round(self.forward_ms[1], 4),
                   verify_ms={M: round(self.forward_ms[M], 4) for M in COPIES},
                   verify_x={M: round(self.verify_x(M), 4) for M in COPIES},
                   head_step_ms={n: round(ms, 4) for n, ms in self.head_ms.items()},
                   head_step_x={n: round(self.head_x(n), 4) for n in self.head_ms})
        if self.layer_ms:  # the parts a per-layer-scaled forward is made of, by M
            out["per_layer_parts_ms"] = {M: dict(
                layer=round(self.layer_ms[M], 4),
                outside_layers=round(self.one_layer_ms[M] - self.layer_ms[M], 4))
                for M in self.layer_ms}
        return out


@dataclass(frozen=True)
class Projection:
    """Projected speed of speculative decoding over the rule it reproduces (not measured)."""

    size: str  # a SIZES entry
    batch: int  # B
    head_layers: int  # depth of the drafting head; 0: self-drafts (no head)
    threshold: float  # τ of the rule (1.0: static)
    accepted: float  # drafts after the first accepted per round (given, not measured here)
    round_cost: float  # denoise forwards per round: verify(K+1) + K head steps

    @property
    def speedup(self) -> float:
        """Rule steps per round over their cost in denoise forwards."""
        return (1 + self.accepted) / self.round_cost

    @property
    def break_even(self) -> float:
        """Accepted head drafts per round at which the projection reaches 1.0x."""
        return self.round_cost - 1

    def to_json(self) -> dict:
        return dict(size=self.size, batch=self.batch, head_layers=self.head_layers,
                    threshold=self.threshold, accepted=self.accepted,
                    round_cost_denoise_forwards=round(self.round_cost, 4),
                    projected_speedup=round(self.speedup, 4),
                    break_even_accepted=round(self.break_even, 4))


def size_config(name: str, fixtures: Path) -> BackboneConfig:
    """A size's full config: the embedded model's own, or a preset shape over a published
    config's vocabulary, special ids, RoPE and norm settings."""
    if name == "embedded":
        return read_config(embedded_model_dir())
    return replace(read_config(fixtures / SDAR_CONFIGS[name]), **BACKBONE_PRESETS[name])


def fits(config: BackboneConfig, device: str) -> bool:
    """Twice the bf16 weights fit in the device's free memory (heads, cache, activations)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in Backbone(config).parameters())
    free, _ = torch.cuda.mem_get_info(device)
    return 2 * 2 * params < free


def runs_whole(name: str, config: BackboneConfig, args: argparse.Namespace) -> bool:
    """The embedded model, and on CUDA any model that fits, run whole; the rest is scaled."""
    if args.per_layer:
        return False
    return name == "embedded" or (args.device.startswith("cuda") and fits(config, args.device))


def random_backbone(config: BackboneConfig, device: str) -> Backbone:
    """A bf16 backbone of random weights, allocated once on `device` (never in float32)."""
    with torch.device("meta"):
        model = Backbone(config).to(DTYPE)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, INIT_STD) if param.dim() >= 2 else param.fill_(1.0)
    return model.eval()


def random_head(config: BackboneConfig, layers: int, device: str) -> MRPHead:
    with torch.device("meta"):
        head = MRPHead(config, HeadConfig(num_layers=layers)).to(DTYPE)
    head.to_empty(device=device)
    head.reset_parameters()
    return head.eval()


def build(name: str, args: argparse.Namespace) -> Built:
    """The embedded model whole with its shipped head; otherwise random weights, whole or
    one layer (see `runs_whole`), with random heads of the timed depths."""
    config = size_config(name, args.fixtures)
    block_size = args.block_size or config.block_size
    whole = runs_whole(name, config, args)
    if name == "embedded" and whole:
        model = load_backbone(embedded_model_dir(), DTYPE, args.device)
        head = load_head(embedded_head_dir(), model)
        return Built(name, model, {head.config.num_layers: head}, config.num_layers, block_size)
    model = random_backbone(config if whole else replace(config, num_layers=1), args.device)
    depths = (EMBEDDED_HEAD_LAYERS,) if name == "embedded" else SDAR_HEAD_LAYERS
    heads = {n: random_head(model.config, n, args.device) for n in depths}
    return Built(name, model, heads, config.num_layers, block_size)


def block_context(built: Built, batch: int, prefix: int, device: str) -> BlockContext:
    """The context of a block at slot `prefix` over a cache of random keys and values."""
    c, L = built.model.config, built.block_size
    slots = -(-(prefix + max(COPIES) * L) // SLOT_BUCKET) * SLOT_BUCKET
    cache = KVCache(c.num_layers, batch, c.num_kv_heads, slots, c.head_dim, DTYPE, device)
    cache.keys.normal_()
    cache.values.normal_()
    schedule = BlockSchedule(block_size=L, steps=L, stop_token_ids=c.stop_token_ids,
                             mask_token_id=c.mask_token_id)
    positions = torch.arange(prefix, prefix + L, device=device).repeat(batch, 1)  # (B, L)
    key_valid = torch.ones(batch, slots, dtype=torch.bool, device=device)  # (B, S)
    active = torch.ones(batch, dtype=torch.bool, device=device)  # (B,)
    return BlockContext(built.model, cache, schedule, prefix, positions, key_valid, active,
                        Counters.start(device))


def head_keys(context: BlockContext, layers: int) -> HeadAttention:
    """A head step's attention over random head keys of the prefix (as the backbone's)."""
    c, cache = context.model.config, context.cache
    keys = KVCache(layers, cache.keys.shape[1], c.num_kv_heads, context.width, c.head_dim,
                   DTYPE, cache.keys.device)
    keys.keys.normal_()
    keys.values.normal_()
    return HeadAttention(keys, context.mask(1), context.slot())


def half_revealed(config: BackboneConfig, batch: int, block_size: int, device: str) -> torch.Tensor:
    """(B, L) a block mid-decode: random tokens at even positions, masks at odd ones."""
    generator = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, config.vocab_size, (batch, block_size), generator=generator)  # (B, L)
    tokens[:, 1::2] = config.mask_token_id
    return tokens.to(device)


def forward_call(context: BlockContext, block: torch.Tensor, copies: int) -> Callable:
    """A denoise forward (copies 1) or a verify forward of `copies` block copies."""
    if copies == 1:
        return lambda: context.denoise(block)
    states = block.repeat(1, copies)  # (B, M*L)
    return lambda: context.verify(states)


def layer_call(context: BlockContext, copies: int) -> Callable:
    """The first decoder layer of a forward over `copies` copies, as `Backbone.forward` calls
    it (the RoPE tables are made once per forward, outside the layers)."""
    model, B = context.model, context.positions.shape[0]
    c = model.config
    positions = context.positions.repeat(1, copies)  # (B, M*L)
    rope = rotary_tables(positions, c.head_dim, c.rope_theta, DTYPE)  # 2 x (B, 1, M*L, hd)
    x = torch.randn(B, positions.shape[1], c.hidden_size, dtype=DTYPE,
                    device=positions.device)  # (B, M*L, H)
    layer, cache, mask, slot = (model.model.layers[0], context.cache.layer(0),
                                context.mask(copies), context.slot())
    return lambda: layer(x, rope, mask, cache, slot)


def timed_calls(built: Built, context: BlockContext, block: torch.Tensor) -> dict[tuple, Callable]:
    """The calls to time, by (kind, count): ("forward", M), ("head", layers), and for a
    per-layer-scaled size ("layer", M)."""
    model, positions = built.model, context.positions
    accumulator = context.denoise(block).hidden  # (B, L, H) h_A, what the first head step gets
    calls = {("forward", M): forward_call(context, block, M) for M in (1, *COPIES)}
    for layers, head in built.heads.items():
        keys = head_keys(context, layers)
        calls[("head", layers)] = lambda head=head, keys=keys: model.logits(
            accumulator + head(model, block, accumulator, positions, keys))  # (B, L, V)
    if not built.whole:
        calls |= {("layer", M): layer_call(context, M) for M in (1, *COPIES)}
    return calls


@torch.inference_mode()
def time_batch(built: Built, batch: int, args: argparse.Namespace) -> Costs:
    context = block_context(built, batch, args.prefix, args.device)
    block = half_revealed(built.model.config, batch, built.block_size, args.device)  # (B, L)
    calls = timed_calls(built, context, block)
    medians = paired_medians(args.device, list(calls.values()), args.repeats, args.warmup)
    ms = {key: 1e3 * seconds for key, seconds in zip(calls, medians)}
    kinds = (1, *COPIES)
    if built.whole:
        forward, one_layer, layer = {M: ms["forward", M] for M in kinds}, {}, {}
    else:
        one_layer, layer = {M: ms["forward", M] for M in kinds}, {M: ms["layer", M] for M in kinds}
        forward = {M: one_layer[M] + (built.layers - 1) * layer[M] for M in kinds}
    return Costs(built.name, batch, built.block_size, built.layers,
                 "whole" if built.whole else "per-layer-scaled", forward,
                 {n: ms["head", n] for n in built.heads}, one_layer, layer)


def project(costs: Costs, lookahead: int, accepted: dict[float, float],
            accepted_self: dict[float, float]) -> list[Projection]:
    """One projection per head depth and threshold, and per threshold for self-drafts (head
    layers 0): a round of K = `lookahead` drafts after the first."""
    return [Projection(costs.size, costs.batch, layers, threshold, drafts,
                       costs.verify_x(lookahead + 1) + lookahead * costs.head_x(layers))
            for layers in costs.head_ms for threshold, drafts in accepted.items()] + [
        Projection(costs.size, costs.batch, 0, threshold, drafts, costs.verify_x(lookahead + 1))
        for threshold, drafts in accepted_self.items()]


def cost_table(rows: list[Costs]) -> list[str]:
    depths = sorted({n for row in rows for n in row.head_ms})
    lines = ["| size | batch | L | timing | denoise ms | "
             + " | ".join(f"verify M={M}" for M in COPIES) + " | "
             + " | ".join(f"head step {n}L" for n in depths) + " |",
             "| --- " * (5 + len(COPIES) + len(depths)) + "|"]
    for row in rows:
        verify = [f"{row.verify_x(M):.2f}x ({row.forward_ms[M]:.1f} ms)" for M in COPIES]
        heads = [f"{row.head_x(n):.2f}x ({row.head_ms[n]:.1f} ms)" if n in row.head_ms else "-"
                 for n in depths]
        lines.append(f"| {row.size} | {row.batch} | {row.block_size} | {row.scaling} | "
                     f"{row.forward_ms[1]:.2f} | " + " | ".join(verify + heads) + " |")
    return lines


def projection_table(projections: list[Projection], lookahead: int) -> list[str]:
    lines = [f"| size | batch | head layers | round cost (verify M={lookahead + 1} + "
             f"{lookahead} head steps), denoise fwds | τ | accepted/round (given) | "
             "PROJECTED speedup vs rule | break-even accepted |",
             "| --- " * 8 + "|"]
    for p in projections:
        layers = p.head_layers or "0 (self-drafts)"
        lines.append(f"| {p.size} | {p.batch} | {layers} | {p.round_cost:.2f} | "
                     f"{p.threshold:g} | {p.accepted:g} | {p.speedup:.2f}x (projection) | "
                     f"{p.break_even:.2f} |")
    return lines


def markdown(rows: list[Costs], projections: list[Projection], args: argparse.Namespace) -> str:
    per_layer = any(row.scaling == "per-layer-scaled" for row in rows)
    return "\n".join([
        f"## Round cost (bfloat16, {args.device}, prefix {args.prefix} cached tokens)", "",
        "Costs in denoise forwards (x) and milliseconds (median of "
        f"{args.repeats} paired repeats after {args.warmup} warm-up rounds)."
        + (" `per-layer-scaled`: one decoder layer timed at full width and scaled by the "
           "layer count (plus the embedding, final norm and lm_head timed once); not a "
           "whole-model timing." if per_layer else ""), "",
        *cost_table(rows), "",
        f"## Projected speedup over the rule ({PROJECTION})", "",
        f"A round (K = {args.lookahead}) costs verify(K+1) + K head steps and advances "
        "1 + accepted steps of the rule; the rule costs one denoise forward per step. "
        "`accepted` is given (`--accepted`), not measured here.", "",
        *projection_table(projections, args.lookahead), ""])


def parse_pairs(text: str) -> dict[float, float]:
    """"0.9:1.2,1.0:1.0" -> {0.9: 1.2, 1.0: 1.0}."""
    pairs = (item.split(":") for item in text.split(",") if item.strip())
    return {float(threshold): float(drafts) for threshold, drafts in pairs}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prefix", type=int, default=512, help="cached prefix tokens")
    parser.add_argument("--block-size", type=int, default=None,
                        help="L; default: the model's (embedded 16, SDAR 4)")
    parser.add_argument("--lookahead", type=int, default=DecodeConfig.lookahead,
                        help="K of the projected rounds (verify K+1 copies)")
    parser.add_argument("--accepted", default="0.9:1.2,1.0:1.0",
                        help="τ:head drafts accepted per round, comma-separated; default: "
                             "the embedded model and head at K=3 (speculative over dynamic "
                             "0.9 and over static), as measured with `mrp bench`")
    parser.add_argument("--accepted-self", default="0.9:0.27,1.0:1.45",
                        help="τ:self-drafts accepted per round, comma-separated; default: the "
                             "embedded model at K=3 (`mrp bench`, speculative-self rows, "
                             "docs/experiments.md 2026-12-01 self-drafts)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds, median (default: 20 on CUDA, 5 on a CPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads; 0 keeps "
                        "torch's default")
    parser.add_argument("--per-layer", action="store_true",
                        help="scale one timed layer for every size (default: SDAR shapes on "
                             "a CPU, and models that do not fit on CUDA)")
    parser.add_argument("--fixtures", type=Path, default=REPO.parent / "shared" / "fixtures",
                        help="folder with the published sdar-4b-chat/ and sdar-8b-chat/ "
                             "config.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for round_cost.json and round_cost.md")
    args = parser.parse_args()
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    args.accepted = parse_pairs(args.accepted)
    args.accepted_self = parse_pairs(args.accepted_self)
    args.repeats = args.repeats or (20 if args.device.startswith("cuda") else 5)
    unknown = sorted(set(args.sizes) - set(SIZES))
    if unknown:
        parser.error(f"unknown size(s) {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    if not 1 <= args.lookahead <= max(COPIES) - 1:
        parser.error(f"--lookahead must be in 1..{max(COPIES) - 1} (verify M <= {max(COPIES)})")
    if set(args.sizes) & set(SDAR_CONFIGS) and not args.fixtures.is_dir():
        parser.error(f"published SDAR configs not found at {args.fixtures}; pass --fixtures")
    return args


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name in args.sizes:
        built = build(name, args)
        for batch in args.batches:
            rows.append(time_batch(built, batch, args))
            print(f"{name} batch {batch}: denoise {rows[-1].forward_ms[1]:.2f} ms "
                  f"({rows[-1].scaling})", file=sys.stderr, flush=True)
        del built
        release(args.device)
    projections = [p for row in rows
                   for p in project(row, args.lookahead, args.accepted, args.accepted_self)]
    report = markdown(rows, projections, args)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    summary = dict(config=config | dict(dtype="bfloat16", copies=list(COPIES)),
                   commit=git_commit(), hardware=hardware(args.device),
                   peak_memory_bytes=peak_memory(args.device),
                   costs=[row.to_json() for row in rows],
                   projection=dict(label=PROJECTION, lookahead=args.lookahead,
                                   rows=[p.to_json() for p in projections]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "round_cost.md").write_text(report)
        (args.out / "round_cost.json").write_text(json.dumps(summary, indent=2))
    print(report)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
