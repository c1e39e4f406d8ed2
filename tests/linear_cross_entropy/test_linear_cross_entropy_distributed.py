"""Fused linear cross entropy under real tensor parallelism: torchrun with gloo, 2 and 4 ranks.

The worker (``_distributed_worker.py``) checks, for both implementations: every rank returns the
full-vocabulary loss (bitwise equal across ranks), ``dC`` is its slice of the full gradient,
``dE`` is the full gradient, and the sequence-parallel variant (gathered ``e``, reduce-scattered
``dE``), under each strategy of the memory budget, against fp64 ``F.cross_entropy(e @ c.T + bias)``;
also with a last shard of padding (a bias of -inf).
"""

from pathlib import Path

import pytest

from tests._torchrun import check_passed, torchrun_results, triton_runs_here

WORKER = Path(__file__).with_name("_distributed_worker.py")


def check_every_case(results: dict, impls, compiled: bool = True) -> None:
    """Every case passed; also the GPU test's check (test_linear_cross_entropy_gpu.py), whose
    ranks share one GPU over gloo and run no compiled case (``compiled=False``:
    ``tests._torchrun.compiled_collectives_run``)."""
    for name in results:
        check_passed(results, name)
    # 20 cases on Triton; the 2 that form a scalar loss's gradients in forward are Triton's
    # only; one group reused with other shapes; frozen hidden states at a budget of the saved
    # tiles; unequal sequence shards under torch.compile (PyTorch backend)
    assert len(results) == (22 * len(impls) - 2 * ("torch" in impls)
                            + ("torch" in impls and compiled)), sorted(results)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_matches_full_vocab_reference(nproc, tmp_path):
    impls = ["triton", "torch"] if triton_runs_here() else ["torch"]
    results = torchrun_results(WORKER, nproc, *impls, results=tmp_path / "results.json",
                               timeout=600)
    check_every_case(results, impls)
