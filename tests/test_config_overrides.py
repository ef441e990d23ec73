"""Config overrides as a user gives them: SKILLSWARM_* variables and `--set KEY=VALUE` over the TOML
file over the defaults, through the real `skillswarm` command and through `load_config`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from skillswarm.coordinator.config import CoordinatorConfig
from skillswarm.node.config import NodeConfig
from skillswarm.node.recipes import DOMAIN_RECIPES
from skillswarm.protocol.tomlconfig import (
    ConfigFileError,
    ConfigOverrideError,
    load_config,
    load_toml_config,
)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command, with no SKILLSWARM_* variables but those in `env`."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("SKILLSWARM_")}
    return subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def _node_file(tmp_path: Path) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(
        'domain = "code"\nseed = 1\nrounds = 2\n[train]\nlearning_rate = 0.001\nsteps = 5\n'
    )
    return path


def test_cli_over_env_over_file_over_defaults_through_config_show(tmp_path: Path) -> None:
    shown = _cli(
        "config",
        "show",
        "--kind",
        "node",
        "--config",
        str(_node_file(tmp_path)),
        "--set",
        "seed=3",
        "--set",
        "train.loss.kl_coef=0.25",
        env={
            "SKILLSWARM_SEED": "2",
            "SKILLSWARM_ROUNDS": "3",
            "SKILLSWARM_TRAIN__STEPS": "6",
            "SKILLSWARM_SANDBOX": "audit-hook",  # the sandbox's own variable: no config field
        },
    )
    assert shown.returncode == 0, shown.stderr
    node = NodeConfig.model_validate(tomllib.loads(shown.stdout))
    assert node.seed == 3  # --set over the variable over the file
    assert node.rounds == 3  # the variable over the file
    assert node.train.steps == 6  # a nested variable over the file
    assert node.train.learning_rate == 0.001  # the file over the recipe
    assert node.train.loss.kl_coef == 0.25  # a nested --set
    assert node.torch_threads == NodeConfig().torch_threads  # the default
    recipe = DOMAIN_RECIPES["code"]
    assert node.train.tasks_per_step == recipe.tasks_per_step  # the code recipe under it all
    assert node.train.loss.clip_high == recipe.loss.clip_high
    assert node.train_overrides == ["learning_rate", "loss.kl_coef", "steps"]


def test_coordinator_overrides_leave_the_operator_token_alone(tmp_path: Path) -> None:
    token = "token-value-never-shown"
    shown = _cli(
        "config",
        "show",
        "--kind",
        "coordinator",
        "--set",
        'eval.domains=["math", "code"]',
        "--set",
        "round={min_deltas = 3}",
        "--set",
        "swarm=2024",  # a text field takes the text as it is
        env={"SKILLSWARM_EVAL__N_TASKS": "4", "SKILLSWARM_OPERATOR_TOKEN": token},
    )
    assert shown.returncode == 0, shown.stderr
    assert token not in shown.stdout
    coordinator = CoordinatorConfig.model_validate(tomllib.loads(shown.stdout))
    assert coordinator.eval.domains == ["math", "code"]
    assert coordinator.eval.n_tasks == 4
    assert coordinator.round.min_deltas == 3
    assert coordinator.round.min_deltas_at_deadline == 1  # the table merged, not replaced
    assert coordinator.swarm == "2024"
    assert coordinator.operator_token_env == "SKILLSWARM_OPERATOR_TOKEN"


def test_a_bad_override_stops_the_node_before_it_starts() -> None:
    for args in (["node", "run"], ["coordinator", "serve"], ["train"]):
        assert "--set" in _cli(*args, "--help").stdout
    bad = _cli("node", "run", "--set", "train.stpes=3")
    assert bad.returncode == 1
    assert "--set train.stpes=3: [train] has no field 'stpes'" in bad.stderr


def test_the_file_sets_fields_the_recipe_does_not_override(tmp_path: Path) -> None:
    path = _node_file(tmp_path)
    node = load_config(NodeConfig, path, overrides=["train.steps=3"], environ={})
    assert node.train.steps == 3 and node.train.learning_rate == 0.001
    assert node.train.max_new_tokens == DOMAIN_RECIPES["code"].max_new_tokens
    # Another domain brings its own recipe under the same set fields.
    search = load_config(NodeConfig, path, overrides=["domain=search"], environ={})
    assert search.train.learning_rate == 0.001 and search.train.steps == 5
    assert search.train.tasks_per_step == DOMAIN_RECIPES["search"].tasks_per_step
    # A table merges key by key into the file's.
    merged = load_config(NodeConfig, path, overrides=["train={temperature = 0.7}"], environ={})
    assert (merged.train.temperature, merged.train.steps) == (0.7, 5)
    # The last of two overrides of one key wins.
    twice = load_config(NodeConfig, None, overrides=["seed=1", "seed=9"], environ={})
    assert twice.seed == 9


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.bogus=1", "--set train.bogus=1: [train] has no field 'bogus'; its fields: steps"),
        ("eval.n_tasks=1", "the configuration has no field 'eval'"),
        ("nonsense", "--set nonsense: expected KEY=VALUE"),
        ("train.steps.x=1", "train.steps is a value, not a table"),
        ("bootstrap_peers=[a, b]", "bootstrap_peers = [a, b] is not a TOML value"),
        ("train.steps=0", "train.steps: Input should be greater than or equal to 1 (from --set"),
        ("train.steps=many", "train.steps: Input should be a valid integer"),
    ],
)
def test_a_bad_key_or_value_names_it(override: str, message: str) -> None:
    with pytest.raises(ConfigFileError) as caught:
        load_config(NodeConfig, None, overrides=[override], environ={})
    assert message in str(caught.value)


def test_only_variables_that_name_a_field_count(caplog: pytest.LogCaptureFixture) -> None:
    environ = {
        "SKILLSWARM_OPERATOR_TOKEN": "secret",
        "SKILLSWARM_SANDBOX": "bubblewrap",
        "SKILLSWARM_TRAIN__STPES": "3",  # a typo under a table: ignored, with a warning
        "SKILLSWARM_SEED": "",  # empty: unset
        "SKILLSWARM_": "x",
        "OTHER_SEED": "5",
        "skillswarm_torch_threads": "4",  # names in any case
    }
    with caplog.at_level(logging.WARNING):
        node = load_config(NodeConfig, None, environ=environ)
    assert node == NodeConfig(torch_threads=4)
    assert "SKILLSWARM_TRAIN__STPES" in caplog.text
    assert "OPERATOR_TOKEN" not in caplog.text
    coordinator = load_config(CoordinatorConfig, None, environ=environ)
    assert coordinator == CoordinatorConfig(torch_threads=4)
    with pytest.raises(ConfigOverrideError, match="environment variable SKILLSWARM_EVAL__DOMAINS"):
        load_config(CoordinatorConfig, None, environ={"SKILLSWARM_EVAL__DOMAINS": "[math"})
    with pytest.raises(
        ConfigFileError, match=r"eval.n_tasks: .* \(from SKILLSWARM_EVAL__N_TASKS\)"
    ):
        load_config(CoordinatorConfig, None, environ={"SKILLSWARM_EVAL__N_TASKS": "0"})


def test_the_file_loader_reads_the_file_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKILLSWARM_SEED", "7")
    path = _node_file(tmp_path)
    assert load_toml_config(path, NodeConfig).seed == 1
    assert load_config(NodeConfig, path).seed == 7  # os.environ when none is given
