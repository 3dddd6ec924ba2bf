"""--data: every file format, chat rendering with loss on assistant turns, bad rows, over-long
rows, weighted mixes, the held-out split and streamed batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mrp_dlm.model.loading import embedded_model_dir
from mrp_dlm.model.tokenizer import load_tokenizer
from mrp_dlm.training.conversations import ChatEncoder, fit_sample
from mrp_dlm.training.data import (BatchSchedule, SampleGroup, chat_samples, epoch_order,
                                   find_special_ids, response_of, task_texts)
from mrp_dlm.training.records import BadRow, to_conversation
from mrp_dlm.training.sources import DataOptions, load_eval_sources, load_sources, parse_sources

L = 16  # the embedded model's block size


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    tokenizer = load_tokenizer(embedded_model_dir())
    return ChatEncoder(tokenizer, find_special_ids(tokenizer), L)


def chat_rows(count: int, split: str = "train") -> list[dict]:
    """Arithmetic problems as chat rows: messages with a system turn, or prompt/response."""
    problems, targets = task_texts(["arith"], count, split)
    rows = []
    for index, (problem, target) in enumerate(zip(problems, targets)):
        if index % 2:
            rows.append({"id": f"{split}{index}", "prompt": problem, "response": target})
        else:
            rows.append({"id": f"{split}{index}", "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": problem}, {"role": "assistant", "content": target}]})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def options(**changes) -> DataOptions:
    base = dict(seq_len=256, train_examples=10, eval_examples=4, held_out_frac=0.0,
                skip_bad_rows=False)
    return DataOptions(**{**base, **changes})


def samples_of(spec: str, encoder: ChatEncoder, **changes) -> list[list[int]]:
    store = load_sources(spec, encoder, options(**changes)).store
    return [store[i].ids.tolist() for i in range(len(store))]


def test_a_one_turn_conversation_is_the_built_in_tasks_sample(encoder):
    problems, targets = task_texts(["arith"], 3)
    expected = chat_samples(problems, targets, encoder.tokenizer, L)
    for problem, target, sample in zip(problems, targets, expected):
        got = encoder.sample(to_conversation({"prompt": problem, "response": target}, "x", "k"))
        assert torch.equal(got.ids, sample.ids) and got.prompt_length == sample.prompt_length
        assert got.response_mask is None


def test_the_loss_sees_assistant_turns_only(encoder):
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 + 3?"},
             {"role": "assistant", "content": "6"}, {"role": "user", "content": "thanks"}]
    sample = encoder.sample(to_conversation({"messages": turns}, "x", "k"))
    labels = response_of(sample)  # (S,)
    assert len(sample.ids) % L == 0
    tokenizer = encoder.tokenizer
    labelled = tokenizer.decode(sample.ids[labels].tolist(), skip_special_tokens=False)
    context = tokenizer.decode(sample.ids[~labels].tolist(), skip_special_tokens=False)
    assert labelled.startswith("4<|im_end|>6<|im_end|>")
    assert set(labelled.removeprefix("4<|im_end|>6<|im_end|>").split("<|endoftext|>")) == {""}
    assert "Be brief." in context and "and 3 + 3?" in context and "thanks" not in context
    rendered = tokenizer.render_messages(turns[:5], add_generation_prompt=False)
    whole = tokenizer.decode(sample.ids.tolist(), skip_special_tokens=False)
    assert whole.replace("<|endoftext|>", "") == rendered.rstrip("\n")  # the template's text


def test_every_format_reads_the_same_conversations(tmp_path, encoder):
    rows = chat_rows(8)
    expected = samples_of(str(write_jsonl(tmp_path / "a" / "chats.jsonl", rows)), encoder)
    assert len(expected) == 8
    (tmp_path / "chats.json").write_text(json.dumps(rows))
    assert samples_of(str(tmp_path / "chats.json"), encoder) == expected
    write_jsonl(tmp_path / "a" / "more.jsonl", rows[:2])
    assert samples_of(str(tmp_path / "a"), encoder) == expected + expected[:2]  # a folder
    assert samples_of(str(tmp_path / "a" / "c*.jsonl"), encoder) == expected  # a glob
    messages = [to_conversation(r, "x", "k").messages for r in rows]
    uniform = [{"id": r["id"], "messages": list(m)} for r, m in zip(rows, messages)]
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.Table.from_pylist(uniform), tmp_path / "chats.parquet")
    assert samples_of(str(tmp_path / "chats.parquet"), encoder) == expected
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(uniform).save_to_disk(str(tmp_path / "hf"))
    assert samples_of(str(tmp_path / "hf"), encoder) == expected
    datasets.DatasetDict({"train": datasets.Dataset.from_list(uniform)}).save_to_disk(
        str(tmp_path / "hf_dict"))
    assert samples_of(str(tmp_path / "hf_dict"), encoder) == expected


def test_a_missing_file_or_unknown_type_fails_before_work(tmp_path):
    with pytest.raises(ValueError, match="names no data file"):
        parse_sources(str(tmp_path / "nothing*.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="names no data file"):
        parse_sources(str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="must be >= 0"):
        parse_sources("task:arith@-1")


@pytest.mark.parametrize("bad,message", [
    ("{not json", "line 3: not a JSON object"),
    ('{"messages": []}', "line 3: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "line 3: turn 0 must be"),
    ('{"text": "no chat"}', "line 3: a record needs 'messages' or a 'prompt'"),
    ('{"prompt": "only a prompt"}', "line 3: no assistant turn after a prompt"),
    ('[1, 2]', "line 3: a record must be a JSON object"),
])
def test_a_bad_row_names_file_and_line_or_is_skipped_and_counted(tmp_path, encoder, bad, message):
    rows = [json.dumps(row) for row in chat_rows(4)]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(rows[:2] + [bad] + rows[2:]) + "\n")
    with pytest.raises(BadRow, match=message) as error:
        load_sources(str(path), encoder, options())
    assert str(path) in str(error.value) and "--skip-bad-rows" in str(error.value)
    data = load_sources(str(path), encoder, options(skip_bad_rows=True))
    assert len(data.store) == 4 and data.counts.bad == 1 and data.counts.rows == 5


def test_over_long_samples_are_cut_at_a_block_boundary_and_counted(tmp_path, encoder):
    rows = [{"prompt": "What is 1 + 1?", "response": "2"},
            {"prompt": "Long answer?", "response": " ".join(["12 + 34 = 46"] * 40)},
            {"prompt": " ".join(["a long prompt"] * 80), "response": "ok"}]
    data = load_sources(str(write_jsonl(tmp_path / "c.jsonl", rows)), encoder,
                        options(seq_len=64))
    assert (data.counts.truncated, data.counts.too_long) == (1, 1)
    assert data.store.lengths[1] == 64 and len(data.store[1].ids) == 64  # 4 whole blocks
    whole = encoder.sample(to_conversation(rows[1], "x", "k"))
    assert torch.equal(data.store[1].ids, whole.ids[:64])
    assert fit_sample(whole, 64).prompt_length == whole.prompt_length


def test_weights_take_each_source_that_many_times_per_epoch():
    groups = [SampleGroup(0, 10, 2.0), SampleGroup(10, 30, 0.5), SampleGroup(30, 32, 0.0)]
    for epoch in range(3):
        order = epoch_order(groups, seed=1, epoch=epoch)
        assert len(order) == 20 + 10
        assert all(order.count(i) == 2 for i in range(10))
        assert len(set(order) & set(range(10, 30))) == 10 and not set(order) & {30, 31}
    assert epoch_order(groups, 1, 0) == epoch_order(groups, 1, 0)  # a pure function
    assert epoch_order(groups, 1, 0) != epoch_order(groups, 1, 1)
    one = [SampleGroup(0, 7, 1.0)]  # one source of weight 1: the plain seeded permutation
    assert sorted(epoch_order(one, 3, 0)) == list(range(7))


def test_mixed_sources_with_weights(tmp_path, encoder):
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(6))
    data = load_sources(f"{path}@2,task:arith@0.5", encoder, options())
    assert [(g.stop - g.start, g.weight) for g in data.store.groups] == [(6, 2.0), (10, 0.5)]
    assert len(data.held_out) == 4  # the task's test split


def test_held_out_split_is_stable_disjoint_and_replaced_by_eval_data(tmp_path, encoder):
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(200))
    data = load_sources(str(path), encoder, options(held_out_frac=0.1, eval_examples=100))
    assert 5 < data.counts.held_out < 40 and len(data.held_out) == data.counts.held_out
    assert len(data.store) + data.counts.held_out == 200
    train = {tuple(data.store[i].ids.tolist()) for i in range(len(data.store))}
    assert not train & {tuple(s.ids.tolist()) for s in data.held_out}
    again = load_sources(str(path), encoder, options(held_out_frac=0.1, eval_examples=100))
    assert [s.ids.tolist() for s in again.held_out] == [s.ids.tolist() for s in data.held_out]
    eval_path = write_jsonl(tmp_path / "e.jsonl", chat_rows(5, "test"))
    assert len(load_eval_sources(f"{eval_path},task:arith", encoder, options())) == 4 + 4


def test_streamed_batches_equal_in_memory_batches(tmp_path, encoder):
    """The store reads each batch's rows from disk; the packing needs only the lengths."""
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(40))
    store = load_sources(str(path), encoder, options(seq_len=128)).store
    streamed = BatchSchedule(store, 128, 2, 5, encoder.special.pad, store.lengths, store.groups)
    in_memory = BatchSchedule([store[i] for i in range(len(store))], 128, 2, 5,
                              encoder.special.pad)
    for step in (0, 3, 40):  # 40: a later epoch
        a, b = streamed.batch(step), in_memory.batch(step)
        assert all(torch.equal(getattr(a, f), getattr(b, f))
                   for f in ("input_ids", "positions", "segment_ids", "response"))


def test_train_backbone_on_chat_files(tmp_path, capsys):
    """`mrp train backbone --data`: a preset's tokenizer learns the files' turns, and the run
    trains on them (two sources mixed, a weight on one)."""
    from conftest import run_cli

    first = write_jsonl(tmp_path / "a.jsonl", chat_rows(30))
    second = write_jsonl(tmp_path / "b.json.d" / "b.jsonl", chat_rows(10, "test"))
    code, out, err = run_cli(capsys, "train", "backbone", "--preset", "tiny", "--out",
                             str(tmp_path / "run"), "--data", f"{first},{second}@2",
                             "--train-steps", "2", "--batch-size", "2", "--seq-len", "128",
                             "--vocab-size", "300")
    assert code == 0, err
    assert (tmp_path / "run" / "model.safetensors").is_file()
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text()
           .splitlines()]
    assert log[-1]["step"] == 2


def test_a_run_saved_before_the_data_fields_resumes():
    """Fields added since a run was saved take their defaults; a real change still fails."""
    import dataclasses

    from mrp_dlm.config import HeadTrainConfig
    from mrp_dlm.training import head_loop, run

    config = HeadTrainConfig(out="run")
    saved = {k: v for k, v in dataclasses.asdict(config).items()
             if k not in ("data", "eval_data", "held_out_frac", "skip_bad_rows")}
    run.check_resumable(saved, config, head_loop.RESUME_FREE_FIELDS)
    with pytest.raises(ValueError, match="held_out_frac"):
        run.check_resumable(saved, dataclasses.replace(config, held_out_frac=0.5),
                            head_loop.RESUME_FREE_FIELDS)
