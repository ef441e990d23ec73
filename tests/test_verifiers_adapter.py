"""A verifiers (0.4) taskset as a node domain: a small taskset written here (tasks, a tool server
whose tool depends on the task, a weighted reward) is registered by name, split, shown to the model
with its tools, played through the rollout engine and scored by its own reward. Skipped where the
`verifiers` extra is not installed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

vf = pytest.importorskip("verifiers.v1", reason="needs the verifiers extra")

from pydantic_config import BaseConfig  # noqa: E402 (verifiers brings it)
from skillswarm.agent import envs  # noqa: E402
from skillswarm.agent.envs import environment_class, get_environment  # noqa: E402
from skillswarm.agent.envs.base import Message, Task  # noqa: E402
from skillswarm.agent.envs.search import SolverUnavailableError  # noqa: E402
from skillswarm.agent.envs.verifiers_adapter import (  # noqa: E402
    VerifiersEnvironment,
    register_verifiers_environment,
    run_awaitable,
)
from skillswarm.agent.inference import SolverBackend  # noqa: E402
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer  # noqa: E402
from skillswarm.agent.rollout import RolloutEngine  # noqa: E402


class CalculatorConfig(BaseConfig):
    pass


class Calculator(vf.Toolset[CalculatorConfig]):
    """Adds numbers; each task sets a bonus the sums include, so the tool is bound to its task."""

    def __init__(self, config: CalculatorConfig) -> None:
        super().__init__(config)
        self.bonus = 0

    async def setup_task(self, task: SumData) -> None:
        self.bonus = task.bonus

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers (and the task's bonus)."""
        await asyncio.sleep(0)
        return str(a + b + self.bonus)


class SumData(vf.TaskData):
    a: int
    b: int
    bonus: int
    answer: str


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(CalculatorConfig())]

    @vf.reward(weight=2.0)
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == task.answer else 0.0

    @vf.metric
    async def reply_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self) -> Iterator[SumTask]:
        for a in range(40):
            yield SumTask(
                SumData(
                    prompt=f"What is {a} + 7 with the bonus?",
                    system_prompt="Use the calculator, then reply with the number alone.",
                    a=a,
                    b=7,
                    bonus=a % 3,
                    answer=str(a + 7 + a % 3),
                ),
                self.config.task,
            )


class SolvedSums(VerifiersEnvironment):
    """The sums with a solver, so the engine can play them without a model."""

    name = "vf-sums-solved"
    taskset_source = SumTaskset

    def solve(self, task: Task) -> list[Message]:
        data = self.verifiers_task(task).data
        call = {"name": "calculator_add", "arguments": {"a": data.a, "b": data.b}}
        result = str(data.a + data.b + data.bonus)
        return [
            *self.initial_messages(task),
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "name": "calculator_add", "content": result},
            {"role": "assistant", "content": f"<think>The tool said {result}.</think>{result}"},
        ]


@pytest.fixture
def registered() -> Iterator[None]:
    environment_class("math")  # the built-in environments are in the state put back below
    saved = dict(envs._REGISTRY)
    register_verifiers_environment("vf-sums", SumTaskset, max_turns=3)
    try:
        yield
    finally:
        envs._REGISTRY.clear()
        envs._REGISTRY.update(saved)


def test_a_registered_taskset_is_a_domain_with_its_tools_and_prompts(registered: None) -> None:
    env = get_environment("vf-sums")
    assert env.max_turns == 3 and "SumTaskset" in (type(env).__doc__ or "")
    assert sorted(env.tools_by_name()) == ["calculator_add"]
    (schema,) = env.tool_schemas()
    assert schema["function"]["name"] == "calculator_add"
    assert schema["function"]["description"] == "Add two integers (and the task's bonus)."
    assert schema["function"]["parameters"]["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": "integer"},
    }
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    train, heldout = env.tasks("train", 25, seed=1), env.tasks("heldout", 3, seed=1)
    assert len({task.id for task in train}) == 25
    assert not {task.prompt for task in train} & {task.prompt for task in heldout}
    assert env.tasks("train", 25, seed=1) == train
    assert env.initial_messages(train[0]) == [
        {"role": "system", "content": "Use the calculator, then reply with the number alone."},
        {"role": "user", "content": train[0].prompt},
    ]
    with pytest.raises(SolverUnavailableError, match="no demonstrations"):
        env.solve(train[0])


def test_the_engine_plays_the_taskset_and_its_reward_scores_the_reply() -> None:
    env = SolvedSums()
    tasks = env.tasks("train", 4, seed=0)
    engine = RolloutEngine(
        SolverBackend(env, build_tokenizer(TEMPLATE_FIXED_STRINGS)), env, max_new_tokens=400
    )
    episodes = engine.play(tasks, seed=0)
    for episode in episodes:
        data = env.verifiers_task(episode.task).data
        (tool_message,) = [m for m in episode.messages if m["role"] == "tool"]
        assert tool_message["content"] == str(data.a + 7 + data.bonus)  # the task's own bonus
        assert episode.final_answer == data.answer
        assert (episode.finish_reason, episode.num_tool_errors) == ("answer", 0)
        assert episode.reward == 2.0  # the reward's weight
    assert env.reward(tasks[0], "0") == 0.0
    assert env.reward(tasks[0], None) == 0.0


def test_a_reply_with_a_tool_call_is_not_the_final_answer() -> None:
    env = SolvedSums()
    call = '<tool_call>{"name": "calculator_add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert env.final_answer(call) is None
    assert env.final_answer('{"name": "calculator_add", "parameters": {"a": 1}}') is None
    assert env.final_answer("<think>hmm</think> 12\n") == "12"


def test_a_reward_that_raises_scores_zero() -> None:
    class Failing(SumTask):
        @vf.reward
        async def exact(self, task: SumData, trace: vf.Trace) -> float:
            raise RuntimeError("judge unavailable")

    class FailingTaskset(vf.Taskset[Failing]):
        def load(self) -> Iterator[Failing]:
            for task in SumTaskset(vf.TasksetConfig()).load():
                yield Failing(task.data, self.config.task)

    env = VerifiersEnvironment(FailingTaskset)
    (task,) = env.tasks("train", 1)
    assert env.reward(task, task.answer) == 0.0


def test_awaitables_run_from_inside_a_running_event_loop() -> None:
    async def seven() -> int:
        return 7

    async def inside() -> Any:
        return run_awaitable(seven())

    assert run_awaitable(seven()) == 7
    assert asyncio.run(inside()) == 7
