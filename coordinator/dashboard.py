"""The coordinator's web dashboard: one page that reads the public /v1 API and shows the nodes
(domain, last seen, step, reward), the rounds with their evaluation tables, and the curves of
held-out success per domain, round after round. No build step and no external assets: the page is
plain HTML with a small script, safe to serve from an air-gapped box.
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
  .status-failed { color: #cf222e; }
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

function short(id) { return id ? String(id).slice(0, 12) : "–"; }

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
  const domains = [...new Set(labels.flatMap((label) => Object.keys(evaluation[label] || {})))];
  const rows = labels.map((label) => [label, ...domains.map((domain) =>
    percent((evaluation[label][domain] || {}).success_rate))]);
  return table(["model", ...domains.map((d) => d + " success")], rows);
}

function curves(rounds) {
  const points = {};
  for (const round of rounds) {
    const merged = (round.evaluation || {}).merged || {};
    for (const [domain, score] of Object.entries(merged)) {
      if (typeof score.success_rate === "number") {
        (points[domain] = points[domain] || []).push([round.number, score.success_rate]);
      }
    }
  }
  const domains = Object.keys(points).sort();
  if (!domains.length) return el("div", {class: "muted"}, "no merged rounds yet");
  const width = 520, height = 220, left = 40, bottom = 30, top = 10, right = 110;
  const numbers = domains.flatMap((d) => points[d].map((p) => p[0]));
  const lo = Math.min(...numbers), hi = Math.max(...numbers, lo + 1);
  const x = (n) => left + (width - left - right) * (n - lo) / (hi - lo);
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
  };
  for (const v of [0, 0.5, 1]) {
    add("line", {x1: left, x2: width - right, y1: y(v), y2: y(v), stroke: "#d0d7de"});
    add("text", {x: 4, y: y(v) + 4}, (100 * v) + "%");
  }
  add("text", {x: left, y: height - 8}, "round " + lo);
  add("text", {x: width - right - 50, y: height - 8}, "round " + hi);
  domains.forEach((domain, index) => {
    const color = COLORS[index % COLORS.length];
    const series = points[domain].sort((a, b) => a[0] - b[0]);
    add("polyline", {fill: "none", stroke: color, "stroke-width": 2,
      points: series.map(([n, v]) => x(n) + "," + y(v)).join(" ")});
    for (const [n, v] of series) add("circle", {cx: x(n), cy: y(v), r: 3, fill: color});
    add("text", {x: width - right + 8, y: top + 14 * (index + 1), fill: color,
      "data-domain": domain}, domain);
  });
  return svg;
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
      " · " + (round.method && round.method.method ? round.method.method : "–"),
      " · " + (round.inputs || []).length + " deltas",
      round.trigger ? " · " + round.trigger : "",
      round.checkpoint_id ? " · checkpoint " + short(round.checkpoint_id) : "",
      round.error ? el("div", {class: "status-failed"}, round.error) : "",
      evaluationTable(round.evaluation))));
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
