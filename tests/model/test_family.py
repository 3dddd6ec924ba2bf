"""README's family table, checked: every dense SDAR-family member's published layout
(`family.py`, tiny dims) loads with the table's block size and mask id and decodes the
tokens of the model that wrote it; one member by its hub id from an offline hub cache.
The sdar_moe members are in `test_family_moe.py`."""

from __future__ import annotations

import json

import pytest

from family import DENSE, FAMILY, MASK_ID, SDAR_DEFAULT_BLOCK, STOP_IDS, published_config, \
    tokenizer_files, write_member
from hub_cache import cache_snapshot, commit_of, hub_home  # noqa: F401 (a fixture)
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.pipeline import Pipeline

PROMPT = [151644, 872, 198, 17, 488, 18, 151645, 198, 151644, 77091, 198]  # a chat turn's ids
README = "README.md"


def block_flag(member) -> int | None:
    """The --block-size a member needs: none for block 4 (the default), else its block."""
    return None if member.block_size == SDAR_DEFAULT_BLOCK else member.block_size


@pytest.mark.parametrize("member", DENSE, ids=lambda member: member.name)
def test_a_dense_member_loads_and_decodes(member, tmp_path):
    written = write_member(member, tmp_path / member.name)
    pipe = Pipeline.load(tmp_path / member.name, block_size=block_flag(member))
    config = pipe.model.config
    assert (config.block_size, config.mask_token_id) == (member.block_size, MASK_ID)
    assert config.stop_token_ids == STOP_IDS and config.tie_word_embeddings == member.tied
    added = json.loads((tmp_path / member.name / "added_tokens.json").read_text())
    assert added[member.mask_text] == config.mask_token_id
    assert pipe.head_dir is None and pipe.tokenizer is None  # no head; ids only here
    decode = DecodeConfig(mode="static", max_new_tokens=member.block_size, steps=4)  # 4 steps a block
    ours = generate(pipe.model, [PROMPT], decode, pipe.decoder(decode))
    theirs = generate(written, [PROMPT], decode, make_decoder(decode, None))
    assert ours.token_ids == theirs.token_ids and len(ours.token_ids[0]) >= 1
    assert MASK_ID not in ours.token_ids[0]


@pytest.mark.parametrize("member", [m for m in DENSE if block_flag(m)], ids=lambda m: m.name)
def test_a_block_size_variant_without_the_flag_gets_the_sdar_default(member, tmp_path):
    """config.json does not say a variant's block: without --block-size it is 4 (which
    README's table says to override)."""
    write_member(member, tmp_path / member.name)
    assert Pipeline.load(tmp_path / member.name).model.config.block_size == SDAR_DEFAULT_BLOCK


def test_a_member_by_its_hub_id(hub_home, tmp_path):
    member = next(m for m in DENSE if m.name == "SDAR-4B-Chat-b64")
    write_member(member, tmp_path / "files")
    snapshot = cache_snapshot(hub_home, member.hub_id, tmp_path / "files", commit_of("b64"))
    pipe = Pipeline.load(member.hub_id, block_size=64)
    assert pipe.directory == snapshot and pipe.model.config.block_size == 64


def test_the_published_keys_match_the_shared_copies(fixtures_dir):
    """The generated config.json and added_tokens.json have the keys of the published
    SDAR-4B/8B-Chat files (whose shared copies add block_size and mask_token_id)."""
    for name in ("SDAR-4B-Chat", "SDAR-8B-Chat"):
        member = next(m for m in FAMILY if m.name == name)
        shared = json.loads((fixtures_dir / name.lower() / "config.json").read_text())
        assert set(published_config(member)) == set(shared) - {"block_size", "mask_token_id"}
        assert published_config(member)["tie_word_embeddings"] == shared["tie_word_embeddings"]
    member = next(m for m in FAMILY if m.name == "SDAR-4B-Chat")
    ours = tokenizer_files(member)
    shared_added = json.loads((fixtures_dir / "sdar-4b-chat" / "added_tokens.json").read_text())
    assert ours["added_tokens.json"] == shared_added
    generation = json.loads((fixtures_dir / "sdar-4b-chat" / "generation_config.json").read_text())
    assert ours["generation_config.json"]["eos_token_id"] == generation["eos_token_id"]


def test_readme_table_lists_every_member_as_the_fixtures_state_it():
    """Each row of README's family table: name, hub id, model_type, block size, mask id."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / README).read_text()
    lines = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    rows = {cells[0]: cells for cells in
            [[cell.strip("` ").replace("\\|", "|") for cell in line] for line in lines]}
    for member in FAMILY:
        row = rows[member.name]
        assert row[1:6] == [member.hub_id, member.model_type, str(member.block_size),
                            str(MASK_ID), member.mask_text], row
