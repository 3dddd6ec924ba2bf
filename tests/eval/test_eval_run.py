"""`mrp eval`'s run directory: per-sample JSONL, the summary, resume after a kill, identity."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mrp_dlm.config import DecodeConfig
from mrp_dlm.eval import store
from mrp_dlm.eval.runner import evaluate_to_dir
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.registry import get_task

MAX_NEW = 6
BATCH = 2


@pytest.fixture
def pipe(saved_model_and_head) -> Pipeline:
    model_dir, head_dir = saved_model_and_head
    return Pipeline.load(model_dir, head=head_dir)


def identity(pipe: Pipeline, **changes) -> store.RunIdentity:
    run = store.RunIdentity(task="arith", data=None, model=str(pipe.directory), head=None,
                            dtype="float32", config=DecodeConfig(max_new_tokens=MAX_NEW))
    return dataclasses.replace(run, **changes)


def run_eval(pipe: Pipeline, out, limit: int, run: store.RunIdentity | None = None) -> dict:
    run = run or identity(pipe)
    task = get_task(run.task)
    return evaluate_to_dir(pipe, task, task.examples("test", limit), store.RunDir(out, run), BATCH)


def read_lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / store.SAMPLES_FILE).read_text().splitlines()]


def test_writes_samples_summary_and_identity(pipe, tmp_path):
    summary = run_eval(pipe, tmp_path, 3)
    records = read_lines(tmp_path)
    examples = get_task("arith").examples("test", 3)
    assert [r["uid"] for r in records] == [e.uid for e in examples]
    assert [r["problem"] for r in records] == [e.problem for e in examples]
    assert all(set(r) == {"uid", "problem", "completion", "correct", "tokens"} for r in records)
    assert all(1 <= r["tokens"] <= MAX_NEW for r in records)
    assert summary == json.loads((tmp_path / store.SUMMARY_FILE).read_text())
    assert json.loads((tmp_path / store.RUN_FILE).read_text()) == identity(pipe).to_dict()
    assert summary["config"]["max_new_tokens"] == MAX_NEW and summary["task"] == "arith"
    assert (summary["n"], summary["decoded"], summary["resumed"]) == (3, 3, 0)
    assert summary["accuracy"] == round(sum(r["correct"] for r in records) / 3, 4)
    assert summary["stats"]["tokens"] == sum(r["tokens"] for r in records)
    assert summary["wall_seconds"] > 0


def test_resume_decodes_only_the_new_samples(pipe, tmp_path):
    run_eval(pipe, tmp_path, 2)
    first = read_lines(tmp_path)
    summary = run_eval(pipe, tmp_path, 4)
    records = read_lines(tmp_path)
    assert (summary["n"], summary["decoded"], summary["resumed"]) == (4, 2, 2)
    assert records[:2] == first and len({r["uid"] for r in records}) == 4
    assert summary["stats"]["tokens"] == sum(r["tokens"] for r in records[2:])
    assert "the last invocation that decoded any" in summary["stats_note"]
    again = run_eval(pipe, tmp_path, 4)
    assert again["decoded"] == 0 and again["correct"] == summary["correct"]


def test_rerunning_a_finished_run_keeps_its_speed_figures(pipe, tmp_path):
    first = run_eval(pipe, tmp_path, 3)
    assert first["stats"]["tokens_per_second"] > 0
    for _ in range(2):
        again = run_eval(pipe, tmp_path, 3)
        assert (again["decoded"], again["resumed"]) == (0, 3)
        assert {key: again[key] for key in ("stats", "stats_note", "wall_seconds")} == \
            {key: first[key] for key in ("stats", "stats_note", "wall_seconds")}
        assert json.loads((tmp_path / store.SUMMARY_FILE).read_text()) == again


def test_a_torn_last_line_is_dropped_and_decoded_again(pipe, tmp_path):
    run_eval(pipe, tmp_path, 3)
    before = read_lines(tmp_path)
    path = tmp_path / store.SAMPLES_FILE
    text = path.read_text()
    cut = text.rindex("\n", 0, len(text) - 1) + 10  # 10 characters into the last line
    path.write_text(text[:cut])
    summary = run_eval(pipe, tmp_path, 3)
    assert summary["decoded"] == 1 and summary["n"] == 3
    assert read_lines(tmp_path) == before  # greedy: the redone sample is the same


def test_a_corrupt_middle_line_is_an_error(pipe, tmp_path):
    run_eval(pipe, tmp_path, 2)
    path = tmp_path / store.SAMPLES_FILE
    path.write_text("not json\n" + path.read_text())
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        run_eval(pipe, tmp_path, 3)


OTHER_RUNS = [dict(task="arith-code"), dict(dtype="bfloat16"), dict(model="/elsewhere"),
              dict(config=DecodeConfig(mode="dynamic", max_new_tokens=MAX_NEW))]


@pytest.mark.parametrize("change", OTHER_RUNS)
def test_a_directory_of_another_run_is_refused(pipe, tmp_path, change):
    run_eval(pipe, tmp_path, 1)
    key = next(iter(change))
    with pytest.raises(ValueError, match=f"different run \\({key}"):
        run_eval(pipe, tmp_path, 1, identity(pipe, **change))
    assert len(read_lines(tmp_path)) == 1


def test_a_run_from_before_a_new_decode_field_resumes_at_its_default(pipe, tmp_path):
    run_eval(pipe, tmp_path, 1)
    path = tmp_path / store.RUN_FILE
    stored = json.loads(path.read_text())
    del stored["config"]["cuda_graphs"]  # as an older version wrote it
    path.write_text(json.dumps(stored))
    assert run_eval(pipe, tmp_path, 2)["n"] == 2
    graphs = DecodeConfig(max_new_tokens=MAX_NEW, cuda_graphs=True)
    with pytest.raises(ValueError, match="different run \\(config.cuda_graphs"):
        run_eval(pipe, tmp_path, 2, identity(pipe, config=graphs))


def test_the_head_is_part_of_the_identity_only_for_mrp_modes(pipe):
    assert identity(pipe, head="/h").head is None
    speculative = DecodeConfig(mode="speculative", max_new_tokens=MAX_NEW)
    assert identity(pipe, head="/h", config=speculative).head == "/h"


def test_bad_runs_fail_before_writing(pipe, tmp_path):
    task = get_task("arith")
    examples = task.examples("test", 2)
    with pytest.raises(ValueError, match="not unique"):
        evaluate_to_dir(pipe, task, examples + examples[:1],
                        store.RunDir(tmp_path / "a", identity(pipe)))
    headless = dataclasses.replace(pipe, head_dir=None)
    direct = identity(pipe, config=DecodeConfig(mode="direct", max_new_tokens=MAX_NEW))
    with pytest.raises(ValueError, match="needs an MRP head"):
        evaluate_to_dir(headless, task, examples, store.RunDir(tmp_path / "b", direct))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        evaluate_to_dir(pipe, task, examples, store.RunDir(tmp_path / "c", identity(pipe)), 0)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_smaller_limit_is_refused_and_leaves_the_run_as_it_was(pipe, tmp_path):
    run_eval(pipe, tmp_path, 4)
    files = {name: (tmp_path / name).read_text() for name in (store.SAMPLES_FILE,
                                                               store.SUMMARY_FILE)}
    with pytest.raises(ValueError, match=r"holds 2 samples outside the 2 problems asked for "
                                         r"\(a smaller --limit"):
        run_eval(pipe, tmp_path, 2)
    assert files == {name: (tmp_path / name).read_text() for name in files}


def test_a_summary_never_keeps_the_note_of_other_samples(pipe, tmp_path):
    """A rerun that decodes nothing keeps the speed figures only from a summary of the same
    samples: here samples.jsonl grew (a run killed before its summary) since the last one."""
    run_eval(pipe, tmp_path / "run", 2)
    run_eval(pipe, tmp_path / "whole", 4)
    (tmp_path / "run" / store.SAMPLES_FILE).write_text(
        (tmp_path / "whole" / store.SAMPLES_FILE).read_text())
    summary = run_eval(pipe, tmp_path / "run", 4)
    assert (summary["n"], summary["decoded"], summary["resumed"]) == (4, 0, 4)
    assert summary["stats_note"] == "no sample was decoded, so there are no speed figures"
    records = read_lines(tmp_path / "run")
    assert summary["accuracy"] == round(sum(r["correct"] for r in records) / 4, 4)
