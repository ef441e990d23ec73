"""`skillswarm demo`: a coordinator and three training nodes (math, code, search) as separate
processes on 127.0.0.1, for two rounds.

Builds the embedded base model, starts the coordinator and the nodes, shows their progress, pulls
the merged checkpoint like any user would, plays a held-out episode with it, prints each round's
score table and writes a report (HTML, reward curves as PNG) into the run folder.
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

from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, MergePlan, RoundPolicy
from skillswarm.merge.methods import MergeSpec
from skillswarm.node.bootstrap import (
    DEFAULT_DOMAIN_WEIGHTS,
    MULTI_DOMAIN_COPY_STEPS,
    MULTI_DOMAIN_WARM_START_STEPS,
)
from skillswarm.node.config import NodeConfig
from skillswarm.node.pipeline import RLConfig
from skillswarm.protocol.tomlconfig import write_toml_config

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


DOMAINS: tuple[str, ...] = ("math", "code", "search")


@dataclass(frozen=True)
class DemoSettings:
    """How big a demo run is: the base's copy pretraining and warm start, RL steps per round,
    evaluation size."""

    warm_start_steps: int | None
    tokenizer_corpus_tasks: int | None
    steps: int
    tasks_per_step: int
    samples_per_task: int
    eval_tasks: int
    rounds: int
    candidates: tuple[MergeSpec, ...]
    copy_steps: int = 0
    domain_weights: dict[str, float] | None = None


def demo_settings(quick: bool, steps: int | None, eval_tasks: int | None) -> DemoSettings:
    """The full demo, on the base `skillswarm bootstrap` builds, or `--quick`: a briefly
    warm-started base (no copy pretraining) and a couple of RL steps, so the whole swarm runs its
    two rounds in a few minutes."""
    candidates = (
        MergeSpec(method="ties", parameters={"weight": 1.0, "density": 0.5}),
        MergeSpec(method="linear", parameters={"weight": 1.0}),
    )
    if quick:
        return DemoSettings(30, 200, steps or 2, 4, 4, eval_tasks or 6, 2, candidates)
    return DemoSettings(
        MULTI_DOMAIN_WARM_START_STEPS,
        None,
        steps or 10,
        8,
        4,
        eval_tasks or 32,
        2,
        candidates,
        copy_steps=MULTI_DOMAIN_COPY_STEPS,
        domain_weights=dict(DEFAULT_DOMAIN_WEIGHTS),
    )


def write_configs(
    workdir: Path,
    base: Path,
    n_nodes: int,
    train: RLConfig,
    eval_tasks: int,
    merge: MergeSpec | None = None,
    *,
    domains: tuple[str, ...] = ("math",),
    rounds: int = 1,
    candidates: tuple[MergeSpec, ...] = (),
) -> tuple[Path, list[Path], str]:
    """Coordinator and node TOML files for a loopback swarm; returns them and the HTTP URL.
    Node i trains `domains[i % len(domains)]`; a round merges once every domain and at least
    `n_nodes` deltas are in."""
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    spec = merge or MergeSpec()
    coordinator = CoordinatorConfig(
        work_dir=workdir / "coordinator",
        http_port=http_port,
        p2p_port=free_port(),
        base_checkpoint=base,
        round=RoundPolicy(min_deltas=n_nodes, required_domains=sorted(set(domains))),
        merge=MergePlan(**spec.model_dump(), candidates=list(candidates)),
        eval=EvalConfig(domains=list(dict.fromkeys(domains)), n_tasks=eval_tasks),
    )
    coordinator_toml = write_toml_config(coordinator, workdir / "coordinator.toml")
    node_tomls = []
    for i in range(n_nodes):
        node = NodeConfig(
            work_dir=workdir / f"node-{i}",
            domain=domains[i % len(domains)],
            coordinator_url=url,
            seed=i + 1,
            rounds=rounds,
            train=train,
            allow_weak_sandbox=True,  # a laptop may lack bubblewrap; the node warns at start
        )
        node_tomls.append(write_toml_config(node, workdir / f"node-{i}.toml"))
    return coordinator_toml, node_tomls, url


def run_demo(
    workdir: Path,
    *,
    quick: bool = False,
    steps: int | None = None,
    eval_tasks: int | None = None,
    console: Console | None = None,
    timeout: float = 3600.0,
) -> list[dict]:
    """Run a loopback swarm of three nodes (math, code, search) for two rounds and write the
    report; returns the rounds' records from the coordinator."""
    console = console or Console(stderr=True)
    settings = demo_settings(quick, steps, eval_tasks)
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    base = workdir / ("base-quick" if quick else "base")
    if not (base / "config.json").exists():
        from skillswarm.agent.model import build_threads
        from skillswarm.node.bootstrap import create_base_checkpoint

        options: dict = {"domains": DOMAINS, "num_threads": build_threads()}
        if settings.warm_start_steps is not None:
            options["warm_start_steps"] = settings.warm_start_steps
        if settings.tokenizer_corpus_tasks is not None:
            options["tokenizer_corpus_tasks"] = settings.tokenizer_corpus_tasks
        if settings.domain_weights is not None:
            options["domain_weights"] = settings.domain_weights
        with console.status("building the embedded base model (tokenizer, tiny Qwen2)") as status:

            def copied(step: int, accuracy: float) -> None:
                status.update(f"copy pretraining: step {step}, {accuracy:.1%} copied right")

            def warmed(step: int, loss: float) -> None:
                status.update(
                    f"warm start: step {step}/{settings.warm_start_steps}, loss {loss:.3f}"
                )

            create_base_checkpoint(
                base,
                copy_steps=settings.copy_steps,
                on_copy_check=copied,
                on_step=warmed,
                **options,
            )
    console.print(f"base checkpoint: {base}")
    for stale in [
        workdir / "coordinator",
        workdir / "pulled",
        workdir / "logs",
        workdir / "report",
        *workdir.glob("node-*"),
    ]:
        if stale.is_dir():  # a fresh swarm every run; only the base is reused
            shutil.rmtree(stale)
    train = RLConfig(
        steps=settings.steps,
        tasks_per_step=settings.tasks_per_step,
        samples_per_task=settings.samples_per_task,
    )
    coordinator_toml, node_tomls, url = write_configs(
        workdir,
        base,
        len(DOMAINS),
        train,
        settings.eval_tasks,
        MergeSpec(method="task_arithmetic", parameters={"weight": 1.0}),
        domains=DOMAINS,
        rounds=settings.rounds,
        candidates=settings.candidates,
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
        wait_http(url, coordinator, timeout=300)
        coordinator.status = "serving"
        for i, toml in enumerate(node_tomls):
            processes.append(
                spawn(
                    f"node-{i} ({DOMAINS[i]})",
                    ["node", "run", "--config", str(toml)],
                    logs / f"node-{i}.log",
                )
            )
        records = _follow_rounds(url, processes, console, settings.rounds, timeout)
        pulled = _pull_and_generate(url, workdir / "pulled", console)
        _wait_nodes_done(processes[1:], timeout=60)
    finally:
        stop_all(processes)
    from skillswarm.report import write_report

    report = write_report(
        workdir / "report",
        records,
        {f"node-{i}-{domain}": workdir / f"node-{i}" for i, domain in enumerate(DOMAINS)},
        {
            "pulled checkpoint": pulled,
            "registry": workdir / "coordinator" / "registry",
            "coordinator database": workdir / "coordinator" / "coordinator.db",
            "logs": logs,
            "base": base,
        },
        title="skillswarm demo" + (" (quick)" if quick else ""),
    )
    _print_summary(console, records, pulled, workdir, report)
    return records


def _follow_rounds(
    url: str, processes: list[Process], console: Console, rounds: int, timeout: float
) -> list[dict]:
    """Show live progress until round `rounds` is published; return the published rounds."""
    deadline = time.monotonic() + timeout
    with Live(_progress_table(processes, []), console=console, refresh_per_second=2) as live:
        while time.monotonic() < deadline:
            for p in processes[1:]:
                matches = STEP_LINE.findall(p.tail())
                if matches:
                    number, step, total, reward = matches[-1]
                    p.status = f"round {number}: training step {step}/{total}, reward {reward}"
                if p.popen.poll() is not None:
                    p.status = f"exited ({p.popen.returncode})"
            try:
                records = httpx.get(f"{url}/v1/rounds", timeout=5).json()
            except httpx.HTTPError:
                records = []
            live.update(_progress_table(processes, records))
            failed = [r for r in records if r["status"] == "failed"]
            if failed:
                raise DemoError(f"round {failed[0]['number']} failed: {failed[0]['error']}")
            published = sorted(
                (r for r in records if r["status"] == "published"), key=lambda r: r["number"]
            )
            if len(published) >= rounds:
                return published
            if processes[0].popen.poll() is not None:
                raise DemoError(f"the coordinator exited; see {processes[0].log}")
            crashed = [p for p in processes[1:] if p.popen.poll() not in (None, 0)]
            if crashed:
                raise DemoError(
                    f"{crashed[0].name} failed; see {crashed[0].log}:\n{crashed[0].tail()[-1500:]}"
                )
            time.sleep(0.5)
    raise DemoError(f"{rounds} rounds did not finish within {timeout:.0f}s")


def _progress_table(processes: list[Process], rounds: list[dict]) -> Table:
    table = Table(title="skillswarm demo: three nodes, two rounds")
    table.add_column("process")
    table.add_column("status")
    for p in processes:
        table.add_row(p.name, p.status)
    for record in sorted(rounds, key=lambda r: r["number"]):
        table.add_row(
            f"round {record['number']}", f"{record['status']}, {len(record['inputs'])} deltas"
        )
    return table


def _pull_and_generate(url: str, out: Path, console: Console) -> Path:
    """Pull the merged checkpoint as a user would and play one held-out episode with it."""
    from skillswarm.agent.envs import get_environment
    from skillswarm.agent.model import load_policy
    from skillswarm.agent.rollout import play_episodes
    from skillswarm.protocol.pull import pull

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


def _print_summary(
    console: Console, records: list[dict], pulled: Path, workdir: Path, report: Path
) -> None:
    from skillswarm.report import score_rows

    out = Console()
    for record in records:
        domains, rows = score_rows(record)
        table = Table(title=f"round {record['number']}: held-out success")
        table.add_column("model")
        for domain in domains:
            table.add_column(domain, justify="right")
        for label, cells in rows:
            table.add_row(label, *cells)
        out.print(table)
    out.print(f"latest checkpoint: {records[-1]['checkpoint_id']}")
    out.print(f"pulled to: {pulled}")
    out.print(f"report: {report}")
    out.print(f"logs: {workdir / 'logs'}")
