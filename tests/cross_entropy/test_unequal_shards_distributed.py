"""Unequal shards across the TP group (vocabulary columns, sequence-parallel rows): a ValueError
on every rank that sees them first, NaN (never a wrong loss) on a rank that verified its own
shape before, no abort inside the collective; eager and torch.compile, both backends."""

from pathlib import Path

import pytest

from tests._torchrun import run_torchrun

WORKER = Path(__file__).with_name("_unequal_shards_worker.py")


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [2, 3])
def test_unequal_shards_raise_on_every_rank(nproc):
    out = run_torchrun(WORKER, nproc, timeout=600)
    assert f"shape cases passed on {nproc} ranks" in out
