"""Tokenizer and chat template of a checkpoint directory.

Reads `tokenizer.json` with the `tokenizers` library, or, when a checkpoint ships only the
`vocab.json` + `merges.txt` pair (as the SDAR release does), builds the same byte-level
BPE through `transformers`' standard Qwen2 tokenizer class (never remote code). The chat
template comes from `tokenizer_config.json` or `chat_template.jinja` and is rendered with
Jinja2 exactly as `transformers` renders it.

Deliberately not here: model weights and model config (see `loading.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import jinja2.sandbox
import tokenizers

from mrp_dlm.model.loading import CheckpointError, read_json

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json")


@dataclass
class TextTokenizer:
    """Text <-> ids, plus the chat template when the checkpoint has one."""

    backend: tokenizers.Tokenizer
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, user_text: str) -> str:
        """One user turn rendered with the template, ready for the assistant's answer."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; drop --chat")
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                                   lstrip_blocks=True)
        template = environment.from_string(self.chat_template)
        messages = [{"role": "user", "content": user_text}]
        return template.render(messages=messages, add_generation_prompt=True)


def check_utf8(text: str, what: str) -> None:
    """Refuse text holding undecodable bytes (argv escapes them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = ord(error.object[error.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise ValueError(f"{what} is not valid UTF-8 text ({byte} at character "
                         f"{error.start}); pass it in UTF-8") from None


def read_chat_template(directory: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text()
        except UnicodeDecodeError as error:
            raise CheckpointError(f"{jinja_file} is not UTF-8 text: {error}") from error
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        template = read_json(config_file).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def read_backend(directory: Path) -> tokenizers.Tokenizer | None:
    """The tokenizer of tokenizer.json or of vocab.json + merges.txt; None when neither."""
    path = directory / "tokenizer.json"
    try:
        if path.is_file():
            return tokenizers.Tokenizer.from_file(str(path))
        path = directory / "vocab.json"
        if path.is_file() and (directory / "merges.txt").is_file():
            from transformers import Qwen2Tokenizer  # heavy import, only for this layout

            return Qwen2Tokenizer.from_pretrained(str(directory)).backend_tokenizer
    except Exception as error:  # tokenizers raises a bare Exception; transformers, several
        raise CheckpointError(f"{path} is not a readable tokenizer: {error}") from error
    return None


def load_tokenizer(directory: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none."""
    directory = Path(directory)
    backend = read_backend(directory)
    if backend is None:
        log.info("no tokenizer in %s", directory)
        return None
    return TextTokenizer(backend=backend, chat_template=read_chat_template(directory))
