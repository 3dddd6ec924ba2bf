"""The `math500` task: competition problems from a JSON Lines file in MATH500's schema.

A record is {"problem": ..., "answer": ...} with optional "solution" (a worked solution,
used as the reference response) and "unique_id" (the example's key). A completion's final
answer is the content of its last `\\boxed{...}` (or `\\fbox{...}`); it is correct when it
matches the reference answer after the usual normalisation (see `answers.py`). A completion
with no box is wrong.

Deliberately not here: reading and validating the file (`common.FileTask`), the
normalisation rules (`answers.py`), and symbolic equivalence.
"""

from __future__ import annotations

from mrp_dlm.tasks.answers import BOXED_INSTRUCTION, answers_match, last_boxed
from mrp_dlm.tasks.common import Example, FileTask, record_key, text_field


class Math500Task(FileTask):
    """MATH-style problems graded on the last boxed answer."""

    name = "math500"
    fields = ("problem", "answer")
    optional_fields = ("solution", "unique_id")

    def parse_record(self, record: dict, index: int) -> Example:
        answer = text_field(record, "answer")
        if not answer.strip():
            raise ValueError("field 'answer' is empty")
        has_solution = record.get("solution") is not None
        target = text_field(record, "solution") if has_solution else f"\\boxed{{{answer}}}"
        return Example(text_field(record, "problem"), answer, target, index,
                       record_key(record, index))

    def prompt(self, example: Example) -> str:
        return f"{example.problem}\n{BOXED_INSTRUCTION}"

    def grade(self, example: Example, completion: str) -> bool:
        boxed = last_boxed(completion)
        return boxed is not None and answers_match(boxed, str(example.answer))
