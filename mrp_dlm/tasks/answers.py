"""Final answers of math completions: find them, normalise them, compare them.

Three pieces, shared by `gsm8k.py` and `math500.py`:
- finding: the content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces), and
  plain numbers in text ("1,234", "-3", "18.00");
- normalising a LaTeX answer the usual MATH way: drop spacing, `\\left`/`\\right`, `$`,
  units in a trailing `\\text{...}`, degrees, percent signs, a trailing period and a
  leading "x =", unwrap `\\text{...}`, spell `\\dfrac`/`\\tfrac` as `\\frac` and brace
  `\\frac12` and `\\sqrt3`;
- comparing: equal normalised strings, or equal numbers when both sides are plain
  numbers or simple fractions (so "0.5" matches "\\frac{1}{2}" and "18.00" matches "18").

Deliberately not here: symbolic equivalence (no sympy: "2\\sqrt{2}" and "\\sqrt{8}" differ),
and which of these a task applies (the tasks decide).
"""

from __future__ import annotations

import re
from fractions import Fraction

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BOXED_COMMANDS = ("\\boxed", "\\fbox")
# A number in running text: optional minus (not after a word character, so "10-3" gives 3),
# digits with optional thousands commas, optional decimal part.
NUMBER_PATTERN = re.compile(r"(?<!\w)-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")
LATEX_FRACTION = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
SLASH_FRACTION = re.compile(r"(-?\d+)/(-?\d+)")
TEXT_COMMAND = r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf)"
# Units: a trailing \text{...} of letters after a non-empty answer, maybe squared or cubed.
TRAILING_UNITS = re.compile(TEXT_COMMAND + r"\{\s*[A-Za-z][A-Za-z\s.]*\}(?:\^\{?\d\}?)?$")
TEXT_WRAPPER = re.compile(TEXT_COMMAND + r"\{([^{}]*)\}")
# "x =", "y=", "x_1 =" in front of the answer (only when it is the answer's one "=").
LEADING_VARIABLE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?=(?!=)")
# Removed verbatim, in this order ("\\$" before "$").
REMOVED = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle", "^{\\circ}", "^\\circ", "°",
           "\\%", "%", "\\$", "$", "{,}")
# Regex rewrites applied after whitespace is gone.
REWRITES = (
    (re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])"), ""),
    (re.compile(r"\\[dt]frac(?![A-Za-z])"), r"\\frac"),
    (re.compile(r"\\frac(\d)(\d)"), r"\\frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"\\frac(\d)(?=\{)"), r"\\frac{\1}"),  # \frac1{2} -> \frac{1}{2}
    (re.compile(r"\\frac(\{[^{}]*\})(\d)"), r"\\frac\1{\2}"),  # \frac{1}2 -> \frac{1}{2}
    (re.compile(r"\\sqrt([0-9A-Za-z])"), r"\\sqrt{\1}"),  # \sqrt3 -> \sqrt{3}
)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (also `\\boxed 5`), else None.

    Braces are matched, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`; an unclosed or
    empty box gives None.
    """
    command = max(BOXED_COMMANDS, key=text.rfind)
    start = text.rfind(command)
    if start < 0:
        return None
    rest = text[start + len(command):]
    if rest.lstrip().startswith("{"):
        content = braced_content(rest.lstrip())
    else:
        match = re.match(r"\s+([^\s$]+)", rest)
        content = match.group(1) if match else None
    return content if content and content.strip() else None


def braced_content(text: str) -> str | None:
    """What is inside the brace group that opens `text`, or None when it never closes."""
    depth = 0
    for position, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return text[1:position]
    return None


def normalise_answer(answer: str) -> str:
    """The answer in a canonical spelling (see the module docstring); no whitespace."""
    text = answer.strip().rstrip(".")
    for token in REMOVED:
        text = text.replace(token, "")
    text = re.sub(r"\s+", "", text)
    for pattern, replacement in REWRITES:
        text = pattern.sub(replacement, text)
    text = drop_units(text)
    while TEXT_WRAPPER.search(text):
        text = TEXT_WRAPPER.sub(r"\1", text)
    if text.count("=") == 1:
        text = LEADING_VARIABLE.sub("", text)
    return text.rstrip(".")


def drop_units(text: str) -> str:
    """"5\\text{cm}" -> "5"; a `\\text{...}` that is the whole answer is kept."""
    match = TRAILING_UNITS.search(text)
    return text[:match.start()] if match and match.start() > 0 else text


def parse_number(text: str) -> Fraction | None:
    """The value of a plain number ("-1,234.50"), "\\frac{a}{b}" or "a/b", else None."""
    if not text:
        return None
    if PLAIN_NUMBER.fullmatch(text) and any(char.isdigit() for char in text):
        return Fraction(text.replace(",", ""))
    for pattern in (LATEX_FRACTION, SLASH_FRACTION):
        match = pattern.fullmatch(text)
        if match:
            return fraction_of(*match.groups())
    return None


def fraction_of(*parts: str) -> Fraction | None:
    """(sign, numerator, denominator) or (numerator, denominator) -> their value."""
    sign = -1 if len(parts) == 3 and parts[0] == "-" else 1
    numerator, denominator = int(parts[-2]), int(parts[-1])
    return None if denominator == 0 else sign * Fraction(numerator, denominator)


def first_number(text: str) -> Fraction | None:
    match = NUMBER_PATTERN.search(text)
    return parse_number(match.group()) if match else None


def last_number(text: str) -> Fraction | None:
    matches = NUMBER_PATTERN.findall(text)
    return parse_number(matches[-1]) if matches else None


def answers_match(candidate: str, reference: str) -> bool:
    """Whether two answers agree after normalisation, as strings or as numbers."""
    left, right = normalise_answer(candidate), normalise_answer(reference)
    if left and left == right:
        return True
    value = parse_number(left)
    return value is not None and value == parse_number(right)
