"""Shared test setup: one torch thread per process, GPU tests skipped where there is no GPU."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory):
    """The embedded math base (`create_base_checkpoint`'s defaults: 480 warm-start steps, past the
    onset of copying numbers into calculator calls, so sampled episodes sometimes succeed and RL
    has something to learn from), built once, with two torch threads: nothing else runs then."""
    from node.model import create_base_checkpoint

    return create_base_checkpoint(tmp_path_factory.mktemp("base") / "base", num_threads=2)
