"""Experiment tracking: each backend writes a real run (TensorBoard event files, an offline W&B
run, trackio's SQLite database) that reads back with the logged values; a node's steps and the
coordinator's rounds reach it; a missing package or an unknown tool-call format is a clear config
error; a failing backend never stops training; no [tracking] table, no tracking."""

from __future__ import annotations

import importlib.util
import json
import logging
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from delta_helpers import current_base_tensors, hand_in_delta, noisy
from skillswarm.agent.envs import get_environment
from skillswarm.agent.model import load_policy
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, MergePlan, RoundPolicy
from skillswarm.coordinator.rounds import round_scores
from skillswarm.coordinator.service import Coordinator
from skillswarm.merge.methods import MergeSpec
from skillswarm.node.config import NodeConfig
from skillswarm.node.daemon import NodeDaemon
from skillswarm.node.metrics import (
    EPISODE_COLUMNS,
    StepTracker,
    episode_rows,
    open_node_tracker,
    read_metrics,
)
from skillswarm.node.pipeline import AsyncRLRun, RLConfig
from skillswarm.protocol.identity import load_or_create_identity
from skillswarm.protocol.tomlconfig import ConfigFileError, load_toml_config

from skillswarm.tracking import (
    TrackingBackendMissing,
    TrackingConfig,
    markdown_table,
    open_tracker,
)

BASE_ID = "b" * 64
SMALL_TRAIN = {"steps": 2, "tasks_per_step": 1, "samples_per_task": 2, "max_new_tokens": 8}


# -- readers of what the backends wrote ------------------------------------------------------


def tensorboard_run(folder: Path) -> Any:
    """TensorBoard's own reader over one run's event files, everything loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(run: Any, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in run.Scalars(tag)]


def texts(run: Any, tag: str) -> list[tuple[int, str]]:
    return [
        (event.step, event.tensor_proto.string_val[0].decode())
        for event in run.Tensors(f"{tag}/text_summary")
    ]


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (`run-ID.wandb`): a 7-byte header, then LevelDB-style
    log records (checksum, length, type: full, or first/middle/last pieces) in 32 KiB blocks.
    The file may still be growing: the records written in full so far."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", "not a W&B run file"
    records, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        if kind == 0 or position + 7 + length > len(data):
            break  # the service is still writing this record: read up to it
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_wandb_records(folder: Path, timeout: float = 30.0) -> list[Any]:
    """The records of the one W&B run under `folder`, once its file ends with the run's exit
    record (W&B's service may still be writing it when `finish()` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        files = list(folder.glob("offline-run-*/run-*.wandb"))
        records = wandb_records(files[0]) if len(files) == 1 else []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"no finished W&B run file under {folder}: {files}")
        time.sleep(0.1)


def wandb_history(records: list[Any]) -> dict[int, dict[str, Any]]:
    """step -> {key: value} of a W&B run's history rows."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {
            "/".join(item.nested_key) or item.key: json.loads(item.value_json)
            for item in record.history.item
        }
        rows[int(row["_step"])] = row
    return rows


# -- each backend, real files ----------------------------------------------------------------


def test_tensorboard_event_files_hold_the_scalars_the_table_and_the_settings(
    tmp_path: Path,
) -> None:
    config = TrackingConfig(backend="tensorboard", dir=tmp_path / "tb")
    with open_tracker(
        config, run_name="math-node-1", default_dir=tmp_path / "unused", run_config={"lr": 0.5}
    ) as tracker:
        tracker.log({"reward_mean": 0.25, "loss": 1.5, "skipped": False}, step=0)
        tracker.log({"reward_mean": 0.75, "nan": float("nan"), "text": "not a number"}, step=1)
        tracker.log_table("episodes", ["task", "reward"], [["t|1", 1.0], ["two\nlines", 0.0]], 1)
    assert not (tmp_path / "unused").exists()
    run = tensorboard_run(tmp_path / "tb" / "math-node-1")
    assert scalars(run, "reward_mean") == [(0, 0.25), (1, 0.75)]
    assert scalars(run, "loss") == [(0, 1.5)]
    assert scalars(run, "skipped") == [(0, 0.0)]
    assert "nan" not in run.Tags()["scalars"] and "text" not in run.Tags()["scalars"]
    ((step, table),) = texts(run, "episodes")
    assert step == 1
    assert table == "| task | reward |\n|---|---|\n| t\\|1 | 1 |\n| two<br>lines | 0 |"
    ((_, settings),) = texts(run, "config")
    assert json.loads(settings.replace("\n    ", "\n")) == {"lr": 0.5}


def test_markdown_table_escapes_cells() -> None:
    assert markdown_table(["a"], [["x|y\\z"]]) == "| a |\n|---|\n| x\\|y\\\\z |"


def test_an_offline_wandb_run_holds_the_history_the_settings_and_the_table(
    tmp_path: Path,
) -> None:
    config = TrackingConfig(backend="wandb", project="swarm-test", dir=tmp_path / "wb")
    assert config.mode == "offline"
    tracker = open_tracker(
        config, run_name="coordinator", default_dir=tmp_path, run_config={"domain": "math"}
    )
    tracker.log({"reward_mean": 0.5, "loss": 1.25}, step=3)
    tracker.log({"reward_mean": 0.75}, step=4)
    tracker.log_table("episodes", ["prompt", "reward"], [["What is 2+2?", 1.0]], step=4)
    tracker.close()
    assert tracker.failures == 0
    records = finished_wandb_records(tmp_path / "wb" / "wandb")
    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("swarm-test", "coordinator")
    settings = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert settings["domain"] == "math"
    history = wandb_history(records)
    assert history[3]["reward_mean"] == 0.5 and history[3]["loss"] == 1.25
    assert history[4]["reward_mean"] == 0.75
    assert history[4]["episodes/_type"] == "table-file"
    (table_file,) = (run_dir / "files" / "media" / "table").glob("episodes_4_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "reward"]
    assert table["data"] == [["What is 2+2?", 1.0]]


def test_trackio_keeps_the_run_in_its_local_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio is not installed (pip install 'skillswarm[tracking]')")
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported earlier in this process; its folder is fixed")
    monkeypatch.setenv("TRACKIO_DIR", "")  # restored after the test; the tracker sets it
    config = TrackingConfig(dir=tmp_path / "trackio")
    assert config.backend == "trackio"
    tracker = open_tracker(config, run_name="code-node-7", default_dir=tmp_path)
    tracker.log({"reward_mean": 0.5, "success_rate": 0.25}, step=1)
    tracker.log_table("episodes", ["task", "reward"], [["t1", 1.0], ["t2", 0.0]], step=1)
    tracker.close()
    assert tracker.failures == 0
    database = tmp_path / "trackio" / "skillswarm.db"
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT run_name, step, metrics FROM metrics").fetchall()
    logged = [(name, step, json.loads(metrics)) for name, step, metrics in rows]
    assert ("code-node-7", 1, {"reward_mean": 0.5, "success_rate": 0.25}) in logged
    (table,) = [m["episodes"] for _, _, m in logged if "episodes" in m]
    assert table["_type"] == "trackio.table"
    assert table["_value"] == [{"task": "t1", "reward": 1.0}, {"task": "t2", "reward": 0.0}]


# -- failures and configuration --------------------------------------------------------------


def test_a_failing_backend_is_one_warning_and_never_an_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    config = TrackingConfig(backend="wandb", dir=tmp_path)
    tracker = open_tracker(config, run_name="math-node-x", default_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="skillswarm.tracking"):
        tracker.log_table("episodes", ["task"], [["t1", "an extra cell"]], step=0)  # refused
        tracker.log({"reward_mean": 0.5}, step=1)  # the run goes on
        tracker.log({"reward_mean": 0.75}, step=2)
        wandb.teardown()  # W&B's service is gone: every later call fails inside wandb
        tracker.log({"reward_mean": 1.0}, step=3)
        tracker.log_table("episodes", ["task"], [["t1"]], step=3)
        tracker.close()
        tracker.log({"reward_mean": 1.0}, step=4)  # closed: nothing happens
    assert tracker.failures == 4
    (warning,) = [r for r in caplog.records if r.name == "skillswarm.tracking"]
    assert warning.levelno == logging.WARNING
    assert "wandb tracking of math-node-x failed in log_table" in warning.getMessage()
    assert "This table expects 1 columns" in warning.getMessage()
    history = wandb_history(finished_wandb_records(tmp_path / "wandb"))
    assert history[1]["reward_mean"] == 0.5 and history[2]["reward_mean"] == 0.75


def test_a_backend_whose_package_is_missing_is_a_config_error_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"pip install 'skillswarm\[wandb\]'"):
        TrackingConfig(backend="wandb")
    node_toml = tmp_path / "node.toml"
    node_toml.write_text('domain = "math"\n\n[tracking]\nbackend = "wandb"\n')
    with pytest.raises(ConfigFileError, match=r"tracking: .*needs the wandb package"):
        load_toml_config(node_toml, NodeConfig)
    with pytest.raises(TrackingBackendMissing, match=r"skillswarm\[wandb\]"):
        open_tracker(
            TrackingConfig.model_construct(backend="wandb"), run_name="r", default_dir=tmp_path
        )
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ValueError, match=r"pip install 'skillswarm\[tensorboard\]'"):
        TrackingConfig(backend="tensorboard")


def test_the_tracking_table_of_a_node_and_a_coordinator_toml(tmp_path: Path) -> None:
    node_toml = tmp_path / "node.toml"
    node_toml.write_text(
        'domain = "code"\nwork_dir = "n"\n\n[tracking]\nbackend = "tensorboard"\n'
        'project = "sweep"\nrun_name = "code-a"\ndir = "tb"\ntable_every = 5\ntable_rows = 2\n'
    )
    node = load_toml_config(node_toml, NodeConfig)
    assert node.tracking == TrackingConfig(
        backend="tensorboard",
        project="sweep",
        run_name="code-a",
        dir=Path("tb"),
        table_every=5,
        table_rows=2,
    )
    coordinator_toml = tmp_path / "coordinator.toml"
    coordinator_toml.write_text('[tracking]\nbackend = "wandb"\nmode = "online"\n')
    coordinator = load_toml_config(coordinator_toml, CoordinatorConfig)
    assert coordinator.tracking is not None
    assert (coordinator.tracking.backend, coordinator.tracking.mode) == ("wandb", "online")
    assert coordinator.tracking.project == "skillswarm" and coordinator.tracking.dir is None
    bad = tmp_path / "bad.toml"
    bad.write_text('[tracking]\nbackend = "mlflow"\n')
    with pytest.raises(ConfigFileError, match="tracking.backend"):
        load_toml_config(bad, CoordinatorConfig)
    bad.write_text('[tracking]\nbackend = "tensorboard"\nflush = true\n')
    with pytest.raises(ConfigFileError, match="tracking.flush"):
        load_toml_config(bad, NodeConfig)


def test_without_a_tracking_table_nothing_is_tracked(tmp_path: Path) -> None:
    node_toml = tmp_path / "node.toml"
    node_toml.write_text(f'work_dir = "{tmp_path / "node"}"\n')
    node = load_toml_config(node_toml, NodeConfig)
    assert node.tracking is None
    unset = {"domain": "math", "peer_id": "12D3KooWabcdefgh", "work_dir": node.work_dir}
    assert open_node_tracker(node.tracking, **unset, run_config={}) is None
    coordinator_toml = tmp_path / "coordinator.toml"
    coordinator_toml.write_text(f'work_dir = "{tmp_path / "coord"}"\np2p_port = 0\n')
    coordinator = Coordinator(load_toml_config(coordinator_toml, CoordinatorConfig))
    try:
        assert coordinator.tracker is None and coordinator.rounds.tracker is None
    finally:
        coordinator.store.close()
    assert not (tmp_path / "node" / "tracking").exists()
    assert not (tmp_path / "coord" / "tracking").exists()


def test_a_node_config_names_its_tool_call_format_or_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('tool_call_format = "llama3.1"\n')
    assert load_toml_config(path, NodeConfig).tool_call_format == "llama3.1"
    assert NodeConfig().tool_call_format is None
    path.write_text('tool_call_format = "llama3"\n')
    with pytest.raises(ConfigFileError) as refused:
        load_toml_config(path, NodeConfig)
    message = str(refused.value)
    assert "tool_call_format" in message and "unknown tool-call format 'llama3'" in message
    assert "hermes, qwen3, llama3.1, response_template" in message


# -- the node and the coordinator ------------------------------------------------------------


def test_the_rollouts_read_tool_calls_in_the_configured_format(tiny_base: Path) -> None:
    model, tokenizer = load_policy(tiny_base)
    env = get_environment("math")
    config = RLConfig.model_validate(SMALL_TRAIN)
    default = AsyncRLRun(model, tokenizer, env, config).rollout_engine()
    assert default.tool_call_parser.format == "hermes"  # what the embedded template teaches
    chosen = AsyncRLRun(model, tokenizer, env, config, tool_call_format="llama3.1")
    parser = chosen.rollout_engine().tool_call_parser
    assert parser.format == "llama3.1"
    (call,) = parser.parse('<|python_tag|>{"name": "calculator", "parameters": {"x": "1+1"}}')
    assert (call.name, call.arguments, call.parse_error) == ("calculator", {"x": "1+1"}, None)


def test_sample_episode_rows_are_cut_to_size(tiny_base: Path) -> None:
    model, tokenizer = load_policy(tiny_base)
    env = get_environment("math")
    config = RLConfig.model_validate(SMALL_TRAIN)
    engine = AsyncRLRun(model, tokenizer, env, config).rollout_engine()
    tasks = env.tasks("train", 1, seed=0)
    episodes = engine.play(tasks, samples_per_task=2, seed=0)
    (row,) = episode_rows(episodes, limit=1, max_chars=24)
    task, prompt, completion, reward, success, turns, tool_calls, finish = row
    assert task == tasks[0].id
    assert len(tasks[0].prompt) > 24 and prompt == tasks[0].prompt[:23] + "…"
    assert completion.startswith("[assistant] ") and len(completion) <= 24
    assert (reward, success, turns) == (episodes[0].reward, episodes[0].success, 1)
    assert (tool_calls, finish) == (episodes[0].num_tool_calls, episodes[0].finish_reason)
    assert len(episode_rows(episodes, limit=4)) == 2


def test_a_node_logs_each_steps_metrics_and_sample_episodes(
    tmp_path: Path, tiny_base: Path
) -> None:
    config = NodeConfig(
        work_dir=tmp_path,
        train=SMALL_TRAIN,
        checkpoint_every=0,
        tracking={"backend": "tensorboard", "table_rows": 2, "max_chars": 40},
    )
    daemon = NodeDaemon(config)
    daemon.client.close()
    daemon._tracker = open_node_tracker(  # as `run()` opens it
        config.tracking,
        domain=config.domain,
        peer_id=daemon.peer_id,
        work_dir=config.work_dir,
        run_config=config.model_dump(mode="json"),
    )
    assert isinstance(daemon._tracker, StepTracker)
    assert daemon._train(3, BASE_ID, tiny_base) is not None
    daemon._tracker.close()
    name = f"math-node-{daemon.peer_id[-8:]}"
    run = tensorboard_run(tmp_path / "tracking" / name)
    logged = read_metrics(tmp_path / "metrics" / "round-3.jsonl")
    # Round 3's steps 0 and 1 are the run's steps 4 and 5 (two steps a round).
    rewards = scalars(run, "reward_mean")
    assert [step for step, _ in rewards] == [4, 5]
    assert [value for _, value in rewards] == pytest.approx([r["reward_mean"] for r in logged])
    assert scalars(run, "round") == [(4, 3.0), (5, 3.0)]
    assert scalars(run, "policy_version") == [(4, 1.0), (5, 2.0)]
    tables = texts(run, "episodes")
    assert [step for step, _ in tables] == [4, 5]
    for _, table in tables:
        header, rule, *rows = table.split("\n")
        assert header == "| " + " | ".join(EPISODE_COLUMNS) + " |"
        assert len(rows) == 2  # table_rows of the step's episodes
        assert all(row.startswith("| math-") for row in rows)


def test_a_node_passes_its_tool_call_format_to_its_rollouts(
    tmp_path: Path, tiny_base: Path
) -> None:
    config = NodeConfig(work_dir=tmp_path, train=SMALL_TRAIN, tool_call_format="response_template")
    daemon = NodeDaemon(config)
    daemon.client.close()
    # The embedded tokenizer has no response_template, so the format cannot be read with it.
    with pytest.raises(ValueError, match="needs a tokenizer with a response_template"):
        daemon._train(1, BASE_ID, tiny_base)


def test_the_coordinator_logs_each_decided_rounds_scores(tmp_path: Path, tiny_base: Path) -> None:
    config = CoordinatorConfig(
        work_dir=tmp_path / "coord",
        p2p_port=0,
        base_checkpoint=tiny_base,
        eval=EvalConfig(n_tasks=1, experts="own"),
        round=RoundPolicy(min_deltas=1),
        merge=MergePlan(
            candidates=[MergeSpec(method="task_arithmetic", parameters={"weight": 0.5})]
        ),
        tracking={"backend": "tensorboard"},
    )
    c = Coordinator(config)
    c.prepare()
    try:
        key = load_or_create_identity(tmp_path / "node.key")
        delta = hand_in_delta(c, key, noisy(current_base_tensors(c), seed=1))
        assert delta.status == "accepted"  # and round 1 merged: one delta is its quorum
        record = c.round_record(1)
    finally:
        c.stop()
    assert record["status"] == "published"
    run = tensorboard_run(tmp_path / "coord" / "tracking" / "coordinator")
    assert scalars(run, "round/published") == [(1, 1.0)]
    assert scalars(run, "round/deltas") == [(1, 1.0)]
    evaluation = record["evaluation"]
    for label in ("base", "merged", f"expert:math:{delta.id[:12]}"):
        row, model = evaluation[label]["math"], label.replace(":", "-")
        assert scalars(run, f"{model}/math/mean_reward") == [(1, pytest.approx(row["mean_reward"]))]
        assert scalars(run, f"{model}/math/success_low") == [(1, pytest.approx(row["success_low"]))]
    candidates = record["candidates"]
    assert len(candidates) == 2
    for index, candidate in enumerate(candidates):
        name = f"candidate/{index}-{candidate['spec']['method']}"
        assert scalars(run, f"{name}/validation_score") == [(1, pytest.approx(candidate["score"]))]
        assert scalars(run, f"{name}/chosen") == [(1, float(candidate["chosen"]))]
    comparison = record["decision"]["comparisons"]["math"]
    assert scalars(run, "decision/math/p_worse") == [(1, pytest.approx(comparison["p_worse"]))]
    held = round_scores("held", record)
    assert held["round/published"] == 0.0
    assert held["merged/math/mean_reward"] == pytest.approx(
        evaluation["merged"]["math"]["mean_reward"]
    )


def test_round_scores_name_both_paired_comparisons() -> None:
    """A round past round 1 records candidate − base and candidate − round 0; the tracker gets
    each under its own prefix."""
    comparison = {"mean": 0.05, "low": -0.01, "high": 0.11, "p_worse": 0.9, "n": 128}
    origin = {"mean": -0.02, "low": -0.08, "high": 0.04, "p_worse": 0.3, "n": 128}
    extra = {
        "decision": {"comparisons": {"math": comparison}, "origin_comparisons": {"math": origin}}
    }
    scores = round_scores("published", extra)
    for key in ("mean", "low", "high", "p_worse"):
        assert scores[f"decision/math/{key}"] == comparison[key]
        assert scores[f"decision_origin/math/{key}"] == origin[key]
    assert scores["round/published"] == 1.0
    assert not any(
        k.startswith("decision_origin/")
        for k in round_scores("held", {"decision": {"comparisons": {"math": comparison}}})
    )
