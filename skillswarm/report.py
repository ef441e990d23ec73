"""The demo's run report: one HTML page (no external assets) led by a plot of the published model's
held-out success per round, then every round's score table (base, each expert, the merged model,
every merge candidate tried) with intervals and the publication verdict, the nodes' reward curves
as PNGs, the rounds, and where the checkpoints and logs are."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from skillswarm.node.metrics import plot_reward_curves, read_metrics, write_figure_png
from skillswarm.protocol.durable import write_bytes_atomically

LEAD_PNG = "published-progress.png"


class Score(NamedTuple):
    """A success rate and its interval (None for rows recorded before intervals were)."""

    rate: float
    low: float | None
    high: float | None


class ProgressPoint(NamedTuple):
    """The published model's success on one domain after round `round`; `held` when that round
    published nothing, so the value is the one carried over from before."""

    round: int
    rate: float
    low: float | None
    high: float | None
    held: bool


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _percent(value: Any) -> str:
    number = _number(value)
    return "–" if number is None else f"{100 * number:.1f}%"


def score_of(row: Mapping[str, Any] | None) -> Score | None:
    """A scores row's success rate and interval; None when the row has no success rate."""
    row = row or {}
    rate = _number(row.get("success_rate"))
    if rate is None:
        return None
    return Score(rate, _number(row.get("success_low")), _number(row.get("success_high")))


def success_cell(row: Mapping[str, Any] | None) -> str:
    """ "62.5% [50.3–73.4]": the success rate and its interval; the rate alone for a row without
    an interval, "–" for a domain the model was not scored on."""
    score = score_of(row)
    if score is None:
        return "–"
    if score.low is None or score.high is None:
        return _percent(score.rate)
    return f"{_percent(score.rate)} [{100 * score.low:.1f}–{100 * score.high:.1f}]"


def signed_points(value: Any) -> str:
    """A difference of fractions as signed percentage points: 0.125 -> "+12.5"."""
    number = _number(value)
    return "–" if number is None else f"{round(100 * number, 1) + 0.0:+.1f}"


def _status_word(record: Mapping[str, Any]) -> str:
    status = str(record.get("status") or "published")
    return "held, not published" if status == "held" else status


def method_label(recorded: Any) -> str:
    """A round's recorded merge as a short label: its method, and each domain it scaled
    ("task_arithmetic, math ×0.5")."""
    if not isinstance(recorded, Mapping):
        return "?"
    label = str(recorded.get("method", "?"))
    scale = recorded.get("domain_scale")
    if isinstance(scale, Mapping):
        for domain, value in scale.items():
            number = _number(value)
            label += f", {domain} ×{number:g}" if number is not None else f", {domain} ×?"
    return label


def score_rows(round_record: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(domains, rows): a row per evaluated model of the round (base, experts, merged) and per
    merge candidate tried on the validation tasks, each row the held-out success per domain with
    its interval ("–" where the model was not scored on that domain)."""
    evaluation: Mapping[str, Mapping[str, Any]] = round_record.get("evaluation") or {}
    domains = sorted({domain for scores in evaluation.values() for domain in scores})
    rows: list[tuple[str, list[str]]] = []
    method = method_label(round_record.get("method"))
    for label, scores in evaluation.items():
        shown = f"merged ({method}, {_status_word(round_record)})" if label == "merged" else label
        rows.append((shown, [success_cell(scores.get(d)) for d in domains]))
    for candidate in round_record.get("candidates") or []:
        spec = candidate.get("spec") or {}
        parameters = ", ".join(f"{k}={v}" for k, v in (spec.get("parameters") or {}).items())
        name = spec.get("method", "?") + (f" {parameters}" if parameters else "")
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
                [success_cell(scores.get(d)) for d in domains],
            )
        )
    return domains, rows


def decision_rows(round_record: Mapping[str, Any], against: str = "comparisons") -> list[list[str]]:
    """Per domain, the publication rule's paired difference candidate − base on the validation
    tasks (`against="origin_comparisons"`: candidate − round 0): [domain, metric,
    "+12.5 [+4.7, +20.3]", n, p worse, p better, test]; [] without a decision."""
    comparisons = (round_record.get("decision") or {}).get(against) or {}
    rows = []
    for domain, comparison in sorted(comparisons.items()):
        interval = (
            f"[{signed_points(comparison.get('low'))}, {signed_points(comparison.get('high'))}]"
        )
        p_values = [_number(comparison.get(key)) for key in ("p_worse", "p_better")]
        rows.append(
            [
                domain,
                f"{comparison.get('metric', 'success')}",
                f"{signed_points(comparison.get('mean'))} {interval}",
                str(comparison.get("n", "–")),
                *("–" if p is None else f"{p:.3g}" for p in p_values),
                str(comparison.get("method", "–")),
            ]
        )
    return rows


def _evaluated(rounds: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted((r for r in rounds if r.get("evaluation")), key=lambda r: r["number"])


def base_levels(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Score]:
    """The starting base's success per domain: the "base" row of the first evaluated round."""
    evaluated = _evaluated(rounds)
    if not evaluated:
        return {}
    base = evaluated[0]["evaluation"].get("base") or {}
    return {domain: score for domain in sorted(base) if (score := score_of(base[domain]))}


def published_series(rounds: Sequence[Mapping[str, Any]]) -> dict[str, list[ProgressPoint]]:
    """Per domain, the published model's success after each evaluated round: the starting base
    at the round before the first, then a published round's "merged" row, or, for a round that
    published nothing (held), the previous value carried over and marked held."""
    evaluated = _evaluated(rounds)
    if not evaluated:
        return {}
    start = int(evaluated[0]["number"]) - 1
    current = base_levels(rounds)
    series = {domain: [ProgressPoint(start, *score, False)] for domain, score in current.items()}
    for record in evaluated:
        published = record.get("status", "published") == "published"
        merged = record["evaluation"].get("merged") or {}
        if published:
            current = {
                **current,
                **{d: s for d in merged if (s := score_of(merged[d])) is not None},
            }
        for domain, score in sorted(current.items()):
            point = ProgressPoint(int(record["number"]), *score, not published)
            series.setdefault(domain, []).append(point)
    return series


def expert_points(rounds: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, Score]]]:
    """Per domain, each round's experts ("expert:<domain>:<id>", one delta applied alone to the
    base) scored on their own domain: (round, score)."""
    points: dict[str, list[tuple[int, Score]]] = {}
    for record in _evaluated(rounds):
        for label, scores in record["evaluation"].items():
            parts = label.split(":")
            if len(parts) < 2 or parts[0] != "expert":
                continue
            domain = parts[1]
            score = score_of(scores.get(domain))
            if score is not None:
                points.setdefault(domain, []).append((int(record["number"]), score))
    return points


def _error_bars(scores: Sequence[Score | ProgressPoint]) -> list[list[float]]:
    """Matplotlib's asymmetric yerr, in points; no bar where a row has no interval."""
    below = [100 * (s.rate - s.low) if s.low is not None else 0.0 for s in scores]
    above = [100 * (s.high - s.rate) if s.high is not None else 0.0 for s in scores]
    return [[max(0.0, v) for v in below], [max(0.0, v) for v in above]]


def plot_published_progress(rounds: Sequence[Mapping[str, Any]], out_png: Path) -> Path | None:
    """One panel per domain of held-out success against the round: the published model (held
    rounds marked, their value carried over), the starting base (flat, its interval as a band)
    and each round's experts on their own domain, intervals as error bars. Writes the PNG
    atomically; returns None (and writes nothing) when no round has an evaluation."""
    published = published_series(rounds)
    base = base_levels(rounds)
    experts = expert_points(rounds)
    domains = sorted(set(published) | set(experts))
    if not domains:
        return None
    first = min(point.round for points in published.values() for point in points)
    last = max(int(r["number"]) for r in _evaluated(rounds))

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(3, len(domains))
    rows = -(-len(domains) // columns)
    figure = Figure(figsize=(4.4 * columns, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for axis in axes[len(domains) :]:
        axis.set_visible(False)
    for axis, domain in zip(axes, domains, strict=False):
        if domain in base:
            level = base[domain]
            if level.low is not None and level.high is not None:
                axis.axhspan(100 * level.low, 100 * level.high, color="0.5", alpha=0.15, lw=0)
            axis.axhline(100 * level.rate, color="0.4", ls="--", lw=1, label="starting base")
        if domain in experts:
            scores = [score for _, score in experts[domain]]
            axis.errorbar(
                [number + 0.15 for number, _ in experts[domain]],
                [100 * s.rate for s in scores],
                yerr=_error_bars(scores),
                fmt="^",
                color="C2",
                ms=5,
                capsize=2,
                label="expert (alone, own domain)",
            )
        points = published.get(domain, [])
        if points:
            axis.plot([p.round for p in points], [100 * p.rate for p in points], color="C0", lw=1.5)
            for held, style in (
                (False, {"fmt": "o", "color": "C0", "label": "published model"}),
                (True, {"fmt": "X", "color": "C3", "label": "held round (value carried over)"}),
            ):
                chosen = [p for p in points if p.held is held]
                if chosen:
                    axis.errorbar(
                        [p.round for p in chosen],
                        [100 * p.rate for p in chosen],
                        yerr=_error_bars(chosen),
                        ms=6,
                        capsize=3,
                        **style,
                    )
        axis.set_title(domain)
        axis.set_xlim(first - 0.4, last + 0.5)
        axis.set_xticks(range(first, last + 1))
        axis.set_ylim(-2, 102)
        axis.set_xlabel("round")
        axis.set_ylabel("held-out success (%)")
        axis.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize="x-small")
    figure.suptitle("Held-out success per round (bars and band: 95% intervals)")
    return write_figure_png(figure, out_png)


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


def round_outcome(record: Mapping[str, Any]) -> str:
    """Why the round ended as it did: the publication rule's reason, else the round's error."""
    reason = (record.get("decision") or {}).get("reason")
    return str(reason or record.get("error") or "–")


def gate_rows(record: Mapping[str, Any]) -> list[list[str]]:
    """The own-domain gate's entries of a round: per delta [label, domain, the base's and the
    delta's own-domain validation mean reward, p worse, "kept" or "left out"]; [] without a
    gate."""

    def reward(value: Any) -> str:
        number = _number(value)
        return "–" if number is None else f"{number:.3f}"

    entries = (record.get("decision") or {}).get("gate") or []
    return [
        [
            str(entry.get("label", "?")),
            str(entry.get("domain", "?")),
            reward(entry.get("base")),
            reward(entry.get("expert")),
            "–" if _number(entry.get("p_worse")) is None else f"{entry['p_worse']:.3g}",
            "kept"
            if entry.get("kept")
            else "left out: gained too little"
            if entry.get("short_of_min_gain")
            else "left out",
        ]
        for entry in entries
    ]


def _round_section(record: Mapping[str, Any]) -> str:
    domains, rows = score_rows(record)
    status = str(record.get("status") or "?")
    outcome = round_outcome(record)
    section = (
        f"<h2>Round {record['number']}: held-out success</h2>"
        f'<p>status: <b class="status-{html.escape(status)}">{html.escape(_status_word(record))}'
        f"</b>{' · ' + html.escape(outcome) if outcome != '–' else ''}</p>"
        + _table(["model", *domains], [[label, *cells] for label, cells in rows])
    )
    gate = gate_rows(record)
    if gate:
        section += f"<h3>Round {record['number']}: the own-domain gate</h3>" + _table(
            ["delta", "domain", "base mean reward", "delta alone", "p worse", "verdict"], gate
        )
    subsets = (record.get("decision") or {}).get("subsets") or []
    if subsets:
        section += f"<h3>Round {record['number']}: the merge tried again without a delta</h3>"
        section += _table(
            ["deltas merged", "validation mean reward", "largest shortfall", "verdict"],
            [
                [
                    ", ".join(str(label) for label in subset.get("merged") or []),
                    "–" if _number(subset.get("score")) is None else f"{subset['score']:.3f}",
                    "–"
                    if _number(subset.get("shortfall")) is None
                    else f"{subset['shortfall']:.3f}",
                    ("passes: " if subset.get("publish") else "held: ")
                    + str(subset.get("reason", "")),
                ]
                for subset in subsets
            ],
        )
    for against, versus in (("comparisons", "base"), ("origin_comparisons", "round 0")):
        comparisons = decision_rows(record, against)
        if comparisons:
            section += (
                f"<h3>Round {record['number']}: candidate − {versus} on the validation tasks</h3>"
                + _table(
                    ["domain", "metric", "difference (points)", "tasks", "p worse", "p better"]
                    + ["test"],
                    comparisons,
                )
            )
    return section


def write_report(
    out_dir: Path,
    rounds: Sequence[Mapping[str, Any]],
    node_dirs: Mapping[str, Path],
    locations: Mapping[str, Path | str],
    title: str = "skillswarm demo",
) -> Path:
    """Write `out_dir/index.html` (plus the lead plot, the curve PNGs and `rounds.json`);
    returns the page."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rounds, key=lambda r: r["number"])
    lead = plot_published_progress(ordered, out_dir / LEAD_PNG)
    pngs = plot_node_curves(node_dirs, out_dir)
    sections = [f"<h1>{html.escape(title)}</h1>"]
    if lead is not None:
        sections.append(
            f'<figure class="lead"><img src="{html.escape(lead.name)}" '
            'alt="held-out success per domain per round"><figcaption>Held-out success per '
            "domain per round: the published model (a held round publishes nothing and keeps "
            "the value before it), the starting base, and each expert alone on its own domain; "
            "bars and band are 95% Wilson intervals.</figcaption></figure>"
        )
    else:
        sections.append("<p>No round has an evaluation yet.</p>")
    sections.extend(_round_section(record) for record in ordered)
    sections.append(
        "<h2>Rounds</h2>"
        + _table(
            [
                "round",
                "status",
                "reason",
                "method",
                "trigger",
                "deltas",
                "checkpoint",
                "merge seconds",
            ],
            [
                [
                    str(r["number"]),
                    r.get("status", "?"),
                    round_outcome(r),
                    method_label(r.get("method")),
                    r.get("trigger") or "–",
                    str(len(r.get("inputs") or [])),
                    (r.get("checkpoint_id") or "–")[:16],
                    f"{r['merge_seconds']:.1f}" if r.get("merge_seconds") else "–",
                ]
                for r in ordered
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
        "figure.lead{display:block;margin:.5rem 0 1.5rem}figure.lead img{max-width:100%}"
        ".status-published{color:#1a7f37}.status-held{color:#9a6700}"
        ".status-failed{color:#cf222e}"
        "</style></head><body>" + "".join(sections) + "</body></html>"
    )
    write_bytes_atomically(
        out_dir / "rounds.json", json.dumps(list(rounds), indent=2, default=str).encode()
    )
    target = out_dir / "index.html"
    write_bytes_atomically(target, page.encode("utf-8"))
    return target
