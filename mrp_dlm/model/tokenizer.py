"""Tokenizer and chat template of a checkpoint directory.

Reads `tokenizer.json` with the `tokenizers` library, or, when a checkpoint ships only the
`vocab.json` + `merges.txt` pair (as the SDAR release does), builds the same byte-level
BPE through `transformers`' standard Qwen2 tokenizer class (never remote code). The chat
template comes from `tokenizer_config.json` or `chat_template.jinja` and is rendered with
Jinja2 exactly as `transformers` renders it.

Deliberately not here: model weights and model config (see `loading.py`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import jinja2.sandbox
import tokenizers

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


def read_chat_template(directory: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        template = json.loads(config_file.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_tokenizer(directory: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none."""
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        from transformers import Qwen2Tokenizer  # heavy import, only for this layout

        backend = Qwen2Tokenizer.from_pretrained(str(directory)).backend_tokenizer
    else:
        log.info("no tokenizer in %s", directory)
        return None
    return TextTokenizer(backend=backend, chat_template=read_chat_template(directory))
