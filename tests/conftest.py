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
    """The embedded default base model (warm-started as `skillswarm demo` builds it), built once."""
    from node.model import create_base_checkpoint

    return create_base_checkpoint(tmp_path_factory.mktemp("base") / "base")
