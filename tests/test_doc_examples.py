"""Every example prompt that README.md and docs/*.md give the embedded model is one it
answers right (static, greedy, with the chat template, as `mrp generate --chat` runs it).

The convention, inside fenced code blocks:
- shell blocks: the text of `--prompt "..."` on a command without `--model` (backslash
  continuations joined), and of `"content": "..."` in a JSON request body;
- Python blocks (parsed with `ast`, so split string literals join): the `"content"` of a
  user message, a string assigned to `problem` or `prompt`, and the strings of a list
  passed to `.generate(...)`.
A prompt for another model (a command with `--model`) is not the embedded model's to answer.
Each prompt's answer is written below as the story's arithmetic; a new example prompt must
be added there (the test fails naming it until it is).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mrp_dlm.config import DecodeConfig
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.arith import extract_answer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL_PROMPT = re.compile(r'--prompt "([^"]+)"')
JSON_CONTENT = re.compile(r'"content": "([^"]+)"')
ANSWERS = {  # prompt -> its answer, worked out from the story
    "Tom has 3 apples. He buys 5 more. Then he eats 2 of them. How many apples are left?":
        3 + 5 - 2,
    "Mia has 4 pens. She gives 3 pens to Leo. Then she buys 6 more. How many pens are "
    "there?": 4 - 3 + 6,
    "Sam has 4 marbles. He finds 5 more. Then he loses 2. How many marbles are left?": 4 + 5 - 2,
    "Mia has 8 pears. She gives 3 pears to Leo. Then she eats 4 pears. How many pears are "
    "left?": 8 - 3 - 4,
}


def shell_prompts(code: str) -> list[str]:
    commands = code.replace("\\\n", " ").splitlines()
    return [prompt for command in commands if "--model" not in command
            for prompt in SHELL_PROMPT.findall(command) + JSON_CONTENT.findall(command)]


def python_prompts(code: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Dict):
            pairs = {k.value: v for k, v in zip(node.keys, node.values)
                     if isinstance(k, ast.Constant)}
            if getattr(pairs.get("role"), "value", None) == "user" and "content" in pairs:
                found.append(pairs["content"])
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("problem", "prompt")
                                                  for t in node.targets):
            found.append(node.value)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "generate":
            found += [e for arg in node.args[:1] if isinstance(arg, ast.List) for e in arg.elts]
    return [n.value for n in found if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def example_prompts() -> dict[str, list[str]]:
    """Every example prompt of the docs -> the files that give it."""
    prompts: dict[str, list[str]] = {}
    for path in DOCS:
        for language, code in FENCE.findall(path.read_text()):
            found = python_prompts(code) if language == "python" else shell_prompts(code)
            for prompt in found:
                prompts.setdefault(prompt, []).append(path.name)
    return prompts


def test_the_convention_finds_the_readme_examples():
    prompts = example_prompts()
    assert len(prompts) >= 3
    assert "README.md" in prompts[next(p for p in ANSWERS if p.startswith("Tom"))]
    assert not any("17 * 23" in p or "7 + 5" in p for p in prompts)  # given with --model


def test_every_example_prompt_is_answered_right_by_the_embedded_model():
    prompts = list(example_prompts())
    unknown = [p for p in prompts if p not in ANSWERS]
    assert not unknown, f"add the answers of these example prompts to ANSWERS: {unknown}"
    pipe = Pipeline.load()
    texts = pipe.generate(prompts, DecodeConfig(mode="static"), chat=True).texts
    wrong = {p: text for p, text in zip(prompts, texts) if extract_answer(text) != ANSWERS[p]}
    assert not wrong, wrong


@pytest.mark.parametrize("code, expected", [
    ('mrp generate --chat \\\n    --prompt "A b."\nmrp generate --model m --prompt "C."', ["A b."]),
    ("""curl -d '{"messages": [{"role": "user", "content": "Hi there."}]}'""", ["Hi there."]),
])
def test_shell_prompts(code, expected):
    assert shell_prompts(code) == expected


def test_python_prompts_join_split_literals():
    code = ('problem = "One."\nx = [{"role": "user", "content": "Two "\n "three."}]\n'
            'pipe.generate(["Four."], config)\n')
    assert sorted(python_prompts(code)) == ["Four.", "One.", "Two three."]
