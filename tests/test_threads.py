"""The CPU thread rule (sizes -> threads, environment, request, device) and its CLI wiring."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import run_cli
from mrp_dlm import threads
from mrp_dlm.threads import PARAMS_PER_THREAD, auto_threads, choose_threads
from training.test_head_training import model_dir  # noqa: F401 (a fixture)

M = 1_000_000


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("parameters, cpus, threads", [
    (22_000, 2, 1),  # the tiny test model
    (1.8 * M, 2, 1),  # the embedded model
    (1.7e9, 2, 1),  # a 1.7B model on a 2-core laptop: one core stays free
    (1.8 * M, 16, 1),  # small models get one thread however many CPUs there are
    (PARAMS_PER_THREAD * 2 - 1, 16, 1),
    (PARAMS_PER_THREAD * 2, 16, 2),
    (216 * M, 16, 4),
    (1.7e9, 16, 15),  # big models get every CPU but one
    (1.7e9, 1, 1),
])
def test_auto_threads_follow_the_size_and_leave_a_cpu(parameters, cpus, threads):
    assert auto_threads(int(parameters), cpus) == threads


def test_request_beats_environment_beats_rule():
    environ = {"OMP_NUM_THREADS": "3"}
    assert choose_threads(2, 10**9, "cpu", environ, 16).threads == 2
    assert choose_threads(None, 10**9, "cpu", environ, 16).threads is None
    assert choose_threads(0, 10**9, "cpu", {"MKL_NUM_THREADS": "4"}, 16).threads is None
    choice = choose_threads(None, 10**9, "cpu", {"OMP_NUM_THREADS": ""}, 16)
    assert choice.threads == 15 and "usable CPUs" in choice.reason
    assert choose_threads(0, 10**9, "cpu", {"TORCH_NUM_THREADS": "1"}, 16).threads == 15


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "meta"])
def test_other_devices_keep_their_threads(device):
    assert choose_threads(4, 10**9, device, {}, 16).threads is None


def test_negative_request_fails():
    with pytest.raises(ValueError, match="threads must be >= 0"):
        choose_threads(-1, 10, "cpu", {}, 2)


@pytest.mark.parametrize("flag, expected", [(["--threads", "3"], 3), ([], 1),
                                            (["--threads", "0"], 1)])
def test_generate_flag_sets_torch_threads(saved_model_and_head, capsys, caplog, monkeypatch,
                                          restore_threads, flag, expected):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    model_dir, _ = saved_model_and_head
    with caplog.at_level(logging.INFO, logger="mrp_dlm.threads"):
        code, _, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "7 + 5",
                               "--max-new-tokens", "4", *flag)
    assert code == 0, err
    assert torch.get_num_threads() == expected
    assert f"torch threads: {expected}" in caplog.text


def test_environment_is_kept_without_the_flag(saved_model_and_head, capsys, caplog, monkeypatch,
                                              restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    model_dir, _ = saved_model_and_head
    with caplog.at_level(logging.INFO, logger="mrp_dlm.threads"):
        code, _, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "7 + 5",
                               "--max-new-tokens", "4")
    assert code == 0, err
    assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS=2 is set" in caplog.text


def test_negative_flag_fails_cleanly(saved_model_and_head, capsys):
    model_dir, _ = saved_model_and_head
    code, _, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "7 + 5",
                           "--threads", "-1")
    assert code == 2 and "threads must be >= 0" in err


@pytest.mark.parametrize("requested, processes, expected", [(None, 1, 15), (None, 2, 7),
                                                            (0, 4, 3), (3, 2, 3)])
def test_training_shares_the_cpus_among_its_processes(monkeypatch, restore_threads, requested,
                                                      processes, expected):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 16)
    big = torch.nn.Linear(40_000, 25_000, bias=False, device="meta")  # 1e9 parameters, no memory
    choice = threads.set_training_threads([big], "cpu", requested, processes)
    assert choice.threads == expected == torch.get_num_threads()


@pytest.mark.parametrize("flag, expected", [(["--threads", "3"], 3), ([], 1)])
def test_train_head_sets_torch_threads(model_dir, tmp_path, capsys, caplog, monkeypatch,  # noqa: F811
                                       restore_threads, flag, expected):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="mrp_dlm.threads"):
        code, _, err = run_cli(capsys, "train", "head", "--model", str(model_dir), "--out",
                               str(tmp_path / "run"), "--tasks", "arith", "--train-examples",
                               "8", "--eval-examples", "2", "--eval-prompts", "0", "--seq-len",
                               "128", "--batch-size", "2", "--train-steps", "1",
                               "--head-layers", "1", *flag)
    assert code == 0, err
    assert torch.get_num_threads() == expected and f"torch threads: {expected}" in caplog.text
