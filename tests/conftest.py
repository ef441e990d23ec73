"""Shared test setup: one torch thread per process, GPU tests skipped where there is no GPU and
vLLM tests where there is no vLLM, the order pytest-xdist's workers take the test files in, and the
shared tiny base model."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Torch's OpenMP threads spin while they wait for work: beside the other pytest-xdist worker that
# more than halves a two-thread build's speed (measured: 38 warm-start steps a minute spinning,
# 68 waiting passively). Read when torch loads, so set before anything imports it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Tests on tiny_base run real training, merging and evaluation rounds.
TINY_BASE_TIMEOUT_S = 1800


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


# The order pytest-xdist hands out test files in (`--dist loadfile --no-loadscope-reorder`):
# the file that first builds tiny_base and the demo, then the files that do not need tiny_base
# (they run beside its building), then those that do; the longest of each kind first.
FIRST_FILES = ("tests/test_cli.py", "tests/test_demo.py")
LONG_FILES = (
    "tests/test_node_daemon.py",
    "tests/test_round_e2e.py",
    "tests/test_rounds.py",
    "tests/test_checkpointing.py",
    "tests/test_pipeline.py",
    "tests/test_merge_methods.py",
    "tests/test_pretrain.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU tests where there is no GPU and vLLM tests where vLLM is not installed (they run
    in the venv `.ci/vllm-cpu` makes), and order the test files as above."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="needs vLLM (marked vllm; .ci/vllm-cpu runs them)")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)

    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    needs_base = {file_of(item) for item in items if "tiny_base" in item.fixturenames}

    for item in items:
        if "tiny_base" in item.fixturenames:
            item.add_marker(pytest.mark.timeout(TINY_BASE_TIMEOUT_S))

    def rank(item: pytest.Item) -> tuple[int, int, bool]:
        path = file_of(item)
        uses_base = "tiny_base" in item.fixturenames
        if path in FIRST_FILES:
            return (FIRST_FILES.index(path), 0, not uses_base)
        long = LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)
        return (len(FIRST_FILES) + (path in needs_base), long, not uses_base)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def tiny_base() -> Path:
    """The embedded base shipped in the package (`skillswarm bootstrap`'s recommended settings:
    copy pretraining, then a warm start on math, code and search, so sampled episodes sometimes
    succeed and RL has something to learn from). Read only: copy it before changing it."""
    from skillswarm.node.bootstrap import embedded_base

    return embedded_base()


@pytest.fixture
def not_a_coordinator() -> Iterator[str]:
    """The URL of an HTTP server answering 404 to everything: a node asking it fails at once."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's API)
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, name="not-a-coordinator")
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="session")
def math_env():
    """The math environment (generated arithmetic tasks with a calculator)."""
    from skillswarm.agent.envs import get_environment

    return get_environment("math")


@pytest.fixture(scope="session")
def math_tokenizer(math_env):
    """A byte-level tokenizer trained on the chat template and 300 math solver demonstrations:
    small tiny models built on it train in seconds."""
    from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer
    from skillswarm.node.bootstrap import render_demonstrations

    renderer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    corpus = list(TEMPLATE_FIXED_STRINGS) + render_demonstrations(renderer, [math_env], 300, seed=0)
    return build_tokenizer(corpus)
