"""The run machinery both training loops share: step loop, logs, schedule, optimizer, resume.

A run is `config.train_steps` optimizer steps of AdamW with linear warmup and a cosine
decay (`learning_rate`), driven by `run_steps`: it times each step, keeps `Progress`, writes
a `train_log.jsonl` line every `log_every` steps (`RunLog`, averaged by `LogWindow`) and
calls the loop's own save every `save_every` steps, at the end and on Ctrl-C (at the step
reached; then `TrainingInterrupted` says where). A checkpoint's run files
are `train_state.pt` (optimizer state and counters, tensors and plain types only, read back
with `weights_only=True`, naming the hash of the weights saved before it) and
`train_config.json`; `loss_curve.png` plots the log.

Deliberately not here: what a step computes, which module is trained and how its weights
are saved (see `loop.py` for a backbone, `head_loop.py` for an MRP head).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from mrp_dlm.config import RunConfig
from mrp_dlm.files import write_atomic
from mrp_dlm.model.files import weight_files

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.jsonl"
CONFIG_FILE = "train_config.json"
CURVE_FILE = "loss_curve.png"
ADAM_BETAS = (0.9, 0.95)
# Fields any resumed run may change: they do not touch the weights.
RUN_FREE_FIELDS = ("out", "resume", "log_every", "save_every", "device", "threads")
# Fields renamed since runs were saved: old name -> new name (any training config).
RENAMED_FIELDS = {"steps": "train_steps"}


@dataclass
class Progress:
    """Counters saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    elapsed: float = 0.0  # seconds spent in steps (no setup or saving), summed over resumes
    tokens: int = 0  # sample tokens (x_0, no filler) seen


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during the step loop, after the step reached was saved; the message says
    which step and where (the CLI adds the command that resumes)."""


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """A first Ctrl-C inside the block is raised when the block ends, so that a step or a
    save is never left half done; a second one interrupts at once. Main thread only
    (elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.getsignal(signal.SIGINT)

    def defer(signum, frame) -> None:
        caught.append(signum)
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports."""

    loss: float  # the step's loss (under DDP: the mean over processes)
    grad_norm: float  # global gradient norm before clipping
    tokens: int  # sample tokens of the global batch


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


@dataclass
class RunLog:
    """A JSONL log of a run (a record per line, each with its "step"); only the writing
    process appends to the file, every process keeps the records."""

    path: Path  # the JSONL file
    records: list[dict]  # the records so far
    writes: bool = True  # this process appends to the file (rank 0 under DDP)

    @classmethod
    def resume(cls, path: Path, last_step: int, writes: bool = True) -> RunLog:
        """The log up to `last_step`; later records (lost with a killed run) are cut from
        the file. A process that does not write starts empty."""
        if not writes or not path.is_file():
            return cls(path, [], writes)
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        kept = [r for r in records if r["step"] <= last_step]
        write_atomic(path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))
        return cls(path, kept, writes)

    def append(self, record: dict) -> None:
        self.records.append(record)
        if self.writes:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")


@dataclass(frozen=True)
class RunHooks:
    """A loop's own parts of the shared step loop."""

    step: Callable[[int], StepResult]  # one optimizer step at a 0-based step index
    save: Callable[[Progress], None]  # a checkpoint (every save_every steps and the last)
    # after each step's log line (head training: its evaluations); returns bar postfix fields
    after: Callable[[Progress, bool], dict[str, str]] = lambda progress, done: {}


def learning_rate(config: RunConfig, step: int) -> float:
    """Linear warmup to lr, then cosine to min_lr_ratio * lr at the last step (step is 0-based)."""
    warmup = round(config.warmup_frac * config.train_steps)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.train_steps - 1 - warmup)
    floor = config.min_lr_ratio * config.lr
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, config: RunConfig, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, step)


def build_optimizer(module: torch.nn.Module, config: RunConfig,
                    state: dict | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (ndim >= 2) only, never on norms; `state`: a
    resumed run's optimizer state."""
    params = list(module.parameters())  # tied weights appear once
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=ADAM_BETAS)
    if state is not None:
        optimizer.load_state_dict(state)
    return optimizer


def apply_gradients(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                    config: RunConfig) -> float:
    """Clip, step and clear the gradients of `module`; returns their norm before clipping."""
    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item()


def autocast_dtype(config: RunConfig) -> torch.dtype | None:
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


def autocast(device: str, precision: torch.dtype | None) -> torch.autocast:
    """Autocast to `precision` on `device`'s type; off for None (float32)."""
    return torch.autocast(torch.device(device).type, dtype=precision or torch.bfloat16,
                          enabled=precision is not None)


def fingerprint_weights(out: Path) -> str:
    """sha256 of the weight files: ties train_state.pt to the weights saved with it."""
    digest = hashlib.sha256()
    for path in weight_files(out):
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def write_loss_curve(path: Path, history: list[dict], ylabel: str, title: str,
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


def save_train_state(out: Path, optimizer: torch.optim.Optimizer, progress: Progress,
                     config: RunConfig) -> None:
    """train_state.pt, naming the hash of the weights already in `out`, and the config JSON."""
    state = {"progress": asdict(progress), "optimizer": optimizer.state_dict(),
             "config": asdict(config), "weights_sha256": fingerprint_weights(out)}
    write_atomic(out / STATE_FILE, lambda tmp: torch.save(state, tmp))
    config_text = json.dumps(asdict(config), indent=2) + "\n"
    write_atomic(out / CONFIG_FILE, lambda tmp: tmp.write_text(config_text))


def patch_saved_config(saved: dict, config: RunConfig, renamed: dict[str, str]) -> dict:
    """A saved config in today's fields (the one back-compat patch): renamed fields
    (`RENAMED_FIELDS` and the loop's own `renamed`) under their new names, and fields added
    since at their defaults (such a run trained with what the default now does)."""
    moved = {old: new for old, new in {**RENAMED_FIELDS, **renamed}.items() if old in saved}
    saved = {moved.get(name, name): value for name, value in saved.items()}
    missing = {f.name: f.default for f in fields(config)
               if f.name not in saved and f.default is not MISSING}
    if moved:
        log.info("the saved run predates the names %s", ", ".join(moved.values()))
    if missing:
        log.info("the saved run predates %s; taking their defaults", ", ".join(missing))
    return {**missing, **saved}


def check_resumable(saved: dict, config: RunConfig, free: tuple[str, ...] = RUN_FREE_FIELDS,
                    renamed: dict[str, str] | None = None) -> None:
    """Raise ValueError naming every field but the `free` ones that `config` changes."""
    saved = patch_saved_config(saved, config, renamed or {})
    changed = [f"{f.name}: {saved.get(f.name)!r} -> {getattr(config, f.name)!r}"
               for f in fields(config)
               if f.name not in free and saved.get(f.name) != getattr(config, f.name)]
    if changed:
        raise ValueError("--resume needs the settings of the saved run; changed: "
                         + "; ".join(changed))


def read_train_state(out: Path, config: RunConfig, device: str,
                     free: tuple[str, ...] = RUN_FREE_FIELDS,
                     renamed: dict[str, str] | None = None) -> tuple[dict, Progress]:
    """(optimizer state dict, progress) of `out`, checked against `config` (bar the `free`
    fields; `renamed`: the loop's own renamed fields, old -> new name) and the weights."""
    state = torch.load(out / STATE_FILE, map_location=device, weights_only=True)
    check_resumable(state["config"], config, free, renamed)
    if fingerprint_weights(out) != state["weights_sha256"]:
        raise ValueError(f"{out}: the weights do not match {STATE_FILE} (a save was interrupted); "
                         "start the run again in a fresh directory")
    progress = Progress(**state["progress"])
    log.info("resuming from step %d of %d (%s)", progress.step, config.train_steps,
             out / STATE_FILE)
    return state["optimizer"], progress


def check_run_dir(out: Path, resume: bool) -> None:
    """Refuse an `out` that is a file, or that holds a run, without --resume (called before
    anything loads: a rerun fails in a moment)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    if (out / STATE_FILE).is_file() and not resume:
        raise ValueError(f"{out} already holds a training run; pass --resume to continue it "
                         "or choose another --out")


def is_resuming(out: Path, resume: bool) -> bool:
    """Whether `out` holds a run to continue; refuses to overwrite one without --resume."""
    check_run_dir(out, resume)
    has_state = (out / STATE_FILE).is_file()
    if resume and not has_state:
        log.warning("--resume: nothing to resume in %s (no %s); starting from scratch",
                    out, STATE_FILE)
    return resume and has_state


def is_due(step: int, every: int, done: bool) -> bool:
    """Whether a periodic action (log, save, eval) runs after `step` steps."""
    return step % every == 0 or done


def run_steps(config: RunConfig, progress: Progress, hooks: RunHooks, log_file: RunLog,
              desc: str) -> Progress:
    """Steps progress.step .. train_steps - 1, with their log lines and saves; the bar shows
    on the writing process only. A first Ctrl-C lets the step finish, saves the step
    reached (unless just saved) and raises `TrainingInterrupted`."""
    window = LogWindow()
    bar = tqdm(range(progress.step, config.train_steps), initial=progress.step,
               total=config.train_steps, desc=desc, unit="step", mininterval=1.0,
               disable=not log_file.writes)
    saved, stepping = None, False  # the step this call saved last; inside a step
    try:
        for step in bar:
            stepping = True
            with deferred_interrupt():
                started = time.perf_counter()
                result = hooks.step(step)
                seconds = time.perf_counter() - started
                progress = Progress(step + 1, progress.elapsed + seconds,
                                    progress.tokens + result.tokens)
                stepping = False
            window.add(result.loss, result.tokens, seconds)
            done = progress.step == config.train_steps
            if is_due(progress.step, config.log_every, done):
                record = window.record(progress, learning_rate(config, step), result.grad_norm)
                log_file.append(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                window = LogWindow()
            postfix = hooks.after(progress, done)
            if postfix:
                bar.set_postfix(**postfix)
            if is_due(progress.step, config.save_every, done):
                saved = progress.step
                save_step(hooks, progress, log_file.writes, config.out)
    except KeyboardInterrupt:
        bar.close()
        raise interrupted(config, hooks, progress, saved, stepping) from None
    bar.close()
    return progress


def save_step(hooks: RunHooks, progress: Progress, logs: bool, out: str) -> None:
    """The loop's save, shielded from a first Ctrl-C until it is complete."""
    with deferred_interrupt():
        hooks.save(progress)
    if logs:
        log.info("saved step %d to %s", progress.step, out)


def interrupted(config: RunConfig, hooks: RunHooks, progress: Progress, saved: int | None,
                stepping: bool) -> TrainingInterrupted:
    """Save the step reached after Ctrl-C, unless a second Ctrl-C cut a step short (its
    update may be half applied); the error says what `out` holds."""
    where = f"interrupted at step {progress.step} of {config.train_steps}"
    if stepping:
        kept = f"step {saved}" if saved is not None else "its last save, if any"
        return TrainingInterrupted(f"{where}, inside a step: nothing saved now; {config.out} "
                                   f"keeps {kept}")
    if saved != progress.step:
        with deferred_interrupt():
            hooks.save(progress)
    return TrainingInterrupted(f"{where}; saved step {progress.step} to {config.out}")
