"""`mrp train backbone`: SDAR block-diffusion training of a backbone, with exact resume.

`train_backbone(config)` builds (or loads) the tokenizer and the model, then runs the
shared step loop of `run.py` (AdamW, warmup + cosine). Every `save_every` steps and at the
end it writes, into `config.out`: the model in our HF format (`save_backbone`), the
tokenizer, and the run files of `run.py` (`train_state.pt`, `train_config.json`,
`loss_curve.png`); `train_log.jsonl` gets a line every `log_every` steps.

Resume is exact: the batch and the noise of step s are pure functions of (seed, s) (see
`data.BatchSchedule`, `data.derive_seed`), so no RNG or iterator state is stored, and a
run killed and resumed ends with the same float32 weights as an uninterrupted one.

Deliberately not here: the run machinery (see `run.py`), the objective (see `losses.py`)
and flag parsing (see `cli.py`).
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from mrp_dlm.config import BACKBONE_PRESETS, BackboneConfig, TrainConfig
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.device import resolve_device
from mrp_dlm.model.loading import load_backbone, save_backbone
from mrp_dlm.model.tokenizer import TOKENIZER_FILES, TextTokenizer, load_tokenizer
from mrp_dlm.threads import set_training_threads
from mrp_dlm.training.conversations import ChatEncoder
from mrp_dlm.training.data import BatchSchedule, PackedBatch, derive_seed, find_special_ids
from mrp_dlm.training.losses import block_diffusion_loss
from mrp_dlm.training.noise import add_noise
from mrp_dlm.training.run import (CURVE_FILE, LOG_FILE, Progress, RunHooks, RunLog, StepResult,
                                  apply_gradients, autocast, autocast_dtype, build_optimizer,
                                  check_run_dir, is_resuming, read_train_state, run_steps,
                                  save_train_state, set_learning_rate, write_loss_curve)
from mrp_dlm.training.sources import DataOptions, first_texts, load_sources, task_spec
from mrp_dlm.training.tokenizer import save_tokenizer, train_tokenizer

log = logging.getLogger(__name__)

INIT_STD = 0.02  # normal init of every matrix; residual outputs get INIT_STD / sqrt(2 layers)
MAX_POSITIONS = 4096  # max_position_embeddings written for preset models
RENAMED_FIELDS = {"init_from": "model"}  # fields renamed since backbone runs were saved


def init_weights(model: Backbone, seed: int) -> None:
    """Seeded normal init; residual-branch outputs scaled down by depth (GPT-2)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, "init", 0))
    residual_std = INIT_STD / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2:
                continue  # RMSNorm weights stay 1
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def prepare_tokenizer(config: TrainConfig, out: Path, texts: Callable[[], list[str]],
                      fresh: bool) -> TextTokenizer:
    """The run's tokenizer in `out`; a fresh run first writes the model's or a new one
    there, trained on `texts()`."""
    if fresh:
        if config.model is not None:
            for name in TOKENIZER_FILES:
                if (Path(config.model) / name).is_file():
                    shutil.copy2(Path(config.model) / name, out / name)
        else:
            corpus = texts()
            log.info("training a %d-token tokenizer on %d texts", config.vocab_size, len(corpus))
            save_tokenizer(train_tokenizer(corpus, config.vocab_size), out)
    tokenizer = load_tokenizer(out)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{out} has no tokenizer with a chat template")
    return tokenizer


def build_model(config: TrainConfig, tokenizer: TextTokenizer) -> Backbone:
    """A fresh preset model (seeded init) or the `model` checkpoint, in float32."""
    special = find_special_ids(tokenizer)
    if config.model is not None:
        model = load_backbone(config.model, device=config.device, block_size=config.block_size)
        if model.config.mask_token_id != special.mask:
            log.warning("model mask id %d differs from the tokenizer's <|MASK|> id %d",
                        model.config.mask_token_id, special.mask)
        return model.train()
    shape = BackboneConfig(vocab_size=tokenizer.backend.get_vocab_size(),
                           block_size=config.block_size,
                           max_position_embeddings=MAX_POSITIONS, mask_token_id=special.mask,
                           stop_token_ids=(special.end, special.pad),
                           **BACKBONE_PRESETS[config.preset])
    model = Backbone(shape)
    init_weights(model, config.seed)
    return model.to(config.device).train()


def train_step(model: Backbone, optimizer: torch.optim.Optimizer, batch: PackedBatch,
               config: TrainConfig, step: int,
               precision: torch.dtype | None) -> tuple[float, float]:
    """One optimizer step on `batch`; returns (loss, gradient norm before clipping)."""
    set_learning_rate(optimizer, config, step)
    generator = torch.Generator().manual_seed(derive_seed(config.seed, "noise", step))
    noisy = add_noise(batch.input_ids, batch.segment_ids, batch.response,
                      model.config.mask_token_id, generator)
    with autocast(config.device, precision):
        loss = block_diffusion_loss(model, batch, noisy)
    loss.backward()
    return loss.item(), apply_gradients(optimizer, model, config)


def save_checkpoint(out: Path, model: Backbone, optimizer: torch.optim.Optimizer,
                    progress: Progress, config: TrainConfig, history: list[dict]) -> None:
    """Weights first, then the state that names their hash, so a torn save is detected."""
    save_backbone(model, out)
    save_train_state(out, optimizer, progress, config)
    if history:
        write_loss_curve(out / CURVE_FILE, history, "loss (CE / p per response token)",
                         "SDAR block-diffusion training")


def load_checkpoint(out: Path, config: TrainConfig) -> tuple[Backbone, dict, Progress]:
    """(model, optimizer state dict, progress) of the checkpoint in `out`."""
    optimizer_state, progress = read_train_state(out, config, config.device,
                                                 renamed=RENAMED_FIELDS)
    model = load_backbone(out, device=config.device).train()
    return model, optimizer_state, progress


def start_run(config: TrainConfig, out: Path, texts: Callable[[], list[str]]
              ) -> tuple[TextTokenizer, Backbone, torch.optim.Optimizer, Progress]:
    """Tokenizer, model, optimizer and progress of a fresh or resumed run."""
    resuming = is_resuming(out, config.resume)
    tokenizer = prepare_tokenizer(config, out, texts, fresh=not resuming)
    if resuming:
        model, optimizer_state, progress = load_checkpoint(out, config)
        return tokenizer, model, build_optimizer(model, config, optimizer_state), progress
    model = build_model(config, tokenizer)
    return tokenizer, model, build_optimizer(model, config), Progress()


def train_backbone(config: TrainConfig) -> Path:
    """Train (or resume) a backbone as configured; returns the checkpoint directory."""
    resolve_device(config.device)  # fail before anything is written
    out = Path(config.out)
    check_run_dir(out, config.resume)
    out.mkdir(parents=True, exist_ok=True)
    spec = config.data or task_spec(config.task_names)
    tokenizer, model, optimizer, progress = start_run(
        config, out, lambda: first_texts(spec, config.train_examples))
    set_training_threads([model], config.device, config.threads)
    log.info("reading, tokenizing and packing %s into rows of %d tokens", config.data or
             f"{config.train_examples} problems per task ({', '.join(config.task_names)})",
             config.seq_len)
    special = find_special_ids(tokenizer)
    options = DataOptions(config.seq_len, config.train_examples, 0, 0.0, config.skip_bad_rows)
    store = load_sources(spec, ChatEncoder(tokenizer, special, model.config.block_size),
                         options).store
    schedule = BatchSchedule(store, config.seq_len, config.batch_size, config.seed,
                             special.pad, store.lengths, store.groups)
    log_file = RunLog.resume(out / LOG_FILE, progress.step)
    precision = autocast_dtype(config)
    log.info("%d samples, rows %.0f%% full, %.1fM parameters, start at step %d of %d",
             len(schedule.samples), 100 * schedule.fill_fraction(),
             sum(p.numel() for p in model.parameters()) / 1e6, progress.step, config.train_steps)

    def step(index: int) -> StepResult:
        batch = schedule.batch(index).to(config.device)
        loss, grad_norm = train_step(model, optimizer, batch, config, index, precision)
        return StepResult(loss, grad_norm, batch.num_tokens)

    def save(progress: Progress) -> None:
        save_checkpoint(out, model, optimizer, progress, config, log_file.records)

    run_steps(config, progress, RunHooks(step, save), log_file, "train")
    return out
