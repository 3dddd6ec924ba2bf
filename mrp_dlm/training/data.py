"""Training data: chat samples from the tasks, packed into fixed-length rows.

A sample is the rendered chat prompt, the reference response and `<|im_end|>`, padded
with `<|endoftext|>` to a multiple of the block size L; the pads are response tokens, so
the model learns to fill the tail of its last block with EOS. Rows of `seq_len` tokens
hold several whole samples (first fit within a small window of open rows); positions
restart at 0 in every sample, so block boundaries are relative to the sample start. The
rest of a row is filler that nothing attends to and no loss sees.

Data order is a pure function of (seed, step): epoch e is a seeded permutation of the
samples, packed deterministically, and step s takes the s-th batch of the concatenated
epochs. A resumed run therefore needs no iterator state.

Deliberately not here: noising, masks and the loss.

Shapes: B rows, T = seq_len tokens per row.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mrp_dlm.model.tokenizer import TextTokenizer
from mrp_dlm.tasks.registry import get_task

log = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|MASK|>"
PLACEHOLDER = "\x00problem\x00"  # stands for the user turn when the template is rendered once
PACKING_WINDOW = 8  # open rows a sample may go into; more fills rows better, slower packing
CACHED_EPOCHS = 2  # packed epochs kept in memory


def derive_seed(seed: int, purpose: str, index: int) -> int:
    """A 63-bit seed that depends only on its arguments (Python's hash() is salted)."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the data and the model config need."""

    pad: int  # <|endoftext|>: pads samples to a multiple of L and fills rows
    end: int  # <|im_end|>: closes every response
    mask: int  # <|MASK|>: the diffusion mask


def find_special_ids(tokenizer: TextTokenizer) -> SpecialIds:
    ids = {name: tokenizer.token_id(name) for name in (PAD_TOKEN, END_TOKEN, MASK_TOKEN)}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise ValueError(f"the tokenizer lacks the special token(s) {', '.join(missing)}")
    return SpecialIds(pad=ids[PAD_TOKEN], end=ids[END_TOKEN], mask=ids[MASK_TOKEN])


@dataclass(frozen=True)
class Sample:
    """One tokenized (prompt, response) pair."""

    ids: torch.Tensor  # (S,) int64, prompt + response + <|im_end|> + pads, S a multiple of L
    prompt_length: int  # tokens before the (first) response; these are never masked
    # (S,) bool: the response tokens of a conversation with several assistant turns;
    # None: every token from prompt_length on
    response_mask: torch.Tensor | None = None


def encode_samples(prompts: Sequence[str], responses: Sequence[str], tokenizer: TextTokenizer,
                   special: SpecialIds, block_size: int) -> list[Sample]:
    """Samples from already rendered prompts and raw responses."""
    prompt_ids = tokenizer.backend.encode_batch(list(prompts), add_special_tokens=False)
    response_ids = tokenizer.backend.encode_batch(list(responses), add_special_tokens=False)
    samples = []
    for prompt, response in zip(prompt_ids, response_ids):
        ids = prompt.ids + response.ids + [special.end]
        ids += [special.pad] * (-len(ids) % block_size)
        samples.append(Sample(torch.tensor(ids, dtype=torch.int64), len(prompt.ids)))
    return samples


def task_texts(task_names: Sequence[str], count: int,
               split: str = "train") -> tuple[list[str], list[str]]:
    """(user turns, reference responses) of the first `count` examples of each task's split."""
    problems, targets = [], []
    for name in task_names:
        try:
            task = get_task(name)
        except KeyError as error:
            raise ValueError(error.args[0]) from error
        for example in task.examples(split, count):
            problems.append(task.prompt(example))
            targets.append(example.target)
    return problems, targets


def render_prompts(problems: Sequence[str], tokenizer: TextTokenizer) -> list[str]:
    """User turns rendered with the chat template.

    Rendering is slow enough per call to dominate the tokenizing of a large data set
    (docs/experiments.md, "numbers moved out of code"), so the template is rendered
    once around a placeholder; when that does not reproduce a real rendering (a template
    that transforms the content), every prompt is rendered on its own.
    """
    if not problems:
        return []
    prefix, _, suffix = tokenizer.render_chat(PLACEHOLDER).partition(PLACEHOLDER)
    if prefix + problems[0] + suffix != tokenizer.render_chat(problems[0]):
        return [tokenizer.render_chat(problem) for problem in problems]
    return [prefix + problem + suffix for problem in problems]


def chat_samples(problems: Sequence[str], targets: Sequence[str], tokenizer: TextTokenizer,
                 block_size: int) -> list[Sample]:
    """Samples whose prompt is the user turn rendered with the tokenizer's chat template."""
    prompts = render_prompts(problems, tokenizer)
    return encode_samples(prompts, targets, tokenizer, find_special_ids(tokenizer), block_size)


def pack_rows(lengths: Sequence[int], order: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row: each sample goes into the first open row with room for it."""
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[int] = []
    for index in order:
        slot = next((row for row in open_rows if room[row] >= lengths[index]), None)
        if slot is None:
            rows.append([])
            room.append(seq_len)
            slot = len(rows) - 1
            open_rows = (open_rows + [slot])[-PACKING_WINDOW:]
        rows[slot].append(index)
        room[slot] -= lengths[index]
    return rows


@dataclass(frozen=True)
class PackedBatch:
    """B rows of packed samples."""

    input_ids: torch.Tensor  # (B, T) int64, x_0; filler holds <|endoftext|>
    positions: torch.Tensor  # (B, T) int64, position within the token's sample (0 on filler)
    segment_ids: torch.Tensor  # (B, T) int64, sample index within the row, -1 on filler
    response: torch.Tensor  # (B, T) bool, True on response tokens (labels), pads included

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(*(t.to(device) for t in (self.input_ids, self.positions,
                                                     self.segment_ids, self.response)))

    @property
    def num_tokens(self) -> int:
        """Sample tokens (not filler) in the batch."""
        return int((self.segment_ids >= 0).sum())


def response_of(sample: Sample) -> torch.Tensor:
    """(S,) bool: the sample's response tokens (the labels)."""
    if sample.response_mask is not None:
        return sample.response_mask
    return torch.arange(len(sample.ids)) >= sample.prompt_length


def build_row(samples: Sequence[Sample], seq_len: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, positions, segment_ids, response), each (T,), for one row of whole samples."""
    lengths = [len(sample.ids) for sample in samples]
    filler = seq_len - sum(lengths)
    ids = torch.cat([s.ids for s in samples] + [torch.full((filler,), pad_id)])  # (T,)
    positions = torch.cat([torch.arange(n) for n in lengths]
                          + [torch.zeros(filler, dtype=torch.int64)])  # (T,)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]
                         + [torch.full((filler,), -1)])  # (T,)
    response = torch.cat([response_of(s) for s in samples]
                         + [torch.zeros(filler, dtype=torch.bool)])  # (T,)
    return ids, positions, segments, response


def collate_rows(samples: Sequence[Sample], rows: Sequence[Sequence[int]], seq_len: int,
                 pad_id: int) -> PackedBatch:
    built = [build_row([samples[i] for i in row], seq_len, pad_id) for row in rows]
    return PackedBatch(*(torch.stack(parts) for parts in zip(*built)))  # each (B, T)


@dataclass(frozen=True)
class SampleGroup:
    """A contiguous range of sample indices (one data source) and its share of an epoch."""

    start: int  # first sample index
    stop: int  # one past the last
    weight: float  # passes per epoch: 2 takes every sample twice, 0.5 a seeded half


def epoch_order(groups: Sequence[SampleGroup], seed: int, epoch: int) -> list[int]:
    """Sample indices of epoch `epoch`, shuffled: each group's samples floor(w) times plus a
    seeded (w - floor(w)) share of them; a pure function of its arguments."""
    picks: list[int] = []
    for number, group in enumerate(groups):
        size = group.stop - group.start
        whole, part = divmod(group.weight, 1.0)
        picks += list(range(group.start, group.stop)) * int(whole)
        if part:
            generator = torch.Generator().manual_seed(derive_seed(seed, f"mix{number}", epoch))
            chosen = torch.randperm(size, generator=generator)[:round(part * size)]  # (n,)
            picks += (chosen + group.start).tolist()
    generator = torch.Generator().manual_seed(derive_seed(seed, "epoch", epoch))
    return [picks[i] for i in torch.randperm(len(picks), generator=generator).tolist()]


class BatchSchedule:
    """The batch of any step, as a pure function of (samples, seed, step).

    `samples` is any indexable sequence: a list, or a store that reads and encodes each
    sample when a batch needs it (data larger than memory); packing needs only `lengths`.
    """

    def __init__(self, samples: Sequence[Sample], seq_len: int, batch_size: int, seed: int,
                 pad_id: int, lengths: Sequence[int] | None = None,
                 groups: Sequence[SampleGroup] | None = None) -> None:
        if lengths is None:
            kept = [s for s in samples if len(s.ids) <= seq_len]
            if len(kept) < len(samples):
                log.warning("dropped %d of %d samples longer than seq_len=%d",
                            len(samples) - len(kept), len(samples), seq_len)
            samples, lengths = kept, [len(s.ids) for s in kept]
        if max(lengths, default=0) > seq_len:
            raise ValueError(f"a sample is longer than seq_len={seq_len}")
        self.samples, self.seq_len, self.batch_size = samples, seq_len, batch_size
        self.seed, self.pad_id, self.lengths = seed, pad_id, lengths
        self.groups = groups or [SampleGroup(0, len(samples), 1.0)]
        self.batches_per_epoch: list[int] = []
        self.cache: OrderedDict[int, list[list[int]]] = OrderedDict()
        if self.epoch_batches(0) == 0:
            raise ValueError(f"{len(samples)} samples fill fewer than batch_size={batch_size} "
                             f"rows of {seq_len} tokens; add train_examples or lower batch_size")

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        if epoch not in self.cache:
            order = epoch_order(self.groups, self.seed, epoch)
            self.cache[epoch] = pack_rows(self.lengths, order, self.seq_len)
            while len(self.cache) > CACHED_EPOCHS:
                self.cache.popitem(last=False)
        return self.cache[epoch]

    def epoch_batches(self, epoch: int) -> int:
        while len(self.batches_per_epoch) <= epoch:
            rows = self.epoch_rows(len(self.batches_per_epoch))
            self.batches_per_epoch.append(len(rows) // self.batch_size)
        return self.batches_per_epoch[epoch]

    def batch(self, step: int) -> PackedBatch:
        """The batch of optimizer step `step` (0-based); a partial last batch is skipped."""
        epoch, index = 0, step
        while index >= self.epoch_batches(epoch):
            index -= self.epoch_batches(epoch)
            epoch += 1
        rows = self.epoch_rows(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        return collate_rows(self.samples, rows, self.seq_len, self.pad_id)

    def fill_fraction(self, epoch: int = 0) -> float:
        """Share of row slots that hold sample tokens (the rest is filler)."""
        rows = self.epoch_rows(epoch)
        return sum(self.lengths[i] for row in rows for i in row) / (len(rows) * self.seq_len)
