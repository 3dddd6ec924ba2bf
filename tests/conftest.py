"""Shared fixtures: tiny seeded random backbones, a saved checkpoint, the SDAR fixture files.

The tiny model has odd, mutually distinct sizes (vocab 99, hidden 32,
2 layers, 4 heads / 2 kv heads, intermediate 37), float32, block 4, mask id 98, stop id 97.
Weights are drawn with a larger std than a real init so that the decode is not degenerate
(peaked, varied distributions instead of near-uniform ones).

Deliberately not here: expected values (each test states its own) and the slow reference
decoder (see `reference.py`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from mrp_dlm.cli import main
from mrp_dlm.config import BackboneConfig, HeadConfig
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.head_loading import save_head
from mrp_dlm.model.loading import save_backbone
from mrp_dlm.training.tokenizer import save_tokenizer, train_tokenizer

# Test modules import the slow reference decoder as `import reference`.
sys.path.insert(0, str(Path(__file__).parent))
# Tiny models gain nothing from intra-op threads, and on a busy shared machine the thread
# pool's spin-waits make every op ~10x slower.
torch.set_num_threads(1)

# MRP_TEST_LOGIT_NOISE=1e-6 runs the suite with every logit the library computes multiplied
# by (1 + 1e-6 * N(0, 1)). No exactness test may hinge on float noise (their cases are drawn
# with a decision margin, see reference.py), so the suite must still pass; tests marked
# `exact_arithmetic` check bit-level facts of unperturbed arithmetic and are skipped.
LOGIT_NOISE = float(os.environ.get("MRP_TEST_LOGIT_NOISE", "0"))


if LOGIT_NOISE:
    from margins import noisy

    Backbone.logits = noisy(Backbone.logits, LOGIT_NOISE, torch.Generator().manual_seed(12345))


def pytest_collection_modifyitems(config, items):
    if LOGIT_NOISE:
        skip = pytest.mark.skip(reason="checks unperturbed arithmetic (MRP_TEST_LOGIT_NOISE set)")
        for item in items:
            if "exact_arithmetic" in item.keywords:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    from reference import CASES, MARGIN

    if CASES["drawn"]:
        terminalreporter.write_line(
            f"exactness cases: {CASES['kept']} kept, {CASES['drawn'] - CASES['kept']} of "
            f"{CASES['drawn']} drawn skipped for a decision within {MARGIN} of flipping")

TINY = dict(vocab_size=99, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=37, block_size=4, mask_token_id=98, stop_token_ids=(97,))
WEIGHT_STD = 0.5  # std of every projection and embedding entry
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def tiny_config(**overrides) -> BackboneConfig:
    """The tiny BackboneConfig with some fields replaced."""
    return BackboneConfig(**{**TINY, **overrides})


def random_backbone(config: BackboneConfig, seed: int = 0, std: float = WEIGHT_STD) -> Backbone:
    """A float32 Backbone in eval mode with seeded N(0, std) weights and jittered norms."""
    generator = torch.Generator().manual_seed(seed)
    model = Backbone(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)  # param's shape
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)
    return model.eval()


@pytest.fixture
def make_model():
    """Factory: make_model(seed=0, std=0.4, **BackboneConfig overrides) -> Backbone."""

    def make(seed: int = 0, std: float = WEIGHT_STD, **overrides) -> Backbone:
        return random_backbone(tiny_config(**overrides), seed=seed, std=std)

    return make


@pytest.fixture
def tiny_model() -> Backbone:
    """The default tiny model: block 4, untied lm_head, seed 0."""
    return random_backbone(tiny_config())


@pytest.fixture
def checkpoint_dir(tmp_path: Path, tiny_model: Backbone) -> Path:
    """`tiny_model` saved as a single-file safetensors checkpoint."""
    directory = tmp_path / "tiny"
    save_backbone(tiny_model, directory)
    return directory


@pytest.fixture
def fixtures_dir() -> Path:
    """The published SDAR metadata in ../shared/fixtures; skips when a clone lacks it."""
    if not FIXTURES.is_dir():
        pytest.skip(f"SDAR fixtures not found at {FIXTURES}")
    return FIXTURES


def random_head(model: Backbone, seed: int, norm: float = 1.0, std: float = 0.5,
                layers: int = 1) -> MRPHead:
    """A badly initialised head: N(0, std) matrices and norms near `norm` (the final one too,
    which a fresh head has at zero), so it predicts large, wrong residuals."""
    generator = torch.Generator().manual_seed(500 + seed)
    head = MRPHead(model.config, HeadConfig(num_layers=layers))
    with torch.no_grad():
        for param in head.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(std * noise if param.dim() == 2 else norm * (1.0 + 0.1 * noise))
    return head.eval()


@pytest.fixture
def saved_model_and_head(tmp_path):
    texts = ["What is 7 + 5? 7 + 5 = 12\n#### 12", "Tom has 3 apples and buys 4 more.",
             "def solve():\n    return 3 * 4"] * 4
    tokenizer = train_tokenizer(texts, vocab_size=300)
    vocab = tokenizer.get_vocab_size()
    model = random_backbone(tiny_config(vocab_size=vocab, mask_token_id=3, stop_token_ids=(2,)))
    save_backbone(model, tmp_path / "model")
    save_tokenizer(tokenizer, tmp_path / "model")
    save_head(random_head(model, 0, norm=0.3), model, tmp_path / "head")
    return tmp_path / "model", tmp_path / "head"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def private_cost_cache(tmp_path_factory, monkeypatch):
    """The round cost cache (`decoding/cost_cache.py`) of each test, and of the processes
    it starts, lies in a fresh temporary folder: no test reads or writes the user's cache
    dir, nor the costs another test measured."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
