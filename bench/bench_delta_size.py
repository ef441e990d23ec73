"""Bytes on the wire for a real RL delta from the trainer, against the full bf16 checkpoint.

Builds the embedded base, stores it in bfloat16 (as a real checkpoint is), runs a few RL steps on
it with the node's trainer, packs the delta exactly as a node publishes it, checks the rebuild is
bit-exact, and prints the sizes and the ratio. Run: `python bench/bench_delta_size.py [--steps N]`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4, help="RL steps")
    parser.add_argument("--lr", type=float, nargs="+", default=[2e-4, 2e-5, 2e-6])
    parser.add_argument("--warm-start-steps", type=int, default=220)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from merge.streaming import iter_base_tensors
    from node.envs import get_environment
    from node.model import create_base_checkpoint, load_policy
    from node.pipeline import train_rl
    from protocol.blobstore import BlobStore
    from protocol.delta import DeltaReader, pack_delta

    work = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    fp32 = create_base_checkpoint(work / "base32", warm_start_steps=args.warm_start_steps)
    model, tokenizer = load_policy(fp32)
    model.to(torch.bfloat16).save_pretrained(work / "base16")
    tokenizer.save_pretrained(work / "base16")
    base = dict(iter_base_tensors(work / "base16"))
    full_bytes = (work / "base16" / "model.safetensors").stat().st_size
    print(
        f"full bf16 checkpoint: {full_bytes:,} bytes, {sum(t.numel() for t in base.values()):,} "
        "parameters"
    )
    print(f"{'lr':>8} {'steps':>5} {'changed':>9} {'delta bytes':>12} {'ratio':>8} {'exact':>6}")
    env = get_environment("math")
    for lr in args.lr:
        model, tokenizer = load_policy(work / "base16")  # fp32 master weights from the bf16 base
        started = time.perf_counter()
        train_rl(
            model,
            tokenizer,
            env,
            steps=args.steps,
            tasks_per_step=8,
            samples_per_task=4,
            seed=1,
            lr=lr,
        )
        state = model.state_dict()
        tuned = {n: state[n] for n in base}
        store = BlobStore(work / f"blobs-{lr}")
        manifest = pack_delta(
            base,
            tuned,
            store,
            peer_id="bench",
            public_key=b"",
            domain="math",
            base_id="0" * 64,
            round=1,
            steps=args.steps,
        )
        delta_bytes = sum(manifest.blobs.values()) + len(manifest.encode())
        reader = DeltaReader(manifest, store)
        exact = True
        changed = 0
        for name, b in base.items():
            rebuilt = reader.expert(name, b)
            rebuilt = b if rebuilt is None else rebuilt
            want = tuned[name].to(torch.bfloat16)
            exact &= torch.equal(rebuilt.view(torch.int16), want.view(torch.int16))
            changed += int((rebuilt.view(torch.int16) != b.view(torch.int16)).sum())
        total = sum(t.numel() for t in base.values())
        print(
            f"{lr:>8.0e} {args.steps:>5} {changed / total:>8.2%} {delta_bytes:>12,} "
            f"{full_bytes / delta_bytes:>7.1f}x {str(exact):>6}   "
            f"({time.perf_counter() - started:.0f}s)"
        )


if __name__ == "__main__":
    main()
