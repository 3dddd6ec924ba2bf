"""Hub ids as `--model` / `--head`, offline from a hub cache on disk (`hub_cache.py`): the CLI,
`Pipeline.load`, `--revision`, the command `mrp serve` builds and the lm-eval model's args.
Every test runs with HF_HUB_OFFLINE=1 in a temporary HF_HOME: no network.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import random_backbone, run_cli, tiny_config
from hub_cache import cache_snapshot, commit_of, hub_home  # noqa: F401 (a fixture)
from mrp_dlm import hub
from mrp_dlm.hub import CHECKPOINT_FILES, HubError, resolve_checkpoint
from mrp_dlm.model.loading import save_backbone
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.serving import launch
from mrp_dlm.serving.launch import ServeConfig, ServeError, plan_launch

REPO = "tiny-org/tiny-sdar"
HEAD_REPO = "tiny-org/tiny-sdar-head"


@pytest.fixture
def cached(hub_home, saved_model_and_head, tmp_path):
    """The saved tiny model and head in the hub cache: the model at main (commit A) and,
    with another seed's weights, at the tag v2 (commit B); the head at main."""
    model_dir, head_dir = saved_model_and_head
    main = cache_snapshot(hub_home, REPO, model_dir, commit_of("A"))
    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            (other / name).write_bytes((model_dir / name).read_bytes())
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    save_backbone(random_backbone(tiny_config(vocab_size=vocab, mask_token_id=3,
                                              stop_token_ids=(2,)), seed=7), other)
    tagged = cache_snapshot(hub_home, REPO, other, commit_of("B"), refs=("v2",))
    head = cache_snapshot(hub_home, HEAD_REPO, head_dir, commit_of("H"))
    return {"model": model_dir, "head": head_dir, "main": main, "v2": tagged, "head_snap": head}


def test_a_hub_id_resolves_to_its_cached_snapshot(cached):
    assert resolve_checkpoint(REPO) == cached["main"]
    assert resolve_checkpoint(REPO, "v2") == cached["v2"]
    assert resolve_checkpoint(REPO, commit_of("B")) == cached["v2"]  # a commit, not a ref


def test_a_local_directory_wins_over_a_cached_repo(cached, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / REPO
    local.mkdir(parents=True)
    assert resolve_checkpoint(REPO) == local.relative_to(tmp_path)
    with pytest.raises(HubError, match="a revision .v2. is for hub ids; the model .* is a local"):
        resolve_checkpoint(REPO, "v2")


@pytest.mark.parametrize("name, message", [
    ("no/such/dir", r"model directory not found: no/such/dir \(nor is it a hub id"),
    ("-bad/-name", r"model directory not found: -bad/-name \(nor is it a hub id"),
    ("org/not-cached", r"the model org/not-cached is not a local directory nor in the hub cache "
                       r".*hf-home/hub, and HF_HUB_OFFLINE is set"),
])
def test_names_that_resolve_to_nothing_fail_in_one_line(hub_home, name, message):
    with pytest.raises(HubError, match=message):
        resolve_checkpoint(name)


def test_a_revision_not_in_the_cache_is_named(cached):
    with pytest.raises(HubError, match=f"the model {REPO} at revision v3 is not a local "
                                       "directory nor in the hub cache"):
        resolve_checkpoint(REPO, "v3")


def test_only_checkpoint_files_are_fetched(hub_home, monkeypatch):
    """The patterns snapshot_download gets keep what mrp-dlm reads of a published SDAR repo
    (JetLM/SDAR-4B-Chat-b64's file list) and leave out remote code and the README."""
    from huggingface_hub.utils import filter_repo_objects

    import huggingface_hub

    seen = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kwargs: seen.update(kwargs) or str(hub_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    resolve_checkpoint("JetLM/SDAR-4B-Chat-b64", "main")
    published = [".gitattributes", "README.md", "added_tokens.json", "chat_template.jinja",
                 "config.json", "configuration_sdar.py", "generation_config.json", "merges.txt",
                 "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "modeling_sdar.py", "special_tokens_map.json",
                 "tokenization_qwen2.py", "tokenization_qwen2_fast.py", "tokenizer.json",
                 "tokenizer_config.json", "vocab.json"]
    kept = set(filter_repo_objects(published, allow_patterns=seen["allow_patterns"]))
    assert kept == {name for name in published if not name.endswith((".py", ".md"))
                    and name != ".gitattributes"}
    assert seen["revision"] == "main" and seen["local_files_only"] is False
    assert seen["allow_patterns"] == list(CHECKPOINT_FILES)
    assert seen["cache_dir"] == hub_home / "hub"


def test_the_cache_follows_hf_hub_cache_then_hf_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert hub.cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub.cache_dir() == tmp_path / "cache"


def test_generate_takes_a_hub_id_and_revision(cached, capsys):
    argv = ["generate", "--prompt", "7 + 5", "--mode", "static", "--max-new-tokens", "8",
            "--json"]
    code, local, err = run_cli(capsys, *argv, "--model", str(cached["model"]))
    assert code == 0, err
    code, by_id, err = run_cli(capsys, *argv, "--model", REPO)
    assert code == 0, err
    assert json.loads(by_id)["token_ids"] == json.loads(local)["token_ids"]
    code, tagged, err = run_cli(capsys, *argv, "--model", REPO, "--revision", "v2")
    assert code == 0, err
    assert json.loads(tagged)["token_ids"] != json.loads(local)["token_ids"]  # other weights


def test_generate_hub_errors_are_one_line(cached, capsys, tmp_path):
    code, out, err = run_cli(capsys, "generate", "--model", REPO, "--revision", "v3",
                             "--prompt", "x")
    assert code == 2 and err.count("\n") == 1 and "at revision v3" in err, err
    code, out, err = run_cli(capsys, "generate", "--revision", "v2", "--prompt", "x")
    assert code == 2 and "needs a hub id as the model" in err, err
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"")
    code, out, err = run_cli(capsys, "generate", "--model", str(file), "--prompt", "x")
    assert code == 2 and err == (f"mrp: error: the model {file} is a file: give a checkpoint "
                                 "directory or a hub id (org/name)\n"), err


def test_pipeline_load_takes_hub_ids_for_model_and_head(cached):
    pipe = Pipeline.load(REPO, head=HEAD_REPO)
    assert pipe.directory == cached["main"] and pipe.head_dir == cached["head_snap"]
    assert pipe.head is not None  # the head reads from the snapshot and fits the model
    tagged = Pipeline.load(REPO, revision="v2")
    assert tagged.directory == cached["v2"] and tagged.head_dir is None
    with pytest.raises(HubError, match="head directory not found: no/such/head"):
        Pipeline.load(REPO, head="no/such/head")
    with pytest.raises(ValueError, match="head revision .v9. needs a hub id as the head"):
        Pipeline.load(REPO, head_revision="v9")


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(launch, "resolve_device", lambda name: "cpu")
    monkeypatch.setattr(launch, "available_memory", lambda: 1 << 33)


def test_serve_gives_sglang_the_snapshot_path(cached, cpu_machine, tmp_path):
    config = ServeConfig(model=REPO, head=HEAD_REPO)
    plan = plan_launch(config, tmp_path / "a.yaml", [], {})
    assert plan.model_path == cached["main"].resolve()
    assert plan.served_name == REPO and plan.head == cached["head_snap"].resolve()
    assert f'head: "{cached["head_snap"].resolve()}"' in plan.yaml_text
    plan = plan_launch(ServeConfig(model=REPO, revision="v2"), tmp_path / "b.yaml", [], {})
    assert plan.model_path == cached["v2"].resolve()
    with pytest.raises(ServeError, match="MRP head directory not found: no/such/head"):
        plan_launch(ServeConfig(model=REPO, head="no/such/head"), tmp_path / "c.yaml", [], {})


def test_serve_cli_has_revision_flags(cached, monkeypatch, capsys):
    from mrp_dlm.serving import process

    seen = {}
    monkeypatch.setattr(process, "serve", lambda config, extra, say: seen.setdefault("c", config)
                        and 0)
    code, out, err = run_cli(capsys, "serve", "--model", REPO, "--revision", "v2",
                             "--head", HEAD_REPO, "--head-revision", "main")
    assert code == 0, err
    assert (seen["c"].model, seen["c"].revision, seen["c"].head_revision) == (REPO, "v2", "main")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")
def test_the_lm_eval_model_takes_a_hub_id_and_revision(cached):
    from mrp_dlm.eval.harness import MrpLM

    lm = MrpLM(pretrained=REPO, revision="v2", head=HEAD_REPO, mode="static")
    assert lm.pipe.directory == cached["v2"] and lm.pipe.head_dir == cached["head_snap"]
    with pytest.raises(HubError, match="at revision v3"):
        MrpLM(pretrained=REPO, revision="v3")


def hub_error(kind: type, message: str) -> Exception:
    """An instance of one of huggingface_hub's errors (their constructors differ by version)."""
    error = kind.__new__(kind)
    Exception.__init__(error, message)
    return error


@pytest.mark.parametrize("kind, message", [
    ("RevisionNotFoundError", r"the hub repo org/name has no revision 'v9' \(a branch, tag"),
    ("RepositoryNotFoundError", r"model directory not found: org/name, and the hub has no repo "
                                r"org/name \(a private or gated one needs `hf auth login`\)"),
    ("LocalEntryNotFoundError", r"the model org/name at revision v9 is not a local directory "
                                r"nor in the hub cache .*, and the hub could not be reached"),
    ("HfHubHTTPError", r"the hub refused org/name at revision v9: 500 Server Error$"),
])
def test_online_hub_errors_become_one_line(hub_home, monkeypatch, kind, message):
    """What snapshot_download raises online (here raised by a stand-in: no network) is
    reported as one line that says what to fix."""
    import huggingface_hub
    from huggingface_hub import utils

    def refuse(repo_id, **kwargs):
        raise hub_error(getattr(utils, kind), "500 Server Error\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(HubError, match=message) as caught:
        resolve_checkpoint("org/name", "v9")
    assert "\n" not in str(caught.value)
