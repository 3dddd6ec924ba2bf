"""`mrp distill`: answers, resume after a kill, parquet shards, bad rows; and the whole
path from a chat file to a head trained on the backbone's own answers, decoding exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from mrp_dlm import distill as distill_module
from mrp_dlm.config import DecodeConfig
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.registry import get_task


class Killed(Exception):
    pass


def write_chats(path: Path, count: int, split: str = "test", answered: bool = False) -> Path:
    """Chat rows of arithmetic problems: messages (a system turn, a reference answer) and,
    unless `answered`, prompt-only rows."""
    task = get_task("arith")
    rows = []
    for index, example in enumerate(task.examples(split, count)):
        turns = [{"role": "user", "content": task.prompt(example)}]
        if index % 2 or answered:
            turns = [{"role": "system", "content": "Answer briefly."}, *turns,
                     {"role": "assistant", "content": example.target}]
            rows.append({"id": f"p{index}", "messages": turns})
        else:
            rows.append({"id": f"p{index}", "prompt": turns[0]["content"]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_rows(out: Path) -> dict[str, dict]:
    rows = {}
    for path in sorted(out.glob("part-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[row["id"]] = row
    return rows


def distill_args(model_dir: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["distill", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
            "--batch-size", "3", "--max-new-tokens", "8", "--shard-rows", "4", *extra]


def test_distill_answers_every_prompt_with_the_backbone(saved_model_and_head, tmp_path, capsys):
    model_dir, _ = saved_model_and_head
    prompts = write_chats(tmp_path / "chats.jsonl", 7)
    code, out, err = run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "out"))
    assert code == 0, err
    assert "answered 7 prompts" in out and "dynamic:0.9" in err
    rows = read_rows(tmp_path / "out")
    assert len(list((tmp_path / "out").glob("part-*.jsonl"))) == 2  # 4 rows per shard
    assert sorted(rows) == sorted(f"p{i}" for i in range(7))
    pipe = Pipeline.load(model_dir)
    for index, row in rows.items():
        source = json.loads((tmp_path / "chats.jsonl").read_text().splitlines()[int(index[1:])])
        turns = source.get("messages", [{"role": "user", "content": source.get("prompt")}])
        prompt_turns = [t for t in turns if t["role"] != "assistant"]
        assert row["messages"][:-1] == prompt_turns  # the reference answer is replaced
        ids = pipe.tokenizer.encode(pipe.tokenizer.render_messages(prompt_turns))
        expected = pipe.generate_ids([ids], DecodeConfig(mode="dynamic", threshold=0.9,
                                                         max_new_tokens=8)).texts[0]
        assert row["messages"][-1] == {"role": "assistant", "content": expected}
    code, out, _ = run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "out"))
    assert code == 0 and "answered 0 prompts" in out and "7 already done" in out


def test_distill_resumes_after_a_kill(saved_model_and_head, tmp_path, capsys, monkeypatch):
    """Killed after its first batch with a torn row on disk, a rerun answers the rest and the
    rows equal a straight run's."""
    model_dir, _ = saved_model_and_head
    prompts = write_chats(tmp_path / "chats.jsonl", 8)
    assert run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "straight"))[0] == 0
    real = Pipeline.generate_ids
    calls = []

    def dying(self, ids, config):
        calls.append(len(ids))
        if len(calls) == 2:
            raise Killed
        return real(self, ids, config)

    monkeypatch.setattr(Pipeline, "generate_ids", dying)
    with pytest.raises(Killed):
        distill_module_main(model_dir, prompts, tmp_path / "resumed", capsys)
    monkeypatch.setattr(Pipeline, "generate_ids", real)
    shard = sorted((tmp_path / "resumed").glob("part-*.jsonl"))[-1]
    with shard.open("a") as handle:
        handle.write('{"id": "p7", "messages": [{"ro')  # a row torn by the kill
    code, out, _ = run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "resumed"))
    assert code == 0 and "answered 5 prompts" in out and "3 already done" in out
    assert read_rows(tmp_path / "resumed") == read_rows(tmp_path / "straight")


def distill_module_main(model_dir, prompts, out, capsys):
    from mrp_dlm import cli

    cli.main(distill_args(model_dir, prompts, out))


def test_distill_writes_parquet_shards_that_data_reads(saved_model_and_head, tmp_path, capsys):
    pytest.importorskip("pyarrow")
    model_dir, _ = saved_model_and_head
    prompts = write_chats(tmp_path / "chats.jsonl", 5)
    jsonl = run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "j"))
    code, _, err = run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "p",
                                                 "--output-format", "parquet"))
    assert jsonl[0] == 0 and code == 0, err
    assert len(list((tmp_path / "p").glob("part-*.parquet"))) == 2
    from mrp_dlm.training.records import RecordFile

    rows = {c.key: list(c.messages) for path in sorted((tmp_path / "p").glob("*.parquet"))
            for c in (RecordFile(path).read(i) for i in range(len(RecordFile(path))))}
    assert rows == {key: row["messages"] for key, row in read_rows(tmp_path / "j").items()}


def test_distill_bad_prompt_rows_fail_or_are_skipped(saved_model_and_head, tmp_path, capsys):
    model_dir, _ = saved_model_and_head
    prompts = write_chats(tmp_path / "chats.jsonl", 3)
    with prompts.open("a") as handle:
        handle.write('{"messages": "not a list"}\n')
    code, _, err = run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "out"))
    assert code == 2 and "chats.jsonl line 4" in err and "--skip-bad-rows" in err
    code, out, _ = run_cli(capsys, *distill_args(model_dir, prompts, tmp_path / "out",
                                                 "--skip-bad-rows"))
    assert code == 0 and "answered 3 prompts" in out and "1 bad rows skipped" in out


def test_chat_file_to_distilled_head_to_exact_speculative_decoding(tmp_path, capsys):
    """The issue's end-to-end path on the embedded model: a chat JSONL, `mrp distill`, a head
    trained on the answers for a few steps, speculative decoding with it equal to its rule."""
    chats = write_chats(tmp_path / "chats.jsonl", 12, split="train")
    code, _, err = run_cli(capsys, "distill", "--prompts", str(chats), "--out",
                           str(tmp_path / "distilled"), "--batch-size", "6",
                           "--max-new-tokens", "32")
    assert code == 0, err
    code, _, err = run_cli(capsys, "train", "head", "--data", str(tmp_path / "distilled"),
                           "--eval-data",
                           str(write_chats(tmp_path / "held.jsonl", 4, answered=True)),
                           "--out", str(tmp_path / "head"), "--train-steps", "3",
                           "--batch-size", "2", "--seq-len", "128", "--head-layers", "1",
                           "--lookahead", "2", "--eval-every", "3", "--eval-prompts", "2",
                           "--eval-new-tokens", "16")
    assert code == 0, err
    metrics = [json.loads(line) for line in (tmp_path / "head" / "metrics.jsonl").read_text()
               .splitlines()]
    assert metrics[-1]["acceptance"]["rounds"] > 0
    pipe = Pipeline.load(None, head=tmp_path / "head")
    prompts = [get_task("arith").prompt(e) for e in get_task("arith").examples("test", 3)]
    rule = pipe.generate(prompts, DecodeConfig(mode="dynamic", threshold=0.9), chat=True)
    fast = pipe.generate(prompts, DecodeConfig(mode="speculative", threshold=0.9, lookahead=2),
                         chat=True)
    assert fast.token_ids == rule.token_ids
    assert fast.stats.rounds > 0
