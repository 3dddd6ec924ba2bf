"""`mrp train backbone`: SDAR block-diffusion training of a backbone, with exact resume.

`train_backbone(config)` builds (or loads) the tokenizer and the model, then runs AdamW
with linear warmup and a cosine decay. Every `save_every` steps and at the end it writes,
into `config.out`: the model in our HF format (`save_backbone`), the tokenizer,
`train_state.pt` (optimizer state and counters, tensors and plain types only, read back
with `weights_only=True`), `train_config.json`, and `loss_curve.png`; `train_log.jsonl`
gets a line every `log_every` steps.

Resume is exact: the batch and the noise of step s are pure functions of (seed, s) (see
`data.BatchSchedule`, `data.derive_seed`), so no RNG or iterator state is stored, and a
run killed and resumed ends with the same float32 weights as an uninterrupted one.

Deliberately not here: the objective (see `losses.py`) and flag parsing (see `cli.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import MISSING, asdict, dataclass, fields
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from mrp_dlm.config import BACKBONE_PRESETS, BackboneConfig, TrainConfig
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.device import resolve_device
from mrp_dlm.model.loading import load_backbone, save_backbone, weight_files, write_atomic
from mrp_dlm.model.tokenizer import TOKENIZER_FILES, TextTokenizer, load_tokenizer
from mrp_dlm.training.conversations import ChatEncoder
from mrp_dlm.training.data import BatchSchedule, PackedBatch, derive_seed, find_special_ids
from mrp_dlm.training.losses import block_diffusion_loss
from mrp_dlm.training.noise import add_noise
from mrp_dlm.training.sources import DataOptions, first_texts, load_sources, task_spec
from mrp_dlm.training.tokenizer import save_tokenizer, train_tokenizer

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.jsonl"
CONFIG_FILE = "train_config.json"
CURVE_FILE = "loss_curve.png"
ADAM_BETAS = (0.9, 0.95)
INIT_STD = 0.02  # normal init of every matrix; residual outputs get INIT_STD / sqrt(2 layers)
MAX_POSITIONS = 4096  # max_position_embeddings written for preset models
# Fields a resumed run may change: they do not touch the weights.
RESUME_FREE_FIELDS = ("out", "resume", "log_every", "save_every", "device")


@dataclass
class Progress:
    """Counters saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    elapsed: float = 0.0  # seconds spent in steps (no setup or saving), summed over resumes
    tokens: int = 0  # sample tokens (x_0, no filler) seen


@dataclass
class LogWindow:
    """Sums over the steps since the last log line."""

    loss: float = 0.0  # summed step losses
    steps: int = 0  # steps in the window
    tokens: int = 0  # sample tokens in the window
    seconds: float = 0.0  # step wall-clock time in the window

    def add(self, loss: float, tokens: int, seconds: float) -> None:
        self.loss, self.steps = self.loss + loss, self.steps + 1
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds

    def record(self, progress: Progress, lr: float, grad_norm: float) -> dict:
        return {"step": progress.step, "loss": self.loss / self.steps, "lr": lr,
                "grad_norm": grad_norm, "tokens_per_s": self.tokens / self.seconds,
                "elapsed": progress.elapsed}


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup to lr, then cosine to min_lr_ratio * lr at the last step (step is 0-based)."""
    warmup = round(config.warmup_frac * config.steps)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - 1 - warmup)
    floor = config.min_lr_ratio * config.lr
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: Backbone, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (ndim >= 2) only: never on norms."""
    params = list(model.parameters())  # tied weights appear once
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=ADAM_BETAS)


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
    """The run's tokenizer in `out`; a fresh run first writes init_from's or a new one
    there, trained on `texts()`."""
    if fresh:
        if config.init_from is not None:
            for name in TOKENIZER_FILES:
                if (Path(config.init_from) / name).is_file():
                    shutil.copy2(Path(config.init_from) / name, out / name)
        else:
            corpus = texts()
            log.info("training a %d-token tokenizer on %d texts", config.vocab_size, len(corpus))
            save_tokenizer(train_tokenizer(corpus, config.vocab_size), out)
    tokenizer = load_tokenizer(out)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{out} has no tokenizer with a chat template")
    return tokenizer


def build_model(config: TrainConfig, tokenizer: TextTokenizer) -> Backbone:
    """A fresh preset model (seeded init) or the init_from checkpoint, in float32."""
    special = find_special_ids(tokenizer)
    if config.init_from is not None:
        model = load_backbone(config.init_from, device=config.device, block_size=config.block_size)
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


def autocast_dtype(config: TrainConfig) -> torch.dtype | None:
    """bfloat16 when asked for and the device runs it natively, else None (float32)."""
    if not config.bf16:
        return None
    if config.device.startswith("cuda"):
        supported = torch.cuda.is_bf16_supported()
    else:
        supported = any(getattr(torch.cpu, probe, lambda: False)()
                        for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if not supported:
        log.warning("this %s has no native bfloat16; training in float32", config.device)
        return None
    return torch.bfloat16


def train_step(model: Backbone, optimizer: torch.optim.Optimizer, batch: PackedBatch,
               config: TrainConfig, step: int,
               precision: torch.dtype | None) -> tuple[float, float]:
    """One optimizer step on `batch`; returns (loss, gradient norm before clipping)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, step)
    generator = torch.Generator().manual_seed(derive_seed(config.seed, "noise", step))
    noisy = add_noise(batch.input_ids, batch.segment_ids, batch.response,
                      model.config.mask_token_id, generator)
    device_type = torch.device(config.device).type
    with torch.autocast(device_type, dtype=precision or torch.bfloat16,
                        enabled=precision is not None):
        loss = block_diffusion_loss(model, batch, noisy)
    loss.backward()
    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), grad_norm.item()


def fingerprint_weights(out: Path) -> str:
    """sha256 of the weight files: ties train_state.pt to the weights saved with it."""
    digest = hashlib.sha256()
    for path in weight_files(out):
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def write_loss_curve(path: Path, history: list[dict],
                     ylabel: str = "loss (CE / p per response token)",
                     title: str = "SDAR block-diffusion training",
                     acceptance: list[tuple[int, float]] = ()) -> None:
    """The loss over steps; with `acceptance` ((step, accepted drafts per round) pairs),
    that too, on a second axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy import, only here
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot([r["step"] for r in history], [r["loss"] for r in history], linewidth=1)
    axes.set(xlabel="step", ylabel=ylabel, title=title)
    axes.grid(True, alpha=0.3)
    if acceptance:
        right = axes.twinx()
        right.plot(*zip(*acceptance), color="tab:orange", marker="o", linewidth=1)
        right.set_ylabel("accepted drafts per round (held out)", color="tab:orange")
    write_atomic(path, lambda tmp: figure.savefig(tmp, format="png"))


def save_checkpoint(out: Path, model: Backbone, optimizer: torch.optim.Optimizer,
                    progress: Progress, config: TrainConfig, history: list[dict]) -> None:
    """Weights first, then the state that names their hash, so a torn save is detected."""
    save_backbone(model, out)
    save_train_state(out, optimizer, progress, config)
    if history:
        write_loss_curve(out / CURVE_FILE, history)
    log.info("saved step %d to %s", progress.step, out)


def save_train_state(out: Path, optimizer: torch.optim.Optimizer, progress: Progress,
                     config) -> None:
    """train_state.pt, naming the hash of the weights already in `out`, and the config JSON
    (`config` is any frozen config dataclass)."""
    state = {"progress": asdict(progress), "optimizer": optimizer.state_dict(),
             "config": asdict(config), "weights_sha256": fingerprint_weights(out)}
    write_atomic(out / STATE_FILE, lambda tmp: torch.save(state, tmp))
    config_text = json.dumps(asdict(config), indent=2) + "\n"
    write_atomic(out / CONFIG_FILE, lambda tmp: tmp.write_text(config_text))


def patch_missing_fields(saved: dict, config) -> dict:
    """A saved config with the fields added since it was written at their defaults (the
    one back-compat patch: such a run trained with what the default now does)."""
    missing = {f.name: f.default for f in fields(config)
               if f.name not in saved and f.default is not MISSING}
    if missing:
        log.info("the saved run predates %s; taking their defaults", ", ".join(missing))
    return {**missing, **saved}


def check_resumable(saved: dict, config, free: tuple[str, ...] = RESUME_FREE_FIELDS) -> None:
    saved = patch_missing_fields(saved, config)
    changed = [f"{f.name}: {saved.get(f.name)!r} -> {getattr(config, f.name)!r}"
               for f in fields(config)
               if f.name not in free and saved.get(f.name) != getattr(config, f.name)]
    if changed:
        raise ValueError("--resume needs the settings of the saved run; changed: "
                         + "; ".join(changed))


def read_train_state(out: Path, config, device: str,
                     free: tuple[str, ...] = RESUME_FREE_FIELDS) -> tuple[dict, Progress]:
    """(optimizer state dict, progress) of `out`, checked against `config` and the weights."""
    state = torch.load(out / STATE_FILE, map_location=device, weights_only=True)
    check_resumable(state["config"], config, free)
    if fingerprint_weights(out) != state["weights_sha256"]:
        raise ValueError(f"{out}: the weights do not match {STATE_FILE} (a save was interrupted); "
                         "start the run again in a fresh directory")
    progress = Progress(**state["progress"])
    log.info("resuming from step %d of %d (%s)", progress.step, config.steps, out / STATE_FILE)
    return state["optimizer"], progress


def load_checkpoint(out: Path, config: TrainConfig) -> tuple[Backbone, dict, Progress]:
    """(model, optimizer state dict, progress) of the checkpoint in `out`."""
    optimizer_state, progress = read_train_state(out, config, config.device)
    model = load_backbone(out, device=config.device).train()
    return model, optimizer_state, progress


def read_history(out: Path, last_step: int, name: str = LOG_FILE) -> list[dict]:
    """Log records up to `last_step`; later ones (lost with the killed run) are dropped."""
    path = out / name
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in records if r["step"] <= last_step]
    write_atomic(path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))
    return kept


def append_log(out: Path, record: dict, history: list[dict], name: str = LOG_FILE) -> None:
    history.append(record)
    with (out / name).open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def is_resuming(out: Path, resume: bool) -> bool:
    """Whether `out` holds a run to continue; refuses to overwrite one without --resume."""
    has_state = (out / STATE_FILE).is_file()
    if has_state and not resume:
        raise ValueError(f"{out} already holds a training run; pass --resume to continue it "
                         "or choose another --out")
    if resume and not has_state:
        log.warning("--resume: nothing to resume in %s (no %s); starting from scratch",
                    out, STATE_FILE)
    return resume and has_state


def start_run(config: TrainConfig, out: Path, texts: Callable[[], list[str]]
              ) -> tuple[TextTokenizer, Backbone, torch.optim.Optimizer, Progress]:
    """Tokenizer, model, optimizer and progress of a fresh or resumed run."""
    resuming = is_resuming(out, config.resume)
    tokenizer = prepare_tokenizer(config, out, texts, fresh=not resuming)
    if resuming:
        model, optimizer_state, progress = load_checkpoint(out, config)
        optimizer = build_optimizer(model, config)
        optimizer.load_state_dict(optimizer_state)
        return tokenizer, model, optimizer, progress
    model = build_model(config, tokenizer)
    return tokenizer, model, build_optimizer(model, config), Progress()


def train_backbone(config: TrainConfig) -> Path:
    """Train (or resume) a backbone as configured; returns the checkpoint directory."""
    resolve_device(config.device)  # fail before anything is written
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = config.data or task_spec(config.task_names)
    tokenizer, model, optimizer, progress = start_run(
        config, out, lambda: first_texts(spec, config.train_examples))
    log.info("reading, tokenizing and packing %s into rows of %d tokens", config.data or
             f"{config.train_examples} problems per task ({', '.join(config.task_names)})",
             config.seq_len)
    special = find_special_ids(tokenizer)
    options = DataOptions(config.seq_len, config.train_examples, 0, 0.0, config.skip_bad_rows)
    store = load_sources(spec, ChatEncoder(tokenizer, special, model.config.block_size),
                         options).store
    schedule = BatchSchedule(store, config.seq_len, config.batch_size, config.seed,
                             special.pad, store.lengths, store.groups)
    history = read_history(out, progress.step)
    precision = autocast_dtype(config)
    log.info("%d samples, rows %.0f%% full, %.1fM parameters, start at step %d of %d",
             len(schedule.samples), 100 * schedule.fill_fraction(),
             sum(p.numel() for p in model.parameters()) / 1e6, progress.step, config.steps)
    window = LogWindow()
    bar = tqdm(range(progress.step, config.steps), initial=progress.step, total=config.steps,
               desc="train", unit="step", mininterval=1.0)
    for step in bar:
        started = time.perf_counter()
        batch = schedule.batch(step).to(config.device)
        loss, grad_norm = train_step(model, optimizer, batch, config, step, precision)
        seconds = time.perf_counter() - started
        progress = Progress(step + 1, progress.elapsed + seconds,
                            progress.tokens + batch.num_tokens)
        window.add(loss, batch.num_tokens, seconds)
        done = progress.step == config.steps
        if progress.step % config.log_every == 0 or done:
            record = window.record(progress, learning_rate(config, step), grad_norm)
            append_log(out, record, history)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            window = LogWindow()
        if progress.step % config.save_every == 0 or done:
            save_checkpoint(out, model, optimizer, progress, config, history)
    bar.close()
    return out
