"""Tokenizer and chat template of a checkpoint directory.

Reads `tokenizer.json` with the `tokenizers` library, or, when a checkpoint ships only the
`vocab.json` + `merges.txt` pair (as the SDAR release does), builds the Qwen2 byte-level
BPE from them with the same library: NFC, Qwen2's split regex, byte-level pre-tokenizer
and decoder, then the added tokens of `tokenizer_config.json` (or `added_tokens.json`) at
their ids. That is what `transformers`' Qwen2 tokenizer builds (4.x converts its slow class
this way, 5.x builds it directly; the tests compare the two), without depending on which
`transformers` is installed (4.5x's `Qwen2Tokenizer` has no `backend_tokenizer`) and never
with remote code. The chat template comes from `tokenizer_config.json` or
`chat_template.jinja` and is rendered with Jinja2 exactly as `transformers` renders it.

Deliberately not here: model weights and model config (see `loading.py`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from mrp_dlm.model.files import CheckpointError, read_json

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json")
# Qwen2's pre-tokenizer split (transformers' PRETOKENIZE_REGEX, the same in 4.x and 5.x).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")


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
        return self.render_messages([{"role": "user", "content": user_text}])

    def render_messages(self, messages: list[dict[str, str]],
                        add_generation_prompt: bool = True) -> str:
        """A conversation ({"role", "content"} dicts) rendered with the template; with
        `add_generation_prompt`, followed by the opening of the assistant's turn."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; drop --chat (lm_eval: "
                             "--apply_chat_template)")
        return self.compiled_template.render(messages=messages,
                                             add_generation_prompt=add_generation_prompt)

    @functools.cached_property
    def compiled_template(self) -> jinja2.Template:
        """The chat template compiled once (compiling costs milliseconds, rendering much
        less: training data renders every sample)."""
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                                   lstrip_blocks=True)
        return environment.from_string(self.chat_template)


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


def read_tokenizer_config(directory: Path) -> dict:
    config_file = directory / "tokenizer_config.json"
    return read_json(config_file) if config_file.is_file() else {}


def added_tokens(directory: Path, config: dict) -> list[tuple[int, AddedToken]]:
    """(id, token) of every added token, by id: tokenizer_config.json's added_tokens_decoder,
    else added_tokens.json. A token is special when its entry says so or the config names it
    (eos_token, additional_special_tokens, ...), as in transformers."""
    named = [config.get(key) for key in NAMED_SPECIAL_TOKENS]
    named += config.get("additional_special_tokens") or []
    named = {item["content"] if isinstance(item, dict) else item for item in named if item}
    entries = {int(i): entry for i, entry in (config.get("added_tokens_decoder") or {}).items()}
    if not entries and (directory / "added_tokens.json").is_file():
        mapping = read_json(directory / "added_tokens.json")
        entries = {int(i): {"content": content} for content, i in mapping.items()}
    return [(i, AddedToken(entry["content"], single_word=entry.get("single_word", False),
                           lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                           normalized=entry.get("normalized", False),
                           special=entry.get("special", False) or entry["content"] in named))
            for i, entry in sorted(entries.items())]


def build_bpe_tokenizer(directory: Path) -> tokenizers.Tokenizer:
    """The Qwen2 byte-level BPE of a vocab.json + merges.txt checkpoint."""
    model = BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt"),
                          dropout=None, unk_token=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    config = read_tokenizer_config(directory)
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")),
                                 use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    for token_id, token in added_tokens(directory, config):
        backend.add_tokens([token])  # one by one: each takes the next free id
        if backend.token_to_id(token.content) != token_id:
            raise ValueError(f"{directory}: added token {token.content!r} should have id "
                             f"{token_id} but lands on {backend.token_to_id(token.content)}")
    return backend


def read_backend(directory: Path) -> tokenizers.Tokenizer | None:
    """The tokenizer of tokenizer.json or of vocab.json + merges.txt; None when neither."""
    path = directory / "tokenizer.json"
    try:
        if path.is_file():
            return tokenizers.Tokenizer.from_file(str(path))
        path = directory / "vocab.json"
        if path.is_file() and (directory / "merges.txt").is_file():
            return build_bpe_tokenizer(directory)
    except Exception as error:  # tokenizers raises a bare Exception
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
