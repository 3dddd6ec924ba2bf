"""Train and save the small byte-level BPE tokenizer of the synthetic tasks.

Four special tokens come first, with fixed ids: `<|endoftext|>` 0 (padding), `<|im_start|>` 1,
`<|im_end|>` 2 (end of a turn, the eos token) and `<|MASK|>` 3 (the diffusion mask). Digits
are always split into single tokens so that arithmetic stays learnable, and byte-level
encoding makes `decode(encode(text)) == text` for any text. `save_tokenizer` writes a
directory that both `tokenizers.Tokenizer.from_file` and `transformers.AutoTokenizer` load
offline, with a Qwen-style chat template.

Deliberately not here: loading tokenizers of released checkpoints (see `model/tokenizer.py`)
and building training sequences.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN)  # ids 0, 1, 2, 3
MAX_VOCAB_SIZE = 1024
BYTE_ALPHABET_SIZE = 256
# Qwen-style turns without a default system prompt; renders identically with or without
# Jinja's trim_blocks/lstrip_blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL_MAX_LENGTH = 4096  # advertised to transformers; the model config is the real limit


def build_empty_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int = MAX_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids, special tokens included."""
    minimum = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE
    if not minimum <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [{minimum}, {MAX_VOCAB_SIZE}], got {vocab_size}")
    tokenizer = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"{token} got id {tokenizer.token_to_id(token)}, not {expected_id}")
    log.info("trained a tokenizer with %d ids", tokenizer.get_vocab_size())
    return tokenizer


def tokenizer_config() -> dict:
    """Contents of `tokenizer_config.json` for `transformers.AutoTokenizer`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config_text = json.dumps(tokenizer_config(), indent=2) + "\n"
    (directory / "tokenizer_config.json").write_text(config_text)
    return directory
