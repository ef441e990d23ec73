"""What every training environment provides: tasks, tools, a reward and a solver.

An environment is a task generator (seeded, with disjoint train and held-out splits), plain Python
tool functions, a reward on the final answer (plus optional turn-level rewards), and a solver that
demonstrates a correct trajectory.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from skillswarm.agent.tools import ToolResult, extract_final_answer
from transformers.utils import get_json_schema

T = TypeVar("T")

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")

Message = dict[str, Any]
ToolFunction = Callable[..., str]


class InvalidSplitError(ValueError):
    """Raised when a split name other than 'train' or 'heldout' is requested."""


@dataclass(frozen=True)
class Task:
    """One problem: its id, the user-facing prompt, the reference answer and free-form metadata."""

    id: str
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


THINK_PATTERN = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """`text` without its `<think>…</think>` spans (and the whitespace after each)."""
    return THINK_PATTERN.sub("", text)


def check_split(split: str) -> Split:
    """Return `split` if it names a known split, else raise InvalidSplitError."""
    if split not in SPLITS:
        raise InvalidSplitError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split  # type: ignore[return-value]


def split_of_text(text: str, heldout_fraction: float) -> Split:
    """Assign a problem to a split by a stable hash of its text, so the splits never overlap."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
    return "heldout" if bucket < heldout_fraction else "train"


def draw_split_tasks(
    draw: Callable[[], tuple[str, T] | None],
    split: Split,
    n: int,
    heldout_fraction: float,
    what: str,
) -> list[T]:
    """`n` items from repeated `draw()` calls, each returning (prompt, item) or None for a
    failed draw, keeping only new prompts that `split_of_text` puts in `split`. Raises
    RuntimeError when the generator runs dry (100 draws per task, plus 1000)."""
    items: list[T] = []
    seen: set[str] = set()
    attempts = 0
    while len(items) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise RuntimeError(f"could not generate {n} distinct {split} {what}")
        drawn = draw()
        if drawn is None:
            continue
        prompt, item = drawn
        if prompt in seen or split_of_text(prompt, heldout_fraction) != split:
            continue
        seen.add(prompt)
        items.append(item)
    return items


class Environment(ABC):
    """Base class of environments: subclasses set `name`, `system_prompt`, `tools`, `max_turns`.

    `tool_timeout_s` bounds each tool call's wall time in the rollout engine (a call that runs
    longer is answered with a timeout error); `max_tool_output_chars` truncates long results.
    `runs_model_code` marks an environment that executes what the model writes (in the sandbox).
    """

    name: str
    system_prompt: str
    max_turns: int
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 2000
    runs_model_code: bool = False

    @property
    @abstractmethod
    def tools(self) -> list[ToolFunction]:
        """Plain functions the model may call; their JSON schemas come from hints and docstrings."""

    @abstractmethod
    def tasks(self, split: Split, n: int, seed: int = 0) -> list[Task]:
        """Return `n` tasks of `split`, the same for the same seed; the splits never overlap."""

    @abstractmethod
    def reward(self, task: Task, final_answer: str | None) -> float:
        """Score a final answer (None when the model gave none) for `task`."""

    @abstractmethod
    def solve(self, task: Task) -> list[Message]:
        """Return a correct demonstration: the initial messages, tool-call turns, tool results and
        the final assistant answer, as chat messages."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """JSON schemas of the tools, in the form chat templates take as `tools=`."""
        return [get_json_schema(tool) for tool in self.tools]

    def tools_by_name(self) -> dict[str, ToolFunction]:
        """The tool functions keyed by the name the model calls them by."""
        return {tool.__name__: tool for tool in self.tools}

    def bind_tools(self, task: Task) -> dict[str, ToolFunction]:
        """The callables an episode of `task` runs, keyed by tool name. Environments whose tools
        depend on the task (the code domain's tests, say) return closures with the same names,
        signatures and type hints as `tools`; the default is `tools_by_name()`."""
        return self.tools_by_name()

    def new_episode_memory(self, task: Task) -> dict[str, Any]:
        """Per-episode scratch state handed to `turn_reward` (empty by default)."""
        return {}

    def turn_reward(
        self, task: Task, results: Sequence[ToolResult], memory: dict[str, Any]
    ) -> float:
        """Reward credited to the assistant turn whose tool calls gave `results` (0 by default).
        `memory` is this episode's state from `new_episode_memory`, which the method may update."""
        return 0.0

    def final_answer(self, text: str) -> str | None:
        """The final answer in an assistant turn, or None when the turn gives none. The default
        reads the last `<answer>…</answer>`."""
        return extract_final_answer(text)

    def initial_messages(self, task: Task) -> list[Message]:
        """The conversation an episode starts from: the system prompt and the task's prompt."""
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": task.prompt},
        ]
