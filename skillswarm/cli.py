"""The `skillswarm` command: demo, node run, coordinator serve, pull, version."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

import skillswarm

app = typer.Typer(
    help="Decentralized post-training of tool-using LLM agents.", no_args_is_help=True
)
node_app = typer.Typer(help="Run a training node.", no_args_is_help=True)
coordinator_app = typer.Typer(help="Run the merge coordinator service.", no_args_is_help=True)
app.add_typer(node_app, name="node")
app.add_typer(coordinator_app, name="coordinator")
console = Console(stderr=True)

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML file; defaults are used without one")
]


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("libp2p", "multiaddr", "httpx", "trio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
    raise typer.Exit(1) from exc


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(f"skillswarm {skillswarm.__version__}")


@node_app.command("run")
def node_run(config: ConfigOption = None, verbose: bool = False) -> None:
    """Train on one domain, publish deltas, rebase on merged checkpoints."""
    from node.config import NodeConfig
    from node.daemon import NodeError, run_node
    from protocol.tomlconfig import ConfigFileError, load_toml_config

    _logging(verbose)
    try:
        cfg = load_toml_config(config, NodeConfig) if config else NodeConfig()
        results = run_node(cfg)
    except (ConfigFileError, NodeError) as exc:
        _fail(exc)
        return
    for r in results:
        typer.echo(
            f"round {r.round}: delta {r.delta_id[:12]} {r.status}; "
            f"next base {(r.next_base_id or '-')[:12]}"
        )


@coordinator_app.command("serve")
def coordinator_serve(config: ConfigOption = None, verbose: bool = False) -> None:
    """Serve the coordinator: delta intake over libp2p, merges, registry and API over HTTP."""
    from coordinator.app import serve
    from coordinator.config import CoordinatorConfig
    from protocol.tomlconfig import ConfigFileError, load_toml_config

    _logging(verbose)
    try:
        cfg = load_toml_config(config, CoordinatorConfig) if config else CoordinatorConfig()
    except ConfigFileError as exc:
        _fail(exc)
        return
    serve(cfg)


@app.command("pull")
def pull_command(
    url: Annotated[str, typer.Argument(help="coordinator URL, e.g. http://127.0.0.1:8470")],
    revision: Annotated[str, typer.Argument(help="'latest', 'main' or a checkpoint revision")],
    out: Annotated[Path, typer.Argument(help="folder to write the checkpoint into")],
    repo_id: str = "skillswarm/agent",
) -> None:
    """Download a checkpoint, verifying every file's sha256 and the checkpoint id."""
    from protocol.pull import pull

    try:
        path = pull(url, revision, out, repo_id=repo_id, progress=True)
    except Exception as exc:
        _fail(exc)
        return
    typer.echo(str(path))


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="run folder")] = Path("runs/demo"),
    nodes: Annotated[int, typer.Option(min=1, max=4, help="math nodes")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="RL steps per node")] = 6,
    eval_tasks: Annotated[int, typer.Option(min=1, help="held-out tasks per evaluation")] = 64,
) -> None:
    """Coordinator + nodes as processes on 127.0.0.1, one round, CPU only."""
    from skillswarm.demo import DemoError, run_demo

    try:
        run_demo(workdir, n_nodes=nodes, steps=steps, eval_tasks=eval_tasks, console=console)
    except DemoError as exc:
        _fail(exc)


if __name__ == "__main__":
    app()
