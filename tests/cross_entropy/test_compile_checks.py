"""Checks that read the device run at run time under torch.compile, inside registered ops: the
opt-in target check (``check_targets=True``, VOCAB_PARALLEL_LOSS_CHECK_TARGETS) for both losses,
with no graph break; the ops pass opcheck and do what the eager checks do."""

from __future__ import annotations

import pytest
import torch

from vocab_parallel_loss import cross_entropy, linear_cross_entropy
from vocab_parallel_loss.settings import CHECK_TARGETS

BAD = torch.tensor([[0, 1, 9], [2, -100, 4]])  # 9 is outside a 7-class vocabulary


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_cross_entropy_check_targets_compiled(monkeypatch, how):
    monkeypatch.setenv(CHECK_TARGETS, "1" if how == "environment" else "0")
    kw = dict(check_targets=True) if how == "argument" else {}
    torch._dynamo.reset()
    f = torch.compile(lambda x, t: cross_entropy(x, t, reduction="mean", **kw), fullgraph=True,
                      backend="aot_eager")
    x = torch.randn(2, 3, 7)
    with pytest.raises(ValueError, match="target value 9 is outside the vocabulary"):
        f(x, BAD)
    good = BAD.clamp(max=6)
    torch.testing.assert_close(f(x, good), torch.nn.functional.cross_entropy(
        x.reshape(-1, 7).double(), good.reshape(-1)).float())


def test_linear_cross_entropy_check_targets_compiled(monkeypatch):
    monkeypatch.setenv(CHECK_TARGETS, "1")
    torch._dynamo.reset()
    f = torch.compile(lambda e, c, t: linear_cross_entropy(e, c, t, impl="torch"),
                      fullgraph=True, backend="aot_eager")
    e, c = torch.randn(2, 3, 5), torch.randn(7, 5)
    with pytest.raises(ValueError, match="target value 9 is outside the vocabulary"):
        f(e, c, BAD)
    good = BAD.clamp(max=6)
    ref = torch.nn.functional.cross_entropy((e.double() @ c.double().t()).reshape(-1, 7),
                                            good.reshape(-1))
    torch.testing.assert_close(f(e, c, good).double(), ref)


def test_check_ops_pass_opcheck():
    from vocab_parallel_loss.ops.fused_linear import compiled_checks as ops

    torch.library.opcheck(ops.checked_targets, (BAD.clamp(max=6), 7, -100))
    with pytest.raises(ValueError, match="target value 9"):
        ops.checked_targets(BAD, 7, -100)


def test_shapes_op_passes_opcheck_and_reads_new_shapes_only():
    from vocab_parallel_loss import communication
    from vocab_parallel_loss.ops.fused_linear import compiled_checks as ops

    gathered = torch.zeros(2, communication.stats_size(4, 3))
    gathered[:, 12] = 7  # both ranks: 7 vocabulary columns
    torch.library.opcheck(ops.shapes_agree, (gathered, 4, 3, [7], ""))
    assert bool(ops.shapes_agree(gathered, 4, 3, [7], ""))
    gathered[1, 12] = 8
    # 7 was verified: no host read, the device answer only; 8 is new: read, raise
    assert not bool(ops.shapes_agree(gathered, 4, 3, [7], ""))
    with pytest.raises(ValueError, match=r"vocab shards differ .* sizes per rank \[7, 8\]"):
        ops.shapes_agree(gathered, 4, 3, [8], "")
