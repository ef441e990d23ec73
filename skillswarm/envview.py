"""`skillswarm env list` and `skillswarm env try`: the registered environments, and episodes played
by a model or by the environment's solver, shown turn by turn in the terminal."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from skillswarm.agent.envs import get_environment, list_environments
from skillswarm.agent.envs.base import Environment, Task
from skillswarm.agent.rollout import Episode, RolloutEngine, summarize_episodes

ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "yellow"}


def describe(env: Environment) -> str:
    """The first line of the environment class's docstring."""
    doc = (type(env).__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def environments_table() -> Table:
    """A table of every registered environment: name, tools, turn limit, description."""
    table = Table(title="environments")
    for column in ("domain", "tools", "max turns", "description"):
        table.add_column(column)
    for name in list_environments():
        env = get_environment(name)
        tools = ", ".join(sorted(env.tools_by_name()))
        table.add_row(name, tools, str(env.max_turns), describe(env))
    return table


def play_for_viewing(
    domain: str,
    n: int,
    *,
    model_path: Path | None,
    split: str = "heldout",
    tasks_file: Path | None = None,
    seed: int = 0,
    temperature: float = 1.0,
    greedy: bool = False,
    max_new_tokens: int = 256,
) -> list[Episode]:
    """Play `n` tasks of `domain` (from `tasks_file` when given) with the model at `model_path`,
    or with the solver when None."""
    from skillswarm.agent.inference import HFBackend, SolverBackend
    from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer, load_policy

    env = get_environment(domain, tasks_file=tasks_file)
    tasks = env.tasks(split, n, seed=seed)  # type: ignore[arg-type]
    if model_path is None:
        backend = SolverBackend(env, build_tokenizer(TEMPLATE_FIXED_STRINGS))
        max_new_tokens = max(max_new_tokens, 4096)
    else:
        model, tokenizer = load_policy(model_path)
        backend = HFBackend(model, tokenizer)
    engine = RolloutEngine(backend, env, max_new_tokens=max_new_tokens, schedule="waves")
    return engine.play(tasks, temperature=temperature, greedy=greedy, seed=seed)


def print_episode(console: Console, index: int, episode: Episode) -> None:
    """One episode: every message after the system prompt, turn rewards, the outcome."""
    console.rule(
        f"episode {index} · {escape(episode.task.id)} · reward {episode.reward:g} · "
        f"{episode.finish_reason}"
    )
    turn = 0
    for message in episode.messages[1:]:
        role = message["role"]
        label = role
        if role == "assistant":
            credit = episode.turn_rewards[turn] if turn < len(episode.turn_rewards) else 0.0
            label = f"assistant turn {turn}" + (f" (+{credit:g})" if credit else "")
            turn += 1
        elif role == "tool" and message.get("name"):
            label = f"tool {message['name']}"
        style = ROLE_STYLES.get(role, "white")
        console.print(f"[bold {style}]{escape(label)}[/]", highlight=False)
        console.print(escape(str(message.get("content", ""))), highlight=False, soft_wrap=True)
    console.print(
        f"answer: {escape(repr(episode.final_answer))}   reference: {escape(episode.task.answer)}"
        f"   tool calls: {episode.num_tool_calls} (errors {episode.num_tool_errors})",
        highlight=False,
    )


def summary_table(episodes: list[Episode]) -> Table:
    """Success rate, mean reward, tool calls and errors over the episodes shown."""
    summary = summarize_episodes(episodes)
    keys = ("episodes", "success_rate", "reward_mean", "tool_calls_mean", "tool_errors_mean")
    table = Table(title="summary")
    for key in keys:
        table.add_column(key)
    table.add_row(*(f"{summary.get(key, 0.0):.3g}" for key in keys))
    return table


def task_family(task: Task) -> str:
    """The kind of task its generator names (`add`, `repeat`, `founder>born_in`…), "–" if none."""
    return str(task.metadata.get("family") or "–")


def families_table(episodes: list[Episode]) -> Table:
    """Episodes and success rate per task family, the most common family first: where a model
    fails, and where RL has no success in a group to learn from."""
    counts: dict[str, list[int]] = {}
    for episode in episodes:
        tally = counts.setdefault(task_family(episode.task), [0, 0])
        tally[0] += 1
        tally[1] += int(episode.success)
    table = Table(title="success per task family")
    for column in ("family", "episodes", "success_rate"):
        table.add_column(column)
    for family, (total, won) in sorted(counts.items(), key=lambda item: (-item[1][0], item[0])):
        table.add_row(family, str(total), f"{won / total:.3g}")
    return table
