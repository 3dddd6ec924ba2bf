"""Grid specs: "static,dynamic:0.9,speculative:3@0.9" <-> the decode configs a benchmark
compares.

An entry is `mode` or `mode:value`. The value sets the one knob that distinguishes a mode's
settings (`VALUE_FIELDS`): the threshold of dynamic and remask, the lookahead K of direct
and speculative, the entropy bound of entropy. Speculative also names the threshold of the
rule it reproduces, `speculative:K@τ` (without `@τ`, the base config's threshold); its
label always shows it. Every other knob comes from a base config.
Static is always part of a grid and always first: every ratio is measured against it. A
lossless mode's rule (`rule_of`: dynamic at τ, or static at τ = 1.0) joins the grid just
before it when the spec leaves it out, so that every lossless row can be checked.

Deliberately not here: running the grid (see `bench.py`) and which modes need a head
(`config.MRP_MODES`).
"""

from __future__ import annotations

import dataclasses

from mrp_dlm.config import MODES, DecodeConfig

VALUE_FIELDS = {"dynamic": "threshold", "remask": "threshold", "direct": "lookahead",
                "speculative": "lookahead", "entropy": "entropy_bound"}
FIELD_TYPES = {"threshold": float, "lookahead": int, "entropy_bound": float}
TYPE_NAMES = {float: "a number", int: "an integer"}
BASELINE = "static"  # the reference every ratio is measured against
LOSSLESS_MODES = ("static", "speculative")  # modes whose greedy tokens equal their rule's
DEFAULT_GRID = ("static,dynamic:0.9,dynamic:0.7,dynamic:0.5,direct:4,direct:8,"
                "speculative:2@1,speculative:3@1,speculative:2@0.9,speculative:3@0.9,"
                "speculative:4@0.9,remask:0.5,remask:0.4")  # lossy MRP: the Pareto winners


def grid_label(config: DecodeConfig) -> str:
    """The grid entry that produces `config` from a base: "static", "speculative:3@0.9"."""
    name = VALUE_FIELDS.get(config.mode)
    if name is None:
        return config.mode
    label = f"{config.mode}:{getattr(config, name):g}"
    return f"{label}@{config.threshold:g}" if config.mode == "speculative" else label


def setting_of(config: DecodeConfig) -> str:
    """The mode's distinguishing knob as text, "lookahead=3"; empty for modes without one."""
    name = VALUE_FIELDS.get(config.mode)
    if name is None:
        return ""
    setting = f"{name}={getattr(config, name):g}"
    return f"{setting} threshold={config.threshold:g}" if config.mode == "speculative" else setting


def rule_of(config: DecodeConfig) -> DecodeConfig | None:
    """The head-free decode a lossless mode must equal token for token (None: lossy)."""
    if config.mode == "static":
        return config
    if config.mode != "speculative":
        return None
    if config.threshold >= 1.0:
        return dataclasses.replace(config, mode="static")
    return dataclasses.replace(config, mode="dynamic")


def parse_entry(entry: str, base: DecodeConfig) -> DecodeConfig:
    entry, at, threshold = entry.partition("@")
    if at:
        if not entry.startswith("speculative:"):
            raise ValueError(f"grid entry {entry + at + threshold!r}: only speculative:K@τ "
                             "takes a threshold after @")
        try:
            base = dataclasses.replace(base, threshold=float(threshold))
        except ValueError:
            raise ValueError(f"grid entry {entry + at + threshold!r}: threshold must be a "
                             f"number in (0, 1], got {threshold!r}") from None
    mode, _, value = entry.partition(":")
    if mode not in MODES:
        raise ValueError(f"grid entry {entry!r}: unknown mode {mode!r}; choose one of "
                         f"{', '.join(MODES)}")
    name = VALUE_FIELDS.get(mode)
    if name is None:
        if value:
            raise ValueError(f"grid entry {entry!r}: mode {mode!r} takes no value")
        return dataclasses.replace(base, mode=mode)
    if not value:
        raise ValueError(f"grid entry {entry!r}: mode {mode!r} needs a value, "
                         f"{mode}:{name.upper()}")
    try:
        number = FIELD_TYPES[name](value)
    except ValueError:
        raise ValueError(f"grid entry {entry!r}: {name} must be "
                         f"{TYPE_NAMES[FIELD_TYPES[name]]}, got {value!r}") from None
    try:
        return dataclasses.replace(base, mode=mode, **{name: number})
    except ValueError as error:
        raise ValueError(f"grid entry {entry!r}: {error}") from None


def parse_grid(spec: str, base: DecodeConfig) -> tuple[DecodeConfig, ...]:
    """The configs of a comma-separated grid spec, static first (added when left out)."""
    entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
    if not entries:
        raise ValueError("the grid is empty; give entries such as 'static,speculative:3'")
    configs = [parse_entry(entry, base) for entry in entries]
    labels = [grid_label(config) for config in configs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"grid lists {', '.join(repeated)} more than once")
    baseline = dataclasses.replace(base, mode=BASELINE)
    return with_rules((baseline, *(config for config in configs if config.mode != BASELINE)))


def with_rules(configs: tuple[DecodeConfig, ...]) -> tuple[DecodeConfig, ...]:
    """configs with each lossless mode's rule inserted before it where missing (configs
    share one base, so a label names a config)."""
    labels = {grid_label(config) for config in configs}
    out: list[DecodeConfig] = []
    for config in configs:
        rule = rule_of(config)
        if rule is not None and grid_label(rule) not in labels:
            labels.add(grid_label(rule))
            out.append(rule)
        out.append(config)
    return tuple(out)
