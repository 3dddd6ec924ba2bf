"""CLI smoke tests: every subcommand runs, and bad input exits with code 2 and a message."""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_cli


def test_generate_prints_text_and_stats(saved_model_and_head, capsys):
    model_dir, _ = saved_model_and_head
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt",
                             "What is 7 + 5?", "--chat", "--max-new-tokens", "6")
    assert code == 0, err
    assert "tokens/forward" in err


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
                             "--problems", "2")
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])["demo"]
    modes = {(row["task"], row["mode"]) for row in report}
    assert ("arith", "speculative") in modes and ("arith-code", "static") in modes
    assert all(row["n"] == 2 for row in report)


def test_train_backbone_smoke(tmp_path, capsys):
    out_dir = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "backbone", "--out", str(out_dir), "--preset", "tiny",
                             "--steps", "2", "--train-examples", "40", "--batch-size", "2",
                             "--seq-len", "128", "--vocab-size", "300")
    assert code == 0, err
    assert (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()


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
}


@pytest.mark.parametrize("case", BAD_GENERATE)
def test_generate_bad_input_fails_cleanly(saved_model_and_head, capsys, case):
    model_dir, _ = saved_model_and_head
    extra, message = BAD_GENERATE[case]
    argv = ["generate", "--model", str(model_dir), "--max-new-tokens", "4", "--prompt", "hi", *extra]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert re.search(message, err), err


def test_missing_model_dir_fails_cleanly(tmp_path, capsys):
    code, out, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert code == 2 and "model directory not found" in err
