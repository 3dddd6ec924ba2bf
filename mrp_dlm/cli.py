"""`mrp`: argparse -> configs -> calls. No logic of its own; the only module that prints."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from mrp_dlm.config import DecodeConfig, HeadTrainConfig, TrainConfig
from mrp_dlm.eval.demo import DEMO_PROBLEMS
from mrp_dlm.flags import add_dataclass_flags, build_dataclass
from mrp_dlm.model.loading import DTYPES


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (HF format); default: the embedded model")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="weights and activations dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="override the mask token id of the checkpoint")
    parser.add_argument("--head", default=None,
                        help="MRP head directory for the direct, speculative and remask modes "
                             "(default: the embedded head with the embedded model)")


def cmd_generate(args: argparse.Namespace, decode_fields: list[str]) -> int:
    from mrp_dlm.pipeline import Pipeline

    config = build_dataclass(DecodeConfig, args, decode_fields)
    pipe = Pipeline.load(args.model, args.dtype, args.device, args.mask_token_id,
                         config.block_size, args.head)
    out = pipe.generate([args.prompt], config, chat=args.chat)
    stats = out.stats
    if args.json:
        print(json.dumps({"text": out.texts[0], "token_ids": out.token_ids[0],
                          "stats": stats.to_dict()}))
    else:
        print(out.texts[0])
        print(f"[{stats.tokens} tokens, {stats.backbone_forwards} backbone forwards, "
              f"{stats.tokens_per_forward:.2f} tokens/forward, {stats.seconds:.2f} s]",
              file=sys.stderr)
    return 0


def cmd_train_backbone(args: argparse.Namespace, train_fields: list[str]) -> int:
    from mrp_dlm.training.loop import train_backbone

    config = build_dataclass(TrainConfig, args, train_fields)
    out = train_backbone(config)
    print(f"checkpoint written to {out}")
    return 0


def cmd_train_head(args: argparse.Namespace, train_fields: list[str]) -> int:
    from mrp_dlm.training.head_loop import train_head

    config = build_dataclass(HeadTrainConfig, args, train_fields)
    out = train_head(config)
    print(f"head written to {out}")
    return 0


def format_table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from mrp_dlm.eval.demo import run_demo
    from mrp_dlm.pipeline import Pipeline

    if args.problems < 1:
        raise ValueError(f"--problems must be >= 1, got {args.problems}")
    pipe = Pipeline.load(args.model, args.dtype, args.device, args.mask_token_id, None, args.head)
    print(f"mrp demo: {pipe.directory}, {args.problems} held-out problems per task")
    report = run_demo(pipe, args.problems)
    rows = report.rows()
    print(format_table(rows, ["task", "mode", "setting", "accuracy", "tokens_per_forward",
                              "tokens_per_second", "backbone_forwards"]))
    for result in report.results[:: max(len(report.results) // 2, 1)][:2]:
        sample = result.samples[0]
        print(f"\n--- {result.task} ({result.config.mode}), "
              f"{'correct' if sample.correct else 'wrong'}\n{sample.problem}\n>>> {sample.completion}")
    print(json.dumps({"demo": rows}))
    return 0


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

    demo = commands.add_parser("demo", help="solve held-out problems with several modes")
    add_model_flags(demo)
    demo.add_argument("--problems", type=int, default=DEMO_PROBLEMS,
                      help=f"problems per task (default: {DEMO_PROBLEMS})")

    train = commands.add_parser("train", help="train a backbone or an MRP head")
    targets = train.add_subparsers(dest="target", required=True)
    backbone = targets.add_parser("backbone", help="SDAR block-diffusion training of a backbone")
    fields["train backbone"] = add_dataclass_flags(backbone, TrainConfig)
    head = targets.add_parser("head", help="train an MRP head on a frozen backbone "
                                           "(DDP under torchrun)")
    fields["train head"] = add_dataclass_flags(head, HeadTrainConfig)
    return parser, fields


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser, fields = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args, fields["generate"])
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "train" and args.target == "backbone":
            return cmd_train_backbone(args, fields["train backbone"])
        if args.command == "train" and args.target == "head":
            return cmd_train_head(args, fields["train head"])
    except (ValueError, FileNotFoundError) as error:
        print(f"mrp: error: {error}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
