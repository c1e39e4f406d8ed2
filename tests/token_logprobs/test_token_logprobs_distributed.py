"""Log-probs and entropy under real tensor parallelism (torchrun, gloo): 2 and 3 ranks, equal and
unequal (``vocab_range``) shards, sequence parallelism, both backends.

One launch per world size of ``_distributed_worker.py`` runs the cases of both ops (over logits,
``token_logprobs``; from hidden states, ``linear_token_logprobs``, under each strategy of the
fused engine); each test reads its op's outcomes."""

from pathlib import Path

import pytest

from tests._torchrun import check_passed, torchrun_results, triton_runs_here

WORKER = Path(__file__).with_name("_distributed_worker.py")
IMPLS = ["triton", "torch"] if triton_runs_here() else ["torch"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tp{request.param}") / "results.json"
    return torchrun_results(WORKER, request.param, ",".join(IMPLS), results=out, timeout=600)


def _passed(results, kind, n, impls=IMPLS):
    names = [name for name in results if name.split("/")[1] == kind]
    for name in names:
        check_passed(results, name)
    assert len(names) == n * len(impls), names


def _groups_passed(results, impls, compiled: bool = True) -> int:
    """Every case on reused groups and wrong shapes passed: reused and wrong ranges on both ops
    and unequal sequence shards per backend, and under torch.compile on the PyTorch one."""
    names = [name for name in results if name.split("/")[1] == "groups"]
    for name in names:
        check_passed(results, name)
    assert len(names) == 5 * len(impls) + ("torch" in impls and compiled), names
    return len(names)


def check_both_ops(results, impls, compiled: bool = True) -> None:
    """Every case of both ops passed (the tests below); the GPU test's check
    (test_token_logprobs_gpu.py), whose ranks share one GPU over gloo and run no compiled case
    (``compiled=False``: ``tests._torchrun.compiled_collectives_run``)."""
    # equal / unequal shards, scalar / per-token temperature; masked vocabulary, large offset
    _passed(results, "logits", 6, impls)
    _passed(results, "hidden", 4, impls)
    groups = _groups_passed(results, impls, compiled)
    assert len(results) == 10 * len(impls) + groups, sorted(results)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_token_logprobs_matches_full_vocab_oracle(results):
    # equal / unequal shards, scalar / per-token temperature; masked vocabulary, large offset
    _passed(results, "logits", 6)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_linear_token_logprobs_matches_full_vocab_oracle(results):
    _passed(results, "hidden", 4)  # saved, split (SP; unequal), recompute (SP, unequal)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_groups_reused_with_other_ranges_and_wrong_shapes(results):
    # one group reused with vocabulary ranges that change (every rank runs the same
    # collectives; exact values each time); ranges that do not tile and unequal sequence shards
    # raise on every rank that has not verified its own before, NaN on the others
    _groups_passed(results, IMPLS)
