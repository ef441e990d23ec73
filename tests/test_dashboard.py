"""The coordinator's dashboard as a person sees it: a real coordinator with a merged round, a held
round and a node's heartbeat, served by uvicorn, the page rendered by headless Chromium."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from delta_helpers import current_base_tensors, hand_in_delta, noisy
from skillswarm.agent.openai_server import running_server
from skillswarm.agent.stats import wilson_interval
from skillswarm.coordinator.app import create_app
from skillswarm.coordinator.config import (
    CoordinatorConfig,
    EvalConfig,
    PublishPolicy,
    RoundPolicy,
)
from skillswarm.coordinator.publication import publication_decision
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


def _scores_row(successes: int, n: int) -> dict[str, Any]:
    """A scores row as the evaluator writes it: the first `successes` of `n` tasks solved."""
    outcomes = [1] * successes + [0] * (n - successes)
    low, high = wilson_interval(successes, n)
    return {
        "success_rate": successes / n,
        "mean_reward": successes / n,
        "n": n,
        "success_low": low,
        "success_high": high,
        "rewards": [float(v) for v in outcomes],
        "successes": outcomes,
        "task_ids": [f"t{i}" for i in range(n)],
    }


def _hold_round_on_hand_made_scores(coordinator: Coordinator, number: int) -> dict[str, Any]:
    """Record round `number` as held through the coordinator's own path, on hand-made scores
    (a merge worse than its base beyond noise needs a trained base and many tasks): the merged
    candidate solves 2 of 16 math tasks where the base solves 12 and round 0 solved 10."""
    base = {"math": _scores_row(12, 16), "code": _scores_row(8, 16)}
    merged = {"math": _scores_row(2, 16), "code": _scores_row(8, 16)}
    origin = {"math": _scores_row(10, 16), "code": _scores_row(8, 16)}
    decision = publication_decision(base, merged, PublishPolicy(), origin_scores=origin)
    assert not decision.publish
    coordinator.rounds.record_held(
        number,
        coordinator.current_base().id,
        {
            "inputs": [],
            "evaluation": {
                "base": base,
                "expert:math:0123456789ab": {"math": _scores_row(14, 16)},
                "merged": merged,
            },
            "candidates": [],
            "merge_spec": {"method": "ties"},
            "merge_seconds": 0.5,
            "decision": decision.to_dict()
            | {
                "gate": [
                    {
                        "label": "expert:math:0123456789ab",
                        "domain": "math",
                        "base": 0.75,
                        "expert": 0.875,
                        "kept": True,
                        "p_worse": 0.96875,
                    },
                    {
                        "label": "expert:code:ba9876543210",
                        "domain": "code",
                        "base": 0.5,
                        "expert": 0.0625,
                        "kept": False,
                        "p_worse": 0.000122,
                    },
                    {
                        "label": "expert:search:5555aaaa5555",
                        "domain": "search",
                        "base": 0.5,
                        "expert": 0.5,
                        "kept": False,
                        "p_worse": 0.6,
                        "short_of_min_gain": True,
                    },
                ],
                "subsets": [
                    {
                        "merged": ["expert:math:0123456789ab"],
                        "score": 0.125,
                        "publish": False,
                        "reason": "worse on math",
                    }
                ],
            },
        },
    )
    return coordinator.round_record(number)


def _cell(row: Mapping[str, Any]) -> str:
    """A success cell as the page shows it: the rate and its interval."""
    return (
        f"{100 * row['success_rate']:.1f}% "
        f"[{100 * row['success_low']:.1f}–{100 * row['success_high']:.1f}]"
    )


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
def test_dashboard_shows_nodes_rounds_scores_held_rounds_and_curves(
    coordinator: Coordinator, tmp_path
) -> None:
    math_key = load_or_create_identity(tmp_path / "math.key")
    code_key = load_or_create_identity(tmp_path / "code.key")
    _hand_in_delta(coordinator, math_key, "math", 1e-3)
    _hand_in_delta(coordinator, code_key, "code", 2e-3)
    coordinator.record_heartbeat(
        peer_id_of(math_key), NodeHeartbeat(domain="math", round=2, step=5, reward=0.375)
    )
    published = coordinator.round_record(1)  # the quorum of two merged it
    assert published["status"] == "published"
    merged_math = published["evaluation"]["merged"]["math"]
    merged_success = merged_math["success_rate"]
    held = _hold_round_on_hand_made_scores(coordinator, 2)
    assert held["status"] == "held"

    with running_server(create_app(coordinator)) as api_url:
        page = _render(api_url.removesuffix("/v1") + "/dashboard")

    assert 'data-loaded="true"' in page, page[-3000:]
    nodes = re.search(r'<table id="nodes-table">.*?</table>', page, re.DOTALL)
    assert nodes is not None
    assert peer_id_of(math_key)[:12] in nodes.group(0)
    assert peer_id_of(code_key)[:12] in nodes.group(0)
    assert "<td>code</td>" in nodes.group(0) and "0.375" in nodes.group(0)
    assert re.search(r'id="current-round">3<', page)  # round 2 was held: round 3 is open
    round_card = re.search(r'data-round="1".*?</table>', page, re.DOTALL)
    assert round_card is not None
    card = round_card.group(0)
    assert "published" in card and "2 deltas" in card
    assert "task_arithmetic, math ×0.5" in html.unescape(card)  # the default plan's scale
    assert published["method"]["domain_scale"] == {"math": 0.5}
    assert "merged" in card and f"{100 * merged_success:.1f}%" in card
    assert _cell(merged_math) in card  # the rate with its interval
    assert "base" in card

    held_card = html.unescape(page.split('data-round="2"', 1)[1].split('data-round="1"', 1)[0])
    assert '<span class="status-held">held</span>' in held_card
    assert f"held: {held['decision']['reason']}" in held_card
    assert held["decision"]["reason"].startswith("worse than the current base beyond noise")
    assert f"<td>merged</td><td>{_cell(held['evaluation']['merged']['code'])}</td>" in held_card
    assert f"<td>{_cell(held['evaluation']['merged']['math'])}</td>" in held_card
    # The expert was scored on its own domain only (columns: code, math).
    assert (
        f"<td>expert:math:0123456789ab</td><td>–</td><td>{_cell(_scores_row(14, 16))}" in held_card
    )
    # The paired difference merged − base on math: 2 vs 12 of the same 16 tasks.
    assert (
        "<td>expert:math:0123456789ab</td><td>0.125</td><td>–</td><td>held: worse on math</td>"
        in held_card
    )
    # The own-domain gate: each delta's mean reward alone beside the base's, and its verdict.
    gate = re.search(r'<table id="gate-2">.*?</table>', held_card, re.DOTALL)
    assert gate is not None
    assert (
        "<td>expert:math:0123456789ab</td><td>math</td><td>0.750</td><td>0.875</td>"
        "<td>0.969</td><td>kept</td>" in gate.group(0)
    )
    assert (
        "<td>expert:code:ba9876543210</td><td>code</td><td>0.500</td><td>0.063</td>"
        "<td>0.000122</td><td>left out</td>" in gate.group(0)
    )
    assert "<td>0.600</td><td>left out: gained too little</td>" in gate.group(0)
    against_base, against_origin = held_card.split("candidate − round 0 (points)", 1)
    assert re.search(r"<td>math</td><td>-62\.5 \[-\d+\.\d, -\d+\.\d\]</td>", against_base)
    # And merged − round 0: 2 vs 10.
    assert re.search(r"<td>math</td><td>-50\.0 \[-\d+\.\d, -\d+\.\d\]</td>", against_origin)

    assert '<svg width="520" height="220" id="curves-svg">' in page
    assert 'data-domain="math"' in page
    # The published curve: round 0's base, round 1 published, round 2 held (carried over).
    assert page.count('data-held="false"') == 2 and page.count('data-held="true"') == 1
    # It starts at the base, round 0, on the axis's first tick, and is named at its end.
    ticks = re.findall(r'<text x="([\d.]+)"[^>]*class="round-tick">([^<]+)</text>', page)
    assert ticks[0][1] == "base" and [label for _, label in ticks[1:]] == ["1", "2"]
    circles = re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"[^>]*data-domain="math"', page)
    xs = [float(cx) for cx, _ in circles]
    assert xs == [float(x) for x, _ in ticks]  # base, round 1, round 2
    label = re.search(r'<text x="([\d.]+)" y="([\d.]+)"[^>]*data-domain="math"[^>]*>math<', page)
    assert label is not None
    end_x, end_y = xs[-1], float(circles[-1][1])
    assert end_x < float(label.group(1)) <= end_x + 10
    assert abs(float(label.group(2)) - end_y) <= 6
