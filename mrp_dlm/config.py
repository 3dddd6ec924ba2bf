"""Frozen configuration objects: one dataclass per concern, every default defined once.

The CLI derives its flags and defaults from these classes; nothing below the CLI reads
environment variables of its own (`threads.py` only steps aside when the standard
OMP_NUM_THREADS or MKL_NUM_THREADS is set). `__post_init__` validates and raises
`ValueError` with a message that names the offending field.

Deliberately not here: anything about checkpoint file formats (see `model/loading.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BACKBONE_PRESETS", "BackboneConfig", "BlockSchedule", "CUDA_DTYPE", "DEFAULT_DEVICE",
           "DEFAULT_DTYPE", "DISTILL_DECODE", "DISTILL_FORMATS", "DRAFTERS", "DTYPE_NAMES",
           "DecodeConfig", "DistillConfig", "HeadConfig", "HeadTrainConfig", "INVARIANT_CHOICES",
           "LOGPROB_MODES", "MODES", "MOST_CANDIDATES", "MRP_MODES", "REMASK_RULES",
           "REVEAL_RULES", "RunConfig", "SDAR_BLOCK_SIZE", "SDAR_MASK_TOKEN_ID",
           "SDAR_STOP_TOKEN_IDS", "STRATEGIES", "TrainConfig", "dtype_for"]

# SDAR family defaults: the published config.json files lack these keys and every engine
# hard-codes them.
SDAR_MASK_TOKEN_ID = 151669
SDAR_BLOCK_SIZE = 4
SDAR_STOP_TOKEN_IDS = (151645, 151643)

STRATEGIES = ("static", "dynamic", "sequential", "entropy")  # backbone-only modes
# modes that use an MRP head (speculative can do without)
MRP_MODES = ("direct", "speculative", "remask")
_LOOKAHEAD_MODES = ("direct", "speculative")  # modes that take K head steps per forward
MODES = STRATEGIES + MRP_MODES
LOGPROB_MODES = (*STRATEGIES, "speculative")  # the modes that return DecodeConfig.logprobs
REMASK_RULES = ("chain", "paper")  # see `decoding/remask.py`, `decoding/veto.py`
DRAFTERS = ("head", "self")  # what speculative decoding drafts with, see `decoding/drafting.py`
INVARIANT_CHOICES = ("auto", "on", "off")  # verify copies as lone forwards: `model/invariant.py`
MOST_CANDIDATES = 4  # largest candidate set: a draft and 3 alternatives (`decoding/candidates.py`)
# What a model loads in unless told (Pipeline, `mrp`). Plain names, so that the CLI builds its
# help without importing torch (`model/loading.py` maps them to torch dtypes).
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a model loads in
DEFAULT_DTYPE = "float32"  # a DTYPE_NAMES entry: what a model loads in on a CPU (or MPS)
CUDA_DTYPE = "bfloat16"  # ... and on a CUDA device, unless a dtype is given
DEFAULT_DEVICE = "cpu"  # the device a model loads onto


def dtype_for(device: str, dtype: str | None = None) -> str:
    """The dtype name a model loads in on `device` ("cuda", "cuda:1", "cpu"...): `dtype` when
    given, else bfloat16 on CUDA and float32 elsewhere."""
    if dtype is not None:
        return dtype
    return CUDA_DTYPE if str(device).startswith("cuda") else DEFAULT_DTYPE


@dataclass(frozen=True)
class BackboneConfig:
    """Shape of an SDAR/Qwen3 decoder plus the two block-diffusion facts it was trained with."""

    vocab_size: int = field(metadata={"help": "V, rows of the embedding and lm_head"})
    hidden_size: int = field(metadata={"help": "H"})
    num_layers: int = field(metadata={"help": "decoder layers"})
    num_heads: int = field(metadata={"help": "nh, query heads"})
    num_kv_heads: int = field(metadata={"help": "nkv, key/value heads (GQA)"})
    intermediate_size: int = field(metadata={"help": "SwiGLU inner width"})
    head_dim: int = field(default=0, metadata={"help": "hd; 0 means hidden_size // num_heads"})
    max_position_embeddings: int = field(default=32768, metadata={"help": (
        "longest sequence the model accepts")})
    rope_theta: float = field(default=1_000_000.0, metadata={"help": "RoPE base"})
    rms_norm_eps: float = field(default=1e-6, metadata={"help": "epsilon of every RMSNorm"})
    tie_word_embeddings: bool = field(default=False, metadata={"help": (
        "lm_head shares the embedding matrix")})
    block_size: int = field(default=SDAR_BLOCK_SIZE, metadata={"help": (
        "block size the model was trained with")})
    mask_token_id: int = field(default=SDAR_MASK_TOKEN_ID, metadata={"help": "id of [MASK]"})
    stop_token_ids: tuple[int, ...] = field(default=SDAR_STOP_TOKEN_IDS, metadata={"help": (
        "ids that end a generation")})
    num_experts: int = field(default=0, metadata={"help": (
        "E, experts of a sparse (MoE) layer; 0: every layer is dense")})
    num_experts_per_tok: int = field(default=0, metadata={"help": (
        "k, experts each token is routed to (MoE)")})
    moe_intermediate_size: int = field(default=0, metadata={"help": (
        "SwiGLU inner width of one expert (MoE)")})
    norm_topk_prob: bool = field(default=False, metadata={"help": (
        "renormalise the k routing weights to sum to 1 (MoE)")})
    decoder_sparse_step: int = field(default=1, metadata={"help": (
        "layer i is sparse when (i + 1) % this == 0 (MoE)")})
    mlp_only_layers: tuple[int, ...] = field(default=(), metadata={"help": (
        "layers kept dense in an MoE model")})

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "head_dim", "max_position_embeddings", "block_size",
                     "mask_token_id", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.num_experts:
            self.check_experts()

    def check_experts(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts = "
                             f"{self.num_experts}], got {self.num_experts_per_tok}")
        for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def is_moe(self) -> bool:
        """Whether any layer is sparse (an SDAR-MoE / Qwen3-MoE model)."""
        return any(self.is_sparse(layer) for layer in range(self.num_layers))

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the sparse MLP (Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode: the strategy, its block schedule, sampling and stopping."""

    mode: str = field(default="static", metadata={"help": (
        "decoding method: static, dynamic, sequential, entropy, direct, speculative (lossless: "
        "equals dynamic at --threshold, static at 1.0, greedy or seeded sampled), remask")})
    block_size: int | None = field(default=None, metadata={"help": (
        "tokens per block; None means the model's")})
    steps: int | None = field(default=None, metadata={"help": (
        "denoising steps per block; None means block_size")})
    threshold: float = field(default=0.9, metadata={"help": (
        "dynamic and remask, and the rule speculative reproduces: commit every masked position with"
        " confidence > threshold, else the most confident (1.0: static, one per step); remask keeps"
        " those the head still finds above it")})
    entropy_bound: float = field(default=0.5, metadata={"help": (
        "entropy: summed entropy (nats) of one step's commits stays <= this")})
    max_new_tokens: int = field(default=128, metadata={"help": (
        "generated tokens per prompt (before stop trimming)")})
    temperature: float = field(default=0.0, metadata={"help": "0 is greedy; > 0 samples"})
    top_k: int = field(default=0, metadata={"help": (
        "keep the k most likely tokens when sampling; 0 keeps all")})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass kept when sampling"})
    seed: int = field(default=0, metadata={"help": (
        "sampling seed; a row's draws depend on it and the row's positions only")})
    lookahead: int = field(default=3, metadata={"help": (
        "direct/speculative: MRP head steps per backbone forward (K)")})
    remask_rule: str = field(default="chain", metadata={"help": (
        "remask: chain (keep the step's reveals while the head, run on the reveals before each, "
        "still finds it above threshold), paper (the v2 paper's residual veto: send back every "
        "proposal whose |C| at its token exceeds remask_delta, the head on the block alone as the "
        "official loop)")})
    remask_delta: float = field(default=2.0, metadata={"help": (
        "δ of the paper remask rules: a proposal is vetoed when |C| at its token exceeds this")})
    adaptive: bool = field(default=True, metadata={"help": (
        "speculative: run per round the drafts (head or self) that the measured acceptance and "
        "round costs say pay most (lookahead is the most); off: always lookahead head drafts "
        "(self-drafts without a head)")})
    cost_cache: bool = field(default=True, metadata={"help": (
        "speculative, adaptive: start the planner from the round costs an earlier process "
        "measured for this model, head, device, dtype, threads and batch size (the user cache "
        "dir, mrp-dlm/costs), and save what it learns there; off: time them afresh, read and "
        "write nothing")})
    drafter: str = field(default="head", metadata={"help": (
        "speculative: head (the MRP head where one is loaded, mixed with self-drafts as adaptive "
        "chooses; without a head, self-drafts) or self (self-drafts only, the rule's steps on the "
        "seed logits: no head read or run)")})
    candidates: str = field(default="auto", metadata={"help": (
        "speculative: candidate set size verified per later draft, the draft and N - 1 "
        f"alternatives (1..{MOST_CANDIDATES}; 1: the drafts alone), or auto (the planner sizes "
        "sets from measured rates and costs)")})
    stop_token_ids: tuple[int, ...] | None = field(default=None, metadata={"help": (
        "None means the model's stop ids")})
    cuda_graphs: bool = field(default=False, metadata={"help": (
        "on CUDA: capture the backbone's block steps (denoise, each verify width, store + next) "
        "and the head's steps as CUDA graphs per batch bucket (rows padded to a power of two) "
        "and replay them; on a CPU or an MoE backbone the same steps run eager. Off until "
        "measured on a GPU")})
    logprobs: int = field(default=0, metadata={"help": (
        "return each generated token's logprob at the step that committed it and this many "
        "top alternatives there (0: off). The reference strategies and speculative only")})
    invariant_verify: str = field(default="auto", metadata={"help": (
        "run each verify copy as a lone denoise forward, so its logits equal the rule's bit "
        "for bit by construction (speculation bit-exact; costs M weight reads per verify): on, "
        "off (one batched forward: exact up to float ties), auto (on for speculative on an "
        "accelerator, off on a CPU)")})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {self.lookahead}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.block_size is not None and self.steps is not None and self.steps > self.block_size:
            raise ValueError(f"steps ({self.steps}) cannot exceed block_size ({self.block_size})")
        if self.block_size is not None:
            self.check_lookahead(self.block_size)
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.remask_rule not in REMASK_RULES:
            raise ValueError(f"unknown remask_rule {self.remask_rule!r}; choose one of "
                             f"{', '.join(REMASK_RULES)}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of "
                             f"{', '.join(DRAFTERS)}")
        if self.invariant_verify not in INVARIANT_CHOICES:
            raise ValueError(f"unknown invariant_verify {self.invariant_verify!r}; choose one of "
                             f"{', '.join(INVARIANT_CHOICES)}")
        object.__setattr__(self, "candidates", str(self.candidates).strip().lower())
        if self.candidates != "auto" and not (
                self.candidates.isdigit() and 1 <= int(self.candidates) <= MOST_CANDIDATES):
            raise ValueError(f"candidates (--candidates) must be auto or an integer in "
                             f"[1, {MOST_CANDIDATES}], got {self.candidates!r}")
        if self.remask_delta < 0:
            raise ValueError(f"remask_delta must be >= 0, got {self.remask_delta}")
        if self.entropy_bound < 0:
            raise ValueError(f"entropy_bound must be >= 0, got {self.entropy_bound}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0 or self.seed < 0:
            raise ValueError(f"top_k and seed must be >= 0, got {self.top_k} and {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.logprobs and self.mode not in LOGPROB_MODES:
            raise ValueError(f"logprobs are not returned by mode {self.mode!r} (yet): use "
                             f"one of {', '.join(LOGPROB_MODES)}")

    @property
    def set_size(self) -> int | None:
        """The fixed candidate set size (`candidates`), or None where the planner sizes sets."""
        return None if self.candidates == "auto" else int(self.candidates)

    @property
    def needs_head(self) -> bool:
        """An MRP mode that cannot run without a head (speculation self-drafts without one)."""
        return self.mode in MRP_MODES and self.mode != "speculative"

    @property
    def uses_head(self) -> bool:
        """An MRP mode that decodes with the head where one is loaded."""
        return self.mode in MRP_MODES and not (self.mode == "speculative"
                                               and self.drafter == "self")

    @property
    def vetoes(self) -> bool:
        """remask with a paper rule: the head vetoes proposals by |C| (`decoding/veto.py`)."""
        return self.mode == "remask" and self.remask_rule != "chain"

    def check_lookahead(self, block_size: int) -> None:
        """K head steps look ahead within one block: K beyond L only costs time."""
        if self.mode in _LOOKAHEAD_MODES and self.lookahead > block_size:
            raise ValueError(f"lookahead ({self.lookahead}) cannot exceed block_size "
                             f"({block_size})")

    def resolve(self, model: BackboneConfig) -> "BlockSchedule":
        """Fill the model-dependent defaults and check them against the model."""
        block_size = self.block_size or model.block_size
        steps = self.steps or block_size
        if steps > block_size:
            raise ValueError(f"steps ({steps}) cannot exceed block_size ({block_size})")
        self.check_lookahead(block_size)
        if self.mode == "speculative" and steps != block_size:
            raise ValueError("speculative decoding verifies one threshold step per forward "
                             f"(at least one token); steps must equal block_size ({block_size}) "
                             "or be unset")
        if self.vetoes and steps != block_size:
            raise ValueError("the paper remask rule reveals the dynamic rule's proposals (at "
                             "least one) until the block is full; steps must equal block_size "
                             f"({block_size}) or be unset")
        stops = model.stop_token_ids if self.stop_token_ids is None else self.stop_token_ids
        for token in stops:
            if not 0 <= token < model.vocab_size:
                raise ValueError(f"stop token id {token} is outside the vocabulary")
        return BlockSchedule(block_size=block_size, steps=steps, stop_token_ids=tuple(stops),
                             mask_token_id=model.mask_token_id)


def check_block_divides(block_size: int, trained: int, what: str) -> None:
    """A decode block must tile the block the model was trained with: a block that straddles
    two trained blocks (7 in 16), or spans several (32 in 16), lets positions attend across
    a trained block boundary, which the model never saw, and decodes nonsense silently."""
    if trained % block_size:
        divisors = [d for d in range(1, trained + 1) if trained % d == 0]
        raise ValueError(f"block size {block_size} does not divide the block size {trained} "
                         f"{what} was trained with: its blocks would cross the trained block "
                         f"boundaries; use one of {', '.join(map(str, divisors))}")


@dataclass(frozen=True)
class BlockSchedule:
    """The per-call facts of a decode after defaults are resolved against the model."""

    block_size: int = field(metadata={"help": "L, tokens per block"})
    steps: int = field(metadata={"help": "denoising steps per block"})
    stop_token_ids: tuple[int, ...] = field(metadata={"help": "ids that end a row"})
    mask_token_id: int = field(metadata={"help": "id of [MASK]"})
    quotas: tuple[int, ...] = field(init=False, metadata={"help": (
        "n_s per step: even split of L over steps")})

    def __post_init__(self) -> None:
        base, extra = divmod(self.block_size, self.steps)
        object.__setattr__(self, "quotas", tuple(base + (s < extra) for s in range(self.steps)))

    def quota(self, step: int) -> int:
        """n_s of step `step` of a block; steps past `steps` reuse the last quota."""
        return self.quotas[min(step, self.steps - 1)]


@dataclass(frozen=True)
class HeadConfig:
    """Shape of the MRP residual head; its width and layer class are the backbone's."""

    num_layers: int = field(default=2, metadata={"help": "decoder layers of the head"})
    init_std: float = field(default=0.02, metadata={"help": (
        "std of the normal init of the head's matrices")})

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {self.num_layers!r}")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")


# Backbone shapes for `mrp train backbone --preset`. The vocabulary, block size and special
# token ids come from the tokenizer and the TrainConfig, never from here.
BACKBONE_PRESETS: dict[str, dict[str, int | bool]] = {
    "tiny": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=48),
    "embedded": dict(hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=2,
                     intermediate_size=384),
    "sdar-1.7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                      intermediate_size=6144, head_dim=128, tie_word_embeddings=True),
    "sdar-4b": dict(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8,
                    intermediate_size=9728, head_dim=128),
    "sdar-8b": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                    intermediate_size=12288, head_dim=128),
    # SDAR-30B-A3B: every layer sparse, 8 of 128 experts; intermediate_size is the MRP head's
    "sdar-30b-a3b": dict(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                         intermediate_size=6144, head_dim=128, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768,
                         norm_topk_prob=True),
}


def _check_at_least_one(config: object, names: tuple[str, ...]) -> None:
    """Raise ValueError naming the first of the integer fields `names` that is below 1."""
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every training run has: output, data, schedule, optimiser, checkpoints, device.

    The training configs below extend it; a field without a default here takes each
    command's own (a backbone and a head train at different rates and lengths)."""

    out: str = field(metadata={"help": (
        "output directory: the weights, train_state.pt, train_config.json and the logs")})
    tasks: str = field(default="arith,arith-code", metadata={"help": (
        "comma-separated task names the training data comes from (without --data)")})
    data: str | None = field(default=None, metadata={"help": (
        "training data: comma-separated chat files (.jsonl, .json, .parquet), globs, datasets "
        "folders and task:NAME, each with an optional @WEIGHT (passes per epoch); None: the "
        "--tasks")})
    skip_bad_rows: bool = field(default=False, metadata={"help": (
        "skip and count data rows that are not conversations instead of failing on the first")})
    train_examples: int = field(default=50000, metadata={"help": (
        "training examples drawn from each task")})
    seq_len: int = field(default=256, metadata={"help": (
        "tokens per packed row, a multiple of the block size")})
    batch_size: int = field(default=16, metadata={"help": (
        "packed rows per optimizer step, over all processes")})
    train_steps: int = field(metadata={"help": "optimizer steps"})
    lr: float = field(metadata={"help": "peak learning rate"})
    warmup_frac: float = field(default=0.03, metadata={"help": (
        "fraction of steps with linear warmup")})
    min_lr_ratio: float = field(default=0.1, metadata={"help": (
        "the cosine decays to min_lr_ratio * lr")})
    weight_decay: float = field(metadata={"help": "AdamW decay, applied to matrices only"})
    grad_clip: float = field(default=1.0, metadata={"help": (
        "max global gradient norm; 0 disables clipping")})
    bf16: bool | None = field(default=None, metadata={"help": (
        "bfloat16 autocast where the device supports it, else float32 (head training: the frozen "
        "backbone's weights too); unset: on with a CUDA device, off elsewhere")})
    seed: int = field(default=0, metadata={"help": (
        "seeds the init, the data order and every draw of a step (all pure functions of it)")})
    log_every: int = field(default=10, metadata={"help": "steps between JSONL log lines"})
    save_every: int = field(default=250, metadata={"help": (
        "steps between checkpoints (the last step always saves)")})
    resume: bool = field(default=False, metadata={"help": "continue from the checkpoint in `out`"})
    device: str = field(default="cpu", metadata={"help": (
        "torch device: cpu, cuda or cuda:N (each process's own under torchrun)")})
    threads: int | None = field(default=None, metadata={"help": (
        "torch CPU threads per process (None or 0: chosen by model size as for inference, unless "
        "OMP_NUM_THREADS or MKL_NUM_THREADS is set)")})

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("out must name a directory")
        _check_at_least_one(self, ("train_examples", "seq_len", "batch_size", "train_steps",
                                   "log_every", "save_every"))
        if self.data is None and not self.task_names:
            raise ValueError("tasks must name at least one task")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("weight_decay", "grad_clip", "seed", "threads"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.bf16 is None:  # the dtype rule of inference: bfloat16 on CUDA
            object.__setattr__(self, "bf16", dtype_for(self.device) == "bfloat16")

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.tasks.split(",") if name.strip())


@dataclass(frozen=True, kw_only=True)
class TrainConfig(RunConfig):
    """SDAR block-diffusion training of a backbone: the run (see RunConfig) and the model."""

    preset: str = field(default="embedded", metadata={"help": (
        "model shape: tiny, embedded, sdar-1.7b, -4b, -8b or -30b-a3b")})
    model: str | None = field(default=None, metadata={"help": (
        "backbone checkpoint dir (HF format, with its tokenizer) or hub id (org/name) to train "
        "instead of a preset; None: a seeded preset")})
    block_size: int = field(default=16, metadata={"help": (
        "L, diffusion block size the model is trained for")})
    vocab_size: int = field(default=1024, metadata={"help": (
        "size of the tokenizer trained for a preset (ignored with model)")})
    train_steps: int = field(default=3000, metadata={"help": "optimizer steps"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": (
        "AdamW decay, applied to matrices only")})

    def __post_init__(self) -> None:
        if self.preset not in BACKBONE_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of "
                             f"{', '.join(BACKBONE_PRESETS)}")
        _check_at_least_one(self, ("block_size", "vocab_size"))
        if self.seq_len % self.block_size:
            raise ValueError(f"seq_len ({self.seq_len}) must be a multiple of block_size "
                             f"({self.block_size})")
        super().__post_init__()


DISTILL_FORMATS = ("jsonl", "parquet")  # output shard formats of `mrp distill`
# What `mrp distill` decodes with unless told: the rule speculative decoding reproduces.
DISTILL_DECODE = DecodeConfig(mode="dynamic", threshold=0.9)


@dataclass(frozen=True)
class DistillConfig:
    """`mrp distill`: the backbone's own answers to prompts, sharded, resumable, seeded."""

    prompts: str = field(metadata={"help": (
        "prompts in the --data syntax: chat files (the turns before the last assistant turn), "
        "globs, datasets folders, task:NAME (its train split, --limit problems)")})
    out: str = field(metadata={"help": (
        "output folder of shards: {\"id\", \"messages\"} rows, the prompt's turns and the "
        "backbone's answer")})
    batch_size: int = field(default=16, metadata={"help": (
        "prompts decoded together by each process")})
    shard_rows: int = field(default=10000, metadata={"help": "rows per output shard file"})
    output_format: str = field(default="jsonl", metadata={"help": (
        "jsonl (append-only, a row per finished prompt) or parquet (needs pyarrow; a shard written "
        "whole)")})
    limit: int | None = field(default=None, metadata={"help": (
        "the first N prompts of each source; None: all (a task source needs it)")})
    skip_bad_rows: bool = field(default=False, metadata={"help": (
        "skip and count prompt rows that are not conversations instead of failing on the first")})

    def __post_init__(self) -> None:
        if not self.prompts or not self.out:
            raise ValueError("prompts and out must name a source and a folder")
        _check_at_least_one(self, ("batch_size", "shard_rows"))
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.output_format not in DISTILL_FORMATS:
            raise ValueError(f"unknown output_format {self.output_format!r}; choose one of "
                             f"{', '.join(DISTILL_FORMATS)}")


REVEAL_RULES = ("static", "dynamic", "random")


@dataclass(frozen=True, kw_only=True)
class HeadTrainConfig(RunConfig):
    """MRP head training on a frozen backbone: the run (see RunConfig), the head, the
    objective and the held-out metrics."""

    model: str | None = field(default=None, metadata={"help": (
        "backbone checkpoint dir (HF format, with its tokenizer) or hub id (org/name); it stays "
        "frozen; None: the embedded model")})
    head_layers: int = field(default=HeadConfig.num_layers, metadata={"help": (
        "decoder layers of the head")})
    init_std: float = field(default=HeadConfig.init_std, metadata={"help": (
        "std of the normal init of the head's matrices")})
    lookahead: int = field(default=1, metadata={"help": (
        "K, chained head steps trained per batch (one reveal and teacher each)")})
    reveal_rule: str = field(default="random", metadata={"help": (
        "random: a random masked position, true token; static: the backbone's pick; dynamic: the "
        "backbone's threshold step at --threshold")})
    threshold: float = field(default=DecodeConfig.threshold, metadata={"help": (
        "τ of the dynamic reveal rule and of the commit loss's teacher step (the decoding "
        "threshold; 1.0: static)")})
    commit_weight: float = field(default=0.0, metadata={"help": (
        "weight of the commit loss: CE of the teacher's next threshold step (positions, tokens) "
        "under A + sum C")})
    burn_in_max: int = field(default=0, metadata={"help": (
        "0: chains start from SDAR-noised blocks; R > 0: from fully masked responses after 0..R of "
        "the backbone's own threshold steps per block (the states decoding visits)")})
    init_from: str | None = field(default=None, metadata={"help": (
        "head dir whose weights start a fresh run (same head_layers); None: a seeded init")})
    reveal_max: int = field(default=1, metadata={"help": (
        "reveals per block per step, drawn uniformly from 1..reveal_max")})
    block_size: int | None = field(default=None, metadata={"help": (
        "L; None means the model's")})
    eval_data: str | None = field(default=None, metadata={"help": (
        "held-out data in the --data syntax; None: the held-out split of --data (a task's test "
        "split)")})
    held_out_frac: float = field(default=0.02, metadata={"help": (
        "share of --data's file rows (by a hash of each row's id) kept out of training as the "
        "held-out split, without --eval-data")})
    eval_examples: int = field(default=128, metadata={"help": (
        "held-out examples per source (a task's test split) for the metrics")})
    eval_prompts: int = field(default=16, metadata={"help": (
        "held-out prompts decoded speculatively at each evaluation (accepted drafts per round at "
        "--threshold and --lookahead); 0: none")})
    eval_new_tokens: int = field(default=64, metadata={"help": (
        "tokens generated per held-out prompt for the acceptance metric")})
    eval_every: int = field(default=100, metadata={"help": (
        "steps between held-out evaluations (the last step always evaluates)")})
    grad_checkpointing: bool = field(default=False, metadata={"help": (
        "recompute the head's layers in the backward pass")})
    shard_backbone: bool = field(default=False, metadata={"help": (
        "under torchrun: shard the frozen backbone's layers over the processes (FSDP2); the head "
        "stays data-parallel")})
    train_steps: int = field(default=2000, metadata={"help": "optimizer steps"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": (
        "AdamW decay, applied to matrices only")})

    def __post_init__(self) -> None:
        if self.model == "":
            raise ValueError("model must name a directory")
        _check_at_least_one(self, ("head_layers", "lookahead", "reveal_max", "eval_examples",
                                   "eval_new_tokens", "eval_every"))
        if self.reveal_rule not in REVEAL_RULES:
            raise ValueError(f"unknown reveal_rule {self.reveal_rule!r}; choose one of "
                             f"{', '.join(REVEAL_RULES)}")
        if self.block_size is not None and (self.block_size < 1 or self.seq_len % self.block_size):
            raise ValueError(f"block_size ({self.block_size}) must be >= 1 and divide seq_len "
                             f"({self.seq_len})")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        if not 0.0 <= self.held_out_frac < 1.0 or self.eval_prompts < 0:
            raise ValueError(f"held_out_frac must be in [0, 1) and eval_prompts >= 0, got "
                             f"{self.held_out_frac} and {self.eval_prompts}")
        if not 0 < self.threshold <= 1 or self.commit_weight < 0 or self.burn_in_max < 0:
            raise ValueError(f"threshold must be in (0, 1], commit_weight and burn_in_max "
                             f">= 0, got {self.threshold}, {self.commit_weight} and "
                             f"{self.burn_in_max}")
        super().__post_init__()
