"""The math environment, the environment registry and the tool-call parser/executor."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from node.envs import (
    DuplicateEnvironmentError,
    Environment,
    UnknownEnvironmentError,
    get_environment,
    list_environments,
    register_environment,
)
from node.envs.base import InvalidSplitError
from node.envs.math import MathEnvironment, calculator, evaluate_expression, format_number
from node.tools import (
    TOOL_ERROR_PREFIX,
    ToolCall,
    execute_tool_call,
    execute_tool_calls,
    extract_final_answer,
    parse_tool_calls,
    tool_messages,
)


@pytest.fixture(scope="module")
def env() -> MathEnvironment:
    environment = get_environment("math")
    assert isinstance(environment, MathEnvironment)
    return environment


def test_calculator_computes_exactly() -> None:
    assert calculator("12+7*3") == "33"
    assert calculator("(4+41)/9") == "5"
    assert calculator("10-4*1.25") == "5"
    assert calculator("0.1+0.2") == "0.3"
    assert calculator("7/2") == "3.5"
    assert calculator("10/3") == "3.333333"
    assert calculator("-(3)+2**3") == "5"
    assert calculator(" 2 * ( 3 + 4 ) ") == "14"
    assert evaluate_expression("1/3") == Fraction(1, 3)


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd')",
        "x + 1",
        "(1).__class__",
        "[1, 2]",
        "'a' * 3",
        "True + 1",
        "lambda: 1",
        "2**100",
        "9**9**9",
        "10**5**5",
        "2**0.5",
        "1e999",
        "1/0",
        "0**-1",
        "99999999999*99999999999",
        "1+" * 120 + "1",
        "2**-17",
        "",
        "1 +",
    ],
)
def test_calculator_refuses_unsafe_or_invalid_input(expression: str) -> None:
    result = calculator(expression)
    assert result.startswith(TOOL_ERROR_PREFIX), result


def test_format_number_trims_and_rounds() -> None:
    assert format_number(Fraction(5, 1)) == "5"
    assert format_number(Fraction(-5, 2)) == "-2.5"
    assert format_number(Fraction(1, 8)) == "0.125"
    assert format_number(Fraction(2, 3)) == "0.666667"


def test_tasks_are_deterministic_and_splits_disjoint(env: MathEnvironment) -> None:
    train = env.tasks("train", 300, seed=0)
    assert env.tasks("train", 300, seed=0) == train
    assert env.tasks("train", 50, seed=1) != train[:50]
    heldout = env.tasks("heldout", 300, seed=0)
    more_heldout = env.tasks("heldout", 300, seed=7)
    train_prompts = {task.prompt for task in train + env.tasks("train", 300, seed=3)}
    heldout_prompts = {task.prompt for task in heldout + more_heldout}
    assert not train_prompts & heldout_prompts
    assert len({task.id for task in train}) == 300
    assert {task.metadata["template"] for task in train} == set(env.templates)
    with pytest.raises(InvalidSplitError):
        env.tasks("test", 3)  # type: ignore[arg-type]


def test_reward_is_numeric_equality(env: MathEnvironment) -> None:
    (task,) = [t for t in env.tasks("train", 200) if t.metadata["template"] == "change"][:1]
    assert "." in task.answer or task.answer.isdigit()
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, f" {float(Fraction(task.answer)):.4f} ") == 1.0
    assert env.reward(task, "$" + task.answer) == 1.0
    assert env.reward(task, str(Fraction(task.answer) + 1)) == 0.0
    assert env.reward(task, "twelve") == 0.0
    assert env.reward(task, None) == 0.0


def test_tool_schema_comes_from_hints_and_docstring(env: MathEnvironment) -> None:
    (schema,) = env.tool_schemas()
    function = schema["function"]
    assert function["name"] == "calculator"
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert function["parameters"]["required"] == ["expression"]
    assert "arithmetic" in function["description"]


def _render_tool_calls(message: dict) -> str:
    """The assistant text a model writes for `message` (same layout as the chat template)."""
    calls = [call["function"] for call in message.get("tool_calls", [])]
    parts = [message["content"]] if message["content"] else []
    parts += [
        "<tool_call>"
        + json.dumps({"name": call["name"], "arguments": call["arguments"]})
        + "</tool_call>"
        for call in calls
    ]
    return "\n".join(parts)


def test_solver_trajectories_score_full_reward_on_heldout(env: MathEnvironment) -> None:
    tools = env.tools_by_name()
    for task in env.tasks("heldout", 120):
        messages = env.solve(task)
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        final_answer = None
        tool_turns = 0
        position = 2
        while position < len(messages):
            text = _render_tool_calls(messages[position])
            calls = parse_tool_calls(text)
            if not calls:
                final_answer = extract_final_answer(text)
                break
            tool_turns += 1
            results = execute_tool_calls(calls, tools)
            expected = messages[position + 1 : position + 1 + len(results)]
            assert tool_messages(results) == expected
            assert not any(result.is_error for result in results)
            position += 1 + len(results)
        assert tool_turns >= 1
        assert env.reward(task, final_answer) == 1.0, task


def test_parser_turns_bad_calls_into_counted_errors() -> None:
    tools = {"calculator": calculator}
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>\n'
        "<tool_call>{not json}</tool_call>\n"
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>\n'
        '<tool_call>{"name": "calculator", '
        '"arguments": "{\\"expression\\": \\"3*3\\"}"}</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>\n'
        '<tool_call>["calculator"]</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+'
    )
    results = execute_tool_calls(parse_tool_calls(text), tools)
    contents = [result.content for result in results]
    assert contents[0] == "4"
    assert contents[1].startswith("Error: tool call is not valid JSON")
    assert contents[2] == "Error: unknown tool 'search'; available tools: calculator"
    assert contents[3].startswith("Error: bad arguments for calculator")
    assert contents[4] == (
        "Error: bad arguments for calculator: argument 'expression' must be of type str"
    )
    assert contents[5] == "9"
    assert contents[6] == "Error: division by zero"
    assert contents[7] == "Error: tool call must be a JSON object"
    assert contents[8] == "Error: <tool_call> is never closed"
    assert [result.is_error for result in results] == [
        False, True, True, True, True, False, True, True, True,
    ]  # fmt: skip


def test_tool_exceptions_become_error_messages() -> None:
    def flaky(value: int) -> str:
        raise RuntimeError(f"boom {value}")

    call = ToolCall(raw="", name="flaky", arguments={"value": 3})
    result = execute_tool_call(call, {"flaky": flaky})
    assert result.is_error
    assert result.content == "Error: flaky raised RuntimeError: boom 3"


def test_final_answer_extraction() -> None:
    assert extract_final_answer("so <answer> 42 </answer>") == "42"
    assert extract_final_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_final_answer("<answer>unclosed") is None
    assert extract_final_answer("no answer") is None


def test_registry_lists_gets_and_refuses_duplicates() -> None:
    assert "math" in list_environments()
    assert isinstance(get_environment("math", max_turns=3), MathEnvironment)
    assert get_environment("math", max_turns=3).max_turns == 3
    with pytest.raises(UnknownEnvironmentError, match="registered: .*math"):
        get_environment("no-such-domain")
    with pytest.raises(DuplicateEnvironmentError, match="already registered"):

        @register_environment
        class AnotherMath(MathEnvironment):
            name = "math"

    assert type(get_environment("math")) is MathEnvironment
    assert issubclass(MathEnvironment, Environment)
