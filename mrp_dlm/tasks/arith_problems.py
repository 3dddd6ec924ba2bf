"""Seeded arithmetic word problems: a short story over one running count, and its equations.

`make_word_problem(seed)` picks a scenario, a character, a start value and 2-4 operations
(+, -, small *) and returns the story text together with the structured steps, so that
`arith.py` can write the solution as equations and `arith_code.py` as a Python function.
Every intermediate result is a non-negative integer below `RESULT_LIMIT`; numbers are
written as plain digits, and no number occurs twice in one story (a repeated number made
the embedded model mix up which clause it belongs to, so its sign; see docs/experiments.md,
2026-11-30, where the `arith` failures come from). The difficulty knobs are the module
constants below.

Deliberately not here: grading, prompts and splits (see `arith.py`, `arith_code.py`,
`common.py`). Only `random.Random(seed)` is used: never the global RNG, never `hash()`.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

# Difficulty knobs.
MIN_STEPS = 2  # fewest equations in a solution
MAX_STEPS = 4  # most equations in a solution
START_RANGE = (2, 9)  # inclusive range of the starting count
MIN_TERM = 2  # smallest number added or subtracted (keeps nouns plural: never "1 apples")
MAX_TERM = 9  # largest number added or subtracted in one step
MAX_FACTOR = 4  # largest operand of a multiplication
RESULT_LIMIT = 10  # every intermediate result stays below this (single digits)
# Relative frequency of each kind of operation (group kinds need two equations).
OPERATION_WEIGHTS = {"add": 3, "sub": 3, "mul": 1, "group_add": 2, "group_sub": 2}

MALE_NAMES = ("Tom", "Sam", "Ben", "Leo", "Max", "Jack", "Noah", "Liam", "Omar", "Ravi",
              "Carlos", "Ivan", "Kenji", "Hugo", "Paul")
FEMALE_NAMES = ("Anna", "Mia", "Lily", "Emma", "Sara", "Nora", "Zoe", "Ella", "Maya", "Rosa",
                "Aisha", "Yuki", "Grace", "Lucy", "Ruth")
CONNECTORS = ("Then ", "After that, ", "Next, ", "Later, ")
MUL_CLAUSES = ("the number of {item} becomes {k} times as large",
               "there are {k} times as many {item} as before")


@dataclass(frozen=True)
class Scenario:
    """Sentence templates of one story; fields {name} {pron} {poss} {obj} {friend} {item}."""

    items: tuple[str, ...]  # plural nouns the story counts (valid Python identifiers)
    start: str  # opening sentence, with {n}
    question: str  # closing question
    add: tuple[str, ...]  # clauses that add {n}
    sub: tuple[str, ...]  # clauses that take away {n}
    group_add: tuple[str, ...]  # clauses that add {k} groups of {m}
    group_sub: tuple[str, ...]  # clauses that take away {k} groups of {m}


SCENARIOS = (
    Scenario(("apples", "oranges", "pears", "bananas", "plums", "lemons", "peaches"),
             "{name} has {n} {item}.", "How many {item} does {name} have now?",
             ("{pron} buys {n} more {item}", "{pron} picks {n} more {item}",
              "{friend} gives {obj} {n} {item}"),
             ("{pron} eats {n} {item}", "{pron} gives {n} {item} to {friend}",
              "{pron} sells {n} {item}"),
             ("{pron} buys {k} bags with {m} {item} in each",),
             ("{pron} gives {m} {item} to each of {k} friends",)),
    Scenario(("marbles", "stickers", "stamps", "cards", "shells", "buttons"),
             "{name} has {n} {item} in {poss} collection.",
             "How many {item} are in {poss} collection now?",
             ("{pron} finds {n} more {item}", "{pron} wins {n} {item} in a game",
              "{friend} gives {obj} {n} {item}"),
             ("{pron} loses {n} {item}", "{pron} trades {n} {item} with {friend}"),
             ("{pron} gets {k} packs of {m} {item}",),
             ("{pron} gives {m} {item} to each of {k} classmates",)),
    Scenario(("dollars",), "{name} has {n} dollars in {poss} wallet.",
             "How many dollars does {name} have now?",
             ("{pron} earns {n} dollars", "{pron} finds {n} dollars on the street",
              "{friend} pays {obj} {n} dollars"),
             ("{pron} spends {n} dollars on lunch", "{pron} buys a book for {n} dollars",
              "{pron} pays {friend} {n} dollars"),
             ("{pron} works {k} hours and earns {m} dollars each hour",),
             ("{pron} buys {k} tickets that cost {m} dollars each",)),
    Scenario(("cookies", "muffins", "cupcakes", "rolls", "pies"), "{name} bakes {n} {item}.",
             "How many {item} does {name} have now?",
             ("{pron} bakes {n} more {item}", "{friend} brings {n} {item}"),
             ("{pron} sells {n} {item}", "the family eats {n} {item}",
              "{pron} gives {n} {item} to {friend}"),
             ("{pron} bakes {k} trays with {m} {item} on each",),
             ("{pron} packs {k} boxes with {m} {item} in each and sells them",)),
    Scenario(("books", "magazines", "comics", "notebooks"), "A shelf holds {n} {item}.",
             "How many {item} are on the shelf now?",
             ("{name} puts {n} more {item} on the shelf", "{name} adds {n} {item} to the shelf"),
             ("{name} takes {n} {item} off the shelf", "{name} lends {n} {item} to {friend}"),
             ("{name} adds {k} stacks of {m} {item}",),
             ("{name} removes {k} piles of {m} {item}",)),
    Scenario(("students",), "A class has {n} students.", "How many students are in the class now?",
             ("{n} new students join the class", "{n} more students arrive"),
             ("{n} students leave the class", "{n} students go home early"),
             ("{k} groups of {m} students join the class",),
             ("{k} teams of {m} students leave for a game",)),
    Scenario(("passengers",), "A bus has {n} passengers.",
             "How many passengers are on the bus now?",
             ("at the next stop, {n} people get on", "{n} more passengers get on"),
             ("{n} passengers get off", "at the next stop, {n} people get off"),
             ("{k} families of {m} people get on",),
             ("{k} groups of {m} passengers get off",)),
    Scenario(("cows", "sheep", "goats", "chickens", "ducks", "pigs", "horses"),
             "A farm has {n} {item}.", "How many {item} are on the farm now?",
             ("the farmer buys {n} more {item}", "{n} {item} are born"),
             ("the farmer sells {n} {item}", "{n} {item} run away"),
             ("the farmer buys {k} groups of {m} {item}",),
             ("the farmer sells {k} groups of {m} {item}",)),
    Scenario(("birds", "sparrows", "crows", "pigeons"), "There are {n} {item} in a tree.",
             "How many {item} are in the tree now?",
             ("{n} more {item} land in the tree", "{n} {item} fly to the tree"),
             ("{n} {item} fly away", "a cat scares away {n} {item}"),
             ("{k} flocks of {m} {item} land in the tree",),
             ("{k} groups of {m} {item} fly away",)),
    Scenario(("fish", "goldfish", "snails"), "{name} has {n} {item} in a tank.",
             "How many {item} are in the tank now?",
             ("{pron} adds {n} more {item} to the tank", "{friend} gives {obj} {n} {item}"),
             ("{pron} gives {n} {item} to {friend}", "{pron} moves {n} {item} to a pond"),
             ("{pron} buys {k} bags with {m} {item} in each",),
             ("{pron} moves {k} groups of {m} {item} to a pond",)),
    Scenario(("coins", "beads", "candies", "pebbles"), "A jar holds {n} {item}.",
             "How many {item} are in the jar now?",
             ("{name} puts {n} more {item} in the jar", "{name} drops {n} {item} into the jar"),
             ("{name} takes {n} {item} out of the jar", "{friend} takes out {n} {item}"),
             ("{name} puts in {k} handfuls of {m} {item}",),
             ("{name} fills {k} cups with {m} {item} from the jar",)),
    Scenario(("points",), "{name} has {n} points in a game.",
             "How many points does {name} have now?",
             ("{pron} wins {n} points", "{pron} gets {n} bonus points"),
             ("{pron} loses {n} points", "{pron} spends {n} points on a new level"),
             ("{pron} scores {k} goals worth {m} points each",),
             ("{pron} makes {k} mistakes that cost {m} points each",)),
    Scenario(("toys", "blocks", "balls", "dolls", "cars"), "A box contains {n} {item}.",
             "How many {item} are in the box now?",
             ("{name} puts {n} more {item} in the box", "{friend} brings {n} {item}"),
             ("{name} takes {n} {item} out of the box", "{name} gives {n} {item} to {friend}"),
             ("{name} adds {k} sets of {m} {item}",),
             ("{name} gives {k} friends {m} {item} each",)),
    Scenario(("cars", "trucks", "vans"), "A parking lot has {n} {item}.",
             "How many {item} are in the parking lot now?",
             ("{n} more {item} park there", "{n} {item} arrive"),
             ("{n} {item} drive away", "{n} {item} leave the lot"),
             ("{k} rows of {m} {item} arrive",),
             ("{k} rows of {m} {item} leave",)),
    Scenario(("eggs",), "A basket has {n} eggs.", "How many eggs are in the basket now?",
             ("the hens lay {n} more eggs", "{name} buys {n} more eggs"),
             ("{name} uses {n} eggs to bake a cake", "{name} breaks {n} eggs"),
             ("{name} buys {k} cartons with {m} eggs in each",),
             ("{name} makes {k} cakes with {m} eggs each",)),
    Scenario(("pencils", "pens", "crayons", "erasers", "markers"),
             "{name} has {n} {item} in {poss} bag.", "How many {item} are in {poss} bag now?",
             ("{pron} buys {n} more {item}", "the teacher gives {obj} {n} {item}"),
             ("{pron} lends {n} {item} to {friend}", "{pron} loses {n} {item}"),
             ("{pron} buys {k} packs with {m} {item} in each",),
             ("{pron} gives {m} {item} to each of {k} classmates",)),
    Scenario(("flowers", "roses", "tulips", "trees"), "{name} plants {n} {item} in the garden.",
             "How many {item} are in the garden now?",
             ("{pron} plants {n} more {item}", "{friend} plants {n} {item}"),
             ("rabbits eat {n} {item}", "{n} {item} dry out"),
             ("{pron} plants {k} rows of {m} {item}",),
             ("{pron} gives {k} neighbors {m} {item} each",)),
    Scenario(("balloons",), "There are {n} balloons at a party.",
             "How many balloons are at the party now?",
             ("{name} blows up {n} more balloons", "{friend} brings {n} balloons"),
             ("{n} balloons pop", "{n} balloons fly away"),
             ("{name} brings {k} bunches of {m} balloons",),
             ("{name} gives {k} children {m} balloons each",)),
)


@dataclass(frozen=True)
class Step:
    """One equation `left op right = result`, and how code names its operands and result."""

    left: int  # left operand
    op: str  # "+", "-" or "*"
    right: int  # right operand
    result: int  # value of the equation
    target: str  # variable that receives the result in code
    left_name: str | None = None  # variable holding `left` in code, None for a literal
    right_name: str | None = None  # variable holding `right` in code, None for a literal


@dataclass(frozen=True)
class WordProblem:
    """A story, its starting count and the equations that solve it."""

    text: str  # the story and its question
    quantity: str  # name of the counted thing, used as the code variable
    start: int  # the starting count
    steps: tuple[Step, ...]  # equations in solving order
    answer: int  # result of the last step


def pick_cast(rng: random.Random) -> dict[str, str]:
    """Who appears in a story, as the template fields name, friend, pron, poss and obj."""
    male = rng.random() < 0.5
    name = rng.choice(MALE_NAMES if male else FEMALE_NAMES)
    friend = rng.choice([other for other in MALE_NAMES + FEMALE_NAMES if other != name])
    pronouns = ("he", "his", "him") if male else ("she", "her", "her")
    return dict(zip(("name", "friend", "pron", "poss", "obj"), (name, friend, *pronouns)))


def available_kinds(value: int, steps_left: int) -> list[str]:
    """Operations that keep every result in [0, RESULT_LIMIT) and fit in `steps_left`."""
    kinds = []
    if value + MIN_TERM < RESULT_LIMIT:
        kinds.append("add")
    if value >= MIN_TERM:
        kinds.append("sub")
    if 2 <= value <= MAX_FACTOR and value * 2 < RESULT_LIMIT:
        kinds.append("mul")
    if steps_left >= 2 and value + 4 < RESULT_LIMIT:
        kinds.append("group_add")
    if steps_left >= 2 and value >= 4:
        kinds.append("group_sub")
    return kinds


def plan_operation(rng: random.Random, kind: str, value: int) -> tuple[int, int]:
    """Operands of one operation: (n, 0) for add/sub/mul, (k, m) for the group kinds."""
    room = RESULT_LIMIT - 1 - value
    if kind == "add":
        return rng.randint(MIN_TERM, min(MAX_TERM, room)), 0
    if kind == "sub":
        return rng.randint(MIN_TERM, min(MAX_TERM, value)), 0
    if kind == "mul":
        return rng.randint(2, min(MAX_FACTOR, (RESULT_LIMIT - 1) // value)), 0
    limit = room if kind == "group_add" else value
    k = rng.randint(2, min(MAX_FACTOR, limit // 2))
    return k, rng.randint(2, min(MAX_FACTOR, limit // k))


def operation_steps(kind: str, value: int, k: int, m: int, quantity: str) -> list[Step]:
    """The equations of one operation applied to `value`."""
    if kind in ("add", "sub", "mul"):
        op = {"add": "+", "sub": "-", "mul": "*"}[kind]
        result = {"+": value + k, "-": value - k, "*": value * k}[op]
        return [Step(value, op, k, result, quantity, left_name=quantity)]
    product = k * m
    helper, op = ("added", "+") if kind == "group_add" else ("removed", "-")
    result = value + product if op == "+" else value - product
    return [Step(k, "*", m, product, helper),
            Step(value, op, product, result, quantity, left_name=quantity, right_name=helper)]


def clause_for(rng: random.Random, scenario: Scenario, kind: str, k: int, m: int) -> str:
    """The clause template of one operation with its numbers filled in ({n} or {k}, {m})."""
    templates = {"add": scenario.add, "sub": scenario.sub, "mul": MUL_CLAUSES,
                 "group_add": scenario.group_add, "group_sub": scenario.group_sub}[kind]
    template = rng.choice(templates)
    return template.replace("{n}", str(k)).replace("{k}", str(k)).replace("{m}", str(m))


def sentence(text: str) -> str:
    return text[0].upper() + text[1:] + ("" if text.endswith(("?", ".")) else ".")


def make_word_problem(seed: int) -> WordProblem:
    """The word problem of `seed`; deterministic across runs and platforms.

    Draws are retried on derived seeds ("seed.1", "seed.2", ...: string seeds hash with
    SHA-512, stable everywhere) until no number occurs twice in the story.
    """
    for attempt in itertools.count():
        problem = draw_word_problem(random.Random(seed if attempt == 0 else f"{seed}.{attempt}"))
        numbers = re.findall(r"\d+", problem.text)
        if len(set(numbers)) == len(numbers):
            return problem
    raise AssertionError("unreachable")  # itertools.count() never ends


def draw_word_problem(rng: random.Random) -> WordProblem:
    """One story drawn from `rng`."""
    scenario = rng.choice(SCENARIOS)
    cast = pick_cast(rng)
    item = rng.choice(scenario.items)
    start = rng.randint(*START_RANGE)
    steps_left = rng.randint(MIN_STEPS, MAX_STEPS)
    value, steps, clauses = start, [], []
    while steps_left > 0:
        kinds = available_kinds(value, steps_left)
        kind = rng.choices(kinds, [OPERATION_WEIGHTS[name] for name in kinds])[0]
        k, m = plan_operation(rng, kind, value)
        new_steps = operation_steps(kind, value, k, m, item)
        connector = rng.choice(CONNECTORS) if clauses else ""
        clauses.append(connector + clause_for(rng, scenario, kind, k, m))
        steps.extend(new_steps)
        steps_left -= len(new_steps)
        value = new_steps[-1].result
    fields = dict(cast, item=item, n=str(start))
    parts = [scenario.start, *clauses, scenario.question]
    text = " ".join(sentence(part.format(**fields)) for part in parts)
    return WordProblem(text, item, start, tuple(steps), value)


def line_styles(seed: int, count: int) -> list[bool]:
    """Which of two equivalent forms each of `count` solution lines takes (True: the second
    form), a fair coin per line from the seed. Two forms make the target multimodal, as
    real model outputs are: a line's tokens and the next line's positions depend on a
    choice made inside the block, which is what parallel commits get wrong."""
    rng = random.Random(f"{seed}:style")
    return [rng.random() < 0.5 for _ in range(count)]
