"""Namespace plumbing of bench_swarm_netns.py: names, the bridge and shaped veths, processes in
namespaces, HTTP probes and the peers' event files. Needs root and iproute2's `ip` and `tc`."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = Path(__file__).resolve().parent / "netns_peer.py"
PREFIX_ROOT = "ssim"
PREFIX = f"{PREFIX_ROOT}{os.getpid()}"
HTTP_PORT = 8470
P2P_PORT = 4001
HEALTH_PORT = 9470
ALL_SCENARIOS = ["scale", "slow", "churn", "partition", "stall", "load"]
REPO = "skillswarm/agent"


class BenchError(RuntimeError):
    """The simulator cannot go on; the message says why."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise BenchError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def child_env() -> dict[str, str]:
    """The environment of every peer and coordinator: one torch thread, no proxies, no
    SKILLSWARM_* overrides from the caller's shell."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SKILLSWARM_") and "proxy" not in k.lower()
    }
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        NO_PROXY="*",
    )
    return env


# network -------------------------------------------------------------------------------------


def tbf_args(rate_bit: int) -> list[str]:
    """tbf settings for a rate: a burst of ~10 ms (at least 16 KiB), a queue of ~80 ms."""
    burst = max(rate_bit // 8 // 100, 16 * 1024)
    limit = max(rate_bit // 8 * 80 // 1000, 4 * burst, 64 * 1024)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]


def parse_rate(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (e.g. 100mbit, 10mbit)")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return int(value * (8 if match.group(3) == "bps" else 1))


@dataclass
class Node:
    """One namespace: its name, address, the bridge-side veth and the process in it."""

    name: str
    ns: str
    ip: str
    host_if: str
    rate: int
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    work_dir: Path | None = None
    config_path: Path | None = None
    starts: int = 0


class Net:
    """The bridge, namespaces, veths and qdiscs of one run, all named with PREFIX."""

    def __init__(self, subnet: str) -> None:
        self.subnet = subnet  # "10.213.x"
        self.bridge = f"{PREFIX}br"
        self.namespaces: list[str] = []
        self.bridge_up = False

    def up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.bridge_up = True
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def add(self, name: str, host_number: int, rate: int) -> Node:
        ns = f"{PREFIX}-{name}"
        host_if, inner = f"{PREFIX}h{name}", f"{PREFIX}n{name}"
        if len(host_if) > 15:
            raise BenchError(f"interface name {host_if} is too long")
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", ns)
        ip = f"{self.subnet}.{host_number}"
        for cmd in (
            ["ip", "link", "set", inner, "name", "eth0"],
            ["ip", "addr", "add", f"{ip}/24", "dev", "eth0"],
            ["ip", "link", "set", "eth0", "up"],
            ["ip", "link", "set", "lo", "up"],
            ["tc", "qdisc", "add", "dev", "eth0", "root", *tbf_args(rate)],
        ):
            sh("ip", "netns", "exec", ns, *cmd)
        sh("ip", "link", "set", host_if, "master", self.bridge)
        sh("ip", "link", "set", host_if, "up")
        sh("tc", "qdisc", "add", "dev", host_if, "root", *tbf_args(rate))
        return Node(name=name, ns=ns, ip=ip, host_if=host_if, rate=rate)

    @staticmethod
    def set_rate(node: Node, rate: int) -> None:
        sh("tc", "qdisc", "change", "dev", node.host_if, "root", *tbf_args(rate))
        sh(
            "ip",
            "netns",
            "exec",
            node.ns,
            "tc",
            "qdisc",
            "change",
            "dev",
            "eth0",
            "root",
            *tbf_args(rate),
        )

    @staticmethod
    def blackhole(node: Node, ip: str, on: bool) -> None:
        verb = "add" if on else "del"
        sh("ip", "netns", "exec", node.ns, "ip", "route", verb, "blackhole", f"{ip}/32")

    @staticmethod
    def counters(node: Node) -> tuple[int, int]:
        """(bytes the namespace sent, bytes it received), from the bridge-side veth."""
        base = Path("/sys/class/net") / node.host_if / "statistics"
        try:
            return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())
        except OSError:
            return 0, 0

    def remove_namespaces(self) -> None:
        for ns in list(self.namespaces):
            kill_namespace_processes(ns)
            sh("ip", "netns", "del", ns, check=False)
            self.namespaces.remove(ns)

    def down(self) -> None:
        self.remove_namespaces()
        if self.bridge_up:
            sh("ip", "link", "del", self.bridge, check=False)
            self.bridge_up = False


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs in a namespace this simulator made (its peers/coordinator)."""
    result = sh("ip", "netns", "pids", ns, check=False)
    for pid in result.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def cleanup_leftovers(only_dead: bool = True) -> list[str]:
    """Remove namespaces and links named ssim<pid>... whose run (pid) is gone."""

    def dead(name: str) -> bool:
        match = re.match(rf"{PREFIX_ROOT}(\d+)", name)
        if not match:
            return False
        pid = int(match.group(1))
        return not only_dead or (pid != os.getpid() and not Path(f"/proc/{pid}").exists())

    removed = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(PREFIX_ROOT) and dead(ns):
            kill_namespace_processes(ns)
            sh("ip", "netns", "del", ns, check=False)
            removed.append(f"netns {ns}")
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if name.startswith(PREFIX_ROOT) and dead(name):
            sh("ip", "link", "del", name, check=False)
            removed.append(f"link {name}")
    return removed


def free_subnet() -> str:
    used = sh("ip", "-o", "addr", "show", check=False).stdout
    for third in [os.getpid() % 200 + 20, *range(20, 250)]:
        subnet = f"10.213.{third}"
        if f" {subnet}." not in used:
            return subnet
    raise BenchError("no free 10.213.x.0/24 subnet for the bridge")


# processes -----------------------------------------------------------------------------------


PROCS: list[subprocess.Popen] = []


def spawn(node: Node, argv: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node.ns, *argv],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    out.close()
    PROCS.append(proc)
    node.proc, node.log_path = proc, log_path
    node.starts += 1
    return proc


def stop_proc(proc: subprocess.Popen | None, grace: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    except ProcessLookupError:
        pass


def proc_stats(pid: int) -> dict[str, float]:
    """Peak and current RSS (MiB) and CPU seconds (user + system) of a live process."""
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmHWM:", "VmRSS:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        out["cpu_s"] = (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, IndexError, ValueError):
        pass
    return out


# HTTP ----------------------------------------------------------------------------------------


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - our own URL
        return json.loads(response.read())


def try_json(url: str, timeout: float = 5) -> Any:
    try:
        return get_json(url, timeout)
    except (OSError, ValueError, urllib.error.URLError):
        return None


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        from datetime import UTC

        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# peers' records -----------------------------------------------------------------------------------


def read_events(peers: list[Node]) -> dict[str, list[dict[str, Any]]]:
    """Each peer's sim-events.jsonl (`bench/netns_peer.py`), unreadable lines skipped."""
    events: dict[str, list[dict[str, Any]]] = {}
    for node in peers:
        path = (node.work_dir or Path("/nonexistent")) / "sim-events.jsonl"
        rows = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
        events[node.name] = rows
    return events


def log_problems(path: Path | None, limit: int = 4) -> list[str]:
    """The last few warning/error lines of a process's log."""
    if path is None or not path.is_file():
        return []
    lines = [
        line
        for line in path.read_text(errors="replace").splitlines()
        if " WARNING " in line or " ERROR " in line or "Error" in line
    ]
    return [line[:240] for line in lines[-limit:]]
