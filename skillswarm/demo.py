"""`skillswarm demo`: a coordinator and three training nodes (math, code, search) as separate
processes on 127.0.0.1, round after round from the embedded base shipped in the package.

Starts the coordinator and the nodes, shows their progress, pulls the latest checkpoint like any
user would, plays a held-out episode with it, prints the published model's held-out success per
round beside the base with 95% intervals, and writes a report (HTML, a plot of success per round,
reward curves) into the run folder.
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
from skillswarm.node.bootstrap import embedded_base
from skillswarm.node.config import NodeConfig
from skillswarm.node.imitation import ImitationConfig
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
    """How big a demo run is: rounds, RL steps per node per round (None: each domain's recipe),
    held-out tasks per domain, the coordinator's merge plan (None: its default), and whether the
    nodes take their recipes' imitation steps before RL (`node.imitation`)."""

    rounds: int
    steps: int | None
    eval_tasks: int
    merge: MergePlan | None = None
    imitation: bool = True

    def train(self) -> RLConfig | None:
        """The [train] fields every node sets over its recipe (None: the recipe as it is)."""
        fields: dict[str, object] = {}
        if self.steps is not None:
            fields["steps"] = self.steps
        if not self.imitation:
            fields["imitation"] = ImitationConfig(steps=0)
        return RLConfig(**fields) if fields else None


# The full demo: rounds of each domain's recipe (about a minute of training a round on 2 cores)
# and 128 held-out tasks per domain, in about a quarter of an hour on 2 cores.
FULL_ROUNDS = 3
FULL_EVAL_TASKS = 128


def demo_settings(quick: bool, steps: int | None, eval_tasks: int | None) -> DemoSettings:
    """The full demo, which shows the published model learning round after round, or `--quick`:
    two rounds of two RL steps per node without imitation and a few evaluation tasks, which
    shows the machinery (training, deltas over libp2p, merging, evaluation, publication) and not
    learning."""
    if quick:
        return DemoSettings(2, steps or 2, eval_tasks or 6, imitation=False)
    return DemoSettings(FULL_ROUNDS, steps, eval_tasks or FULL_EVAL_TASKS)


def write_configs(
    workdir: Path,
    base: Path,
    n_nodes: int,
    train: RLConfig | None,
    eval_tasks: int,
    merge: MergeSpec | None = None,
    *,
    domains: tuple[str, ...] = ("math",),
    rounds: int = 1,
    candidates: tuple[MergeSpec, ...] = (),
) -> tuple[Path, list[Path], str]:
    """Coordinator and node TOML files for a loopback swarm; returns them and the HTTP URL.
    Node i trains `domains[i % len(domains)]` with its domain's recipe, `train`'s set fields
    laid over it; a round merges once every domain and at least `n_nodes` deltas are in. With
    neither `merge` nor `candidates`, the coordinator's default merge plan."""
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    fields: dict = {}
    if merge is not None or candidates:
        spec = merge or MergeSpec()
        fields["merge"] = MergePlan(**spec.model_dump(), candidates=list(candidates))
    coordinator = CoordinatorConfig(
        work_dir=workdir / "coordinator",
        http_port=http_port,
        p2p_port=free_port(),
        base_checkpoint=base,
        round=RoundPolicy(min_deltas=n_nodes, required_domains=sorted(set(domains))),
        eval=EvalConfig(domains=list(dict.fromkeys(domains)), n_tasks=eval_tasks, experts="own"),
        **fields,
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
            allow_weak_sandbox=True,  # a laptop may lack bubblewrap; the node warns at start
            **({} if train is None else {"train": train}),
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
    """Run a loopback swarm of three nodes (math, code, search) for the settings' rounds and
    write the report; returns the rounds' records from the coordinator."""
    console = console or Console(stderr=True)
    settings = demo_settings(quick, steps, eval_tasks)
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    base = embedded_base()
    console.print(f"base checkpoint: {base} (the embedded base shipped in the package)")
    if quick:
        console.print(
            "[bold]--quick[/bold] shows the machinery (training, deltas over libp2p, merging, "
            "evaluation, publication) with two RL steps a round: it does not show learning"
        )
    for stale in [
        workdir / "coordinator",
        workdir / "pulled",
        workdir / "logs",
        workdir / "report",
        *workdir.glob("node-*"),
    ]:
        if stale.is_dir():  # a fresh swarm every run
            shutil.rmtree(stale)
    coordinator_toml, node_tomls, url = write_configs(
        workdir,
        base,
        len(DOMAINS),
        settings.train(),
        settings.eval_tasks,
        domains=DOMAINS,
        rounds=settings.rounds,
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
    """Show live progress until `rounds` rounds are closed (published, or held by the
    no-regression rule); return those rounds."""
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
            closed = sorted(
                (r for r in records if r["status"] in ("published", "held")),
                key=lambda r: r["number"],
            )
            if len(closed) >= rounds:
                return closed
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
    table = Table(title="skillswarm demo: three nodes")
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


def _cell(row: dict | None) -> str:
    if not row or row.get("success_rate") is None:
        return "–"
    text = f"{100 * row['success_rate']:.1f}%"
    if row.get("success_low") is not None:
        text += f" [{100 * row['success_low']:.0f}–{100 * row['success_high']:.0f}]"
    return text


def progress_rows(records: list[dict]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(domains, rows): the first round's base, then the model in service after each round (the
    round's merged candidate when published, the previous model when held), each cell the
    held-out success with its 95% interval; then the paired difference of the last published
    model with that base on the same tasks."""
    from skillswarm.agent.stats import paired_difference

    ordered = sorted(records, key=lambda r: r["number"])
    if not ordered or not (ordered[0].get("evaluation") or {}).get("base"):
        return [], []
    base = ordered[0]["evaluation"]["base"]
    domains = sorted(base)
    rows = [("base", [_cell(base.get(d)) for d in domains])]
    current = base
    for record in ordered:
        held = record["status"] != "published"
        if not held:
            current = (record.get("evaluation") or {}).get("merged") or current
        label = f"after round {record['number']}" + (" (held: base kept)" if held else "")
        rows.append((label, [_cell(current.get(d)) for d in domains]))
    cells = []
    for d in domains:
        a, b = base.get(d) or {}, current.get(d) or {}
        if a.get("successes") and b.get("successes") and a.get("task_ids") == b.get("task_ids"):
            diff = paired_difference(a["successes"], b["successes"])
            cells.append(f"{100 * diff.mean:+.1f} [{100 * diff.low:+.1f}, {100 * diff.high:+.1f}]")
        else:
            cells.append("–")
    rows.append(("published − base (points, paired 95%)", cells))
    return domains, rows


def _print_summary(
    console: Console, records: list[dict], pulled: Path, workdir: Path, report: Path
) -> None:
    out = Console()
    domains, rows = progress_rows(records)
    table = Table(title="held-out success of the published model, round after round (95% CI)")
    table.add_column("model")
    for domain in domains:
        table.add_column(domain, justify="right")
    for label, cells in rows:
        table.add_row(label, *cells)
    out.print(table)
    for record in records:
        if record["status"] == "held":
            out.print(
                f"round {record['number']} held: {(record.get('decision') or {}).get('reason')}"
            )
    published = [r for r in records if r.get("checkpoint_id")]
    if published:
        out.print(f"latest checkpoint: {published[-1]['checkpoint_id']}")
    out.print(f"pulled to: {pulled}")
    out.print(f"report: {report}")
    out.print(f"logs: {workdir / 'logs'}")
