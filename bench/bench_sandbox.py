"""Cost of the code sandbox per candidate: the code domain's step checks each sampled answer
against its tests in a sandboxed run, so each isolation level's price shows up per candidate.

Checks the same candidates (reference solutions of the code environment's held-out tasks, against
their visible and hidden tests) under each isolation that works here, in a fresh process each (the
isolation is chosen once a process), interleaved over several rounds, and prints
milliseconds per candidate and the ratio of each level to `namespaces` (the sandbox before
bubblewrap; the target is bubblewrap within 1.10x of it).
Run: `python bench/bench_sandbox.py [--candidates 48] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LEVELS = ("audit-hook", "namespaces", "bubblewrap")

_WORKER = """
import json, sys, time
from skillswarm.agent.envs import get_environment
from skillswarm.agent.sandbox import run_tests_in_sandbox, sandbox_isolation

count = int(sys.argv[1])
env = get_environment("code")
tasks = env.tasks("heldout", count, seed=0)
runs = [
    (task.answer, task.metadata["visible_tests"] + task.metadata["hidden_tests"],
     task.metadata["entry_point"])
    for task in tasks
]
sandbox_isolation()  # probe before timing
started = time.perf_counter()
passed = 0
for code, tests, entry in runs:
    passed += run_tests_in_sandbox(code, tests, entry).passed == len(tests)
elapsed = time.perf_counter() - started
print(json.dumps({"level": str(sandbox_isolation()), "ms": 1000 * elapsed / len(runs),
                  "passed": passed, "runs": len(runs)}))
"""


def run_level(level: str, candidates: int) -> dict[str, object] | None:
    env = {**os.environ, "SKILLSWARM_SANDBOX": level}
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, str(candidates)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        print(f"{level}: failed or not available here: {done.stderr.strip()[-300:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--candidates", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {level: [] for level in LEVELS}
    for round_number in range(args.rounds):
        for level in LEVELS:
            if round_number and not times[level]:
                continue  # not available
            result = run_level(level, args.candidates)
            if result is None:
                continue
            assert result["passed"] == result["runs"], result
            times[level].append(float(result["ms"]))
            print(f"round {round_number + 1} {level:>11}: {result['ms']:.1f} ms per candidate")
    baseline = statistics.median(times["namespaces"]) if times["namespaces"] else None
    print(f"\nmedian of {args.rounds} rounds, {args.candidates} candidates each:")
    for level, values in times.items():
        if not values:
            continue
        median = statistics.median(values)
        ratio = f"{median / baseline:.2f}x namespaces" if baseline else ""
        print(f"  {level:>11}: {median:6.1f} ms per candidate  {ratio}")


if __name__ == "__main__":
    main()
