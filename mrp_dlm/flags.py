"""Command-line flags derived from the config dataclasses, so each default exists once.

Every field becomes `--field-name`; its help text is the field's `metadata["help"]`
(`field(default=..., metadata={"help": ...})`) and its default is the dataclass default.
Flags the user leaves out are absent from the parsed namespace, so the dataclass fills them in.
"""

from __future__ import annotations

import argparse
import dataclasses

SCALARS = {"int": int, "float": float, "str": str}


def scalar_type(annotation: str) -> type | None:
    """int, float, str or bool from an annotation such as 'int | None'; None if unsupported."""
    names = [part.strip() for part in annotation.split("|") if part.strip() != "None"]
    if names == ["bool"]:
        return bool
    return SCALARS.get(names[0]) if len(names) == 1 else None


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type,
                        skip: tuple[str, ...] = (), base: object | None = None) -> list[str]:
    """Add a flag per supported field of cls; return the field names added. `base`, an
    instance of cls, supplies the defaults shown (a command whose defaults differ, built
    with `build_dataclass(..., base=base)`)."""
    added = []
    for spec in dataclasses.fields(cls):
        kind = scalar_type(str(spec.type))
        if spec.name in skip or not spec.init or kind is None:
            continue
        default = spec.default if spec.default is not dataclasses.MISSING else None
        if base is not None:
            default = getattr(base, spec.name)
        text = spec.metadata.get("help", "")
        help_text = f"{text} (default: {default})"
        flag = "--" + spec.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            required = spec.default is dataclasses.MISSING
            parser.add_argument(flag, type=kind, required=required, default=argparse.SUPPRESS,
                                help=help_text, metavar=spec.name.upper())
        added.append(spec.name)
    return added


def build_dataclass(cls: type, args: argparse.Namespace, names: list[str],
                    base: object | None = None):
    """cls from the parsed flags that the user gave; the rest take their defaults (those of
    `base`, an instance of cls, when given)."""
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**given) if base is None else dataclasses.replace(base, **given)
