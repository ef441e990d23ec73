"""The `skillswarm` command as a user runs it: a real subprocess, real config files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from skillswarm.coordinator.config import CoordinatorConfig
from skillswarm.node.config import NodeConfig
from skillswarm.protocol.tomlconfig import ConfigFileError, load_toml_config, write_toml_config


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_version_and_help():
    import skillswarm

    result = _cli("version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"skillswarm {skillswarm.__version__}"
    helped = _cli("--help")
    for command in ("demo", "node", "coordinator", "pull", "version", "env", "serve-model"):
        assert command in helped.stdout


def test_help_names_the_defaults_that_are_resolved_later():
    def flat(*args: str) -> str:  # the help's table without its borders and line breaks
        return " ".join(_cli(*args, "--help").stdout.replace("│", " ").split())

    bootstrap = flat("bootstrap")
    for default in ("recommended budget", "recommended shares", "recommended target"):
        assert f"[default: (the {default})]" in bootstrap, default
    assert "[default: (the shipped base's)]" in bootstrap
    assert "[default: (128; with --quick, 6)]" in flat("demo")


def test_bad_config_is_a_clear_error(tmp_path: Path):
    bad = tmp_path / "node.toml"
    bad.write_text('domain = "math"\n[train]\nsteps = -3\n')
    result = _cli("node", "run", "--config", str(bad))
    assert result.returncode == 1
    assert "train.steps" in result.stderr
    missing = _cli("coordinator", "serve", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 1
    assert "does not exist" in missing.stderr


def test_a_coordinator_without_a_base_checkpoint_says_how_to_make_one(tmp_path: Path):
    """The coordinator never trains a base itself: with an empty registry and no usable
    base_checkpoint it exits before serving, naming the command that builds one."""
    work = tmp_path / "work"
    for base, why in ((None, "is not set"), (tmp_path / "empty", "has no config.json")):
        config = CoordinatorConfig(
            work_dir=work, p2p_host="127.0.0.1", p2p_port=0, http_port=0, base_checkpoint=base
        )
        toml = write_toml_config(config, tmp_path / "coordinator.toml")
        result = _cli("coordinator", "serve", "--config", str(toml))
        assert result.returncode == 1, result.stderr
        assert why in result.stderr and "skillswarm bootstrap DIR" in result.stderr
        assert not (work / "registry").exists() or not any((work / "registry").rglob("*.json"))


def test_config_round_trip_and_unknown_fields(tmp_path: Path):
    node = NodeConfig(domain="math", rounds=3)
    assert load_toml_config(write_toml_config(node, tmp_path / "n.toml"), NodeConfig) == node
    coordinator = CoordinatorConfig(allowed_peers=["12D3KooWabc"])
    path = write_toml_config(coordinator, tmp_path / "c.toml")
    assert load_toml_config(path, CoordinatorConfig) == coordinator
    (tmp_path / "typo.toml").write_text("min_delta = 2\n")
    with pytest.raises(ConfigFileError, match="min_delta"):
        load_toml_config(tmp_path / "typo.toml", CoordinatorConfig)
    (tmp_path / "broken.toml").write_text("[merge\n")
    with pytest.raises(ConfigFileError, match="not valid TOML"):
        load_toml_config(tmp_path / "broken.toml", CoordinatorConfig)
    (tmp_path / "method.toml").write_text('[merge]\nmethod = "nope"\n')
    with pytest.raises(ConfigFileError, match="unknown merge method"):
        load_toml_config(tmp_path / "method.toml", CoordinatorConfig)


def test_env_list_and_try_with_the_solver():
    listed = _cli("env", "list")
    assert listed.returncode == 0, listed.stderr
    for domain in ("math", "code", "search"):
        assert domain in listed.stdout
    tried = _cli("env", "try", "math", "--n", "2", "--solver", "--seed", "3")
    assert tried.returncode == 0, tried.stderr
    assert tried.stdout.count("episode ") == 2
    assert "assistant turn 0" in tried.stdout and "tool calculator" in tried.stdout
    assert "reward 1 · answer" in tried.stdout
    unknown = _cli("env", "try", "chess")
    assert unknown.returncode == 1 and "no environment named 'chess'" in unknown.stderr
    both = _cli("env", "try", "math", "--solver", "--model", "x")
    assert both.returncode == 1 and "not both" in both.stderr


def test_env_try_with_a_model_folder(tiny_base):
    tried = _cli("env", "try", "math", "--n", "2", "--model", str(tiny_base), "--greedy")
    assert tried.returncode == 0, tried.stderr
    assert tried.stdout.count("episode ") == 2 and "summary" in tried.stdout
    by_family = _cli("env", "try", "code", "--n", "12", "--solver", "--families")
    assert by_family.returncode == 0, by_family.stderr
    assert "success per task family" in by_family.stdout and "episode " not in by_family.stdout
    table = by_family.stdout.split("success per task family", 1)[1].split("summary", 1)[0]
    rows = re.findall(r"│ (\w+) +│ (\d+) +│ ([\d.]+) +│", table)
    assert sum(int(count) for _, count, _ in rows) == 12 and len(rows) > 1
    assert {rate for _, _, rate in rows} == {"1"}  # the solver solves every task
    searched = _cli("env", "try", "search", "--n", "6", "--solver", "--families")
    assert searched.returncode == 0, searched.stderr
    assert re.search(r"│ [a-z_]+>[a-z_]+ +│", searched.stdout)  # two-hop relation chains
    missing = _cli("env", "try", "math", "--model", "/nonexistent/model")
    assert missing.returncode == 1 and "config.json" in missing.stderr


def test_bootstrap_shares_demonstrations_by_weight_and_refuses_bad_weights(tmp_path: Path):
    import json

    out = tmp_path / "base"
    built = _cli(
        "bootstrap", str(out), "--steps", "2", "--domains", "math,code",
        "--weights", "math=2.5, code=1", "--eval-tasks", "0", "--threads", "1",
        "--copy-steps", "3", "--copy-target", "0.5", "--copy-whole-words", "0.4",
        "--hidden-size", "64", "--layers", "2",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip().endswith(str(out))
    assert "math ×2.5, code ×1" in built.stderr
    provenance = json.loads((out / "skillswarm_base.json").read_text())
    assert provenance["domain_weights"] == [2.5, 1.0]
    assert provenance["warm_start_steps"] == 2
    assert provenance["copy_pretraining_steps"] == 3
    assert provenance["copy_target"] == 0.5
    assert provenance["copy_whole_word_share"] == 0.4
    assert (provenance["hidden_size"], provenance["layers"]) == (64, 2)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert config["intermediate_size"] == 256 and config["num_attention_heads"] == 4
    assert "copy pretraining until 50%" in " ".join(built.stderr.split())
    assert provenance["built_with"]["torch"].startswith("2.")
    assert 0 <= provenance["copy_accuracy"] < 0.9  # three steps copy next to nothing
    assert "copy pretraining" in built.stderr
    refused = _cli("bootstrap", str(tmp_path / "no"), "--domains", "math", "--weights", "code=3")
    assert refused.returncode == 2, refused.stderr
    assert "'code' is not one of the domains" in refused.stderr
    assert not (tmp_path / "no").exists()
    odd = _cli("bootstrap", str(tmp_path / "odd"), "--hidden-size", "66", "--eval-tasks", "0")
    assert odd.returncode == 1 and "size 66 is not a positive multiple of 4" in odd.stderr
    assert not (tmp_path / "odd").exists()


def test_bootstrap_prebuilt_copies_the_shipped_base(tmp_path: Path, tiny_base: Path):
    out = tmp_path / "base"
    copied = _cli("bootstrap", str(out), "--prebuilt")
    assert copied.returncode == 0, copied.stderr
    assert copied.stdout.strip() == str(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "skillswarm_base.json"):
        assert (out / name).read_bytes() == (tiny_base / name).read_bytes(), name
    again = _cli("bootstrap", str(out), "--prebuilt")
    assert again.returncode == 1 and "not empty" in again.stderr


def test_domain_weights_are_parsed_and_checked():
    import typer

    from skillswarm.cli import parse_domain_weights

    domains = ["math", "code", "search"]
    assert parse_domain_weights("math=1.9, search=20,", domains) == {"math": 1.9, "search": 20.0}
    assert parse_domain_weights("", domains) == {}
    assert parse_domain_weights("math=0,code=0", domains) == {"math": 0.0, "code": 0.0}
    for weights, message in [
        ("search=3", "'search' is not one of the domains"),
        ("math=-1", "is not DOMAIN=WEIGHT"),
        ("math=inf", "is not DOMAIN=WEIGHT"),
        ("math", "is not DOMAIN=WEIGHT"),
        ("=2", "is not DOMAIN=WEIGHT"),
        ("math=0,code=0", "at least one domain"),
    ]:
        with pytest.raises(typer.BadParameter, match=message):
            parse_domain_weights(weights, ["math", "code"])
