"""Environments from installed packages: a package written here declares environments in the
`skillswarm.environments` entry-point group (a `*.dist-info` folder with `entry_points.txt` on a
path entry, which is what an installed wheel leaves); the registry finds them, a broken entry point
is reported by name and leaves the others working, and `skillswarm env list` shows them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from skillswarm.agent import envs
from skillswarm.agent.envs import (
    EnvironmentEntryPointError,
    UnknownEnvironmentError,
    entry_point_errors,
    environment_class,
    get_environment,
    list_environments,
)
from skillswarm.agent.inference import SolverBackend
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer
from skillswarm.agent.rollout import RolloutEngine

PACKAGE = "skillswarm_toy_envs"

TOY_MODULE = '''
"""A toy environment shipped by another package."""

from skillswarm.agent.envs.base import Environment, Task


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


class ToyEnvironment(Environment):
    """Shout a word back in capitals."""

    name = "toy"
    system_prompt = "Shout the word with the tool, then answer as <answer>WORD</answer>."
    max_turns = 3

    @property
    def tools(self):
        return [shout]

    def tasks(self, split, n, seed=0):
        return [Task(f"toy-{split}-{seed}-{i}", f"Shout word{i}.", f"WORD{i}") for i in range(n)]

    def reward(self, task, final_answer):
        return 1.0 if final_answer == task.answer else 0.0

    def solve(self, task):
        word = task.prompt.split()[1].rstrip(".")
        call = {"type": "function", "function": {"name": "shout", "arguments": {"text": word}}}
        return [
            *self.initial_messages(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "shout", "content": word.upper()},
            {"role": "assistant", "content": f"<answer>{word.upper()}</answer>"},
        ]
'''

REGISTERING_MODULE = '''
"""A module that registers its environment when imported."""

from skillswarm.agent.envs import register_environment
from {package} import ToyEnvironment


@register_environment
class QuietToyEnvironment(ToyEnvironment):
    """Shout a word back, registered by its module."""

    name = "toy-registered"
'''

ENTRY_POINTS = f"""
[skillswarm.environments]
toy = {PACKAGE}:ToyEnvironment
toy-registered = {PACKAGE}.registered
broken = {PACKAGE}_missing:Nothing
misnamed = {PACKAGE}:ToyEnvironment
"""


def write_package(site: Path) -> Path:
    """The package's module and the metadata an install would leave next to it."""
    package = site / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(TOY_MODULE)
    (package / "registered.py").write_text(REGISTERING_MODULE.format(package=PACKAGE))
    dist_info = site / f"{PACKAGE}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    return site


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The toy package on sys.path; the registry's state is put back afterwards, so other tests
    in this process see only the environments they expect."""
    site = write_package(tmp_path / "site")
    environment_class("math")  # the built-in environments are in the state saved here
    saved = (
        dict(envs._REGISTRY),
        dict(envs._DECLARED),
        set(envs._LOADED),
        dict(envs._ENTRY_POINT_ERRORS),
    )
    monkeypatch.syspath_prepend(str(site))
    try:
        yield site
    finally:
        for state, before in zip(
            (envs._REGISTRY, envs._DECLARED, envs._LOADED, envs._ENTRY_POINT_ERRORS),
            saved,
            strict=True,
        ):
            state.clear()
            state.update(before)  # type: ignore[attr-defined]
        for module in [name for name in sys.modules if name.startswith(PACKAGE)]:
            del sys.modules[module]


def test_an_installed_environment_is_found_by_name_and_plays(installed: Path) -> None:
    env = get_environment("toy")
    assert type(env).__module__ == PACKAGE
    assert sorted(env.tools_by_name()) == ["shout"]
    tasks = env.tasks("train", 2, seed=1)
    engine = RolloutEngine(SolverBackend(env, build_tokenizer(TEMPLATE_FIXED_STRINGS)), env)
    episodes = engine.play(tasks, seed=0)
    assert [episode.reward for episode in episodes] == [1.0, 1.0]
    assert [m["content"] for m in episodes[1].messages if m["role"] == "tool"] == ["WORD1"]


def test_a_module_entry_point_registers_its_environment(installed: Path) -> None:
    assert environment_class("toy-registered").__name__ == "QuietToyEnvironment"


def test_a_broken_entry_point_is_reported_by_name_and_the_others_still_load(
    installed: Path,
) -> None:
    names = list_environments()
    assert {"math", "code", "search", "toy", "toy-registered"} <= set(names)
    assert "broken" not in names and "misnamed" not in names
    errors = entry_point_errors()
    assert set(errors) == {"broken", "misnamed"}
    assert "'broken'" in errors["broken"] and "ModuleNotFoundError" in errors["broken"]
    assert "name the entry point after its environment" in errors["misnamed"]
    with pytest.raises(EnvironmentEntryPointError, match="entry point 'broken'") as raised:
        get_environment("broken")
    assert isinstance(raised.value, UnknownEnvironmentError)  # the CLI and daemon catch this
    with pytest.raises(UnknownEnvironmentError, match="no environment named 'chess'"):
        get_environment("chess")


def test_a_broken_entry_point_loaded_alone_leaves_the_next_lookup_working(
    installed: Path,
) -> None:
    with pytest.raises(EnvironmentEntryPointError, match="fix or uninstall"):
        environment_class("broken")
    assert environment_class("toy").name == "toy"


def test_env_list_shows_environments_from_installed_packages(tmp_path: Path) -> None:
    site = write_package(tmp_path / "site")
    paths = [str(site), os.environ.get("PYTHONPATH", "")]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    environ["COLUMNS"] = "200"
    listed = subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", "env", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    assert listed.returncode == 0, listed.stderr
    rows = {line.split("│")[1].strip() for line in listed.stdout.splitlines() if "│" in line}
    assert {"math", "toy", "toy-registered"} <= rows
    assert "broken" not in rows
    assert "entry point 'broken'" in listed.stderr + listed.stdout
