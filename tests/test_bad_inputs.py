"""The bad-input battery: each bad command line gets one clean error line naming the flag
to fix, no traceback, and (for every check that needs no model) no model loaded at all:
the loaders are patched to fail the test if called."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import run_cli
from mrp_dlm.eval import store
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.registry import get_task
from mrp_dlm.training import head_loop, loop, run, sources

TRAIN_HEAD = ["train", "head", "--tasks", "arith", "--train-examples", "8", "--train-steps", "2"]
TRAIN_BACKBONE = ["train", "backbone", "--preset", "tiny", "--train-examples", "8",
                  "--train-steps", "2"]


def saved_run(tmp: Path, model: Path, head: Path) -> Path:
    """A folder holding a training run's state (what --resume continues)."""
    out = tmp / "saved-run"
    out.mkdir()
    (out / run.STATE_FILE).write_bytes(b"")
    return out


def eval_run_of_two(tmp: Path, model: Path, head: Path) -> Path:
    """An `mrp eval` folder holding the samples of the first 2 arith test problems."""
    out = tmp / "eval-run"
    out.mkdir()
    rows = [{"uid": e.uid, "problem": e.problem, "completion": "", "correct": False,
             "tokens": 1} for e in get_task("arith").examples("test", 2)]
    (out / store.SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def a_file(tmp: Path, model: Path, head: Path) -> Path:
    path = tmp / "a-file"
    path.write_text("keep me")
    return path


def non_empty(tmp: Path, model: Path, head: Path) -> Path:
    out = tmp / "full"
    out.mkdir()
    (out / "bench.json").write_text("{}")
    return out


def broken_release(tmp: Path, model: Path, head: Path) -> Path:
    """The tiny model and its head in the release layout, one head tensor missing."""
    out = tmp / "release"
    assert run_cli_quiet(["export", "--model", str(model), "--head", str(head), "--out",
                          str(out)]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["mrp_modules.0.model.eh_proj.weight"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run_cli_quiet(argv: list[str]) -> int:
    from mrp_dlm.cli import main

    return main(argv)


# name: (argv with {model}, {tmp} and {…} placeholders filled below, message, loads a model)
CASES = {
    "generate --threads -1": (["generate", "--prompt", "hi", "--threads", "-1"],
                              "--threads must be >= 0", False),
    "generate --lookahead 1000": (["generate", "--prompt", "hi", "--mode", "speculative",
                                   "--lookahead", "1000"],
                                  "lookahead (1000) cannot exceed block_size (4)", False),
    "generate --candidates 9": (["generate", "--prompt", "hi", "--mode", "speculative",
                                 "--candidates", "9"], "candidates (--candidates) must be auto "
                                "or an integer in [1, 4], got '9'", False),
    "bench --candidates x": (["bench", "--task", "arith", "--out", "{tmp}/b", "--candidates",
                              "x"], "candidates (--candidates) must be auto", False),
    "generate --seed -1": (["generate", "--prompt", "hi", "--seed", "-1"],
                           "seed must be >= 0, got 0 and -1", False),
    "eval --threads -1": (["eval", "--task", "arith", "--out", "{tmp}/e", "--threads", "-1"],
                          "--threads must be >= 0", False),
    "eval --lookahead 1000": (["eval", "--task", "arith", "--out", "{tmp}/e", "--mode",
                               "direct", "--lookahead", "1000"],
                              "lookahead (1000) cannot exceed block_size (4)", False),
    "eval, a smaller --limit": (["eval", "--task", "arith", "--out", "{eval_run}",
                                 "--limit", "1"], "(a smaller --limit than the run's)", False),
    "bench into a non-empty --out": (["bench", "--task", "arith", "--out", "{non_empty}"],
                                     f"--out {{non_empty}} is not empty; pass --force", False),
    "demo --threads -1": (["demo", "--threads", "-1"], "--threads must be >= 0", False),
    "demo --candidates 0": (["demo", "--candidates", "0"],
                            "candidates (--candidates) must be auto", False),
    "export into a non-empty --out": (["export", "--out", "{non_empty}"],
                                      "--out {non_empty} is not empty; pass --force", False),
    "distill, a missing --prompts file": (
        ["distill", "--prompts", "{tmp}/missing.jsonl", "--out", "{tmp}/d"],
        "--prompts: '{tmp}/missing.jsonl' names no data file", False),
    "distill, a task without --limit": (["distill", "--prompts", "task:arith", "--out",
                                         "{tmp}/d"], "--prompts task:arith needs --limit",
                                        False),
    "distill --out a file": (["distill", "--prompts", "task:arith", "--limit", "2", "--out",
                              "{a_file}"], "{a_file} exists and is not a directory", False),
    "distill --lookahead 1000": (["distill", "--prompts", "task:arith", "--limit", "2",
                                  "--out", "{tmp}/d", "--mode", "speculative", "--lookahead",
                                  "1000"], "lookahead (1000) cannot exceed block_size", False),
    "train head --seed -1": ([*TRAIN_HEAD, "--out", "{tmp}/h", "--seed", "-1"],
                             "seed must be >= 0, got -1", False),
    "train backbone --seed -1": ([*TRAIN_BACKBONE, "--out", "{tmp}/b", "--seed", "-1"],
                                 "seed must be >= 0, got -1", False),
    "train head --threads -1": ([*TRAIN_HEAD, "--out", "{tmp}/h", "--threads", "-1"],
                                "threads must be >= 0, got -1", False),
    "train head into a saved run": ([*TRAIN_HEAD, "--out", "{saved_run}"],
                                    "already holds a training run; pass --resume", False),
    "train backbone into a saved run": ([*TRAIN_BACKBONE, "--out", "{saved_run}"],
                                        "already holds a training run; pass --resume", False),
    "train head --out a file": ([*TRAIN_HEAD, "--out", "{a_file}"],
                                "--out {a_file} is a file, not a directory", False),
    "a release missing a head tensor": (
        ["generate", "--prompt", "hi", "--model", "{broken_release}"],
        "missing head tensor(s) mrp_modules.0.model.eh_proj.weight", True),
}
MODEL_FREE = ("demo", "train", "export")  # commands run without --model here
SETUPS = {"saved_run": saved_run, "eval_run": eval_run_of_two, "a_file": a_file,
          "non_empty": non_empty, "broken_release": broken_release}


def forbid_loads(monkeypatch) -> None:
    """Every model and data loader the commands reach fails the test when called."""
    def never(*args, **kwargs):
        raise AssertionError("a model or data was loaded before the bad input was refused")

    monkeypatch.setattr(Pipeline, "load", never)
    for module, name in ((head_loop, "load_frozen_backbone"), (head_loop, "load_data"),
                         (loop, "start_run"), (sources, "load_sources")):
        monkeypatch.setattr(module, name, never)


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_gets_one_clean_line(case, saved_model_and_head, tmp_path, capsys,
                                         monkeypatch):
    argv, message, loads = CASES[case]
    values = {"tmp": str(tmp_path)}
    values.update({key: str(make(tmp_path, *saved_model_and_head)) for key, make in SETUPS.items()
                   if any("{" + key + "}" in arg for arg in argv)})
    capsys.readouterr()
    argv = [fill(arg, values) for arg in argv]
    if argv[0] not in MODEL_FREE and "--model" not in argv:
        argv += ["--model", str(saved_model_and_head[0])]
    if not loads:
        forbid_loads(monkeypatch)
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run_cli(capsys, *argv)
    errors = [line for line in err.splitlines() if line.startswith("mrp: error: ")]
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert len(errors) == 1 and fill(message, values) in errors[0], err
    others = [line for line in err.splitlines() if line not in errors]
    assert all(line.endswith("; loading torch") for line in others), err  # said before torch
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, no empty folder left


def test_distill_leaves_no_empty_folder_when_the_model_fails(saved_model_and_head, tmp_path,
                                                             capsys):
    """A failure after the model loads (here: a model without a chat template) leaves no
    --out folder behind either: the folder is made with the first answer."""
    model_dir, _ = saved_model_and_head
    (model_dir / "tokenizer_config.json").unlink(missing_ok=True)
    code, out, err = run_cli(capsys, "distill", "--model", str(model_dir), "--prompts",
                             "task:arith", "--limit", "2", "--out", str(tmp_path / "d"))
    assert code == 2 and err.count("mrp: error: ") == 1, err
    assert not (tmp_path / "d").exists()


# Ctrl-C: one line, what was saved and where, and the command that resumes.
INTERRUPTS = {
    "generate": (["generate", "--prompt", "hi"], 1, "mrp: interrupted; nothing was saved"),
    "bench": (["bench", "--task", "arith", "--grid", "dynamic:0.5", "--limit", "2",
               "--out", "{tmp}/b"], 2, "mrp: interrupted; nothing was saved"),
    "demo": (["demo", "--problems", "2"], 3, "mrp: interrupted; nothing was saved"),
    "distill": (["distill", "--prompts", "task:arith", "--limit", "5", "--batch-size", "2",
                 "--out", "{tmp}/d"], 2,
                "mrp: interrupted; 2 of 5 prompts are answered in {tmp}/d; resume with: "
                "mrp {argv}"),
}


@pytest.mark.parametrize("case", INTERRUPTS)
def test_ctrl_c_prints_one_line(case, saved_model_and_head, tmp_path, capsys, monkeypatch):
    argv, at_call, line = INTERRUPTS[case]
    argv = [fill(arg, {"tmp": str(tmp_path)}) for arg in argv]
    argv += ["--model", str(saved_model_and_head[0]), "--max-new-tokens", "4"] \
        if case != "demo" else ["--model", str(saved_model_and_head[0])]
    generate_ids, calls = Pipeline.generate_ids, []

    def interrupt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return generate_ids(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "generate_ids", interrupt)
    code, out, err = run_cli(capsys, *argv)
    lines = [text for text in err.splitlines() if text.startswith("mrp: ")]
    assert code == 130 and "Traceback" not in err, err
    assert lines == [fill(line, {"tmp": str(tmp_path), "argv": " ".join(argv)})], err
