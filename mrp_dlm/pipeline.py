"""The user-facing API: a checkpoint's model and tokenizer, text in, text and stats out.

    pipe = Pipeline.load("path/to/checkpoint")          # or Pipeline.load() for the embedded model
    out = pipe.generate(["What is 2 + 3?"], DecodeConfig(mode="static"), chat=True)
    out.texts[0], out.token_ids[0], out.stats.tokens_per_forward

Deliberately not here: argument parsing (see `cli.py`) and decoding internals.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from mrp_dlm.config import DecodeConfig, check_block_divides, dtype_for
from mrp_dlm.decoding.cost_cache import (CostCache, Learnt, cost_identity, default_dir,
                                         rule_key)
from mrp_dlm.decoding.driver import Decoder, generate
from mrp_dlm.decoding.logprobs import TokenLogprob
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.decoding.speculative import SpeculativeDecoder
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.hub import resolve_checkpoint
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.loading import (DEFAULT_DEVICE, DTYPES, embedded_head_dir, embedded_model_dir,
                                   load_backbone, load_head)
from mrp_dlm.model.release import check_head_tensors, is_release_dir
from mrp_dlm.model.tokenizer import TextTokenizer, check_utf8, load_tokenizer
from mrp_dlm.threads import set_inference_threads

__all__ = ["GenerateOutput", "Pipeline", "embedded_head_dir", "embedded_model_dir"]


def _locate(directory: str | Path | None, revision: str | None, head: str | Path | None,
           head_revision: str | None) -> tuple[Path, Path | None]:
    """The model's local directory (the embedded model's for None) and the head's (None when
    not given), each a directory or a hub id at its revision (`hub.py`)."""
    if directory is None and revision is not None:
        raise ValueError(f"a revision ({revision}) needs a hub id as the model")
    if head is None and head_revision is not None:
        raise ValueError(f"a head revision ({head_revision}) needs a hub id as the head")
    path = resolve_checkpoint(directory, revision) if directory is not None \
        else embedded_model_dir()
    if directory is None and not (path / "config.json").is_file():
        raise FileNotFoundError("no --model given and this install has no embedded model")
    return path, None if head is None else resolve_checkpoint(head, head_revision, "head")


@dataclass
class GenerateOutput:
    texts: list[str] | None  # decoded generations, special tokens removed (None: the
    # checkpoint has no tokenizer; `generate_ids` still returns the ids)
    token_ids: list[list[int]]  # generated ids, trimmed after the first stop id
    stats: DecodeStats  # cost of the whole batch
    logprobs: list[list[TokenLogprob]] | None = None  # per output token, with
    # DecodeConfig.logprobs > 0 (`decoding/logprobs.py`)


@dataclass
class Pipeline:
    model: Backbone
    tokenizer: TextTokenizer | None
    directory: Path
    head_dir: Path | None = None  # MRP head checkpoint, read when a mode first needs the head
    decoders: dict[DecodeConfig, Decoder] = field(default_factory=dict, repr=False)  # by config
    cost_dir: Path | None = None  # the round cost cache's folder; None: `cost_cache.default_dir`
    cost_caches: dict[DecodeConfig, CostCache] = field(default_factory=dict, repr=False)

    def decoder(self, config: DecodeConfig) -> Decoder:
        """The decoder of `config`, made once: an adaptive speculative decoder carries what it
        measured (acceptance, round costs) from one call to the next. A block size that does
        not tile the model's is refused here, for the user; the driver itself takes any (its
        tests decode random tiny models at other sizes)."""
        if config.block_size is not None:
            check_block_divides(config.block_size, self.model.config.block_size,
                                str(self.directory))
        if config not in self.decoders:
            self.decoders[config] = make_decoder(config, self.head_for(config))
            self.start_costs(config, self.decoders[config])
        return self.decoders[config]

    def start_costs(self, config: DecodeConfig, decoder: Decoder) -> None:
        """An adaptive speculative decoder's planner starts from the round costs cached for
        this model, head, device, dtype and threads (`cost_cache.py`), unless `cost_cache`
        is off."""
        if not (isinstance(decoder, SpeculativeDecoder) and config.adaptive
                and config.cost_cache):
            return
        settings = {"block_size": config.block_size or self.model.config.block_size,
                    "lookahead": config.lookahead, "invariant_verify": config.invariant_verify,
                    "cuda_graphs": config.cuda_graphs}
        rule = rule_key(config.threshold, config.temperature, config.top_k, config.top_p)
        cache = CostCache(self.cost_dir or default_dir(),
                          cost_identity(self.model, decoder.head, settings), rule)
        planner = decoder.planner
        learnt = cache.load(planner.lookahead, planner.sources[0])
        planner.start_from(learnt.costs, learnt.probes, learnt.acceptance)
        self.cost_caches[config] = cache

    def save_costs(self, config: DecodeConfig) -> None:
        """What the planner of `config` learnt, to its cost cache (at the end of a call)."""
        cache = self.cost_caches.get(config)
        decoder = self.decoders.get(config)
        if cache is not None and isinstance(decoder, SpeculativeDecoder):
            planner = decoder.planner
            cache.save(Learnt(dict(planner.costs), dict(planner.probes),
                              {source: known for source, known
                               in planner.acceptance.items() if any(known.tried)}))

    @property
    def dtype(self) -> str:
        """The dtype name the model runs in (a DTYPE_NAMES entry)."""
        return str(self.model.lm_head.weight.dtype).removeprefix("torch.")

    @functools.cached_property
    def head(self) -> MRPHead | None:
        """The MRP head, read on first use: only the MRP modes load it, so a head that does
        not fit (trained for another block size, say) never stops the other modes."""
        return None if self.head_dir is None else load_head(self.head_dir, self.model)

    def head_for(self, config: DecodeConfig) -> MRPHead | None:
        """The head `config` decodes with; None for the modes that use none (and for
        speculation with self-drafts only, which never reads it)."""
        return self.head if config.uses_head else None

    @classmethod
    def load(cls, directory: str | Path | None = None, dtype: str | None = None,
             device: str = DEFAULT_DEVICE, mask_token_id: int | None = None,
             block_size: int | None = None, head: str | Path | None = None,
             threads: int | None = None, revision: str | None = None,
             head_revision: str | None = None,
             cost_dir: str | Path | None = None) -> "Pipeline":
        """Load a checkpoint directory or hub id (`hub.py`, at `revision`); None means the
        embedded model (and its head). A directory in the published MRP layout
        (`release.py`) brings its own head.

        The head (a directory or hub id, at `head_revision`) is only located here; it is
        read when an MRP mode first decodes.
        dtype: a DTYPE_NAMES entry; None: bfloat16 on a CUDA device, float32 elsewhere
        (`config.dtype_for`).
        threads: torch's CPU threads; None or 0 chooses by the model's size (`threads.py`).
        cost_dir: where speculative decoders remember their round costs (`cost_cache.py`);
        None: the user cache dir.
        """
        dtype = dtype_for(device, dtype)
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        path, head = _locate(directory, revision, head, head_revision)
        model = load_backbone(path, DTYPES[dtype], device, mask_token_id, block_size)
        set_inference_threads(model, device, threads)
        if head is None and directory is None and (embedded_head_dir() / "config.json").is_file():
            head = embedded_head_dir()
        if head is None and is_release_dir(path):  # a release holds its head beside the backbone
            check_head_tensors(path, model)  # whole, though only the MRP modes read it
            head = path
        return cls(model=model, tokenizer=load_tokenizer(path), directory=path,
                   head_dir=Path(head) if head is not None else None,
                   cost_dir=Path(cost_dir) if cost_dir is not None else None)

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.directory} has no tokenizer; pass token ids instead")
        if not prompt:
            raise ValueError("the prompt is empty")
        check_utf8(prompt, "the prompt")
        return self.tokenizer.encode(self.tokenizer.render_chat(prompt) if chat else prompt)

    def generate(self, prompts: list[str], config: DecodeConfig,
                 chat: bool = False) -> GenerateOutput:
        return self.generate_ids([self.encode(prompt, chat) for prompt in prompts], config)

    def generate_ids(self, prompts: list[list[int]], config: DecodeConfig) -> GenerateOutput:
        """Decode already tokenized prompts (a rendered conversation, say); `texts` is None
        when the checkpoint has no tokenizer."""
        result = generate(self.model, prompts, config, self.decoder(config))
        self.save_costs(config)
        texts = (None if self.tokenizer is None
                 else [self.tokenizer.decode(row) for row in result.token_ids])
        return GenerateOutput(texts=texts, token_ids=result.token_ids, stats=result.stats,
                              logprobs=result.logprobs)
