"""CLI smoke tests: every subcommand runs, and bad input exits with code 2 and a message."""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from fresh_imports import modules_after
from mrp_dlm.config import DecodeConfig
from mrp_dlm.pipeline import Pipeline, embedded_model_dir


def test_generate_prints_text_and_stats(saved_model_and_head, capsys):
    model_dir, _ = saved_model_and_head
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt",
                             "What is 7 + 5?", "--chat", "--max-new-tokens", "6")
    assert code == 0, err
    assert "tokens/forward" in err


def test_generate_json_logprobs(saved_model_and_head, capsys):
    """--logprobs K: one entry per output token with its top K; refused by direct."""
    model_dir, _ = saved_model_and_head
    argv = ("generate", "--model", str(model_dir), "--prompt", "7 + 5", "--max-new-tokens", "6")
    code, out, err = run_cli(capsys, *argv, "--json", "--logprobs", "2")
    assert code == 0, err
    result = json.loads(out)
    assert [t["token_id"] for t in result["logprobs"]] == result["token_ids"]
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in result["logprobs"])
    assert "logprobs" not in json.loads(run_cli(capsys, *argv, "--json")[1])
    code, _, err = run_cli(capsys, *argv, "--mode", "direct", "--logprobs", "2")
    assert code == 2 and "logprobs are not returned by mode 'direct'" in err, err


@pytest.mark.parametrize("mode", ["static", "dynamic", "sequential", "entropy"])
def test_generate_json_for_each_baseline_mode(saved_model_and_head, capsys, mode):
    model_dir, _ = saved_model_and_head
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "7 + 5",
                             "--mode", mode, "--max-new-tokens", "9", "--json",
                             "--temperature", "0.7", "--top-k", "5", "--seed", "3")
    assert code == 0, err
    result = json.loads(out)
    assert {"text", "token_ids", "stats"} <= set(result)
    for key in ("backbone_forwards", "tokens", "tokens_per_forward", "seconds"):
        assert key in result["stats"]
    assert 1 <= len(result["token_ids"]) <= 9


def test_demo_runs_on_a_given_model(saved_model_and_head, capsys):
    model_dir, head_dir = saved_model_and_head
    code, out, err = run_cli(capsys, "demo", "--model", str(model_dir), "--head", str(head_dir),
                             "--problems", "2", "--json")
    assert code == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    report = last["demo"]
    assert all(row["query_tokens_per_forward"] > 0 for row in report)
    assert (last["batch_size"], last["latency_problems"]) == (2, 2)
    modes = {(row["task"], row["mode"]) for row in report}
    assert ("arith", "speculative") in modes and ("arith-code", "static") in modes
    assert all(row["n"] == 2 for row in report + last["throughput"])
    for rows in (report, last["throughput"]):  # each goal has one pick per task
        for task in ("arith", "arith-code"):
            goals = [g for row in rows if row["task"] == task for g in row["recommended"]]
            assert sorted(goals) == ["exact", "fastest no-loss"]
    lines = out.splitlines()
    assert "latency: batch 1, first 2 problems per task" in lines
    assert "throughput: batch 2, all 2 problems per task" in lines
    header = lines.index(next(line for line in lines if line.startswith("task")))
    assert lines[header].split()[-10:] == ["vs", "rule", "vs", "frontier", "vs", "self-drafts",
                                           "drafts", "same", "lossless", "recommended"]
    table = {tuple(line.split()[:3]): line for line in lines[header + 1:header + 15]}
    assert table["arith", "static", "-"].split()[7:10] == ["1.00x", "-", "-"]
    spec = table["arith", "speculative", "lookahead=3"]
    row = next(row for row in report if row["task"] == "arith" and row["family"] == "speculative")
    # yes*: exact up to float ties, where a verify ran batched (the CPU's `--invariant-verify`
    # auto); a row whose planner drafted nothing verified nothing and reads yes
    same = " yes* " if row["exactness"] == "exact up to float ties" else " yes "
    assert "dynamic:0.9" in spec and " 2/2 " in spec and same in spec
    speed = row["speedup_vs_rule"]
    assert f"{speed:.2f}x" + (" slower" if speed < 1 else "") in spec and "self:" in spec
    assert "(dynamic:" in table["arith", "direct", "lookahead=4"]  # the frontier it is read at
    assert any(line.startswith("Latency above: tokens/s at batch 1") and "one batch of 2" in line
               for line in lines)
    for bar in ("warm-up arith", "arith static", "arith-code speculative:3@0.9", "batch 1 #"):
        assert bar in err  # progress per task and mode


def test_demo_prints_json_only_when_asked(saved_model_and_head, capsys):
    model_dir, _ = saved_model_and_head
    code, out, err = run_cli(capsys, "demo", "--model", str(model_dir), "--problems", "1")
    assert code == 0, err
    assert "note: no MRP head" in out
    assert not any(line.startswith('{"demo"') for line in out.splitlines())


def test_eval_writes_and_resumes(saved_model_and_head, tmp_path, capsys):
    model_dir, _ = saved_model_and_head
    argv = ["eval", "--task", "arith", "--model", str(model_dir), "--mode", "dynamic",
            "--threshold", "0.5", "--max-new-tokens", "6", "--batch-size", "2",
            "--out", str(tmp_path)]
    code, out, err = run_cli(capsys, *argv, "--limit", "2")
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["n"], summary["decoded"], summary["config"]["threshold"]) == (2, 2, 0.5)
    assert summary["head"] is None
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2
    code, out, err = run_cli(capsys, *argv, "--limit", "3")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["decoded"] == 1
    code, out, err = run_cli(capsys, *argv[:-2], "--max-new-tokens", "7", "--out", str(tmp_path))
    assert code == 2 and "config.max_new_tokens 6 there, 7 now" in err


def test_bench_writes_table_json_and_plots(saved_model_and_head, tmp_path, capsys):
    model_dir, head_dir = saved_model_and_head
    code, out, err = run_cli(capsys, "bench", "--task", "arith-code", "--model", str(model_dir),
                             "--head", str(head_dir), "--grid", "speculative:2@0.5,dynamic:0.5",
                             "--limit", "2", "--max-new-tokens", "6", "--out",
                             str(tmp_path / "bench"),
                             "--json")
    assert code == 0, err
    assert "| arith-code | speculative:2@0.5 |" in out
    assert "warm-up arith-code" in err and "arith-code speculative:2@0.5" in err  # progress
    report = json.loads(out.strip().splitlines()[-1])
    assert [row["label"] for row in report["rows"]] == ["static", "speculative-self:2@0.5",
                                                        "speculative:2@0.5", "dynamic:0.5"]
    spec = report["rows"][2]
    assert spec["speedup_vs_self"] > 0 and report["rows"][1]["head_forwards"] == 0
    assert (spec["reproduces"], spec["identical_to_rule"], spec["differing_from_rule"]) == \
        ("dynamic:0.5", 1.0, 0)
    assert report["config"]["head"] == str(head_dir.resolve())
    assert json.loads((tmp_path / "bench" / "bench.json").read_text()) == report
    for name in ("bench.json", "bench.md", "pareto.md", "accuracy_vs_speedup.png",
                 "accuracy_vs_tokens_per_forward.png"):
        assert (tmp_path / "bench" / name).is_file()


def test_bench_pareto_sweeps_every_family_and_judges_it(saved_model_and_head, tmp_path, capsys):
    model_dir, head_dir = saved_model_and_head
    code, out, err = run_cli(capsys, "bench", "--pareto", "--task", "arith", "--model",
                             str(model_dir), "--head", str(head_dir), "--limit", "2",
                             "--max-new-tokens", "4", "--out", str(tmp_path / "bench"))
    assert code == 0, err
    assert "| vs frontier (points) |" in out.splitlines()[0]
    assert out.strip().splitlines()[-1].startswith("wrote ")  # the JSON only with --json
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["config"]["batch_size"] == 50
    labels = [row["label"] for row in report["rows"]]
    assert labels[0] == "static" and "direct:4" in labels and "direct:6" not in labels  # block 4
    assert {row["mode"] for row in report["rows"]} == {"static", "dynamic", "direct", "remask",
                                                       "entropy", "speculative"}
    assert (tmp_path / "bench" / "pareto.md").is_file()


def test_bench_without_a_head_leaves_mrp_modes_out(saved_model_and_head, tmp_path, capsys):
    model_dir, _ = saved_model_and_head
    code, out, err = run_cli(capsys, "bench", "--task", "arith", "--model", str(model_dir),
                             "--grid", "direct:1,dynamic:0.5", "--limit", "1",
                             "--max-new-tokens", "4", "--out", str(tmp_path / "bench"))
    assert code == 0, err
    assert "note: no MRP head" in out and "direct:1" in out.splitlines()[0]
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [row["label"] for row in report["rows"]] == ["static", "dynamic:0.5"]


def test_bench_replaces_an_earlier_report_only_with_force(saved_model_and_head, tmp_path,
                                                          capsys):
    model_dir, _ = saved_model_and_head
    argv = ["bench", "--task", "arith", "--model", str(model_dir), "--grid", "dynamic:0.5",
            "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "bench")]
    assert run_cli(capsys, *argv)[0] == 0
    written = {path: path.read_bytes() for path in (tmp_path / "bench").iterdir()}
    code, out, err = run_cli(capsys, *argv, "--grid", "static")
    assert code == 2 and err == (f"mrp: error: --out {tmp_path / 'bench'} is not empty; pass "
                                 "--force to overwrite it\n")
    assert {path: path.read_bytes() for path in (tmp_path / "bench").iterdir()} == written
    code, out, err = run_cli(capsys, *argv, "--grid", "static", "--force")
    assert code == 0, err
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [row["label"] for row in report["rows"]] == ["static"]


BAD_EVAL = {
    "bad grid": (["bench", "--grid", "static,dynamic:2"], "grid entry 'dynamic:2': threshold"),
    "limit 0": (["eval", "--limit", "0"], "--limit must be >= 1"),
    "data for a generated task": (["eval", "--data", "x.jsonl"], "takes no data file"),
    "mrp mode without head": (["eval", "--mode", "direct"], "needs an MRP head"),
    "eval batch size 0": (["eval", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    "bench batch size 0": (["bench", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
}


@pytest.mark.parametrize("case", BAD_EVAL)
def test_eval_and_bench_bad_input_fail_cleanly(saved_model_and_head, tmp_path, capsys, case):
    model_dir, _ = saved_model_and_head
    (command, *extra), message = BAD_EVAL[case]
    code, out, err = run_cli(capsys, command, "--task", "arith", "--model", str(model_dir),
                             "--out", str(tmp_path / "out"), *extra)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()


LOOKAHEAD_BEYOND_BLOCK = {  # the tiny model's blocks hold 4 tokens
    "generate": (["generate", "--prompt", "hi", "--mode", "direct", "--lookahead", "5"],
                 "lookahead (5) cannot exceed block_size (4)"),
    "eval": (["eval", "--task", "arith", "--mode", "speculative", "--lookahead", "5"],
             "lookahead (5) cannot exceed block_size (4)"),
    "bench": (["bench", "--task", "arith", "--grid", "speculative:5"],
              "grid entry 'speculative:5@0.9': lookahead (5) cannot exceed block_size (4)"),
    "bench, block size given": (
        ["bench", "--task", "arith", "--grid", "direct:9", "--block-size", "4"],
        "grid entry 'direct:9': lookahead (9) cannot exceed block_size (4)"),
}


@pytest.mark.parametrize("case", LOOKAHEAD_BEYOND_BLOCK)
def test_lookahead_beyond_the_block_fails_cleanly(saved_model_and_head, tmp_path, capsys, case):
    model_dir, head_dir = saved_model_and_head
    argv, message = LOOKAHEAD_BEYOND_BLOCK[case]
    out_dir = tmp_path / "out"
    extra = ["--out", str(out_dir)] if argv[0] != "generate" else []
    code, out, err = run_cli(capsys, *argv, "--model", str(model_dir), "--head", str(head_dir),
                             "--max-new-tokens", "4", *extra)
    assert code == 2 and err == f"mrp: error: {message}\n"
    assert not out_dir.exists()


@pytest.mark.parametrize("block_size", [3, 8])
def test_a_decode_block_that_does_not_divide_the_models_is_refused(tiny_model, block_size):
    """The tiny model is trained at block 4: blocks of 3 or 8 would cross its block
    boundaries; 1, 2 and 4 tile it. Pipeline refuses them (the driver takes any)."""
    pipe = Pipeline(model=tiny_model, tokenizer=None, directory=Path("tiny"))
    with pytest.raises(ValueError, match=rf"block size {block_size} does not divide the block "
                       r"size 4 tiny was trained with: .*use one of 1, 2, 4$"):
        pipe.decoder(DecodeConfig(block_size=block_size))
    pipe.decoder(DecodeConfig(block_size=2))


@pytest.mark.parametrize("block_size", ["3", "7", "8"])
def test_a_block_size_that_does_not_tile_the_models_is_refused(saved_model_and_head, capsys,
                                                               block_size):
    model_dir, _ = saved_model_and_head  # trained at block size 4
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "hi",
                             "--block-size", block_size, "--lookahead", "1")
    assert code == 2 and out == ""
    assert err == (f"mrp: error: block size {block_size} does not divide the block size 4 "
                   f"{model_dir} was trained with: its blocks would cross the trained block "
                   "boundaries; use one of 1, 2, 4\n")


def test_a_head_that_does_not_fit_stops_only_the_modes_that_use_it(saved_model_and_head,
                                                                     capsys):
    model_dir, head_dir = saved_model_and_head  # the head was trained at block size 4
    argv = ["generate", "--model", str(model_dir), "--head", str(head_dir), "--prompt", "hi",
            "--block-size", "2", "--lookahead", "2", "--max-new-tokens", "4"]
    for mode in ("static", "dynamic"):
        code, out, err = run_cli(capsys, *argv, "--mode", mode)
        assert code == 0, err
    code, out, err = run_cli(capsys, *argv, "--mode", "speculative")
    assert code == 2 and out == ""
    assert re.fullmatch(r"mrp: error: the head in \S+ was trained on another backbone: "
                        r".*block_size: head 4 vs backbone 2.*\n", err), err


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_an_out_that_is_a_file_fails_cleanly(saved_model_and_head, tmp_path, capsys, command):
    model_dir, _ = saved_model_and_head
    (tmp_path / "outs").mkdir()
    path = tmp_path / "outs" / "taken"
    path.write_text("keep me")
    for out, message in ((path, f"{path} exists and is not a directory"),
                         (path / "sub", f"{path / 'sub'} cannot be a directory: {path} is not")):
        code, stdout, err = run_cli(capsys, command, "--task", "arith", "--model", str(model_dir),
                                    "--limit", "1", "--out", str(out))
        assert code == 2 and stdout == "" and err.startswith(f"mrp: error: {message}"), err
    assert path.read_text() == "keep me" and list(path.parent.iterdir()) == [path]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", ["eval", "bench"])
def test_an_unwritable_out_fails_before_any_decode(saved_model_and_head, capsys, monkeypatch,
                                                   command):
    """/proc takes no new files, even from root (whom chmod would not stop): the command
    refuses --out before it loads the model, not after decoding the whole grid."""
    model_dir, _ = saved_model_and_head

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(Pipeline, "load", no_load)
    out = "/proc/mrp-bench-out"
    code, stdout, err = run_cli(capsys, command, "--task", "arith", "--model", str(model_dir),
                                "--limit", "1", "--out", out)
    assert code == 2 and stdout == "", err
    assert err.startswith(f"mrp: error: cannot write the output directory {out}: writing in "
                          "/proc fails"), err


def test_eval_interrupted_says_what_is_saved_and_resumes_exactly(saved_model_and_head, tmp_path,
                                                                 capsys, monkeypatch):
    model_dir, _ = saved_model_and_head
    argv = ["eval", "--task", "arith", "--model", str(model_dir), "--limit", "4",
            "--batch-size", "2", "--max-new-tokens", "6", "--out"]
    assert run_cli(capsys, *argv, str(tmp_path / "whole"))[0] == 0
    generate, calls = Pipeline.generate, []

    def interrupt_the_second_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "generate", interrupt_the_second_batch)
    samples = tmp_path / "run" / "samples.jsonl"
    code, out, err = run_cli(capsys, *argv, str(tmp_path / "run"))
    assert code == 130 and out == "" and "Traceback" not in err
    resume = shlex.join(["mrp", *argv, str(tmp_path / "run")])
    assert err.splitlines()[-1] == (f"mrp: interrupted; 2 of 4 samples are saved in {samples}; "
                                    f"resume with: {resume}")
    monkeypatch.undo()
    code, out, err = run_cli(capsys, *argv, str(tmp_path / "run"))
    assert code == 0 and json.loads(out.splitlines()[-1])["decoded"] == 2
    assert samples.read_text() == (tmp_path / "whole" / "samples.jsonl").read_text()


def test_train_backbone_smoke(tmp_path, capsys, caplog):
    """It also says what it does from the start: a line before torch loads, then each phase
    (data, tokenizer, packing) before it runs."""
    caplog.set_level(logging.INFO, logger="mrp_dlm.training")
    out_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "backbone", "--out", str(out_dir), "--preset", "tiny",
                             "--train-steps", "2", "--train-examples", "40", "--batch-size", "2",
                             "--seq-len", "128", "--vocab-size", "300")
    assert code == 0, err
    assert (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()
    assert err.startswith(f"mrp train backbone: preset tiny, 2 steps, into {out_dir}; loading "
                          "torch\n")
    phases = ["training a 300-token tokenizer on 160 texts",
              "reading, tokenizing and packing 40 problems per task (arith, arith-code) into "
              "rows of 128 tokens"]
    assert [line for line in caplog.messages if line in phases] == phases


def test_train_head_without_a_model_trains_on_the_embedded_one(tmp_path, capsys, monkeypatch):
    from mrp_dlm.training import head_loop

    seen = []
    monkeypatch.setattr(head_loop, "run_training", lambda config, world: seen.append(config))
    code, out, err = run_cli(capsys, "train", "head", "--out", str(tmp_path / "head"))
    assert code == 0, err
    assert err.startswith("mrp train head: on the embedded model, 2000 steps")
    assert seen[0].model == str(embedded_model_dir())


def test_train_resume_says_what_it_resumes_from(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="mrp_dlm.training")
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    argv = ["train", "backbone", "--out", str(out_dir), "--preset", "tiny",
            "--train-steps", "2", "--train-examples", "40", "--batch-size", "2", "--seq-len", "128",
            "--vocab-size", "300", "--resume"]
    assert run_cli(capsys, *argv)[0] == 0
    assert (f"--resume: nothing to resume in {out_dir} (no train_state.pt); starting from "
            "scratch") in caplog.text
    caplog.clear()
    assert run_cli(capsys, *argv)[0] == 0
    assert f"resuming from step 2 of 2 ({out_dir / 'train_state.pt'})" in caplog.text


BAD_GENERATE = {
    "empty prompt": (["--prompt", ""], "empty"),
    "block size < 1": (["--block-size", "0"], "block_size must be >= 1"),
    "steps > block size": (["--block-size", "4", "--steps", "5"], "steps \\(5\\) cannot exceed"),
    "steps < 1": (["--steps", "0"], "steps must be >= 1"),
    "threshold > 1": (["--threshold", "1.5"], "threshold must be in \\(0, 1\\]"),
    "threshold 0": (["--threshold", "0"], "threshold must be in \\(0, 1\\]"),
    "unknown mode": (["--mode", "fastest"], "unknown mode 'fastest'"),
    "too long": (["--max-new-tokens", "100000"], "exceeds the model's maximum length"),
    "mask id outside vocab": (["--mask-token-id", "100000"], "mask_token_id 100000 is outside"),
    "non-UTF-8 prompt": (["--prompt", "ab\udcff"],  # how argv carries the byte 0xff
                         r"the prompt is not valid UTF-8 text \(byte 0xff at character 2\)"),
    "unknown device": (["--device", "foo"], "unknown device 'foo'; available: cpu"),
    "missing GPU": (["--device", "cuda:99"], "device 'cuda:99' is not available: .*available: cpu"),
}


@pytest.mark.parametrize("case", BAD_GENERATE)
def test_generate_bad_input_fails_cleanly(saved_model_and_head, capsys, case):
    model_dir, _ = saved_model_and_head
    extra, message = BAD_GENERATE[case]
    argv = ["generate", "--model", str(model_dir), "--max-new-tokens", "4", "--prompt", "hi",
            *extra]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert re.search(message, err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_cpu_only_machine_fails_cleanly(capsys):
    # README's second example, on a machine without CUDA.
    code, out, err = run_cli(capsys, "generate", "--dtype", "bfloat16", "--device", "cuda",
                             "--prompt", "What is 17 * 23?", "--chat")
    assert code == 2 and out == ""
    assert re.fullmatch(r"mrp: error: device 'cuda' is not available: .*; available: cpu\n", err)


BAD_FILES = {
    "garbage tokenizer.json": ("tokenizer.json", "garbage",
                               "tokenizer.json is not a readable tokenizer: expected value"),
    "config.json a list": ("config.json", "[1, 2]",
                           "config.json must hold a JSON object, not a list"),
    "config.json a string": ("config.json", '"sdar"',
                             "config.json must hold a JSON object, not a string"),
    "tokenizer_config.json not JSON": ("tokenizer_config.json", "{", "is not valid JSON"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_broken_checkpoint_file_fails_cleanly(saved_model_and_head, capsys, case):
    model_dir, _ = saved_model_and_head
    name, text, message = BAD_FILES[case]
    (model_dir / name).write_text(text)
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "hi",
                             "--chat", "--max-new-tokens", "4")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"mrp: error: {model_dir / name}") and message in err, err


def test_missing_model_dir_fails_cleanly(tmp_path, capsys):
    code, out, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert code == 2 and "model directory not found" in err


# --- export and the published MRP layout ------------------------------------------------------

def test_export_writes_a_release_that_generates_without_head(saved_model_and_head, tmp_path,
                                                             capsys):
    model_dir, head_dir = saved_model_and_head
    out = tmp_path / "release"
    code, stdout, err = run_cli(capsys, "export", "--model", str(model_dir), "--head",
                                str(head_dir), "--out", str(out))
    assert code == 0, err
    assert f"to {out}" in stdout
    assert json.loads((out / "config.json").read_text())["architectures"] == ["SDARMRPForCausalLM"]
    assert (out / "tokenizer.json").is_file()
    for mode in ("direct", "speculative", "remask"):
        argv = ["generate", "--prompt", "7 + 5", "--mode", mode, "--max-new-tokens", "9", "--json"]
        code, theirs, err = run_cli(capsys, *argv, "--model", str(out))
        assert code == 0, err
        code, ours, err = run_cli(capsys, *argv, "--model", str(model_dir), "--head", str(head_dir))
        assert code == 0, err
        assert json.loads(theirs)["token_ids"] == json.loads(ours)["token_ids"]


def test_export_refuses_a_non_empty_out_unless_forced(saved_model_and_head, tmp_path, capsys):
    model_dir, head_dir = saved_model_and_head
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    argv = ["export", "--model", str(model_dir), "--head", str(head_dir), "--out", str(out)]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 2
    assert err == f"mrp: error: --out {out} is not empty; pass --force to overwrite it\n"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    code, stdout, err = run_cli(capsys, *argv, "--force", "--dtype", "bfloat16")
    assert code == 0, err
    assert Pipeline.load(out, dtype="bfloat16").head is not None


def test_export_without_a_head_fails_cleanly(saved_model_and_head, tmp_path, capsys):
    model_dir, _ = saved_model_and_head
    code, stdout, err = run_cli(capsys, "export", "--model", str(model_dir), "--out",
                                str(tmp_path / "out"))
    assert code == 2 and err == (f"mrp: error: {model_dir} has no MRP head to export with it: "
                                 "give --head DIR\n")


def test_export_defaults_to_the_embedded_model_and_head(tmp_path, capsys):
    code, stdout, err = run_cli(capsys, "export", "--out", str(tmp_path / "embedded"))
    assert code == 0, err
    embedded, release = Pipeline.load(), Pipeline.load(tmp_path / "embedded")
    for ours, theirs in ((embedded.model, release.model), (embedded.head, release.head)):
        for name, tensor in ours.state_dict().items():
            assert torch.equal(theirs.state_dict()[name], tensor), name
    assert release.tokenizer is not None


def test_help_and_argument_errors_do_not_import_torch():
    """`mrp --help` and a bad flag answer from the parser alone: no torch, well under a
    second (each command imports what it runs)."""
    script = ("from mrp_dlm import cli\n"
              "for argv in (['--help'], ['serve', '--help'], ['bench', '--task', 'nope']):\n"
              "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n")
    assert {"torch", "tqdm", "sglang"} & modules_after(script) == set()


def test_every_flag_field_has_its_help_in_metadata():
    """CLI help comes from `field(metadata={"help": ...})`: a field that becomes a flag
    without it would show an empty help line."""
    import dataclasses

    from mrp_dlm.config import DecodeConfig, DistillConfig, HeadTrainConfig, TrainConfig
    from mrp_dlm.flags import scalar_type
    from mrp_dlm.serving.serve_config import ServeConfig

    for cls in (DecodeConfig, DistillConfig, HeadTrainConfig, TrainConfig, ServeConfig):
        bare = [spec.name for spec in dataclasses.fields(cls)
                if spec.init and scalar_type(str(spec.type)) and not spec.metadata.get("help")]
        assert not bare, f"{cls.__name__}: no metadata help for {bare}"
