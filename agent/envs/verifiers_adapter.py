"""Verifiers tasksets as node domains: a verifiers (0.4) taskset's tasks, the `@vf.tool` methods of
its tool servers (called in-process) and its `@vf.reward` functions (scored on a trace of the
episode) played through the rollout engine. Needs the `verifiers` extra; it is imported lazily.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import random
import typing
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import create_model
from skillswarm.agent.envs import register_environment
from skillswarm.agent.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    ToolFunction,
    check_split,
    split_of_text,
    strip_reasoning,
)
from skillswarm.agent.envs.search import SolverUnavailableError
from skillswarm.agent.toolcalls import contains_tool_call

if TYPE_CHECKING:
    import verifiers.v1 as vf

logger = logging.getLogger(__name__)

DEFAULT_MAX_TURNS = 8
HELDOUT_FRACTION = 0.2
# How many tasks of a taskset are read at most (an endless taskset is cut here).
MAX_TASKS = 100_000
METADATA_KEY = "verifiers_task"

# A taskset id (an installed taskset package), a Taskset class or instance, or a function
# returning one.
TasksetSource = Any
T = TypeVar("T")


class VerifiersNotInstalledError(ImportError):
    """Raised when a verifiers environment is used without the verifiers package."""


def verifiers_api() -> ModuleType:
    """The `verifiers.v1` module, or a VerifiersNotInstalledError that says how to get it."""
    try:
        import verifiers.v1 as api
    except ImportError as error:
        raise VerifiersNotInstalledError(
            "verifiers environments need the verifiers package: pip install 'skillswarm[verifiers]'"
        ) from error
    return api


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def run_awaitable(value: Awaitable[T] | T) -> T:
    """`value`, awaited on an event loop of its own when it is awaitable (from a thread of its
    own when this thread already runs a loop)."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(value))
    with ThreadPoolExecutor(1, thread_name_prefix="verifiers") as pool:
        return pool.submit(asyncio.run, _awaited(value)).result()


def load_taskset(source: TasksetSource) -> vf.Taskset:
    """The Taskset `source` names: a taskset id, a Taskset class (built with its default
    config), a Taskset, or a function returning one."""
    api = verifiers_api()
    if isinstance(source, api.Taskset):
        return source
    if isinstance(source, str):
        return api.load_taskset(api.taskset_config_type(source)(id=source))
    if isinstance(source, type) and issubclass(source, api.Taskset):
        from verifiers.v1.utils.generic import concrete_type

        config_type = concrete_type(source, api.TasksetConfig, origin=api.Taskset)
        return source((config_type or api.TasksetConfig)())
    if callable(source):
        return load_taskset(source())
    raise TypeError(
        f"cannot read a verifiers taskset from {source!r}; give a taskset id, a Taskset class "
        "or instance, or a function returning one"
    )


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The chat-template schema of a tool: its name, docstring and a JSON schema of its
    parameters built from their type hints by pydantic (as MCP servers advertise them)."""
    hints = typing.get_type_hints(function)
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (hints.get(parameter.name, Any), default)
    parameters = create_model(f"{function.__name__}_arguments", **fields).model_json_schema()
    parameters.pop("title", None)
    for value in parameters.get("properties", {}).values():
        value.pop("title", None)
    return {
        "type": "function",
        "function": {
            "name": function.__name__,
            "description": inspect.getdoc(function) or "",
            "parameters": parameters,
        },
    }


def _tool_functions(toolsets: Sequence[Any]) -> list[ToolFunction]:
    """Each `@vf.tool` method of `toolsets` as a plain function named as verifiers' harnesses
    name it for the model (`<server>_<tool>`, bare when the server has no prefix)."""
    from verifiers.v1.utils.decorators import discover_decorated

    functions: list[ToolFunction] = []
    for toolset in toolsets:
        for method in discover_decorated(toolset, "tool"):
            tool_name = getattr(method, "tool_name", None) or method.__name__
            server = toolset.server_name
            functions.append(_plain_tool(method, f"{server}_{tool_name}" if server else tool_name))
    return functions


def _plain_tool(method: Callable[..., Any], name: str) -> ToolFunction:
    """A synchronous function with `method`'s signature and hints that awaits its result."""

    @functools.wraps(method)
    def call(**arguments: Any) -> Any:
        return run_awaitable(method(**arguments))

    call.__name__ = call.__qualname__ = name
    return call


class VerifiersEnvironment(Environment):
    """A verifiers taskset played as a node domain: its tasks, tools and rewards.

    Tasks are split into train and held-out by a stable hash of each task's key. A turn without
    a tool call is the final reply (reasoning removed), which the task's rewards score as the
    trace's last reply; rewards that need a sandbox runtime are skipped. Tool servers run
    in-process: taskset-scoped ones are set up once, task-scoped ones per task (`setup_task`).
    """

    name = "verifiers"
    system_prompt = ""
    taskset_source: ClassVar[TasksetSource | None] = None
    default_max_turns: ClassVar[int] = DEFAULT_MAX_TURNS

    def __init__(
        self,
        taskset: TasksetSource | None = None,
        *,
        max_turns: int | None = None,
        heldout_fraction: float = HELDOUT_FRACTION,
        max_tasks: int = MAX_TASKS,
    ) -> None:
        source = taskset if taskset is not None else self.taskset_source
        if source is None:
            raise ValueError(
                "give the verifiers taskset to play: a taskset id, a Taskset class or instance"
            )
        self.taskset = load_taskset(source)
        self.task_type = type(self.taskset).task_type()
        self.max_turns = max_turns if max_turns is not None else self.default_max_turns
        if self.max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.heldout_fraction = heldout_fraction
        self.max_tasks = max_tasks
        self._splits: dict[Split, list[Any]] | None = None
        self._shared_toolsets: list[Any] | None = None
        self._schema_tools: list[ToolFunction] | None = None

    # --- tasks -----------------------------------------------------------------------------

    def _split_tasks(self) -> dict[Split, list[Any]]:
        if self._splits is None:
            splits: dict[Split, list[Any]] = {"train": [], "heldout": []}
            for task in itertools.islice(iter(self.taskset), self.max_tasks):
                splits[split_of_text(task.key, self.heldout_fraction)].append(task)
            self._splits = splits
        return self._splits

    def tasks(self, split: Split, n: int, seed: int = 0) -> list[Task]:
        pool = self._split_tasks()[check_split(split)]
        if not pool:
            raise RuntimeError(
                f"the verifiers taskset {type(self.taskset).__name__} has no {split} tasks "
                f"(heldout_fraction={self.heldout_fraction:g})"
            )
        rng = random.Random(f"{self.name}/{split}/{seed}")
        chosen = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
        return [self._task_of(task) for task in chosen]

    def _task_of(self, verifiers_task: Any) -> Task:
        data = verifiers_task.data.model_dump(mode="json")
        answer = data.get("answer")
        return Task(
            id=f"{self.name}-{verifiers_task.key[:16]}",
            prompt=verifiers_task.data.prompt_text,
            answer="" if answer is None else str(answer),
            metadata={METADATA_KEY: data},
        )

    def verifiers_task(self, task: Task) -> Any:
        """The verifiers Task that `task` was made from."""
        data = self.task_type.data_type().model_validate(task.metadata[METADATA_KEY])
        return self.task_type(data, self.taskset.config.task)

    def _prompt_messages(self, verifiers_task: Any) -> list[Any]:
        """The task's opening messages as verifiers message models."""
        api = verifiers_api()
        data = verifiers_task.data
        messages: list[Any] = []
        if data.system_prompt:
            messages.append(api.SystemMessage(content=data.system_prompt))
        if isinstance(data.prompt, str):
            messages.append(api.UserMessage(content=data.prompt))
        else:
            messages.extend(data.prompt or [])
        return messages

    def initial_messages(self, task: Task) -> list[Message]:
        from verifiers.v1.types import content_text

        messages: list[Message] = []
        for message in self._prompt_messages(self.verifiers_task(task)):
            as_dict = message.model_dump(exclude_none=True)
            if not isinstance(as_dict.get("content"), str):
                as_dict["content"] = content_text(message.content)
            messages.append(as_dict)
        return messages

    # --- tools -----------------------------------------------------------------------------

    def _task_toolsets(self) -> list[Any]:
        return list(self.task_type.toolsets(self.taskset.config.task))

    def _taskset_toolsets(self) -> list[Any]:
        """The taskset-scoped tool servers, set up once and shared by every episode."""
        if self._shared_toolsets is None:
            toolsets = list(type(self.taskset).toolsets(self.taskset.config))
            for toolset in toolsets:
                run_awaitable(toolset.setup())
            self._shared_toolsets = toolsets
        return self._shared_toolsets

    @property
    def tools(self) -> list[ToolFunction]:
        """The tools as the model sees them (unbound to a task; `bind_tools` runs them)."""
        if self._schema_tools is None:
            shared = list(type(self.taskset).toolsets(self.taskset.config))
            self._schema_tools = _tool_functions([*shared, *self._task_toolsets()])
        return self._schema_tools

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(tool) for tool in self.tools]

    def bind_tools(self, task: Task) -> dict[str, ToolFunction]:
        """Fresh task-scoped tool servers, set up for this task, and the shared ones."""
        data = self.verifiers_task(task).data
        task_toolsets = self._task_toolsets()
        for toolset in task_toolsets:
            run_awaitable(toolset.setup())
            run_awaitable(toolset.setup_task(data))
        functions = _tool_functions([*self._taskset_toolsets(), *task_toolsets])
        return {function.__name__: function for function in functions}

    # --- answers and rewards -----------------------------------------------------------------

    def final_answer(self, text: str) -> str | None:
        """A turn without a tool call is the final reply, its reasoning removed."""
        return None if contains_tool_call(text) else strip_reasoning(text).strip()

    def reward(self, task: Task, final_answer: str | None) -> float:
        """The task's weighted rewards on a trace of the prompt and the final reply; 0 when the
        scoring itself fails (logged), as verifiers records a failed score on its trace."""
        api = verifiers_api()
        verifiers_task = self.verifiers_task(task)
        trace = api.Trace(
            task=api.TraceTask(
                type=type(verifiers_task).__name__,
                data=verifiers_task.data,
                key=verifiers_task.key,
                hash=verifiers_task.hash,
            ),
            agent=api.AgentInfo(
                config=api.AgentConfig(runtime=api.SubprocessConfig(), max_turns=self.max_turns)
            ),
        )
        messages = self._prompt_messages(verifiers_task)
        for position, message in enumerate(messages):
            parent = position - 1 if position else None
            trace.nodes.append(api.MessageNode(message=message, parent=parent))
        if final_answer is not None:
            reply = api.AssistantMessage(content=final_answer)
            parent = len(messages) - 1 if messages else None
            trace.nodes.append(api.MessageNode(message=reply, parent=parent, sampled=True))
        try:
            run_awaitable(verifiers_task.score(trace))
        except Exception as error:  # a reward's failure is a 0 for this episode, not a crash
            logger.warning("scoring %s failed: %s: %s", task.id, type(error).__name__, error)
            return 0.0
        return float(trace.reward)

    def solve(self, task: Task) -> list[Message]:
        raise SolverUnavailableError(
            f"verifiers tasksets ship no demonstrations; {self.name} has no solver "
            "(warm-start the policy on another domain, or train from its own rollouts)"
        )


def register_verifiers_environment(
    name: str,
    taskset: TasksetSource,
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
    description: str | None = None,
) -> type[VerifiersEnvironment]:
    """Register a VerifiersEnvironment subclass named `name` that plays `taskset` (loaded when
    the environment is built). A package calls this in the module its `skillswarm.environments`
    entry point `name` names."""
    label = taskset if isinstance(taskset, str) else getattr(taskset, "__name__", repr(taskset))
    environment_class = type(
        f"VerifiersEnvironment_{name}",
        (VerifiersEnvironment,),
        {
            "__doc__": description or f"The verifiers taskset {label} as a node domain.",
            "__module__": __name__,
            "name": name,
            "taskset_source": taskset,
            "default_max_turns": max_turns,
        },
    )
    return register_environment(environment_class)
