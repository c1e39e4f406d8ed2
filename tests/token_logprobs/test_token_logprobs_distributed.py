"""Log-probs and entropy under real tensor parallelism (torchrun, gloo): 2 and 3 ranks, equal and
unequal (``vocab_range``) shards, sequence parallelism, both backends."""

from pathlib import Path

import pytest

from tests._torchrun import run_torchrun, triton_runs_here

WORKER = Path(__file__).with_name("_distributed_worker.py")


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [2, 3])
def test_tp_matches_full_vocab_oracle(nproc):
    impls = "triton,torch" if triton_runs_here() else "torch"
    out = run_torchrun(WORKER, nproc, impls, timeout=600)
    assert "log-prob cases passed on" in out

