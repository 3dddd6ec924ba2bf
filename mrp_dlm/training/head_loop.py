"""`mrp train head`: train an MRP residual head on a frozen backbone, with exact resume.

`train_head(config)` loads the backbone (frozen: no grads, eval mode; bfloat16 with
`--bf16`) and its tokenizer, builds a seeded head, and runs the shared step loop of
`run.py` (AdamW, warmup + cosine) on the objective of `head_loss.py`. Every `save_every`
steps and at the end rank 0 writes into `config.out`: the head (`save_head`: config.json
with the backbone fingerprint + model.safetensors) and the run files of `run.py`
(`train_state.pt`, `train_config.json`, `loss_curve.png`); `train_log.jsonl` gets a line
every `log_every` steps and `metrics.jsonl` the held-out metrics (see `head_eval.py`) every
`eval_every` steps.

Resume is exact for the same reasons as the backbone's (see `loop.py`): the batch, the
noise and the reveal draws of step s are pure functions of (seed, s), drawn for the whole
global batch, so neither resuming nor the number of processes changes them.

Under torchrun the same call trains with DDP (see `distributed.py`); `batch_size` is the
global number of rows.

Deliberately not here: the run machinery (see `run.py`), the objective and metrics (see
`head_loss.py`, `head_eval.py`), flag parsing (see `cli.py`).

Shapes: B rows, T tokens per row, K lookahead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from mrp_dlm.config import HeadConfig, HeadTrainConfig
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.device import resolve_device
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.files import SINGLE_FILE
from mrp_dlm.model.head_loading import save_head
from mrp_dlm.model.loading import embedded_model_dir, load_backbone, load_head
from mrp_dlm.model.tokenizer import TextTokenizer, load_tokenizer
from mrp_dlm.threads import set_training_threads
from mrp_dlm.training.conversations import ChatEncoder
from mrp_dlm.training.data import (BatchSchedule, PackedBatch, Sample, SpecialIds, derive_seed,
                                   find_special_ids)
from mrp_dlm.training.distributed import (World, all_sum, finish_together, join_world,
                                          leave_world, shard_record, shard_rows, wrap_module)
from mrp_dlm.training.head_batch import encode_batch
from mrp_dlm.training.head_acceptance import measure_acceptance, prompt_ids
from mrp_dlm.training.head_eval import HeldOutBatch, build_held_out, evaluate_head
from mrp_dlm.training.head_loss import (RevealPlan, advance_blocks, chain_loss, chain_steps,
                                        draw_reveals)
from mrp_dlm.training.noise import NoisyBatch, add_noise
from mrp_dlm.training.run import (CURVE_FILE, LOG_FILE, RUN_FREE_FIELDS, Progress, RunHooks,
                                  RunLog, StepResult, apply_gradients, autocast, autocast_dtype,
                                  build_optimizer, check_run_dir, is_due, is_resuming,
                                  read_train_state, run_steps, save_train_state,
                                  set_learning_rate, write_loss_curve)
from mrp_dlm.training.sharding import lockstep, shard_backbone
from mrp_dlm.training.sources import DataOptions, load_eval_sources, load_sources, task_spec

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# Fields a resumed run may change: they touch neither the weights nor the data. The model
# directory may move: the head's backbone fingerprint is checked on load instead.
RESUME_FREE_FIELDS = RUN_FREE_FIELDS + ("model", "eval_every", "eval_examples", "eval_data",
                                         "eval_prompts", "eval_new_tokens", "shard_backbone")


@dataclass(frozen=True)
class StepInputs:
    """This process's share of one step's data, on the device."""

    batch: PackedBatch  # (B / world, T) x_0 rows
    noisy: NoisyBatch  # (B / world, T) x_t
    keys: torch.Tensor  # (K, B / world, T) float32 random reveal priorities
    counts: torch.Tensor  # (K, B / world, T) int64 reveals per block (constant within a block)
    burn_in: torch.Tensor | None  # (B / world, T) int64 backbone steps before the chain, per block
    normaliser: float  # response tokens of the global batch / world size
    tokens: int  # sample tokens of the global batch (for tokens/s)


def load_frozen_backbone(config: HeadTrainConfig, dtype: torch.dtype, device: str) -> Backbone:
    """The backbone in eval mode without grads, in `dtype` (it is never updated)."""
    backbone = load_backbone(config.model, dtype=dtype, device=device,
                             block_size=config.block_size)
    if config.seq_len % backbone.config.block_size:
        raise ValueError(f"seq_len ({config.seq_len}) must be a multiple of the block size "
                         f"({backbone.config.block_size})")
    return backbone.requires_grad_(False).eval()


def model_tokenizer(config: HeadTrainConfig,
                    backbone: Backbone) -> tuple[TextTokenizer, SpecialIds]:
    tokenizer = load_tokenizer(config.model)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{config.model} has no tokenizer with a chat template")
    special = find_special_ids(tokenizer)
    if special.mask != backbone.config.mask_token_id:
        raise ValueError(f"the tokenizer's <|MASK|> id {special.mask} differs from the model's "
                         f"mask_token_id {backbone.config.mask_token_id}")
    return tokenizer, special


def checkpoint_layers(head: MRPHead) -> MRPHead:
    """Recompute each head layer in the backward pass instead of storing its activations.

    Wraps the layers' bound forwards in place, so parameter names (and checkpoints) are
    unchanged; non-reentrant checkpointing works under DDP and with chained steps.
    """
    for layer in head.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return head


def build_head(config: HeadTrainConfig, backbone: Backbone) -> MRPHead:
    """A seeded float32 head on the backbone's device (the global RNG is left untouched),
    or the head in `config.init_from` (float32) to fine-tune."""
    if config.init_from is not None:
        head = resume_head(config, Path(config.init_from), backbone, block_only=True)
        if head.config.num_layers != config.head_layers:
            raise ValueError(f"{config.init_from} has {head.config.num_layers} layers, not "
                             f"head_layers ({config.head_layers})")
        return head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(config.seed, "head-init", 0))
        head = MRPHead(backbone.config, HeadConfig(config.head_layers, config.init_std))
    return head.to(backbone.lm_head.weight.device).train()


def resume_head(config: HeadTrainConfig, out: Path, backbone: Backbone,
                block_only: bool = False) -> MRPHead:
    """The head saved in `out` in float32 (a bfloat16 backbone would round it on load);
    `block_only`: a head saved before heads attended to the context may start a run."""
    head = load_head(out, backbone, config.block_size, block_only).float()  # checks the fingerprint
    device = str(backbone.lm_head.weight.device)
    head.load_state_dict(load_file(str(out / SINGLE_FILE), device=device))
    return head.train()


@dataclass
class HeadRun:
    """What every step of one run uses, built once."""

    config: HeadTrainConfig  # the run's settings
    world: World  # this process among the data-parallel ones
    out: Path  # output directory (rank 0 writes it)
    backbone: Backbone  # frozen
    head: MRPHead  # the trained module (saved)
    model: torch.nn.Module  # the head, or its DDP wrapper: what the step calls
    optimizer: torch.optim.Optimizer  # AdamW over the head's parameters
    precision: torch.dtype | None  # autocast dtype, None for float32


def start_head_run(config: HeadTrainConfig, world: World, backbone: Backbone,
                   precision: torch.dtype | None) -> tuple[HeadRun, Progress]:
    """A fresh (seeded) or resumed head with its optimizer, and the progress so far."""
    out = Path(config.out)
    if is_resuming(out, config.resume):
        optimizer_state, progress = read_train_state(out, config, world.device,
                                                     RESUME_FREE_FIELDS)
        head = resume_head(config, out, backbone)
        optimizer = build_optimizer(head, config, optimizer_state)
    else:
        head, progress = build_head(config, backbone), Progress()
        optimizer = build_optimizer(head, config)
    if config.grad_checkpointing:
        checkpoint_layers(head)
    run = HeadRun(config, world, out, backbone, head, wrap_module(head, world), optimizer,
                  precision)
    return run, progress


@dataclass(frozen=True)
class RunData:
    """The training schedule and the held-out set of a run."""

    schedule: BatchSchedule  # global batches of any step
    held_out: list[HeldOutBatch]  # this process's share of the held-out rows
    prompts: list[list[int]]  # held-out prompts (token ids) for the acceptance metric


def load_data(config: HeadTrainConfig, tokenizer: TextTokenizer, special: SpecialIds,
              block_size: int, world: World) -> RunData:
    """The training schedule (global batches) and this process's share of the held-out set:
    --data (or the --tasks) and its held-out split, or --eval-data."""
    log.info("reading, tokenizing and packing %s", config.data or
             f"{config.train_examples} problems per task ({', '.join(config.task_names)})")
    encoder = ChatEncoder(tokenizer, special, block_size)
    options = DataOptions(config.seq_len, config.train_examples, config.eval_examples,
                          0.0 if config.eval_data else config.held_out_frac,
                          config.skip_bad_rows)
    data = load_sources(config.data or task_spec(config.task_names), encoder, options)
    schedule = BatchSchedule(data.store, config.seq_len, config.batch_size, config.seed,
                             special.pad, data.store.lengths, data.store.groups)
    held_out: list[Sample] = data.held_out
    if config.eval_data:
        held_out = load_eval_sources(config.eval_data, encoder, options)
    log.info("held-out set: %d samples", len(held_out))
    return RunData(schedule, build_held_out(held_out, config, special, world),
                   prompt_ids(held_out, config.eval_prompts))


def draw_step(config: HeadTrainConfig, schedule: BatchSchedule, step: int, mask_token_id: int,
              block_size: int, world: World) -> StepInputs:
    """The global batch of `step` with its noise and reveal draws, cut to this process's rows."""
    batch = schedule.batch(step)
    generator = torch.Generator().manual_seed(derive_seed(config.seed, "noise", step))
    noisy = add_noise(batch.input_ids, batch.segment_ids, batch.response, mask_token_id, generator)
    keys, counts = draw_reveals(generator, config.batch_size, config.seq_len, block_size,
                                config.lookahead, config.reveal_max)  # (K, B, T) each
    burn_in = None
    if config.burn_in_max:
        noisy = fully_masked(batch, mask_token_id)
        burn_in = torch.randint(0, config.burn_in_max + 1, (config.batch_size,
                                config.seq_len // block_size), generator=generator)  # (B, T/L)
        burn_in = shard_rows(burn_in.repeat_interleave(block_size, dim=1), world).to(world.device)
    return StepInputs(batch=shard_record(batch, world), noisy=shard_record(noisy, world),
                      keys=shard_rows(keys, world, dim=1).to(world.device),
                      counts=shard_rows(counts, world, dim=1).to(world.device), burn_in=burn_in,
                      normaliser=int(batch.response.sum()) / world.size,
                      tokens=batch.num_tokens)


def fully_masked(batch: PackedBatch, mask_token_id: int) -> NoisyBatch:
    """Every response token masked (p = 1): each response block as decoding starts it."""
    response = batch.response  # (B, T)
    return NoisyBatch(noisy_ids=batch.input_ids.masked_fill(response, mask_token_id),
                      masked=response, mask_rate=response.float())


def train_step(run: HeadRun, inputs: StepInputs, step: int) -> tuple[float, float]:
    """One optimizer step; returns (global loss, gradient norm before clipping)."""
    config, backbone = run.config, run.backbone
    set_learning_rate(run.optimizer, config, step)
    with autocast(run.world.device, run.precision):
        blocks, context = encode_batch(backbone, inputs.batch, inputs.noisy)
        take = context.layout.take
        threshold = 1.0 if config.reveal_rule == "static" else config.threshold
        if inputs.burn_in is not None:
            with lockstep(backbone, run.world):  # per-rank step counts
                blocks = advance_blocks(backbone, blocks, context, take(inputs.burn_in)[:, 0],
                                        threshold)
        plan = RevealPlan(config.reveal_rule, torch.stack([take(k) for k in inputs.keys]),
                          torch.stack([take(c)[:, 0] for c in inputs.counts]), threshold)
        loss = chain_loss(chain_steps(run.model, backbone, blocks, context, plan), blocks.rates,
                          inputs.normaliser, backbone.config.mask_token_id,
                          config.commit_weight, threshold)
    loss.backward()
    grad_norm = apply_gradients(run.optimizer, run.head, config)
    return all_sum(loss.detach(), run.world).item() / run.world.size, grad_norm


def save_head_checkpoint(run: HeadRun, progress: Progress, history: list[dict],
                         metrics: list[dict]) -> None:
    """Head weights first, then the state that names their hash (see `run.save_train_state`)."""
    save_head(run.head, run.backbone, run.out, run.config.block_size)
    save_train_state(run.out, run.optimizer, progress, run.config)
    if history:
        acceptance = [(r["step"], r["acceptance"]["accepted_per_round"]) for r in metrics
                      if "acceptance" in r]
        write_loss_curve(run.out / CURVE_FILE, history, "loss (KL / p per response token)",
                         "MRP head training", acceptance)


def run_evaluation(run: HeadRun, data: RunData, step: int, metrics: RunLog) -> dict:
    """Held-out metrics and speculative acceptance now; rank 0 appends them to metrics.jsonl."""
    started = time.perf_counter()
    run.head.eval()
    with autocast(run.world.device, run.precision):
        by_rule = evaluate_head(run.head, run.backbone, data.held_out, run.config.lookahead,
                                run.world)
        result = {**by_rule["static"], "random_reveal": by_rule["random"]}
        if data.prompts:
            result["acceptance"] = measure_acceptance(run.head, run.backbone, data.prompts,
                                                      run.config, run.world)
    run.head.train()
    record = {"step": step, **result, "seconds": round(time.perf_counter() - started, 3)}
    metrics.append(record)
    return record


def train_head(config: HeadTrainConfig) -> Path:
    """Train (or resume) an MRP head as configured (no model: on the embedded one); returns
    the output directory."""
    resolve_device(config.device)  # fail before anything is written
    check_run_dir(Path(config.out), config.resume)  # and before anything loads
    if config.model is None:
        config = dataclasses.replace(config, model=str(embedded_model_dir()))
    world = join_world(config.device)
    try:
        out = run_training(config, world)
        finish_together(world)
        return out
    finally:
        leave_world(world)


def run_training(config: HeadTrainConfig, world: World) -> Path:
    if config.batch_size % world.size:
        raise ValueError(f"batch_size ({config.batch_size}) must be a multiple of the "
                         f"number of processes ({world.size})")
    precision = autocast_dtype(config)
    log.info("loading the backbone %s", config.model)
    device = "cpu" if config.shard_backbone else world.device  # shards move to world.device
    backbone = load_frozen_backbone(config, precision or torch.float32, device)
    set_training_threads([backbone], world.device, config.threads, world.size)
    if config.shard_backbone:
        backbone = shard_backbone(backbone, world)
    tokenizer, special = model_tokenizer(config, backbone)
    L = backbone.config.block_size
    data = load_data(config, tokenizer, special, L, world)
    if world.is_main:
        Path(config.out).mkdir(parents=True, exist_ok=True)
    run, progress = start_head_run(config, world, backbone, precision)
    log_file = RunLog.resume(run.out / LOG_FILE, progress.step, world.is_main)
    metrics = RunLog.resume(run.out / METRICS_FILE, progress.step, world.is_main)
    log.info("%d samples, %d held-out rows, head %.2fM parameters, start at step %d of %d",
             len(data.schedule.samples), sum(h.batch.input_ids.shape[0] for h in data.held_out),
             sum(p.numel() for p in run.head.parameters()) / 1e6, progress.step,
             config.train_steps)

    def step(index: int) -> StepResult:
        inputs = draw_step(config, data.schedule, index, special.mask, L, world)
        loss, grad_norm = train_step(run, inputs, index)
        return StepResult(loss, grad_norm, inputs.tokens)

    def evaluate(progress: Progress, done: bool) -> dict[str, str]:
        if not is_due(progress.step, config.eval_every, done):
            return {}
        result = run_evaluation(run, data, progress.step, metrics)
        accepted = result.get("acceptance", {}).get("accepted_per_round", 0.0)
        return {"kl": f"{result['kl_residual'][0]:.4f}", "accepted": f"{accepted:.3f}"}

    def save(progress: Progress) -> None:
        if world.is_main:
            save_head_checkpoint(run, progress, log_file.records, metrics.records)

    run_steps(config, progress, RunHooks(step, save, evaluate), log_file, "train head")
    return run.out
