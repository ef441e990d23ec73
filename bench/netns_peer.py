"""One light peer of bench/bench_swarm_netns.py: the real node daemon with synthetic training.

`SyntheticNode` is `skillswarm.node.daemon.NodeDaemon` with only `_train` replaced: instead of
RL it loads the round's base, moves a given fraction of each floating-point tensor's elements by
a small random amount, packs the delta with the project's `pack_delta`, signs it and keeps its
manifest as the real `_train` does. Pulling and rebasing, announcing until recorded, serving
blobs, waiting for the next base, heartbeats and the health server are the real daemon's.

Run by the simulator inside a peer's network namespace:

    python bench/netns_peer.py --config node.toml [--sparsity 0.01] [--scale 0.01] [--train-s 2]

Besides the daemon's own log lines it appends one JSON line per round to
`work_dir/sim-events.jsonl`: the wall time the round's base was in place (pulled and checked)
and the time its delta was signed, which the simulator reads to time rebases.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.node.config import NodeConfig
from skillswarm.node.daemon import NodeDaemon, NodeError
from skillswarm.protocol.delta import pack_delta
from skillswarm.protocol.host import freeze_startup_heap
from skillswarm.protocol.identity import public_key_bytes
from skillswarm.protocol.manifest import SignedManifest, sign_manifest
from skillswarm.protocol.tomlconfig import load_config

log = logging.getLogger("netns_peer")


class SyntheticNode(NodeDaemon):
    """The real daemon; a round's "training" is a sparse random perturbation of the base."""

    def __init__(self, config: NodeConfig, sparsity: float, scale: float, train_s: float) -> None:
        super().__init__(config)
        self.sparsity = sparsity
        self.scale = scale
        self.train_s = train_s

    def _event(self, **fields: object) -> None:
        path = self.config.work_dir / "sim-events.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), **fields}) + "\n")

    def _train(
        self, number: int, base_id: str, base_dir: Path
    ) -> tuple[SignedManifest, dict[str, float]] | None:
        import torch

        self._event(event="rebased", round=number, base_id=base_id)
        self.status.update(phase="training")
        started = time.monotonic()
        # A seed per peer and round: every peer's delta differs, a restarted peer's is the same.
        generator = torch.Generator().manual_seed(
            (int.from_bytes(self.peer_id.encode()[-8:], "big") + 7919 * number) % (2**63)
        )
        base = dict(iter_base_tensors(base_dir))
        tuned: dict[str, torch.Tensor] = {}
        for name, tensor in base.items():
            if not tensor.is_floating_point() or tensor.numel() == 0:
                tuned[name] = tensor
                continue
            flat = tensor.detach().float().reshape(-1).clone()
            count = max(1, round(self.sparsity * flat.numel()))
            where = torch.randint(flat.numel(), (count,), generator=generator)
            rms = max(float(flat.pow(2).mean().sqrt()), 1e-3)
            flat[where] += self.scale * rms * torch.randn(count, generator=generator)
            tuned[name] = flat.reshape(tensor.shape).to(tensor.dtype)
        # Training time, if asked for; a stop request ends it like a real run's step.
        while time.monotonic() - started < self.train_s:
            if self._stop.is_set():
                return None
            self._stop.wait(0.2)
        metrics = {"synthetic": 1.0, "sparsity": float(self.sparsity)}
        manifest = pack_delta(
            base,
            tuned,
            self.blobs,
            peer_id=self.peer_id,
            public_key=public_key_bytes(self.key_pair),
            domain=self.config.domain,
            base_id=base_id,
            round=number,
            steps=1,
            metrics=metrics,
        )
        signed = sign_manifest(manifest, self.key_pair)
        self._keep_manifest(signed)
        self.status.deltas.inc()
        self.status.update(step=1)
        self._heartbeat(number, 1, None)
        size = sum(manifest.blobs.values())
        self._event(event="signed", round=number, delta_id=signed.manifest_id, bytes=size)
        log.info(
            "round=%d synthetic delta %s: %d tensors changed, %d bytes",
            number,
            signed.manifest_id[:12],
            len(manifest.tensors),
            size,
        )
        return signed, metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--sparsity", type=float, default=0.01)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--train-s", type=float, default=0.0)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("libp2p", "multiaddr", "httpx", "trio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = load_config(NodeConfig, args.config)
    freeze_startup_heap()
    daemon = SyntheticNode(config, args.sparsity, args.scale, args.train_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    try:
        results = daemon.run()
    except NodeError as error:
        log.error("node error: %s", error)
        return 1
    log.info("done: %d rounds", len(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
