"""The node daemon as an operator runs it: real coordinator and node processes on 127.0.0.1. Two
rounds in a row (the second trained from the first merged checkpoint), the health and metrics
endpoint, and a SIGTERM mid-round after which a restart resumes and the round completes."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from skillswarm.node.config import NodeConfig
from skillswarm.node.pipeline import RLConfig
from skillswarm.protocol.messages import decode_message
from skillswarm.protocol.tomlconfig import load_toml_config, write_toml_config

from skillswarm.demo import Process, free_port, spawn, stop_all, wait_http, write_configs


def _kept_manifests(node_dir: Path) -> list:
    manifests = []
    for path in sorted((node_dir / "deltas").glob("*.msgpack")):
        manifests.append(decode_message(path.read_bytes()).signed.verify())
    return sorted(manifests, key=lambda manifest: manifest.round)


def _wait_for(condition, what: str, processes: list[Process], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for process in processes:
            code = process.popen.poll()
            assert code in (None, 0), f"{process.name} exited {code}:\n{process.tail()}"
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n" + processes[-1].tail())


def _swarm(tmp_path: Path, base: Path, steps: int, rounds: int) -> tuple[Path, Path, str]:
    train = RLConfig(steps=steps, tasks_per_step=4, samples_per_task=4)
    coordinator_toml, (node_toml,), url = write_configs(
        tmp_path, base, 1, train, eval_tasks=2, domains=("math",), rounds=rounds
    )
    node = load_toml_config(node_toml, NodeConfig).model_copy(
        update={"health_port": free_port(), "checkpoint_every": 1}
    )
    write_toml_config(node, node_toml)
    return coordinator_toml, node_toml, url


def _round_status(url: str, number: int) -> str | None:
    try:
        rounds = httpx.get(f"{url}/v1/rounds", timeout=5).json()
    except httpx.HTTPError:
        return None
    return next((r["status"] for r in rounds if r["number"] == number), None)


def test_two_rounds_the_second_trained_from_the_first_merge_across_a_coordinator_restart(
    tmp_path: Path, tiny_base: Path
):
    """The coordinator is stopped and started again once round 1 is published: the node waits
    for its API, redials its libp2p peer and has its second delta merged."""
    coordinator_toml, node_toml, url = _swarm(tmp_path, tiny_base, steps=2, rounds=2)
    node_config = load_toml_config(node_toml, NodeConfig)
    health = f"http://{node_config.health_host}:{node_config.health_port}"
    logs = tmp_path / "logs"
    logs.mkdir()
    serve = ["coordinator", "serve", "--config", str(coordinator_toml)]
    processes: list[Process] = []
    try:
        processes.append(spawn("coordinator", serve, logs / "coordinator.log"))
        wait_http(url, processes[0], timeout=120)
        node = spawn("node", ["node", "run", "--config", str(node_toml)], logs / "node.log")
        processes.append(node)

        def healthy() -> bool:
            try:
                return httpx.get(f"{health}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_for(healthy, "the node's health endpoint", processes)
        status = httpx.get(f"{health}/healthz", timeout=2).json()
        assert status["domain"] == "math" and status["peer_id"].startswith("12D3KooW")
        _wait_for(lambda: _round_status(url, 1) == "published", "round 1", processes, 300)
        stop_all(processes[:1])
        assert "Application shutdown complete" in processes[0].tail()
        processes[0] = spawn("coordinator", serve, logs / "coordinator-restarted.log")
        wait_http(url, processes[0], timeout=120)
        _wait_for(lambda: node.popen.poll() is not None, "the node's two rounds", processes, 420)
        assert node.popen.returncode == 0, node.tail()
        rounds = {r["number"]: r for r in httpx.get(f"{url}/v1/rounds", timeout=5).json()}
    finally:
        stop_all(processes)
    assert rounds[1]["status"] == rounds[2]["status"] == "published"
    first, second = _kept_manifests(tmp_path / "node-0")
    assert (first.round, second.round) == (1, 2)
    assert second.base_id == rounds[1]["checkpoint_id"]  # rebased on the first merge
    assert first.base_id == rounds[1]["base_id"] != second.base_id
    log = (logs / "node.log").read_text()
    assert "round=1 step=2/2" in log and "round=2 step=2/2" in log
    assert "lost the connection to" in log and "reconnected to" in log


def test_sigterm_mid_round_then_restart_resumes_and_completes(tmp_path: Path, tiny_base: Path):
    coordinator_toml, node_toml, url = _swarm(tmp_path, tiny_base, steps=6, rounds=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: list[Process] = []
    try:
        processes.append(
            spawn("coordinator", ["coordinator", "serve", "--config", str(coordinator_toml)],
                  logs / "coordinator.log")
        )  # fmt: skip
        wait_http(url, processes[0], timeout=120)
        first = spawn("node", ["node", "run", "--config", str(node_toml)], logs / "node-1.log")
        processes.append(first)
        _wait_for(lambda: "round=1 step=2/6" in first.tail(), "two training steps", processes)
        first.popen.send_signal(signal.SIGTERM)
        assert first.popen.wait(timeout=120) == 0, first.tail()
        processes.remove(first)
        stopped_log = (logs / "node-1.log").read_text()
        assert "stopped after step" in stopped_log
        assert not (tmp_path / "node-0" / "deltas").exists() or not _kept_manifests(
            tmp_path / "node-0"
        )

        second = spawn("node", ["node", "run", "--config", str(node_toml)], logs / "node-2.log")
        processes.append(second)
        _wait_for(lambda: second.popen.poll() is not None, "the resumed round", processes, 420)
        assert second.popen.returncode == 0, second.tail()
        rounds = httpx.get(f"{url}/v1/rounds", timeout=5).json()
    finally:
        stop_all(processes)
    resumed_log = (logs / "node-2.log").read_text()
    assert "resuming at step" in resumed_log
    resumed_at = int(resumed_log.split("resuming at step ")[1].split()[0])
    assert resumed_at >= 2
    assert f"round=1 step={resumed_at + 1}/6" in resumed_log
    assert "round=1 step=1/6" not in resumed_log
    (record,) = [r for r in rounds if r["number"] == 1]
    assert record["status"] == "published" and len(record["inputs"]) == 1
    (manifest,) = _kept_manifests(tmp_path / "node-0")
    assert manifest.steps == 6


pytestmark = pytest.mark.timeout(900)


def test_a_daemon_waiting_for_an_absent_coordinator_stops_when_told(tmp_path: Path) -> None:
    from skillswarm.node.daemon import NodeDaemon

    port = free_port()  # nothing listens there: the coordinator is away
    daemon = NodeDaemon(NodeConfig(work_dir=tmp_path, coordinator_url=f"http://127.0.0.1:{port}"))
    stopper = threading.Timer(1.0, daemon.stop)
    stopper.start()
    started = time.monotonic()
    try:
        assert daemon.run() == []
    finally:
        stopper.cancel()
    assert time.monotonic() - started < 10  # not the 120 s it would wait for the coordinator
    assert daemon.host is None  # nothing was started


def test_a_daemon_pointed_at_something_that_is_not_a_coordinator_fails_at_once(
    tmp_path: Path, not_a_coordinator: str
) -> None:
    from skillswarm.node.daemon import NodeDaemon

    started = time.monotonic()
    with pytest.raises(httpx.HTTPStatusError, match="404"):
        NodeDaemon(NodeConfig(work_dir=tmp_path, coordinator_url=not_a_coordinator)).run()
    assert time.monotonic() - started < 10  # a refusal is not waited out as an outage
