"""Ctrl-C in training: the step reached is saved whatever --save-every says, one line says
where and how to resume, and the resumed run ends with the uninterrupted run's head."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mrp_dlm import cli
from mrp_dlm.config import HeadTrainConfig
from mrp_dlm.training import head_loop
from mrp_dlm.training.run import (LOG_FILE, STATE_FILE, Progress, RunHooks, RunLog, StepResult,
                                  TrainingInterrupted, run_steps)
from training.test_head_training import model_dir  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]


def fake_loop(tmp_path: Path, interrupt_at: int, where: str, steps: int = 10):
    """run_steps with hooks that record saves and send SIGINT to this process at step
    `interrupt_at`, inside the step (`where` = "step") or after it ("after")."""
    config = HeadTrainConfig(out=str(tmp_path), train_steps=steps, save_every=4)
    saves = []

    def step(index: int) -> StepResult:
        if where == "step" and index + 1 == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the step goes on: the signal is deferred to its end
        return StepResult(1.0, 0.0, 8)

    def after(progress: Progress, done: bool) -> dict:
        if where == "after" and progress.step == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        return {}

    hooks = RunHooks(step, lambda progress: saves.append(progress.step), after)
    # Python's own Ctrl-C handler, whatever this process inherited: a shell that starts a
    # job in the background without job control starts it with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(TrainingInterrupted) as caught:
            run_steps(config, Progress(), hooks, RunLog(tmp_path / LOG_FILE, [], False),
                      "test")
    finally:
        signal.signal(signal.SIGINT, previous)
    return saves, str(caught.value)


@pytest.mark.parametrize("where", ["step", "after"])
def test_ctrl_c_saves_the_step_reached(tmp_path, where):
    saves, message = fake_loop(tmp_path, 6, where)
    assert saves == [4, 6]  # the periodic save, then the step reached (the step finished)
    assert message == f"interrupted at step 6 of 10; saved step 6 to {tmp_path}"


def test_ctrl_c_right_after_a_save_does_not_save_again(tmp_path):
    saves, message = fake_loop(tmp_path, 4, "after")
    assert saves == [4] and message.endswith(f"saved step 4 to {tmp_path}")


def train_argv(model: Path, out: Path, steps: int) -> list[str]:
    return ["train", "head", "--model", str(model), "--out", str(out), "--tasks", "arith",
            "--train-examples", "40", "--eval-examples", "4", "--eval-prompts", "0",
            "--seq-len", "128", "--batch-size", "4", "--train-steps", str(steps),
            "--head-layers", "1", "--log-every", "1", "--eval-every", "1000"]


def default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal delivers it (this test may run in a
    background job, which starts with SIGINT ignored, and a child inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_when_logged(argv: list[str], log: Path, lines: int) -> subprocess.CompletedProcess:
    """`mrp ARGV` in a subprocess, sent SIGINT once its log has `lines` lines."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen([sys.executable, "-m", "mrp_dlm.cli", *argv], env=env, cwd=REPO,
                            preexec_fn=default_sigint,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= lines:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.exact_arithmetic
def test_an_interrupted_head_resumes_to_the_uninterrupted_head(model_dir, tmp_path,  # noqa: F811
                                                               capsys):
    steps, out = 30, tmp_path / "interrupted"
    argv = train_argv(model_dir, out, steps)
    done = interrupt_when_logged(argv, out / LOG_FILE, 3)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("mrp: ")]
    assert len(lines) == 1, done.stderr[-3000:]
    reached = int(lines[0].split("interrupted at step ")[1].split()[0])
    assert 3 <= reached < steps  # below --save-every (250): only the interrupt saved it
    resume = shlex.join(["mrp", *argv, "--resume"])
    assert lines[0] == (f"mrp: interrupted at step {reached} of {steps}; saved step {reached} "
                        f"to {out}; resume with: {resume}")
    assert torch.load(out / STATE_FILE, weights_only=True)["progress"]["step"] == reached

    code = cli.main(argv)  # a rerun without --resume refuses
    assert code == 2 and "--resume" in capsys.readouterr().err
    assert cli.main([*argv, "--resume"]) == 0
    assert cli.main(train_argv(model_dir, tmp_path / "straight", steps)) == 0
    expected, actual = (load_file(str(d / "model.safetensors"))
                        for d in (tmp_path / "straight", out))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_a_rerun_into_a_saved_run_refuses_before_loading(model_dir, tmp_path,  # noqa: F811
                                                         monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / STATE_FILE).write_bytes(b"")

    def never(*args, **kwargs):
        raise AssertionError("loaded before refusing")

    monkeypatch.setattr(head_loop, "load_frozen_backbone", never)
    monkeypatch.setattr(head_loop, "load_data", never)
    assert cli.main(train_argv(model_dir, out, 5)) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"mrp: error: {out} already holds a training run; pass "
                                    "--resume to continue it or choose another --out")
