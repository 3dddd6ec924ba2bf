"""The `arith` task: word problems answered by step-by-step equations and a final `#### n`.

The reference response writes one equation per line and ends with the answer line, e.g.
"2 + 5 = 7\n7 - 3 = 4 apples\n#### 4": each line names the counted thing after its
result or not, a coin per line (`arith_problems.line_styles`). A completion is correct
when the integer after its last `####` equals the answer.

Deliberately not here: the problem generator (see `arith_problems.py`) and split logic (see
`common.py`).
"""

from __future__ import annotations

import re

from mrp_dlm.tasks.arith_problems import WordProblem, line_styles, make_word_problem
from mrp_dlm.tasks.common import Example, Task

ANSWER_MARKER = "####"
# An integer at the start of the answer text; commas group thousands, no decimal part.
ANSWER_PATTERN = re.compile(r"-?\d+(?:,\d{3})*(?![\d.,]*\d)")


def write_equations(problem: WordProblem, seed: int) -> str:
    styles = line_styles(seed, len(problem.steps))
    lines = [f"{step.left} {step.op} {step.right} = {step.result}"
             + (f" {problem.quantity}" if named else "")
             for step, named in zip(problem.steps, styles)]
    return "\n".join([*lines, f"{ANSWER_MARKER} {problem.answer}"])


def extract_answer(completion: str) -> int | None:
    """The integer right after the last `####`, or None when there is none."""
    if ANSWER_MARKER not in completion:
        return None
    tail = completion.rsplit(ANSWER_MARKER, 1)[1].strip()
    match = ANSWER_PATTERN.match(tail)
    return int(match.group().replace(",", "")) if match else None


class ArithTask(Task):
    """Arithmetic word problems solved with explicit equations."""

    name = "arith"

    def make_example(self, seed: int) -> Example:
        problem = make_word_problem(seed)
        return Example(problem.text, problem.answer, write_equations(problem, seed), seed)

    def grade(self, example: Example, completion: str) -> bool:
        return extract_answer(completion) == example.answer
