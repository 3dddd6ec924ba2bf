"""The task tokenizer: fixed special ids, single-digit tokens, exact round trips, HF loading."""

import pytest
import tokenizers

from mrp_dlm.tasks.registry import EMBEDDED_TASKS, get_task
from mrp_dlm.training.tokenizer import (CHAT_TEMPLATE, MAX_VOCAB_SIZE, SPECIAL_TOKENS,
                                        save_tokenizer, train_tokenizer)

TRAIN_COUNT = 1500


def chat_text(problem: str, target: str) -> str:
    return (f"<|im_start|>user\n{problem}<|im_end|>\n"
            f"<|im_start|>assistant\n{target}<|im_end|>")


@pytest.fixture(scope="module")
def task_texts():
    texts = []
    for name in EMBEDDED_TASKS:
        for example in get_task(name).examples("train", TRAIN_COUNT):
            texts.append(chat_text(example.problem, example.target))
    return texts


@pytest.fixture(scope="module")
def tokenizer(task_texts):
    return train_tokenizer(task_texts)


@pytest.fixture(scope="module")
def saved_dir(tokenizer, tmp_path_factory):
    return save_tokenizer(tokenizer, tmp_path_factory.mktemp("tokenizer"))


def test_vocab_size_is_bounded(tokenizer, task_texts):
    assert tokenizer.get_vocab_size() <= MAX_VOCAB_SIZE
    assert train_tokenizer(task_texts[:200], vocab_size=300).get_vocab_size() <= 300
    with pytest.raises(ValueError):
        train_tokenizer(task_texts[:10], vocab_size=MAX_VOCAB_SIZE + 1)


def test_special_tokens_have_fixed_ids(tokenizer):
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert SPECIAL_TOKENS == ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
    assert tokenizer.encode("<|MASK|><|MASK|>").ids == [3, 3]


def test_round_trip(tokenizer, task_texts):
    test_examples = get_task("arith-code").examples("test", 100)
    extra = [chat_text(example.problem, example.target) for example in test_examples]
    extra.append("Unseen: ünïcode 😀, tabs\tand  double  spaces 1234567890\n")
    for text in task_texts + extra:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_digits_are_single_tokens(tokenizer):
    for token in tokenizer.get_vocab():
        if any(char.isdigit() for char in token):
            assert len(token) == 1, token
    tokens = tokenizer.encode("12 + 345 = 357").tokens
    assert [token for token in tokens if token.isdigit()] == list("12345357")


def test_saved_files_load_with_tokenizers(tokenizer, saved_dir):
    loaded = tokenizers.Tokenizer.from_file(str(saved_dir / "tokenizer.json"))
    text = chat_text("Tom has 7 apples.", "7 + 5 = 12\n#### 12")
    assert loaded.encode(text).ids == tokenizer.encode(text).ids


def test_loads_in_transformers_with_chat_template(tokenizer, saved_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(saved_dir))
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 2)
    assert (hf.pad_token, hf.pad_token_id) == ("<|endoftext|>", 0)
    assert (hf.mask_token, hf.mask_token_id) == ("<|MASK|>", 3)
    rendered = hf.apply_chat_template([{"role": "user", "content": "Tom has 7 apples."}],
                                      tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nTom has 7 apples.<|im_end|>\n<|im_start|>assistant\n"
    text = chat_text("Tom has 7 apples.", "7 + 5 = 12\n#### 12")
    ids = hf(text, add_special_tokens=True)["input_ids"]
    assert ids == tokenizer.encode(text).ids
    assert hf.decode(ids) == text


def test_project_loader_renders_the_same_template(saved_dir):
    from mrp_dlm.model.tokenizer import load_tokenizer

    loaded = load_tokenizer(saved_dir)
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.render_chat("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
