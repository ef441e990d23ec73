"""What every training environment provides: tasks, tools, a reward and a solver.

An environment is a task generator (seeded, with disjoint train and held-out splits), plain Python
tool functions, a reward on the final answer, and a solver that demonstrates a correct trajectory.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers.utils import get_json_schema

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


def check_split(split: str) -> Split:
    """Return `split` if it names a known split, else raise InvalidSplitError."""
    if split not in SPLITS:
        raise InvalidSplitError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split  # type: ignore[return-value]


def split_of_text(text: str, heldout_fraction: float) -> Split:
    """Assign a problem to a split by a stable hash of its text, so the splits never overlap."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
    return "heldout" if bucket < heldout_fraction else "train"


class Environment(ABC):
    """Base class of environments: subclasses set `name`, `system_prompt`, `tools`, `max_turns`."""

    name: str
    system_prompt: str
    max_turns: int

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

    def initial_messages(self, task: Task) -> list[Message]:
        """The conversation an episode starts from: the system prompt and the task's prompt."""
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": task.prompt},
        ]
