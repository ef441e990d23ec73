"""The `math` environment: arithmetic problems from word-problem templates and reasoning-gym
datasets, solved with an exact `calculator` tool and answered as `<answer>NUMBER</answer>`; scored
by numeric equality, or by the reasoning-gym dataset's scorer with math-verify as fallback.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, DefaultContext, localcontext
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from skillswarm.agent import pyast
from skillswarm.agent.envs import register_environment
from skillswarm.agent.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    ToolFunction,
    check_split,
    draw_split_tasks,
)
from skillswarm.agent.tools import TOOL_ERROR_PREFIX

if TYPE_CHECKING:
    from reasoning_gym.dataset import ProceduralDataset

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 16
MAX_MAGNITUDE = Fraction(10**18)
RESULT_DECIMAL_PLACES = 6
HELDOUT_FRACTION = 0.2
# Longest final answer that is scored at all; longer answers get reward 0.
MAX_ANSWER_CHARS = 64


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def format_number(value: Fraction) -> str:
    """Integers as integers; other values as decimals with at most six places, no trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as context:
        context.prec = 60
        decimal = (Decimal(value.numerator) / Decimal(value.denominator)).quantize(
            Decimal(1).scaleb(-RESULT_DECIMAL_PLACES)
        )
    text = format(decimal, "f").rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def parse_number(text: str | None) -> Fraction | None:
    """Read an integer or decimal such as '12', '-3.5', '$1,200'; None when it is not a number."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").removeprefix("$").strip()
    if not cleaned or len(cleaned) > 64:
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _check_magnitude(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"result exceeds {format_number(MAX_MAGNITUDE)} in magnitude")
    return value


def _evaluate_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate_node(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"unsupported literal {node.value!r}")
        try:
            return _check_magnitude(Fraction(repr(node.value)))
        except (ValueError, OverflowError) as error:
            raise CalculatorError(f"unsupported number {node.value!r}") from error
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate_node(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left = _evaluate_node(node.left)
        right = _evaluate_node(node.right)
        if isinstance(node.op, ast.Add):
            return _check_magnitude(left + right)
        if isinstance(node.op, ast.Sub):
            return _check_magnitude(left - right)
        if isinstance(node.op, ast.Mult):
            return _check_magnitude(left * right)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise CalculatorError("division by zero")
            return _check_magnitude(left / right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(
                    f"exponents must be integers from -{MAX_EXPONENT} to {MAX_EXPONENT}"
                )
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            return _check_magnitude(left ** int(right))
        raise CalculatorError(f"unsupported operator {type(node.op).__name__}")
    raise CalculatorError(
        f"unsupported syntax {type(node).__name__}; use numbers, + - * / ** and ( )"
    )


def evaluate_expression(expression: str) -> Fraction:
    """Evaluate `expression` exactly; raise CalculatorError when it is refused or invalid."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():
            # Model-written text such as "5or 6" draws SyntaxWarnings from the parser on stderr.
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = pyast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise CalculatorError("expression is not valid arithmetic") from error
    try:
        return _evaluate_node(tree)
    except RecursionError as error:
        raise CalculatorError("expression is nested too deeply") from error


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers, + - * / ** and parentheses.

    Args:
        expression: The arithmetic expression to evaluate, for example "12+7*3".
    """
    try:
        return format_number(evaluate_expression(expression))
    except CalculatorError as error:
        return f"{TOOL_ERROR_PREFIX}{error}"


NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
ITEMS = ("apples", "pens", "cards", "eggs", "books", "shells", "stamps", "marbles", "cookies")
PRICES = ("0.25", "0.5", "0.75", "1.25", "1.5", "1.75", "2.25", "2.5", "3.5", "4.75")


@dataclass(frozen=True)
class _Problem:
    """A generated problem: its family, text and the calculator steps that solve it (a step may
    refer to the previous step's result as `{previous}`). `answer` is the reference answer when it
    is not the last step's result; `source` is what a reasoning-gym scorer needs."""

    family: str
    prompt: str
    steps: tuple[str, ...]
    answer: str | None = None
    source: dict[str, Any] | None = None


def _buy_boxes(rng: random.Random) -> _Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 12)
    prompt = (
        f"{name} has {a} {item} and buys {b} boxes of {c} {item}. "
        f"How many {item} does {name} have now?"
    )
    return _Problem("buy_boxes", prompt, (f"{a}+{b}*{c}",))


def _give_away(rng: random.Random) -> _Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    b, c = rng.randint(2, 9), rng.randint(2, 6)
    a = b * c + rng.randint(1, 40)
    prompt = (
        f"{name} has {a} {item} and gives {b} {item} to each of {c} friends. "
        f"How many {item} are left?"
    )
    return _Problem("give_away", prompt, (f"{a}-{b}*{c}",))


def _packs(rng: random.Random) -> _Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 12)
    prompt = (
        f"{name} buys {a} red packs and {b} blue packs with {c} {item} in each pack. "
        f"How many {item} does {name} get?"
    )
    return _Problem("packs", prompt, (f"({a}+{b})*{c}",))


def _shelves(rng: random.Random) -> _Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(3, 25), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    prompt = (
        f"Each shelf holds {a} {item}. {name} fills {b} shelves and then sells {c} {item}. "
        f"How many {item} are left?"
    )
    return _Problem("shelves", prompt, (f"{a}*{b}-{c}",))


def _change(rng: random.Random) -> _Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, price = rng.randint(2, 9), rng.choice(PRICES)
    cost = a * Fraction(price)
    bill = next(value for value in (10, 20, 50, 100) if value > cost)
    prompt = (
        f"{name} buys {a} {item} at {price} dollars each and pays with a {bill} dollar bill. "
        f"How much change does {name} get?"
    )
    return _Problem("change", prompt, (f"{bill}-{a}*{price}",))


def _share(rng: random.Random) -> _Problem:
    first, second = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kids, each = rng.randint(2, 9), rng.randint(2, 12)
    a = rng.randint(1, kids * each - 1)
    b = kids * each - a
    prompt = (
        f"{first} has {a} {item} and {second} has {b} {item}. They share them equally among "
        f"{kids} kids. How many {item} does each kid get?"
    )
    return _Problem("share", prompt, (f"{a}+{b}", "{previous}/" + str(kids)))


PROBLEM_TEMPLATES: dict[str, Callable[[random.Random], _Problem]] = {
    "buy_boxes": _buy_boxes,
    "give_away": _give_away,
    "packs": _packs,
    "shelves": _shelves,
    "change": _change,
    "share": _share,
}


def _run_steps(steps: tuple[str, ...]) -> list[tuple[str, str]]:
    """(expression, calculator result) for each step, feeding each result into the next step."""
    done: list[tuple[str, str]] = []
    previous = ""
    for step in steps:
        expression = step.format(previous=previous)
        previous = calculator(expression)
        done.append((expression, previous))
    return done


def _expression_in_metadata(entry: Mapping[str, Any]) -> str:
    return str(entry["metadata"]["expression"])


def _expression_on_last_line(entry: Mapping[str, Any]) -> str:
    """decimal_arithmetic's question ends with a line 'EXPRESSION = ?'."""
    return str(entry["question"]).rsplit("\n", 1)[-1].removesuffix("= ?").strip()


@dataclass(frozen=True)
class ReasoningGymFamily:
    """A reasoning-gym dataset used as a problem family: the dataset's name, its generator
    settings (kept small so prompts stay short) and where an item states its expression."""

    dataset: str
    config: Mapping[str, int | bool]
    expression_of: Callable[[Mapping[str, Any]], str]


REASONING_GYM_FAMILIES: dict[str, ReasoningGymFamily] = {
    "chain_sum": ReasoningGymFamily(
        "chain_sum",
        {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
        _expression_in_metadata,
    ),
    "basic_arithmetic": ReasoningGymFamily(
        "basic_arithmetic",
        {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
        _expression_in_metadata,
    ),
    "products": ReasoningGymFamily(
        "products",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 3},
        _expression_in_metadata,
    ),
    "decimal_arithmetic": ReasoningGymFamily(
        "decimal_arithmetic",
        {"min_num_decimal_places": 1, "max_num_decimal_places": 2, "min_terms": 2, "max_terms": 3},
        _expression_on_last_line,
    ),
    "decimal_chain_sum": ReasoningGymFamily(
        "decimal_chain_sum",
        {
            "min_terms": 2,
            "max_terms": 3,
            "min_digits": 1,
            "max_digits": 2,
            "min_decimal_places": 1,
            "max_decimal_places": 2,
        },
        _expression_in_metadata,
    ),
}

# The tiny default policy learns these from a short warm start; basic_arithmetic (negative numbers
# and nested brackets) and decimal_arithmetic (six-place answers) stayed near 0% and are opt-in.
DEFAULT_FAMILIES: tuple[str, ...] = (*PROBLEM_TEMPLATES, "chain_sum", "products")
# Items of a reasoning-gym dataset are a function of (seed + index): one dataset with seed 0 is
# indexed by a number drawn from the task generator's own random stream.
REASONING_GYM_INDEX_SPACE = 2**31


class UnknownProblemFamilyError(ValueError):
    """Raised when a MathEnvironment is asked for problem families it does not have."""


@functools.lru_cache(maxsize=64)
def _reasoning_gym_dataset(dataset: str, config_json: str) -> ProceduralDataset:
    """The dataset object (generator and scorer) for a name and JSON-encoded settings; cheap
    after reasoning_gym's first import (about a second)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(
        dataset, seed=0, size=REASONING_GYM_INDEX_SPACE, **json.loads(config_json)
    )


def _config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


PLAIN_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
# math-verify runs without its signal-based timeouts (rollouts run outside the main thread), so
# only short answers made of numbers, + - /, brackets and fraction LaTeX reach it: no powers
# (`^`, `**`) or factorials, which sympy would try to expand.
MATH_VERIFY_LATEX_COMMANDS = re.compile(r"\\(?:[dt]?frac|boxed|left|right)(?![A-Za-z])")
MATH_VERIFY_CHARACTERS = re.compile(r"[0-9\s.,+\-/(){}$]*")


def answers_equivalent(gold: str, prediction: str) -> bool:
    """Whether math-verify judges `prediction` equal to `gold` (e.g. '1/2' and '0.5'); False for
    text longer than MAX_ANSWER_CHARS or outside the grammar above."""
    for text in (gold, prediction):
        if len(text) > MAX_ANSWER_CHARS:
            return False
        if not MATH_VERIFY_CHARACTERS.fullmatch(MATH_VERIFY_LATEX_COMMANDS.sub("", text)):
            return False
    from math_verify import parse, verify

    parsed_gold = parse(gold, parsing_timeout=None)
    parsed_prediction = parse(prediction, parsing_timeout=None)
    if not parsed_gold or not parsed_prediction:
        return False
    return bool(verify(parsed_gold, parsed_prediction, timeout_seconds=None))


def reasoning_gym_reward(source: Mapping[str, Any], answer: str | None) -> float:
    """1.0 when the reasoning-gym dataset in `source` (a task's `metadata["reasoning_gym"]`) gives
    `answer` full credit, or when `answer` is not a plain decimal and math-verify finds it equal
    to the reference; else 0.0 (partial credit counts as a miss)."""
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    answer = answer.strip()
    entry = source["entry"]
    dataset = _reasoning_gym_dataset(source["dataset"], _config_json(source["config"]))
    with localcontext(DefaultContext):
        try:
            score = float(dataset.score_answer(answer, entry))
        except (ArithmeticError, ValueError, TypeError):
            score = 0.0
    if score >= 1.0:
        return 1.0
    if PLAIN_DECIMAL.fullmatch(answer):
        # A plain number was compared exactly (or within the dataset's tolerance) already;
        # math-verify would only add its six-place float rounding.
        return 0.0
    return 1.0 if answers_equivalent(str(entry["answer"]), answer) else 0.0


def _reasoning_gym_problem(family_name: str, rng: random.Random) -> _Problem | None:
    """One item of a reasoning-gym family, or None when the calculator's result on the item's
    expression would not get full credit (basic_arithmetic's floor-division answers, say)."""
    family = REASONING_GYM_FAMILIES[family_name]
    config_json = _config_json(family.config)
    index = rng.randrange(REASONING_GYM_INDEX_SPACE)
    try:
        # decimal_arithmetic sets the thread's decimal precision: keep that change local.
        with localcontext(DefaultContext):
            item = _reasoning_gym_dataset(family.dataset, config_json)[index]
    except ArithmeticError:  # an expression that divides by zero
        return None
    entry = json.loads(json.dumps(item))  # plain JSON types, so tasks serialize and compare
    expression = family.expression_of(entry)
    source = {
        "dataset": family.dataset,
        "config": json.loads(config_json),
        "index": index,
        "entry": entry,
    }
    result = calculator(expression)
    if result.startswith(TOOL_ERROR_PREFIX) or reasoning_gym_reward(source, result) < 1.0:
        return None
    return _Problem(family_name, entry["question"], (expression,), entry["answer"], source)


def _task_of(problem: _Problem) -> Task:
    steps = _run_steps(problem.steps)
    metadata: dict[str, Any] = {"family": problem.family, "steps": list(problem.steps)}
    if problem.source is not None:
        metadata["reasoning_gym"] = problem.source
    digest = hashlib.sha256(problem.prompt.encode("utf-8")).hexdigest()[:16]
    return Task(
        id=f"math-{digest}",
        prompt=problem.prompt,
        answer=steps[-1][1] if problem.answer is None else problem.answer,
        metadata=metadata,
    )


def _generate_problem(family: str, rng: random.Random) -> _Problem | None:
    if family in PROBLEM_TEMPLATES:
        return PROBLEM_TEMPLATES[family](rng)
    return _reasoning_gym_problem(family, rng)


@register_environment
class MathEnvironment(Environment):
    """Arithmetic problems; one or two calculator calls, then `<answer>…</answer>`."""

    name = "math"
    system_prompt = (
        "Solve the problem. Use the calculator tool for the arithmetic, then reply with "
        "the final number as <answer>NUMBER</answer>."
    )

    def __init__(
        self,
        max_turns: int = 4,
        families: Sequence[str] | None = None,
        *,
        templates: Sequence[str] | None = None,
    ) -> None:
        """`families` picks the problem families, drawn uniformly: names of PROBLEM_TEMPLATES or
        REASONING_GYM_FAMILIES (default DEFAULT_FAMILIES); `templates` is its older name."""
        if max_turns < 2:
            raise ValueError("max_turns must be at least 2: one tool turn and one answer turn")
        if families is not None and templates is not None:
            raise ValueError("give families or templates (its older name), not both")
        requested = families if families is not None else templates
        chosen = DEFAULT_FAMILIES if requested is None else tuple(requested)
        known = (*PROBLEM_TEMPLATES, *REASONING_GYM_FAMILIES)
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            raise UnknownProblemFamilyError(
                f"unknown problem families {unknown}; known: {', '.join(known)}"
            )
        self.max_turns = max_turns
        self.families = chosen

    @property
    def tools(self) -> list[ToolFunction]:
        return [calculator]

    def tasks(self, split: Split, n: int, seed: int = 0) -> list[Task]:
        check_split(split)
        rng = random.Random(f"math/{split}/{seed}/{','.join(self.families)}")

        def draw() -> tuple[str, _Problem] | None:
            problem = _generate_problem(rng.choice(self.families), rng)
            return None if problem is None else (problem.prompt, problem)

        problems = draw_split_tasks(draw, split, n, HELDOUT_FRACTION, "math tasks")
        return [_task_of(problem) for problem in problems]

    def reward(self, task: Task, final_answer: str | None) -> float:
        if final_answer is None or len(final_answer) > MAX_ANSWER_CHARS:
            return 0.0
        source = task.metadata.get("reasoning_gym")
        if source is not None:
            return reasoning_gym_reward(source, final_answer)
        given = parse_number(final_answer)
        expected = parse_number(task.answer)
        return 1.0 if given is not None and given == expected else 0.0

    def solve(self, task: Task) -> list[Message]:
        messages = self.initial_messages(task)
        result = ""
        for expression, result in _run_steps(tuple(task.metadata["steps"])):
            call = {"name": calculator.__name__, "arguments": {"expression": expression}}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": call}],
                }
            )
            messages.append({"role": "tool", "name": calculator.__name__, "content": result})
        messages.append({"role": "assistant", "content": f"<answer>{result}</answer>"})
        return messages
