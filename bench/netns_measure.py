"""What one scenario of bench_swarm_netns.py measured (per round and in total, the registry under
load) and how it is printed and plotted."""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from netns_lib import (
    REPO,
    Net,
    Node,
    get_json,
    log_problems,
    percentile,
    proc_stats,
    read_events,
    try_json,
)


def coordinator_stats(coord: Node) -> dict[str, Any]:
    """The coordinator process's peak RSS (MiB) and CPU seconds so far."""
    stats = proc_stats(coord.proc.pid) if coord.proc is not None else {}
    return {
        "coordinator_peak_rss_mib": stats.get("VmHWM"),
        "coordinator_cpu_s": stats.get("cpu_s"),
    }


def measure(
    coord: Node,
    coord_url: str,
    peers: list[Node],
    samples: list[tuple[float, int, int]],
    health: dict[str, dict[str, Any]],
    faults: list[dict[str, Any]],
    published: dict[int, float],
    t0: float,
    done_reason: str,
) -> dict[str, Any]:
    """What one scenario measured, from the coordinator's API, the peers' event files and
    health, the veth counters and the processes: per round and in total (docstring of
    bench_swarm_netns.py)."""
    result: dict[str, Any] = {"end": done_reason, "faults": faults}
    result.update(coordinator_stats(coord))
    peer_rss = [
        proc_stats(p.proc.pid).get("VmRSS")
        for p in peers
        if p.proc is not None and p.proc.poll() is None
    ]
    peer_rss = [r for r in peer_rss if r]
    result["peer_rss_mib_mean"] = statistics.mean(peer_rss) if peer_rss else None
    result["peer_rss_mib_max"] = max(peer_rss) if peer_rss else None
    rounds = try_json(f"{coord_url}/v1/rounds", 10) or []
    deltas = try_json(f"{coord_url}/v1/deltas", 10) or []
    events = read_events(peers)
    end_t = time.time()
    per_round = []
    numbers = sorted(published)
    for k, number in enumerate(numbers):
        t_pub = published[number]
        t_next = published[numbers[k + 1]] if k + 1 < len(numbers) else end_t
        rebase = {}
        for node in peers:
            times = [
                e["t"]
                for e in events[node.name]
                if e.get("event") == "rebased" and e["round"] == number + 1
            ]
            if times:
                rebase[node.name] = min(times) - t_pub
        before = [s for s in samples if s[0] <= t_pub]
        within = [s for s in samples if s[0] <= t_next]
        up = (within[-1][1] - before[-1][1]) if before and within else None
        row = next((r for r in rounds if r["number"] == number), {})
        per_round.append(
            {
                "round": number,
                "deltas_merged": len(row.get("inputs") or []),
                "trigger": row.get("trigger"),
                "merge_s": row.get("merge_seconds"),
                "rebased": len(rebase),
                "rebase_p50_s": statistics.median(rebase.values()) if rebase else None,
                "round_time_s": max(rebase.values()) if rebase else None,
                "not_rebased": sorted(set(p.name for p in peers) - set(rebase)),
                "interval_s": (t_next - t_pub) if k + 1 < len(numbers) else None,
                "coordinator_upload_bytes": up,
            }
        )
    result["rounds"] = per_round
    result["rounds_published"] = len(numbers)
    # round 0 -> 1: every peer's first pull of the base, from its start
    first = [
        min(e["t"] for e in events[p.name] if e.get("event") == "rebased" and e["round"] == 1) - t0
        for p in peers
        if any(e.get("event") == "rebased" and e["round"] == 1 for e in events[p.name])
    ]
    result["first_pull_max_s"] = max(first) if first else None
    # rounds over (a "merging" round's accepted deltas are still being merged)
    closed = [
        r["number"] for r in rounds if r["status"] in ("published", "held", "failed", "abandoned")
    ]
    lost = [d for d in deltas if d["status"] == "accepted" and d.get("round") in closed]
    result["accepted_lost"] = len(lost)
    result["accepted_pending_open_round"] = sum(
        1 for d in deltas if d["status"] == "accepted" and d.get("round") not in closed
    )
    kinds: dict[str, int] = {}
    for d in deltas:
        if d["status"] == "rejected":
            kinds[d.get("rejection_kind") or "?"] = kinds.get(d.get("rejection_kind") or "?", 0) + 1
    result["rejected_by_kind"] = kinds
    result["deltas_merged_total"] = sum(1 for d in deltas if d["status"] == "merged")
    sent = [Net.counters(p) for p in peers]
    result["peer_upload_bytes_mean"] = statistics.mean(s[0] for s in sent) if sent else None
    result["peer_download_bytes_mean"] = statistics.mean(s[1] for s in sent) if sent else None
    result["peer_download_bytes_max"] = max(s[1] for s in sent) if sent else None
    c_sent, c_recv = Net.counters(coord)
    result["coordinator_upload_total_bytes"] = c_sent
    result["coordinator_download_total_bytes"] = c_recv
    # peers that did not rebase on the last published checkpoint, and why
    failures = {}
    if numbers:
        last = numbers[-1]
        for node in peers:
            if not any(
                e.get("event") == "rebased" and e["round"] == last + 1 for e in events[node.name]
            ):
                failures[node.name] = {
                    "health": {
                        k: health.get(node.name, {}).get(k)
                        for k in ("phase", "round", "seconds_since_progress")
                    },
                    "log": log_problems(node.log_path),
                }
    result["not_rebased_on_last"] = failures
    result["restarts"] = sum(max(0, p.starts - 1) for p in peers)
    return result


def load_test(
    coord: Node, coord_url: str, stop_at: float, clients: int, load_s: float
) -> dict[str, Any]:
    """`clients` concurrent GETs of the model file for `load_s` seconds while /v1/info is
    timed."""
    info = get_json(f"{coord_url}/v1/info")
    url = f"{coord_url}/{REPO}/resolve/{info['base_revision']}/model.safetensors"

    def time_info(count: int) -> list[float]:
        out = []
        for _ in range(count):
            t = time.perf_counter()
            if try_json(f"{coord_url}/v1/info", 10) is not None:
                out.append(time.perf_counter() - t)
            time.sleep(0.05)
        return out

    idle = time_info(40)
    stop = threading.Event()
    got = [0] * clients
    done = [False] * clients
    errors: list[str] = []

    def download(i: int) -> None:
        try:
            with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310
                while not stop.is_set():
                    chunk = response.read(1 << 16)
                    if not chunk:
                        done[i] = True
                        return
                    got[i] += len(chunk)
        except Exception as error:  # noqa: BLE001 - recorded
            errors.append(f"{type(error).__name__}: {error}")

    sent0 = Net.counters(coord)[0]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(download, i) for i in range(clients)]
        time.sleep(1.0)
        loaded: list[float] = []
        until = min(start + load_s, stop_at - 30)
        while time.monotonic() < until and not all(done):
            loaded += time_info(1)
        stop.set()
        concurrent.futures.wait(futures, timeout=60)
    elapsed = time.monotonic() - start
    sent = Net.counters(coord)[0] - sent0
    return {
        "clients": clients,
        "load_s": round(elapsed, 1),
        "downloads_completed": sum(done),
        "download_errors": len(errors),
        "download_error_sample": errors[:3],
        "bytes_served": sum(got),
        "coordinator_upload_bytes": sent,
        "coordinator_upload_mbit_s": sent * 8 / elapsed / 1e6,
        "info_idle_ms": {
            q: 1000 * (percentile(idle, p) or 0)
            for q, p in (("p50", 50), ("p99", 99), ("max", 100))
        },
        "info_loaded_ms": {
            q: 1000 * (percentile(loaded, p) or 0)
            for q, p in (("p50", 50), ("p99", 99), ("max", 100))
        },
        "info_loaded_samples": len(loaded),
    }


# report -------------------------------------------------------------------------------------------


def fmt(value: Any, scale: float = 1, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value / scale:.{digits}f}"


def print_scenario(label: str, r: dict[str, Any]) -> None:
    print(f"\n== {label} ==")
    if "error" in r:
        print(f"failed: {r['error']}")
        return
    if "info_loaded_ms" in r:
        print(
            f"{r['clients']} concurrent model downloads for {r['load_s']} s: "
            f"{r['downloads_completed']} completed, {r['download_errors']} errors, "
            f"{r['bytes_served'] / 1e6:.1f} MB read, coordinator sent "
            f"{r['coordinator_upload_mbit_s']:.1f} Mbit/s"
        )
        for key in ("info_idle_ms", "info_loaded_ms"):
            q = r[key]
            print(
                f"  /v1/info {key[5:-3]:>6}: p50 {q['p50']:.1f} ms, p99 {q['p99']:.1f} ms, "
                f"max {q['max']:.1f} ms"
            )
        print(
            f"  coordinator peak RSS {fmt(r.get('coordinator_peak_rss_mib'), 1, 0)} MiB, "
            f"CPU {fmt(r.get('coordinator_cpu_s'))} s"
        )
        return
    faults = ", ".join(f["what"] for f in r.get("faults", []))
    if faults:
        print(f"faults: {faults}")
    elif label.split("-")[0] in ("churn", "partition", "stall"):
        print("faults: none fired (e.g. a fan-out delta downloads too fast to be stalled mid-way)")
    print(
        f"rounds published {r['rounds_published']} (end: {r['end']}); first pull of the base "
        f"by every peer {fmt(r.get('first_pull_max_s'))} s after start; restarts {r['restarts']}"
    )
    print(
        "round | deltas | trigger  | merge s | rebased | rebase p50 s | round time s "
        "| interval s | coordinator upload MB"
    )
    for row in r["rounds"]:
        print(
            f"{row['round']:>5} | {row['deltas_merged']:>6} | {str(row['trigger']):<8} | "
            f"{fmt(row['merge_s']):>7} | {row['rebased']:>7} | {fmt(row['rebase_p50_s']):>12} "
            f"| {fmt(row['round_time_s']):>12} | {fmt(row['interval_s']):>10} | "
            f"{fmt(row['coordinator_upload_bytes'], 1e6):>6}"
        )
    print(
        f"coordinator: upload {r['coordinator_upload_total_bytes'] / 1e6:.1f} MB in all, "
        f"download {r['coordinator_download_total_bytes'] / 1e6:.1f} MB, peak RSS "
        f"{fmt(r.get('coordinator_peak_rss_mib'), 1, 0)} MiB, "
        f"CPU {fmt(r.get('coordinator_cpu_s'))} s"
    )
    print(
        f"peers: download {fmt(r['peer_download_bytes_mean'], 1e6)} MB mean "
        f"({fmt(r['peer_download_bytes_max'], 1e6)} max), upload "
        f"{fmt(r['peer_upload_bytes_mean'], 1e6, 2)} MB mean, RSS "
        f"{fmt(r.get('peer_rss_mib_mean'), 1, 0)} MiB mean "
        f"({fmt(r.get('peer_rss_mib_max'), 1, 0)} max)"
    )
    print(
        f"deltas: {r['deltas_merged_total']} merged, {r['accepted_lost']} accepted but never "
        f"merged (closed rounds), {r['accepted_pending_open_round']} pending (open/merging round), "
        f"rejected {r['rejected_by_kind'] or 'none'}"
    )
    for name, why in r["not_rebased_on_last"].items():
        print(f"  {name} did not rebase on the last checkpoint: {why['health']}")
        for line in why["log"]:
            print(f"    {line}")


def plot(results: list[dict[str, Any]], out_png: Path) -> Path | None:
    """Round time (median over rounds) and coordinator upload per round against N, per mode."""
    points: dict[str, list[tuple[int, float, float]]] = {}
    for item in results:
        sc, r = item["scenario"], item["result"]
        if sc["name"] != "scale" or "rounds" not in r:
            continue
        times = [x["round_time_s"] for x in r["rounds"] if x["round_time_s"] is not None]
        ups = [
            x["coordinator_upload_bytes"]
            for x in r["rounds"][:-1]
            if x["coordinator_upload_bytes"] is not None
        ] or [
            x["coordinator_upload_bytes"]
            for x in r["rounds"]
            if x["coordinator_upload_bytes"] is not None
        ]
        if times and ups:
            points.setdefault(sc["mode"], []).append(
                (sc["n"], statistics.median(times), statistics.median(ups) / 1e6)
            )
    if not points:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from skillswarm.node.metrics import write_figure_png

    figure = Figure(figsize=(9, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    for mode, rows in sorted(points.items()):
        rows.sort()
        ns = [p[0] for p in rows]
        left.plot(ns, [p[1] for p in rows], "o-", label=mode)
        right.plot(ns, [p[2] for p in rows], "o-", label=mode)
    left.set_xlabel("peers N")
    left.set_ylabel("round time (s): published -> all rebased")
    right.set_xlabel("peers N")
    right.set_ylabel("coordinator upload per round (MB)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle("netns swarm: median over rounds (tbf links, no latency emulation)")
    return write_figure_png(figure, out_png)
