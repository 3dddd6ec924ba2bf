"""The synthetic tasks: deterministic, disjoint splits, valid problems, and graders that agree."""

import random
import re

import pytest

from mrp_dlm.tasks import arith_problems
from mrp_dlm.tasks.arith import ArithTask, extract_answer
from mrp_dlm.tasks.arith_code import ArithCodeTask, extract_code
from mrp_dlm.tasks.common import TEST_SIZE, Example
from mrp_dlm.tasks.registry import EMBEDDED_TASKS, get_task

TRAIN_COUNT = 3000


@pytest.fixture(scope="module", params=EMBEDDED_TASKS)
def task(request):
    return get_task(request.param)


def test_registry_has_exact_keys():
    assert EMBEDDED_TASKS == ("arith", "arith-code")
    assert isinstance(get_task("arith"), ArithTask)
    assert isinstance(get_task("arith-code"), ArithCodeTask)
    with pytest.raises(KeyError):
        get_task("arith_code")
    with pytest.raises(ValueError, match="takes no data"):
        get_task("arith", "problems.jsonl")


def test_generation_is_deterministic(task):
    fresh = get_task(task.name)
    assert task.examples("test") == fresh.examples("test")
    assert task.examples("train", 200) == fresh.examples("train", 200)
    assert task.make_example(12345) == fresh.make_example(12345)


def test_global_rng_is_untouched(task):
    random.seed(7)
    state = random.getstate()
    task.make_example(99)
    assert random.getstate() == state


def test_split_prefixes_are_stable(task):
    assert task.examples("test", 50) == task.examples("test")[:50]
    assert task.examples("train", 100) == task.examples("train", 300)[:100]


def test_test_split_size(task):
    assert len(task.examples("test")) == TEST_SIZE >= 500
    with pytest.raises(ValueError):
        task.examples("test", TEST_SIZE + 1)
    with pytest.raises(ValueError):
        task.examples("validation")


def test_uid_is_the_seed(task):
    example = task.examples("test", 1)[0]
    assert example.key == "" and example.uid == str(example.seed)


def test_splits_are_disjoint_and_deduplicated(task):
    test_problems = [example.problem for example in task.examples("test")]
    train_problems = [example.problem for example in task.examples("train", TRAIN_COUNT)]
    assert len(set(test_problems)) == len(test_problems)
    assert len(set(train_problems)) == len(train_problems) == TRAIN_COUNT
    assert not set(test_problems) & set(train_problems)


def test_prompt_is_problem_text(task):
    example = task.examples("test", 1)[0]
    assert task.prompt(example) == example.problem


def test_problems_respect_the_difficulty_limits():
    for seed in range(2000):
        problem = arith_problems.make_word_problem(seed)
        assert arith_problems.MIN_STEPS <= len(problem.steps) <= arith_problems.MAX_STEPS
        for step in problem.steps:
            assert 0 <= step.result < arith_problems.RESULT_LIMIT
            assert step.result == {"+": step.left + step.right, "-": step.left - step.right,
                                   "*": step.left * step.right}[step.op]
            if step.op == "*":
                assert max(step.left, step.right) <= arith_problems.MAX_FACTOR
        assert problem.answer == problem.steps[-1].result
        assert not re.search(r"\d[,.]\d", problem.text), "numbers must be plain digits"


def test_no_number_occurs_twice_in_a_story():
    for seed in range(2000):
        numbers = re.findall(r"\d+", arith_problems.make_word_problem(seed).text)
        assert len(numbers) == len(set(numbers)), (seed, numbers)


def test_templates_are_varied():
    assert len(arith_problems.SCENARIOS) >= 15
    openings = {arith_problems.make_word_problem(seed).text.split(".")[0].split(" has ")[0]
                for seed in range(3000)}
    assert len(openings) > 50
    for scenario in arith_problems.SCENARIOS:
        assert all(item.isidentifier() for item in scenario.items)


def test_arith_target_format():
    example = ArithTask().make_example(3)
    lines = example.target.split("\n")
    assert lines[-1] == f"#### {example.answer}"
    assert all(re.fullmatch(r"\d+ [-+*] \d+ = \d+( [a-z]+)?", line) for line in lines[:-1])


def test_both_line_styles_occur_in_both_tasks():
    arith_lines = [line for seed in range(200)
                   for line in ArithTask().make_example(seed).target.split("\n")[:-1]]
    named = [line[-1].isalpha() for line in arith_lines]
    assert 0.35 < sum(named) / len(named) < 0.65
    code = "\n".join(ArithCodeTask().make_example(seed).target for seed in range(200))
    assert re.search(r"^    (\w+) = \1 [-+*] ", code, re.M)
    assert re.search(r"^    \w+ [-+*]= ", code, re.M)


def test_arith_reference_targets_grade_correct():
    task = ArithTask()
    examples = task.examples("test") + task.examples("train", TRAIN_COUNT)
    assert all(task.grade(example, example.target) for example in examples)


def test_arith_wrong_answers_grade_false():
    task = ArithTask()
    example = task.examples("test", 1)[0]
    assert not task.grade(example, f"#### {example.answer + 1}")
    assert not task.grade(example, f"The answer is {example.answer}.")
    assert not task.grade(example, f"#### {example.answer}\n#### {example.answer + 1}")
    assert task.grade(example, f"#### {example.answer + 1}\n#### {example.answer}")


@pytest.mark.parametrize("text, expected", [
    ("2 + 3 = 5\n#### 5", 5),
    ("####5", 5),
    ("#### 9.", 9),
    ("#### 12 apples", 12),
    ("#### 1,000", 1000),
    ("#### -3", -3),
    ("#### 4\n#### 7", 7),
    ("#### 9\n<|im_end|>", 9),
    ("#### 9.5", None),
    ("#### 9.0", None),
    ("#### 1,2", None),
    ("#### abc", None),
    ("####", None),
    ("no marker 42", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_arith_code_reference_targets_grade_correct():
    task = ArithCodeTask()
    examples = task.examples("test")
    assert all(task.grade_many(examples, [example.target for example in examples]))


def test_arith_code_problem_and_target_format():
    example = ArithCodeTask().make_example(3)
    assert example.problem.endswith("Write a Python function solve() that returns the answer.")
    assert example.problem.split("\n")[0] == ArithTask().make_example(3).problem
    assert example.target.startswith("def solve():\n    ")
    assert example.target.split("\n")[-1].startswith("    return ")


def test_arith_code_wrong_answers_grade_false():
    task = ArithCodeTask()
    example = Example("p", 9, "def solve():\n    return 9", 0)
    completions = ["def solve():\n    return 10", "def solve():\n    return 9.0",
                   "def solve():\n    return '9'", "def solve(:\n    return 9",
                   "def solve():\n    import os\n    os.system('true')\n    return 9",
                   "def solve():\n    while True:\n        pass",
                   "the answer is 9", "```python\ndef solve():\n    return 9\n```"]
    results = task.grade_many([example] * len(completions), completions)
    assert results == [False] * 7 + [True]
    assert task.grade(example, example.target)


@pytest.mark.parametrize("text, expected", [
    ("def solve():\n    return 1", "def solve():\n    return 1"),
    ("```python\ndef solve():\n    return 1\n```\nDone.", "def solve():\n    return 1\n"),
    ("Here:\n```\nx = 1\n```", "x = 1\n"),
    ("```py\nx = 1", "x = 1"),
])
def test_extract_code(text, expected):
    assert extract_code(text) == expected
