"""A node that would run model-written code insists on the kernel sandbox: without bubblewrap it
refuses the code domain unless its config accepts the weaker sandbox, and then it warns; a node
whose KL anchor would play code episodes leaves code out of the anchor instead; its /healthz
reports the sandbox in force."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from skillswarm.agent.sandbox import Isolation, sandbox_isolation
from skillswarm.node.config import NodeConfig
from skillswarm.protocol.tomlconfig import write_toml_config


def _node_run(config: NodeConfig, path: Path, sandbox: str) -> subprocess.CompletedProcess[str]:
    toml = write_toml_config(config, path)
    return subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", "node", "run", "--config", str(toml)],
        env={**os.environ, "SKILLSWARM_SANDBOX": sandbox},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_code_domain_is_refused_without_kernel_isolation(
    tmp_path: Path, not_a_coordinator: str
) -> None:
    config = NodeConfig(
        work_dir=tmp_path / "node", domain="code", coordinator_url=not_a_coordinator
    )
    refused = _node_run(config, tmp_path / "node.toml", "audit-hook")
    assert refused.returncode == 1
    assert "refusing to train code" in refused.stderr
    assert "allow_weak_sandbox = true" in refused.stderr
    math = config.model_copy(update={"domain": "math"})  # runs no model code: not refused
    asked = _node_run(math, tmp_path / "math.toml", "audit-hook")
    assert "refusing" not in asked.stderr and "404" in asked.stderr


def test_an_accepted_weak_sandbox_is_said_at_start(tmp_path: Path, not_a_coordinator: str) -> None:
    config = NodeConfig(
        work_dir=tmp_path / "node",
        domain="code",
        coordinator_url=not_a_coordinator,
        allow_weak_sandbox=True,
    )
    result = _node_run(config, tmp_path / "node.toml", "audit-hook")
    assert "refusing" not in result.stderr
    assert "only the audit-hook sandbox" in result.stderr
    assert "404" in result.stderr  # it went on to ask the coordinator


def test_an_anchor_on_code_without_kernel_isolation_leaves_code_out(
    tmp_path: Path, not_a_coordinator: str
) -> None:
    config = NodeConfig(
        work_dir=tmp_path / "node",
        domain="math",
        coordinator_url=not_a_coordinator,
        train={"anchor": {"coef": 1.0, "domains": ["code", "search"]}},
    )
    result = _node_run(config, tmp_path / "node.toml", "audit-hook")
    assert "refusing" not in result.stderr
    assert "the anchor leaves out code: its episodes run model-written code" in result.stderr
    assert "anchor 1 on search)" in result.stderr  # the training summary, after the check
    assert "404" in result.stderr  # it went on to ask the coordinator
    accepted = config.model_copy(update={"allow_weak_sandbox": True})
    result = _node_run(accepted, tmp_path / "weak.toml", "audit-hook")
    assert "leaves out" not in result.stderr
    assert "code runs model-written code with only the audit-hook sandbox" in result.stderr
    assert "anchor 1 on code, search)" in result.stderr


@pytest.mark.skipif(
    sandbox_isolation() is not Isolation.BUBBLEWRAP, reason="bubblewrap cannot run here"
)
def test_health_reports_the_kernel_sandbox(tmp_path: Path) -> None:
    from skillswarm.node.daemon import NodeDaemon

    daemon = NodeDaemon(NodeConfig(work_dir=tmp_path, domain="code"))
    assert daemon.status.snapshot()["sandbox"] is None
    daemon._check_sandbox()
    assert daemon.status.snapshot()["sandbox"] == {"isolation": "bubblewrap", "kernel": True}
