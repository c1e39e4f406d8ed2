"""``tp_group`` must be None or a ``torch.distributed.ProcessGroup`` on every entry point: any other
value is a ``TypeError`` naming the argument (without a process group it would otherwise pass for
one rank without parallelism and return a loss)."""

import pytest
import torch

from vocab_parallel_loss import (VocabParallelCrossEntropy, VocabParallelLinearCrossEntropy,
                                 cross_entropy, linear_cross_entropy, linear_token_logprobs,
                                 parallel_cross_entropy, token_logprobs,
                                 vocab_parallel_cross_entropy)
from vocab_parallel_loss.verl import linear_cross_entropy as verl_linear_cross_entropy

NOT_GROUPS = ["foo", 2, [0, 1], object()]


def _inputs():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 5, 13, generator=g, requires_grad=True)
    target = torch.randint(0, 13, (3, 5), generator=g)
    e = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    c = torch.randn(13, 8, generator=g, requires_grad=True)
    return logits, target, e, c


def _ops():
    """(name, call, argument name) of every entry point that takes a group."""
    return [
        ("cross_entropy", lambda x, t, e, c, grp: cross_entropy(x, t, tp_group=grp), "tp_group"),
        ("cross_entropy mean", lambda x, t, e, c, grp: cross_entropy(
            x, t, tp_group=grp, reduction="mean"), "tp_group"),
        ("cross_entropy lse", lambda x, t, e, c, grp: cross_entropy(
            x, t, tp_group=grp, return_lse=True), "tp_group"),
        ("linear_cross_entropy", lambda x, t, e, c, grp: linear_cross_entropy(
            e, c, t, tp_group=grp), "tp_group"),
        ("linear_cross_entropy sp", lambda x, t, e, c, grp: linear_cross_entropy(
            e, c, t, tp_group=grp, sequence_parallel=True), "tp_group"),
        ("token_logprobs", lambda x, t, e, c, grp: token_logprobs(x, t, tp_group=grp),
         "tp_group"),
        ("token_logprobs vocab_range", lambda x, t, e, c, grp: token_logprobs(
            x, t % 11, tp_group=grp, vocab_range=(0, 11)), "tp_group"),
        ("linear_token_logprobs", lambda x, t, e, c, grp: linear_token_logprobs(
            e, c, t, tp_group=grp), "tp_group"),
        ("linear_token_logprobs sp", lambda x, t, e, c, grp: linear_token_logprobs(
            e, c, t, tp_group=grp, sequence_parallel=True), "tp_group"),
        ("VocabParallelCrossEntropy", lambda x, t, e, c, grp: VocabParallelCrossEntropy(grp)(
            x, t), "tp_group"),
        ("VocabParallelLinearCrossEntropy", lambda x, t, e, c, grp:
         VocabParallelLinearCrossEntropy(tp_group=grp)(e, c, t), "tp_group"),
        ("parallel_cross_entropy", lambda x, t, e, c, grp: parallel_cross_entropy(
            x, t, dist_process_group=grp), "dist_process_group"),
        ("parallel_cross_entropy overwrite", lambda x, t, e, c, grp: parallel_cross_entropy(
            x.clone(), t, dist_process_group=grp, overwrite_input=True), "dist_process_group"),
        ("vocab_parallel_cross_entropy", lambda x, t, e, c, grp: vocab_parallel_cross_entropy(
            x, t, tp_group=grp), "tp_group"),
        ("verl linear_cross_entropy", lambda x, t, e, c, grp: verl_linear_cross_entropy(
            e, c, t, dist_process_group=grp), "dist_process_group"),
    ]


@pytest.mark.parametrize("op", _ops(), ids=lambda op: op[0])
@pytest.mark.parametrize("group", NOT_GROUPS, ids=lambda g: type(g).__name__)
def test_a_non_group_is_a_type_error_naming_the_argument(impl, op, group):
    assert not torch.distributed.is_initialized()
    _, call, name = op
    with pytest.raises(TypeError, match=f"^{name} must be None or a torch.distributed"):
        call(*_inputs(), group)


@pytest.mark.parametrize("op", _ops(), ids=lambda op: op[0])
def test_none_is_no_parallelism(impl, op):
    # the check lets None through: the same call without a group returns finite values
    _, call, _ = op
    out = call(*_inputs(), None)
    first = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(first).all()


def test_modules_refuse_a_non_group_when_built():
    with pytest.raises(TypeError, match="^tp_group must be"):
        VocabParallelCrossEntropy("foo")
    with pytest.raises(TypeError, match="^tp_group must be"):
        VocabParallelLinearCrossEntropy(tp_group="foo")
