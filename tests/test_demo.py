"""`skillswarm demo --quick` as a user runs it: a real subprocess that starts the coordinator and
three nodes as processes on 127.0.0.1, runs two rounds and writes the report."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

from skillswarm.agent.model import load_policy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DOMAINS = ("code", "math", "search")


def _cells(table_html: str) -> list[list[str]]:
    rows = re.findall(r"<tr>(.*?)</tr>", table_html, flags=re.S)
    return [
        [html.unescape(cell) for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)]
        for row in rows
    ]


def test_quick_demo_runs_two_rounds_and_writes_the_report(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", "demo", "--quick", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    report = workdir / "report"
    page = (report / "index.html").read_text()
    for round_number in (1, 2):
        heading = f"Round {round_number}: held-out success"
        assert heading in page
        table = page.split(heading, 1)[1].split("</table>", 1)[0]
        header, *rows = _cells(table)
        assert header[1:] == list(DOMAINS)
        labels = [row[0] for row in rows]
        assert labels[0] == "base"
        assert sorted(label.split(":")[1] for label in labels if label.startswith("expert:")) == [
            "code",
            "math",
            "search",
        ]
        assert any(label.startswith("merged (") and "published" in label for label in labels)
        # the default merge plan: task arithmetic at λ 1 with math's deltas at half size, and
        # no other candidate to choose on the validation tasks
        assert any(label.startswith("merged (task_arithmetic, math ×0.5, ") for label in labels)
        assert not [label for label in labels if label.startswith("candidate")]
        cell = re.compile(r"\d+\.\d% \[\d+\.\d–\d+\.\d\]|–")
        for row in rows:
            assert len(row) == 4 and all(cell.fullmatch(c) for c in row[1:]), row
        experts = [row for row in rows if row[0].startswith("expert:")]
        for row in experts:  # each expert is scored on its own domain only
            own = row[0].split(":")[1]
            assert [c != "–" for c in row[1:]] == [d == own for d in DOMAINS], row

    curves = sorted(report.glob("curves-*.png"))
    assert [p.name for p in curves] == [
        "curves-node-0-math.png",
        "curves-node-1-code.png",
        "curves-node-2-search.png",
    ]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in curves)
    for png in curves:
        assert f'src="{png.name}"' in page

    rounds = json.loads((report / "rounds.json").read_text())
    published = [r for r in rounds if r["status"] == "published"]
    assert [r["number"] for r in published] == [1, 2]
    assert all(len(r["inputs"]) == 3 for r in published)
    # Round 2's inputs were trained on round 1's merged checkpoint.
    assert published[1]["base_id"] == published[0]["checkpoint_id"]

    model, tokenizer = load_policy(workdir / "pulled")
    assert tokenizer.chat_template and model.config.model_type == "qwen2"
    output = result.stdout + result.stderr
    assert "report:" in output and "it does not show learning" in output
    assert "published − base" in output
    assert (report / "published-progress.png").read_bytes().startswith(PNG_MAGIC)
