"""The `arith-code` task: the `arith` word problems, answered by a Python function `solve()`.

The problem text is the story plus `CODE_INSTRUCTION`, so a model trained on both tasks can
tell which answer format is wanted. The reference response is a short function that keeps
the running count in one variable named after the counted thing, e.g.
"def solve():\n    apples = 3\n    apples = apples + 5\n    apples -= 2\n    return apples":
an update of the running count is a plain or an augmented assignment, a coin per line
(`arith_problems.line_styles`). A completion is correct when `solve()`, run in the
sandbox, returns exactly the answer (an int, not 9.0).

Deliberately not here: sandboxing itself (see `sandbox.py`) and the problem generator
(see `arith_problems.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mrp_dlm.tasks.arith_problems import Step, WordProblem, line_styles, make_word_problem
from mrp_dlm.tasks.code import extract_code
from mrp_dlm.tasks.common import Example, Task
from mrp_dlm.tasks.sandbox import SandboxLimits, SandboxResult, run_many, run_python

CODE_INSTRUCTION = "Write a Python function solve() that returns the answer."
CALL = "solve()"
INDENT = "    "
GRADING_LIMITS = SandboxLimits(timeout_s=2.0)  # reference solutions finish in milliseconds


def write_statement(step: Step, augmented: bool) -> str:
    """`x = x + 5`, or `x += 5` when `augmented` and the step updates its left operand."""
    left = step.left_name or str(step.left)
    right = step.right_name or str(step.right)
    if augmented and left == step.target:
        return f"{step.target} {step.op}= {right}"
    return f"{step.target} = {left} {step.op} {right}"


def write_function(problem: WordProblem, seed: int) -> str:
    styles = line_styles(seed, len(problem.steps))
    lines = [f"{problem.quantity} = {problem.start}",
             *map(write_statement, problem.steps, styles), f"return {problem.quantity}"]
    return "\n".join(["def solve():", *(INDENT + line for line in lines)])


def is_correct(result: SandboxResult, answer: int) -> bool:
    return result.ok and result.value == repr(answer)


class ArithCodeTask(Task):
    """Arithmetic word problems solved by writing `solve()`; graded by running it."""

    name = "arith-code"

    def __init__(self, limits: SandboxLimits = GRADING_LIMITS) -> None:
        self.limits = limits

    def make_example(self, seed: int) -> Example:
        problem = make_word_problem(seed)
        text = f"{problem.text}\n{CODE_INSTRUCTION}"
        return Example(text, problem.answer, write_function(problem, seed), seed)

    def grade(self, example: Example, completion: str) -> bool:
        result = run_python(extract_code(completion), CALL, self.limits)
        return is_correct(result, example.answer)

    def grade_many(self, examples: Sequence[Example], completions: Sequence[str]) -> list[bool]:
        """Runs the programs in parallel sandboxes."""
        if len(examples) != len(completions):
            raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
        results = run_many([extract_code(text) for text in completions], CALL, self.limits)
        return [is_correct(result, example.answer) for result, example in zip(results, examples)]
