"""The `mbpp` task: short Python programming problems from a JSON Lines file in MBPP's schema.

A record is {"task_id", "text", "code", "test_list": [assert statements]} with optional
"test_setup_code". The user turn is the task text, the first assert as an example of the
expected signature (the usual MBPP prompt), and a request for a fenced code block. The test
program is the extracted code (see `code.extract_code`), then the setup code, then every
assert; the completion is correct when it runs to the end in the sandbox.

Deliberately not here: few-shot prompts, and reading the file (`common.FileTask`).
"""

from __future__ import annotations

from mrp_dlm.tasks.code import CodeTask, extract_code
from mrp_dlm.tasks.common import Example, text_field

CODE_REQUEST = "Write the Python code in a ```python code block."


def read_tests(record: dict) -> list[str]:
    """The record's asserts: a non-empty list of strings."""
    tests = record["test_list"]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("field 'test_list' must be a non-empty list of strings")
    return tests


def write_prompt(text: str, first_test: str) -> str:
    return f"{text}\nYour code should pass this test:\n{first_test}\n{CODE_REQUEST}"


class MBPPTask(CodeTask):
    """MBPP: write a function from a one-line description; graded by its asserts."""

    name = "mbpp"
    fields = ("task_id", "text", "code", "test_list")
    optional_fields = ("test_setup_code",)

    def parse_record(self, record: dict, index: int) -> Example:
        tests = read_tests(record)
        has_setup = record.get("test_setup_code") is not None
        setup = text_field(record, "test_setup_code") if has_setup else ""
        program = "\n".join([setup, *tests, ""])
        return Example(write_prompt(text_field(record, "text"), tests[0]), program,
                       text_field(record, "code"), index, str(record["task_id"]))

    def program(self, example: Example, completion: str) -> str:
        # The setup code runs after the solution is defined; names it imports are looked up
        # when the asserts call the solution.
        return f"{extract_code(completion)}\n\n{example.answer}"
