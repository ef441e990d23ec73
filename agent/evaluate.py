"""Score a checkpoint on one domain's held-out tasks; the node and the coordinator both use this."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from skillswarm.agent.envs import get_environment
from skillswarm.agent.model import load_policy, set_torch_threads
from skillswarm.agent.rollout import DEFAULT_MAX_NEW_TOKENS, play_episodes, summarize_episodes
from skillswarm.agent.stats import wilson_interval
from transformers import PreTrainedModel, PreTrainedTokenizerBase

Policy = tuple[PreTrainedModel, PreTrainedTokenizerBase]


@dataclass(frozen=True)
class EvalResult:
    """Held-out score of one checkpoint on one domain.

    `rewards`, `successes` (1 or 0, success as in `Episode.success`) and `task_ids` hold each
    task's outcome in task order, so two checkpoints scored on the same tasks (same domain, number
    of tasks and seed) compare task by task (`skillswarm.agent.stats.paired_difference`). They
    default to empty, so a stored result without them still loads."""

    domain: str
    mean_reward: float
    success_rate: float
    n: int
    greedy: bool
    tool_calls_mean: float
    tool_errors_mean: float
    answered_rate: float
    rewards: tuple[float, ...] = ()
    successes: tuple[int, ...] = ()
    task_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A result read back from JSON brings lists; keep tuples so it equals the original.
        object.__setattr__(self, "rewards", tuple(float(r) for r in self.rewards))
        object.__setattr__(self, "successes", tuple(int(s) for s in self.successes))
        object.__setattr__(self, "task_ids", tuple(str(t) for t in self.task_ids))

    def success_interval(self, level: float = 0.95) -> tuple[float, float]:
        """Wilson interval of the success rate at confidence `level`."""
        return wilson_interval(round(self.success_rate * self.n), self.n, level)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (the per-task tuples as lists)."""
        data = asdict(self)
        for name in ("rewards", "successes", "task_ids"):
            data[name] = list(data[name])
        return data


def evaluate_checkpoint(
    path_or_model_and_tokenizer: Path | str | Policy,
    domain: str,
    n_tasks: int = 64,
    seed: int = 0,
    greedy: bool = True,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    num_threads: int | None = None,
    tasks_file: Path | None = None,
) -> EvalResult:
    """Play one episode on each of `n_tasks` held-out tasks of `domain` (greedy by default, or
    sampled at `temperature` with `seed`) and report mean reward and success rate, with each
    task's reward, success and id in task order. `num_threads`, when given, sets torch's
    threads first; `tasks_file`, when given, holds the tasks (its held-out split)."""
    if n_tasks < 1:
        raise ValueError("n_tasks must be at least 1")
    if num_threads is not None:
        set_torch_threads(num_threads)
    if isinstance(path_or_model_and_tokenizer, str | Path):
        model, tokenizer = load_policy(Path(path_or_model_and_tokenizer))
    else:
        model, tokenizer = path_or_model_and_tokenizer
    environment = get_environment(domain, tasks_file=tasks_file)
    episodes = play_episodes(
        model,
        tokenizer,
        environment,
        environment.tasks("heldout", n_tasks, seed=seed),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        seed=seed,
    )
    summary = summarize_episodes(episodes)
    return EvalResult(
        domain=domain,
        mean_reward=summary["reward_mean"],
        success_rate=summary["success_rate"],
        n=len(episodes),
        greedy=greedy,
        tool_calls_mean=summary["tool_calls_mean"],
        tool_errors_mean=summary["tool_errors_mean"],
        answered_rate=summary["answered_rate"],
        rewards=tuple(episode.reward for episode in episodes),
        successes=tuple(int(episode.success) for episode in episodes),
        task_ids=tuple(episode.task.id for episode in episodes),
    )
