"""A real process group in the test process: gloo, one rank, a file store."""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist


@contextlib.contextmanager
def single_rank_group(tmp_path):
    """A gloo group of this process alone, torn down afterwards (other tests run without one)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()
