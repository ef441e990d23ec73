"""Bytes on the wire for a real RL delta from the trainer, against the full bf16 checkpoint.

Builds the embedded base and stores it in bfloat16 (as a real checkpoint is). Then, for each node
configuration given, runs one round of its `[train]` section (steps, batch shape, optimizer,
learning rate, loss) with the node's trainer, packs the delta exactly as a node publishes it,
checks the rebuild is bit-exact, and prints the share of weights changed, the delta's bytes and
the ratio to the full checkpoint. The project's target (at least 50x, lossless) is for the round
a GPU node runs (deploy/configs/node-gpu.toml, the default first row). Run:
`python bench/bench_delta_size.py [--config TOML ...] [--lr LR ...] [--warm-start-steps 220]`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from skillswarm.node.config import NodeConfig

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = [
    REPO / "deploy" / "configs" / "node-gpu.toml",  # a rented GPU box: the target's row
    REPO / "deploy" / "configs" / "node-math.toml",  # the CPU swarm of the tiny model
]
TARGET_RATIO = 50.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--config",
        type=Path,
        nargs="+",
        default=DEFAULT_CONFIGS,
        help="node TOML files; one round of each one's [train] section (default: the GPU "
        "node's and the CPU math node's)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        nargs="*",
        default=[],
        help="more rows: the first config's round at these learning rates",
    )
    parser.add_argument("--warm-start-steps", type=int, default=220)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from skillswarm.protocol.tomlconfig import ConfigFileError, load_toml_config

    rounds = []
    for path in args.config:
        try:
            config = load_toml_config(path, NodeConfig)
        except ConfigFileError as error:
            parser.error(str(error))
        rounds.append((path.name, config))
    first_name, first = rounds[0]
    for lr in args.lr:
        rounds.append((f"{first_name}, lr {lr:.0e}", _with_learning_rate(first, lr)))

    from skillswarm.agent.envs import get_environment
    from skillswarm.agent.model import load_policy
    from skillswarm.merge.tensors import iter_base_tensors
    from skillswarm.node.bootstrap import create_base_checkpoint
    from skillswarm.node.pipeline import AsyncRLRun
    from skillswarm.protocol.blobstore import BlobStore
    from skillswarm.protocol.delta import DeltaReader, pack_delta

    work = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    fp32 = create_base_checkpoint(work / "base32", warm_start_steps=args.warm_start_steps)
    model, tokenizer = load_policy(fp32)
    model.to(torch.bfloat16).save_pretrained(work / "base16")
    tokenizer.save_pretrained(work / "base16")
    base = dict(iter_base_tensors(work / "base16"))
    full_bytes = (work / "base16" / "model.safetensors").stat().st_size
    total = sum(t.numel() for t in base.values())
    print(f"full bf16 checkpoint: {full_bytes:,} bytes, {total:,} parameters")
    print(
        f"{'round of':<28} {'optimizer':>9} {'lr':>7} {'steps':>5} {'episodes':>8} "
        f"{'changed':>8} {'delta bytes':>12} {'ratio':>7} {'exact':>6}"
    )
    ratios: list[float] = []
    for index, (name, config) in enumerate(rounds):
        train = config.train.model_copy(update={"device": "cpu", "checkpoint_every": 0})
        model, tokenizer = load_policy(work / "base16")  # fp32 master weights from the bf16 base
        started = time.perf_counter()
        AsyncRLRun(model, tokenizer, get_environment(config.domain), train).run()
        state = model.state_dict()
        tuned = {n: state[n] for n in base}
        store = BlobStore(work / f"blobs-{index}")
        manifest = pack_delta(
            base,
            tuned,
            store,
            peer_id="bench",
            public_key=b"",
            domain=config.domain,
            base_id="0" * 64,
            round=1,
            steps=train.steps,
        )
        delta_bytes = sum(manifest.blobs.values()) + len(manifest.encode())
        reader = DeltaReader(manifest, store)
        exact = True
        changed = 0
        for tensor_name, b in base.items():
            rebuilt = reader.expert(tensor_name, b)
            rebuilt = b if rebuilt is None else rebuilt
            want = tuned[tensor_name].to(torch.bfloat16)
            exact &= torch.equal(rebuilt.view(torch.int16), want.view(torch.int16))
            changed += int((rebuilt.view(torch.int16) != b.view(torch.int16)).sum())
        ratio = full_bytes / delta_bytes
        ratios.append(ratio if exact else 0.0)
        episodes = train.steps * train.tasks_per_step * train.samples_per_task
        print(
            f"{name:<28} {train.optimizer:>9} {train.learning_rate:>7.0e} {train.steps:>5} "
            f"{episodes:>8} {changed / total:>8.2%} {delta_bytes:>12,} {ratio:>6.1f}x "
            f"{str(exact):>6}   ({time.perf_counter() - started:.0f}s)"
        )
    print(
        f"full / delta for a round of {first_name}: {ratios[0]:.1f}x "
        f"(target >= {TARGET_RATIO:.0f}x, lossless)"
    )


def _with_learning_rate(config: NodeConfig, lr: float) -> NodeConfig:
    """`config` with its [train] learning rate replaced by `lr`."""
    train = config.train.model_copy(update={"learning_rate": lr})
    return config.model_copy(update={"train": train})


if __name__ == "__main__":
    main()
