"""A node's optimizer state carried from one round to the next (NodeConfig.keep_optimizer_state):
the saved state loads into a fresh optimizer of the same kind and shapes with its own settings
kept, is refused (and the optimizer left fresh) for another kind, model, domain or a round not
before this one, and a real daemon's second round starts from the momentum its first ended with."""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from skillswarm.node.checkpointing import restore_optimizer_state, save_optimizer_state
from skillswarm.node.config import NodeConfig
from skillswarm.node.daemon import CARRIED_OPTIMIZER_FILE, NodeDaemon
from skillswarm.node.pipeline import AsyncRLRun

MATH_1 = {"domain": "math", "round": 1}
MATH_2 = {"domain": "math", "round": 2}


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
    save_optimizer_state(tmp_path / "carried.pt", old, **MATH_1)

    rebased = torch.nn.Linear(4, 2)  # the next round's model: other weights, same shapes
    new = torch.optim.SGD(rebased.parameters(), lr=0.007, momentum=0.9)
    assert restore_optimizer_state(tmp_path / "carried.pt", new, **MATH_2) == 1
    assert new.param_groups[0]["lr"] == 0.007  # this round's recipe, not the saved one
    for before, after in zip(model.parameters(), rebased.parameters(), strict=True):
        carried = new.state[after]["momentum_buffer"]
        assert torch.equal(old.state[before]["momentum_buffer"], carried)
    # The next step moves by lr × (0.9 × the carried buffer + the new gradient).
    weight = rebased.weight.detach().clone()
    buffer = new.state[rebased.weight]["momentum_buffer"].clone()
    new.zero_grad()
    rebased(torch.ones(3, 4)).pow(2).sum().backward()
    gradient = rebased.weight.grad.clone()
    new.step()
    assert torch.allclose(rebased.weight, weight - 0.007 * (0.9 * buffer + gradient))


def _refused(path: Path, optimizer: torch.optim.Optimizer, caplog, says: str, **tag: Any) -> None:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skillswarm.node.checkpointing"):
        assert restore_optimizer_state(path, optimizer, **(MATH_2 | tag)) is None
    assert not optimizer.state, "a refused state must leave the optimizer fresh"
    assert optimizer.param_groups[0]["lr"] == 0.01, "a refused state must keep its settings"
    assert says in caplog.text


def test_state_of_another_kind_model_domain_or_round_leaves_the_optimizer_fresh(tmp_path, caplog):
    model = torch.nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    assert restore_optimizer_state(tmp_path / "absent.pt", sgd, **MATH_2) is None

    adamw = torch.optim.AdamW(model.parameters(), lr=0.5)
    _stepped(model, adamw)
    save_optimizer_state(tmp_path / "adamw.pt", adamw, **MATH_1)
    _refused(tmp_path / "adamw.pt", sgd, caplog, "AdamW state of math, not SGD of math")

    other = torch.nn.Linear(2, 4)  # as many tensors, other shapes
    other_sgd = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)
    _stepped(other, other_sgd)
    save_optimizer_state(tmp_path / "other.pt", other_sgd, **MATH_1)
    _refused(tmp_path / "other.pt", sgd, caplog, "another model's")

    fewer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5, momentum=0.9)
    save_optimizer_state(tmp_path / "fewer.pt", fewer, **MATH_1)
    _refused(tmp_path / "fewer.pt", sgd, caplog, "does not fit")

    mine = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _stepped(model, mine)
    save_optimizer_state(tmp_path / "mine.pt", mine, **MATH_1)
    _refused(tmp_path / "mine.pt", sgd, caplog, "SGD state of math, not SGD of code", domain="code")
    _refused(tmp_path / "mine.pt", sgd, caplog, "ended round 1, not one before 1", round=1)
    assert restore_optimizer_state(tmp_path / "mine.pt", sgd, **MATH_2) == 1

    fresh = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.save({"optimizer": "SGD", "domain": "math", "round": 1, "state": []}, tmp_path / "x.pt")
    _refused(tmp_path / "x.pt", fresh, caplog, "holds no optimizer state")
    (tmp_path / "torn.pt").write_bytes(b"not a torch file")
    _refused(tmp_path / "torn.pt", fresh, caplog, "unreadable")


def test_a_daemons_next_round_starts_from_the_momentum_its_last_ended_with(
    tmp_path: Path, tiny_base: Path, caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    assert NodeConfig().keep_optimizer_state  # on by default
    started: list[dict[str, Any]] = []
    run = AsyncRLRun.run

    def run_noting_the_starting_state(self: AsyncRLRun) -> list[dict[str, float]]:
        started.append(copy.deepcopy(self.trainer.optimizer.state_dict()["state"]))
        return run(self)

    monkeypatch.setattr(AsyncRLRun, "run", run_noting_the_starting_state)
    base_dir = tmp_path / "base"
    shutil.copytree(tiny_base, base_dir)
    config = NodeConfig(
        work_dir=tmp_path / "node",
        domain="math",
        checkpoint_every=0,
        train={"steps": 2, "tasks_per_step": 4},
    )
    daemon = NodeDaemon(config)
    daemon.client.close()
    carried = config.work_dir / CARRIED_OPTIMIZER_FILE
    with caplog.at_level(logging.INFO, logger="skillswarm.node.daemon"):
        assert daemon._train(1, "a" * 64, base_dir) is not None
        first = torch.load(carried, weights_only=True)
        assert (first["domain"], first["round"]) == ("math", 1)
        assert daemon._train(2, "a" * 64, base_dir) is not None
    assert started[0] == {}  # round 1: a fresh optimizer
    buffers = {k: v["momentum_buffer"] for k, v in first["state"]["state"].items()}
    assert buffers and any(b.abs().sum() > 0 for b in buffers.values())
    assert set(started[1]) == set(buffers)
    for key, buffer in buffers.items():
        assert torch.equal(started[1][key]["momentum_buffer"], buffer)
    assert any(
        "round=2 starts from the optimizer state round 1 ended with" in m for m in caplog.messages
    )
    assert torch.load(carried, weights_only=True)["round"] == 2

    # Turned off, a node neither reads the carried state nor writes one.
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    shutil.copy(carried, fresh_dir / CARRIED_OPTIMIZER_FILE)
    fresh = NodeDaemon(
        config.model_copy(update={"work_dir": fresh_dir, "keep_optimizer_state": False})
    )
    fresh.client.close()
    assert fresh._train(3, "a" * 64, base_dir) is not None
    assert started[2] == {}
    assert torch.load(fresh_dir / CARRIED_OPTIMIZER_FILE, weights_only=True)["round"] == 2
