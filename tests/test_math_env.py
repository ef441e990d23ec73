"""The math environment (word problems and reasoning-gym families), the environment registry and
the tool-call parser/executor."""

from __future__ import annotations

import json
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from decimal import getcontext
from fractions import Fraction

import pytest
from skillswarm.agent.envs import (
    DuplicateEnvironmentError,
    Environment,
    UnknownEnvironmentError,
    get_environment,
    list_environments,
    register_environment,
)
from skillswarm.agent.envs.base import InvalidSplitError, Task
from skillswarm.agent.envs.math import (
    DEFAULT_FAMILIES,
    PROBLEM_TEMPLATES,
    REASONING_GYM_FAMILIES,
    MathEnvironment,
    ReasoningGymFamily,
    UnknownProblemFamilyError,
    answers_equivalent,
    calculator,
    evaluate_expression,
    format_number,
)
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer
from skillswarm.agent.tools import (
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


@pytest.mark.parametrize("expression", ["3in 4", "1if 2", "5or 6", "1else"])
def test_model_written_junk_is_refused_without_parser_warnings(expression: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = calculator(expression)
    assert result.startswith(TOOL_ERROR_PREFIX), result
    assert [w for w in caught if issubclass(w.category, SyntaxWarning)] == []


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
    assert {task.metadata["family"] for task in train} == set(env.families) == set(DEFAULT_FAMILIES)
    with pytest.raises(InvalidSplitError):
        env.tasks("test", 3)  # type: ignore[arg-type]


def test_reward_is_numeric_equality(env: MathEnvironment) -> None:
    (task,) = [t for t in env.tasks("train", 200) if t.metadata["family"] == "change"][:1]
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


@pytest.fixture(scope="module")
def template_tokenizer():
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


def _replay_solver(env: MathEnvironment, tasks: list[Task], tokenizer) -> float:
    """Render each of the solver's assistant turns with the chat template, parse and run its tool
    calls with the task's bound tools, check they give the demonstration's tool messages, and
    return the fraction of tasks whose final answer earns reward 1.0."""
    full_reward = 0
    for task in tasks:
        messages = env.solve(task)
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        tools = env.bind_tools(task)
        final_answer = None
        tool_turns = 0
        position = 2
        while position < len(messages):
            text = tokenizer.apply_chat_template([messages[position]], tokenize=False)
            calls = parse_tool_calls(text)
            if not calls:
                final_answer = env.final_answer(text)
                break
            tool_turns += 1
            results = [execute_tool_call(call, tools) for call in calls]
            expected = messages[position + 1 : position + 1 + len(results)]
            assert tool_messages(results) == expected
            assert not any(result.is_error for result in results)
            position += 1 + len(results)
        assert tool_turns == len(task.metadata["steps"]) >= 1
        full_reward += env.reward(task, final_answer) == 1.0
    return full_reward / len(tasks)


def test_solver_trajectories_score_full_reward_on_heldout(
    env: MathEnvironment, template_tokenizer
) -> None:
    tasks = env.tasks("heldout", 240)
    assert {task.metadata["family"] for task in tasks} == set(DEFAULT_FAMILIES)
    assert _replay_solver(env, tasks, template_tokenizer) >= 0.99


@pytest.mark.parametrize("family", [*PROBLEM_TEMPLATES, *REASONING_GYM_FAMILIES])
def test_solver_scores_full_reward_on_each_family(family: str, template_tokenizer) -> None:
    env = MathEnvironment(families=(family,))
    tasks = env.tasks("heldout", 200, seed=1)
    assert {task.metadata["family"] for task in tasks} == {family}
    assert _replay_solver(env, tasks, template_tokenizer) >= 0.99


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


def test_families_are_chosen_by_name_and_templates_stays_an_alias() -> None:
    assert MathEnvironment(families=["chain_sum", "share"]).families == ("chain_sum", "share")
    assert MathEnvironment(templates=("packs",)).families == ("packs",)
    assert MathEnvironment(3, ("products",)).families == ("products",)
    assert set(MathEnvironment().families) == set(DEFAULT_FAMILIES)
    with pytest.raises(UnknownProblemFamilyError, match="known: .*chain_sum"):
        MathEnvironment(families=("chain_sum", "calculus"))
    with pytest.raises(UnknownProblemFamilyError):
        MathEnvironment(families=())
    with pytest.raises(ValueError, match="not both"):
        MathEnvironment(families=("packs",), templates=("packs",))


@pytest.mark.parametrize("family", sorted(REASONING_GYM_FAMILIES))
def test_reasoning_gym_families_generate_deterministic_distinct_split_tasks(family: str) -> None:
    precision = getcontext().prec
    env = MathEnvironment(families=(family,))
    train = env.tasks("train", 150)
    assert MathEnvironment(families=(family,)).tasks("train", 150) == train
    assert env.tasks("train", 20, seed=1) != train[:20]
    heldout = env.tasks("heldout", 100) + env.tasks("heldout", 100, seed=5)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert len({t.prompt for t in train}) == len({t.id for t in train}) == 150
    assert getcontext().prec == precision  # generation leaves the decimal context alone
    for task in train:
        source = task.metadata["reasoning_gym"]
        assert source["dataset"] == REASONING_GYM_FAMILIES[family].dataset
        assert task.prompt == source["entry"]["question"]
        assert task.answer == source["entry"]["answer"]
        (expression,) = task.metadata["steps"]
        assert expression in task.prompt  # the policy copies it from the prompt
        assert len(task.prompt) <= 160


def test_items_the_calculator_cannot_match_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """basic_arithmetic computes '/' as floor division; with long expressions some references
    differ from the exact value, and those items never become tasks."""
    import reasoning_gym

    config = {"min_terms": 4, "max_terms": 6, "min_digits": 3, "max_digits": 4}
    expression_of = REASONING_GYM_FAMILIES["basic_arithmetic"].expression_of
    monkeypatch.setitem(
        REASONING_GYM_FAMILIES,
        "long_basic_arithmetic",
        ReasoningGymFamily("basic_arithmetic", config, expression_of),
    )
    raw = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=400, **config)
    inexact = [
        item
        for item in raw
        if not calculator(expression_of(item)).startswith(TOOL_ERROR_PREFIX)
        and Fraction(calculator(expression_of(item))) != Fraction(item["answer"])
    ]
    assert inexact, "the configuration should produce floor-division references"
    env = MathEnvironment(families=("long_basic_arithmetic",))
    tasks = env.tasks("train", 150)
    for task in tasks:
        (expression,) = task.metadata["steps"]
        assert Fraction(calculator(expression)) == Fraction(task.answer)
        assert env.reward(task, calculator(expression)) == 1.0


def test_partial_credit_from_reasoning_gym_scorers_counts_as_zero() -> None:
    import reasoning_gym

    env = MathEnvironment(families=("chain_sum",))
    task = env.tasks("heldout", 1)[0]
    source = task.metadata["reasoning_gym"]
    dataset = reasoning_gym.create_dataset(source["dataset"], **source["config"])
    for near_miss in (task.answer + "1", task.answer + " apples", f"x = {task.answer}?"):
        partial = dataset.score_answer(near_miss, source["entry"])
        assert 0.0 < partial < 1.0
        assert env.reward(task, near_miss) == 0.0
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, f" {task.answer}.00 ") == 1.0


def test_decimal_arithmetic_accepts_the_calculators_rounding_only() -> None:
    env = MathEnvironment(families=("decimal_arithmetic",))
    tasks = env.tasks("heldout", 200)
    rounded = [t for t in tasks if calculator(t.metadata["steps"][0]) != t.answer]
    assert rounded, "some references carry more places than the calculator prints"
    for task in rounded:
        assert env.reward(task, calculator(task.metadata["steps"][0])) == 1.0
        assert env.reward(task, str(Fraction(task.answer) + Fraction(1, 10))) == 0.0


def test_math_verify_accepts_equivalent_forms_and_refuses_wrong_ones() -> None:
    assert answers_equivalent("0.5", "1/2")
    assert answers_equivalent("0.5", "\\frac{1}{2}")
    assert answers_equivalent("-3", "-6/2")
    assert not answers_equivalent("0.5", "1/3")
    assert not answers_equivalent("0.5", "0.6")
    # Outside the bounded grammar: powers would make sympy expand huge numbers.
    assert not answers_equivalent("0.5", "10^10^10")
    assert not answers_equivalent("0.5", "9**9**9")
    assert not answers_equivalent("2", "2*1")
    assert not answers_equivalent("7", "7 apples")
    assert not answers_equivalent("0.5", "1/2" + " " * 80)


def test_reward_falls_back_to_math_verify_outside_the_main_thread() -> None:
    env = MathEnvironment(families=("decimal_chain_sum",))
    task = env.tasks("heldout", 1)[0]
    exact = Fraction(task.answer)
    assert exact.denominator > 1
    as_fraction = f"{exact.numerator}/{exact.denominator}"
    wrong_fraction = f"{exact.numerator + 1}/{exact.denominator}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        right, wrong, latex = pool.map(
            lambda answer: env.reward(task, answer),
            [as_fraction, wrong_fraction, f"\\frac{{{exact.numerator}}}{{{exact.denominator}}}"],
        )
    assert (right, wrong, latex) == (1.0, 0.0, 1.0)


@pytest.mark.parametrize("family", [*PROBLEM_TEMPLATES, *REASONING_GYM_FAMILIES])
def test_missing_or_overlong_answers_score_zero(family: str) -> None:
    env = MathEnvironment(families=(family,))
    task = env.tasks("heldout", 1)[0]
    assert env.reward(task, None) == 0.0
    assert env.reward(task, "") == 0.0
    assert env.reward(task, task.answer + " " * 100) == 0.0
    assert env.reward(task, task.answer) == 1.0


def test_reasoning_gym_tasks_rescore_from_their_json_metadata() -> None:
    env = MathEnvironment(families=tuple(REASONING_GYM_FAMILIES))
    tasks = env.tasks("train", 60)
    copies = [Task(**json.loads(json.dumps(asdict(task)))) for task in tasks]
    assert copies == tasks
    for copy in copies:
        solved = env.solve(copy)[-1]["content"]
        assert env.reward(copy, env.final_answer(solved)) == 1.0
