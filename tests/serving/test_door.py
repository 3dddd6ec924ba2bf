"""One door into SGLang: every touch of SGLang internals lives in `sglang_process.py` or
`sglang_forward.py`, and each touch exists in the SGLang the plugin pins.

- `plugin.load()` on another SGLang version logs one line and registers nothing (no
  SGLang needed: the version is faked);
- no other serving module imports SGLang, names an SGLang module, or reads SGLang's runner,
  pool, batch or scheduler internals;
- every hook target resolves in this SGLang, and every ForwardBatch field the plugin writes
  or reads while serving (the fake engine, verify rows included) is one of its fields;
- the model class and the algorithm contract stand on SGLang's own classes.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from mrp_dlm.serving import plugin
from mrp_dlm.serving import sglang_process as door

SERVING = Path(plugin.__file__).parent
DOORS = ("sglang_process.py", "sglang_forward.py")
INTERNALS = {  # attributes of SGLang's objects only the doors may read or write
    "req_to_token_pool", "token_to_kv_pool_allocator", "kv_index_translator", "req_to_token",
    "req_pool_indices", "req_pool_indices_cpu", "extend_prefix_lens_cpu", "out_cache_loc",
    "input_ids", "dllm_prompt_mask", "logits_output", "full_logits", "can_run_graph",
    "forward_mode", "dllm_config", "tp_worker", "metrics_reporter", "algo_name_to_cls",
    "first_done_first_out_mode", "algorithm_config", "reqs", "_TritonFinder",
}


def sglang_touches(path: Path) -> list[str]:
    """'line: what' for each SGLang import, SGLang module name or internal attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("sglang.") else []
        elif isinstance(node, ast.Attribute):
            names = [node.attr] if node.attr in INTERNALS else []
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names
                  if name.split(".")[0] == "sglang" or name in INTERNALS]
    return found


def test_only_the_doors_touch_sglang():
    modules = [p for p in SERVING.rglob("*.py") if p.name not in DOORS]
    touches = {str(p.relative_to(SERVING)): sglang_touches(p) for p in modules}
    assert not {name: found for name, found in touches.items() if found}, touches
    assert sglang_touches(SERVING / "sglang_forward.py")  # the scan sees a door's touches


def test_load_on_another_sglang_registers_nothing(monkeypatch, caplog):
    monkeypatch.setattr(door, "sglang_version", lambda: "0.6.0")
    monkeypatch.delenv(door.MODEL_PACKAGE_VARIABLE, raising=False)
    calls = []
    for name in ("register_algorithms", "register_hooks", "use_model_package"):
        monkeypatch.setattr(door, name, lambda *args, name=name: calls.append(name))
    monkeypatch.setattr(plugin, "register_sdar_config", lambda: calls.append("sdar config"))
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.load() is False
    assert calls == [] and door.MODEL_PACKAGE_VARIABLE not in os.environ
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "found SGLang 0.6.0" in lines[0] and "registers nothing" \
        in lines[0], lines


def test_load_on_the_pinned_sglang_registers_everything(monkeypatch):
    monkeypatch.setattr(door, "sglang_version", lambda: door.SUPPORTED_SGLANG[0])
    calls = []
    for name in ("register_algorithms", "register_hooks", "use_model_package"):
        monkeypatch.setattr(door, name, lambda *args, name=name: calls.append(name))
    monkeypatch.setattr(plugin, "register_sdar_config", lambda: calls.append("sdar config"))
    monkeypatch.setattr(plugin, "register_algorithms", lambda: calls.append("algorithms"))
    assert plugin.load() is True
    assert sorted(calls) == ["algorithms", "register_hooks", "sdar config", "use_model_package"]


def test_the_hooks_leave_other_models_and_algorithms_alone(monkeypatch):
    from mrp_dlm.serving.sampling import BATCH_ATTRIBUTE

    monkeypatch.setattr(door, "served_algorithm", lambda: ("LowConfidence", None))
    kvc = SimpleNamespace(is_draft_worker=False)  # no model_config: it must not be read
    assert door.after_cell_size(1000, None, kvc) == 1000
    greedy = SimpleNamespace(sampling_params=SimpleNamespace(top_k=1, sampling_seed=3))
    for config, attached in ((None, False), (SimpleNamespace(algorithm="LowConfidence"), False),
                             (SimpleNamespace(algorithm="MrpSpeculative"), True)):
        out = door.after_forward_batch_init(SimpleNamespace(), None,
                                            SimpleNamespace(dllm_config=config, reqs=[greedy]))
        assert hasattr(out, BATCH_ATTRIBUTE) == attached, config
    assert plugin.block_facts(SimpleNamespace(architectures=["Qwen3ForCausalLM"]), None) is None
    facts = plugin.block_facts(SimpleNamespace(architectures=["SDARForCausalLM"],
                                               block_size=16, mask_token_id=5), None)
    assert (facts.block_size, facts.mask_token_id) == (16, 5)


@pytest.fixture
def sglang():
    from sglang_env import require_sglang

    require_sglang()
    if not door.supported():
        pytest.skip(f"the plugin pins SGLang {door.SUPPORTED_SGLANG}, found "
                    f"{door.sglang_version()}")


def test_every_hook_target_resolves(sglang):
    from sglang.srt.plugins.hook_registry import HookType

    assert len(door.HOOKS) == 9
    for target, (adapter, kind) in door.HOOKS.items():
        owner, name = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(owner), name)), target
        assert HookType[kind] in (HookType.AFTER, HookType.AROUND) and callable(adapter)


def test_the_model_bases_and_the_algorithm_contract_resolve(sglang):
    from sglang.srt.dllm.algorithm.base import DllmAlgorithm

    from mrp_dlm.serving.sglang_forward import SGLangAlgorithm, sglang_model_class

    for architecture in door.MODEL_BASES:
        assert sglang_model_class(architecture).__name__ == architecture
    assert issubclass(SGLangAlgorithm, DllmAlgorithm)
    for name in ("run", "configure_server_args", "validate_request"):
        assert callable(getattr(DllmAlgorithm, name)), name
    assert door.triton_mock_finder() is not None


def forward_batch_names() -> set[str]:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    return {f.name for f in dataclasses.fields(ForwardBatch)} | set(dir(ForwardBatch))


def test_the_verify_rows_write_forward_batch_fields(sglang):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from mrp_dlm.serving.sglang_forward import ROW_FIELDS

    fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert not set(ROW_FIELDS) - fields, sorted(set(ROW_FIELDS) - fields)


def test_serving_reads_and_writes_only_forward_batch_fields(sglang, tmp_path, monkeypatch):
    """A fake-engine serve of MrpSpeculative with verify rows: every attribute of a
    ForwardBatch read or written on the way is SGLang's (or the plugin's sampling)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    import fake_engine
    from mrp_dlm.config import HeadConfig
    from mrp_dlm.model.head import MRPHead
    from mrp_dlm.serving.sampling import BATCH_ATTRIBUTE
    from mrp_dlm.serving.speculative import MrpSpeculative
    from test_algorithms import MASK, backbone, dllm_config, runner_with_head, saved_head

    used: set[str] = set()

    class Recording(ForwardBatch):
        def __getattribute__(self, name):
            if not name.startswith("__"):
                used.add(name)
            return super().__getattribute__(name)

        def __setattr__(self, name, value):
            used.add(name)
            super().__setattr__(name, value)

    batch_of = fake_engine.batch_of

    def recorded(*args, **kwargs):
        batch = batch_of(*args, **kwargs)
        batch.__class__ = Recording
        return batch

    monkeypatch.setattr(fake_engine, "batch_of", recorded)
    model = backbone(5, 4, True)
    head = saved_head(tmp_path, model, MRPHead(model.config, HeadConfig(num_layers=2)))
    algorithm = MrpSpeculative(dllm_config("MrpSpeculative", 4, lookahead=3, head=head))
    runner = runner_with_head(model, 4, head)
    fake_engine.serve(runner, algorithm, [[5, 6, 7], [8, 9, 10, 11, 12]], 12, MASK)
    assert {"out_cache_loc", "req_pool_indices", "extend_prefix_lens_cpu"} <= used
    assert "extend_start_loc" in used  # written by build_rows_batch: verify rows were built
    unknown = used - forward_batch_names() - {BATCH_ATTRIBUTE}
    assert not unknown, sorted(unknown)
