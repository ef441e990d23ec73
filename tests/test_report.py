"""The demo's report on hand-made round records: an old round recorded before intervals, a
published round with Wilson intervals and the publication verdict, and a held round; the page
shows the intervals and the held reason, and the lead plot carries the published value over the
held round."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pytest
from skillswarm.agent.stats import wilson_interval
from skillswarm.coordinator.config import PublishPolicy
from skillswarm.coordinator.publication import publication_decision

from skillswarm.report import (
    ProgressPoint,
    Score,
    base_levels,
    expert_points,
    method_label,
    plot_published_progress,
    published_series,
    signed_points,
    success_cell,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N = 32


def _row(successes: int, n: int = N) -> dict[str, Any]:
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


def _old_row(rate: float) -> dict[str, Any]:
    """A row recorded before intervals and per-task outcomes were."""
    return {"success_rate": rate, "mean_reward": rate, "n": N}


def _cell(successes: int) -> str:
    low, high = wilson_interval(successes, N)
    return f"{100 * successes / N:.1f}% [{100 * low:.1f}–{100 * high:.1f}]"


def _rounds() -> list[dict[str, Any]]:
    old = {
        "number": 1,
        "status": "published",
        "method": {"method": "ties"},
        "inputs": ["d1", "d2"],
        "evaluation": {
            "base": {"math": _old_row(0.25), "code": _old_row(0.5)},
            "expert:math:aaaaaaaaaaaa": {"math": _old_row(0.375), "code": _old_row(0.5)},
            "merged": {"math": _old_row(0.375), "code": _old_row(0.5)},
        },
        "checkpoint_id": "c" * 64,
        "decision": None,
        "error": None,
    }
    base2 = {"math": _row(12), "code": _row(16)}
    merged2 = {"math": _row(20), "code": _row(16)}
    published = {
        "number": 2,
        "status": "published",
        "method": {"method": "task_arithmetic"},
        "inputs": ["d3", "d4"],
        "evaluation": {
            "base": base2,
            "expert:math:bbbbbbbbbbbb": {"math": _row(18)},
            "expert:code:cccccccccccc": {"code": _row(17)},
            "merged": merged2,
        },
        "candidates": [
            {
                "spec": {"method": "task_arithmetic"},
                "chosen": True,
                "validation": {
                    d: {k: v for k, v in r.items() if k not in ("rewards", "successes", "task_ids")}
                    for d, r in merged2.items()
                },
            }
        ],
        "trigger": "quorum",
        "checkpoint_id": "d" * 64,
        "decision": publication_decision(base2, merged2, PublishPolicy()).to_dict()
        | {
            "gate": [
                {
                    "label": "expert:math:b",
                    "domain": "math",
                    "base": 0.375,
                    "expert": 0.5625,
                    "kept": True,
                    "p_worse": 0.98,
                },
                {
                    "label": "expert:code:c",
                    "domain": "code",
                    "base": 0.5,
                    "expert": 0.125,
                    "kept": False,
                    "p_worse": 0.00049,
                },
                {"label": "expert:x:d", "domain": "x", "base": None, "expert": None, "kept": True},
                {
                    "label": "expert:search:e",
                    "domain": "search",
                    "base": 0.5,
                    "expert": 0.5,
                    "kept": False,
                    "p_worse": 0.6,
                    "short_of_min_gain": True,
                },
            ],
            "subsets": [
                {"merged": ["expert:code:c"], "score": 0.25, "publish": False, "reason": "no"},
                {
                    "merged": ["expert:math:b"],
                    "score": 0.625,
                    "shortfall": 0.0625,
                    "publish": True,
                    "reason": "ok",
                },
            ],
        },
        "error": None,
    }
    merged3 = {"math": _row(8), "code": _row(16)}
    held_decision = publication_decision(
        merged2, merged3, PublishPolicy(), origin_scores=base2
    ).to_dict()
    held = {
        "number": 3,
        "status": "held",
        "method": {"method": "task_arithmetic"},
        "inputs": ["d5"],
        "evaluation": {
            "base": merged2,
            "expert:math:eeeeeeeeeeee": {"math": _row(9)},
            "merged": merged3,
        },
        "candidates": [],
        "trigger": "deadline",
        "checkpoint_id": None,
        "decision": held_decision,
        "error": f"round 3 held: {held_decision['reason']}",
    }
    return [old, published, held]


def test_success_cells_and_signed_points() -> None:
    assert success_cell(_row(20)) == _cell(20)
    assert re.fullmatch(r"62\.5% \[\d+\.\d–\d+\.\d\]", success_cell(_row(20)))
    assert success_cell(_old_row(0.5)) == "50.0%"
    assert success_cell(None) == success_cell({}) == "–"
    assert signed_points(0.125) == "+12.5"
    assert signed_points(-0.047) == "-4.7"
    assert signed_points(-1e-9) == "+0.0"


def test_a_round_s_merge_is_labelled_with_the_domains_it_scaled() -> None:
    spec = {"method": "task_arithmetic", "parameters": {"weight": 1.0}}
    assert method_label(spec) == "task_arithmetic"
    assert method_label(spec | {"domain_scale": {"math": 0.5}}) == "task_arithmetic, math ×0.5"
    assert method_label(spec | {"domain_scale": {"code": "x"}}) == "task_arithmetic, code ×?"
    assert method_label(None) == "?" and method_label({}) == "?"


def test_published_series_carries_the_value_over_a_held_round() -> None:
    rounds = _rounds()
    series = published_series(rounds)
    assert sorted(series) == ["code", "math"]
    math = series["math"]
    assert [p.round for p in math] == [0, 1, 2, 3]
    assert math[0] == ProgressPoint(0, 0.25, None, None, False)  # round 1's base, no interval
    assert math[1] == ProgressPoint(1, 0.375, None, None, False)
    low, high = wilson_interval(20, N)
    assert math[2] == ProgressPoint(2, 20 / N, low, high, False)
    # Round 3 was held: its merged 8/32 was not published, round 2's value stays.
    assert math[3] == ProgressPoint(3, 20 / N, low, high, True)
    assert [p.held for p in series["code"]] == [False, False, False, True]

    assert base_levels(rounds) == {
        "code": Score(0.5, None, None),
        "math": Score(0.25, None, None),
    }
    experts = expert_points(rounds)
    # Each expert on its own domain only, even where the row has others.
    assert [(n, s.rate) for n, s in experts["math"]] == [(1, 0.375), (2, 18 / N), (3, 9 / N)]
    assert [(n, s.rate) for n, s in experts["code"]] == [(2, 17 / N)]


def test_nothing_is_plotted_without_an_evaluation(tmp_path: Path) -> None:
    open_round = {"number": 1, "status": "open", "evaluation": {}}
    assert published_series([open_round]) == {}
    assert plot_published_progress([open_round], tmp_path / "lead.png") is None
    assert not (tmp_path / "lead.png").exists()


def test_report_shows_intervals_the_verdict_held_rounds_and_the_lead_plot(tmp_path: Path) -> None:
    rounds = _rounds()
    page_path = write_report(tmp_path / "report", rounds, {}, {"registry": tmp_path / "reg"})
    page = html.unescape(page_path.read_text())

    lead = tmp_path / "report" / "published-progress.png"
    assert lead.read_bytes().startswith(PNG_MAGIC)
    assert page.index('src="published-progress.png"') < page.index("Round 1: held-out success")

    round2 = page.split("Round 2: held-out success", 1)[1].split("Round 3:", 1)[0]
    assert f"<td>{_cell(20)}</td>" in round2  # merged on math
    # Columns are code, math: the math expert was scored on math only.
    assert f"<td>expert:math:bbbbbbbbbbbb</td><td>–</td><td>{_cell(18)}</td>" in round2
    assert "merged (task_arithmetic, published)" in round2
    assert "candidate task_arithmetic (validation tasks, chosen)" in round2
    assert "not worse than the current base on any domain" in round2
    # math: 20 vs 12 of the same 32 tasks, +25 points.
    assert re.search(
        r"<td>math</td><td>success</td><td>\+25\.0 \[\+\d+\.\d, \+\d+\.\d\]</td>", round2
    )

    held_reason = rounds[2]["decision"]["reason"]
    assert held_reason.startswith("worse than the current base beyond noise on math")
    round3 = page.split("Round 3: held-out success", 1)[1].split("<h2>", 1)[0]
    assert "held, not published" in round3 and held_reason in round3
    assert "merged (task_arithmetic, held, not published)" in round3
    against_base, against_origin = round3.split("candidate − round 0", 1)
    assert re.search(
        r"<td>math</td><td>success</td><td>-37\.5 \[-\d+\.\d, -\d+\.\d\]</td>", against_base
    )
    # Against round 0 (12 of the same 32 tasks): −12.5 points.
    assert re.search(
        r"<td>math</td><td>success</td><td>-12\.5 \[-\d+\.\d, [-+]\d+\.\d\]</td>", against_origin
    )
    assert "candidate − round 0" not in round2
    tried = round2.split("the merge tried again without a delta", 1)[1].split("</table>", 1)[0]
    assert "<td>expert:code:c</td><td>0.250</td><td>–</td><td>held: no</td>" in tried
    assert "<td>expert:math:b</td><td>0.625</td><td>0.062</td><td>passes: ok</td>" in tried
    assert "the merge tried again without a delta" not in round3
    gate = round2.split("the own-domain gate", 1)[1].split("</table>", 1)[0]
    assert "<td>expert:math:b</td><td>math</td><td>0.375</td><td>0.562</td><td>0.98</td>" in gate
    assert "<td>0.00049</td><td>left out</td>" in gate
    # A delta of a domain the coordinator does not evaluate: kept unscored.
    assert "<td>expert:x:d</td><td>x</td><td>–</td><td>–</td><td>–</td><td>kept</td>" in gate
    # Left out by [merge] own_domain_min_gain, not for being below the base.
    assert "<td>0.6</td><td>left out: gained too little</td>" in gate
    assert "own-domain gate" not in round3

    round1 = page.split("Round 1: held-out success", 1)[1].split("Round 2:", 1)[0]
    assert "<td>37.5%</td>" in round1 and "[" not in round1  # an old round: no intervals
    assert "candidate − base" not in round1  # and no verdict

    table = page.split("<h2>Rounds</h2>", 1)[1].split("</table>", 1)[0]
    assert f"<td>3</td><td>held</td><td>{held_reason}</td>" in table


@pytest.mark.parametrize("status", ["held", "published"])
def test_lead_plot_is_a_png_for_one_round(tmp_path: Path, status: str) -> None:
    record = {**_rounds()[1], "number": 1, "status": status}
    out = plot_published_progress([record], tmp_path / "one.png")
    assert out == tmp_path / "one.png" and out.read_bytes().startswith(PNG_MAGIC)
    assert [p.held for p in published_series([record])["math"]] == [False, status == "held"]
