"""`skillswarm demo`: a coordinator and training nodes as separate processes on 127.0.0.1.

Builds the embedded base model, starts the coordinator and the nodes, shows their progress, pulls
the merged checkpoint like any user would, checks it generates, and prints the round's table.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from coordinator.config import CoordinatorConfig, EvalConfig, RoundPolicy
from merge.methods import MergeSpec
from node.config import NodeConfig, TrainConfig
from protocol.tomlconfig import write_toml_config

STEP_LINE = re.compile(r"round=(\d+) step=(\d+)/(\d+) reward=([\d.na]+)")


class DemoError(RuntimeError):
    """The demo could not finish; the message points at the log to read."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    status: str = "starting"
    extra: dict[str, str] = field(default_factory=dict)

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""


def spawn(name: str, args: list[str], log: Path) -> Process:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    handle = open(log, "wb")  # noqa: SIM115 - owned by the child
    popen = subprocess.Popen(
        [sys.executable, "-m", "skillswarm.cli", *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    handle.close()
    return Process(name, popen, log)


def stop_all(processes: list[Process], timeout: float = 20.0) -> None:
    for p in processes:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in processes:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


def wait_http(url: str, proc: Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise DemoError(f"{proc.name} exited early; see {proc.log}:\n{proc.tail()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise DemoError(f"{proc.name} did not answer on {url} within {timeout:.0f}s; see {proc.log}")


def write_configs(
    workdir: Path,
    base: Path,
    n_nodes: int,
    train: TrainConfig,
    eval_tasks: int,
    merge: MergeSpec | None = None,
) -> tuple[Path, list[Path], str]:
    """Coordinator and node TOML files for a loopback swarm; returns them and the HTTP URL."""
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    coordinator = CoordinatorConfig(
        work_dir=workdir / "coordinator",
        http_port=http_port,
        p2p_port=free_port(),
        base_checkpoint=base,
        round=RoundPolicy(min_deltas=n_nodes),
        merge=merge or MergeSpec(),
        eval=EvalConfig(domains=["math"], n_tasks=eval_tasks),
    )
    coordinator_toml = write_toml_config(coordinator, workdir / "coordinator.toml")
    node_tomls = []
    for i in range(n_nodes):
        node = NodeConfig(
            work_dir=workdir / f"node-{i}",
            domain="math",
            coordinator_url=url,
            seed=i + 1,
            train=train,
        )
        node_tomls.append(write_toml_config(node, workdir / f"node-{i}.toml"))
    return coordinator_toml, node_tomls, url


def run_demo(
    workdir: Path,
    *,
    n_nodes: int = 2,
    steps: int = 6,
    eval_tasks: int = 64,
    console: Console | None = None,
    timeout: float = 1800.0,
) -> dict:
    """Run one round of a loopback swarm; returns the round's record from the coordinator."""
    console = console or Console(stderr=True)
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    base = workdir / "base"
    if not (base / "config.json").exists():
        from node.model import create_base_checkpoint

        with console.status("building the embedded base model (tokenizer, tiny Qwen2, warm start)"):
            create_base_checkpoint(base)
    console.print(f"base checkpoint: {base}")
    for stale in [
        workdir / "coordinator",
        workdir / "pulled",
        workdir / "logs",
        *workdir.glob("node-*"),
    ]:
        if stale.is_dir():  # a fresh swarm every run; only the base is reused
            shutil.rmtree(stale)
    # Nodes of one domain pull the same way: their task vectors are averaged, not stacked.
    merge = MergeSpec(method="task_arithmetic", parameters={"weight": 1.0 / n_nodes})
    coordinator_toml, node_tomls, url = write_configs(
        workdir, base, n_nodes, TrainConfig(steps=steps), eval_tasks, merge
    )
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    processes: list[Process] = []
    try:
        coordinator = spawn(
            "coordinator",
            ["coordinator", "serve", "--config", str(coordinator_toml)],
            logs / "coordinator.log",
        )
        processes.append(coordinator)
        wait_http(url, coordinator, timeout=180)
        coordinator.status = "serving"
        for i, toml in enumerate(node_tomls):
            processes.append(
                spawn(
                    f"node-{i} (math)",
                    ["node", "run", "--config", str(toml)],
                    logs / f"node-{i}.log",
                )
            )
        record = _follow_round(url, processes, console, timeout)
        pulled = _pull_and_generate(url, workdir / "pulled", console)
        _wait_nodes_done(processes[1:], timeout=30)
    finally:
        stop_all(processes)
    _print_summary(console, record, pulled, workdir)
    return record


def _follow_round(url: str, processes: list[Process], console: Console, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    with Live(_progress_table(processes, None), console=console, refresh_per_second=2) as live:
        while time.monotonic() < deadline:
            for p in processes[1:]:
                matches = STEP_LINE.findall(p.tail())
                if matches:
                    _, step, total, reward = matches[-1]
                    p.status = f"training step {step}/{total}, reward {reward}"
                if "delta " in p.tail() and " is accepted" in p.tail():
                    p.status = "delta accepted, waiting for the merge"
                if p.popen.poll() is not None:
                    p.status = f"exited ({p.popen.returncode})"
            try:
                rounds = httpx.get(f"{url}/v1/rounds", timeout=5).json()
            except httpx.HTTPError:
                rounds = []
            first = rounds[0] if rounds else None
            live.update(_progress_table(processes, first))
            if first and first["status"] == "published":
                return first
            if first and first["status"] == "failed":
                raise DemoError(f"round 1 failed: {first['error']}")
            if processes[0].popen.poll() is not None:
                raise DemoError(f"the coordinator exited; see {processes[0].log}")
            crashed = [p for p in processes[1:] if p.popen.poll() not in (None, 0)]
            if crashed:
                raise DemoError(
                    f"{crashed[0].name} failed; see {crashed[0].log}:\n{crashed[0].tail()[-1500:]}"
                )
            time.sleep(0.5)
    raise DemoError(f"round 1 did not finish within {timeout:.0f}s")


def _progress_table(processes: list[Process], round_record: dict | None) -> Table:
    table = Table(title="skillswarm demo: round 1")
    table.add_column("process")
    table.add_column("status")
    for p in processes:
        table.add_row(p.name, p.status)
    if round_record:
        table.add_row("round 1", f"{round_record['status']}, {len(round_record['inputs'])} inputs")
    return table


def _pull_and_generate(url: str, out: Path, console: Console) -> Path:
    """Pull the merged checkpoint as a user would and play one held-out episode with it."""
    from node.envs import get_environment
    from node.model import load_policy
    from node.rollout import play_episodes
    from protocol.pull import pull

    path = pull(url, "latest", out, progress=False)
    model, tokenizer = load_policy(path)
    env = get_environment("math")
    (episode,) = play_episodes(model, tokenizer, env, env.tasks("heldout", 1), greedy=True)
    console.print("[bold]one held-out episode with the pulled checkpoint[/bold]")
    for message in episode.messages:
        if message["role"] == "system":
            continue
        content = message.get("content") or ""
        for call in message.get("tool_calls") or []:
            content += f" <tool_call>{call['function']}</tool_call>"
        console.print(f"  [cyan]{message['role']}[/cyan]: {escape(content.strip())}")
    console.print(f"  reward {episode.reward:.1f} (answer {episode.task.answer})")
    return path


def _wait_nodes_done(processes: list[Process], timeout: float) -> None:
    """Nodes finish their last round on their own once the merged checkpoint is out."""
    deadline = time.monotonic() + timeout
    for p in processes:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _print_summary(console: Console, record: dict, pulled: Path, workdir: Path) -> None:
    table = Table(title="round 1 result")
    table.add_column("")
    table.add_column("value")
    table.add_row("checkpoint id", record["checkpoint_id"][:16] + "…")
    table.add_row("merge method", record["method"].get("method", "?"))
    table.add_row("deltas merged", str(len(record["inputs"])))
    for domain, base_row in record["evaluation"].get("base", {}).items():
        merged_row = record["evaluation"].get("merged", {}).get(domain, {})
        table.add_row(
            f"{domain} held-out reward (base → merged)",
            f"{base_row['mean_reward']:.3f} → {merged_row.get('mean_reward', float('nan')):.3f}"
            f"  (n={base_row['n']})",
        )
    table.add_row("pulled checkpoint", str(pulled))
    table.add_row("registry", str(workdir / "coordinator" / "registry"))
    table.add_row("logs", str(workdir / "logs"))
    out = Console()
    out.print(table)
    out.print(f"checkpoint id: {record['checkpoint_id']}")
