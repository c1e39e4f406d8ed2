"""Real multi-process tensor parallelism on CPU: torchrun with gloo, 2 and 4 ranks."""

from pathlib import Path

import pytest

from tests._torchrun import run_torchrun, triton_runs_here

WORKER = Path(__file__).with_name("_distributed_worker.py")


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [2, 4])
def test_every_api_matches_full_vocab_reference(nproc):
    out = run_torchrun(WORKER, nproc, "triton,torch" if triton_runs_here() else "torch")
    assert f"cases passed on {nproc} ranks" in out
