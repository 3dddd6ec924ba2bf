"""README's family table, the sdar_moe rows (SDAR-30B-A3B-Chat / -Sci): their published
layout (`family.py`: per-expert weights, two shards, config without block size or mask id)
loads with the table's block size, mask id and expert fields, reads every tensor, and
decodes (exactness against transformers' Qwen3-MoE is `test_moe.py`'s)."""

from __future__ import annotations

import json
import logging

import pytest

from family import MASK_ID, MOE, STOP_IDS, TINY_MOE, write_member
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.pipeline import Pipeline

PROMPT = [151644, 872, 198, 17, 488, 18, 151645, 198, 151644, 77091, 198]  # a chat turn's ids


@pytest.mark.parametrize("member", MOE, ids=lambda member: member.name)
def test_an_moe_member_loads_and_decodes(member, tmp_path, caplog):
    write_member(member, tmp_path / member.name)
    with caplog.at_level(logging.WARNING):
        pipe = Pipeline.load(tmp_path / member.name)
    assert not [r for r in caplog.records if "unexpected tensor" in r.getMessage()]
    config = pipe.model.config
    assert (config.block_size, config.mask_token_id) == (member.block_size, MASK_ID)
    assert config.stop_token_ids == STOP_IDS and not config.tie_word_embeddings
    moe = {name: getattr(config, name) for name in TINY_MOE}
    assert moe == TINY_MOE and config.norm_topk_prob  # the json's true, not the class's false
    added = json.loads((tmp_path / member.name / "added_tokens.json").read_text())
    assert added[member.mask_text] == config.mask_token_id
    decode = DecodeConfig(mode="static", max_new_tokens=2 * member.block_size, steps=4)
    out = generate(pipe.model, [PROMPT], decode, pipe.decoder(decode))
    assert 1 <= len(out.token_ids[0]) <= 2 * member.block_size
    assert MASK_ID not in out.token_ids[0]
