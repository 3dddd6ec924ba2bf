"""Both tokenizer layouts of a checkpoint, on the real SDAR tokenizer (../shared/fixtures).

`vocab.json` + `merges.txt` (the SDAR release) is built by our own code with `tokenizers`;
`tokenizer.json` is read as is. Both must give the ids and text that the installed
`transformers`' Qwen2 tokenizer gives, whichever version it is (4.45 to 5.x), and the
vocab + merges path must not need `transformers` at all.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from mrp_dlm.model.tokenizer import build_bpe_tokenizer, load_tokenizer

TEXTS = [
    "Hello, world! 2 + 2 = 4.\n  def f(x):\treturn x  # it's 12345",
    "I'LL say: don't, we've, they're\r\n\r\n   trailing   ",
    "caf\u0065\u0301 vs caf\u00e9, na\u00efve, \u4f60\u597d\u4e16\u754c, "
    "\u0645\u0631\u062d\u0628\u0627, "
    "\U0001f600\U0001f680",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4",
    "<|MASK|><|MASK|> masked <|endoftext|> and <tool_call>{}</tool_call>",
    "",
]


@pytest.fixture
def sdar_tokenizer_dir(fixtures_dir):
    return fixtures_dir / "sdar-4b-chat"


def hf_tokenizer(directory):
    """transformers' own Qwen2 tokenizer (the fast class in 4.x, the only class in 5.x)."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "Qwen2TokenizerFast", None) or transformers.Qwen2Tokenizer
    return cls.from_pretrained(str(directory))


def assert_same_as_transformers(ours, hf) -> None:
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip), (text, skip)


def test_vocab_and_merges_match_transformers(sdar_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = load_tokenizer(sdar_tokenizer_dir)
    assert_same_as_transformers(ours, hf_tokenizer(sdar_tokenizer_dir))
    assert ours.token_id("<|MASK|>") == 151669


def test_vocab_and_merges_need_no_transformers(sdar_tokenizer_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it now fails
    tokenizer = load_tokenizer(sdar_tokenizer_dir)
    assert tokenizer.encode("<|im_start|>user") == [151644, 872]


def test_tokenizer_json_written_by_transformers_loads_the_same(sdar_tokenizer_dir, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = hf_tokenizer(sdar_tokenizer_dir)
    hf.save_pretrained(str(tmp_path))  # a converted checkpoint: tokenizer.json
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).unlink(missing_ok=True)
    ours = load_tokenizer(tmp_path)
    assert_same_as_transformers(ours, hf)
    reference = load_tokenizer(sdar_tokenizer_dir)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)
    assert ours.render_chat("hi") == reference.render_chat("hi")


def test_added_tokens_json_is_the_fallback(sdar_tokenizer_dir, tmp_path):
    for name in ("vocab.json", "merges.txt", "added_tokens.json"):
        shutil.copy(sdar_tokenizer_dir / name, tmp_path / name)  # no tokenizer_config.json
    backend = build_bpe_tokenizer(tmp_path)
    assert backend.token_to_id("<|im_end|>") == 151645
    assert backend.token_to_id("<MASK>") == 151669  # the SDAR release's added_tokens.json name


def test_added_token_off_its_id_fails_clearly(sdar_tokenizer_dir, tmp_path):
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(sdar_tokenizer_dir / name, tmp_path / name)
    (tmp_path / "added_tokens.json").write_text('{"<|im_end|>": 151700}')
    with pytest.raises(ValueError, match="should have id 151700"):
        build_bpe_tokenizer(tmp_path)
