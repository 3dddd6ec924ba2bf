"""The MRP head and its checkpoints: zero residual, chaining, save/load, fingerprint, errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mrp_dlm.config import HeadConfig
from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.files import CheckpointError
from mrp_dlm.model.head import HeadAttention, KeyRecorder, MRPHead
from mrp_dlm.model.head_loading import save_head
from mrp_dlm.model.loading import load_head
from mrp_dlm.model.masks import block_causal_mask, copies_mask

B, L = 3, 4


def block_inputs(model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens (B, L), base hidden (B, L, H) of the backbone on them, positions (B, L)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size - 2, (B, L), generator=generator)
    tokens[:, 1] = model.config.mask_token_id
    positions = 8 + torch.arange(L).expand(B, L)  # (B, L), the block after two full blocks
    mask = torch.ones(B, L, L, dtype=torch.bool)  # (B, L, L)
    with torch.no_grad():
        hidden = model(tokens, positions, mask)  # (B, L, H)
    return tokens, hidden, positions


def randomize(head: MRPHead, seed: int) -> MRPHead:
    """Every parameter random (the final norm included), as after training."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return head


@pytest.mark.exact_arithmetic
def test_zeroed_output_norm_gives_a_plus_c_equal_a(tiny_model):
    head = randomize(MRPHead(tiny_model.config, HeadConfig(num_layers=1)), seed=1)
    with torch.no_grad():
        head.norm.weight.zero_()  # what reset_parameters does: the head starts at "no change"
    tokens, hidden, positions = block_inputs(tiny_model)
    with torch.no_grad():
        accumulator = hidden
        for _ in range(3):  # chained steps stay exact too
            accumulator = accumulator + head(tiny_model, tokens, accumulator, positions)
    assert torch.equal(accumulator, hidden)
    assert torch.equal(tiny_model.logits(accumulator), tiny_model.logits(hidden))
    assert MRPHead(tiny_model.config).norm.weight.abs().sum() == 0  # the default init


def test_residual_logits_add_because_lm_head_has_no_bias(tiny_model):
    head = randomize(MRPHead(tiny_model.config, HeadConfig(num_layers=1)), seed=2)
    tokens, hidden, positions = block_inputs(tiny_model)
    with torch.no_grad():
        residual = head(tiny_model, tokens, hidden, positions)  # (B, L, H)
        combined = tiny_model.logits(hidden + residual)
        added = tiny_model.logits(hidden) + tiny_model.logits(residual)
    diff = (combined - added).abs()
    assert diff.max() < 1e-4, f"max {diff.max():.2e}, mean {diff.mean():.2e} (tolerance 1e-4)"
    assert residual.abs().max() > 0.1


def test_head_runs_on_zero_blocks(tiny_model):
    head = MRPHead(tiny_model.config, HeadConfig(num_layers=1))
    H = tiny_model.config.hidden_size
    out = head(tiny_model, torch.zeros(0, L, dtype=torch.int64), torch.zeros(0, L, H),
               torch.zeros(0, L, dtype=torch.int64))
    assert out.shape == (0, L, H)


def test_save_load_is_exact(tmp_path, tiny_model):
    head = randomize(MRPHead(tiny_model.config, HeadConfig(num_layers=2, init_std=0.05)), seed=3)
    save_head(head, tiny_model, tmp_path / "head")
    loaded = load_head(tmp_path / "head", tiny_model)
    assert loaded.config == head.config
    assert not loaded.training
    expected, actual = dict(head.named_parameters()), dict(loaded.named_parameters())
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert not any(part in name for name in actual for part in ("embed_tokens", "lm_head"))
    tokens, hidden, positions = block_inputs(tiny_model)
    with torch.no_grad():
        assert torch.equal(head(tiny_model, tokens, hidden, positions),
                           loaded(tiny_model, tokens, hidden, positions))


def test_fingerprint_mismatch_lists_the_differences(tmp_path, tiny_model, make_model):
    directory = tmp_path / "head"
    save_head(MRPHead(tiny_model.config), tiny_model, directory)
    with pytest.raises(CheckpointError, match="lm_head_sha256") as error:
        load_head(directory, make_model(seed=5))
    assert "another backbone" in str(error.value)
    with pytest.raises(CheckpointError, match="block_size: head 4 vs backbone 8"):
        load_head(directory, tiny_model, block_size=8)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_head(directory, make_model(hidden_size=48))


def test_fingerprint_names_a_dtype_that_changes_the_hash(tmp_path, tiny_model):
    # The hash rounds lm_head to bfloat16: float32 and bfloat16 loads of the same weights
    # agree, a float16 load does not, and the error must say so instead of blaming the
    # backbone (SGLang's --dtype auto ran float32 checkpoints in float16).
    directory = tmp_path / "head"
    save_head(MRPHead(tiny_model.config), tiny_model, directory)
    bf16 = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert load_head(directory, bf16).norm.weight.dtype == torch.bfloat16
    fp16 = copy.deepcopy(tiny_model).to(torch.float16)
    with pytest.raises(CheckpointError, match="loaded in float16") as error:
        load_head(directory, fp16)
    assert "another backbone" not in str(error.value)
    assert "--dtype" in str(error.value)


def test_bad_head_directories(tmp_path, tiny_model):
    with pytest.raises(CheckpointError, match="head directory not found"):
        load_head(tmp_path / "nowhere", tiny_model)
    directory = tmp_path / "head"
    save_head(MRPHead(tiny_model.config), tiny_model, directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing file"):
        load_head(directory, tiny_model)
    (directory / "config.json").write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(CheckpointError, match="not an MRP head config"):
        load_head(directory, tiny_model)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing file"):
        load_head(directory, tiny_model)


def context_inputs(model, prefix_blocks: int, seed: int = 3):
    """A clean prefix of whole blocks with the backbone's hidden states, then one block."""
    generator = torch.Generator().manual_seed(seed)
    T = (prefix_blocks + 1) * L
    tokens = torch.randint(0, model.config.vocab_size - 2, (B, T), generator=generator)
    tokens[:, -L + 1::2] = model.config.mask_token_id  # the current block, mid-decode
    positions = torch.arange(T).expand(B, T)  # (B, T)
    mask = block_causal_mask(torch.arange(T) // L, torch.ones(B, T, dtype=torch.bool))  # (B, T, T)
    with torch.no_grad():
        hidden = model(tokens, positions, mask)  # (B, T, H)
    return tokens, hidden, positions, mask


def test_cached_head_keys_equal_the_whole_sequence_pass(tiny_model):
    """Keys written by a store pass into a KVCache, then a step on the block against them ==
    one head pass over the whole sequence under the block-causal mask (and the same with
    the recorded keys of a pass over the prefix, as training runs it)."""
    head = randomize(MRPHead(tiny_model.config, HeadConfig(num_layers=2)), seed=4)
    tokens, hidden, positions, mask = context_inputs(tiny_model, prefix_blocks=3)
    P, S = 3 * L, 4 * L
    with torch.no_grad():
        whole = head(tiny_model, tokens, hidden, positions,
                     HeadAttention(KeyRecorder(2), mask))[:, P:]  # (B, L, H)
        cache = KVCache(2, B, tiny_model.config.num_kv_heads, S, tiny_model.config.head_dim,
                        torch.float32, "cpu")
        head(tiny_model, tokens[:, :P], hidden[:, :P], positions[:, :P],
             HeadAttention(cache, mask[:, :P, :P], 0))
        valid = torch.ones(B, S, dtype=torch.bool)
        step = head(tiny_model, tokens[:, P:], hidden[:, P:], positions[:, P:],
                    HeadAttention(cache, copies_mask(valid, P, L, 1, S), P))  # (B, L, H)
        recorder = KeyRecorder(2)
        head(tiny_model, tokens[:, :P], hidden[:, :P], positions[:, :P],
             HeadAttention(recorder, mask[:, :P, :P]))
        trained = head(tiny_model, tokens[:, P:], hidden[:, P:], positions[:, P:],
                       HeadAttention(recorder.prefix(), mask[:, P:]))
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trained, whole, rtol=1e-5, atol=1e-5)


def test_head_sees_the_context(tiny_model):
    """Changing one token of an earlier block changes the residual of the current block."""
    head = randomize(MRPHead(tiny_model.config, HeadConfig(num_layers=1)), seed=5)
    tokens, hidden, positions, mask = context_inputs(tiny_model, prefix_blocks=2)
    changed = tokens.clone()
    changed[:, 1] = (changed[:, 1] + 1) % (tiny_model.config.vocab_size - 2)
    with torch.no_grad():
        before = head(tiny_model, tokens, hidden, positions, HeadAttention(KeyRecorder(1), mask))
        after = head(tiny_model, changed, hidden, positions, HeadAttention(KeyRecorder(1), mask))
    assert (before[:, -L:] - after[:, -L:]).abs().max() > 1e-3


def test_a_block_only_head_is_refused_except_to_fine_tune(tmp_path, tiny_model):
    """A head saved before heads attended to the context (no `attention` key) is another
    model: loading it says what changed and how to fine-tune it; `block_only` loads it."""
    head = randomize(MRPHead(tiny_model.config, HeadConfig(num_layers=1)), seed=6)
    directory = tmp_path / "head"
    save_head(head, tiny_model, directory)
    meta = json.loads((directory / "config.json").read_text())
    assert meta["attention"] == "context"
    del meta["attention"]
    (directory / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="attends to its own block only.*--init-from"):
        load_head(directory, tiny_model)
    loaded = load_head(directory, tiny_model, block_only=True)
    assert torch.equal(loaded.fuse.weight, head.fuse.weight)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_one_query_position_equals_that_row_of_the_whole_pass(tiny_model, layers):
    """`query=`: h_C at one position per row (the last layer run there alone, every token
    still giving keys) == that position of the whole pass, with and without earlier keys;
    the keys written to the cache are the whole pass's."""
    head = randomize(MRPHead(tiny_model.config, HeadConfig(num_layers=layers)), seed=6)
    tokens, hidden, positions, mask = context_inputs(tiny_model, prefix_blocks=2)
    P, S = 2 * L, 3 * L
    query = torch.tensor([0, L - 1, 2])  # (B,) one position per row
    rows = torch.arange(B)
    valid = torch.ones(B, S, dtype=torch.bool)

    def cache_after_prefix() -> KVCache:
        cache = KVCache(layers, B, tiny_model.config.num_kv_heads, S,
                        tiny_model.config.head_dim, torch.float32, "cpu")
        head(tiny_model, tokens[:, :P], hidden[:, :P], positions[:, :P],
             HeadAttention(cache, mask[:, :P, :P], 0))
        return cache

    with torch.no_grad():
        block = (tokens[:, P:], hidden[:, P:], positions[:, P:])
        alone = head(tiny_model, *block)  # (B, L, H): the block alone
        one = head(tiny_model, *block, query=query)  # (B, 1, H)
        whole_cache, one_cache = cache_after_prefix(), cache_after_prefix()
        step = HeadAttention(whole_cache, copies_mask(valid, P, L, 1, S), P)
        whole = head(tiny_model, *block, step)  # (B, L, H)
        picked = head(tiny_model, *block,
                      HeadAttention(one_cache, copies_mask(valid, P, L, 1, S), P), query=query)
    assert one.shape == picked.shape == (B, 1, tiny_model.config.hidden_size)
    torch.testing.assert_close(one[:, 0], alone[rows, query], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(picked[:, 0], whole[rows, query], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one_cache.keys, whole_cache.keys)
    assert (whole[rows, query] - whole[rows, (query + 1) % L]).abs().max() > 1e-3  # not vacuous
