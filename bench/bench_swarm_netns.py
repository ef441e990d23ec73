"""A swarm in network namespaces: N light peers and a real coordinator, rate-limited links.

Every peer is a real process running the real node daemon (`skillswarm.node.daemon.NodeDaemon`:
pull and rebase, announce until recorded, serve blobs, wait for the next base, heartbeats,
health server) with only its training replaced by a synthetic sparse delta
(`bench/netns_peer.py`). The coordinator is the real `skillswarm coordinator serve`, on a
synthetic Qwen2-architecture base of a chosen size, its evaluation cut to one task of one domain
and its no-regression rule off (synthetic deltas are noise). Each process lives in its own
network namespace with a veth pair to one bridge in the root namespace; the bridge holds an
address so that this controller reaches every HTTP and health endpoint. Each link is shaped with
`tc tbf` in both directions (the namespace side's egress: upload; the bridge side's: download).

Scenarios (`--scenarios`, comma-separated; default: all of them):

  scale      N peers (each of --sizes) on --rate links                  round time, bytes vs N
  slow       --peers peers, --slow-peers of them on --slow-rate links
  churn      --peers peers; every --churn-every s one is killed (SIGKILL) and restarted on the
             same work_dir --churn-down s later
  partition  --peers peers; once round 1 is published one peer is cut from the coordinator
             (blackhole routes both ways; still reachable by the other peers) for --partition-s
  stall      --peers peers; once round 1 is published and one peer has downloaded a quarter of
             the new checkpoint, its link drops to --stall-rate in both directions (it stops
             reading mid-transfer) for --stall-s, then is restored
  load       the coordinator alone; --clients concurrent downloads of the model file from the
             registry routes for --load-s, while /v1/info is timed (p50/p99/max)

Measured per scenario: rounds published, round time (checkpoint published -> every peer that
takes part rebased on it, from each peer's own record of when its base was in place and its
/healthz), the interval between publications, bytes the coordinator uploaded per round (its veth
counters), bytes per peer, accepted deltas never merged, rejected deltas by kind, peers that did
not rebase and why (their logs), the coordinator's peak RSS (VmHWM) and CPU seconds, and the
peers' RSS. Writes results.json, swarm-netns.png (round time and coordinator upload against N)
and the processes' logs under --out.

No latency emulation: there is no netem here (only tbf rate limits), so every link has the
bridge's sub-millisecond latency; figures say nothing about WAN round-trip times.

Budget: the defaults (whole pulls, scale at N=8, the other scenarios with 4 peers, 2 rounds
each, a 24 MB base, 20 s of load) took 8 minutes on 2 lightly loaded cores. Each peer is a Python
process of ~500 MiB RSS (torch, transformers, py-libp2p) that costs several CPU seconds to
start: N=16 wants ~8 GB, N=32 ~16 GB and, on 2 shared cores, ~10-15 minutes per mode (there CPU
starvation, not the links, set the figures). --mode both runs each scenario twice. No peer is
started with less than --min-free-mb available.

Needs root (namespaces, veth, bridge, tc) and iproute2's `ip` and `tc`. Everything it creates is
named with the prefix ssim<pid> and removed at exit, also on SIGINT/SIGTERM or an error;
`--cleanup` removes what earlier runs left behind (names starting with "ssim").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_lib import (  # noqa: E402 (the bench folder is no package)
    ALL_SCENARIOS,
    HEALTH_PORT,
    HTTP_PORT,
    P2P_PORT,
    PEER_SCRIPT,
    PREFIX,
    PROCS,
    ROOT,
    BenchError,
    Net,
    Node,
    child_env,
    cleanup_leftovers,
    free_subnet,
    log,
    mem_available_mb,
    parse_rate,
    parse_time,
    read_events,
    sh,
    spawn,
    stop_proc,
    try_json,
)
from netns_measure import (  # noqa: E402
    coordinator_stats,
    fmt,
    load_test,
    measure,
    plot,
    print_scenario,
)

# setup ---------------------------------------------------------------------------------------


BUILD_SCRIPT = r"""
import json, shutil, sys
from pathlib import Path
out, mb = Path(sys.argv[1]), float(sys.argv[2])
n_keys, keys_dir = int(sys.argv[3]), Path(sys.argv[4])
from skillswarm.node.config import NodeConfig
from skillswarm.coordinator.config import CoordinatorConfig
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of
ids = []
for i in range(n_keys):
    ids.append(peer_id_of(load_or_create_identity(keys_dir / f"peer{i}.key")))
if not (out / "model.safetensors").is_file():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    embedded = Path(__import__("skillswarm").__file__).parent / "embedded_base"
    hidden, inter, vocab = 384, 1024, 1028
    per_layer = 4 * hidden * hidden + 3 * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((mb * 1e6 / 4 - vocab * hidden) / per_layer))
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=6,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0,
        bos_token_id=None, initializer_range=0.02, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        shutil.copy(embedded / name, tmp / name)
    tmp.rename(out)
size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
print(json.dumps({"size": size, "peer_ids": ids,
    "node_fanout": "fanout" in NodeConfig.model_fields,
    "coordinator_fanout": "fanout" in CoordinatorConfig.model_fields}))
"""


def toml_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, bool) else ("true" if value else "false")


@dataclass
class Scenario:
    name: str
    label: str
    n: int
    rounds: int
    mode: str
    slow: int = 0
    churn: bool = False
    partition: bool = False
    stall: bool = False
    load: bool = False


@dataclass
class Run:
    """What one scenario measured."""

    scenario: Scenario
    result: dict[str, Any] = field(default_factory=dict)


class Simulator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = Path(args.workdir).resolve() if args.workdir else self.out / f"work-{PREFIX}"
        self.net = Net(free_subnet())
        self.base_dir = self.out / f"base-{args.base_mb:g}mb"
        self.keys_dir = self.work / "keys"
        self.info: dict[str, Any] = {}
        self.deadline = time.monotonic() + args.timeout

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def prepare(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        n_keys = max([*self.args.sizes, self.args.peers])
        log(f"building the {self.args.base_mb:g} MB synthetic base and {n_keys} peer keys")
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                BUILD_SCRIPT,
                str(self.base_dir),
                str(self.args.base_mb),
                str(n_keys),
                str(self.keys_dir),
            ],
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=ROOT,
            timeout=600,
        )
        if result.returncode != 0:
            raise BenchError(f"building the base failed:\n{result.stderr[-3000:]}")
        self.info = json.loads(result.stdout.strip().splitlines()[-1])
        log(
            f"base {self.base_dir} ({self.info['size'] / 1e6:.1f} MB); fan-out fields: node "
            f"{self.info['node_fanout']}, coordinator {self.info['coordinator_fanout']}"
        )
        self.net.up()

    def fanout_available(self) -> bool:
        return bool(self.info.get("node_fanout") and self.info.get("coordinator_fanout"))

    # configs -----------------------------------------------------------------------------

    def coordinator_toml(self, node: Node, sc: Scenario, work: Path) -> Path:
        args = self.args
        if args.deadline is not None:
            deadline = args.deadline
        else:  # every peer's pull over the coordinator's link and the peers' start (round 1
            # opens when the coordinator starts), with room to spare
            pull_s = sc.n * self.info["size"] * 8 / args.rate
            deadline = max(60.0, 2.0 * pull_s + 30 + 2.0 * sc.n + args.train_s)
        lines = [
            f"work_dir = {toml_value(str(work))}",
            f"http_host = {toml_value(node.ip)}",
            f"http_port = {HTTP_PORT}",
            f"p2p_host = {toml_value(node.ip)}",
            f"p2p_port = {P2P_PORT}",
            f"base_checkpoint = {toml_value(str(self.base_dir))}",
            "torch_threads = 1",
            "keep_rounds = 2",
        ]
        if self.info.get("coordinator_fanout"):
            lines += ["", "[fanout]", f"enabled = {toml_value(sc.mode == 'fanout')}"]
        lines += [
            "",
            "[merge]",
            'method = "task_arithmetic"',
            "parameters = { weight = 1.0 }",
            "",
            "[round]",
            f"min_deltas = {max(1, sc.n)}",
            f"deadline_s = {deadline:.0f}",
            "min_deltas_at_deadline = 1",
            "",
            "[eval]",
            'domains = ["math"]',
            "n_tasks = 1",
            'experts = "none"',
            "",
            "[publish]",
            "no_regression = false",
        ]
        path = work.parent / "coordinator.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def peer_toml(
        self, node: Node, index: int, sc: Scenario, coord: Node, peers: list[Node], work: Path
    ) -> Path:
        ids = self.info["peer_ids"]
        links = []
        for step in range(1, min(self.args.peer_links, sc.n - 1) + 1):
            other = (index + step) % sc.n
            links.append(f"/ip4/{peers[other].ip}/tcp/{P2P_PORT}/p2p/{ids[other]}")
        lines = [
            f"work_dir = {toml_value(str(work))}",
            f"identity_file = {toml_value(str(self.keys_dir / f'peer{index}.key'))}",
            'domain = "math"',
            f"coordinator_url = {toml_value(f'http://{coord.ip}:{HTTP_PORT}')}",
            f"p2p_host = {toml_value(node.ip)}",
            f"p2p_port = {P2P_PORT}",
            f"bootstrap_peers = {json.dumps(links)}",
            "rounds = 0",
            f"seed = {index}",
            "torch_threads = 1",
            f"round_timeout_s = {self.args.node_round_timeout:g}",
            f"health_host = {toml_value(node.ip)}",
            f"health_port = {HEALTH_PORT}",
        ]
        if self.info.get("node_fanout"):
            lines.append(f"fanout = {toml_value(sc.mode == 'fanout')}")
        path = work.parent / f"{node.name}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    # one scenario ------------------------------------------------------------------------

    def start_peer(self, node: Node) -> None:
        assert node.config_path is not None
        spawn(
            node,
            [
                sys.executable,
                str(PEER_SCRIPT),
                "--config",
                str(node.config_path),
                "--sparsity",
                str(self.args.sparsity),
                "--scale",
                str(self.args.scale),
                "--train-s",
                str(self.args.train_s),
            ],
            self.out / "logs" / self.current_label / f"{node.name}.log",
        )

    def run_scenario(self, sc: Scenario) -> dict[str, Any]:
        args = self.args
        self.current_label = sc.label
        budget = min(args.scenario_timeout, self.remaining())
        if budget < 60:
            raise BenchError(f"no time left for scenario {sc.label} (--timeout)")
        stop_at = time.monotonic() + budget
        scen_dir = self.work / sc.label
        shutil.rmtree(scen_dir, ignore_errors=True)
        shutil.rmtree(self.out / "logs" / sc.label, ignore_errors=True)
        scen_dir.mkdir(parents=True)
        coord = self.net.add("c", 2, args.rate)
        peers: list[Node] = []
        for i in range(sc.n):
            rate = args.slow_rate if i < sc.slow else args.rate
            peers.append(self.net.add(f"p{i}", 10 + i, rate))
        coord.work_dir = scen_dir / "coordinator" / "data"
        coord.work_dir.parent.mkdir(parents=True)
        coord.config_path = self.coordinator_toml(coord, sc, coord.work_dir)
        coord_url = f"http://{coord.ip}:{HTTP_PORT}"
        log(
            f"[{sc.label}] coordinator at {coord_url}; {sc.n} peers "
            f"({sc.slow} at {args.slow_rate / 1e6:g} Mbit/s, the rest at {args.rate / 1e6:g})"
        )
        spawn(
            coord,
            [
                sys.executable,
                "-m",
                "skillswarm.cli",
                "coordinator",
                "serve",
                "--config",
                str(coord.config_path),
            ],
            self.out / "logs" / sc.label / "coordinator.log",
        )
        started = time.monotonic()
        while try_json(f"{coord_url}/v1/info", 2) is None:
            if coord.proc is not None and coord.proc.poll() is not None:
                raise BenchError(f"the coordinator exited; see {coord.log_path}")
            if time.monotonic() - started > 180 or time.monotonic() > stop_at:
                raise BenchError(f"the coordinator did not answer in 180 s; see {coord.log_path}")
            time.sleep(1)
        log(f"[{sc.label}] coordinator answers after {time.monotonic() - started:.0f} s")
        if sc.load:
            result = load_test(coord, coord_url, stop_at, self.args.clients, self.args.load_s)
            result.update(coordinator_stats(coord))
            return self.finish(sc, coord, peers, result)
        for i, node in enumerate(peers):
            node.work_dir = scen_dir / node.name / "data"
            node.work_dir.parent.mkdir(parents=True)
            node.config_path = self.peer_toml(node, i, sc, coord, peers, node.work_dir)
        t0 = time.time()
        for node in peers:
            if mem_available_mb() < self.args.min_free_mb:
                raise BenchError(
                    f"only {mem_available_mb():.0f} MB of memory available after starting "
                    f"{node.name}; fewer peers (or --min-free-mb) needed"
                )
            self.start_peer(node)
            time.sleep(0.3)
        log(f"[{sc.label}] {sc.n} peers started")
        result = self.monitor(sc, coord, coord_url, peers, stop_at, t0)
        return self.finish(sc, coord, peers, result)

    def monitor(
        self,
        sc: Scenario,
        coord: Node,
        coord_url: str,
        peers: list[Node],
        stop_at: float,
        t0: float,
    ) -> dict[str, Any]:
        args = self.args
        samples: list[tuple[float, int, int]] = []  # (time, coordinator sent, received)
        health: dict[str, dict[str, Any]] = {}
        faults: list[dict[str, Any]] = []
        killed: dict[str, float] = {}  # peer -> when to restart
        next_churn = time.monotonic() + args.churn_every
        fault_on: dict[str, Any] | None = None
        published: dict[int, float] = {}
        rounds: list[dict[str, Any]] = []
        victim = peers[-1] if peers else None
        stall_from: int | None = None  # the victim's download counter at the first publication
        last_health = 0.0
        last_report = 0.0
        done_reason = "timeout"
        rng = random.Random(0)
        while time.monotonic() < stop_at:
            now = time.monotonic()
            sent, received = Net.counters(coord)
            samples.append((time.time(), sent, received))
            rounds = try_json(f"{coord_url}/v1/rounds", 5) or rounds
            for r in rounds:
                if r["status"] == "published" and r["number"] not in published:
                    when = parse_time(r.get("finished_at")) or time.time()
                    published[r["number"]] = when
                    log(
                        f"[{sc.label}] round {r['number']} published with "
                        f"{len(r.get('inputs') or [])} deltas ({r.get('trigger')})"
                    )
            if coord.proc is not None and coord.proc.poll() is not None:
                done_reason = "coordinator exited"
                break
            if mem_available_mb() < self.args.min_free_mb / 2:
                done_reason = f"memory low ({mem_available_mb():.0f} MB available)"
                log(f"[{sc.label}] stopping: {done_reason}")
                break
            if now - last_health >= 2:
                last_health = now
                for node in peers:
                    h = try_json(f"http://{node.ip}:{HEALTH_PORT}/healthz", 1)
                    if h is not None:
                        health[node.name] = {**h, "seen": time.time()}
            # faults
            first_published = 1 in published
            if sc.churn and now >= next_churn and peers:
                alive = [p for p in peers if p.name not in killed]
                if alive:
                    node = rng.choice(alive)
                    if node.proc is not None and node.proc.poll() is None:
                        node.proc.kill()
                        node.proc.wait(timeout=10)
                    killed[node.name] = now + args.churn_down
                    faults.append({"t": time.time(), "what": f"SIGKILL {node.name}"})
                    log(f"[{sc.label}] SIGKILL {node.name}")
                next_churn = now + args.churn_every
            for name, when in list(killed.items()):
                if now >= when:
                    node = next(p for p in peers if p.name == name)
                    self.start_peer(node)
                    del killed[name]
                    faults.append({"t": time.time(), "what": f"restart {name}"})
                    log(f"[{sc.label}] restarted {name}")
            if sc.partition and victim and first_published and fault_on is None:
                Net.blackhole(victim, coord.ip, True)
                Net.blackhole(coord, victim.ip, True)
                fault_on = {"until": now + args.partition_s}
                faults.append({"t": time.time(), "what": f"partition {victim.name}"})
                log(
                    f"[{sc.label}] {victim.name} cut from the coordinator for "
                    f"{args.partition_s:g} s"
                )
            if sc.stall and victim and first_published and stall_from is None:
                stall_from = Net.counters(victim)[1]
            downloading = (
                stall_from is not None
                and victim is not None
                and Net.counters(victim)[1] - stall_from > self.info["size"] / 4
            )
            if sc.stall and victim and downloading and fault_on is None:
                Net.set_rate(victim, args.stall_rate)
                fault_on = {"until": now + args.stall_s}
                faults.append({"t": time.time(), "what": f"stall {victim.name}"})
                log(
                    f"[{sc.label}] {victim.name}'s link at {args.stall_rate} bit/s for "
                    f"{args.stall_s:g} s"
                )
            if fault_on is not None and not fault_on.get("healed") and now >= fault_on["until"]:
                if sc.partition and victim:
                    Net.blackhole(victim, coord.ip, False)
                    Net.blackhole(coord, victim.ip, False)
                if sc.stall and victim:
                    Net.set_rate(victim, victim.rate)
                fault_on["healed"] = True
                faults.append({"t": time.time(), "what": f"heal {victim.name if victim else ''}"})
                log(f"[{sc.label}] healed {victim.name if victim else ''}")
            # done: enough rounds published, every peer rebased on the last (or grace over)
            if len(published) >= sc.rounds and (fault_on is None or fault_on.get("healed")):
                last = max(published)
                events = read_events(peers)
                rebased = [
                    p
                    for p in peers
                    if any(
                        e.get("event") == "rebased" and e["round"] == last + 1
                        for e in events[p.name]
                    )
                ]
                grace_over = time.time() - published[last] > args.rebase_grace
                if len(rebased) == len(peers) or grace_over:
                    done_reason = "done" if len(rebased) == len(peers) else "rebase grace over"
                    break
            if now - last_report >= 30:
                last_report = now
                phases: dict[str, int] = {}
                for h in health.values():
                    key = f"r{h.get('round')}:{h.get('phase')}"
                    phases[key] = phases.get(key, 0) + 1
                log(f"[{sc.label}] {len(published)}/{sc.rounds} published; peers {phases}")
            time.sleep(1)
        if fault_on is not None and not fault_on.get("healed") and victim:
            if sc.partition:
                Net.blackhole(victim, coord.ip, False)
                Net.blackhole(coord, victim.ip, False)
            if sc.stall:
                Net.set_rate(victim, victim.rate)
        return measure(coord, coord_url, peers, samples, health, faults, published, t0, done_reason)

    def finish(
        self, sc: Scenario, coord: Node, peers: list[Node], result: dict[str, Any]
    ) -> dict[str, Any]:
        for node in peers:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in peers:
            stop_proc(node.proc, grace=10)
        stop_proc(coord.proc, grace=15)
        self.net.remove_namespaces()
        if not self.args.keep:
            shutil.rmtree(self.work / sc.label, ignore_errors=True)
        return result

    def cleanup(self) -> None:
        for proc in PROCS:
            if proc.poll() is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        self.net.down()
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


# main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(ALL_SCENARIOS),
        help="comma-separated, from: " + ", ".join(ALL_SCENARIOS),
    )
    parser.add_argument(
        "--sizes", default="8", help="N for the scale scenario, comma-separated (e.g. 8,16,32)"
    )
    parser.add_argument("--peers", type=int, default=4, help="N for the other scenarios")
    parser.add_argument(
        "--mode",
        choices=["whole", "fanout", "both"],
        default="whole",
        help="whole-checkpoint pulls, peer-to-peer delta fan-out, or both "
        "(each scenario twice); fanout needs the config fields",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds to publish per scenario (faults start when round 1 is published)",
    )
    parser.add_argument("--base-mb", type=float, default=24.0, help="synthetic base size, MB")
    parser.add_argument("--rate", type=parse_rate, default=parse_rate("100mbit"))
    parser.add_argument("--slow-rate", type=parse_rate, default=parse_rate("10mbit"))
    parser.add_argument("--slow-peers", type=int, default=2)
    parser.add_argument("--churn-every", type=float, default=25.0)
    parser.add_argument("--churn-down", type=float, default=5.0)
    parser.add_argument("--partition-s", type=float, default=40.0)
    parser.add_argument("--stall-rate", type=parse_rate, default=parse_rate("8kbit"))
    parser.add_argument("--stall-s", type=float, default=40.0)
    parser.add_argument("--clients", type=int, default=50, help="load: concurrent downloads")
    parser.add_argument("--load-s", type=float, default=20.0, help="load: seconds of load")
    parser.add_argument(
        "--sparsity",
        type=float,
        default=0.01,
        help="fraction of each tensor's elements a synthetic delta moves",
    )
    parser.add_argument(
        "--scale", type=float, default=0.01, help="size of a move, in units of the tensor's RMS"
    )
    parser.add_argument("--train-s", type=float, default=0.0, help="synthetic training time")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="round deadline_s (default: from N, base size and rate)",
    )
    parser.add_argument(
        "--peer-links",
        type=int,
        default=2,
        help="bootstrap_peers per peer (a ring of its next K peers)",
    )
    parser.add_argument(
        "--rebase-grace",
        type=float,
        default=120.0,
        help="s after the last publication to wait for every peer's rebase",
    )
    parser.add_argument("--node-round-timeout", type=float, default=600.0)
    parser.add_argument("--scenario-timeout", type=float, default=600.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="the whole run, s")
    parser.add_argument(
        "--min-free-mb",
        type=float,
        default=2048.0,
        help="start no peer with less memory available; stop a scenario at half",
    )
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-swarm-netns"))
    parser.add_argument(
        "--workdir",
        default=None,
        help="peers' and coordinator's data (default: OUT/work-<prefix>, removed at the end)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dirs")
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces/links left by earlier runs (ssim*) and exit",
    )
    args = parser.parse_args(argv)
    args.sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - set(ALL_SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {ALL_SCENARIOS}")
    if max([*args.sizes, args.peers]) > 200:
        parser.error("at most 200 peers (one /24)")
    return args


def preflight() -> None:
    if not sys.platform.startswith("linux"):
        raise BenchError("this simulator needs Linux network namespaces")
    if os.geteuid() != 0:
        raise BenchError(
            "run as root: it creates network namespaces, veths, a bridge and tc "
            "qdiscs (e.g. sudo .venv/bin/python bench/bench_swarm_netns.py)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise BenchError(f"`{tool}` is missing: install iproute2")


def scenarios_of(args: argparse.Namespace, modes: list[str]) -> list[Scenario]:
    out = []
    for name in args.scenarios:
        for mode in modes:
            tag = f"-{mode}"
            if name == "scale":
                out += [
                    Scenario("scale", f"scale-n{n}{tag}", n, args.rounds, mode) for n in args.sizes
                ]
            elif name == "slow":
                out.append(
                    Scenario(
                        "slow",
                        f"slow-n{args.peers}{tag}",
                        args.peers,
                        args.rounds,
                        mode,
                        slow=min(args.slow_peers, args.peers),
                    )
                )
            elif name == "load":
                if mode == modes[0]:
                    out.append(Scenario("load", "load", 0, 0, mode, load=True))
            else:
                out.append(
                    Scenario(
                        name,
                        f"{name}-n{args.peers}{tag}",
                        args.peers,
                        args.rounds,
                        mode,
                        **{name: True},
                    )
                )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preflight()
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_leftovers(only_dead=True)
        print("\n".join(removed) if removed else "nothing to clean up")
        return 0

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    sim = Simulator(args)
    results: list[dict[str, Any]] = []
    status = 0
    try:
        sim.prepare()
        modes = ["whole", "fanout"] if args.mode == "both" else [args.mode]
        if "fanout" in modes and not sim.fanout_available():
            raise BenchError(
                "--mode fanout: this checkout has no `fanout` field in NodeConfig "
                "and CoordinatorConfig yet"
            )
        for sc in scenarios_of(args, modes):
            if sim.remaining() < 90:
                log(f"skipping {sc.label}: --timeout reached")
                continue
            log(f"scenario {sc.label}")
            started = time.monotonic()
            try:
                result = sim.run_scenario(sc)
            except BenchError as error:
                result = {"error": str(error)}
                sim.net.remove_namespaces()
                status = 1
            result["wall_s"] = round(time.monotonic() - started, 1)
            results.append({"scenario": sc.__dict__, "result": result})
            print_scenario(sc.label, result)
            (sim.out / "results.json").write_text(
                json.dumps(
                    {
                        "args": {k: v for k, v in vars(args).items()},
                        "prefix": PREFIX,
                        "base_bytes": sim.info.get("size"),
                        "results": results,
                    },
                    indent=2,
                    default=str,
                )
            )
    except KeyboardInterrupt as error:
        print(f"\ninterrupted ({error}); cleaning up", file=sys.stderr)
        status = 130
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sim.cleanup()
        leftovers = [
            n for n in sh("ip", "netns", "list", check=False).stdout.split() if n.startswith(PREFIX)
        ]
        if leftovers:
            print(f"warning: namespaces left: {leftovers}", file=sys.stderr)
    if results:
        modes_run = {r["scenario"]["mode"] for r in results}
        if len(modes_run) > 1:
            print("\ncoordinator upload per scenario, whole vs fanout (MB):")
            by_label: dict[str, dict[str, float]] = {}
            for item in results:
                base_label = item["scenario"]["label"].rsplit("-", 1)[0]
                total = item["result"].get("coordinator_upload_total_bytes")
                if total is not None:
                    by_label.setdefault(base_label, {})[item["scenario"]["mode"]] = total / 1e6
            for label, row in by_label.items():
                print(
                    f"  {label:<20} whole {fmt(row.get('whole'))}  fanout {fmt(row.get('fanout'))}"
                )
        png = plot(results, sim.out / "swarm-netns.png")
        if png is not None:
            print(f"\nplot: {png}")
        print(f"results: {sim.out / 'results.json'}; logs: {sim.out / 'logs'}")
        print(
            "note: links are rate-limited with tbf only; no netem, so no latency or loss is "
            "emulated"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
