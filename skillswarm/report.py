"""The demo's run report: one HTML page (no external assets) with the held-out score table of every
round (base, each expert, the merged model, and every merge method tried), the nodes' reward
curves as PNGs, the rounds, and where the checkpoints and logs are."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from skillswarm.node.metrics import plot_reward_curves, read_metrics
from skillswarm.protocol.durable import write_bytes_atomically


def _percent(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, int | float) else "–"


def score_rows(round_record: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(domains, rows): a row per evaluated model of the round (base, experts, merged) and per
    merge candidate tried on the validation tasks, each row the held-out success per domain."""
    evaluation: Mapping[str, Mapping[str, Any]] = round_record.get("evaluation") or {}
    domains = sorted({domain for scores in evaluation.values() for domain in scores})
    rows: list[tuple[str, list[str]]] = []
    method = (round_record.get("method") or {}).get("method", "?")
    for label, scores in evaluation.items():
        shown = f"merged ({method}, published)" if label == "merged" else label
        rows.append((shown, [_percent(scores.get(d, {}).get("success_rate")) for d in domains]))
    for candidate in round_record.get("candidates") or []:
        name = (candidate.get("spec") or {}).get("method", "?")
        chosen = ", chosen" if candidate.get("chosen") else ""
        if candidate.get("error"):
            rows.append(
                (f"candidate {name}: failed", [candidate["error"]] + [""] * (len(domains) - 1))
            )
            continue
        scores = candidate.get("validation") or {}
        rows.append(
            (
                f"candidate {name} (validation tasks{chosen})",
                [_percent((scores.get(d) or {}).get("success_rate")) for d in domains],
            )
        )
    return domains, rows


def plot_node_curves(node_dirs: Mapping[str, Path], out_dir: Path) -> list[Path]:
    """One PNG per node of its reward and success rate over its training steps, rounds one
    after another; returns the PNGs written."""
    written: list[Path] = []
    for name, node_dir in node_dirs.items():
        records: list[dict[str, Any]] = []
        offset = 0
        for log in sorted((node_dir / "metrics").glob("round-*.jsonl")):
            run = read_metrics(log)
            for record in run:
                records.append({**record, "step": offset + int(record["step"])})
            offset += len(run)
        if records:
            png = out_dir / f"curves-{name}.png"
            plot_reward_curves(records, png, title=f"{name}: reward while training")
            written.append(png)
    return written


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(
    out_dir: Path,
    rounds: Sequence[Mapping[str, Any]],
    node_dirs: Mapping[str, Path],
    locations: Mapping[str, Path | str],
    title: str = "skillswarm demo",
) -> Path:
    """Write `out_dir/index.html` (plus the curve PNGs and `rounds.json`); returns the page."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = plot_node_curves(node_dirs, out_dir)
    sections = [f"<h1>{html.escape(title)}</h1>"]
    for record in sorted(rounds, key=lambda r: r["number"]):
        domains, rows = score_rows(record)
        sections.append(
            f"<h2>Round {record['number']}: held-out success</h2>"
            + _table(["model", *domains], [[label, *cells] for label, cells in rows])
        )
    sections.append(
        "<h2>Rounds</h2>"
        + _table(
            ["round", "status", "method", "trigger", "deltas", "checkpoint", "merge seconds"],
            [
                [
                    str(r["number"]),
                    r.get("status", "?"),
                    (r.get("method") or {}).get("method", "?"),
                    r.get("trigger") or "–",
                    str(len(r.get("inputs") or [])),
                    (r.get("checkpoint_id") or "–")[:16],
                    f"{r['merge_seconds']:.1f}" if r.get("merge_seconds") else "–",
                ]
                for r in sorted(rounds, key=lambda r: r["number"])
            ],
        )
    )
    sections.append(
        "<h2>Reward curves</h2>"
        + "".join(
            f'<figure><img src="{html.escape(png.name)}" alt="{html.escape(png.stem)}">'
            f"<figcaption>{html.escape(png.stem)}</figcaption></figure>"
            for png in pngs
        )
    )
    sections.append(
        "<h2>Where things are</h2>"
        + _table(["", "path"], [[name, str(path)] for name, path in locations.items()])
    )
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>"
        "body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#1b1f24}"
        "table{border-collapse:collapse;margin:.4rem 0 1rem}"
        "th,td{border:1px solid #d0d7de;padding:.25rem .6rem;text-align:left}"
        "th{background:#f6f8fa}img{max-width:640px}figure{display:inline-block;margin:.5rem}"
        "</style></head><body>" + "".join(sections) + "</body></html>"
    )
    write_bytes_atomically(
        out_dir / "rounds.json", json.dumps(list(rounds), indent=2, default=str).encode()
    )
    target = out_dir / "index.html"
    write_bytes_atomically(target, page.encode("utf-8"))
    return target
