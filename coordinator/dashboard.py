"""The coordinator's web dashboard: one page that reads the public /v1 API and shows the nodes
(domain, last seen, step, reward), the rounds with their evaluation tables (success rates with
their intervals), the publication verdict of each round (published or held, why, the own-domain
gate's entries, and the paired difference to the base), and the published model's held-out
success per domain from the base (round 0) on, each line named at its end. No build step and no
external assets: the page is plain HTML with a small script, safe to serve from an air-gapped box.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>skillswarm coordinator</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; color: #1b1f24; }
  h1 { font-size: 1.3rem; margin: 0 0 .25rem; }
  h2 { font-size: 1.05rem; margin: 1.5rem 0 .5rem; }
  .muted { color: #667; }
  table { border-collapse: collapse; margin: .25rem 0 1rem; }
  th, td { border: 1px solid #d0d7de; padding: .25rem .6rem; text-align: left; }
  th { background: #f6f8fa; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .round { border: 1px solid #d0d7de; border-radius: 6px; padding: .5rem .9rem; margin: .5rem 0; }
  .status-published, .status-merged { color: #1a7f37; }
  .status-held { color: #9a6700; }
  .status-failed { color: #cf222e; }
  .decision { margin: .25rem 0; }
  code { font-size: 12px; }
  svg text { font-size: 11px; fill: #445; }
</style>
</head>
<body>
<h1>skillswarm coordinator</h1>
<div id="info" class="muted">loading…</div>
<h2>Nodes</h2>
<div id="nodes"></div>
<h2>Held-out success per round</h2>
<div id="curves"></div>
<h2>Rounds</h2>
<div id="rounds"></div>
<h2>Checkpoints</h2>
<div id="checkpoints"></div>
<script>
"use strict";
const COLORS = ["#0969da", "#1a7f37", "#bf3989", "#9a6700", "#8250df", "#cf222e"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(headers, rows, id) {
  const head = el("tr", {}, ...headers.map((h) => el("th", {}, h)));
  const body = rows.map((row) => el("tr", {}, ...row.map((cell) =>
    typeof cell === "number" ? el("td", {class: "num"}, cell) : el("td", {}, cell ?? "–"))));
  return el("table", id ? {id} : {}, el("thead", {}, head), el("tbody", {}, ...body));
}

function percent(value) {
  return typeof value === "number" ? (100 * value).toFixed(1) + "%" : "–";
}

// "62.5% [50.3–73.4]": a scores row's success rate and its interval (the rate alone for rows
// recorded without one, "–" for a domain the model was not scored on).
function successCell(row) {
  if (!row || typeof row.success_rate !== "number") return "–";
  if (typeof row.success_low !== "number" || typeof row.success_high !== "number") {
    return percent(row.success_rate);
  }
  return percent(row.success_rate) + " [" + (100 * row.success_low).toFixed(1) + "–" +
    (100 * row.success_high).toFixed(1) + "]";
}

// A difference of fractions as signed percentage points: 0.125 -> "+12.5".
function signedPoints(value) {
  if (typeof value !== "number") return "–";
  const shown = (100 * value).toFixed(1);
  return Number(shown) >= 0 ? "+" + shown.replace("-", "") : shown;
}

function short(id) { return id ? String(id).slice(0, 12) : "–"; }
function methodLabel(method) {
  if (!method || !method.method) return "–";
  const scale = method.domain_scale && typeof method.domain_scale === "object"
    ? Object.entries(method.domain_scale).map(([d, s]) => ", " + d + " ×" + s).join("") : "";
  return method.method + scale;
}

function ago(iso) {
  if (!iso) return "–";
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 90) return Math.round(seconds) + " s ago";
  if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
  return Math.round(seconds / 3600) + " h ago";
}

function evaluationTable(evaluation) {
  const labels = Object.keys(evaluation || {});
  if (!labels.length) return el("div", {class: "muted"}, "no evaluation yet");
  const domains = [...new Set(labels.flatMap((label) => Object.keys(evaluation[label] || {})))]
    .sort();
  const rows = labels.map((label) => [label, ...domains.map((domain) =>
    successCell((evaluation[label] || {})[domain]))]);
  return table(["model", ...domains.map((d) => d + " success")], rows);
}

// The publication rule's verdict: published or held and why, the own-domain gate's entries (each
// delta's own-domain mean reward alone beside the base's, and whether it was merged), and per
// domain the paired
// difference candidate − base on the validation tasks with its interval and p-values (and,
// from round 2 on, candidate − round 0).
function decisionBlock(round) {
  const decision = round.decision;
  if (!decision) return round.error ? el("div", {class: "status-failed"}, round.error) : "";
  const p = (value) => typeof value === "number" ? value.toPrecision(3) : "–";
  const reward = (value) => typeof value === "number" ? value.toFixed(3) : "–";
  const comparisonTable = (byDomain, versus) => {
    const comparisons = Object.entries(byDomain || {}).sort((a, b) => a[0].localeCompare(b[0]));
    return comparisons.length ? table(
      ["domain", "candidate − " + versus + " (points)", "tasks", "p worse", "p better"],
      comparisons.map(([domain, c]) => [domain,
        signedPoints(c.mean) + " [" + signedPoints(c.low) + ", " + signedPoints(c.high) + "]",
        c.n, p(c.p_worse), p(c.p_better)])) : "";
  };
  return el("div", {class: "decision"},
    el("div", {class: decision.publish ? "status-published" : "status-held"},
      (decision.publish ? "publish: " : "held: ") + decision.reason),
    (decision.gate || []).length ? table(
      ["own-domain gate: delta", "domain", "base mean reward", "delta alone", "p worse",
        "verdict"],
      decision.gate.map((g) => [g.label, g.domain, reward(g.base), reward(g.expert),
        p(g.p_worse), g.kept ? "kept" : g.short_of_min_gain ? "left out: gained too little"
          : "left out"]), "gate-" + round.number) : "",
    (decision.subsets || []).length ? table(
      ["merged again without a delta", "validation mean reward", "largest shortfall",
        "verdict"],
      decision.subsets.map((s) => [(s.merged || []).join(", "),
        typeof s.score === "number" ? s.score.toFixed(3) : "–",
        typeof s.shortfall === "number" ? s.shortfall.toFixed(3) : "–",
        (s.publish ? "passes: " : "held: ") + (s.reason || "")])) : "",
    comparisonTable(decision.comparisons, "base"),
    comparisonTable(decision.origin_comparisons, "round 0"));
}

// Per domain, the published model's success after each evaluated round, from the base at round
// 0 (the first evaluated round's base: a round before it published nothing, or it would have
// been evaluated): a published round's merged row, or for a held round the value carried over.
function publishedSeries(rounds) {
  const evaluated = rounds.filter((r) => Object.keys(r.evaluation || {}).length)
    .sort((a, b) => a.number - b.number);
  const points = {};
  if (!evaluated.length) return points;
  let current = {};
  for (const [domain, row] of Object.entries(evaluated[0].evaluation.base || {})) {
    if (row && typeof row.success_rate === "number") current[domain] = row;
  }
  const add = (number, held) => {
    for (const [domain, row] of Object.entries(current)) {
      (points[domain] = points[domain] || []).push({number, row, held});
    }
  };
  add(0, false);
  for (const round of evaluated) {
    const published = round.status === "published";
    if (published) {
      for (const [domain, row] of Object.entries(round.evaluation.merged || {})) {
        if (row && typeof row.success_rate === "number") current = {...current, [domain]: row};
      }
    }
    add(round.number, !published);
  }
  return points;
}

// The published model's success per domain against the round, from the base (round 0); each
// line is named at its end, the names pushed apart where lines end close together.
function curves(rounds) {
  const points = publishedSeries(rounds);
  const domains = Object.keys(points).sort();
  if (!domains.length) return el("div", {class: "muted"}, "no evaluated rounds yet");
  const width = 520, height = 220, left = 40, bottom = 30, top = 10, right = 90;
  const hi = Math.max(1, ...domains.flatMap((d) => points[d].map((p) => p.number)));
  const x = (n) => left + (width - left - right) * n / hi;
  const y = (v) => top + (height - top - bottom) * (1 - v);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  svg.setAttribute("id", "curves-svg");
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(ns, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    svg.appendChild(node);
    return node;
  };
  for (const v of [0, 0.5, 1]) {
    add("line", {x1: left, x2: width - right, y1: y(v), y2: y(v), stroke: "#d0d7de"});
    add("text", {x: 4, y: y(v) + 4}, (100 * v) + "%");
  }
  const every = Math.ceil(hi / 8);
  for (let n = 0; n <= hi; n += every) {
    add("text", {x: x(n), y: height - 12, "text-anchor": "middle", class: "round-tick"},
      n === 0 ? "base" : String(n));
  }
  const ends = [];
  domains.forEach((domain, index) => {
    const color = COLORS[index % COLORS.length];
    const series = points[domain];
    add("polyline", {fill: "none", stroke: color, "stroke-width": 2, "data-domain": domain,
      points: series.map((p) => x(p.number) + "," + y(p.row.success_rate)).join(" ")});
    for (const {number, row, held} of series) {
      if (typeof row.success_low === "number" && typeof row.success_high === "number") {
        add("line", {x1: x(number), x2: x(number), y1: y(row.success_low),
          y2: y(row.success_high), stroke: color, "stroke-width": 1, "stroke-opacity": 0.6});
      }
      add("circle", {cx: x(number), cy: y(row.success_rate), r: held ? 4 : 3,
        fill: held ? "#fff" : color, stroke: color, "stroke-width": held ? 2 : 0,
        "data-held": held ? "true" : "false", "data-domain": domain});
    }
    const last = series[series.length - 1];
    ends.push({domain, color, x: x(last.number) + 8, y: y(last.row.success_rate) + 4});
  });
  ends.sort((a, b) => a.y - b.y);
  for (let i = 1; i < ends.length; i++) ends[i].y = Math.max(ends[i].y, ends[i - 1].y + 12);
  for (const end of ends) {
    add("text", {x: end.x, y: end.y, fill: end.color, "data-domain": end.domain,
      class: "line-label"}, end.domain);
  }
  return el("div", {}, svg,
    el("div", {class: "muted"}, "○ a held round (the published model carried over) · | interval"));
}

async function getJSON(path) {
  const response = await fetch(path, {headers: {accept: "application/json"}});
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

async function refresh() {
  try {
    const [info, nodes, rounds, checkpoints] = await Promise.all([
      getJSON("/v1/info"), getJSON("/v1/nodes"), getJSON("/v1/rounds"),
      getJSON("/v1/checkpoints")]);
    document.getElementById("info").replaceChildren(
      "round ", el("b", {id: "current-round"}, info.round), " · base ",
      el("code", {}, short(info.base_id)), " · peer ", el("code", {}, short(info.peer_id)),
      " · topic ", el("code", {}, info.topic));
    document.getElementById("nodes").replaceChildren(nodes.length ? table(
      ["peer", "domain", "last seen", "round", "step", "reward", "accepted", "rejected"],
      nodes.map((n) => [short(n.peer_id), n.domain, ago(n.last_seen), n.round, n.step,
        typeof n.reward === "number" ? Number(n.reward.toFixed(3)) : null, n.accepted,
        n.rejected]), "nodes-table") : el("div", {class: "muted"}, "no nodes seen yet"));
    const ordered = [...rounds].sort((a, b) => b.number - a.number);
    document.getElementById("curves").replaceChildren(curves(rounds));
    document.getElementById("rounds").replaceChildren(...ordered.map((round) => el("div",
      {class: "round", "data-round": round.number},
      el("b", {}, "round " + round.number), " ",
      el("span", {class: "status-" + round.status}, round.status),
      " · " + methodLabel(round.method),
      " · " + (round.inputs || []).length + " deltas",
      round.trigger ? " · " + round.trigger : "",
      round.checkpoint_id ? " · checkpoint " + short(round.checkpoint_id) : "",
      evaluationTable(round.evaluation),
      decisionBlock(round))));
    document.getElementById("checkpoints").replaceChildren(table(
      ["revision", "round", "retired"],
      checkpoints.map((c) => [c.revision, c.round, c.retired ? "yes" : "no"])));
    document.body.dataset.loaded = "true";
  } catch (error) {
    document.getElementById("info").textContent = "could not load: " + error.message;
  }
}
refresh();
setInterval(refresh, 5000);
</script>
</body>
</html>
"""


def dashboard_router() -> APIRouter:
    """`GET /` and `GET /dashboard`: the dashboard page (it reads the public /v1 API)."""
    router = APIRouter(tags=["dashboard"])

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    @router.get("/dashboard", response_class=HTMLResponse, summary="The web dashboard")
    def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD_HTML)

    return router
