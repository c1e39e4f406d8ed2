"""``batch_invariant=True`` under tensor parallelism: torchrun with gloo, 2 ranks, both
backends (``_batch_invariant_worker.py``): a block of tokens gets the same bits alone and in
batches of other sizes, positions and budgets, on every rank, for the three ops."""

from pathlib import Path

import pytest

from tests._torchrun import check_passed, torchrun_results, triton_runs_here

WORKER = Path(__file__).with_name("_batch_invariant_worker.py")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_tp2_block_outputs_are_batch_invariant(tmp_path):
    impls = ["triton", "torch"] if triton_runs_here() else ["torch"]
    results = torchrun_results(WORKER, 2, *impls, results=tmp_path / "results.json",
                               timeout=600)
    for name in results:
        check_passed(results, name)
    assert len(results) == 3 * 2 * len(impls)
