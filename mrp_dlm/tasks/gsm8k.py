"""The `gsm8k` task: grade-school word problems from a JSON Lines file in GSM8K's schema.

A record is {"question": ..., "answer": ...}; the reference answer is a worked solution whose
final value follows "####" ("... #### 1,234"). The example's `answer` is that value with
commas stripped ("1234"). A completion's final number is the first number after its last
"####"; without one, the last `\\boxed{}`; without that, the last number in the text. It is
correct when it equals the reference as a number ("18.00" == "18", "1,234" == "1234").

Deliberately not here: reading and validating the file (`common.FileTask`), number and
LaTeX parsing (`answers.py`), and any few-shot prompt (the user turn is the question plus
the usual step-by-step instruction; the caller applies the chat template).
"""

from __future__ import annotations

from fractions import Fraction

from mrp_dlm.tasks.answers import (BOXED_INSTRUCTION, first_number, last_boxed,
                                        last_number, normalise_answer, parse_number)
from mrp_dlm.tasks.common import Example, FileTask, record_key, text_field

FINAL_MARKER = "####"


def reference_value(solution: str) -> str:
    """The final value after the last "####" of a reference solution, commas stripped."""
    if FINAL_MARKER not in solution:
        raise ValueError(f"field 'answer' has no {FINAL_MARKER!r} before its final value")
    value = solution.rsplit(FINAL_MARKER, 1)[1].strip().replace(",", "")
    if parse_number(value) is None:
        raise ValueError(f"the final value {value!r} after {FINAL_MARKER!r} is not a number")
    return value


def extract_number(completion: str) -> Fraction | None:
    """The completion's final number (see the module docstring), or None."""
    if FINAL_MARKER in completion:
        return first_number(completion.rsplit(FINAL_MARKER, 1)[1])
    boxed = last_boxed(completion)
    if boxed is not None:
        value = parse_number(normalise_answer(boxed))
        return value if value is not None else first_number(boxed)
    return last_number(completion)


class GSM8KTask(FileTask):
    """GSM8K-style word problems graded on the final number."""

    name = "gsm8k"
    fields = ("question", "answer")

    def parse_record(self, record: dict, index: int) -> Example:
        solution = text_field(record, "answer")
        return Example(text_field(record, "question"), reference_value(solution), solution,
                       index, record_key(record, index))

    def prompt(self, example: Example) -> str:
        return f"{example.problem}\n{BOXED_INSTRUCTION}"

    def grade(self, example: Example, completion: str) -> bool:
        value = extract_number(completion)
        return value is not None and value == parse_number(str(example.answer))
