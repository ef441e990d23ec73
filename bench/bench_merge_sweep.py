"""Which merge keeps every skill? One round's deltas merged by each method, scored on every domain.

From one base, each domain's node trains its recipe (k steps, times --rounds-worth) and packs its
delta as a node does; then the three deltas are merged by each spec of the sweep (the coordinator's
streaming merge through mergekit) and every merge is scored greedily on the same held-out tasks of
every domain. Prints, per spec, success per domain with its 95% Wilson interval, the paired
difference with the base (bootstrap interval), and the retention (merged − base) / (expert − base)
of each domain's expert gain. Every merge leaves the tensors --keep-base-tensors names at the
base, as the coordinator's plan does (default: its default, the embedding and head); with
--compare-keep-base each spec is also merged over every tensor (its name followed by "·all"), so
the two are compared on the same deltas and tasks. Each expert is scored on every domain, which
shows what a delta alone costs the others, with the kept tensors at the base as the merges apply
it (and whole as `expert:D·all` with --compare-keep-base, the reference of the "·all" merges'
retention). Writes
`sweep.json` into --out; `--reuse` merges the deltas a previous run left there instead of
training again.

Run: `python bench/bench_merge_sweep.py [--rounds-worth 1 | --swarm-steps] [--eval-tasks 128]
[--eval-seed 0] [--seed 0] [--base DIR] [--out runs/bench-merge-sweep] [--reuse]
[--only linear,ties-sum,…] [--keep-base-tensors P,…|none] [--compare-keep-base]
[--weighted DOMAIN=W,… …]`. `--weighted search=2` merges search's delta alone at twice its size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from skillswarm.agent.evaluate import evaluate_checkpoint
from skillswarm.agent.model import load_policy, set_torch_threads
from skillswarm.agent.stats import paired_difference
from skillswarm.coordinator.candidates import kept_at_base
from skillswarm.coordinator.config import MergePlan
from skillswarm.coordinator.evaluation import scores_row
from skillswarm.coordinator.gates import write_expert_checkpoint
from skillswarm.merge.methods import MergeSpec
from skillswarm.merge.streaming import TaskVector, merge_checkpoint
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.node.recipes import recipe_for
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader, pack_delta
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes
from skillswarm.protocol.manifest import DeltaManifest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_swarm import (  # noqa: E402 (the bench folder is no package)
    DEFAULT_STEPS,
    DOMAINS,
    add_keep_base_argument,
    folder_id,
    parse_weights,
    train_steps,
)

SWEEP: dict[str, MergeSpec] = {
    "linear": MergeSpec(method="linear", parameters={"weight": 1.0}),
    "task_arithmetic-0.5": MergeSpec(method="task_arithmetic", parameters={"weight": 0.5}),
    "task_arithmetic-0.75": MergeSpec(method="task_arithmetic", parameters={"weight": 0.75}),
    "task_arithmetic-1.0": MergeSpec(method="task_arithmetic", parameters={"weight": 1.0}),
    "ties-0.5": MergeSpec(method="ties", parameters={"weight": 1.0, "density": 0.5}),
    "ties-sum-0.5": MergeSpec(
        method="ties", parameters={"weight": 1.0, "density": 0.5, "normalize": False}
    ),
    "dare_ties-0.5": MergeSpec(method="dare_ties", parameters={"weight": 1.0, "density": 0.5}),
    "ram": MergeSpec(method="ram", parameters={}),
    "ramplus_tl": MergeSpec(method="ramplus_tl", parameters={}),
}


def score(folder: Path, domains: tuple[str, ...], n_tasks: int, seed: int) -> dict[str, dict]:
    policy = load_policy(folder)
    return {
        d: scores_row(evaluate_checkpoint(policy, d, n_tasks=n_tasks, seed=seed)) for d in domains
    }


def cell(row: dict[str, Any]) -> str:
    return (
        f"{100 * row['success_rate']:5.1f} "
        f"[{100 * row['success_low']:4.1f},{100 * row['success_high']:5.1f}]"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds-worth", type=int, default=1, help="recipe rounds per expert")
    parser.add_argument("--eval-tasks", type=int, default=128)
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the training tasks")
    parser.add_argument("--base", type=Path, help="base model folder (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-merge-sweep"))
    parser.add_argument("--reuse", action="store_true", help="merge the deltas already in --out")
    parser.add_argument("--only", help=f"comma-separated specs of {', '.join(SWEEP)}")
    parser.add_argument(
        "--swarm-steps",
        action="store_true",
        help=f"train each expert the swarm bench's steps a round ({DEFAULT_STEPS}) instead of "
        "--rounds-worth recipe rounds",
    )
    add_keep_base_argument(parser)
    parser.add_argument(
        "--weighted",
        type=parse_weights("--weighted"),
        action="append",
        default=[],
        metavar="DOMAIN=W,…",
        help="also merge the named domains' deltas (only those) by task arithmetic at these "
        "weights, e.g. search=2 or math=0.5,code=1,search=1 (repeatable)",
    )
    parser.add_argument(
        "--compare-keep-base",
        action="store_true",
        help="also merge each spec over every tensor, named SPEC·all",
    )
    args = parser.parse_args()
    if args.base is None:
        from skillswarm.node.bootstrap import embedded_base

        args.base = embedded_base()
    if args.compare_keep_base and not args.keep_base_tensors:
        parser.error("--compare-keep-base needs --keep-base-tensors to name the tensors kept")
    names = list(SWEEP) if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in SWEEP]
    if unknown:
        parser.error(f"unknown specs {unknown}; the sweep has {', '.join(SWEEP)}")
    set_torch_threads(1)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    blobs = BlobStore(args.out / "blobs")
    manifests = args.out / "manifests"
    if not args.reuse:
        shutil.rmtree(manifests, ignore_errors=True)
        manifests.mkdir()
        key = load_or_create_identity(args.out / "identity.key")
        base_tensors = dict(iter_base_tensors(args.base))
        for index, domain in enumerate(DOMAINS):
            steps = (
                DEFAULT_STEPS[domain]
                if args.swarm_steps
                else recipe_for(domain).steps * args.rounds_worth
            )
            print(f"training the {domain} expert: {steps} steps", flush=True)
            model, tokenizer = load_policy(args.base)
            train_steps(model, tokenizer, domain, steps, args.seed + 1000 + 100 * index)
            state = model.state_dict()
            manifest = pack_delta(
                base_tensors,
                {name: state[name] for name in base_tensors},
                blobs,
                peer_id=peer_id_of(key),
                public_key=public_key_bytes(key),
                domain=domain,
                base_id=folder_id(args.base),
                round=1,
                steps=steps,
            )
            (manifests / f"{domain}.msgpack").write_bytes(manifest.encode())
    readers = {
        d: DeltaReader(DeltaManifest.decode((manifests / f"{d}.msgpack").read_bytes()), blobs)
        for d in DOMAINS
    }
    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, dict[str, dict]] = {
        "base": score(args.base, DOMAINS, args.eval_tasks, args.eval_seed)
    }
    # Each expert is scored as the merges apply it (the kept tensors at the base); with
    # --compare-keep-base also whole, the reference for the merges of every tensor.
    expert_kinds = [("", args.keep_base_tensors)]
    if args.compare_keep_base:
        expert_kinds.append(("·all", []))
    for domain, reader in readers.items():
        for suffix, keep_base in expert_kinds:
            folder = write_expert_checkpoint(
                args.base, reader, work / f"expert-{domain}{suffix}", keep_base
            )
            results[f"expert:{domain}{suffix}"] = score(
                folder, DOMAINS, args.eval_tasks, args.eval_seed
            )
    plan = MergePlan(keep_base_tensors=args.keep_base_tensors)

    runs = [(name, SWEEP[name], False, DOMAINS) for name in names]
    if args.compare_keep_base:
        runs += [(f"{name}·all", SWEEP[name], True, DOMAINS) for name in names]
    for weights in args.weighted:
        label = "weighted:" + ",".join(f"{d}={w:g}" for d, w in weights.items())
        spec = MergeSpec(method="task_arithmetic", parameters={"weight": weights})
        runs.append((label, spec, False, tuple(weights)))
    for label, spec, every_tensor, merged in runs:
        experts = [TaskVector(name=d, expert=readers[d].expert) for d in merged]
        if not every_tensor:
            experts = [kept_at_base(plan, v.name, v) for v in experts]
        folder = merge_checkpoint(args.base, experts, work / label, spec)
        results[label] = score(folder, DOMAINS, args.eval_tasks, args.eval_seed)
        cells = "".join(f"{cell(results[label][d]):>24}" for d in DOMAINS)
        print(f"{label:<22}{cells}", flush=True)
    names = [label for label, _, _, _ in runs]
    expert_suffix = {label: "·all" if every_tensor else "" for label, _, every_tensor, _ in runs}
    base = results["base"]
    table: dict[str, Any] = {}
    print(f"\ngreedy held-out success on {args.eval_tasks} tasks per domain (95% Wilson)")
    print(f"{'model':<22}" + "".join(f"{d:>24}" for d in DOMAINS))
    for label, rows in results.items():
        print(
            f"{label:<22}" + "".join(f"{cell(rows[d]) if d in rows else '–':>24}" for d in DOMAINS)
        )
    print("\nmerged − base, paired (points, 95% bootstrap), and retention of the expert's gain")
    for name in names:
        line, entry = f"{name:<22}", {}
        for d in DOMAINS:
            diff = paired_difference(base[d]["successes"], results[name][d]["successes"])
            expert = results[f"expert:{d}{expert_suffix[name]}"]
            gain = expert[d]["success_rate"] - base[d]["success_rate"]
            retention = diff.mean / gain if gain > 0 else None
            entry[d] = {**diff.to_dict(), "retention": retention}
            kept = f"{100 * retention:4.0f}%" if retention is not None else "  n/a"
            interval = f"[{100 * diff.low:+5.1f},{100 * diff.high:+5.1f}]"
            line += f"  {d} {100 * diff.mean:+5.1f} {interval} {kept}"
        table[name] = entry
        print(line)
    compact = {
        label: {
            d: {k: row[k] for k in ("success_rate", "success_low", "success_high")}
            for d, row in rows.items()
        }
        for label, rows in results.items()
    }
    (args.out / "sweep.json").write_text(
        json.dumps(
            {
                "settings": {k: str(v) for k, v in vars(args).items()},
                "specs": {label: spec.model_dump() for label, spec, _, _ in runs},
                "keep_base_tensors": args.keep_base_tensors,
                "scores": compact,
                "versus_base": table,
                "minutes": (time.perf_counter() - started) / 60,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min; results: {args.out / 'sweep.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
