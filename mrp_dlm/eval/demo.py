"""`mrp demo`: held-out problems of each task, decoded with several modes side by side.

Deliberately not here: printing (the CLI formats the report).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mrp_dlm.config import DecodeConfig
from mrp_dlm.eval.runner import EvalResult, evaluate
from mrp_dlm.eval.tasks.common import TASK_NAMES, get_task
from mrp_dlm.pipeline import Pipeline

DEMO_PROBLEMS = 20  # held-out problems per task
DEMO_MAX_NEW_TOKENS = 128  # longest reference answers are ~90 tokens
BASELINE_CONFIGS = (DecodeConfig(mode="static", max_new_tokens=DEMO_MAX_NEW_TOKENS),
                    DecodeConfig(mode="dynamic", threshold=0.5, max_new_tokens=DEMO_MAX_NEW_TOKENS))
MRP_CONFIGS = (DecodeConfig(mode="speculative", lookahead=3, max_new_tokens=DEMO_MAX_NEW_TOKENS),
               DecodeConfig(mode="direct", lookahead=1, max_new_tokens=DEMO_MAX_NEW_TOKENS),
               DecodeConfig(mode="remask", threshold=0.5, max_new_tokens=DEMO_MAX_NEW_TOKENS))


def demo_configs(pipe: Pipeline) -> tuple[DecodeConfig, ...]:
    """The baselines, plus the MRP modes when the pipeline has a head."""
    return BASELINE_CONFIGS + (MRP_CONFIGS if pipe.head is not None else ())


@dataclass
class DemoReport:
    results: list[EvalResult] = field(default_factory=list)

    def rows(self) -> list[dict]:
        return [r.summary() for r in self.results]


def run_demo(pipe: Pipeline, problems: int = DEMO_PROBLEMS,
             configs: tuple[DecodeConfig, ...] | None = None) -> DemoReport:
    configs = demo_configs(pipe) if configs is None else configs
    report = DemoReport()
    for name in TASK_NAMES:
        task = get_task(name)
        examples = task.examples("test", problems)
        for config in configs:
            report.results.append(evaluate(pipe, task, examples, config, batch_size=problems))
    return report
