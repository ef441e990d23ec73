"""The outer optimizer steps merged checkpoints by the DiLoCo formula on real safetensors folders,
and its momentum state survives crashes: two-phase, atomic, recovered by what was published."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from skillswarm.merge.outer import (
    PENDING_FILE,
    STATE_FILE,
    OuterOptimizer,
    OuterOptimizerConfig,
    commit_pending,
    load_state,
    outer_step,
    recover,
    write_pending,
)
from skillswarm.merge.tensors import MergeError

NESTEROV = OuterOptimizerConfig(learning_rate=0.8, momentum=0.5, nesterov=True)
CLASSIC = OuterOptimizerConfig(learning_rate=0.8, momentum=0.5, nesterov=False)


def _checkpoint(folder: Path, weight: list[float], *, dtype=torch.float32, marker="x") -> Path:
    """A tiny Hugging Face folder: one floating tensor, one integer tensor, a config.json."""
    folder.mkdir(parents=True)
    tensors = {
        "model.weight": torch.tensor(weight, dtype=dtype),
        "model.positions": torch.arange(3, dtype=torch.int64) + (10 if marker == "merged" else 0),
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"marker": marker}))
    return folder


def _weight(folder: Path) -> torch.Tensor:
    return load_file(folder / "model.safetensors")["model.weight"]


def _assert_close(actual: torch.Tensor, expected: list[float]) -> None:
    assert torch.allclose(actual, torch.tensor(expected), rtol=0, atol=1e-6), actual


@pytest.mark.parametrize(
    "config,round1,momentum1,merged2,round2,momentum2",
    [
        # Round 1: base [1, 2, -1], merged [1.5, 1, -1] -> g = [0.5, -1, 0], m = g.
        # Nesterov: u = g + 0.5 m = [0.75, -1.5, 0]; new = base + 0.8 u = [1.6, 0.8, -1].
        # Round 2: merged [1.8, 0.8, -0.5] -> g = [0.2, 0, 0.5], m = 0.5 m + g = [0.45, -0.5, 0.5],
        # u = g + 0.5 m = [0.425, -0.25, 0.75]; new = [1.6, 0.8, -1] + 0.8 u = [1.94, 0.6, -0.4].
        (
            NESTEROV,
            [1.6, 0.8, -1.0],
            [0.5, -1.0, 0.0],
            [1.8, 0.8, -0.5],
            [1.94, 0.6, -0.4],
            [0.45, -0.5, 0.5],
        ),
        # Classic: u = m. Round 1: new = base + 0.8 [0.5, -1, 0] = [1.4, 1.2, -1].
        # Round 2: merged [1.6, 1.2, -0.5] -> g = [0.2, 0, 0.5], m = [0.45, -0.5, 0.5],
        # new = [1.4, 1.2, -1] + 0.8 m = [1.76, 0.8, -0.6].
        (
            CLASSIC,
            [1.4, 1.2, -1.0],
            [0.5, -1.0, 0.0],
            [1.6, 1.2, -0.5],
            [1.76, 0.8, -0.6],
            [0.45, -0.5, 0.5],
        ),
    ],
    ids=["nesterov", "classic"],
)
def test_two_rounds_follow_the_formula(
    tmp_path, config, round1, momentum1, merged2, round2, momentum2
):
    optimizer = OuterOptimizer(tmp_path / "state", config)
    base = _checkpoint(tmp_path / "base", [1.0, 2.0, -1.0])
    merged = _checkpoint(tmp_path / "merged1", [1.5, 1.0, -1.0], marker="merged")

    out1 = optimizer.step("ckpt-0", base, merged, tmp_path / "out1", 1)
    _assert_close(_weight(out1), round1)
    stepped = load_file(out1 / "model.safetensors")
    assert torch.equal(stepped["model.positions"], torch.arange(3) + 10)  # copied from merged
    assert json.loads((out1 / "config.json").read_text()) == {"marker": "merged"}
    assert (tmp_path / "state" / PENDING_FILE).exists()
    optimizer.commit("ckpt-1")
    assert not (tmp_path / "state" / PENDING_FILE).exists()
    _assert_close(load_state(tmp_path / "state", "ckpt-1")["model.weight"], momentum1)

    # Round 2 starts from the published checkpoint; its merge moved by [0.2, 0, 0.5].
    merged2_dir = _checkpoint(tmp_path / "merged2", merged2)
    out2 = optimizer.step("ckpt-1", out1, merged2_dir, tmp_path / "out2", 2)
    _assert_close(_weight(out2), round2)
    optimizer.commit("ckpt-2")
    buffers = load_state(tmp_path / "state", "ckpt-2", config)
    assert set(buffers) == {"model.weight"}  # integer tensors carry no momentum
    assert buffers["model.weight"].dtype == torch.float32
    _assert_close(buffers["model.weight"], momentum2)
    state = json.loads((tmp_path / "state" / STATE_FILE).read_text())
    assert (state["checkpoint_id"], state["parent_id"], state["round"], state["steps"]) == (
        "ckpt-2",
        "ckpt-1",
        2,
        2,
    )
    assert state["config"] == config.model_dump()
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert files == [state["buffers"], STATE_FILE]  # the previous round's buffers are gone


def test_identity_publishes_the_merged_files_bit_for_bit(tmp_path):
    identity = OuterOptimizerConfig()
    assert identity.is_identity() and not NESTEROV.is_identity()
    base = _checkpoint(tmp_path / "base", [1.0, 2.0, 3.0])
    merged = _checkpoint(tmp_path / "merged", [1.1, 2.2, 3.3], marker="merged")

    optimizer = OuterOptimizer(tmp_path / "state", identity)
    assert optimizer.step("ckpt-0", base, merged, tmp_path / "unused", 1) == merged
    optimizer.commit("ckpt-1")
    assert optimizer.recover(lambda number, parent: None) is None
    assert not (tmp_path / "state").exists() and not (tmp_path / "unused").exists()

    assert outer_step(base, merged, tmp_path / "copy", identity, None) == {}
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "copy" / name).read_bytes() == (merged / name).read_bytes()


def test_momentum_zero_steps_without_state(tmp_path):
    config = OuterOptimizerConfig(learning_rate=0.5)
    base = _checkpoint(tmp_path / "base", [1.0, 2.0, 3.0])
    merged = _checkpoint(tmp_path / "merged", [2.0, 2.0, 1.0])
    optimizer = OuterOptimizer(tmp_path / "state", config)
    out = optimizer.step("ckpt-0", base, merged, tmp_path / "out", 1)
    _assert_close(_weight(out), [1.5, 2.0, 2.0])  # base + 0.5 (merged - base)
    optimizer.commit("ckpt-1")
    assert not (tmp_path / "state").exists()


def test_bfloat16_stays_bfloat16(tmp_path):
    base = _checkpoint(tmp_path / "base", [1.0, 2.0, -1.0], dtype=torch.bfloat16)
    merged = _checkpoint(tmp_path / "merged", [1.5, 1.0, -1.0], dtype=torch.bfloat16)
    buffers = outer_step(base, merged, tmp_path / "out", NESTEROV, None)
    weight = _weight(tmp_path / "out")
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, torch.tensor([1.6, 0.8, -1.0]).to(torch.bfloat16))
    assert buffers["model.weight"].dtype == torch.float32
    _assert_close(buffers["model.weight"], [0.5, -1.0, 0.0])


def test_mismatched_checkpoints_and_buffers_raise(tmp_path):
    base = _checkpoint(tmp_path / "base", [1.0, 2.0, 3.0])
    wider = _checkpoint(tmp_path / "wider", [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(MergeError, match=r"model\.weight .*shapes"):
        outer_step(base, wider, tmp_path / "out", NESTEROV, None)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    save_file({"other": torch.zeros(3)}, renamed / "model.safetensors")
    with pytest.raises(MergeError, match="missing"):
        outer_step(base, renamed, tmp_path / "out", NESTEROV, None)
    with pytest.raises(MergeError, match="momentum buffers do not fit"):
        outer_step(base, base, tmp_path / "out", NESTEROV, {"model.weight": torch.zeros(4)})
    with pytest.raises(MergeError, match="own input folder"):
        outer_step(base, base, base, NESTEROV, None)


def test_config_is_validated():
    for bad in ({"momentum": 1.0}, {"momentum": -0.1}, {"learning_rate": 0}, {"lr": 1}):
        with pytest.raises(ValidationError):
            OuterOptimizerConfig(**bad)


def test_recover_promotes_a_published_pending_state_and_drops_the_rest(tmp_path):
    state = tmp_path / "state"
    buffers = {"w": torch.tensor([1.0, 2.0])}
    write_pending(state, buffers, 3, "ckpt-2", config=NESTEROV)
    asked = []

    def unpublished(number: int, parent: str) -> str | None:
        asked.append((number, parent))
        return None

    assert recover(state, unpublished) is None
    assert asked == [(3, "ckpt-2")]
    assert list(state.iterdir()) == []  # the buffers file went with its pending JSON
    assert load_state(state, "ckpt-3") is None

    write_pending(state, buffers, 3, "ckpt-2", config=NESTEROV)
    assert recover(state, lambda number, parent: f"ckpt-{number}") == "ckpt-3"
    assert not (state / PENDING_FILE).exists()
    assert torch.equal(load_state(state, "ckpt-3", NESTEROV)["w"], buffers["w"])
    assert recover(state, unpublished) is None  # nothing pending: the committed state stays
    assert load_state(state, "ckpt-3") is not None


def test_load_state_refuses_another_checkpoint_or_config(tmp_path, caplog):
    state = tmp_path / "state"
    write_pending(state, {"w": torch.ones(2)}, 1, "ckpt-0", config=NESTEROV)
    assert load_state(state, "ckpt-1") is None  # pending is not committed yet
    commit_pending(state, "ckpt-1")
    with caplog.at_level(logging.INFO, logger="skillswarm.merge.outer"):
        assert load_state(state, "ckpt-retired") is None
        assert load_state(state, "ckpt-1", CLASSIC) is None
    assert "leads to ckpt-1, not to the base ckpt-retired" in caplog.text
    assert "config changed" in caplog.text
    assert load_state(state, "ckpt-1", NESTEROV) is not None
    with pytest.raises(MergeError, match="no pending"):
        commit_pending(state, "ckpt-2")
    (state / STATE_FILE).write_bytes(b" " * (2 << 20))  # over the 1 MiB bound: not read
    assert load_state(state, "ckpt-1") is None


_WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from skillswarm.merge.outer import OuterOptimizerConfig, write_pending
    state, mode = sys.argv[1], sys.argv[2]
    config = OuterOptimizerConfig(momentum=0.5)
    if mode == "kill-after-pending":
        write_pending(state, {"w": torch.full((4,), 7.0)}, 7, "ckpt-6", config=config)
        os.kill(os.getpid(), signal.SIGKILL)  # dies before anything commits
    round = 0
    while True:  # write pending states until killed; round r's buffers all equal r
        round += 1
        buffers = {f"w{i}": torch.full((256, 256), float(round)) for i in range(8)}
        write_pending(state, buffers, round, f"ckpt-{round - 1}", config=config)
        print(round, flush=True)
    """
)


def _writer(state: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(state), mode], stdout=subprocess.PIPE, text=True
    )


def test_pending_state_survives_sigkill_before_commit(tmp_path):
    state = tmp_path / "state"
    process = _writer(state, "kill-after-pending")
    assert process.wait(timeout=120) == -signal.SIGKILL
    assert recover(state, lambda number, parent: f"ckpt-{number}" if parent == "ckpt-6" else None)
    assert torch.equal(load_state(state, "ckpt-7")["w"], torch.full((4,), 7.0))


def test_sigkill_mid_write_never_leaves_a_half_written_state(tmp_path):
    state = tmp_path / "state"
    process = _writer(state, "loop")
    try:
        assert process.stdout.readline().strip() == "1"  # one pending state is complete
        time.sleep(0.2)  # then kill it somewhere inside a later write
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        process.stdout.close()
    pending = json.loads((state / PENDING_FILE).read_text())
    number = pending["round"]
    buffers = load_file(state / pending["buffers"])
    assert sorted(buffers) == [f"w{i}" for i in range(8)]
    assert all(torch.equal(b, torch.full((256, 256), float(number))) for b in buffers.values())

    assert recover(state, lambda n, parent: f"ckpt-{n}" if parent == f"ckpt-{n - 1}" else None)
    assert sorted(p.name for p in state.iterdir()) == sorted([pending["buffers"], STATE_FILE])
    assert torch.equal(load_state(state, f"ckpt-{number}")["w0"], buffers["w0"])
