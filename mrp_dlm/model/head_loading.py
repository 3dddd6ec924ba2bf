"""MRP head checkpoints: a directory of config.json (head shape + backbone fingerprint) and
model.safetensors (the head's own weights; the backbone's embedding and lm_head are never
saved with it).

The fingerprint names the backbone a head was trained on. Loading a head onto a backbone
it does not fit fails with a message that lists every field that differs.

Deliberately not here: the head module (see `head.py`), backbone checkpoints, and the
release layout's head (`release.py`; `loading.load_head` reads either).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from mrp_dlm.config import HeadConfig
from mrp_dlm.files import write_atomic
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.files import SINGLE_FILE, CheckpointError, copy_shard, read_json
from mrp_dlm.model.head import MRPHead

HEAD_KIND = "mrp-head"
# What the head attends to, saved with it. Heads saved before the key existed attended to
# their own block only: their weights fit the context-attending head (same parameters) but
# were trained for another model, so they load only to be fine-tuned (`--init-from`).
HEAD_ATTENTION = "context"
BLOCK_ONLY_MESSAGE = (
    "the head in {directory} attends to its own block only (saved by mrp-dlm before heads "
    "attended to the context); heads now attend, as the published MRP head does, to their "
    "own keys of every earlier block, so its weights would run as another model. Retrain it "
    "(`mrp train head`), or fine-tune it with `mrp train head --init-from {directory}`")


@dataclass(frozen=True)
class Fingerprint:
    """What a head depends on in its backbone."""

    hidden_size: int  # H
    vocab_size: int  # V
    num_layers: int  # backbone depth
    block_size: int  # L the head attends within
    mask_token_id: int  # id of [MASK]
    lm_head_sha256: str  # hash of the lm_head weights rounded to bfloat16

    def differences(self, other: "Fingerprint") -> list[str]:
        return [f"{key}: head {mine!r} vs backbone {theirs!r}"
                for key, mine, theirs in zip(asdict(self), asdict(self).values(),
                                             asdict(other).values()) if mine != theirs]


def lm_head_hash(backbone: Backbone) -> str:
    """sha256 of lm_head in bfloat16, so fp32 and bf16 loads of one checkpoint agree."""
    weight = backbone.lm_head.weight.detach().to("cpu", torch.bfloat16).contiguous()
    return hashlib.sha256(weight.view(torch.int16).numpy().tobytes()).hexdigest()


def fingerprint_of(backbone: Backbone, block_size: int | None = None) -> Fingerprint:
    cfg = backbone.config
    return Fingerprint(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                       num_layers=cfg.num_layers, block_size=block_size or cfg.block_size,
                       mask_token_id=cfg.mask_token_id, lm_head_sha256=lm_head_hash(backbone))


def save_head(head: MRPHead, backbone: Backbone, directory: str | Path,
              block_size: int | None = None) -> None:
    """Write config.json (with the backbone fingerprint) and model.safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in head.named_parameters()}
    write_atomic(directory / SINGLE_FILE,
                 lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    meta = {"kind": HEAD_KIND, "attention": HEAD_ATTENTION, "head": asdict(head.config),
            "fingerprint": asdict(fingerprint_of(backbone, block_size))}
    write_atomic(directory / "config.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))


def read_head_meta(directory: Path, block_only: bool = False) -> tuple[HeadConfig, Fingerprint]:
    """The head's shape and fingerprint; `block_only`: accept a head saved before heads
    attended to the context (to fine-tune it)."""
    if not directory.is_dir():
        raise CheckpointError(f"head directory not found: {directory}")
    meta = read_json(directory / "config.json")
    if meta.get("kind") != HEAD_KIND:
        raise CheckpointError(f"{directory / 'config.json'} is not an MRP head config "
                              f"(kind {meta.get('kind')!r})")
    if meta.get("attention") != HEAD_ATTENTION and not block_only:
        raise CheckpointError(BLOCK_ONLY_MESSAGE.format(directory=directory))
    try:
        return HeadConfig(**meta["head"]), Fingerprint(**meta["fingerprint"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{directory / 'config.json'}: {error}") from error


HASHABLE_DTYPES = (torch.float32, torch.bfloat16)  # loads whose lm_head hash is the checkpoint's


def mismatch_message(directory: Path, differences: list[str], dtype: torch.dtype) -> str:
    """Why a head does not fit: another backbone, or (when only the lm_head hash differs
    and the backbone was loaded in a dtype that changes it) the load's dtype."""
    if len(differences) == 1 and differences[0].startswith("lm_head_sha256") \
            and dtype not in HASHABLE_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return (f"the head in {directory} cannot be checked against a model loaded in {name}: "
                f"its fingerprint hashes the lm_head rounded to bfloat16, which a float32 or "
                f"bfloat16 load of the checkpoint reproduces and a {name} load does not. Load "
                f"the model in its checkpoint's dtype (SGLang: --dtype float32 or bfloat16; "
                f"`mrp serve` passes the checkpoint's own)")
    return (f"the head in {directory} was trained on another backbone: "
            + "; ".join(differences))


def load_saved_head(directory: Path, backbone: Backbone, block_size: int | None = None,
                    block_only: bool = False) -> MRPHead:
    """Load a head saved by `save_head` for `backbone` (same dtype and device), checking the
    fingerprint; `block_only`: also a head saved before heads attended to the context (to
    fine-tune). Either layout: `loading.load_head`."""
    config, saved = read_head_meta(directory, block_only)
    differences = saved.differences(fingerprint_of(backbone, block_size))
    if differences:
        raise CheckpointError(mismatch_message(directory, differences,
                                               backbone.lm_head.weight.dtype))
    weights = directory / SINGLE_FILE
    if not weights.is_file():
        raise CheckpointError(f"missing file: {weights}")
    param = backbone.lm_head.weight
    with torch.device("meta"):
        head = MRPHead(backbone.config, config).to(param.dtype)
    head.to_empty(device=param.device)
    params = {name: p.data for name, p in head.named_parameters()}
    seen: set[str] = set()
    with torch.no_grad():
        copy_shard(weights, params, seen)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"{weights}: missing tensor(s) {', '.join(missing)}")
    return head.eval()
