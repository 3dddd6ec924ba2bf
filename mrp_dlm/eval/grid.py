"""Grid specs: "static,dynamic:0.9,speculative:3@0.9" <-> the decode configs a benchmark
compares.

An entry is `mode` or `mode:value`. The value sets the one knob that distinguishes a mode's
settings (`VALUE_FIELDS`): the threshold of dynamic and remask, the lookahead K of direct
and speculative, the entropy bound of entropy. Speculative also names the threshold of the
rule it reproduces, `speculative:K@τ` (without `@τ`, the base config's threshold); its
label always shows it; `speculative-self:K@τ` is the same with self-drafts only (no head
read: what a checkpoint without a trained head gets), the row every speculative row with
a head is compared to. `speculative:KxN@τ` fixes the candidate set size N (`--candidates`;
without `xN`, the base config's, `auto` by default). Remask entries name their rule,
`remask-chain:τ` and `remask-paper:τ@δ` (without `@δ`, the base's remask_delta);
a plain `remask:τ` takes the base config's rule, and its label names the rule. Every other
knob comes from a base config.
Static is always part of a grid and always first: every ratio is measured against it. A
lossless mode's rule (`rule_of`: dynamic at τ, or static at τ = 1.0) joins the grid just
before it when the spec leaves it out, so that every lossless row can be checked; so does a
head-drafting speculative row's self-draft counterpart (`self_of`: the same K and τ,
`speculative-self`) unless the grid has self-draft speculation at that τ.

Deliberately not here: running the grid (see `bench.py`) and which modes need a head
(`config.MRP_MODES`).
"""

from __future__ import annotations

import dataclasses

from mrp_dlm.config import MODES, REMASK_RULES, DecodeConfig

VALUE_FIELDS = {"dynamic": "threshold", "remask": "threshold", "direct": "lookahead",
                "speculative": "lookahead", "entropy": "entropy_bound"}
FIELD_TYPES = {"threshold": float, "lookahead": int, "entropy_bound": float}
TYPE_NAMES = {float: "a number", int: "an integer"}
REMASK_ENTRIES = {f"remask-{rule}": rule for rule in REMASK_RULES}  # entry mode -> remask_rule
SELF_ENTRY = "speculative-self"  # speculative with drafter self
BASELINE = "static"  # the reference every ratio is measured against
LOSSLESS_MODES = ("static", "speculative")  # modes whose greedy tokens equal their rule's
DEFAULT_GRID = ("static,dynamic:0.9,dynamic:0.7,dynamic:0.5,direct:4,direct:8,"
                "speculative-self:3@1,speculative:2@1,speculative:3@1,speculative-self:3@0.9,"
                "speculative:2@0.9,speculative:3@0.9,speculative:4@0.9,"
                "remask-chain:0.6,remask-chain:0.5,remask-chain:0.4")  # lossy MRP: the Pareto
# winners; the embedded head keeps static's accuracy on both tasks from 0.6 (experiments.md)


def entry_mode(config: DecodeConfig) -> str:
    """The mode as a grid entry names it: a remask config's names its rule, a self-drafting
    speculative config's says so."""
    if config.mode == "remask":
        return f"remask-{config.remask_rule}"
    return SELF_ENTRY if config.mode == "speculative" and config.drafter == "self" else config.mode


def second_knob(config: DecodeConfig) -> tuple[str, float] | None:
    """The knob after `@` in an entry: speculative's threshold, a paper remask rule's δ."""
    if config.mode == "speculative":
        return "threshold", config.threshold
    return ("remask_delta", config.remask_delta) if config.vetoes else None


def grid_label(config: DecodeConfig) -> str:
    """The grid entry that produces `config` from a base: "static", "speculative:3@0.9",
    "remask-paper:0.5@2"."""
    name = VALUE_FIELDS.get(config.mode)
    if name is None:
        return config.mode
    label = f"{entry_mode(config)}:{getattr(config, name):g}{set_suffix(config)}"
    second = second_knob(config)
    return label if second is None else f"{label}@{second[1]:g}"


def set_suffix(config: DecodeConfig) -> str:
    """"xN" after a speculative entry's K where its candidate set size is fixed, else ""."""
    fixed = config.mode == "speculative" and config.set_size is not None
    return f"x{config.set_size}" if fixed else ""


def family_of(config: DecodeConfig) -> str:
    """The sweep a config belongs to (a plot's line): its mode; a remask rule, with its δ;
    a fixed candidate set size."""
    return (entry_mode(config) + (f" δ={config.remask_delta:g}" if config.vetoes else "")
            + (f" {set_suffix(config)}" if set_suffix(config) else ""))


def setting_of(config: DecodeConfig) -> str:
    """The mode's distinguishing knobs as text, "lookahead=3"; empty for modes without one."""
    name = VALUE_FIELDS.get(config.mode)
    if name is None:
        return ""
    parts = [f"{name}={getattr(config, name):g}"]
    if config.mode == "remask":
        parts.append(f"remask_rule={config.remask_rule}")
    if config.mode == "speculative" and config.drafter == "self":
        parts.append("drafter=self")
    if set_suffix(config):
        parts.append(f"candidates={config.set_size}")
    second = second_knob(config)
    return " ".join(parts + ([f"{second[0]}={second[1]:g}"] if second else []))


def rule_of(config: DecodeConfig) -> DecodeConfig | None:
    """The head-free decode a lossless mode must equal token for token (None: lossy)."""
    if config.mode == "static":
        return config
    if config.mode != "speculative":
        return None
    mode = "static" if config.threshold >= 1.0 else "dynamic"
    return dataclasses.replace(config, mode=mode, drafter=DecodeConfig.drafter,
                               candidates=DecodeConfig.candidates)


def self_of(config: DecodeConfig) -> DecodeConfig | None:
    """The self-draft speculation a head-drafting speculative config must beat at its τ
    (the same K; None for every other config)."""
    if config.mode != "speculative" or config.drafter == "self":
        return None
    return dataclasses.replace(config, drafter="self")


def parse_entry(entry: str, base: DecodeConfig) -> DecodeConfig:
    text = entry
    entry, at, second = entry.partition("@")
    mode, _, value = entry.partition(":")
    if mode in REMASK_ENTRIES:
        base = dataclasses.replace(base, remask_rule=REMASK_ENTRIES[mode])
        mode = "remask"
    elif mode == "speculative":
        base = dataclasses.replace(base, drafter="head")
    elif mode == SELF_ENTRY:
        base = dataclasses.replace(base, drafter="self")
        mode = "speculative"
    if at:
        base = with_second_knob(text, base, second)
    if mode == "speculative" and "x" in value:
        value, _, size = value.partition("x")
        try:
            base = dataclasses.replace(base, candidates=size)
        except ValueError as error:
            raise ValueError(f"grid entry {entry!r}: {error} (speculative:KxN)") from None
    if mode not in MODES:
        raise ValueError(f"grid entry {entry!r}: unknown mode {mode!r}; choose one of "
                         f"{', '.join(MODES + tuple(REMASK_ENTRIES) + (SELF_ENTRY,))}")
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


def with_second_knob(entry: str, base: DecodeConfig, value: str) -> DecodeConfig:
    """base with the knob after `@`: speculative's threshold, a paper remask rule's δ."""
    if entry.startswith(("speculative:", f"{SELF_ENTRY}:")):
        name, allowed = "threshold", "a number in (0, 1]"
    elif entry.startswith("remask-paper"):
        name, allowed = "remask_delta", "a number >= 0"
    else:
        raise ValueError(f"grid entry {entry!r}: only speculative:K@τ, {SELF_ENTRY}:K@τ and "
                         "remask-paper:τ@δ take a value after @")
    try:
        return dataclasses.replace(base, **{name: float(value)})
    except ValueError:
        raise ValueError(f"grid entry {entry!r}: {name} must be {allowed}, "
                         f"got {value!r}") from None


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
    """configs with each lossless mode's rule, and each head-drafting speculative config's
    self-draft counterpart unless one at its τ is there, inserted before it where missing
    (configs share one base, so a label names a config)."""
    labels = {grid_label(config) for config in configs}
    self_drafted = {c.threshold for c in configs if c.mode == "speculative" and not c.uses_head}
    out: list[DecodeConfig] = []
    for config in configs:
        extras = [rule_of(config)]
        counterpart = self_of(config)
        if counterpart is not None and counterpart.threshold not in self_drafted:
            self_drafted.add(counterpart.threshold)
            extras.append(counterpart)
        for extra in extras:
            if extra is not None and grid_label(extra) not in labels:
                labels.add(grid_label(extra))
                out.append(extra)
        out.append(config)
    return tuple(out)
