"""Peak memory of the streaming merge against loading every model and merging state dicts.

Builds a base and N experts (base + sparse deltas) of a model with a few large tensors, then
merges them twice, each in a fresh child process: with `merge_checkpoint` (one tensor per input
in memory) and by loading all state dicts and calling mergekit's `merge_state_dicts`. Prints the
peak RSS of each (and above the process's RSS after imports), the ratio, the wall time, and
whether both outputs are bit-identical. Run: `python bench/bench_merge_memory.py [--experts 3]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("streaming", "in-memory")


def _status_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, from /proc (Linux).

    Not getrusage's ru_maxrss: Linux carries it across exec, so a child would report the peak
    of the parent it was forked from.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}; this benchmark needs Linux")


def _build(work: Path, experts: int, tensors: int, mib: int) -> None:
    from safetensors.torch import save_file

    cols = 4096
    rows = mib * 1024 * 1024 // (4 * cols)
    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.mlp.weight" for i in range(tensors)]
    for index in range(experts + 1):
        folder = work / ("base" if index == 0 else f"expert{index}")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "bench"}))
        state = {}
        for name_index, name in enumerate(names):
            base_gen = torch.Generator().manual_seed(1000 + name_index)
            tensor = torch.randn(rows, cols, generator=base_gen)
            if index:
                changed = torch.rand(rows, cols, generator=gen) < 0.05
                tensor += torch.randn(rows, cols, generator=gen) * 0.01 * changed
                del changed
            state[name] = tensor
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        del state


def _measure(mode: str, work: Path, method: str, experts: int) -> None:
    """Child process: one merge, then print its peak RSS as JSON on the last line."""
    torch.set_num_threads(1)
    from mergekit.merge_methods import get
    from skillswarm.merge.methods import MergeSpec
    from skillswarm.merge.streaming import TaskVector, merge_checkpoint
    from skillswarm.merge.tensors import CheckpointTensors

    names = [f"expert{i}" for i in range(1, experts + 1)]
    accepted = {p.name for p in get(method).spec.parameters}
    wanted = {"weight": 1.0 / experts, "density": 0.5}
    parameters = {key: value for key, value in wanted.items() if key in accepted}
    spec = MergeSpec(method=method, parameters=parameters, seed=0)
    baseline = _status_kib("VmRSS")
    started = time.perf_counter()
    if mode == "streaming":
        vectors = []
        for name in names:
            tensors = CheckpointTensors(work / name)
            vectors.append(TaskVector(name=name, expert=lambda key, base, t=tensors: t.get(key)))
        merge_checkpoint(work / "base", vectors, work / "out-streaming", spec)
    else:
        from mergekit.merge_methods import merge_state_dicts
        from safetensors.torch import load_file, save_file

        models = {"base": load_file(work / "base" / "model.safetensors")}
        for name in names:
            models[name] = load_file(work / name / "model.safetensors")
        torch.manual_seed(spec.seed)  # as merge_checkpoint and `mergekit-yaml --random-seed` do
        with torch.no_grad():
            merged = merge_state_dicts(
                models,
                spec.method,
                parameters=spec.bound_parameters(names),
                base="base" if spec.uses_base() else None,
                dtype=spec.torch_dtype(),
                out_dtype=torch.float32,
            )
        (work / "out-in-memory").mkdir()
        save_file(merged, work / "out-in-memory" / "model.safetensors", metadata={"format": "pt"})
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    print(json.dumps({"baseline_kib": baseline, "peak_kib": peak, "seconds": seconds}))


def _same_outputs(work: Path) -> bool:
    from skillswarm.merge.tensors import CheckpointTensors

    ours = CheckpointTensors(work / "out-streaming")
    theirs = CheckpointTensors(work / "out-in-memory")
    if ours.names() != theirs.names():
        return False
    return all(torch.equal(ours.get(n), theirs.get(n)) for n in ours.names())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32, help="size of each float32 tensor")
    parser.add_argument("--method", default="task_arithmetic")
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        _measure(args.measure, args.work, args.method, args.experts)
        return

    work = Path(tempfile.mkdtemp(prefix="bench-merge-memory-"))
    try:
        started = time.perf_counter()
        _build(work, args.experts, args.tensors, args.mib)
        size = (work / "base" / "model.safetensors").stat().st_size
        print(
            f"base + {args.experts} experts, {args.tensors} tensors x {args.mib} MiB float32 "
            f"({size / 2**20:.0f} MiB a model), method {args.method}; "
            f"built in {time.perf_counter() - started:.1f} s"
        )
        results = {}
        for mode in MODES:
            command = [
                sys.executable,
                __file__,
                "--measure",
                mode,
                "--work",
                str(work),
                "--experts",
                str(args.experts),
                "--method",
                args.method,
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{mode} merge failed:\n{done.stderr[-3000:]}")
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{'merge':>10} {'peak MiB':>9} {'after imports':>14} {'above':>8} {'seconds':>8}")
        for mode, r in results.items():
            above = r["peak_kib"] - r["baseline_kib"]
            print(
                f"{mode:>10} {r['peak_kib'] / 1024:>9.0f} {r['baseline_kib'] / 1024:>14.0f} "
                f"{above / 1024:>8.0f} {r['seconds']:>8.1f}"
            )
        stream, memory = results["streaming"], results["in-memory"]
        peak_ratio = memory["peak_kib"] / stream["peak_kib"]
        above_ratio = (memory["peak_kib"] - memory["baseline_kib"]) / max(
            1, stream["peak_kib"] - stream["baseline_kib"]
        )
        print(
            f"in-memory / streaming: peak {peak_ratio:.1f}x, above imports {above_ratio:.1f}x; "
            f"one tensor per input is {(args.experts + 1) * args.mib} MiB"
        )
        print(f"outputs bit-identical: {_same_outputs(work)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
