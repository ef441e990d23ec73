"""The node daemon: pull the current base, train on one domain, publish the signed delta, rebase.

One round: fetch base B_r from the coordinator's registry (every file's sha256 checked), run RL on
the node's domain, compute Δ = θ − B_r, store it as a blob, sign its manifest, announce it on
gossip and serve it until the coordinator has it, then wait for the merged checkpoint B_{r+1}.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from merge.streaming import iter_base_tensors
from node.config import NodeConfig
from protocol.blobstore import BlobStore
from protocol.delta import pack_delta
from protocol.host import SwarmHost
from protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from protocol.manifest import SignedManifest, sign_manifest
from protocol.messages import DeltaAnnounced, encode_message
from protocol.pull import pull

log = logging.getLogger(__name__)


class NodeError(RuntimeError):
    """The node cannot go on; the message says what the operator should look at."""


@dataclass(frozen=True)
class RoundResult:
    round: int
    base_id: str
    delta_id: str
    status: str
    reason: str | None
    next_base_id: str | None
    metrics: dict[str, float]


class CoordinatorClient:
    """The few HTTP calls a node makes to the coordinator's /v1 API."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=30)

    def info(self) -> dict:
        response = self._http.get("/v1/info")
        response.raise_for_status()
        return response.json()

    def delta(self, delta_id: str) -> dict | None:
        response = self._http.get(f"/v1/deltas/{delta_id}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.info()
            except httpx.HTTPError as exc:
                if time.monotonic() > deadline:
                    raise NodeError(f"coordinator at {self.url} unreachable: {exc}") from exc
                time.sleep(1.0)

    def close(self) -> None:
        self._http.close()


class NodeDaemon:
    """Runs a node's rounds; `stop()` (e.g. from a signal handler) ends it at the next wait."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        config.work_dir.mkdir(parents=True, exist_ok=True)
        self.key_pair = load_or_create_identity(config.identity_path)
        self.peer_id = peer_id_of(self.key_pair)
        self.blobs = BlobStore(config.work_dir / "blobs")
        self.client = CoordinatorClient(config.coordinator_url)
        self._stop = threading.Event()
        self.host: SwarmHost | None = None

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> list[RoundResult]:
        import torch

        torch.set_num_threads(self.config.torch_threads)
        info = self.client.wait_ready(timeout=120)
        self.host = SwarmHost(
            self.key_pair,
            self.blobs,
            topic=info["topic"],
            listen_host=self.config.p2p_host,
            listen_port=self.config.p2p_port,
        )
        self.host.start()
        log.info(
            "node %s (%s) listening on %s", self.peer_id, self.config.domain, self.host.listen_addrs
        )
        try:
            self._connect(info)
            results = []
            done = 0
            while not self._stop.is_set() and (
                self.config.rounds == 0 or done < self.config.rounds
            ):
                results.append(self.run_round(self.client.info()))
                done += 1
            return results
        finally:
            self.host.stop()
            self.client.close()

    def _connect(self, info: dict) -> None:
        assert self.host is not None
        for addr in [*info["multiaddrs"], *self.config.bootstrap_peers]:
            try:
                self.host.connect(addr)
                log.info("connected to %s", addr)
            except Exception as exc:  # one unreachable address is not fatal
                log.warning("could not dial %s: %s", addr, exc)
        if not self.host.connected_peers():
            raise NodeError(f"could not reach the coordinator's peer at {info['multiaddrs']}")

    def run_round(self, info: dict) -> RoundResult:
        """Train one round on the current base and publish the delta; wait for the merge."""
        assert self.host is not None
        number, base_id, revision = info["round"], info["base_id"], info["base_revision"]
        base_dir = self.config.work_dir / "checkpoints" / revision
        self._collect_garbage(keep_checkpoint=revision)
        log.info("round=%d pulling base %s", number, base_id[:12])
        pull(
            self.config.coordinator_url, revision, base_dir, repo_id=info["repo_id"], progress=False
        )

        from node.envs import get_environment
        from node.model import load_policy
        from node.pipeline import train_rl

        model, tokenizer = load_policy(base_dir)
        env = get_environment(self.config.domain)
        train = self.config.train

        def on_step(metrics: dict[str, float]) -> None:
            log.info(
                "round=%d step=%d/%d reward=%.3f success=%.3f tool_calls=%.2f",
                number,
                int(metrics["step"]) + 1,
                train.steps,
                metrics.get("reward_mean", float("nan")),
                metrics.get("success_rate", float("nan")),
                metrics.get("tool_calls_mean", float("nan")),
            )

        history = train_rl(
            model,
            tokenizer,
            env,
            steps=train.steps,
            tasks_per_step=train.tasks_per_step,
            samples_per_task=train.samples_per_task,
            seed=self.config.seed + 1000 * number,
            on_step=on_step,
            lr=train.learning_rate,
            temperature=train.temperature,
        )
        base = dict(iter_base_tensors(base_dir))
        state = model.state_dict()
        last = history[-1] if history else {}
        metrics = {k: float(v) for k, v in last.items() if isinstance(v, int | float)}
        manifest = pack_delta(
            base,
            {name: state[name] for name in base},
            self.blobs,
            peer_id=self.peer_id,
            public_key=public_key_bytes(self.key_pair),
            domain=self.config.domain,
            base_id=base_id,
            round=number,
            steps=train.steps,
            metrics=metrics,
        )
        signed = sign_manifest(manifest, self.key_pair)
        self._keep_manifest(signed)
        log.info(
            "round=%d delta %s: %d tensors changed, %d bytes",
            number,
            signed.manifest_id[:12],
            len(manifest.tensors),
            sum(manifest.blobs.values()),
        )
        for sha in manifest.blobs:
            self.host.serve_blob(sha)
        record = self._announce_until_recorded(signed)
        if record["status"] == "rejected":
            raise NodeError(
                f"coordinator rejected delta {signed.manifest_id[:12]}: {record['reason']}"
            )
        next_base = self._wait_for_next_base(base_id)
        return RoundResult(
            number,
            base_id,
            signed.manifest_id,
            record["status"],
            record.get("reason"),
            next_base,
            metrics,
        )

    def _collect_garbage(self, keep_checkpoint: str) -> None:
        """A new round starts: earlier deltas were merged, earlier bases are superseded."""
        removed = self.blobs.gc(keep=set())
        checkpoints = self.config.work_dir / "checkpoints"
        if checkpoints.is_dir():
            for folder in checkpoints.iterdir():
                if folder.is_dir() and folder.name != keep_checkpoint:
                    shutil.rmtree(folder, ignore_errors=True)
        if removed:
            log.info("removed %d blobs of earlier rounds", removed)

    def _keep_manifest(self, signed: SignedManifest) -> Path:
        """Keep the signed manifest beside the blobs: the node's own record of what it published."""
        folder = self.config.work_dir / "deltas"
        folder.mkdir(exist_ok=True)
        path = folder / f"{signed.manifest_id}.msgpack"
        path.write_bytes(
            encode_message(
                DeltaAnnounced(manifest_bytes=signed.manifest_bytes, signature=signed.signature)
            )
        )
        return path

    def _announce_until_recorded(self, signed: SignedManifest) -> dict:
        """Announce on gossip, again every few seconds, until the coordinator records a verdict."""
        assert self.host is not None
        message = encode_message(
            DeltaAnnounced(manifest_bytes=signed.manifest_bytes, signature=signed.signature)
        )
        deadline = time.monotonic() + self.config.round_timeout_s
        try:
            self.host.wait_for_peers_in_topic(1, timeout=30)
        except Exception as exc:
            log.warning("gossip mesh not formed yet (%s); announcing anyway", exc)
        next_announce = 0.0
        while time.monotonic() < deadline and not self._stop.is_set():
            if time.monotonic() >= next_announce:
                self.host.publish(message)
                log.info("announced delta %s", signed.manifest_id[:12])
                next_announce = time.monotonic() + 10.0
            record = self.client.delta(signed.manifest_id)
            if record is not None:
                log.info("delta %s is %s", signed.manifest_id[:12], record["status"])
                return record
            self._stop.wait(1.0)
        raise NodeError(f"coordinator did not record delta {signed.manifest_id[:12]} in time")

    def _wait_for_next_base(self, base_id: str) -> str | None:
        deadline = time.monotonic() + self.config.round_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            info = self.client.info()
            if info["base_id"] != base_id:
                log.info(
                    "merged checkpoint %s published (round %d)",
                    info["base_id"][:12],
                    info["round"] - 1,
                )
                return info["base_id"]
            self._stop.wait(2.0)
        return None


def run_node(config: NodeConfig) -> list[RoundResult]:
    """Entry point for `skillswarm node run`: runs until its rounds are done or SIGTERM."""
    import signal

    daemon = NodeDaemon(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    return daemon.run()
