"""Decode speed of the reference strategies and peak memory of checkpoint loading.

Not a test (never collected by pytest). On a small random backbone (default: vocab 1024,
hidden 256, 4 layers, block 4) it decodes one prompt for 256 new tokens with every
strategy and reports tokens/s and tokens per backbone forward. It also times two slow
paths on the same prompt, in the same run, against our cached static decode:
- `reference`: tests/reference.py, the test suite's specification decoder (full recompute,
  Python loops over positions and the vocabulary);
- `no-cache`: the same library rule and sampling code, but every step recomputes the whole
  sequence without a KV cache (isolates what the cache buys).
Finally, in a fresh subprocess, it loads a ~1 GB sharded float32 checkpoint written to a
temporary directory and reports the peak RSS increase over the RSS before the load.

Warm-up runs are excluded from every timing. Prints a table, then one JSON line last
(config, git commit, hardware, results).

    python benchmarks/decode.py [--device cpu] [--threads N] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from mrp_dlm.config import BackboneConfig, DecodeConfig  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.sampling import draw_index, propose  # noqa: E402
from mrp_dlm.decoding.selection import select_static  # noqa: E402
from mrp_dlm.decoding.strategies import StrategyDecoder, sampling_of  # noqa: E402
from mrp_dlm.eval.provenance import git_commit, hardware  # noqa: E402
from mrp_dlm.model.backbone import Backbone  # noqa: E402
from mrp_dlm.model.masks import block_causal_mask  # noqa: E402
from reference import reference_generate  # noqa: E402  (tests/reference.py)

STRATEGIES = {
    "static": dict(mode="static"),
    "static steps=2": dict(mode="static", steps=2),
    "dynamic t=0.9": dict(mode="dynamic", threshold=0.9),
    "dynamic t=0.5": dict(mode="dynamic", threshold=0.5),
    "sequential": dict(mode="sequential"),
    "entropy g=1.0": dict(mode="entropy", entropy_bound=1.0),
    "static sample": dict(mode="static", temperature=0.8, top_k=50, top_p=0.95, seed=1),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 keeps the default "
                        "(1 by default: small models gain little, shared machines lose a lot)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per strategy (median)")
    parser.add_argument("--std", type=float, default=0.3, help="init std of the random weights")
    parser.add_argument("--checkpoint-gb", type=float, default=1.0)
    parser.add_argument("--shard-mb", type=int, default=256)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    return parser.parse_args()


def random_model(config: BackboneConfig, std: float, device: str) -> Backbone:
    torch.manual_seed(0)
    model = Backbone(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, std)
    return model.to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def no_cache_static(model: Backbone, prompt: list[int],
                    config: DecodeConfig) -> tuple[list[int], int]:
    """Greedy static decode recomputing the whole sequence every step (no KV cache)."""
    L, mask_token_id = model.config.block_size, model.config.mask_token_id
    device = model.lm_head.weight.device
    n = len(prompt)
    tokens = torch.tensor([prompt], device=device)  # (1, n)
    start, forwards = n // L * L, 0
    while start < n + config.max_new_tokens:
        pad = start + L - tokens.shape[1]
        fill = torch.full((1, pad), mask_token_id, device=device)  # (1, pad)
        tokens = torch.cat((tokens, fill), dim=1)  # (1, T)
        T = tokens.shape[1]
        mask = block_causal_mask(torch.arange(T, device=device) // L,
                                 torch.ones(1, T, dtype=torch.bool, device=device))  # (1, T, T)
        positions = torch.arange(T, device=device)[None]  # (1, T)
        while bool((tokens[:, start:] == mask_token_id).any()):
            logits = model.logits(model(tokens, positions, mask))[:, start:]  # (1, L, V)
            forwards += 1
            proposal = propose(logits, mask_token_id, sampling_of(config), positions[:, start:],
                               draw_index(tokens[:, start:], mask_token_id))
            eligible = tokens[:, start:] == mask_token_id  # (1, L)
            commit = select_static(proposal.confidence, eligible, 1)
            tokens[:, start:] = torch.where(commit, proposal.tokens, tokens[:, start:])
        start += L
    return tokens[0, n:n + config.max_new_tokens].tolist(), forwards


def timed(device: str, fn, repeats: int = 1):
    """fn's result and its median wall time over `repeats` runs (synced around each)."""
    times = []
    for _ in range(repeats):
        sync(device)
        began = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - began)
    return out, sorted(times)[len(times) // 2]


def bench_strategies(model: Backbone, prompt: list[int], new_tokens: int, device: str,
                     repeats: int) -> list[dict]:
    rows = []
    # One full-length warm-up first: short warm-ups alone leave the first timed strategy
    # ~50% slow (allocator and cache shapes still growing).
    full = DecodeConfig(max_new_tokens=new_tokens, stop_token_ids=())
    generate(model, [prompt], full, StrategyDecoder(full))
    for name, knobs in STRATEGIES.items():
        config = DecodeConfig(max_new_tokens=new_tokens, stop_token_ids=(), **knobs)
        warm = DecodeConfig(max_new_tokens=16, stop_token_ids=(), **knobs)
        generate(model, [prompt], warm, StrategyDecoder(warm))  # warm-up, not timed
        result, seconds = timed(device, lambda: generate(model, [prompt], config,
                                                         StrategyDecoder(config)), repeats)
        stats = result.stats
        rows.append(dict(strategy=name, tokens=stats.tokens, seconds=round(seconds, 4),
                         tokens_per_s=round(stats.tokens / seconds, 1),
                         tokens_per_forward=round(stats.tokens_per_forward, 3),
                         tokens_per_denoise_forward=round(stats.tokens_per_denoise_forward, 3),
                         forwards=stats.backbone_forwards, output=result.token_ids[0]))
    return rows


def bench_slow_paths(model: Backbone, prompt: list[int], new_tokens: int, device: str,
                     static_seconds: float, static_tokens: list[int]) -> list[dict]:
    config = DecodeConfig(max_new_tokens=new_tokens, stop_token_ids=())
    warm = DecodeConfig(max_new_tokens=8, stop_token_ids=())
    no_cache_static(model, prompt, warm)
    reference_generate(model, prompt, warm)
    (tokens, forwards), seconds = timed(device, lambda: no_cache_static(model, prompt, config))
    ref_tokens, ref_seconds = timed(device, lambda: reference_generate(model, prompt, config))
    return [dict(path="no-cache (library rule, full recompute)", seconds=round(seconds, 4),
                 speedup_of_cached=round(seconds / static_seconds, 2),
                 identical=tokens == static_tokens, forwards=forwards),
            dict(path="tests/reference.py (Python loops)", seconds=round(ref_seconds, 4),
                 speedup_of_cached=round(ref_seconds / static_seconds, 2),
                 identical=ref_tokens == static_tokens, forwards=None)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def anon_rss_bytes() -> int:
    """Anonymous resident memory (excludes clean, reclaimable file-backed mmap pages)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def memory_child(directory: str) -> None:
    """Runs in a fresh interpreter: RSS before the load, and the peak during it.

    The total peak comes from ru_maxrss; a sampling thread also tracks the anonymous part,
    since mmap-ed safetensors pages are resident but clean and reclaimable.
    """
    import threading

    from mrp_dlm.model.loading import load_backbone

    before, anon_before = rss_bytes(), anon_rss_bytes()
    peak_anon, done = [anon_before], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak_anon[0] = max(peak_anon[0], anon_rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.perf_counter()
    model = load_backbone(directory)
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps(dict(rss_before=before, peak=peak, anon_before=anon_before,
                          peak_anon=max(peak_anon[0], anon_rss_bytes()), param_bytes=params,
                          seconds=seconds)))


def bench_memory(checkpoint_gb: float, shard_mb: int) -> dict:
    from mrp_dlm.model.loading import save_backbone

    # vocab 32768, hidden 1024, untied lm_head: embedding + lm_head are 67M parameters and
    # each layer 15.7M (268 MB / 63 MB in float32); the layer count sets the size.
    H, V, I = 1024, 32768, 4096
    per_layer = 2 * H * 1024 + 2 * H * 512 + 3 * H * I + 2 * H + 2 * 64  # q,o + k,v + mlp + norms
    layers = max(1, round((checkpoint_gb * 1e9 / 4 - 2 * V * H) / per_layer))
    config = BackboneConfig(vocab_size=V, hidden_size=H, num_layers=layers, num_heads=16,
                            num_kv_heads=8, intermediate_size=I, head_dim=64,
                            mask_token_id=V - 1, stop_token_ids=(V - 2,))
    with tempfile.TemporaryDirectory(prefix="mrp-bench-") as tmp:
        with torch.device("meta"):
            model = Backbone(config)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02)
        save_backbone(model, tmp, max_shard_bytes=shard_mb * 2**20)
        del model
        files = sorted(Path(tmp).glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        largest = max(f.stat().st_size for f in files)
        child = subprocess.run([sys.executable, __file__, "--memory-child", tmp], check=True,
                               capture_output=True, text=True, cwd=REPO)
        measured = json.loads(child.stdout.strip().splitlines()[-1])
    increase = measured["peak"] - measured["rss_before"]
    anon_increase = measured["peak_anon"] - measured["anon_before"]
    return dict(checkpoint_bytes=size, shards=len(files), largest_shard=largest,
                layers=layers, rss_before=measured["rss_before"], peak=measured["peak"],
                peak_increase=increase, ratio=round(increase / size, 3),
                anon_peak_increase=anon_increase, anon_ratio=round(anon_increase / size, 3),
                load_seconds=round(measured["seconds"], 2))


def main() -> None:
    args = parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    config = BackboneConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=8, num_kv_heads=4, intermediate_size=4 * args.hidden,
                            block_size=args.block, mask_token_id=args.vocab - 1,
                            max_position_embeddings=4096, stop_token_ids=(args.vocab - 2,))
    model = random_model(config, args.std, args.device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab - 2, (args.prompt_len,), generator=generator).tolist()

    rows = bench_strategies(model, prompt, args.new_tokens, args.device, args.repeats)
    static = rows[0]
    slow = bench_slow_paths(model, prompt, args.new_tokens, args.device, static["seconds"],
                            static["output"])
    memory = None if args.skip_memory else bench_memory(args.checkpoint_gb, args.shard_mb)

    print(f"{'strategy':<16}{'tokens':>7}{'seconds':>9}{'tok/s':>9}{'tok/fwd':>9}"
          f"{'tok/denoise':>12}{'forwards':>9}")
    for row in rows:
        print(f"{row['strategy']:<16}{row['tokens']:>7}{row['seconds']:>9.3f}"
              f"{row['tokens_per_s']:>9.1f}{row['tokens_per_forward']:>9.3f}"
              f"{row['tokens_per_denoise_forward']:>12.3f}{row['forwards']:>9}")
    for path in slow:
        print(f"cached static vs {path['path']}: {path['speedup_of_cached']}x faster "
              f"({path['seconds']:.3f}s vs {static['seconds']:.3f}s; identical tokens: "
              f"{path['identical']}; target >= 3x)")
    if memory:
        print(f"load of a {memory['checkpoint_bytes'] / 1e9:.2f} GB checkpoint in "
              f"{memory['shards']} shards: peak RSS +{memory['peak_increase'] / 1e9:.2f} GB = "
              f"{memory['ratio']}x the checkpoint (target <= 1.3x); anonymous memory only "
              f"+{memory['anon_peak_increase'] / 1e9:.2f} GB = {memory['anon_ratio']}x; "
              f"{memory['load_seconds']}s")
    for row in rows:
        del row["output"]
    summary = dict(config=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                               block=args.block, new_tokens=args.new_tokens, batch=1,
                               prompt_len=args.prompt_len, init_std=args.std, dtype="float32",
                               repeats=args.repeats, shard_mb=args.shard_mb),
                   commit=git_commit(), hardware=hardware(args.device), strategies=rows,
                   slow_paths=slow, memory=memory)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
