"""The coordinator's dashboard as a person sees it: a real coordinator with a merged round and a
node's heartbeat, served by uvicorn, the page rendered by headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from delta_helpers import current_base_tensors, hand_in_delta, noisy
from skillswarm.agent.openai_server import running_server
from skillswarm.coordinator.app import create_app
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, RoundPolicy
from skillswarm.coordinator.service import Coordinator
from skillswarm.protocol.identity import KeyPair, load_or_create_identity, peer_id_of
from skillswarm.protocol.messages import NodeHeartbeat

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from skillswarm.node.bootstrap import create_base_checkpoint

    return create_base_checkpoint(
        tmp_path_factory.mktemp("dashboard-base") / "base",
        warm_start_steps=0,
        domains=("math",),
    )


def _hand_in_delta(coordinator: Coordinator, key: KeyPair, domain: str, scale: float) -> None:
    """A signed delta of `key`'s peer, as if announced on gossip and fetched."""
    tuned = noisy(current_base_tensors(coordinator), int(scale * 1e6), scale)
    record = hand_in_delta(
        coordinator, key, tuned, domain=domain, steps=3, metrics={"reward_mean": 0.5}
    )
    assert record.status == "accepted", record.reason


@pytest.fixture
def coordinator(tmp_path: Path, base: Path) -> Iterator[Coordinator]:
    config = CoordinatorConfig(
        work_dir=tmp_path / "coordinator",
        p2p_port=0,
        base_checkpoint=base,
        eval=EvalConfig(domains=["math"], n_tasks=2),
        round=RoundPolicy(min_deltas=2),
    )
    coordinator = Coordinator(config)
    coordinator.prepare()
    yield coordinator
    coordinator.store.close()


def _render(url: str) -> str:
    """The page's DOM after its script ran, as headless Chromium sees it."""
    assert CHROMIUM is not None
    result = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=15000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")
def test_dashboard_shows_nodes_rounds_scores_and_curves(coordinator: Coordinator, tmp_path) -> None:
    math_key = load_or_create_identity(tmp_path / "math.key")
    code_key = load_or_create_identity(tmp_path / "code.key")
    _hand_in_delta(coordinator, math_key, "math", 1e-3)
    _hand_in_delta(coordinator, code_key, "code", 2e-3)
    coordinator.record_heartbeat(
        peer_id_of(math_key), NodeHeartbeat(domain="math", round=2, step=5, reward=0.375)
    )
    published = coordinator.round_record(1)  # the quorum of two merged it
    assert published["status"] == "published"
    merged_success = published["evaluation"]["merged"]["math"]["success_rate"]

    with running_server(create_app(coordinator)) as api_url:
        page = _render(api_url.removesuffix("/v1") + "/dashboard")

    assert 'data-loaded="true"' in page, page[-3000:]
    nodes = re.search(r'<table id="nodes-table">.*?</table>', page, re.DOTALL)
    assert nodes is not None
    assert peer_id_of(math_key)[:12] in nodes.group(0)
    assert peer_id_of(code_key)[:12] in nodes.group(0)
    assert "<td>code</td>" in nodes.group(0) and "0.375" in nodes.group(0)
    assert re.search(r'id="current-round">2<', page)
    round_card = re.search(r'data-round="1".*?</table>', page, re.DOTALL)
    assert round_card is not None
    card = round_card.group(0)
    assert "published" in card and "2 deltas" in card
    assert "merged" in card and f"{100 * merged_success:.1f}%" in card
    assert "base" in card
    assert '<svg width="520" height="220" id="curves-svg">' in page
    assert 'data-domain="math"' in page
