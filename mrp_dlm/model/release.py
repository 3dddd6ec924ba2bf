"""The published MRP layout, read and written as it is: backbone and head in ONE directory.

The official releases (`SDARMRPForCausalLM`, e.g. the sdar-{1.7b,4b,8b}-mrp-3lyr heads)
store config.json (the SDAR/Qwen3 keys, block_size, mask_token_id, num_nextn_predict_layers)
and safetensors with the backbone as `model.*` and `lm_head.weight` and the head under
`mrp_modules.0.model.` (`enorm`, `hnorm`, `eh_proj`, `layers.N.*`, `norm`); no tensor is
reordered, tied aliases of the shared embedding and lm_head are not read, and the head's
fingerprint is built from config.json and the file's own lm_head. The whole layout and the
name map: docs/design.md, "The release layout".

The facade above both layouts dispatches here (`loading.read_config`, `load_backbone`,
`load_head`); `Pipeline.load` takes a release's head from its own directory.
SGLang knows only `SDARForCausalLM`, so `mrp serve` serves a release through a view of it
(`write_sdar_view`).

Deliberately not here: our own layouts (see `hf_config.py`, `head_loading.py`), the head
module (see `head.py`), and the serving launch (see `serving/launch.py`).

Shapes: H hidden, V vocab.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from mrp_dlm.config import HeadConfig
from mrp_dlm.files import write_atomic
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.files import (CheckpointError, copy_tensors, read_header, read_json,
                                 save_tensors, weight_files)
from mrp_dlm.model.head import HeadBackbone, MRPHead
from mrp_dlm.model.head_loading import (Fingerprint, fingerprint_of, lm_head_hash,
                                        mismatch_message, read_head_meta)
from mrp_dlm.model.hf_config import MOE_MODEL_TYPES, config_from_dir, config_to_hf
from mrp_dlm.model.moe import published_tensors
from mrp_dlm.model.tokenizer import TOKENIZER_FILES

RELEASE_ARCHITECTURE = "SDARMRPForCausalLM"  # config.json `architectures` of a release
SDAR_ARCHITECTURE = "SDARForCausalLM"  # what an engine that knows SDAR only is shown
SDAR_MOE_ARCHITECTURE = "SDARMoeForCausalLM"  # the same for an MoE backbone
# The official configs carry block_size (16: every published head is trained at block 16);
# a release config without it is taken to be one of those, not SDAR's default 4.
RELEASE_BLOCK_SIZE = 16
HEAD_TENSORS = "mrp_modules."  # every tensor of the MRP heads starts so
HEAD_PREFIX = "mrp_modules.0.model."  # the one defined head's own tensors
HEAD_NAMES = {"embed_norm": "enorm", "hidden_norm": "hnorm", "fuse": "eh_proj",
              "layers": "layers", "norm": "norm"}  # our top-level head module -> theirs
NOT_HEAD = ("model.", "lm_head.", "mrp_modules.0.lm_head.",
            "mrp_modules.0.model.embed_tokens.")  # the backbone, and the head's tied aliases
EXTRA_FILES = ("generation_config.json",)  # copied on export beside the tokenizer files


def is_release_config(raw: dict) -> bool:
    architectures = raw.get("architectures")
    return isinstance(architectures, list) and RELEASE_ARCHITECTURE in architectures


def is_release_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a release-layout checkpoint (False when it has no config)."""
    path = Path(directory) / "config.json"
    return path.is_file() and is_release_config(read_json(path))


def head_depth(raw: dict, path: Path) -> int:
    """num_nextn_predict_layers of a release config, after checking num_mrp_heads is 1
    (both default to 1, as in the official config class)."""
    heads, layers = raw.get("num_mrp_heads", 1), raw.get("num_nextn_predict_layers", 1)
    if heads != 1:
        raise CheckpointError(f"{path}: num_mrp_heads is {heads!r}; only the single-head "
                              "release layout (num_mrp_heads 1) is defined and read")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise CheckpointError(f"{path}: num_nextn_predict_layers must be an integer >= 1, "
                              f"got {layers!r}")
    return layers


def head_layer_count(directory: Path) -> int:
    """Layers of the MRP head in `directory`: a release's own head or a saved head."""
    if is_release_dir(directory):
        return head_depth(read_json(directory / "config.json"), directory / "config.json")
    return read_head_meta(directory)[0].num_layers


def backbone_config(raw: dict, directory: Path) -> dict:
    """config.json as our backbone reader takes it: unchanged for our layout; for a release,
    checked and with its block size filled in."""
    if not is_release_config(raw):
        return raw
    head_depth(raw, directory / "config.json")
    return {**raw, "block_size": raw.get("block_size") or RELEASE_BLOCK_SIZE}


def head_prefixes(directory: Path) -> tuple[str, ...]:
    """Tensor-name prefixes a backbone load passes over: a release's head tensors."""
    return (HEAD_TENSORS,) if is_release_dir(directory) else ()


def is_head_tensor(name: str) -> bool:
    """Whether a tensor of a release's weight files belongs to the head (engines that load
    the backbone from the release's files skip these)."""
    return name.startswith(HEAD_TENSORS)


def release_names(head: MRPHead) -> dict[str, str]:
    """Our parameter name -> the release's, for every head parameter (invert for theirs)."""
    names = {}
    for name, _ in head.named_parameters():
        module, _, rest = name.partition(".")
        names[name] = f"{HEAD_PREFIX}{HEAD_NAMES[module]}.{rest}"
    return names


def read_lm_head(directory: Path, tied: bool) -> torch.Tensor:
    """The release's lm_head (V, H) (the embedding when tied), read from its file alone."""
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)  # (V, H)
    raise CheckpointError(f"{directory}: missing tensor {name}")


def release_fingerprint(directory: Path) -> Fingerprint:
    """What the release's head depends on, from its config and its own lm_head."""
    config = config_from_dir(directory, backbone_config(read_json(directory / "config.json"),
                                                        directory))
    lm_head = read_lm_head(directory, config.tie_word_embeddings)  # (V, H)
    return Fingerprint(hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                       num_layers=config.num_layers, block_size=config.block_size,
                       mask_token_id=config.mask_token_id,
                       lm_head_sha256=lm_head_hash(SimpleNamespace(  # reads `.lm_head.weight`
                           lm_head=SimpleNamespace(weight=lm_head))))


def load_release_head(directory: Path, backbone: HeadBackbone,
                      block_size: int | None = None) -> MRPHead:
    """The head of a release directory for `backbone` (same dtype and device), checked as
    `head_loading.load_saved_head` checks ours: shape, block size, mask id and lm_head."""
    depth = head_depth(read_json(directory / "config.json"), directory / "config.json")
    differences = release_fingerprint(directory).differences(fingerprint_of(backbone, block_size))
    param = backbone.lm_head.weight
    if differences:
        raise CheckpointError(mismatch_message(directory, differences, param.dtype))
    with torch.device("meta"):
        head = MRPHead(backbone.config, HeadConfig(num_layers=depth)).to(param.dtype)
    head.to_empty(device=param.device)
    names = release_names(head)
    params = {names[name]: p.data for name, p in head.named_parameters()}
    copy_tensors(weight_files(directory), params, directory, skip=NOT_HEAD)
    return head.eval()


def check_head_tensors(directory: Path, backbone: HeadBackbone) -> None:
    """Refuse a release whose files lack a head tensor or hold one of another shape, from
    the files' headers alone (no head weights are read): a release is read whole, so a
    mode that never runs the head does not decode from a broken one either."""
    depth = head_depth(read_json(directory / "config.json"), directory / "config.json")
    with torch.device("meta"):
        head = MRPHead(backbone.config, HeadConfig(num_layers=depth))
    names = release_names(head)
    wanted = {names[name]: tuple(p.shape) for name, p in head.named_parameters()}
    found = {}
    for path in weight_files(directory):
        with path.open("rb") as handle:
            header, _ = read_header(handle, path)
        found.update({name: tuple(header[name].get("shape", ())) for name in wanted
                      if name in header})
    missing = [name for name in wanted if name not in found]
    if missing:
        raise CheckpointError(f"{directory}: missing head tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for name, shape in found.items():
        if shape != wanted[name]:
            raise CheckpointError(f"{directory}: {name} has shape {shape}, the config implies "
                                  f"{wanted[name]}")


def release_config(backbone: Backbone, head: MRPHead) -> dict:
    """config.json of a release holding `backbone` and `head`."""
    dtype = backbone.lm_head.weight.dtype
    return {**config_to_hf(backbone.config, dtype), "architectures": [RELEASE_ARCHITECTURE],
            "num_nextn_predict_layers": head.config.num_layers, "num_mrp_heads": 1}


def export_release(backbone: Backbone, head: MRPHead, directory: Path,
                   source: Path | None = None) -> None:
    """Write `backbone` and `head` (loaded together, so the head fits) in the release
    layout, every file atomically, with the tokenizer files of `source` when it has them."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in backbone.named_parameters()}
    names = release_names(head)
    tensors.update({names[name]: p.detach().to("cpu").contiguous()
                    for name, p in head.named_parameters()})
    save_tensors(published_tensors(tensors), directory)
    config = release_config(backbone, head)
    write_atomic(directory / "config.json",
                 lambda tmp: tmp.write_text(json.dumps(config, indent=2)))
    for name in (*TOKENIZER_FILES, *EXTRA_FILES) if source is not None else ():
        if (source / name).is_file():
            write_atomic(directory / name,
                         lambda tmp, name=name: shutil.copyfile(source / name, tmp))


def sdar_view_config(raw: dict, directory: Path) -> dict:
    """A release's config.json as a plain SDAR (or SDAR-MoE) checkpoint's: architecture
    renamed, block size filled in, and no auto_map (the view ships no custom code)."""
    moe = raw.get("model_type") in MOE_MODEL_TYPES
    view = {**backbone_config(raw, directory),
            "architectures": [SDAR_MOE_ARCHITECTURE if moe else SDAR_ARCHITECTURE]}
    view.pop("auto_map", None)
    return view


def write_sdar_view(source: Path, target: Path) -> None:
    """`source` (a release) shown at `target` as an SDAR checkpoint: its config.json
    rewritten (`sdar_view_config`), every other file a symlink. The head's tensors stay in
    the weight files; whoever loads the view skips them (`is_head_tensor`)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != "config.json":
            (target / path.name).symlink_to(path.resolve())
    config = sdar_view_config(read_json(source / "config.json"), source)
    write_atomic(target / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2)))
