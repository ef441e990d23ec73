"""Task files for the code domain as HumanEval and MBPP ship them, plain and gzipped: loading, the
errors that name the line, the split by task id, and the file reaching `env try`, `train`, the
node's and the coordinator's configs and the coordinator's evaluation."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from skillswarm.agent.envs import TasksFileNotSupportedError, get_environment
from skillswarm.agent.envs.base import Task, split_of_text
from skillswarm.agent.envs.code import CodeEnvironment
from skillswarm.agent.envs.taskfiles import TaskFileError, load_task_file
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig
from skillswarm.coordinator.evaluation import Evaluator
from skillswarm.node.config import NodeConfig
from skillswarm.protocol.tomlconfig import ConfigFileError, load_config


def _humaneval(number: int) -> dict[str, Any]:
    """A record shaped like HumanEval.jsonl's."""
    return {
        "task_id": f"Demo/{number}",
        "prompt": f'def add_{number}(x: int) -> int:\n    """x plus {number}."""\n',
        "entry_point": f"add_{number}",
        "canonical_solution": f"    return x + {number}\n",
        "test": f"\n\ndef check(candidate):\n    assert candidate(1) == {1 + number}\n",
    }


def _mbpp(number: int) -> dict[str, Any]:
    """A record shaped like mbpp.jsonl's: the function the tests call comes after a helper."""
    return {
        "text": f"Write a function to multiply a number by {number}.",
        "code": f"def factor():\r\n    return {number}\r\n\r\ndef times_{number}(x):\r\n"
        "    return x * factor()\r\n",
        "task_id": number,
        "test_setup_code": "",
        "test_list": [
            f"assert times_{number}(2) == {2 * number}",
            f"assert times_{number}(0) == 0",
        ],
        "challenge_test_list": [f"assert times_{number}(-1) == {-number}"],
    }


SANITIZED_MBPP = {  # sanitized-mbpp's fields: `prompt` for `text`, `test_imports`; no task_id
    "source_file": "Benchmark Questions Verification V2.ipynb",
    "prompt": "Write a function that halves a number.",
    "code": "def half(x):\n    return x / 2",
    "test_imports": ["import math"],
    "test_list": ["assert math.isclose(half(3), 1.5)"],
}


def _write(path: Path, records: list[Any]) -> Path:
    text = "\n".join(json.dumps(record) for record in records) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_humaneval_and_mbpp_records_load_plain_and_gzipped(tmp_path: Path) -> None:
    records = [_humaneval(1), _mbpp(2), SANITIZED_MBPP]
    plain = load_task_file(_write(tmp_path / "tasks.jsonl", records))
    assert load_task_file(_write(tmp_path / "tasks.jsonl.gz", records)) == plain
    humaneval, mbpp, sanitized = plain

    assert (humaneval.source, humaneval.task_id, humaneval.entry_point) == (
        "humaneval",
        "Demo/1",
        "add_1",
    )
    assert humaneval.visible_tests == humaneval.hidden_tests
    assert humaneval.visible_tests[0].rstrip().endswith("check(add_1)")
    assert humaneval.solution == _humaneval(1)["prompt"] + "    return x + 1\n"

    assert (mbpp.source, mbpp.task_id, mbpp.entry_point) == ("mbpp", "2", "times_2")
    assert mbpp.prompt.startswith("Write a function to multiply a number by 2.")
    assert "assert times_2(2) == 4" in mbpp.prompt  # the tests shown, as in the MBPP paper
    assert mbpp.visible_tests == ("assert times_2(2) == 4", "assert times_2(0) == 0")
    assert mbpp.hidden_tests == (*mbpp.visible_tests, "assert times_2(-1) == -2")
    assert mbpp.solution == _mbpp(2)["code"]

    assert sanitized.task_id.startswith("mbpp-") and sanitized.entry_point == "half"
    assert sanitized.setup == "import math"


def test_file_tasks_are_scored_in_the_sandbox(tmp_path: Path) -> None:
    path = _write(tmp_path / "mbpp.jsonl.gz", [_mbpp(3), SANITIZED_MBPP])
    env = CodeEnvironment(tasks_file=path)

    def task_of(task_id: str) -> Task:
        split = split_of_text(task_id, env.heldout_fraction)
        return next(t for t in env.tasks(split, 2) if t.metadata["task_id"] == task_id)

    tasks = {file_task.entry_point: task_of(file_task.task_id) for file_task in env.file_tasks}
    times, half = tasks["times_3"], tasks["half"]
    messages = env.solve(times)  # the reference, checked by a real sandbox run
    assert messages[3]["content"] == "passed 2/2"
    assert env.reward(times, env.final_answer(messages[-1]["content"])) == 1.0
    # Passes the shown tests, fails the challenge test: 2 of 3 hidden tests.
    shown_only = "def times_3(x):\n    return 6 if x == 2 else 0"
    assert env.bind_tools(times)["run_tests"](shown_only) == "passed 2/2"
    assert env.reward(times, shown_only) == pytest.approx(2 / 3)
    assert env.reward(half, "def half(x):\n    return x / 2") == 1.0  # math from test_imports


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"task_id": 1, "text": "t"}', "neither a HumanEval record"),
        ('{"text": "t", "code": "def f(): pass", "test_list": []}', "'test_list' must be a non-e"),
        ('{"text": "t", "code": "def f(:", "test_list": ["assert f()"]}', "'code' is not valid Py"),
        ('{"text": "t", "code": "def f(): pass", "test_list": ["assert g()"]}', "calls a function"),
        ('{"text": "t", "code": "def f(): pass", "test_list": ["f("]}', "'test_list' is not"),
        ('{"text": "", "code": "def f(): pass", "test_list": ["assert f()"]}', "'text' must be"),
        ('{"task_id": true, "prompt": "p", "entry_point": "f", "test": "def check(c): pass"}',
         "'task_id' must be"),
        (json.dumps(_mbpp(2)), "task_id '2' appears twice"),
    ],
)  # fmt: skip
def test_a_malformed_record_names_the_file_and_line(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    for name in ("bad.jsonl", "bad.jsonl.gz"):
        path = tmp_path / name
        text = f"{json.dumps(_mbpp(2))}\n\n{bad_line}\n"
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
        with pytest.raises(TaskFileError) as caught:
            load_task_file(path)
        assert str(caught.value).startswith(f"{path}:3: ")
        assert message in str(caught.value)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(b"{}")[:-6])
    with pytest.raises(TaskFileError, match=f"cannot read task file {broken}"):
        load_task_file(broken)


def test_the_split_is_a_stable_hash_of_the_task_id(tmp_path: Path) -> None:
    records = [_mbpp(number) for number in range(40)]
    expected = {
        split: {str(number) for number in range(40) if split_of_text(str(number), 0.2) == split}
        for split in ("train", "heldout")
    }
    assert expected["train"] and expected["heldout"]
    shuffled = list(records)
    random.Random(0).shuffle(shuffled)
    for path in (_write(tmp_path / "a.jsonl", records), _write(tmp_path / "b.jsonl.gz", shuffled)):
        env = CodeEnvironment(tasks_file=path)  # heldout_fraction 0.2
        for split, ids in expected.items():
            tasks = env.tasks(split, len(ids), seed=1)
            assert {task.metadata["task_id"] for task in tasks} == ids
            assert env.tasks(split, len(ids), seed=1) == tasks  # the same order for a seed


def test_env_try_plays_a_task_file_with_the_solver(tmp_path: Path) -> None:
    path = _write(tmp_path / "tasks.jsonl.gz", [_mbpp(number) for number in range(6, 10)])
    assert any(split_of_text(str(n), 0.2) == "heldout" for n in range(6, 10))
    tried = subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", "env", "try", "code", "--tasks", str(path)]
        + ["--n", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tried.returncode == 0, tried.stderr
    assert "Your code should pass these tests" in tried.stdout
    assert "passed 2/2" in tried.stdout and "reward 1" in tried.stdout
    with pytest.raises(TasksFileNotSupportedError, match="environments that do: code"):
        get_environment("math", tasks_file=path)


def test_train_hands_the_file_to_the_environment(tmp_path: Path, tiny_base: Path) -> None:
    path = _write(tmp_path / "tasks.jsonl", [_humaneval(1)])
    refused = subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", "train", "--base", str(tiny_base)]
        + ["--domain", "math", "--tasks", str(path), "--eval-tasks", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1
    assert f"the math environment reads no task file ({path})" in refused.stderr


def test_node_and_coordinator_configs_take_task_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "tasks.jsonl.gz", [_humaneval(1)])
    node_file = tmp_path / "node.toml"
    node_file.write_text(f'domain = "code"\ntasks_file = "{path}"\n')
    assert load_config(NodeConfig, node_file, environ={}).tasks_file == path
    coordinator_file = tmp_path / "coordinator.toml"
    coordinator_file.write_text(f'[eval]\ndomains = ["code"]\ntasks_files = {{code = "{path}"}}\n')
    coordinator = load_config(CoordinatorConfig, coordinator_file, environ={})
    assert coordinator.eval.tasks_files == {"code": path}
    over = load_config(
        CoordinatorConfig, None, overrides=[f"eval.tasks_files.code={path}"], environ={}
    )
    assert over.eval.tasks_files == {"code": path}
    with pytest.raises(ConfigFileError, match="tasks_file: Path does not point to a file"):
        load_config(NodeConfig, None, overrides=[f"tasks_file={tmp_path / 'no.jsonl'}"], environ={})


def test_the_coordinator_scores_the_files_held_out_tasks(tmp_path: Path, tiny_base: Path) -> None:
    numbers = [n for n in range(40) if split_of_text(f"Demo/{n}", 0.2) == "heldout"][:1]
    path = _write(tmp_path / "tasks.jsonl", [_humaneval(n) for n in [*numbers, 1, 2]])
    heldout = CodeEnvironment(tasks_file=path).tasks("heldout", 1)
    evaluator = Evaluator(EvalConfig(domains=["code"], n_tasks=1, tasks_files={"code": path}))
    scores = evaluator.scores(tiny_base, ["code"], n_tasks=1, seed=0)
    assert scores["code"]["task_ids"] == [heldout[0].id]
    assert heldout[0].metadata["task_id"] == f"Demo/{numbers[0]}"
