"""The task registry: every task's name, its class, and `get_task`.

The task modules import only the shared base (`common.py`); this module imports the task
modules, so imports run one way: common <- task modules <- registry <- `mrp`, eval,
training.

Deliberately not here: the `Task` base and its splits (`common.py`) and any task's own
problems or grading.
"""

from __future__ import annotations

from pathlib import Path

from mrp_dlm.tasks.arith import ArithTask
from mrp_dlm.tasks.arith_code import ArithCodeTask
from mrp_dlm.tasks.common import FileTask, Task
from mrp_dlm.tasks.gsm8k import GSM8KTask
from mrp_dlm.tasks.humaneval import HumanEvalTask
from mrp_dlm.tasks.math500 import Math500Task
from mrp_dlm.tasks.mbpp import MBPPTask

EMBEDDED_TASKS = ("arith", "arith-code")  # generated tasks the embedded model is trained on
TASK_CLASSES: dict[str, type[Task]] = {  # task name -> class; the names `--task` takes
    "arith": ArithTask, "arith-code": ArithCodeTask, "gsm8k": GSM8KTask,
    "math500": Math500Task, "humaneval": HumanEvalTask, "mbpp": MBPPTask}
TASK_NAMES = tuple(TASK_CLASSES)


def get_task(name: str, data: str | Path | None = None) -> Task:
    """The task registered under `name` (exact key: one of `TASK_NAMES`).

    File tasks read `data` (a JSON Lines file) now, so a bad file fails here; generated
    tasks take no data.
    """
    if name not in TASK_CLASSES:
        raise KeyError(f"unknown task {name!r}; choose from {TASK_NAMES}")
    task_class = TASK_CLASSES[name]
    if issubclass(task_class, FileTask):
        return task_class(data)
    if data is not None:
        raise ValueError(f"{name} is generated from seeds and takes no data file (got {data})")
    return task_class()
