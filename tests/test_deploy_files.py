"""Deployment files name real commands of the project, real files of the repository, and configs
that validate against the current config models; the swarm they describe is wired consistently."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel
from skillswarm.coordinator.config import CoordinatorConfig
from skillswarm.node.config import NodeConfig
from skillswarm.protocol.tomlconfig import load_toml_config
from typer.core import TyperGroup
from typer.main import get_command

from skillswarm.cli import app

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
SKYPILOT_FILE = DEPLOY / "skypilot-node.yaml"
SYSTEMD_UNIT = DEPLOY / "skillswarm-node.service"
DOCKERFILES = {
    "coordinator": DEPLOY / "coordinator.Dockerfile",
    "node": DEPLOY / "node.Dockerfile",
}
CONFIG_MODELS: dict[tuple[str, ...], type[BaseModel]] = {
    ("node", "run"): NodeConfig,
    ("coordinator", "serve"): CoordinatorConfig,
}
URL = re.compile(r"https?://[^\s'\"]+")


# -- helpers ---------------------------------------------------------------------------------


@cache
def _cli_help(args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _resolve_cli(argv: list[str]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Parse argv with the real `skillswarm` command tree, without running it; returns the
    subcommand path and the parsed parameters. Fails on an unknown command or option."""
    assert Path(argv[0]).name == "skillswarm", argv
    command = get_command(app)
    path: list[str] = []
    rest = list(argv[1:])
    while isinstance(command, TyperGroup):
        assert rest, f"{argv} names no subcommand"
        name = rest.pop(0)
        assert name in command.commands, f"{argv}: no command {name!r} under {path}"
        command = command.commands[name]
        path.append(name)
    context = command.make_context(" ".join(["skillswarm", *path]), rest)
    help_run = _cli_help(tuple(path))
    assert help_run.returncode == 0, help_run.stderr
    return tuple(path), context.params


def _validated_config(path: Path, model: type[BaseModel]) -> BaseModel:
    assert path.is_file(), f"{path} does not exist"
    return load_toml_config(path, model)


def _config_model_for(config_file: Path) -> type[BaseModel]:
    return CoordinatorConfig if config_file.name.startswith("coordinator") else NodeConfig


def _dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def _final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    return instructions[starts[-1] :]


def _only(instructions: list[tuple[str, str]], keyword: str) -> str:
    (arguments,) = [args for kw, args in instructions if kw == keyword]
    return arguments


def _healthcheck_urls(text: str) -> list[str]:
    return URL.findall(text)


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (a named volume or a path relative to the compose file)."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target, *_ = entry.split(":")
        mounts[target] = source
    return mounts


def _service_argv(service: dict[str, Any]) -> list[str]:
    if "command" in service:
        return list(service["command"])
    dockerfile = COMPOSE_FILE.parent / service["build"]["context"] / service["build"]["dockerfile"]
    return json.loads(_only(_final_stage(_dockerfile(dockerfile)), "CMD"))


def _compose_configs() -> dict[str, BaseModel]:
    """Every compose service's --config, read from the file mounted at that path."""
    configs = {}
    for name, service in _compose()["services"].items():
        path, params = _resolve_cli(_service_argv(service))
        if params.get("config") is None:
            continue
        source = _mounts(service).get(str(params["config"]))
        assert source is not None, f"{name}: nothing is mounted at {params['config']}"
        configs[name] = _validated_config(COMPOSE_FILE.parent / source, CONFIG_MODELS[path])
    return configs


def _skypilot() -> dict[str, Any]:
    return yaml.safe_load(SKYPILOT_FILE.read_text())


def _skillswarm_lines(script: str) -> list[list[str]]:
    lines = []
    for line in script.splitlines():
        words = shlex.split(line) if line.strip() else []
        if words and words[0] == "exec":
            words = words[1:]
        if words and Path(words[0]).name == "skillswarm":
            lines.append(words)
    return lines


# -- systemd ---------------------------------------------------------------------------------


def test_systemd_unit_runs_a_real_command():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(SYSTEMD_UNIT)
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).name == "skillswarm"
    assert argv[1:3] == ["node", "run"]
    assert _cli_help(tuple(argv[1:3])).returncode == 0
    assert unit["Service"]["KillSignal"] == "SIGTERM"


def test_systemd_unit_restarts_stops_gracefully_and_runs_unprivileged():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(SYSTEMD_UNIT)
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert int(service["TimeoutStopSec"]) >= 300
    assert service["User"] not in ("", "root")
    _, params = _resolve_cli(shlex.split(service["ExecStart"]))
    assert params["config"] == Path("/etc/skillswarm/node.toml")
    # The GPU node config's work_dir is the unit's working (and state) directory.
    gpu_node = _validated_config(DEPLOY / "configs" / "node-gpu.toml", NodeConfig)
    assert Path(service["WorkingDirectory"]) == gpu_node.work_dir
    assert Path("/var/lib") / service["StateDirectory"] == gpu_node.work_dir


# -- Dockerfiles -----------------------------------------------------------------------------


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_copy_real_paths_and_run_a_real_command_unprivileged(image: str):
    instructions = _dockerfile(DOCKERFILES[image])
    copied: set[str] = set()
    for keyword, arguments in instructions:
        if keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(arguments) if arguments.startswith("[") else arguments.split()
        if any(word.startswith("--from=") for word in words):
            continue  # copied from an earlier build stage
        sources = [word for word in words if not word.startswith("--")][:-1]
        assert sources, arguments
        for source in sources:
            assert (ROOT / source).exists(), f"{DOCKERFILES[image].name} copies missing {source}"
            copied.update(sources)
    # `pip install .` in the image needs every folder the package is built from.
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(package_dirs["package-dir"].values()) <= copied, DOCKERFILES[image].name
    final = _final_stage(instructions)
    path, params = _resolve_cli(json.loads(_only(final, "CMD")))
    assert path == {"coordinator": ("coordinator", "serve"), "node": ("node", "run")}[image]
    assert params["config"] is not None
    assert _only(final, "USER") not in ("root", "0")
    assert _only(final, "STOPSIGNAL") == "SIGTERM"
    assert _only(final, "VOLUME")


def test_coordinator_image_is_a_slim_cpu_image_with_a_healthcheck():
    instructions = _dockerfile(DOCKERFILES["coordinator"])
    assert "slim" in _only(_final_stage(instructions), "FROM")
    runs = [arguments for keyword, arguments in instructions if keyword == "RUN"]
    assert any(
        "torch==2.13.0" in run and "--index-url https://download.pytorch.org/whl/cpu" in run
        for run in runs
    )
    # The project goes in with torch held at the CPU build.
    assert any("pip install --constraint" in run and run.endswith(" .") for run in runs)
    healthcheck = _only(_final_stage(instructions), "HEALTHCHECK")
    (url,) = _healthcheck_urls(healthcheck)
    assert urlsplit(url).path == "/healthz"


def test_node_image_is_cuda_with_the_gpu_extra():
    instructions = _dockerfile(DOCKERFILES["node"])
    base = _only(_final_stage(instructions), "FROM")
    image, _, tag = base.partition(":")
    assert image in ("nvidia/cuda", "nvcr.io/nvidia/cuda") or "cuda" in tag, base
    assert re.match(r"\d+\.\d+", tag), f"{base}: pin a versioned tag"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "gpu" in pyproject["project"]["optional-dependencies"]
    runs = [arguments for keyword, arguments in instructions if keyword == "RUN"]
    assert any("pip install '.[gpu]'" in run for run in runs)
    # The image's volume is where the GPU node config keeps its state.
    gpu_node = _validated_config(DEPLOY / "configs" / "node-gpu.toml", NodeConfig)
    assert Path(_only(_final_stage(instructions), "VOLUME")) == gpu_node.work_dir


# -- configs ---------------------------------------------------------------------------------


def test_every_deploy_config_validates():
    files = sorted((DEPLOY / "configs").glob("*.toml"))
    assert {f.name for f in files} >= {
        "coordinator.toml",
        "node-math.toml",
        "node-code.toml",
        "node-search.toml",
        "node-gpu.toml",
    }
    for config_file in files:
        _validated_config(config_file, _config_model_for(config_file))
    gpu_node = _validated_config(DEPLOY / "configs" / "node-gpu.toml", NodeConfig)
    assert gpu_node.inference.backend == "vllm"
    # The CPU recipes' guidance and KL term are measured on the embedded base only.
    assert gpu_node.train.guidance == 0.0
    assert gpu_node.train.loss.kl_coef == 0.0
    # ... and so are the search recipe's imitation steps, whatever domain the node is set to.
    raw = tomllib.loads((DEPLOY / "configs" / "node-gpu.toml").read_text())
    for domain in ("math", "code", "search"):
        assert not NodeConfig.model_validate({**raw, "domain": domain}).train.imitation.active


# -- compose ---------------------------------------------------------------------------------


def test_compose_builds_from_real_dockerfiles_and_declares_its_volumes():
    compose = _compose()
    built_images = set()
    for name, service in compose["services"].items():
        if "build" in service:
            context = COMPOSE_FILE.parent / service["build"]["context"]
            assert context.is_dir(), f"{name}: build context {context} is missing"
            assert (context / service["build"]["dockerfile"]).is_file(), name
            built_images.add(service.get("image"))
    for name, service in compose["services"].items():
        assert "build" in service or service["image"] in built_images, name
        for source in _mounts(service).values():
            if source.startswith((".", "/")):
                assert (COMPOSE_FILE.parent / source).exists(), f"{name}: {source} is missing"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"


def test_compose_commands_are_real_and_their_mounted_configs_validate():
    configs = _compose_configs()
    nodes = {name: c for name, c in configs.items() if isinstance(c, NodeConfig)}
    assert sorted(node.domain for node in nodes.values()) == ["code", "math", "search"]
    assert [name for name, c in configs.items() if isinstance(c, CoordinatorConfig)] == [
        "coordinator"
    ]


def test_compose_swarm_is_wired_consistently():
    compose = _compose()
    services = compose["services"]
    configs = _compose_configs()
    coordinator = configs["coordinator"]
    assert isinstance(coordinator, CoordinatorConfig)

    def address(name: str) -> str:
        return services[name]["networks"]["swarm"]["ipv4_address"]

    def volume_at(name: str, path: Path) -> str:
        """The named volume that holds `path` in service `name`."""
        mounts = _mounts(services[name])
        holders = [t for t in mounts if path == Path(t) or Path(t) in path.parents]
        assert holders, f"{name}: {path} is on no volume"
        source = mounts[max(holders, key=len)]
        assert source in compose["volumes"], f"{name}: {path} is on {source}, not a named volume"
        return source

    # The coordinator serves HTTP on every interface and libp2p on the address nodes can dial.
    assert coordinator.http_host == "0.0.0.0"
    assert coordinator.p2p_host == address("coordinator")
    volume_at("coordinator", coordinator.work_dir)
    # Its base checkpoint is what the bootstrap service writes, on the same volume.
    bootstrap_path, bootstrap_params = _resolve_cli(services["bootstrap"]["command"])
    assert bootstrap_path == ("bootstrap",)
    assert coordinator.base_checkpoint == bootstrap_params["out"]
    assert volume_at("bootstrap", bootstrap_params["out"]) == volume_at(
        "coordinator", coordinator.base_checkpoint
    )
    assert set(bootstrap_params["domains"].split(",")) == set(coordinator.round.required_domains)
    assert services["coordinator"]["depends_on"]["bootstrap"]["condition"] == (
        "service_completed_successfully"
    )
    for name, node in configs.items():
        if not isinstance(node, NodeConfig):
            continue
        url = urlsplit(node.coordinator_url)
        assert (url.hostname, url.port) == ("coordinator", coordinator.http_port), name
        assert node.p2p_host == address(name)
        assert node.domain in coordinator.eval.domains
        assert services[name]["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert volume_at(name, node.work_dir) != volume_at("coordinator", coordinator.work_dir)


@pytest.mark.skipif(
    "operator_token_env" not in CoordinatorConfig.model_fields,
    reason="CoordinatorConfig.operator_token_env is pending",
)
def test_compose_passes_the_operator_token_to_the_coordinator():
    token_env = CoordinatorConfig.model_fields["operator_token_env"].default
    environment = _compose()["services"]["coordinator"]["environment"]
    assert environment[token_env] == f"${{{token_env}:-}}"


def test_healthchecks_hit_real_routes(tmp_path: Path):
    from fastapi.testclient import TestClient
    from skillswarm.coordinator.app import create_app
    from skillswarm.coordinator.service import Coordinator

    compose = _compose()
    coordinator_config = _compose_configs()["coordinator"]
    urls = _healthcheck_urls(json.dumps(compose["services"]["coordinator"]["healthcheck"]["test"]))
    urls += _healthcheck_urls(
        _only(_final_stage(_dockerfile(DOCKERFILES["coordinator"])), "HEALTHCHECK")
    )
    assert urls
    config = coordinator_config.model_copy(
        update={"work_dir": tmp_path, "p2p_host": "127.0.0.1", "base_checkpoint": None}
    )
    coordinator = Coordinator(config)
    try:
        client = TestClient(create_app(coordinator))  # no lifespan: nothing starts
        for url in urls:
            parts = urlsplit(url)
            assert parts.port == coordinator_config.http_port, url
            response = client.get(parts.path)
            assert response.status_code == 200, f"{url}: {response.status_code}"
    finally:
        coordinator.store.close()


# -- SkyPilot --------------------------------------------------------------------------------


def test_skypilot_task_asks_for_a_gpu_and_installs_the_gpu_extra():
    task = _skypilot()
    candidates = task["resources"]["any_of"]
    assert candidates and all(":" in c["accelerators"] for c in candidates)
    assert "'.[gpu]'" in task["setup"]
    assert (ROOT / task["workdir"]).resolve() == ROOT
    for destination, source in task["file_mounts"].items():
        assert (ROOT / source).exists(), f"file_mounts {destination}: {source} is missing"


def test_skypilot_run_overrides_the_mounted_config_and_runs_a_real_command(tmp_path: Path):
    task = _skypilot()
    run = task["run"]
    (argv,) = _skillswarm_lines(run)
    path, params = _resolve_cli(argv)
    assert path == ("node", "run")
    assert str(params["config"]) in task["file_mounts"]
    # The run section as SkyPilot runs it, in a home with the mounted files, its `skillswarm`
    # printing the configuration `node run` would start with instead of starting a node.
    for destination, source in task["file_mounts"].items():
        mounted = tmp_path / destination.removeprefix("~/")
        mounted.parent.mkdir(parents=True, exist_ok=True)
        mounted.write_text((ROOT / source).read_text())
    shim = tmp_path / Path(argv[0].removeprefix("~/"))
    shim.parent.mkdir(parents=True)
    shim.write_text(
        '#!/bin/sh\n[ "$1 $2" = "node run" ] || exit 64\nshift 2\n'
        f'exec {sys.executable} -m skillswarm.cli config show --kind node "$@"\n'
    )
    shim.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SKILLSWARM_")}
    env.update({key: str(value) for key, value in task["envs"].items()})
    env["HOME"] = str(tmp_path)
    missing_url = subprocess.run(
        ["bash", "-c", run], env=env, capture_output=True, text=True, timeout=60
    )
    assert missing_url.returncode != 0 and "SKILLSWARM_COORDINATOR_URL" in missing_url.stderr
    env.update(
        {
            "SKILLSWARM_COORDINATOR_URL": "http://192.0.2.7:8470",
            "SKILLSWARM_DOMAIN": "search",
            "SKILLSWARM_BOOTSTRAP_PEERS": '["/ip4/192.0.2.7/tcp/4001/p2p/12D3KooWExample"]',
        }
    )
    result = subprocess.run(
        ["bash", "-c", run], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    node = NodeConfig.model_validate(tomllib.loads(result.stdout))
    assert node.coordinator_url == "http://192.0.2.7:8470"
    assert node.domain == "search"
    assert node.bootstrap_peers == ["/ip4/192.0.2.7/tcp/4001/p2p/12D3KooWExample"]
    assert node.work_dir == tmp_path / "skillswarm-data"
    assert node.inference.backend == "vllm"
    assert node.train.learning_rate == 1e-6  # the mounted file's
