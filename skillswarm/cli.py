"""The `skillswarm` command: demo, node run, coordinator serve, config show, pull, bootstrap,
train, env list/try, serve-model, version."""

from __future__ import annotations

import logging
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import skillswarm

if TYPE_CHECKING:
    from pydantic import BaseModel

ConfigT = TypeVar("ConfigT", bound="BaseModel")

app = typer.Typer(
    help="Decentralized post-training of tool-using LLM agents.", no_args_is_help=True
)
node_app = typer.Typer(help="Run a training node.", no_args_is_help=True)
env_app = typer.Typer(help="List the skill environments and watch episodes.", no_args_is_help=True)
coordinator_app = typer.Typer(help="Run the merge coordinator service.", no_args_is_help=True)
config_app = typer.Typer(help="Show a resolved configuration.", no_args_is_help=True)
app.add_typer(node_app, name="node")
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(config_app, name="config")
app.add_typer(env_app, name="env")
console = Console(stderr=True)

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML file; defaults are used without one")
]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.learning_rate=0.01 (a TOML value; "
        "repeatable); over SKILLSWARM_* variables (SKILLSWARM_TRAIN__LEARNING_RATE=0.01), "
        "which are over the file",
    ),
]
TasksOption = Annotated[
    Path | None,
    typer.Option(
        "--tasks",
        help="the domain's tasks from a JSONL file (.jsonl or .jsonl.gz; HumanEval or MBPP "
        "records for code) instead of its generator",
    ),
]


def _config(model: type[ConfigT], config: Path | None, sets: list[str] | None) -> ConfigT:
    """The model from its defaults, the file, the SKILLSWARM_* variables and the --set's."""
    from skillswarm.protocol.tomlconfig import load_config

    return load_config(model, config, overrides=sets or ())


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
def node_run(config: ConfigOption = None, set_: SetOption = None, verbose: bool = False) -> None:
    """Train on one domain, publish deltas, rebase on merged checkpoints."""
    from skillswarm.node.config import NodeConfig
    from skillswarm.node.daemon import NodeError, run_node
    from skillswarm.protocol.tomlconfig import ConfigFileError

    _logging(verbose)
    try:
        cfg = _config(NodeConfig, config, set_)
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
def coordinator_serve(
    config: ConfigOption = None, set_: SetOption = None, verbose: bool = False
) -> None:
    """Serve the coordinator: delta intake over libp2p, merges, registry and API over HTTP."""
    from skillswarm.coordinator.app import serve
    from skillswarm.coordinator.config import CoordinatorConfig
    from skillswarm.coordinator.service import MissingBaseCheckpoint
    from skillswarm.protocol.tomlconfig import ConfigFileError

    _logging(verbose)
    try:
        cfg = _config(CoordinatorConfig, config, set_)
        serve(cfg)
    except (ConfigFileError, MissingBaseCheckpoint) as exc:
        _fail(exc)


class ConfigKind(StrEnum):
    node = "node"
    coordinator = "coordinator"


@config_app.command("show")
def config_show(
    kind: Annotated[ConfigKind, typer.Option(help="whose configuration")],
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Print the configuration a node or coordinator would run with, as TOML: the file, the
    SKILLSWARM_* variables and the --set's over the defaults (a node's RL settings over its
    domain's recipe)."""
    from skillswarm.coordinator.config import CoordinatorConfig
    from skillswarm.node.config import NodeConfig
    from skillswarm.protocol.tomlconfig import ConfigFileError, config_toml

    model: type[BaseModel] = NodeConfig if kind is ConfigKind.node else CoordinatorConfig
    try:
        cfg = _config(model, config, set_)
    except ConfigFileError as exc:
        _fail(exc)
        return
    typer.echo(config_toml(cfg), nl=False)


@app.command("pull")
def pull_command(
    url: Annotated[str, typer.Argument(help="coordinator URL, e.g. http://127.0.0.1:8470")],
    revision: Annotated[str, typer.Argument(help="'latest', 'main' or a checkpoint revision")],
    out: Annotated[Path, typer.Argument(help="folder to write the checkpoint into")],
    repo_id: str = "skillswarm/agent",
) -> None:
    """Download a checkpoint, verifying every file's sha256 and the checkpoint id."""
    from skillswarm.protocol.pull import pull

    try:
        path = pull(url, revision, out, repo_id=repo_id, progress=True)
    except Exception as exc:
        _fail(exc)
        return
    typer.echo(str(path))


@env_app.command("list")
def env_list() -> None:
    """The registered environments: domain, tools, turn limit, description."""
    from skillswarm.envview import environments_table

    Console().print(environments_table())


@env_app.command("try")
def env_try(
    domain: Annotated[str, typer.Argument(help="environment name, see `skillswarm env list`")],
    n: Annotated[int, typer.Option("--n", min=1, max=1000, help="episodes to play")] = 5,
    model: Annotated[
        Path | None, typer.Option(help="a Hugging Face model folder to play the episodes")
    ] = None,
    solver: Annotated[
        bool, typer.Option("--solver", help="play the environment's solver (the default)")
    ] = False,
    split: Annotated[str, typer.Option(help="train or heldout")] = "heldout",
    tasks: TasksOption = None,
    seed: int = 0,
    temperature: Annotated[float, typer.Option(min=0.01)] = 1.0,
    greedy: bool = False,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 256,
    families: Annotated[
        bool,
        typer.Option("--families", help="instead of the episodes, show success per task family"),
    ] = False,
) -> None:
    """Play N episodes of DOMAIN with a model (or the solver) and show them turn by turn, or
    with --families the success rate of each kind of task."""
    from skillswarm.agent.envs import TasksFileNotSupportedError, UnknownEnvironmentError
    from skillswarm.agent.envs.base import InvalidSplitError
    from skillswarm.agent.envs.taskfiles import TaskFileError
    from skillswarm.agent.model import CheckpointLoadError
    from skillswarm.envview import (
        families_table,
        play_for_viewing,
        print_episode,
        summary_table,
    )

    if solver and model is not None:
        _fail(ValueError("give either --model PATH or --solver, not both"))
    out = Console()
    try:
        episodes = play_for_viewing(
            domain,
            n,
            model_path=model,
            split=split,
            tasks_file=tasks,
            seed=seed,
            temperature=temperature,
            greedy=greedy,
            max_new_tokens=max_new_tokens,
        )
    except (
        UnknownEnvironmentError,
        InvalidSplitError,
        CheckpointLoadError,
        TaskFileError,
        TasksFileNotSupportedError,
    ) as exc:
        _fail(exc)
        return
    if families:
        out.print(families_table(episodes))
    else:
        for index, episode in enumerate(episodes):
            print_episode(out, index, episode)
    out.print(summary_table(episodes))


def parse_domain_weights(text: str, domains: list[str]) -> dict[str, float]:
    """`"math=1.9,search=20"` -> {"math": 1.9, "search": 20.0}; every name must be in `domains`."""
    weights: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            weight = float(value)  # "" (no "=") is a ValueError too
        except ValueError:
            weight = -1.0
        if not name or not 0 <= weight < float("inf"):  # NaN fails both comparisons
            raise typer.BadParameter(f"{item!r} is not DOMAIN=WEIGHT with a weight of 0 or more")
        if name not in domains:
            raise typer.BadParameter(f"{name!r} is not one of the domains: {', '.join(domains)}")
        weights[name] = weight
    if weights and not any(weights.get(domain, 1.0) > 0 for domain in domains):
        raise typer.BadParameter("at least one domain needs a weight above 0")
    return weights


@app.command()
def bootstrap(
    out: Annotated[Path, typer.Argument(help="folder for the base model")] = Path("runs/base"),
    steps: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="supervised warm-start steps",
            show_default="the recommended budget",
        ),
    ] = None,
    domains: Annotated[str, typer.Option(help="comma-separated domains")] = "math,code,search",
    weights: Annotated[
        str | None,
        typer.Option(
            help="each domain's share of the demonstrations, e.g. math=4,code=1,search=12 "
            "(unnamed: 1)",
            show_default="the recommended shares",
        ),
    ] = None,
    copy_steps: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="most copy-pretraining steps before the warm start, which stops once the model "
            "copies well; 0: none",
            show_default="the recommended budget",
        ),
    ] = None,
    copy_target: Annotated[
        float | None,
        typer.Option(
            min=0.01,
            max=1.0,
            help="share of a held-out batch's repeated tokens copied right (in the kind "
            "copied worse: whole-word tokens or the rest) at which copy pretraining stops",
            show_default="the recommended target",
        ),
    ] = None,
    copy_whole_words: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="share of the copied words that the tokenizer keeps as one token",
            show_default="the recommended share",
        ),
    ] = None,
    hidden_size: Annotated[
        int | None,
        typer.Option(
            min=4,
            help="the model's width, a multiple of its 4 attention heads",
            show_default="the shipped base's",
        ),
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option(
            min=1, help="the model's transformer layers", show_default="the shipped base's"
        ),
    ] = None,
    seed: int = 0,
    eval_tasks: Annotated[int, typer.Option(min=0, help="held-out tasks per domain; 0: skip")] = 64,
    threads: Annotated[
        int | None, typer.Option(min=1, help="torch threads (default: the cores, up to 4)")
    ] = None,
    prebuilt: Annotated[
        bool,
        typer.Option(
            "--prebuilt",
            help="copy the base shipped in the package (built with the recommended settings) "
            "instead of building one",
        ),
    ] = False,
) -> None:
    """Build the embedded base: tiny model and tokenizer, copy-pretrained, then warm-started on
    solver demonstrations; or, with --prebuilt, copy the one shipped in the package."""
    if prebuilt:
        import shutil

        from skillswarm.node.bootstrap import EmbeddedBaseMissing, embedded_base

        try:
            source = embedded_base()
        except EmbeddedBaseMissing as exc:
            _fail(exc)
        if out.exists() and any(out.iterdir()):
            _fail(FileExistsError(f"{out} is not empty; choose an empty or new folder"))
        shutil.copytree(source, out, dirs_exist_ok=True)
        console.print(f"copied the prebuilt base (how it was built: {out}/skillswarm_base.json)")
        typer.echo(str(out))
        return
    from skillswarm.agent.envs import UnknownEnvironmentError
    from skillswarm.agent.evaluate import evaluate_checkpoint
    from skillswarm.agent.model import build_threads
    from skillswarm.node.bootstrap import (
        DEFAULT_DOMAIN_WEIGHTS,
        DEFAULT_HIDDEN_SIZE,
        DEFAULT_LAYERS,
        MULTI_DOMAIN_COPY_STEPS,
        MULTI_DOMAIN_WARM_START_STEPS,
        check_model_size,
        create_base_checkpoint,
    )
    from skillswarm.node.pretrain import COPY_TARGET_ACCURACY, WHOLE_WORD_SHARE

    chosen = [domain.strip() for domain in domains.split(",") if domain.strip()]
    if weights is None:
        shares = {d: w for d, w in DEFAULT_DOMAIN_WEIGHTS.items() if d in chosen}
    else:
        shares = parse_domain_weights(weights, chosen)
    if steps is None:
        steps = MULTI_DOMAIN_WARM_START_STEPS
    if copy_steps is None:
        copy_steps = MULTI_DOMAIN_COPY_STEPS
    if copy_target is None:
        copy_target = COPY_TARGET_ACCURACY
    if copy_whole_words is None:
        copy_whole_words = WHOLE_WORD_SHARE
    if hidden_size is None:
        hidden_size = DEFAULT_HIDDEN_SIZE
    if layers is None:
        layers = DEFAULT_LAYERS
    try:
        check_model_size(hidden_size, layers)
    except ValueError as exc:
        _fail(exc)
    try:
        described = ", ".join(f"{d} ×{shares.get(d, 1.0):g}" for d in chosen)
        console.print(
            f"building the base on {described} (copy pretraining until {copy_target:.0%} "
            f"of a held-out batch's whole words and of the rest are copied right, at most "
            f"{copy_steps} steps; then {steps} "
            "warm-start steps)…"
        )
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        ) as progress:
            copying = progress.add_task("copy pretraining", total=copy_steps, status="")
            bar = progress.add_task("warm start", total=steps, status="", start=False)

            def copy_checked(step: int, accuracy: float) -> None:
                progress.update(copying, completed=step, status=f"copied {accuracy:.1%}")

            def warm_step(step: int, loss: float) -> None:
                if step == 1:
                    progress.update(copying, total=progress.tasks[copying].completed)
                    progress.start_task(bar)
                progress.update(bar, completed=step, status=f"loss {loss:.3f}")

            path = create_base_checkpoint(
                out,
                seed=seed,
                warm_start_steps=steps,
                domains=chosen,
                num_threads=threads or build_threads(),
                domain_weights=shares,
                on_step=warm_step,
                copy_steps=copy_steps,
                on_copy_check=copy_checked,
                copy_target=copy_target,
                copy_whole_word_share=copy_whole_words,
                hidden_size=hidden_size,
                layers=layers,
            )
    except UnknownEnvironmentError as exc:
        _fail(exc)
        return
    for domain in chosen if eval_tasks else []:
        result = evaluate_checkpoint(path, domain, n_tasks=eval_tasks)
        typer.echo(
            f"{domain}: held-out success {result.success_rate:.1%} "
            f"(mean reward {result.mean_reward:.3f}, n={result.n}, greedy)"
        )
    typer.echo(str(path))


@app.command()
def train(
    base: Annotated[Path, typer.Option(help="model folder to start from")],
    domain: Annotated[str, typer.Option(help="environment to train on")] = "math",
    out: Annotated[Path, typer.Option(help="run folder; an existing run there is resumed")] = Path(
        "runs/train"
    ),
    config: ConfigOption = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="override an RL setting, e.g. --set learning_rate=0.01 (a TOML value; "
            "repeatable); over SKILLSWARM_TRAIN__* variables, which are over the file",
        ),
    ] = None,
    tasks: TasksOption = None,
    steps: Annotated[int | None, typer.Option(min=1)] = None,
    max_staleness: Annotated[int | None, typer.Option(min=0)] = None,
    checkpoint_every: Annotated[int | None, typer.Option(min=0)] = None,
    eval_tasks: Annotated[int, typer.Option(min=0, help="held-out tasks before/after")] = 128,
    torch_threads: Annotated[int, typer.Option(min=1)] = 1,
    verbose: bool = False,
) -> None:
    """RL on one domain with the asynchronous trainer; resumable, with metrics and curves."""
    from skillswarm.agent.envs import UnknownEnvironmentError
    from skillswarm.agent.model import CheckpointLoadError
    from skillswarm.node.pipeline import RLConfig
    from skillswarm.node.recipes import DOMAIN_RECIPES
    from skillswarm.node.runner import run_training
    from skillswarm.protocol.tomlconfig import (
        ENV_NESTING,
        ENV_PREFIX,
        ConfigFileError,
        read_toml_table,
        resolve_config,
    )

    _logging(verbose)
    try:
        if config:
            table, source = read_toml_table(config), str(config)
        else:  # the domain's recommended settings (node/recipes.py), checkpointing every step
            recipe = DOMAIN_RECIPES.get(domain, RLConfig())
            table = {**recipe.model_dump(), "checkpoint_every": 1}
            source = f"the {domain} recipe"
        # The variables a node's [train] reads, SKILLSWARM_TRAIN__…, count here too.
        rl = resolve_config(
            RLConfig,
            table,
            source=source,
            overrides=set_ or (),
            env_prefix=f"{ENV_PREFIX}TRAIN{ENV_NESTING}",
        )
        overrides = {
            key: value
            for key, value in (
                ("steps", steps),
                ("max_staleness", max_staleness),
                ("checkpoint_every", checkpoint_every),
            )
            if value is not None
        }
        rl = RLConfig.model_validate({**rl.model_dump(), **overrides})
        outcome = run_training(
            base,
            domain,
            out,
            rl,
            eval_tasks=eval_tasks,
            torch_threads=torch_threads,
            tasks_file=tasks,
        )
    except (ConfigFileError, UnknownEnvironmentError, CheckpointLoadError, ValueError) as exc:
        _fail(exc)
        return
    if outcome.stopped_early:
        typer.echo(f"stopped after step {outcome.steps_done}; run again to resume")
        raise typer.Exit(0)
    if outcome.before and outcome.after:
        typer.echo(
            f"{domain}: held-out success {outcome.before.success_rate:.1%} -> "
            f"{outcome.after.success_rate:.1%} ({outcome.steps_done} steps, "
            f"{outcome.seconds:.0f} s)"
        )
    typer.echo(str(outcome.out_dir))


@app.command("serve-model")
def serve_model(
    model: Annotated[Path, typer.Argument(help="a Hugging Face model folder")],
    host: str = "127.0.0.1",
    port: int = 8001,
    api_key_env: Annotated[
        str | None, typer.Option(help="environment variable holding the bearer token to require")
    ] = None,
) -> None:
    """Serve a local model over an OpenAI-compatible API (for sub-agent tools and judges)."""
    import os

    from skillswarm.agent.openai_server import serve

    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        _fail(ValueError(f"environment variable {api_key_env} is not set"))
    serve(model, host=host, port=port, api_key=api_key)


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="run folder")] = Path("runs/demo"),
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="two rounds of 2 RL steps, no imitation: shows the machinery, not learning",
        ),
    ] = False,
    steps: Annotated[
        int | None,
        typer.Option(
            min=1, help="RL steps per node per round", show_default="each domain's recipe"
        ),
    ] = None,
    eval_tasks: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="held-out tasks per domain per evaluation",
            show_default="128; with --quick, 6",
        ),
    ] = None,
) -> None:
    """Coordinator + three nodes (math, code, search) on 127.0.0.1, three rounds from the
    embedded base, CPU only; prints the published model's held-out success per round with 95%
    intervals and writes an HTML report (success per round, scores, verdicts, reward curves)."""
    from skillswarm.demo import DemoError, run_demo

    try:
        run_demo(workdir, quick=quick, steps=steps, eval_tasks=eval_tasks, console=console)
    except DemoError as exc:
        _fail(exc)


if __name__ == "__main__":
    app()
