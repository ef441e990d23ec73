"""A node's optimizer state carried from one round to the next (NodeConfig.keep_optimizer_state):
the saved state loads into a fresh optimizer of the same kind and shapes with its own settings
kept, is refused (and the optimizer left fresh) for another kind or another model, and a real
daemon's second round starts from the momentum its first ended with."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from skillswarm.node.checkpointing import restore_optimizer_state, save_optimizer_state
from skillswarm.node.config import NodeConfig
from skillswarm.node.daemon import CARRIED_OPTIMIZER_FILE, NodeDaemon


def _stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(3, model.in_features)).pow(2).sum().backward()
        optimizer.step()


def test_sgd_momentum_round_trips_into_a_fresh_optimizer_with_its_own_settings(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    old = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _stepped(model, old)
    save_optimizer_state(tmp_path / "carried.pt", old)

    rebased = torch.nn.Linear(4, 2)  # the next round's model: other weights, same shapes
    new = torch.optim.SGD(rebased.parameters(), lr=0.007, momentum=0.9)
    assert restore_optimizer_state(tmp_path / "carried.pt", new)
    assert new.param_groups[0]["lr"] == 0.007  # this round's recipe, not the saved one
    for before, after in zip(model.parameters(), rebased.parameters(), strict=True):
        assert torch.equal(
            old.state[before]["momentum_buffer"], new.state[after]["momentum_buffer"]
        )
    # The next step moves by lr × (0.9 × the carried buffer + the new gradient).
    weight = rebased.weight.detach().clone()
    buffer = new.state[rebased.weight]["momentum_buffer"].clone()
    new.zero_grad()
    rebased(torch.ones(3, 4)).pow(2).sum().backward()
    gradient = rebased.weight.grad.clone()
    new.step()
    assert torch.allclose(rebased.weight, weight - 0.007 * (0.9 * buffer + gradient))


def test_state_of_another_kind_or_model_or_none_leaves_the_optimizer_fresh(tmp_path, caplog):
    model = torch.nn.Linear(4, 2)
    assert not restore_optimizer_state(tmp_path / "absent.pt", torch.optim.SGD(model.parameters()))

    adamw = torch.optim.AdamW(model.parameters())
    _stepped(model, adamw)
    save_optimizer_state(tmp_path / "adamw.pt", adamw)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="skillswarm.node.checkpointing"):
        assert not restore_optimizer_state(tmp_path / "adamw.pt", sgd)
    assert not sgd.state and "is not SGD state" in caplog.text

    other = torch.nn.Linear(2, 4)  # as many tensors, other shapes
    other_sgd = torch.optim.SGD(other.parameters(), lr=0.01, momentum=0.9)
    _stepped(other, other_sgd)
    save_optimizer_state(tmp_path / "other.pt", other_sgd)
    with caplog.at_level(logging.WARNING, logger="skillswarm.node.checkpointing"):
        assert not restore_optimizer_state(tmp_path / "other.pt", sgd)
    assert not sgd.state and "another model's" in caplog.text
    assert sgd.param_groups[0]["lr"] == 0.01

    (tmp_path / "torn.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="skillswarm.node.checkpointing"):
        assert not restore_optimizer_state(tmp_path / "torn.pt", sgd)
    assert "unreadable" in caplog.text


def test_a_daemons_next_round_starts_from_the_momentum_its_last_ended_with(
    tmp_path: Path, tiny_base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert NodeConfig().keep_optimizer_state  # on by default
    base_dir = tmp_path / "base"
    shutil.copytree(tiny_base, base_dir)
    config = NodeConfig(
        work_dir=tmp_path / "node",
        domain="math",
        keep_optimizer_state=True,
        checkpoint_every=0,
        train={"steps": 2, "tasks_per_step": 2},
    )
    daemon = NodeDaemon(config)
    daemon.client.close()
    carried = config.work_dir / CARRIED_OPTIMIZER_FILE
    with caplog.at_level(logging.INFO, logger="skillswarm.node.daemon"):
        assert daemon._train(1, "a" * 64, base_dir) is not None
        assert carried.is_file()
        first = torch.load(carried, weights_only=True)["state"]
        assert "carried over" not in caplog.text
        assert daemon._train(2, "a" * 64, base_dir) is not None
    assert "round=2 optimizer state carried over from the last round" in caplog.messages
    second = torch.load(carried, weights_only=True)["state"]
    assert set(first["state"]) == set(second["state"])

    fresh = NodeDaemon(
        config.model_copy(update={"work_dir": tmp_path / "fresh", "keep_optimizer_state": False})
    )
    fresh.client.close()
    assert fresh._train(1, "a" * 64, base_dir) is not None
    assert not (tmp_path / "fresh" / CARRIED_OPTIMIZER_FILE).exists()
