"""Conversations rendered with the backbone's own chat template into training samples.

The loss sees assistant turns only. The template renders the conversation turn by turn:
the text before assistant turn i is `render(turns[:i], add_generation_prompt=True)`, the
turn itself what `render(turns[:i + 1])` adds after it. Each assistant turn contributes
its content and `<|im_end|>` as response tokens; the template's text around them (system,
user turns, the assistant header, the newline after `<|im_end|>`) is context. The last
assistant turn ends the sample as `data.encode_samples` ends one (content, `<|im_end|>`,
pads to a multiple of L), so a one-turn conversation gives exactly the built-in tasks'
sample. Turns after the last assistant turn are dropped (nothing to learn from them).

A sample longer than the row is cut at the row's length, a block boundary (`fit_sample`);
one whose prompt alone fills the row is dropped. Both are counted by the caller.

Deliberately not here: reading files (see `records.py`), packing (see `data.py`).

Shapes: S tokens of one sample.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mrp_dlm.model.tokenizer import TextTokenizer
from mrp_dlm.training.data import END_TOKEN, Sample, SpecialIds
from mrp_dlm.training.records import BadRow, Conversation


@dataclass(frozen=True)
class ChatEncoder:
    """Everything turning a conversation into tokens needs, bound once per run."""

    tokenizer: TextTokenizer  # the backbone's, with its chat template
    special: SpecialIds  # pad, end and mask ids
    block_size: int  # L: samples are padded to a multiple of it

    def prompt_text(self, conversation: Conversation) -> str:
        """The conversation up to its last assistant turn (exclusive), rendered and opened
        for the assistant's answer: what decoding continues (distillation, acceptance)."""
        turns = list(conversation.messages)
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()
        if not turns:
            raise BadRow(f"{conversation.where}: no turn before the assistant's")
        return self.tokenizer.render_messages(turns, add_generation_prompt=True)

    def sample(self, conversation: Conversation) -> Sample:
        """The conversation's training sample: loss on its assistant turns only."""
        turns = list(conversation.messages)
        answers = [i for i, turn in enumerate(turns) if turn["role"] == "assistant"]
        if not answers or answers[0] == 0:
            raise BadRow(f"{conversation.where}: no assistant turn after a prompt to train on")
        ids: list[int] = []
        labels: list[bool] = []
        rendered = ""
        for turn_index in answers:
            before = self.tokenizer.render_messages(turns[:turn_index], add_generation_prompt=True)
            after = self.tokenizer.render_messages(turns[:turn_index + 1],
                                                   add_generation_prompt=False)
            content = turns[turn_index]["content"]
            if not before.startswith(rendered) or not after.startswith(before + content):
                raise BadRow(f"{conversation.where}: the chat template does not render turn "
                             f"{turn_index} as a continuation of the turns before it")
            self.extend(ids, labels, before[len(rendered):], False)
            self.extend(ids, labels, content, True)
            ids.append(self.special.end)
            labels.append(True)
            rendered = before + content + END_TOKEN  # the template's text after it is context
            if not after.startswith(rendered):
                raise BadRow(f"{conversation.where}: the chat template does not close "
                             f"assistant turn {turn_index} with {END_TOKEN}")
        pads = -len(ids) % self.block_size
        ids += [self.special.pad] * pads
        labels += [True] * pads
        response = torch.tensor(labels)  # (S,) bool
        prompt_length = int(response.int().argmax())
        several = len(answers) > 1
        return Sample(torch.tensor(ids, dtype=torch.int64), prompt_length,
                      response if several else None)

    def extend(self, ids: list[int], labels: list[bool], text: str, label: bool) -> None:
        if text:
            piece = self.tokenizer.encode(text)
            ids += piece
            labels += [label] * len(piece)


def fit_sample(sample: Sample, seq_len: int) -> Sample | None:
    """The sample cut to `seq_len` tokens (a multiple of L, so a block boundary); None when
    no response token is left."""
    if len(sample.ids) <= seq_len:
        return sample
    if sample.prompt_length >= seq_len:
        return None
    mask = None if sample.response_mask is None else sample.response_mask[:seq_len]
    return replace(sample, ids=sample.ids[:seq_len], response_mask=mask)
