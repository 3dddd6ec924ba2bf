"""The lm-evaluation-harness model `mrp`: lm-eval's generation requests decoded by a Pipeline.

    python -m mrp_dlm.eval.harness --model mrp \\
        --model_args pretrained=DIR,head=HEAD,mode=speculative,lookahead=3,threshold=0.9 \\
        --tasks gsm8k --apply_chat_template --batch_size 16 --device cuda

Model args: `pretrained` (a checkpoint directory, hub id or `embedded`, the default),
`head`, `revision`, `head_revision`, `dtype` (unset: bfloat16 on CUDA, float32 elsewhere),
`mask_token_id`, `threads` and every scalar field of `DecodeConfig`. A request's own
generation settings override `max_new_tokens`, `temperature`, `top_k` and `top_p` for that
request; requests with equal settings are decoded `batch_size` at a time in request order,
as `mrp eval` batches them.

Why a module to run: lm-eval 0.4.x resolves `--model NAME` only in its registry, so
importing this module registers `MrpLM` as "mrp" and `python -m` then runs lm-eval's own
command line (adding `pretrained=embedded` when no checkpoint is named). The full story,
the model args table and the request settings: docs/evaluation.md, "lm-evaluation-harness".

Deliberately not here: decoding (`Pipeline`), log-likelihoods (see `LOGLIKELIHOOD_ERROR`),
data-parallel ranks, and lm-eval's `--batch_size auto` (a block-diffusion batch's memory
is set by its prompts and max_new_tokens, not probed).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.eval.runner import check_config
from mrp_dlm.flags import scalar_type
from mrp_dlm.model.device import unavailable_reason
from mrp_dlm.model.loading import DEFAULT_DEVICE
from mrp_dlm.pipeline import Pipeline

try:
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as error:  # the extra is optional; say how to get it
    raise ImportError("the lm-evaluation-harness model needs lm-eval: "
                      "pip install 'mrp-dlm[lmeval]'") from error

log = logging.getLogger(__name__)

MODEL_NAME = "mrp"  # the name `--model` takes
# pretrained=embedded: the shipped model. lm-eval names --output_path's folder after
# `pretrained` (and picks a random name without one), so `main` fills this in.
EMBEDDED_NAME = "embedded"
MODEL_FLAGS = ("--model", "-M")  # lm-eval's spellings of these flags
MODEL_ARGS_FLAGS = ("--model_args", "-a")
LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # what lm_eval's command line passes without --device
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
LOGLIKELIHOOD_ERROR = (
    "the mrp model cannot score {kind} requests: a block-diffusion model has no cheap "
    "left-to-right likelihood (it denoises a block of masked positions at once, so "
    "p(continuation | context) is not a product of next-token probabilities, and scoring "
    "it would take one forward per token or a Monte Carlo bound). Use generate_until tasks "
    "(gsm8k, minerva_math, humaneval, mbpp, ...; `lm_eval ls tasks` shows each task's "
    "output type).")


@dataclass(frozen=True)
class Generation:
    """How one request is decoded, and the strings its text is cut at."""

    config: DecodeConfig  # the model args' decode config with the request's settings
    until: tuple[str, ...]  # the text ends before the first of these (none: uncut)


def decode_arg_types() -> dict[str, type]:
    """DecodeConfig's scalar fields (the ones a model arg can set) and their types."""
    fields = {spec.name: scalar_type(str(spec.type)) for spec in dataclasses.fields(DecodeConfig)}
    return {name: kind for name, kind in fields.items() if kind is not None}


def cast_arg(name: str, value: object, kind: type) -> object:
    """`value` as `kind` (lm-eval typed it from the text already: 3 -> int, 0.9 -> float)."""
    if value is None or (kind is float and type(value) is int):
        return None if value is None else float(value)
    if type(value) is not kind:
        raise ValueError(f"model arg {name}={value!r} must be a {kind.__name__}")
    return value


def decode_config(args: dict[str, object]) -> DecodeConfig:
    """The decode config the model args name (DecodeConfig's defaults for the rest)."""
    types = decode_arg_types()
    unknown = sorted(set(args) - set(types))
    if unknown:
        raise ValueError(f"unknown model arg(s) {', '.join(unknown)}; the mrp model takes "
                         f"pretrained, head, revision, head_revision, dtype, device, "
                         f"mask_token_id, threads, batch_size and {', '.join(types)}")
    return DecodeConfig(**{name: cast_arg(name, value, types[name])
                           for name, value in args.items()})


def generation_of(base: DecodeConfig, gen_kwargs: dict) -> Generation:
    """A request's settings: `base` with its max_gen_toks / sampling values, its stops."""
    unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
    if unknown:
        raise ValueError(f"unsupported generation setting(s) {', '.join(unknown)}; the mrp "
                         f"model takes {', '.join(GEN_KWARGS)}")
    until = gen_kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    changes = {name: gen_kwargs[name] for name in ("temperature", "top_k", "top_p")
               if name in gen_kwargs}
    if "max_gen_toks" in gen_kwargs:
        changes["max_new_tokens"] = int(gen_kwargs["max_gen_toks"])
    if gen_kwargs.get("do_sample") is False:
        changes["temperature"] = 0.0
    config = dataclasses.replace(base, **changes)
    if gen_kwargs.get("do_sample") and config.temperature == 0:
        raise ValueError("do_sample=True needs temperature > 0 (in the task's "
                         "generation_kwargs, --gen_kwargs or the model args)")
    return Generation(config, until)


def cut_at_stops(text: str, until: tuple[str, ...]) -> str:
    """`text` up to the first occurrence of any stop string (empty ones are ignored)."""
    ends = [text.find(stop) for stop in until if stop and stop in text]
    return text[:min(ends)] if ends else text


def plan_batches(generations: list[Generation], batch_size: int) -> list[list[int]]:
    """Request indices per decode call: equal settings together, in request order,
    `batch_size` at a time."""
    groups: dict[Generation, list[int]] = {}
    for index, generation in enumerate(generations):
        groups.setdefault(generation, []).append(index)
    return [indices[start:start + batch_size] for indices in groups.values()
            for start in range(0, len(indices), batch_size)]


def batch_size_of(value: int | str) -> int:
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"batch_size must be a whole number >= 1 (lm-eval's 'auto' is not "
                         f"supported), got {value!r}")
    return int(text)


def device_of(name: str | None) -> str:
    """The device to load on: lm_eval's own default (cuda:0) falls back to the CPU when
    this machine has no CUDA device, as lm-eval's hf model does; any other name is kept
    (Pipeline.load rejects one this machine lacks)."""
    if name is None:
        return DEFAULT_DEVICE
    if name == LM_EVAL_DEFAULT_DEVICE and unavailable_reason(torch.device(name)) is not None:
        log.warning("device %s (lm_eval's default when --device is not given) is not "
                    "available; using %s", name, DEFAULT_DEVICE)
        return DEFAULT_DEVICE
    return name


@register_model(MODEL_NAME)
class MrpLM(LM):
    """lm-eval's LM interface over a Pipeline: generate_until only."""

    def __init__(self, pretrained: str = EMBEDDED_NAME, head: str | None = None,
                 dtype: str | None = None, device: str | None = None,
                 mask_token_id: int | None = None, threads: int | None = None,
                 batch_size: int | str = 1, max_batch_size: int | None = None,
                 revision: str | None = None, head_revision: str | None = None,
                 **decode_args: object) -> None:
        super().__init__()
        if max_batch_size is not None:
            raise ValueError("max_batch_size only bounds lm-eval's batch_size auto, which the "
                             "mrp model does not support; give --batch_size N")
        self.config = decode_config(decode_args)  # the decode every request starts from
        self.batch_size = batch_size_of(batch_size)
        directory = None if pretrained == EMBEDDED_NAME else pretrained  # None: embedded
        self.pipe = Pipeline.load(directory, dtype, device_of(device), mask_token_id,
                                  self.config.block_size, head, threads, revision, head_revision)
        if self.pipe.tokenizer is None:
            raise ValueError(f"{self.pipe.directory} has no tokenizer; lm-eval sends text")
        check_config(self.pipe, self.config)
        self._device = self.pipe.model.lm_head.weight.device
        self.stats = DecodeStats()  # summed over every generate_until call

    @property
    def tokenizer_name(self) -> str:
        """Names the chat template in lm-eval's request cache keys."""
        return str(self.pipe.directory.resolve()).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if isinstance(chat_template, str):
            raise ValueError("a checkpoint here has one chat template; give "
                             "--apply_chat_template without a name")
        return self.pipe.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.pipe.tokenizer.render_messages(chat_history, add_generation_prompt)

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError(LOGLIKELIHOOD_ERROR.format(kind="loglikelihood"))

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        raise NotImplementedError(LOGLIKELIHOOD_ERROR.format(kind="loglikelihood_rolling"))

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's (context, gen_kwargs) decoded; texts in request order."""
        contexts = [request.args[0] for request in requests]
        generations = [generation_of(self.config, request.args[1]) for request in requests]
        texts: list[str] = [""] * len(requests)
        stats = DecodeStats()
        with tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                  desc=f"{MODEL_NAME} generate_until") as bar:
            for batch in plan_batches(generations, self.batch_size):
                generation = generations[batch[0]]
                out = self.pipe.generate([contexts[i] for i in batch], generation.config)
                stats = stats + out.stats
                for index, text in zip(batch, out.texts):
                    texts[index] = cut_at_stops(text, generation.until)
                    self.cache_hook.add_partial("generate_until", requests[index].args,
                                                texts[index])
                bar.update(len(batch))
        self.stats = self.stats + stats
        log.info("%s: %d requests, %d tokens, %.2f tokens per forward, %.1f tokens/s",
                 MODEL_NAME, len(requests), stats.tokens, stats.tokens_per_forward,
                 stats.tokens_per_second)
        return texts


def flag_values(argv: list[str], flags: tuple[str, ...]) -> list[tuple[int, str]]:
    """(index, text) of each value given to any of `flags`: `--flag=v`, or the words after
    `--flag` up to the next option (lm-eval 0.4.13 takes several, older releases one)."""
    found, taking = [], False
    for index, token in enumerate(argv):
        name, equals, value = token.partition("=")
        if token.startswith("-"):
            taking = token in flags
            if name in flags and equals:
                found.append((index, value))
        elif taking:
            found.append((index, token))
    return found


def name_the_model(argv: list[str]) -> list[str]:
    """lm-eval's arguments with `pretrained=embedded` added to the mrp model's args when they
    name no checkpoint, so `--output_path DIR` writes to DIR/embedded/ and not to a folder
    of a random name. Left as they are: another model, a `--config` file (its model args
    are not read here) and model args given as JSON."""
    models = flag_values(argv, MODEL_FLAGS)
    if [value for _, value in models] != [MODEL_NAME] or flag_values(argv, ("--config", "-C")):
        return argv
    found = flag_values(argv, MODEL_ARGS_FLAGS)
    keys = {item.partition("=")[0].strip() for _, value in found for item in value.split(",")}
    if "pretrained" in keys or any(value.lstrip().startswith("{") for _, value in found):
        return argv
    named = f"pretrained={EMBEDDED_NAME}"
    if not found:
        return [*argv, MODEL_ARGS_FLAGS[0], named]
    index, value = found[0]
    token = argv[index]  # the value itself, or `--model_args=value`
    return [*argv[:index], f"{token},{named}" if value else f"{token}{named}", *argv[index + 1:]]


def main() -> None:
    """lm-eval's command line, with `--model mrp` registered (this module's import did it)
    and the embedded model named (`name_the_model`)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[1:] = name_the_model(sys.argv[1:])
    cli_evaluate()


if __name__ == "__main__":
    main()
