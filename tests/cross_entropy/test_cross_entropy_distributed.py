"""Real multi-process tensor parallelism on CPU: torchrun with gloo, 2 and 3 ranks.

One launch per world size runs ``_distributed_worker.py``: every API on vocabulary shards
(module, in-place backward, TransformerEngine's and Megatron's drop-ins; both layouts,
reductions, label smoothing, z-loss), bf16, narrow targets and extreme logits, megatron-core's
own loss, torch.compile, against the fp64 full-vocabulary reference; and the unequal shards of
``_unequal_shards_worker.py`` (vocabulary columns, sequence-parallel rows: a ValueError on every
rank that sees them first, NaN, never a wrong loss, on a rank that verified its own shape before,
no abort inside the collective; eager and torch.compile, both backends, cross_entropy and
linear_cross_entropy). Each case's outcome comes back as JSON; each test reads its own.
"""

from pathlib import Path

import pytest

from tests._torchrun import check_passed, torchrun_results, triton_runs_here

WORKER = Path(__file__).with_name("_distributed_worker.py")
IMPLS = ["triton", "torch"] if triton_runs_here() else ["torch"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def results(request, tmp_path_factory):
    nproc = request.param
    out = tmp_path_factory.mktemp(f"tp{nproc}") / "results.json"
    return nproc, torchrun_results(WORKER, nproc, ",".join(IMPLS), "--unequal-shards",
                                   results=out, timeout=900)


def check_every_api(got: dict, impls) -> None:
    """The worker's own cases (not those of ``_unequal_shards_worker.py``) all passed; also the
    GPU test's check (tests/cross_entropy/test_cross_entropy_gpu.py)."""
    names = [n for n in got if not n.startswith("shapes/")]
    for name in names:
        check_passed(got, name)
    # 36 fp32 cases, bf16, megatron-core, the input domain and the masked and offset logits per
    # backend; compile; unequal widths
    assert len(names) == 40 * len(impls) + 2


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_every_api_matches_full_vocab_reference(results):
    _, got = results
    check_every_api(got, IMPLS)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_unequal_shards_raise_on_every_rank(results):
    _, got = results
    names = [n for n in got if n.startswith("shapes/")]
    for name in names:
        check_passed(got, name)
    assert len(names) == 9 + 11  # Triton: 9 cases; PyTorch: those and 2 under torch.compile
