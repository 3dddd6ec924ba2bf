"""One speculative round reads in a few files: docs/design.md's reading lists ("One round,
file by file") are the files an ast pass reaches from each entry, and stay within budget.

The pass follows calls resolved to mrp_dlm functions and methods: names defined in or
imported into a module, `module.name`, and `obj.method` where obj's class is known from an
annotation, a constructor call or a return annotation (parameters, locals, dataclass fields,
`self.x` set in `__init__`). Calls it cannot resolve (torch, builtins) are not followed.
It stops at the BOUNDARIES (what a reader of the round may skip, named in design.md) and at
model/. Lines count whole files: a reader opens the file.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"library": (5, 1500), "serving": (7, 2000)}  # most files, most lines
BOUNDARIES = (  # (module, qualified name prefix): not followed
    ("mrp_dlm.decoding.drafting", "DraftPlanner."),  # the planner's face: plan, observe, time
    ("mrp_dlm.decoding.costs", "Timer."),  # and its timer
    ("mrp_dlm.decoding.driver", "BlockContext.verify"),  # the verify forward
    ("mrp_dlm.decoding.driver", "BlockContext.progress"),  # what is left: sizes the work
    ("mrp_dlm.decoding.step", ""),  # the step's types and host-read policy: size the work
    ("mrp_dlm.decoding.head_cache", "HeadSteps.advance"),  # a head step
    ("mrp_dlm.decoding.cpu_sampling", ""),  # the CPU sampling path: the definition's tokens
    ("mrp_dlm.model", ""),  # the backbone and the head
    ("mrp_dlm.serving.head_pool", ""),  # serving's head step and head keys (as head_cache.py)
    ("mrp_dlm.serving.stats", ""),  # serving stats: read by nobody who decides a token
    ("mrp_dlm.decoding.logprobs", ""),  # the logprobs recorder (opt-in): decides no token
)
# Serving never builds candidate sets (`draft(..., alternatives=False)`, checked below).
EXTRA_BOUNDARIES = {"serving": (("mrp_dlm.decoding.candidates", ""),)}


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local -> (module, name)
    modules: dict[str, str] = field(default_factory=dict)  # local -> module


class Index:
    """Every mrp_dlm module, parsed, with what each name refers to."""

    def __init__(self) -> None:
        self.modules: dict[str, Module] = {}
        for path in (ROOT / "mrp_dlm").rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self.modules[name] = Module(name, path, ast.parse(path.read_text()))
        for module in self.modules.values():
            self.read_imports(module)

    def read_imports(self, module: Module) -> None:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mrp_dlm"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in self.modules:
                        module.modules[alias.asname or alias.name] = full
                    else:
                        module.names[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.modules and alias.asname:
                        module.modules[alias.asname] = alias.name

    def definition(self, module: str, name: str) -> tuple[str, ast.AST] | None:
        """The top-level def or class `name` of `module`, following imports."""
        for _ in range(5):
            found = self.modules.get(module)
            if found is None:
                return None
            for node in found.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                    return module, node
            if name not in found.names:
                return None
            module, name = found.names[name]
        return None


@dataclass(frozen=True)
class Cls:
    module: str
    node: ast.ClassDef


@dataclass(frozen=True)
class Func:
    module: str
    qualname: str
    node: ast.FunctionDef
    owner: Cls | None = None


class Walk:
    """The calls reached from one entry."""

    def __init__(self, index: Index, boundaries: tuple = BOUNDARIES) -> None:
        self.index = index
        self.boundaries = boundaries
        self.seen: set[tuple[str, str]] = set()
        self.modules: set[str] = set()
        self.stopped: set[tuple[str, str]] = set()

    # --- names and types ------------------------------------------------------------

    def resolve(self, module: str, expr: ast.AST) -> Cls | Func | str | None:
        """What a Name / Attribute chain refers to: a class, a function, a module name."""
        mod = self.index.modules[module]
        if isinstance(expr, ast.Name):
            if expr.id in mod.modules:
                return mod.modules[expr.id]
            found = self.index.definition(module, expr.id)
        elif isinstance(expr, ast.Attribute):
            base = self.resolve(module, expr.value)
            found = self.index.definition(base, expr.attr) if isinstance(base, str) else None
        else:
            return None
        if found is None:
            return None
        where, node = found
        return Cls(where, node) if isinstance(node, ast.ClassDef) else Func(where, node.name, node)

    def annotation(self, module: str, node: ast.AST | None) -> Cls | None:
        """The class an annotation names (`X`, `X | None`, `Optional[X]`, "X")."""
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node = ast.parse(node.value, mode="eval").body
        if isinstance(node, ast.BinOp):
            return self.annotation(module, node.left) or self.annotation(module, node.right)
        if isinstance(node, ast.Subscript):
            return self.annotation(module, node.slice)
        found = self.resolve(module, node)
        return found if isinstance(found, Cls) else None

    def classes(self, cls: Cls) -> list[Cls]:
        """cls and its mrp_dlm bases."""
        out = [cls]
        for base in cls.node.bases:
            found = self.resolve(cls.module, base)
            if isinstance(found, Cls):
                out += self.classes(found)
        return out

    def method(self, cls: Cls, name: str) -> Func | None:
        for c in self.classes(cls):
            for node in c.node.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return Func(c.module, f"{c.node.name}.{name}", node, c)
        return None

    def attribute(self, cls: Cls, name: str) -> Cls | None:
        """The class of attribute `name` of cls's instances: a field annotation, a property's
        return annotation, or `self.name` annotated or constructed in `__init__`."""
        for c in self.classes(cls):
            for node in c.node.body:
                if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                        and node.target.id == name):
                    return self.annotation(c.module, node.annotation)
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return self.annotation(c.module, node.returns)
            init = self.method(c, "__init__")
            for node in ast.walk(init.node) if init else ():
                target = node.target if isinstance(node, ast.AnnAssign) else (
                    node.targets[0] if isinstance(node, ast.Assign) else None)
                if (isinstance(target, ast.Attribute) and target.attr == name
                        and isinstance(target.value, ast.Name) and target.value.id == "self"):
                    if isinstance(node, ast.AnnAssign):
                        return self.annotation(c.module, node.annotation)
                    return self.type_of(init, node.value, {"self": c})
        return None

    def type_of(self, func: Func, expr: ast.AST, env: dict[str, Cls]) -> Cls | None:
        if isinstance(expr, ast.Name) and expr.id in env:
            return env[expr.id]
        if isinstance(expr, ast.Attribute):
            owner = self.type_of(func, expr.value, env)
            if owner is not None:
                return self.attribute(owner, expr.attr)
        if isinstance(expr, ast.Call):
            target = self.callee(func, expr.func, env)
            if isinstance(target, Cls):
                return target
            if isinstance(target, Func):
                return self.annotation(target.module, target.node.returns)
        return None

    def callee(self, func: Func, expr: ast.AST, env: dict[str, Cls]) -> Cls | Func | None:
        if isinstance(expr, ast.Attribute) and not (
                isinstance(expr.value, ast.Name) and expr.value.id not in env):
            owner = self.type_of(func, expr.value, env)
            if owner is not None:
                return self.method(owner, expr.attr)
        found = self.resolve(func.module, expr)
        return found if isinstance(found, (Cls, Func)) else None

    # --- the walk ---------------------------------------------------------------------

    def visit(self, func: Func) -> None:
        key = (func.module, func.qualname)
        if key in self.seen:
            return
        self.seen.add(key)
        if any(func.module.startswith(m) and func.qualname.startswith(q)
               for m, q in self.boundaries):
            self.stopped.add(key)
            return
        self.modules.add(func.module)
        env = {} if func.owner is None else {"self": func.owner}
        args = func.node.args
        for arg in args.posonlyargs + args.args + args.kwonlyargs:
            cls = self.annotation(func.module, arg.annotation)
            if cls is not None:
                env[arg.arg] = cls
        for node in ast.walk(func.node):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                cls = self.type_of(func, node.value, env)
                if cls is not None:
                    env[node.targets[0].id] = cls
        for node in ast.walk(func.node):
            if isinstance(node, ast.Call):
                target = self.callee(func, node.func, env)
                if isinstance(target, Cls):  # a constructor: its own code, if any
                    target = self.method(target, "__init__") or self.method(
                        target, "__post_init__")
                if target is not None and target.node is not func.node:
                    self.visit(target)


@functools.lru_cache(maxsize=1)
def package_index() -> Index:
    return Index()


def walk(entry: str, round_name: str = "library") -> Walk:
    """The walk from `module:Class.method` (with the round `round_name`'s boundaries)."""
    module, qualname = entry.split(":")
    index = package_index()
    cls_name, name = qualname.split(".")
    _, node = index.definition(module, cls_name)
    run = Walk(index, BOUNDARIES + EXTRA_BOUNDARIES.get(round_name, ()))
    run.visit(run.method(Cls(module, node), name))
    return run


def file_of(module: str) -> str:
    """mrp_dlm.decoding.speculative -> decoding/speculative.py"""
    return "/".join(module.split(".")[1:]) + ".py"


def lines_of(files: set[str]) -> int:
    return sum(len((ROOT / "mrp_dlm" / f).read_text().splitlines()) for f in files)


def reading_lists(design: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (entry, files) from design.md's block under "One round, file by file"."""
    block = design.split("## One round, file by file", 1)[1].split("```")[1]
    lists: dict[str, tuple[str, set[str]]] = {}
    name = ""
    for line in block.splitlines():
        head = re.match(r"(\w+): (\S+)$", line)
        if head:
            name = head.group(1)
            lists[name] = (head.group(2), set())
        elif line.startswith("  ") and line.split()[0].endswith(".py"):
            lists[name][1].add(line.split()[0])
    return lists


def read_round(name: str) -> tuple[set[str], set[str]]:
    """(the files the round `name` reads, those docs/design.md lists for it)."""
    entry, listed = reading_lists((ROOT / "docs" / "design.md").read_text())[name]
    return {file_of(m) for m in walk(entry, name).modules}, listed


@pytest.mark.parametrize("name", BUDGETS)
def test_design_md_lists_the_files_each_round_reads(name):
    files, listed = read_round(name)
    assert files == listed, (f"{name}: the round reads {sorted(files - listed)} beyond "
                             f"docs/design.md's list; listed, unread: {sorted(listed - files)}")


@pytest.mark.parametrize("name", [
    "library",
    "serving",
])
def test_each_round_reads_within_its_budget(name):
    files, _ = read_round(name)
    most_files, most_lines = BUDGETS[name]
    assert len(files) <= most_files and lines_of(files) <= most_lines, (
        f"{name}: {len(files)} files, {lines_of(files)} lines")


def test_serving_never_builds_candidate_sets():
    """The serving boundary at candidates.py holds: no serving module asks `draft` for
    alternatives or calls candidates.py."""
    for path in (ROOT / "mrp_dlm" / "serving").rglob("*.py"):
        text = path.read_text()
        assert "alternatives=True" not in text and "candidates" not in re.findall(
            r"from mrp_dlm\.decoding(?:\.| import )(\w+)", text), path


def test_the_walk_resolves_typed_calls_and_stops_at_boundaries():
    run = walk("mrp_dlm.decoding.speculative:SpeculativeDecoder.step")
    reached = {q for _, q in run.seen}
    # a parameter's annotation, a local from a constructor, a module alias, a return type
    assert {"SpeculativeDecoder.verify", "draft", "Drafter.proposal", "alternatives",
            "threshold_pick", "take_accepted"} <= reached
    assert ("mrp_dlm.decoding.drafting", "DraftPlanner.plan") in run.stopped
    assert ("mrp_dlm.decoding.driver", "BlockContext.verify") in run.stopped
    assert not any(m.startswith("mrp_dlm.model") for m in run.modules)


if __name__ == "__main__":  # print the lists and their counts
    for name, (entry, _) in reading_lists((ROOT / "docs" / "design.md").read_text()).items():
        run = walk(entry, name)
        files = sorted(file_of(m) for m in run.modules)
        print(f"{name}: {entry}: {len(files)} files, {lines_of(set(files))} lines")
        for f in files:
            print(f"  {f:34} {lines_of({f})}")
        print("  stops at:", sorted(f"{m}:{q}" for m, q in run.stopped))
