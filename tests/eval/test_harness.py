"""The lm-evaluation-harness model `mrp` (mrp_dlm/eval/harness.py); skipped without lm-eval.

The agreement test runs the documented commands, `python -m mrp_dlm.eval.harness` over the
local task in lm_eval_task/ and `mrp eval --task arith`, each in its own process, and
checks that they decode the same problems into the same completions, extract the same
answers and score the same accuracy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.eval import harness  # noqa: E402
from mrp_dlm.eval.harness import Generation, MrpLM, generation_of  # noqa: E402
from mrp_dlm.model.loading import embedded_head_dir, embedded_model_dir  # noqa: E402
from mrp_dlm.tasks.arith import ArithTask, extract_answer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "tests" / "eval" / "lm_eval_task"
TASK_PROBLEMS = 100  # problems in TASK_DIR / arith.jsonl


def request(context: str, **gen_kwargs) -> Instance:
    return Instance(request_type="generate_until", doc={}, arguments=(context, gen_kwargs),
                    idx=0)


@pytest.fixture(scope="module")
def embedded_lm() -> MrpLM:
    return MrpLM(device="cpu", batch_size=2)


def test_mrp_is_registered_and_declared_as_an_entry_point():
    assert get_model("mrp") is MrpLM
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["lm_eval.models"]["mrp"]
    module, _, name = target.partition(":")
    assert (module, name) == ("mrp_dlm.eval.harness", "MrpLM")
    assert any(spec.startswith("lm-eval") for spec in project["optional-dependencies"]["lmeval"])


def test_model_args_mirror_decode_config():
    config = harness.decode_config({"mode": "speculative", "lookahead": 2, "threshold": 1,
                                    "adaptive": False, "block_size": None})
    assert config == DecodeConfig(mode="speculative", lookahead=2, threshold=1.0,
                                  adaptive=False)
    with pytest.raises(ValueError, match="unknown model arg.*lookahed.*lookahead"):
        harness.decode_config({"lookahed": 2})
    with pytest.raises(ValueError, match="lookahead='3' must be a int"):
        harness.decode_config({"lookahead": "3"})
    with pytest.raises(ValueError, match="unknown mode"):
        harness.decode_config({"mode": "greedy"})


def test_batch_size_and_device_args():
    assert harness.batch_size_of("10") == harness.batch_size_of(10) == 10
    for bad in ("auto", "auto:4", 0, "-1"):
        with pytest.raises(ValueError, match="batch_size must be a whole number"):
            harness.batch_size_of(bad)
    with pytest.raises(ValueError, match="max_batch_size"):
        MrpLM(device="cpu", max_batch_size=8)
    assert harness.device_of(None) == harness.device_of("cpu") == "cpu"
    if not torch.cuda.is_available():  # lm_eval's own default falls back, no other
        assert harness.device_of("cuda:0") == "cpu"
        with pytest.raises(ValueError, match="cuda:1"):
            MrpLM(device="cuda:1")


def test_the_embedded_model_is_named_for_lm_eval():
    """`python -m mrp_dlm.eval.harness` adds pretrained=embedded where the mrp model's args
    name no checkpoint: lm-eval names --output_path's folder after `pretrained`."""
    name = harness.name_the_model
    run_args = ["--tasks", "gsm8k", "--output_path", "out"]
    assert name(["--model", "mrp", *run_args]) == [
        "--model", "mrp", *run_args, "--model_args", "pretrained=embedded"]
    assert name(["run", "-M", "mrp", "-a", "mode=static", "lookahead=3", *run_args]) == [
        "run", "-M", "mrp", "-a", "mode=static,pretrained=embedded", "lookahead=3", *run_args]
    assert name(["--model=mrp", "--model_args=mode=static,threshold=0.9"]) == [
        "--model=mrp", "--model_args=mode=static,threshold=0.9,pretrained=embedded"]
    assert name(["--model", "mrp", "--model_args", ""]) == [
        "--model", "mrp", "--model_args", "pretrained=embedded"]
    unchanged = (["--model", "mrp", "--model_args", "mode=static", "pretrained=/ckpt/sdar-8b"],
                 ["--model", "mrp", "--model_args", "pretrained=embedded,mode=static"],
                 ["--model", "mrp", "--model_args", '{"mode": "static"}'],
                 ["--model", "mrp", "--config", "eval.yaml"],
                 ["--model", "hf", "--model_args", "dtype=float32"],
                 ["ls", "tasks"])
    for argv in unchanged:
        assert name(argv) == argv


def test_lm_eval_names_the_folder_after_pretrained_as_documented():
    """docs/evaluation.md's rule, on the installed lm-eval: NAME is `pretrained` with runs of
    `"<>:/|\\?*[]` replaced by `__` (string or dict model args alike)."""
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.utils import sanitize_model_name

    def folder(model_args):
        return sanitize_model_name(GeneralConfigTracker._get_model_name(model_args))

    assert folder("mode=static,pretrained=embedded") == folder({"pretrained": "embedded"}) \
        == "embedded"
    assert folder({"pretrained": "/ckpt/sdar-8b", "mode": "static"}) == "__ckpt__sdar-8b"
    assert GeneralConfigTracker._get_model_name({"mode": "static"}) is None  # then random


def test_pretrained_embedded_is_the_embedded_model_and_head(embedded_lm):
    assert embedded_lm.pipe.directory == embedded_model_dir()
    assert embedded_lm.pipe.head_dir == embedded_head_dir()


def test_request_settings_override_the_model_args():
    base = DecodeConfig(mode="dynamic", threshold=0.7, max_new_tokens=64, temperature=0.5)
    generation = generation_of(base, {"until": ["\n\n", "Q:"], "max_gen_toks": 32,
                                      "do_sample": False, "temperature": 0.9})
    assert generation == Generation(DecodeConfig(mode="dynamic", threshold=0.7,
                                                 max_new_tokens=32), ("\n\n", "Q:"))
    assert generation_of(base, {"until": "Q:"}) == Generation(base, ("Q:",))
    assert generation_of(base, {"top_k": 5}).config.top_k == 5
    with pytest.raises(ValueError, match="unsupported generation setting.*repetition_penalty"):
        generation_of(base, {"repetition_penalty": 1.1})
    with pytest.raises(ValueError, match="do_sample=True needs temperature > 0"):
        generation_of(DecodeConfig(), {"do_sample": True})
    sampled = generation_of(DecodeConfig(mode="speculative"), {"do_sample": True,
                                                               "temperature": 0.7})
    assert sampled.config.temperature == 0.7  # lossless speculation samples too


def test_cut_at_stops():
    assert harness.cut_at_stops("a\n\nb Q: c", ("Q:", "\n\n")) == "a"
    assert harness.cut_at_stops("a Q: b", ("", "Z")) == "a Q: b"
    assert harness.cut_at_stops("a Q: b", ()) == "a Q: b"


def test_batches_group_equal_settings_in_request_order():
    one, two = Generation(DecodeConfig(), ()), Generation(DecodeConfig(), ("Q:",))
    plan = harness.plan_batches([one, two, one, one, two, one], batch_size=2)
    assert plan == [[0, 2], [3, 5], [1, 4]]


def test_loglikelihood_requests_get_a_reason(embedded_lm):
    for method in (embedded_lm.loglikelihood, embedded_lm.loglikelihood_rolling):
        with pytest.raises(NotImplementedError, match="block-diffusion model has no cheap "
                                                      "left-to-right likelihood"):
            method([request("2 + 2 =")])


def test_chat_template_renders_like_mrp(embedded_lm):
    tokenizer = embedded_lm.pipe.tokenizer
    problem = ArithTask().examples("test", 1)[0].problem
    assert embedded_lm.chat_template() == tokenizer.chat_template
    assert (embedded_lm.apply_chat_template([{"role": "user", "content": problem}])
            == tokenizer.render_chat(problem))
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "#### 1"}]
    assert embedded_lm.apply_chat_template(turns, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n#### 1<|im_end|>\n")


@pytest.mark.exact_arithmetic  # the same decode twice: equal only without injected noise
def test_generate_until_decodes_batches_like_the_pipeline(embedded_lm):
    pipe = embedded_lm.pipe
    prompts = [pipe.tokenizer.render_chat(e.problem) for e in ArithTask().examples("test", 3)]
    requests = [request(prompts[0], until=["="], max_gen_toks=16),
                request(prompts[1], max_gen_toks=40), request(prompts[2], until=["="],
                                                                max_gen_toks=16)]
    texts = embedded_lm.generate_until(requests, disable_tqdm=True)
    short, long = DecodeConfig(max_new_tokens=16), DecodeConfig(max_new_tokens=40)
    cut = pipe.generate([prompts[0], prompts[2]], short).texts  # one batch of 2
    assert all("=" in text for text in cut)
    assert texts == [cut[0].split("=")[0], pipe.generate([prompts[1]], long).texts[0],
                     cut[1].split("=")[0]]
    assert embedded_lm.stats.tokens > 0


def run(command: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_shipped_task_data_is_the_arith_test_split():
    lines = (TASK_DIR / "arith.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    examples = ArithTask().examples("test", TASK_PROBLEMS)
    assert records == [{"uid": e.uid, "problem": e.problem, "answer": e.answer}
                       for e in examples]


def answer_of(filtered: str) -> int | None:
    """The task YAML's extracted answer as `mrp eval` reads one (None: nothing found)."""
    return None if filtered == "[invalid]" else int(filtered.replace(",", ""))


def test_lm_eval_scores_like_mrp_eval(tmp_path):
    """The same 20 problems, mode and batches: same completions, answers and accuracy."""
    limit, batch = 20, 10
    decode = {"mode": "speculative", "lookahead": "3", "threshold": "0.5"}  # = dynamic 0.5
    run([sys.executable, "-m", "mrp_dlm.eval.harness", "--model", "mrp",
         "--model_args", ",".join(f"{name}={value}" for name, value in decode.items()),
         "--device", "cpu", "--include_path", str(TASK_DIR), "--tasks", "mrp_arith",
         "--apply_chat_template", "--limit", str(limit), "--batch_size", str(batch),
         "--output_path", str(tmp_path / "lm_eval"), "--log_samples"], tmp_path)
    run([sys.executable, "-m", "mrp_dlm.cli", "eval", "--task", "arith",
         "--limit", str(limit), "--batch-size", str(batch),
         *[item for name, value in decode.items() for item in (f"--{name}", value)],
         "--out", str(tmp_path / "mrp")], tmp_path)

    folder = tmp_path / "lm_eval" / "embedded"  # named after pretrained=embedded
    [samples_file] = folder.glob("samples_mrp_arith_*.jsonl")
    [results_file] = folder.glob("results_*.json")
    assert [path.name for path in (tmp_path / "lm_eval").iterdir()] == ["embedded"]
    ours = sorted((json.loads(line) for line in samples_file.read_text().splitlines()),
                  key=lambda sample: sample["doc_id"])
    theirs = [json.loads(line) for line in (tmp_path / "mrp" / "samples.jsonl").read_text()
              .splitlines()]
    summary = json.loads((tmp_path / "mrp" / "summary.json").read_text())
    score = json.loads(results_file.read_text())["results"]["mrp_arith"]

    assert [s["doc"]["uid"] for s in ours] == [s["uid"] for s in theirs]
    assert [s["resps"][0][0] for s in ours] == [s["completion"] for s in theirs]
    assert [answer_of(s["filtered_resps"][0]) for s in ours] == [
        extract_answer(s["completion"]) for s in theirs]
    assert [s["exact_match"] == 1.0 for s in ours] == [s["correct"] for s in theirs]
    assert score["exact_match,last-answer"] == summary["accuracy"]
    assert 0 < summary["correct"] < limit  # right and wrong answers both compared
