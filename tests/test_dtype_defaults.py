"""The dtype a model loads in when none is given: bfloat16 on a CUDA device, float32
elsewhere (`config.dtype_for`), at every entry point: `mrp generate / eval / bench / demo /
distill` (--dtype), `Pipeline.load`, lm-eval's `mrp` model and training's --bf16.

No GPU needed: the weights' load is replaced by a stand-in that records the dtype it is
asked for and stops there, so the rule is checked on its way to the device.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from mrp_dlm import pipeline
from mrp_dlm.cli import build_parser, main
from mrp_dlm.config import HeadTrainConfig, TrainConfig, dtype_for
from mrp_dlm.flags import build_dataclass
from mrp_dlm.pipeline import Pipeline


class Stop(ValueError):
    """Raised by the stand-in load: the dtype was chosen, nothing loads."""


@pytest.fixture
def requested(monkeypatch) -> list[tuple[torch.dtype, str]]:
    """(dtype, device) of every backbone load asked of the pipeline; each load stops."""
    asked = []

    def load(path, dtype, device, *rest):
        asked.append((dtype, str(device)))
        raise Stop(f"stand-in load: {dtype} on {device}")

    monkeypatch.setattr(pipeline, "load_backbone", load)
    return asked


def test_the_rule():
    assert dtype_for("cuda") == dtype_for("cuda:1") == "bfloat16"
    assert dtype_for("cpu") == dtype_for("mps") == "float32"
    assert dtype_for("cuda", "float32") == "float32" and dtype_for("cpu", "float16") == "float16"


@pytest.mark.parametrize("device,dtype,want", [("cuda", None, torch.bfloat16),
                                               ("cuda:0", None, torch.bfloat16),
                                               ("cpu", None, torch.float32),
                                               ("cuda", "float32", torch.float32),
                                               ("cpu", "bfloat16", torch.bfloat16)])
def test_pipeline_load(requested, device, dtype, want):
    with pytest.raises(Stop):
        Pipeline.load(dtype=dtype, device=device)
    assert requested == [(want, device)]


def test_pipeline_reports_its_dtype(tiny_model):
    assert Pipeline(tiny_model, None, None).dtype == "float32"
    assert Pipeline(tiny_model.to(torch.bfloat16), None, None).dtype == "bfloat16"


@pytest.mark.parametrize("command", ["generate", "eval", "bench", "demo", "distill"])
def test_every_model_command_says_the_rule(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "bfloat16 on a CUDA device, float32 elsewhere" in text


@pytest.mark.parametrize("argv,want", [(["--device", "cuda"], torch.bfloat16),
                                       (["--device", "cuda", "--dtype", "float32"], torch.float32),
                                       ([], torch.float32)])
def test_mrp_generate_loads_in_the_devices_dtype(capsys, requested, argv, want):
    code, out, err = run_cli(capsys, "generate", "--prompt", "2 + 3", *argv)
    assert code == 2 and "stand-in load" in err
    assert requested[0][0] == want


def test_lm_eval_model_loads_in_the_devices_dtype(requested):
    pytest.importorskip("lm_eval")
    from mrp_dlm.eval.harness import MrpLM

    # cuda:1: lm-eval's own default, cuda:0, falls back to the CPU on a machine without CUDA
    for device, dtype, want in (("cuda:1", None, torch.bfloat16), ("cpu", None, torch.float32),
                                ("cuda:1", "float16", torch.float16)):
        with pytest.raises(Stop):
            MrpLM(device=device, dtype=dtype)
        assert requested.pop() == (want, device)


@pytest.mark.parametrize("config", [TrainConfig, HeadTrainConfig])
def test_training_autocasts_to_bfloat16_on_cuda_unless_told(config):
    assert config(out="run", device="cuda").bf16 is True
    assert config(out="run", device="cuda:3").bf16 is True
    assert config(out="run").bf16 is False  # the CPU default
    assert config(out="run", device="cuda", bf16=False).bf16 is False
    assert config(out="run", device="cpu", bf16=True).bf16 is True


@pytest.mark.parametrize("argv,want", [(["--device", "cuda"], True),
                                       (["--device", "cuda", "--no-bf16"], False),
                                       (["--bf16"], True), ([], False)])
def test_train_flags_resolve_bf16(argv, want):
    parser, fields = build_parser()
    args = parser.parse_args(["train", "head", "--out", "run", *argv])
    assert build_dataclass(HeadTrainConfig, args, fields["train head"]).bf16 is want
