"""The node daemon: pull the current base, train on one domain, publish the signed delta, rebase.

One round: fetch base B_r from the coordinator's registry (every file's sha256 checked), run RL on
the node's domain, compute Δ = θ − B_r, store it as a blob, sign its manifest, announce it on
gossip and serve it until the coordinator has it, then wait for the merged checkpoint B_{r+1}, or
for round r+1 to open on B_r again when the coordinator held round r.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.node.checkpointing import restore_optimizer_state, save_optimizer_state
from skillswarm.node.config import NodeConfig
from skillswarm.node.fanout import FanoutClient
from skillswarm.node.health import HealthServer, NodeStatus
from skillswarm.node.metrics import StepTracker, open_node_tracker
from skillswarm.protocol.api import DeltaOut, DeltaStatus, InfoOut
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import pack_delta
from skillswarm.protocol.host import SwarmHost, freeze_startup_heap
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import SignedManifest, sign_manifest
from skillswarm.protocol.messages import (
    DeltaAnnounced,
    NodeHeartbeat,
    decode_message,
    encode_message,
)
from skillswarm.protocol.pull import PullError, pull

log = logging.getLogger(__name__)

# The optimizer state the last round ended with, under work_dir (NodeConfig.keep_optimizer_state).
CARRIED_OPTIMIZER_FILE = "optimizer-carried.pt"
_T = TypeVar("_T")

# How long a node waits for a first connection to the swarm (the coordinator's libp2p peer or a
# bootstrap peer) after it starts.
CONNECT_TIMEOUT_S = 60.0
# How long a node waits for the coordinator's API to answer when it starts.
STARTUP_TIMEOUT_S = 120.0


class NodeError(RuntimeError):
    """The node cannot go on; the message says what the operator should look at."""


@dataclass(frozen=True)
class RoundResult:
    """One round as the node saw it. `next_base_id` is the base the next round trains on: the
    merged checkpoint, or `base_id` again when the coordinator `held` the round (it closed without
    publishing one); None when the wait ended first (the node was stopped, or round_timeout_s)."""

    round: int
    base_id: str
    delta_id: str
    status: str
    reason: str | None
    next_base_id: str | None
    metrics: dict[str, float]
    held: bool = False


class CoordinatorClient:
    """The few HTTP calls a node makes to the coordinator's /v1 API, answers parsed into the
    models of skillswarm.protocol.api (a malformed answer raises pydantic's ValidationError)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=30)

    def info(self) -> InfoOut:
        response = self._http.get("/v1/info")
        response.raise_for_status()
        return InfoOut.model_validate(response.json())

    def delta(self, delta_id: str) -> DeltaOut | None:
        """The coordinator's record of a delta; None while it has none."""
        response = self._http.get(f"/v1/deltas/{delta_id}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return DeltaOut.model_validate(response.json())

    def close(self) -> None:
        self._http.close()


class _Outage:
    """Asks the coordinator's API for something while riding out a restart of the coordinator:
    a request that finds it away (no connection, a timeout, a 5xx answer from it or a proxy
    before it) is reported once, and its return once; a 4xx is a real refusal and is raised."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.since: float | None = None

    def ask(self, request: Callable[[], _T]) -> tuple[bool, _T | None]:
        """(True, what `request` returned), or (False, None) while the coordinator is away.
        A pull's PullError is judged by the HTTP error that caused it."""
        try:
            value = request()
        except (httpx.HTTPError, PullError) as error:
            cause = error.__cause__ if isinstance(error, PullError) else error
            if not (isinstance(cause, httpx.HTTPError) and _coordinator_away(cause)):
                raise
            if self.since is None:
                self.since = time.monotonic()
                log.warning("coordinator at %s not answering (%s); waiting for it", self.url, cause)
            return False, None
        if self.since is not None:
            away = time.monotonic() - self.since
            log.info("coordinator at %s answers again after %.0f s", self.url, away)
            self.since = None
        return True, value


def _coordinator_away(error: httpx.HTTPError) -> bool:
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500
    return isinstance(error, httpx.TransportError)


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
        self.status = NodeStatus(self.peer_id, config.domain)
        self._training: Any = None  # the AsyncRLRun in progress, if any
        self.fanout: FanoutClient | None = None  # while running, unless fan-out is off
        self._tracker: StepTracker | None = None  # while running, when [tracking] is set

    def stop(self) -> None:
        """End the daemon: a training step in progress finishes and is checkpointed (the next
        start resumes it); waits are abandoned."""
        self._stop.set()
        training = self._training
        if training is not None:
            training.request_stop()

    def run(self) -> list[RoundResult]:
        import torch

        torch.set_num_threads(self.config.torch_threads)
        self._check_sandbox()
        log.info("%s", training_summary(self.config))
        answered, info = self._ask_while_away(self.client.info, "reach it", STARTUP_TIMEOUT_S)
        if not answered or info is None:  # stopped before the coordinator answered
            return []
        self.host = SwarmHost(
            self.key_pair,
            self.blobs,
            topic=info.topic,
            listen_host=self.config.p2p_host,
            listen_port=self.config.p2p_port,
            deliver_gossip=False,  # a node publishes and relays gossip; it reads none
        )
        self.host.start()
        log.info(
            "node %s (%s) listening on %s", self.peer_id, self.config.domain, self.host.listen_addrs
        )
        if self.config.fanout:
            self.fanout = FanoutClient(
                self.host,
                self.config.coordinator_url,
                self.config.work_dir / "checkpoints",
                self.config.work_dir / "fanout",
                wait_s=self.config.fanout_wait_s,
                announce_addrs=self.config.p2p_announce_addrs,
                stop=self._stop,
            )
        health = None
        if self.config.health_port is not None:
            health = HealthServer(
                self.status, self.config.health_host, self.config.health_port
            ).start()
        try:
            self._tracker = open_node_tracker(
                self.config.tracking,
                domain=self.config.domain,
                peer_id=self.peer_id,
                work_dir=self.config.work_dir,
                run_config=self.config.model_dump(mode="json"),
            )
            self._connect(info)
            results = []
            done = 0
            while not self._stop.is_set() and (
                self.config.rounds == 0 or done < self.config.rounds
            ):
                answered, info = self._ask_while_away(
                    self.client.info, "learn the next round", self.config.round_timeout_s
                )
                result = self.run_round(info) if answered and info is not None else None
                if result is None:  # stopped mid-round; the next start resumes it
                    break
                results.append(result)
                done += 1
            return results
        finally:
            self.status.update(phase="stopped")
            if self._tracker is not None:
                self._tracker.close()
            if health is not None:
                health.stop()
            self.host.stop()
            self.client.close()

    def _check_sandbox(self) -> None:
        """A domain that runs model-written code needs the kernel sandbox (bubblewrap) unless the
        config accepts the weaker one; either way /healthz reports the sandbox in force. The
        anchor's domains (`train.anchor`) play episodes too: one that runs model code without
        that sandbox, the weaker one not accepted, is left out of the anchor with a warning."""
        from skillswarm.agent.envs import UnknownEnvironmentError, environment_class
        from skillswarm.agent.sandbox import SandboxUnavailable, require_isolation

        anchor = self.config.train.anchor
        try:
            runs_code = environment_class(self.config.domain).runs_model_code
            anchored = anchor.domains if anchor.active else []
            anchored_code = [d for d in anchored if environment_class(d).runs_model_code]
        except UnknownEnvironmentError as error:
            raise NodeError(str(error)) from error
        if not runs_code and not anchored_code:
            return
        try:
            isolation = require_isolation(accept_weak=self.config.allow_weak_sandbox)
        except SandboxUnavailable as error:
            if runs_code:
                raise NodeError(f"refusing to train {self.config.domain}: {error}") from error
            kept = [d for d in anchor.domains if d not in anchored_code]
            log.warning(
                "the anchor leaves out %s: its episodes run model-written code, and %s",
                ", ".join(anchored_code),
                error,
            )
            train = self.config.train.model_copy(
                update={"anchor": anchor.model_copy(update={"domains": kept})}
            )
            self.config = self.config.model_copy(update={"train": train})
            return
        if not isolation.kernel:
            log.warning(
                "%s runs model-written code with only the %s sandbox (allow_weak_sandbox = "
                "true): such code could read this node's key and files",
                ", ".join(([self.config.domain] if runs_code else []) + anchored_code),
                isolation,
            )
        self.status.update(sandbox={"isolation": str(isolation), "kernel": isolation.kernel})

    def _connect(self, info: InfoOut) -> None:
        """Hold connections to the coordinator's peer and the bootstrap peers (redialled with
        backoff whenever they drop, for as long as the node runs); return once one is up."""
        assert self.host is not None
        self._keep_connected([*info.multiaddrs, *self.config.bootstrap_peers])
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not self.host.connected_peers():
            if self._stop.is_set():
                return
            if time.monotonic() > deadline:
                raise NodeError(
                    f"could not reach the coordinator's peer at {info.multiaddrs} or a "
                    f"bootstrap peer within {CONNECT_TIMEOUT_S:.0f} s"
                )
            self._stop.wait(0.2)

    def _keep_connected(self, multiaddrs: list[str]) -> None:
        assert self.host is not None
        for addr in multiaddrs:
            try:
                self.host.keep_connected([addr])
            except Exception as exc:  # one unusable address is not fatal
                log.warning("cannot dial %s: %s", addr, exc)

    def run_round(self, info: InfoOut) -> RoundResult | None:
        """Train one round on the current base and publish the delta; wait for the round to
        close, merged or held. Returns None when the daemon was stopped during training (its
        checkpoint is kept, and the next start resumes it). A delta already published for this
        round and base (the daemon restarted after publishing) is announced again instead of
        trained anew; one kept for an earlier round, closed since, is not. A delta refused as
        stale (its round closed first) ends the round; any other refusal ends the node."""
        assert self.host is not None
        number, base_id, revision = info.round, info.base_id, info.base_revision
        self._keep_connected(info.multiaddrs)  # the coordinator may listen elsewhere now
        kept = self._kept_delta(base_id, number)
        self.status.update(phase="pulling", round=number, step=0)
        base_dir = self.config.work_dir / "checkpoints" / revision
        if not self._obtain_base(info, base_dir):
            return None
        # Only now: the last round's base is the parent a fanned-out delta is rebuilt on.
        self._collect_garbage(
            keep_checkpoint=revision,
            keep_blobs=(set(kept.verify().blobs) if kept is not None else set())
            | (self.fanout.kept_blobs() if self.fanout is not None else set()),
            keep_training=self._training_dir(base_id, number).name,
        )
        if kept is None:
            trained = self._train(number, base_id, base_dir)
            if trained is None:
                return None
            signed, metrics = trained
        else:
            signed = kept
            metrics = dict(signed.verify().metrics)
            log.info(
                "round=%d re-announcing delta %s kept from before a restart",
                number,
                signed.manifest_id[:12],
            )
        for sha in signed.verify().blobs:
            self.host.serve_blob(sha)
        self.status.update(phase="announcing")
        record = self._announce_until_recorded(signed)
        if record is None:
            return None
        if record.status == DeltaStatus.REJECTED:
            if record.rejection_kind != "stale":
                raise NodeError(
                    f"coordinator rejected delta {signed.manifest_id[:12]}: {record.reason}"
                )
            log.warning(  # the round closed (merged or held) before the delta came in
                "round=%d delta %s came too late (%s); going on to the next round",
                number,
                signed.manifest_id[:12],
                record.reason,
            )
        self.status.update(phase="waiting for the merge")
        next_base = self._wait_for_next_base(base_id, number)
        if next_base is None and self._stop.is_set():
            return None
        self.status.rounds.inc()
        return RoundResult(
            number,
            base_id,
            signed.manifest_id,
            record.status,
            record.reason,
            next_base,
            metrics,
            held=next_base == base_id,
        )

    def _ask_while_away(
        self, request: Callable[[], _T], what: str, timeout: float
    ) -> tuple[bool, _T | None]:
        """(True, what `request` returned), asked again every 2 s while the coordinator is away
        (see _Outage), for up to `timeout` s; (False, None) when the daemon is stopped first."""
        deadline = time.monotonic() + timeout
        outage = _Outage(self.client.url)
        while not self._stop.is_set():
            answered, value = outage.ask(request)
            if answered:
                return True, value
            if time.monotonic() > deadline:
                raise NodeError(
                    f"could not {what}: the coordinator at {self.client.url} did not answer "
                    f"within {timeout:.0f} s"
                )
            self._stop.wait(2.0)
        return False, None

    def _obtain_base(self, info: InfoOut, base_dir: Path) -> bool:
        """The round's base in `base_dir`: rebuilt from its delta fetched from peers when this
        node holds the parent, else pulled whole from the registry; False when stopped first."""
        if self.fanout is not None and self.fanout.rebase(info, base_dir):
            return True
        if self._stop.is_set():
            return False
        log.info("round=%d pulling base %s", info.round, info.base_id[:12])
        return self._pull_base(info.base_revision, base_dir, info.repo_id)

    def _pull_base(self, revision: str, base_dir: Path, repo_id: str) -> bool:
        """Pull the round's base from the registry, resuming across a coordinator that stops
        answering meanwhile (a pull keeps what it has and goes on from there); False when the
        daemon is stopped first."""
        pulled, _ = self._ask_while_away(
            lambda: pull(
                self.config.coordinator_url, revision, base_dir, repo_id=repo_id, progress=False
            ),
            f"pull base {revision}",
            self.config.round_timeout_s,
        )
        return pulled

    def _training_dir(self, base_id: str, number: int) -> Path:
        return self.config.work_dir / "training" / f"round-{number}-{base_id[:16]}"

    def _train(
        self, number: int, base_id: str, base_dir: Path
    ) -> tuple[SignedManifest, dict[str, float]] | None:
        """RL on the base (resuming this round's checkpoint if there is one), then the signed
        delta; None when stopped before the last step."""
        from skillswarm.agent.envs import get_environment
        from skillswarm.agent.model import load_policy
        from skillswarm.node.pipeline import AsyncRLRun

        model, tokenizer = load_policy(base_dir)
        env = get_environment(self.config.domain, tasks_file=self.config.tasks_file)
        train = self.config.train.model_copy(
            update={
                "seed": self.config.seed + 1000 * number,
                "checkpoint_every": self.config.checkpoint_every,
            }
        )
        self.status.update(phase="training")

        def on_step(metrics: dict[str, float]) -> None:
            step = int(metrics["step"]) + 1
            reward = metrics.get("reward_mean")
            log.info(
                "round=%d step=%d/%d reward=%.3f success=%.3f tool_calls=%.2f staleness=%d",
                number,
                step,
                train.steps,
                metrics.get("reward_mean", float("nan")),
                metrics.get("success_rate", float("nan")),
                metrics.get("tool_calls_mean", float("nan")),
                int(metrics.get("staleness", 0)),
            )
            self.status.update(step=step, reward=reward)
            self._heartbeat(number, step, reward)

        # A KL term (train.loss.kl_coef > 0) is measured against the model as the run starts,
        # the round's base (a checkpoint of this round is resumed inside run()).
        run = AsyncRLRun(
            model,
            tokenizer,
            env,
            train,
            backend=self._inference_backend(base_dir, model, tokenizer),
            on_step=on_step,
            metrics_path=self.config.work_dir / "metrics" / f"round-{number}.jsonl",
            tracker=self._tracker.for_round(number, train.steps) if self._tracker else None,
            tool_call_format=self.config.tool_call_format,
            checkpoint_dir=self._training_dir(base_id, number) if train.checkpoint_every else None,
        )
        carried = self.config.work_dir / CARRIED_OPTIMIZER_FILE
        if self.config.keep_optimizer_state:
            ended = restore_optimizer_state(
                carried, run.trainer.optimizer, domain=self.config.domain, round=number
            )
            if ended is not None:
                log.info(
                    "round=%d starts from the optimizer state round %d ended with (a checkpoint "
                    "of this round, when there is one, replaces it)",
                    number,
                    ended,
                )
        self._training = run
        try:
            if self._stop.is_set():
                run.request_stop()
            history = run.run()
        finally:
            self._training = None
        steps_done = int(history[-1]["step"]) + 1 if history else 0
        if self._stop.is_set() and steps_done < train.steps:
            log.info("round=%d stopped after step %d; a restart resumes it", number, steps_done)
            return None
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
        if self.config.keep_optimizer_state:
            try:
                save_optimizer_state(
                    carried, run.trainer.optimizer, domain=self.config.domain, round=number
                )
            except OSError as error:
                log.warning(
                    "round=%d optimizer state not kept for the next round: %s", number, error
                )
        self.status.deltas.inc()
        log.info(
            "round=%d delta %s: %d tensors changed, %d bytes",
            number,
            signed.manifest_id[:12],
            len(manifest.tensors),
            sum(manifest.blobs.values()),
        )
        return signed, metrics

    def _kept_delta(self, base_id: str, number: int) -> SignedManifest | None:
        """A delta this node signed for this base and round, with all its blobs still here."""
        folder = self.config.work_dir / "deltas"
        for path in sorted(folder.glob("*.msgpack")) if folder.is_dir() else []:
            try:
                message = decode_message(path.read_bytes())
                if not isinstance(message, DeltaAnnounced):
                    continue
                signed = SignedManifest(
                    manifest_bytes=message.manifest_bytes, signature=message.signature
                )
                manifest = signed.verify()
            except Exception as error:  # a damaged record is not reused
                log.warning("ignoring unreadable kept delta %s: %s", path.name, error)
                continue
            if (
                manifest.base_id == base_id
                and manifest.round == number
                and manifest.peer_id == self.peer_id
                and all(self.blobs.has(sha) for sha in manifest.blobs)
            ):
                return signed
        return None

    def _heartbeat(self, round_number: int, step: int, reward: float | None) -> None:
        """Tell the swarm this node is alive and how far it is (best effort)."""
        if self.host is None:
            return
        if self.fanout is not None:
            self.fanout.announce()
        finite = reward if reward is not None and math.isfinite(reward) else None
        message = NodeHeartbeat(
            domain=self.config.domain, round=round_number, step=step, reward=finite
        )
        try:
            self.host.publish(encode_message(message))
        except Exception as error:  # a missed heartbeat is harmless; training goes on
            log.debug("heartbeat not sent: %s", error)

    def _inference_backend(self, base_dir: Path, model: Any, tokenizer: Any) -> Any:
        """The configured rollout engine, holding the round's base weights."""
        settings = self.config.inference
        if settings.backend == "hf":
            import copy

            from skillswarm.agent.inference import HFBackend

            behaviour = model if self.config.train.max_staleness == 0 else copy.deepcopy(model)
            return HFBackend(behaviour.eval(), tokenizer, max_batch_size=settings.max_batch_size)
        from skillswarm.agent.inference_vllm import VLLMBackend

        # One engine for the daemon's life, started on the first round's base: every round's run
        # pushes its base weights into it before the first rollout (`AsyncRLRun.run`), so a
        # rebase loads nothing from disk.
        backend = getattr(self, "_vllm_backend", None)
        if backend is None:
            backend = self._vllm_backend = VLLMBackend(
                base_dir,
                tokenizer=tokenizer,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                max_model_len=settings.max_model_len,
                dtype=settings.dtype,
                seed=self.config.seed,
                engine_options=settings.engine_options,
            )
        return backend

    def _collect_garbage(
        self, keep_checkpoint: str, keep_blobs: set[str], keep_training: str
    ) -> None:
        """A new round starts: earlier deltas were merged, earlier bases are superseded, earlier
        rounds' training checkpoints are done with."""
        removed = self.blobs.gc(keep=keep_blobs)
        for parent, keep in (("checkpoints", keep_checkpoint), ("training", keep_training)):
            folder = self.config.work_dir / parent
            for child in folder.iterdir() if folder.is_dir() else []:
                if child.is_dir() and child.name != keep:
                    shutil.rmtree(child, ignore_errors=True)
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

    def _announce_until_recorded(self, signed: SignedManifest) -> DeltaOut | None:
        """Announce on gossip, again every few seconds, until the coordinator records a verdict
        (None when the daemon is stopped first)."""
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
        last_fetch_failure: str | None = None
        outage = _Outage(self.client.url)
        while time.monotonic() < deadline and not self._stop.is_set():
            if time.monotonic() >= next_announce:
                self.host.publish(message)
                log.info("announced delta %s", signed.manifest_id[:12])
                next_announce = time.monotonic() + 10.0
            answered, record = outage.ask(lambda: self.client.delta(signed.manifest_id))
            if not answered:
                self._stop.wait(1.0)
                continue
            if record is not None and record.rejection_kind == "fetch":
                # The coordinator could not download the blobs (a dropped link, say): it takes
                # the next announcement again, so keep announcing and serving.
                if record.reason != last_fetch_failure:
                    last_fetch_failure = record.reason
                    log.warning(
                        "coordinator could not fetch delta %s (%s); announcing again",
                        signed.manifest_id[:12],
                        last_fetch_failure,
                    )
            elif record is not None:
                log.info("delta %s is %s", signed.manifest_id[:12], record.status)
                return record
            self._stop.wait(1.0)
        if self._stop.is_set():
            return None
        raise NodeError(f"coordinator did not record delta {signed.manifest_id[:12]} in time")

    def _wait_for_next_base(self, base_id: str, number: int) -> str | None:
        """Wait for round `number`, trained on `base_id`, to close; return the next round's base.
        That is the merged checkpoint the coordinator published, or `base_id` again when it
        opened a later round on the same base (it held round `number`: a merge worse than the
        base is not published). None when the daemon is stopped or round_timeout_s passes."""
        deadline = time.monotonic() + self.config.round_timeout_s
        outage = _Outage(self.client.url)
        while time.monotonic() < deadline and not self._stop.is_set():
            answered, info = outage.ask(self.client.info)
            if not answered or info is None:  # info is an InfoOut whenever it answered
                self._stop.wait(2.0)
                continue
            if info.base_id != base_id:
                log.info(
                    "merged checkpoint %s published; round %d trains on it",
                    info.base_id[:12],
                    info.round,
                )
                return info.base_id
            if info.round > number:
                log.info(
                    "round %d was held; training round %d from the same base", number, info.round
                )
                return base_id
            self._stop.wait(2.0)
        return None


def training_summary(config: NodeConfig) -> str:
    """One line on the settings a node trains with: the recipe they start from, the main
    hyper-parameters, and the fields the config sets otherwise."""
    train = config.train
    if config.train_recipe is not None:
        start = f"the {config.train_recipe} recipe"
    else:
        start = f"RLConfig's defaults, {config.domain} having no recipe,"
    optimizer = {"adamw": "AdamW", "sgd": "SGD"}.get(train.optimizer, train.optimizer)
    settings = (
        f"{optimizer} lr {train.learning_rate:g}, temperature {train.temperature:g}, "
        f"{train.tasks_per_step} tasks x {train.samples_per_task} samples"
    )
    if train.loss.kl_coef > 0:
        settings += f", KL to the round's base {train.loss.kl_coef:g}"
    if train.imitation.active:
        settings += (
            f", {train.imitation.steps} imitation steps at lr {train.imitation.learning_rate:g} "
            "first"
        )
    if train.guidance > 0:
        settings += f", guidance {train.guidance:g}"
    if train.anchor.active:
        settings += f", anchor {train.anchor.coef:g} on {', '.join(train.anchor.domains)}"
    values = train.model_dump()
    overridden = []
    for path in config.train_overrides:
        value: Any = values
        for key in path.split("."):
            value = value[key]
        overridden.append(f"{path}={value}")
    return f"training with {start} ({settings}); overridden: {', '.join(overridden) or 'none'}"


def run_node(config: NodeConfig) -> list[RoundResult]:
    """Entry point for `skillswarm node run`: runs until its rounds are done or SIGTERM."""
    import signal

    freeze_startup_heap()
    daemon = NodeDaemon(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    return daemon.run()
