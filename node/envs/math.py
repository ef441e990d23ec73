"""The `math` environment: seeded arithmetic word problems solved with a calculator tool.

The model calls `calculator` (exact arithmetic parsed with `ast`, never `eval`) and ends with
`<answer>NUMBER</answer>`; the reward is 1.0 when that number equals the reference answer.
"""

from __future__ import annotations

import ast
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction

from node.envs import register_environment
from node.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    ToolFunction,
    check_split,
    split_of_text,
)
from node.tools import TOOL_ERROR_PREFIX

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 16
MAX_MAGNITUDE = Fraction(10**18)
RESULT_DECIMAL_PLACES = 6
HELDOUT_FRACTION = 0.2


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
        tree = ast.parse(expression.strip(), mode="eval")
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
    """A generated problem: its text and the calculator steps that solve it. A step may refer to
    the previous step's result as `{previous}`."""

    template: str
    prompt: str
    steps: tuple[str, ...]


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


@register_environment
class MathEnvironment(Environment):
    """Arithmetic word problems; one or two calculator calls, then `<answer>…</answer>`."""

    name = "math"
    system_prompt = (
        "Solve the word problem. Use the calculator tool for the arithmetic, then reply with "
        "the final number as <answer>NUMBER</answer>."
    )

    def __init__(self, max_turns: int = 4, templates: tuple[str, ...] | None = None) -> None:
        if max_turns < 2:
            raise ValueError("max_turns must be at least 2: one tool turn and one answer turn")
        chosen = tuple(PROBLEM_TEMPLATES) if templates is None else templates
        unknown = sorted(set(chosen) - set(PROBLEM_TEMPLATES))
        if unknown or not chosen:
            raise ValueError(
                f"unknown problem templates {unknown}; known: {', '.join(PROBLEM_TEMPLATES)}"
            )
        self.max_turns = max_turns
        self.templates = chosen

    @property
    def tools(self) -> list[ToolFunction]:
        return [calculator]

    def tasks(self, split: Split, n: int, seed: int = 0) -> list[Task]:
        check_split(split)
        rng = random.Random(f"math/{split}/{seed}/{','.join(self.templates)}")
        tasks: list[Task] = []
        seen: set[str] = set()
        attempts = 0
        while len(tasks) < n:
            attempts += 1
            if attempts > 100 * n + 1000:
                raise RuntimeError(f"could not generate {n} distinct {split} math tasks")
            problem = PROBLEM_TEMPLATES[rng.choice(self.templates)](rng)
            if problem.prompt in seen or split_of_text(problem.prompt, HELDOUT_FRACTION) != split:
                continue
            seen.add(problem.prompt)
            steps = _run_steps(problem.steps)
            digest = hashlib.sha256(problem.prompt.encode("utf-8")).hexdigest()[:16]
            tasks.append(
                Task(
                    id=f"math-{digest}",
                    prompt=problem.prompt,
                    answer=steps[-1][1],
                    metadata={"template": problem.template, "steps": list(problem.steps)},
                )
            )
        return tasks

    def reward(self, task: Task, final_answer: str | None) -> float:
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
