"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A default gloo process group of one rank on a HashStore, destroyed after the test."""
    import torch.distributed as dist  # only the tests that ask for a group import torch for it

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
