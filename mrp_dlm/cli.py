"""`mrp`: argparse -> configs -> calls. No logic of its own; the only module that prints.

Imports at the top stay light (no torch): `mrp --help` and argument errors answer in well
under a second; each command imports what it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path

from mrp_dlm.config import (CUDA_DTYPE, DEFAULT_DEVICE, DEFAULT_DTYPE, DISTILL_DECODE,
                            DTYPE_NAMES, DecodeConfig, DistillConfig, HeadTrainConfig,
                            TrainConfig)
from mrp_dlm.eval.defaults import BENCH_BATCH_SIZE, DEMO_PROBLEMS, EVAL_BATCH_SIZE
from mrp_dlm.eval.grid import BASELINE, DEFAULT_GRID, VALUE_FIELDS, grid_label, parse_grid
from mrp_dlm.eval.pareto import PARETO_BATCH_SIZE
from mrp_dlm.flags import add_dataclass_flags, build_dataclass
from mrp_dlm.serving.serve_config import ServeConfig
from mrp_dlm.tasks.registry import TASK_NAMES


def add_revision_flags(parser: argparse.ArgumentParser) -> None:
    """--revision and --head-revision: a hub id's branch, tag or commit (hub.py)."""
    parser.add_argument("--revision", default=None,
                        help="branch, tag or commit of a hub id --model (default: main)")
    parser.add_argument("--head-revision", default=None,
                        help="branch, tag or commit of a hub id --head (default: main)")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (HF format) or hub id (org/name, fetched "
                             "into the HF_HOME cache); default: the embedded model")
    add_revision_flags(parser)
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPE_NAMES),
                        help=f"weights and activations dtype (default: {CUDA_DTYPE} on a CUDA "
                             f"device, {DEFAULT_DTYPE} elsewhere)")
    parser.add_argument("--device", default=DEFAULT_DEVICE,
                        help=f"torch device (default: {DEFAULT_DEVICE})")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="override the mask token id of the checkpoint")
    parser.add_argument("--head", default=None,
                        help="MRP head directory or hub id for the direct, speculative and "
                             "remask modes (default: the embedded head with the embedded model)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default or 0: chosen by model size, unless "
                             "OMP_NUM_THREADS or MKL_NUM_THREADS is set)")


def load_pipeline(args: argparse.Namespace, block_size: int | None):
    from mrp_dlm.pipeline import Pipeline

    return Pipeline.load(args.model, args.dtype, args.device, args.mask_token_id, block_size,
                         args.head, args.threads, args.revision, args.head_revision)


def check_before_load(args: argparse.Namespace, config: DecodeConfig) -> None:
    """What needs no weights, checked before they load: --threads, and `config` against the
    model's config.json (a lookahead beyond its block, say) when --model names a local
    directory or is left out (the load itself reports any other --model)."""
    if args.threads is not None and args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0: chosen by model size), got {args.threads}")
    from mrp_dlm.model.loading import embedded_model_dir, read_config

    directory = Path(args.model) if args.model is not None else embedded_model_dir()
    if (directory / "config.json").is_file():
        config.resolve(read_config(directory, args.mask_token_id))


def cmd_generate(args: argparse.Namespace, decode_fields: list[str]) -> int:
    config = build_dataclass(DecodeConfig, args, decode_fields)
    check_before_load(args, config)
    pipe = load_pipeline(args, config.block_size)
    out = pipe.generate([args.prompt], config, chat=args.chat)
    stats = out.stats
    if args.json:
        logprobs = {} if out.logprobs is None else {
            "logprobs": [token.to_dict() for token in out.logprobs[0]]}
        print(json.dumps({"text": out.texts[0], "token_ids": out.token_ids[0],
                          "stats": stats.to_dict(), **logprobs}))
    else:
        print(out.texts[0])
        print(f"[{stats.tokens} tokens, {stats.backbone_forwards} backbone forwards, "
              f"{stats.tokens_per_forward:.2f} tokens/forward, {stats.seconds:.2f} s]",
              file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mrp_dlm.files import check_fresh_out
    from mrp_dlm.model.release import export_release
    from mrp_dlm.pipeline import Pipeline

    out = Path(args.out)
    check_fresh_out(out, args.force)
    pipe = Pipeline.load(args.model, args.dtype, head=args.head, revision=args.revision,
                         head_revision=args.head_revision)
    if pipe.head is None:
        raise ValueError(f"{pipe.directory} has no MRP head to export with it: give --head DIR")
    export_release(pipe.model, pipe.head, out, pipe.directory)
    print(f"wrote {pipe.directory} and its head {pipe.head_dir} in the published MRP layout "
          f"to {out}")
    return 0


def add_export_parser(commands) -> None:
    export = commands.add_parser(
        "export", help="write a backbone and its MRP head in the published MRP layout",
        description="Write a backbone and its MRP head as one directory in the layout of the "
                    "official MRP releases (SDARMRPForCausalLM): config.json, model.safetensors "
                    "and the tokenizer files. Default: the embedded model and its head.")
    export.add_argument("--model", default=None,
                        help="checkpoint directory (HF format or a release) or hub id; default: "
                             "the embedded model")
    export.add_argument("--head", default=None,
                        help="MRP head directory or hub id (default: the embedded head with the "
                             "embedded model, a release's own head with a release)")
    add_revision_flags(export)
    export.add_argument("--out", required=True, help="output directory (empty or new)")
    export.add_argument("--dtype", default=DEFAULT_DTYPE, choices=sorted(DTYPE_NAMES),
                        help=f"dtype of the written weights (default: {DEFAULT_DTYPE})")
    export.add_argument("--force", action="store_true",
                        help="write into a non-empty --out, replacing the files it writes")


def training_log():
    """Training logs its threads, where it resumed from and each save at INFO: show them,
    above the bar."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    for name in ("mrp_dlm.training", "mrp_dlm.threads"):
        logging.getLogger(name).setLevel(logging.INFO)
    return logging_redirect_tqdm()


def cmd_train_backbone(args: argparse.Namespace, train_fields: list[str]) -> int:
    config = build_dataclass(TrainConfig, args, train_fields)
    print(f"mrp train backbone: preset {config.preset}, {config.train_steps} steps, into "
          f"{config.out}; loading torch", file=sys.stderr, flush=True)  # torch is slow to import
    from mrp_dlm.training.loop import train_backbone

    with training_log():
        out = train_backbone(config)
    print(f"checkpoint written to {out}")
    return 0


def cmd_train_head(args: argparse.Namespace, train_fields: list[str]) -> int:
    config = build_dataclass(HeadTrainConfig, args, train_fields)
    print(f"mrp train head: on {config.model or 'the embedded model'}, {config.train_steps} steps, "
          f"into {config.out}; loading torch", file=sys.stderr, flush=True)
    from mrp_dlm.training.head_loop import train_head

    with training_log():
        out = train_head(config)
    print(f"head written to {out}")
    return 0


def cmd_distill(args: argparse.Namespace, distill_fields: list[str],
                decode_fields: list[str]) -> int:
    config = build_dataclass(DistillConfig, args, distill_fields)
    decode = build_dataclass(DecodeConfig, args, decode_fields, base=DISTILL_DECODE)
    print(f"mrp distill: {config.prompts} with {grid_label(decode)}, into {config.out}; "
          "loading torch", file=sys.stderr, flush=True)
    from mrp_dlm.distill import distill_in_world
    from mrp_dlm.pipeline import Pipeline

    check_before_load(args, decode)

    def load(device: str) -> Pipeline:
        return Pipeline.load(args.model, args.dtype, device, args.mask_token_id,
                             decode.block_size, args.head, args.threads, args.revision,
                             args.head_revision)

    report = distill_in_world(config, decode, load, args.device)
    rate = report.tokens / report.seconds if report.seconds else 0.0
    print(f"answered {report.written} prompts ({report.tokens} tokens, {rate:.0f} tokens/s) on "
          f"rank {report.rank}; {report.skipped} already done, {report.bad} bad rows skipped; "
          f"output in {config.out}")
    return 0


def add_distill_parser(commands) -> dict[str, list[str]]:
    """`mrp distill`; returns its DistillConfig and DecodeConfig flag names."""
    distill = commands.add_parser(
        "distill", help="answer prompts with the backbone itself: the data heads train on",
        description="Decode every prompt of --prompts with the backbone (default: dynamic at "
                    "threshold 0.9, the rule speculative decoding reproduces) and write "
                    "{id, messages} rows into shards in --out, which --data reads back. "
                    "Resumable (finished ids are skipped) and data-parallel under torchrun.")
    add_model_flags(distill)
    names = {"distill": add_dataclass_flags(distill, DistillConfig)}
    names["distill decode"] = add_dataclass_flags(distill, DecodeConfig,
                                                  skip=("stop_token_ids",), base=DISTILL_DECODE)
    return names


def cmd_demo(args: argparse.Namespace, names: list[str]) -> int:
    from mrp_dlm.eval.demo import run_demo
    from mrp_dlm.eval.demo_table import demo_json, demo_text

    check_positive(args, "problems")
    base = build_dataclass(DecodeConfig, args, names)  # only --candidates: the rows are fixed
    check_before_load(args, base)
    pipe = load_pipeline(args, None)
    print(f"mrp demo: {pipe.directory}, {args.problems} held-out problems per task")
    report = run_demo(pipe, args.problems, progress=True, candidates=base.candidates)
    print(demo_text(report))
    if args.json:
        print(json.dumps(demo_json(report)))
    return 0


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Integer flags that must be >= 1 when given (before any model loads, to fail fast)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def cmd_eval(args: argparse.Namespace, decode_fields: list[str]) -> int:
    from mrp_dlm.eval.provenance import source_of
    from mrp_dlm.eval.runner import evaluate_to_dir, load_examples
    from mrp_dlm.eval.store import (SAMPLES_FILE, SUMMARY_FILE, RunDir, RunIdentity,
                                    check_covered)

    config = build_dataclass(DecodeConfig, args, decode_fields)
    check_positive(args, "limit", "batch_size")
    out = Path(args.out)
    task, examples = load_examples(args.task, args.data, args.limit, out)
    check_covered(out, [example.uid for example in examples])  # before the model loads
    check_before_load(args, config)
    pipe = load_pipeline(args, config.block_size)
    run = RunDir(out, RunIdentity(**source_of(task.name, args.data, pipe, pipe.dtype),
                                  config=config))
    summary = evaluate_to_dir(pipe, task, examples, run, args.batch_size, progress=True)
    stats = summary["stats"]
    print(f"{task.name} {grid_label(config)}: {summary['correct']}/{summary['n']} correct "
          f"({100 * summary['accuracy']:.1f}%), {summary['decoded']} decoded now, "
          f"{stats['tokens_per_forward']:.2f} tokens/forward, {stats['tokens_per_second']:.1f} "
          f"tokens/s; wrote {out / SAMPLES_FILE} and {out / SUMMARY_FILE}")
    print(json.dumps(summary))
    return 0


def bench_defaults(args: argparse.Namespace) -> None:
    """--grid and --batch-size left unset: the Pareto sweep's with --pareto, else the bench's."""
    if args.batch_size is None:
        args.batch_size = PARETO_BATCH_SIZE if args.pareto else BENCH_BATCH_SIZE
    if args.grid is None and not args.pareto:
        args.grid = DEFAULT_GRID


def cmd_bench(args: argparse.Namespace, decode_fields: list[str]) -> int:
    from mrp_dlm.eval import bench, pareto
    from mrp_dlm.eval.provenance import source_of
    from mrp_dlm.eval.runner import load_examples
    from mrp_dlm.files import check_fresh_out

    bench_defaults(args)
    base = build_dataclass(DecodeConfig, args, decode_fields)
    configs = None if args.grid is None else parse_grid(args.grid, base)  # fails first
    check_positive(args, "limit", "batch_size")
    task, examples = load_examples(args.task, args.data, args.limit, Path(args.out))
    check_fresh_out(Path(args.out), args.force)  # bench.json, bench.md and the plots
    check_before_load(args, base)
    pipe = load_pipeline(args, base.block_size)
    configs, dropped = bench.grid_for(pipe, base, configs)
    if dropped:
        print(f"note: no MRP head (give --head DIR), so {', '.join(dropped)} are left out")
    setup = dict(source_of(task.name, args.data, pipe, pipe.dtype), device=args.device,
                 n=len(examples), batch_size=args.batch_size)
    report, paths = bench.bench_to_dir(pipe, (task, examples), configs, args.batch_size, setup,
                                       Path(args.out))
    rows = report["rows"]
    print(pareto.markdown(rows) if args.pareto else bench.markdown(rows))
    for row in bench.lossless_violations(rows):
        print(f"WARNING: {row['label']} is lossless by construction ({row['exactness']}) but "
              f"differs from {row['reproduces']} on {row['differing_from_rule']} of {row['n']} "
              "problems")
    print("wrote " + ", ".join(str(path) for path in paths))
    if args.json:  # the whole report (8 KB for the default grid) is also in bench.json
        print(json.dumps(report))
    return 0


def cmd_serve(args: argparse.Namespace, serve_fields: list[str]) -> int:
    from mrp_dlm.serving.process import serve

    config = build_dataclass(ServeConfig, args, serve_fields)
    extra = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
    code = serve(config, extra, lambda text: print(text, flush=True))
    if code:
        print(f"mrp: error: the SGLang server exited with code {code}", file=sys.stderr)
    return code


def add_serve_parser(commands) -> list[str]:
    """`mrp serve`; returns its ServeConfig flag names."""
    serve = commands.add_parser(
        "serve", help="serve a checkpoint through SGLang (OpenAI API on 127.0.0.1)",
        description="Serve a checkpoint (default: the embedded model and its MRP head) "
                    "through SGLang with its OpenAI-compatible API on 127.0.0.1; the flags "
                    "SGLang needs (device, dtype, KV pool, algorithm YAML) are chosen here. "
                    "Ctrl-C stops it. Needs the sglang extra (docs/serving.md).")
    fields = add_dataclass_flags(serve, ServeConfig)
    serve.add_argument("sglang_args", nargs=argparse.REMAINDER,
                       help="after --: more SGLang server flags, e.g. -- --enable-metrics")
    return fields


def add_task_flags(parser: argparse.ArgumentParser, batch_size: int | None,
                   batch_help: str = "") -> None:
    """--task, --data, --limit, --batch-size and --out of `mrp eval` and `mrp bench`."""
    parser.add_argument("--task", required=True, choices=TASK_NAMES, help="benchmark task")
    parser.add_argument("--data", default=None,
                        help="the task's data file (JSONL; see docs/evaluation.md)")
    parser.add_argument("--limit", type=int, default=None,
                        help="first N test problems (default: all)")
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help=f"prompts per decode call (default: {batch_help or batch_size})")
    parser.add_argument("--out", required=True, help="output directory")


def add_eval_parsers(commands) -> dict[str, list[str]]:
    """`mrp eval` and `mrp bench`; returns their DecodeConfig flag names."""
    evaluation = commands.add_parser("eval", help="decode and grade a benchmark; resumable")
    add_model_flags(evaluation)
    add_task_flags(evaluation, EVAL_BATCH_SIZE)
    eval_fields = add_dataclass_flags(evaluation, DecodeConfig, skip=("stop_token_ids",))

    grid = commands.add_parser("bench", help="a grid of modes on one task, ratios against static")
    add_model_flags(grid)
    add_task_flags(grid, None, f"{BENCH_BATCH_SIZE}; {PARETO_BATCH_SIZE} with --pareto")
    grid.add_argument("--pareto", action="store_true",
                      help="judge every mode at matched speed: the default grid becomes the "
                           "Pareto sweeps (dynamic over τ, direct over K, the chain remask rule "
                           "over τ, the paper rule over τ at several δ, entropy over its bound, "
                           "speculative:3@0.9; eval/pareto.py), the default "
                           f"batch size {PARETO_BATCH_SIZE}, and the printed table each row "
                           "against the head-free frontier (dynamic) at its own speed")
    grid.add_argument("--grid", default=None,
                      help="comma-separated mode or mode:value entries; the value is the "
                           "threshold (dynamic, remask), the lookahead (direct, speculative) or "
                           "the entropy bound (entropy); speculative:K@T also sets the "
                           "threshold T of the rule it reproduces (T = 1: static), and that "
                           "rule is run too; remask-chain:T and remask-paper:T@D "
                           "name the remask rule (D: remask_delta; "
                           "remask:T takes --remask-rule); static is always run first "
                           f"(default: {DEFAULT_GRID}; with --pareto, the Pareto sweeps)")
    grid.add_argument("--json", action="store_true",
                      help="end with the report as one JSON line (as written to bench.json)")
    grid.add_argument("--force", action="store_true",
                      help="write into a non-empty --out, replacing the files it writes")
    bench_fields = add_dataclass_flags(
        grid, DecodeConfig, skip=("stop_token_ids", "mode", *sorted(set(VALUE_FIELDS.values()))))
    return {"eval": eval_fields, "bench": bench_fields}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, list[str]]]:
    parser = argparse.ArgumentParser(prog="mrp", description="Fast block-diffusion LM decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    fields: dict[str, list[str]] = {}

    gen = commands.add_parser("generate", help="decode one prompt")
    add_model_flags(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    fields["generate"] = add_dataclass_flags(gen, DecodeConfig, skip=("stop_token_ids",))

    fields.update(add_eval_parsers(commands))
    fields["serve"] = add_serve_parser(commands)
    fields.update(add_distill_parser(commands))
    add_export_parser(commands)

    demo = commands.add_parser("demo", help="solve held-out problems with several modes")
    add_model_flags(demo)
    demo.add_argument("--problems", type=int, default=DEMO_PROBLEMS,
                      help=f"problems per task (default: {DEMO_PROBLEMS})")
    demo.add_argument("--json", action="store_true", help="end with one JSON line of the rows")
    fields["demo"] = add_dataclass_flags(demo, DecodeConfig, skip=tuple(
        spec.name for spec in dataclasses.fields(DecodeConfig) if spec.name != "candidates"))

    train = commands.add_parser("train", help="train a backbone or an MRP head")
    targets = train.add_subparsers(dest="target", required=True)
    backbone = targets.add_parser("backbone", help="SDAR block-diffusion training of a backbone")
    fields["train backbone"] = add_dataclass_flags(backbone, TrainConfig)
    head = targets.add_parser("head", help="train an MRP head on a frozen backbone "
                                           "(DDP under torchrun)")
    fields["train head"] = add_dataclass_flags(head, HeadTrainConfig)
    return parser, fields


def interrupt_message(args: argparse.Namespace, error: KeyboardInterrupt,
                      argv: list[str]) -> str:
    """Ctrl-C's one line: what the command saved, where, and the command that resumes. A
    run that saves (training, eval, distill) raises with a message saying what it saved;
    a bare KeyboardInterrupt means nothing was."""
    if not str(error):
        return "interrupted; nothing was saved"
    if args.command == "train":  # resuming a run takes --resume
        argv = [arg for arg in argv if arg not in ("--resume", "--no-resume")] + ["--resume"]
    return f"{error}; resume with: {shlex.join(['mrp', *argv])}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser, fields = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args, fields["generate"])
        if args.command == "eval":
            return cmd_eval(args, fields["eval"])
        if args.command == "bench":
            return cmd_bench(args, fields["bench"])
        if args.command == "demo":
            return cmd_demo(args, fields["demo"])
        if args.command == "export":
            return cmd_export(args)
        if args.command == "distill":
            return cmd_distill(args, fields["distill"], fields["distill decode"])
        if args.command == "serve":
            return cmd_serve(args, fields["serve"])
        if args.command == "train" and args.target == "backbone":
            return cmd_train_backbone(args, fields["train backbone"])
        if args.command == "train" and args.target == "head":
            return cmd_train_head(args, fields["train head"])
    except (ValueError, OSError) as error:
        print(f"mrp: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:  # a resumable run says what it saved
        print(f"mrp: {interrupt_message(args, error, argv)}", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
