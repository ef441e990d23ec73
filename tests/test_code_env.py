"""The code environment: generated and file tasks, the sandboxed run_tests tool and its rewards."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from skillswarm.agent.envs import get_environment
from skillswarm.agent.envs.base import SPLITS, InvalidSplitError, Task, split_of_text
from skillswarm.agent.envs.code import (
    FUNCTION_FAMILIES,
    CodeEnvironment,
    NoReferenceSolutionError,
    TaskFileError,
    TestReportMemo,
    strip_code_fences,
)
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer
from skillswarm.agent.sandbox import TestRunReport
from skillswarm.agent.tools import (
    ToolCall,
    ToolResult,
    execute_tool_call,
    parse_tool_calls,
    tool_messages,
)
from transformers.utils import get_json_schema


@pytest.fixture(scope="module")
def env() -> CodeEnvironment:
    environment = get_environment("code")
    assert isinstance(environment, CodeEnvironment)
    return environment


def _first_task(env: CodeEnvironment, family: str) -> Task:
    return next(task for task in env.tasks("train", 200) if task.metadata["family"] == family)


def _replay(env: CodeEnvironment, tokenizer: Any, task: Task) -> tuple[float, bool]:
    """Render the solver's turns with the chat template, run the parsed tool calls with the
    task's bound tools; return the final reward and whether the tool results matched."""
    messages = env.solve(task)
    tools = env.bind_tools(task)
    matched = True
    final_answer = None
    position = len(env.initial_messages(task))
    while position < len(messages):
        text = tokenizer.apply_chat_template([messages[position]], tokenize=False)
        calls = parse_tool_calls(text)
        if not calls:
            final_answer = env.final_answer(text)
            break
        results = [execute_tool_call(call, tools) for call in calls]
        expected = messages[position + 1 : position + 1 + len(results)]
        matched = matched and tool_messages(results) == expected
        matched = matched and not any(result.is_error for result in results)
        position += 1 + len(results)
    return env.reward(task, final_answer), matched


def test_solver_trajectories_score_full_reward_on_heldout(env: CodeEnvironment) -> None:
    tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    tasks = env.tasks("heldout", 200)
    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda task: _replay(env, tokenizer, task), tasks))
    assert all(matched for _, matched in outcomes)
    failed = [task.prompt for task, (reward, _) in zip(tasks, outcomes, strict=True) if reward < 1]
    assert len(failed) <= 0.01 * len(tasks), failed
    tool_message = env.solve(tasks[0])[3]
    assert tool_message == {"role": "tool", "name": "run_tests", "content": "passed 3/3"}


def test_tasks_are_deterministic_varied_and_splits_disjoint(env: CodeEnvironment) -> None:
    train = env.tasks("train", 400, seed=0)
    assert env.tasks("train", 400, seed=0) == train
    assert env.tasks("train", 50, seed=1) != train[:50]
    heldout = env.tasks("heldout", 300, seed=0) + env.tasks("heldout", 300, seed=5)
    train_prompts = {task.prompt for task in train + env.tasks("train", 400, seed=9)}
    assert not train_prompts & {task.prompt for task in heldout}
    assert len({task.id for task in train}) == 400
    assert {task.metadata["family"] for task in train} == set(FUNCTION_FAMILIES)
    assert len({task.metadata["entry_point"] for task in env.tasks("train", 3000)}) > 300
    task = train[0]
    assert len(task.metadata["visible_tests"]) == 3 and len(task.metadata["hidden_tests"]) == 8
    assert task.metadata["visible_tests"][0].removeprefix("assert ") in task.prompt
    with pytest.raises(InvalidSplitError):
        env.tasks("test", 3)  # type: ignore[arg-type]
    only_add = CodeEnvironment(families=["add"])
    assert {task.metadata["family"] for task in only_add.tasks("train", 20)} == {"add"}
    with pytest.raises(ValueError, match="unknown function families"):
        CodeEnvironment(families=["sort"])


def test_wrong_and_partial_answers_score_below_one(env: CodeEnvironment) -> None:
    task = _first_task(env, "add")
    name = task.metadata["entry_point"]
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, f"```python\n{task.answer}\n```") == 1.0
    assert env.reward(task, f"def {name}(x):\n    return x") == 0.0
    assert env.reward(task, "def wrong_name(x):\n    return x") == 0.0
    assert env.reward(task, "this is not python") == 0.0
    assert env.reward(task, None) == 0.0
    assert env.reward(task, "") == 0.0

    clamp = _first_task(env, "clamp")
    low = int(clamp.metadata["entry_point"].split("_")[1])
    only_floor = f"def {clamp.metadata['entry_point']}(x):\n    return max(x, {low})"
    partial = env.reward(clamp, only_floor)
    assert 0.0 < partial < 1.0

    handmade = Task(
        id="handmade",
        prompt="Write double(x).",
        answer="def double(x):\n    return 2 * x",
        metadata={
            "family": "handmade",
            "entry_point": "double",
            "visible_tests": ["assert double(1) == 2"],
            "hidden_tests": ["assert double(0) == 0", "assert double(1) == 2"] * 2,
            "setup": "",
        },
    )
    assert env.reward(handmade, "def double(x):\n    return 2") == 0.5


def test_run_tests_tool_reports_and_turn_reward_credits_improvement(env: CodeEnvironment) -> None:
    task = _first_task(env, "multiply")
    name = task.metadata["entry_point"]
    tools = env.bind_tools(task)
    memory = env.new_episode_memory(task)

    def turn(code: str) -> tuple[str, float]:
        call = ToolCall(raw="", name="run_tests", arguments={"code": code})
        result = execute_tool_call(call, tools)
        return result.content, env.turn_reward(task, [result], memory)

    broken, reward = turn(f"def {name}(x) return x")
    assert broken.startswith("passed 0/3; error: SyntaxError") and reward == 0.0
    wrong, reward = turn(f"def {name}(x):\n    return x + 1000")
    assert wrong.startswith("passed 0/3; first failure: assert ") and "got" in wrong
    assert reward == 0.0
    first_visible = task.metadata["visible_tests"][0]
    argument = int(first_visible.split("(")[1].split(")")[0])
    expected = int(first_visible.rsplit("==", 1)[1])
    one_right = f"def {name}(x):\n    return {expected} if x == {argument} else 10**6"
    partial, reward = turn(one_right)
    assert partial.startswith("passed 1/3") and reward == pytest.approx(0.1 / 3)
    _, reward = turn(one_right)
    assert reward == 0.0  # no credit for repeating the same pass rate
    passed, reward = turn(task.answer)
    assert passed == "passed 3/3" and reward == pytest.approx(0.1 * 2 / 3)
    assert memory["best_visible_fraction"] == 1.0
    empty, reward = turn("   ")
    assert empty.startswith("Error: ") and reward == 0.0
    other_tool = ToolResult(ToolCall(raw="", name="other", arguments={}), "passed 9/9", False)
    assert env.turn_reward(task, [other_tool], env.new_episode_memory(task)) == 0.0


def test_tool_schema_comes_from_hints_and_bound_tools_match(env: CodeEnvironment) -> None:
    (schema,) = env.tool_schemas()
    function = schema["function"]
    assert function["name"] == "run_tests"
    assert function["parameters"]["properties"]["code"]["type"] == "string"
    assert function["parameters"]["required"] == ["code"]
    assert "tests" in function["description"]
    task = env.tasks("train", 1)[0]
    bound = env.bind_tools(task)
    assert list(bound) == ["run_tests"]
    assert get_json_schema(bound["run_tests"]) == schema
    unbound = env.tools_by_name()["run_tests"]("def f(): pass")
    assert unbound.startswith("Error: ") and "bind_tools" in unbound


def test_final_answer_strips_fences_and_limits_are_configurable() -> None:
    env = CodeEnvironment(wall_timeout_s=1.5, memory_bytes=256 * 1024 * 1024)
    assert env.limits.wall_timeout_s == 1.5 and env.tool_timeout_s > 1.5
    assert env.final_answer("<answer>```python\ndef f():\n    return 1\n```</answer>") == (
        "def f():\n    return 1"
    )
    assert env.final_answer("<answer>```\n```</answer>") is None
    assert env.final_answer("no answer here") is None
    assert strip_code_fences("  def f(): pass  ") == "def f(): pass"
    task = _first_task(env, "add")
    name = task.metadata["entry_point"]
    looping = f"def {name}(x):\n    while True:\n        pass"
    report = env.bind_tools(task)["run_tests"](looping)
    assert report.startswith("passed 0/3") and "time limit" in report
    assert env.reward(task, task.answer) == 1.0


HELPER_PROMPT = (
    'def encode_shift(s: str) -> str:\n    """Shift every letter by 5."""\n'
    '    return "".join(chr((ord(ch) - 97 + 5) % 26 + 97) for ch in s)\n\n\n'
    'def decode_shift(s: str) -> str:\n    """Undo encode_shift."""\n'
)
HELPER_TEST = (
    "\n\nMETADATA = {}\n\n\ndef check(candidate):\n"
    "    for word in ['abc', 'hello', 'zebra']:\n"
    "        assert candidate(encode_shift(word)) == word\n"
)


def _file_records() -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [
        {
            "task_id": "Demo/shift",
            "prompt": HELPER_PROMPT,
            "entry_point": "decode_shift",
            "canonical_solution": (
                '    return "".join(chr((ord(ch) - 97 - 5) % 26 + 97) for ch in s)\n'
            ),
            "test": HELPER_TEST,
        },
        {
            "task_id": "Demo/unsolved",
            "prompt": 'def triple(x: int) -> int:\n    """Return 3 * x."""\n',
            "entry_point": "triple",
            "test": "def check(candidate):\n    assert candidate(2) == 6\n",
        },
    ]
    for number in range(10):
        records.append(
            {
                "task_id": f"Demo/add/{number}",
                "prompt": (
                    "from typing import List\n\n\n"
                    f'def add_all(values: List[int]) -> int:\n    """Sum plus {number}."""\n'
                ),
                "entry_point": "add_all",
                "canonical_solution": f"    return sum(values) + {number}\n",
                "test": (
                    "def check(candidate):\n"
                    f"    assert candidate([1, 2]) == {3 + number}\n"
                    f"    assert candidate([]) == {number}\n"
                ),
            }
        )
    return records


def _write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    return path


def test_jsonl_tasks_load_split_solve_and_score(tmp_path: Path) -> None:
    records = _file_records()
    path = _write_jsonl(tmp_path / "tasks.jsonl", records)
    env = CodeEnvironment(tasks_file=path, heldout_fraction=0.5)
    split_of = {r["task_id"]: split_of_text(r["task_id"], 0.5) for r in records}
    for split in SPLITS:
        expected = {task_id for task_id, where in split_of.items() if where == split}
        if not expected:
            with pytest.raises(TaskFileError, match=f"no {split} tasks"):
                env.tasks(split, 1)
            continue
        tasks = env.tasks(split, len(expected), seed=3)
        assert {task.metadata["task_id"] for task in tasks} == expected
        assert env.tasks(split, len(expected), seed=3) == tasks
        assert len(env.tasks(split, 3 * len(expected))) == 3 * len(expected)

    every_task = {
        task.metadata["task_id"]: task
        for split in SPLITS
        if split in split_of.values()
        for task in env.tasks(split, 40)
    }
    shift = every_task["Demo/shift"]
    assert "decode_shift" in shift.prompt
    messages = env.solve(shift)
    assert messages[3]["content"] == "passed 1/1"
    assert env.reward(shift, env.final_answer(messages[-1]["content"])) == 1.0
    # The answer may be the function alone: helpers from the prompt are available to it.
    alone = (
        "def decode_shift(s):\n    for _ in range(25):\n        s = encode_shift(s)\n    return s"
    )
    assert env.reward(shift, alone) == 1.0
    assert env.reward(shift, "def decode_shift(s):\n    return s") == 0.0
    add = every_task["Demo/add/4"]
    assert env.reward(add, "def add_all(values):\n    return sum(values) + 4") == 1.0
    wrong = env.bind_tools(add)["run_tests"]("def add_all(values):\n    return 0")
    assert wrong == "passed 0/1; first failure: test 1 -> AssertionError"
    with pytest.raises(NoReferenceSolutionError, match="Demo/unsolved"):
        env.solve(every_task["Demo/unsolved"])
    assert env.reward(every_task["Demo/unsolved"], "def triple(x):\n    return 3 * x") == 1.0


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "must be a JSON object"),
        ('{"task_id": "x", "prompt": "p", "entry_point": "f"}', "field 'test'"),
        ('{"task_id": "x", "prompt": "p", "entry_point": "no way", "test": "t"}', "entry_point"),
        ('{"task_id": "x", "prompt": "p", "entry_point": "f", "test": "def check(:"}', "valid Py"),
        ('{"task_id": "x", "prompt": "p", "entry_point": "f", "test": "x = 1"}', "check(candi"),
        ('{"task_id": "Demo/shift", "prompt": "p", "entry_point": "f", "test": "def check(c): '
         'pass"}', "appears twice"),
    ],
)  # fmt: skip
def test_bad_task_file_names_the_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps(_file_records()[0])
    path.write_text(f"{good}\n\n{bad_line}\n")
    with pytest.raises(TaskFileError, match=f"bad.jsonl:3: .*{re.escape(message)}"):
        CodeEnvironment(tasks_file=path)


def test_missing_or_empty_task_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="cannot read task file"):
        CodeEnvironment(tasks_file=tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskFileError, match="holds no tasks"):
        CodeEnvironment(tasks_file=tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="cannot go with tasks_file"):
        CodeEnvironment(tasks_file=tmp_path / "empty.jsonl", families=["add"])


def test_the_same_function_against_the_same_tests_runs_once() -> None:
    env = CodeEnvironment()
    task = _first_task(env, "add")
    name = task.metadata["entry_point"]
    wrong = f"def {name}(x):\n    return x"
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, f"```python\n{task.answer}\n```") == 1.0  # fences stripped first
    assert env.reward(task, wrong) == 0.0
    assert (env.test_reports.runs, env.test_reports.reused) == (2, 1)
    # The visible tests are other tests: a run of their own, then reused.
    tools = env.bind_tools(task)
    assert tools["run_tests"](task.answer) == tools["run_tests"](task.answer) == "passed 3/3"
    assert (env.test_reports.runs, env.test_reports.reused) == (3, 2)


def test_a_tested_answer_is_scored_from_the_run_of_its_test() -> None:
    env = CodeEnvironment()
    task = _first_task(env, "clamp")
    name = task.metadata["entry_point"]
    floor_only = f"def {name}(x):\n    return max(x, {name.split('_')[1]})"
    assert env.bind_tools(task)["run_tests"](floor_only).startswith("passed ")
    assert (env.test_reports.runs, env.test_reports.reused) == (1, 0)
    scored = env.reward(task, floor_only)
    assert (env.test_reports.runs, env.test_reports.reused) == (1, 1)
    assert scored == CodeEnvironment().reward(task, floor_only)  # as a run of its own gives
    assert 0.0 < scored < 1.0


def test_a_run_stopped_by_its_time_limit_is_not_reused() -> None:
    env = CodeEnvironment(wall_timeout_s=0.5)
    task = _first_task(env, "add")
    name = task.metadata["entry_point"]
    looping = f"def {name}(x):\n    while True:\n        pass"
    for _ in range(2):
        assert env.reward(task, looping) == 0.0
    assert (env.test_reports.runs, env.test_reports.reused) == (2, 0)


def test_report_memo_waits_for_a_run_under_way_and_forgets_the_oldest() -> None:
    memo = TestReportMemo(capacity=2)
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow_run() -> TestRunReport:
        calls.append("slow")
        started.set()
        release.wait(5)
        return TestRunReport(1, 2, "assert f(1) == 2 -> got 3", None)

    key = ("code", ("assert f(1) == 2",), "f", "")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(memo.report, key, slow_run)
        assert started.wait(5)
        second = pool.submit(memo.report, key, slow_run)
        release.set()
        assert (
            first.result(5)
            == second.result(5)
            == TestRunReport(1, 2, "assert f(1) == 2 -> got 3", None)
        )
    assert calls == ["slow"] and (memo.runs, memo.reused) == (1, 1)

    def failing_run() -> TestRunReport:
        raise OSError("no processes left")

    with pytest.raises(OSError, match="no processes left"):
        memo.report(("other", (), "f", ""), failing_run)
    for index in range(2):  # two more keys push the first one out
        memo.report((f"code {index}", (), "f", ""), lambda: TestRunReport(0, 1, None, None))
    memo.report(key, lambda: TestRunReport(2, 2, None, None))
    assert memo.runs == 5  # the failed run counts; the first key ran again
    with pytest.raises(ValueError, match="capacity"):
        TestReportMemo(capacity=0)
