"""The asynchronous RL pipeline: bounded staleness, versions on every sampled token, weight pushes,
and a `skillswarm train` process killed with SIGKILL that resumes where its checkpoint left it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from skillswarm.agent.envs import get_environment
from skillswarm.agent.model import (
    TEMPLATE_FIXED_STRINGS,
    build_tiny_model,
    build_tokenizer,
    load_policy,
)
from skillswarm.node.bootstrap import render_demonstrations
from skillswarm.node.metrics import read_metrics
from skillswarm.node.pipeline import AsyncRLRun, RLConfig


@pytest.fixture(scope="module")
def small_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small untrained model folder (fast to load and to train)."""
    env = get_environment("math")
    renderer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    corpus = list(TEMPLATE_FIXED_STRINGS) + render_demonstrations(renderer, [env], 100, seed=0)
    tokenizer = build_tokenizer(corpus)
    model = build_tiny_model(tokenizer, seed=0, hidden=32, layers=1, heads=2, intermediate=64)
    folder = tmp_path_factory.mktemp("policy") / "small"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _config(**overrides: object) -> RLConfig:
    settings = {
        "steps": 4,
        "tasks_per_step": 2,
        "samples_per_task": 2,
        "max_new_tokens": 8,
        "learning_rate": 1e-3,
    }
    return RLConfig.model_validate({**settings, **overrides})


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_batches_lag_the_trainer_by_at_most_max_staleness(small_policy_dir, max_staleness) -> None:
    model, tokenizer = load_policy(small_policy_dir)
    trained_versions: list[tuple[int, list[int]]] = []
    run = AsyncRLRun(
        model, tokenizer, get_environment("math"), _config(max_staleness=max_staleness)
    )
    original_step = run.trainer.step

    def recording_step(episodes):
        versions = [
            version
            for episode in episodes
            for sample in episode.samples
            for version, mask in zip(sample.policy_version, sample.loss_mask, strict=True)
            if mask
        ]
        trained_versions.append((len(trained_versions), versions))
        return original_step(episodes)

    run.trainer.step = recording_step  # type: ignore[method-assign]
    history = run.run()
    assert [int(m["step"]) for m in history] == [0, 1, 2, 3]
    assert [m["policy_version"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    for metrics in history:
        assert 0 <= metrics["staleness"] <= max_staleness
        assert metrics["dropped_groups"] == 0
        assert 0.0 <= metrics["trainer_idle_fraction"] <= 1.0
    for version_at_update, token_versions in trained_versions:
        assert token_versions, "every batch has sampled tokens"
        assert all(
            version_at_update - max_staleness <= v <= version_at_update for v in token_versions
        )
    if max_staleness == 0:
        assert all(v == update for update, versions in trained_versions for v in versions)
    assert run.backend.policy_version == 4
    # The behaviour copy holds the trainer's final weights.
    behaviour = dict(run.backend.model.named_parameters())  # type: ignore[attr-defined]
    assert all(behaviour[name].equal(p) for name, p in model.named_parameters())


def test_weight_pushes_every_k_steps_need_a_lag_that_covers_them() -> None:
    with pytest.raises(ValueError, match="2 versions old; raise max_staleness"):
        _config(weight_sync_every=3, max_staleness=1)
    assert _config(weight_sync_every=3, max_staleness=2).weight_sync_every == 3


def test_weights_pushed_every_two_steps_keep_batches_within_the_bound(small_policy_dir) -> None:
    model, tokenizer = load_policy(small_policy_dir)
    config = _config(steps=4, weight_sync_every=2, max_staleness=1)
    history = AsyncRLRun(model, tokenizer, get_environment("math"), config).run()
    assert len(history) == 4
    assert all(m["staleness"] <= 1 and m["dropped_groups"] == 0 for m in history)


def _train_process(policy: Path, out: Path, steps: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "skillswarm.cli", "train", "--base", str(policy),
            "--out", str(out), "--steps", str(steps), "--checkpoint-every", "1",
            "--eval-tasks", "0", "--max-staleness", "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _latest_step(out: Path) -> int:
    pointer = out / "checkpoints" / "latest"
    if not pointer.is_file():
        return 0
    name = pointer.read_text().strip()
    return int(name.rsplit("-", 1)[-1]) if name.startswith("step-") else 0


def test_a_killed_training_process_resumes_from_its_last_checkpoint(
    small_policy_dir, tmp_path
) -> None:
    out = tmp_path / "run"
    steps = 8
    process = _train_process(small_policy_dir, out, steps)
    deadline = time.monotonic() + 240
    while _latest_step(out) < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()[0]
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    saved = _latest_step(out)
    assert 3 <= saved < steps

    resumed = _train_process(small_policy_dir, out, steps)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    assert f"resuming at step {saved}" in output
    logged = [int(record["step"]) for record in read_metrics(out / "metrics.jsonl")]
    assert logged == list(range(steps))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == steps and not summary["stopped_early"]
    assert _latest_step(out) == steps
    model, _ = load_policy(out / "final")
    reloaded, _ = load_policy(out / "checkpoints" / f"step-{steps:06d}")
    assert all(
        a.equal(b)
        for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True)
    )
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sigterm_finishes_the_step_and_checkpoints(small_policy_dir, tmp_path) -> None:
    out = tmp_path / "run"
    process = _train_process(small_policy_dir, out, 200)
    deadline = time.monotonic() + 240
    while _latest_step(out) < 1 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    assert "stopped after step" in output and "run again to resume" in output
    stopped_at = _latest_step(out)
    logged = [int(record["step"]) for record in read_metrics(out / "metrics.jsonl")]
    assert logged == list(range(stopped_at))


def test_a_kl_term_without_a_given_reference_measures_against_the_starting_weights(
    small_policy_dir,
) -> None:
    model, tokenizer = load_policy(small_policy_dir)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    run = AsyncRLRun(model, tokenizer, get_environment("math"), _config(loss={"kl_coef": 0.5}))
    reference = run.trainer.reference_model
    assert reference is not None and reference is not model and not reference.training
    shared = {id(p) for p in model.parameters()} & {id(p) for p in reference.parameters()}
    assert not shared
    run.run()
    for name, p in reference.named_parameters():
        assert torch.equal(p, start[name]), name
    off = AsyncRLRun(model, tokenizer, get_environment("math"), _config())
    assert off.trainer.reference_model is None
