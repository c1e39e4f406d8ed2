"""Autograd semantics of the loss over logits, both backends: what ``inplace_backward=True``
may overwrite and what a later use of the logits sees, double backward, a gradient changed by
the caller, and copies of the module."""

from __future__ import annotations

import copy

import pytest
import torch

from tests._oracle import full_vocab_loss, full_vocab_loss_and_grad
from tests._process_group import single_rank_group
from tests.cross_entropy.test_cross_entropy import make_logits, make_target
from vocab_parallel_loss import VocabParallelCrossEntropy, cross_entropy
from vocab_parallel_loss.layout import RowView, may_overlap, row_view

REDUCTIONS = ["none", "mean", "sum"]  # "mean"/"sum" on one shard: Triton's fused path


def _inputs(reduction, seed=0):
    base = make_logits((4, 3, 37), torch.float32, "sbv_transposed", seed=seed)
    target = make_target((4, 3), 37, seed=seed + 1)
    src = base.clone().requires_grad_()
    return base, target, src


def _ce_grad(base, target, reduction):
    return full_vocab_loss_and_grad(base, target, reduction=reduction)[1]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_logits_keep_their_values_until_the_backward(impl, reduction):
    # a use recorded after the loss (an auxiliary term) reads the logits, not the gradient; in
    # the same graph its backward runs before the loss's, so the result is right
    base, target, src = _inputs(reduction)
    y = src * 1  # as out of an output layer: a non-leaf
    loss = cross_entropy(y, target, reduction=reduction, inplace_backward=True).sum()
    assert torch.equal(y.detach(), base)
    aux = (y ** 2).sum()
    torch.testing.assert_close(aux.double(), (base.double() ** 2).sum())
    (loss + aux).backward()
    want = _ce_grad(base, target, reduction) + 2 * base.double()
    torch.testing.assert_close(src.grad.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("recorded", ["before", "after"])
def test_inplace_logits_used_after_the_backward_raise(impl, reduction, recorded):
    # the backward writes the gradient over the logits: a use recorded before or after the loss
    # whose backward runs later fails the version check instead of reading the gradient
    base, target, src = _inputs(reduction)
    y = src * 1
    aux = (y ** 2).sum() if recorded == "before" else None
    loss = cross_entropy(y, target, reduction=reduction, inplace_backward=True).sum()
    if aux is None:
        aux = (y ** 2).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        aux.backward()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_logits_used_before_in_the_same_graph_raise(impl, reduction):
    base, target, src = _inputs(reduction)
    y = src * 1
    aux = (y ** 2).sum()  # its backward runs after the loss's, which overwrote y
    loss = cross_entropy(y, target, reduction=reduction, inplace_backward=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + aux).backward()


def test_may_overlap():
    def view(d0, d1, v, s0, s1):
        return RowView(torch.empty(d0 * d1 * v), d1, s0, s1)._replace(
            tensor=torch.empty(d0, d1, v))

    assert not may_overlap(row_view(make_logits((4, 3, 37), torch.float32, "sbv_transposed")))
    assert not may_overlap(row_view(make_logits((4, 3, 37), torch.float32, "narrowed")))
    assert not may_overlap(view(2, 2, 4, 4, 8))  # interleaved levels, disjoint
    assert may_overlap(view(3, 5, 31, 0, 31))  # expanded along dim 0
    assert may_overlap(view(1, 5, 31, 0, 20))  # rows 20 apart, 31 long
    assert not may_overlap(view(1, 1, 31, 0, 0))


@pytest.mark.parametrize("how", ["expanded", "overlapping rows"])
def test_inplace_backward_on_overlapping_logits_is_an_error(impl, how):
    src = torch.randn(1, 5, 31, requires_grad=True)
    if how == "expanded":  # stride 0 along dim 0
        x = (src * 1).expand(3, 5, 31)
    else:  # 5 rows of 31 elements, 20 apart
        x = (torch.randn(5 * 20 + 11, requires_grad=True) * 1).as_strided((5, 31), (20, 1))
    target = make_target(x.shape[:-1], 31)
    for reduction in REDUCTIONS:
        with pytest.raises(ValueError, match="inplace_backward"):
            cross_entropy(x, target, reduction=reduction, inplace_backward=True)
        with torch.no_grad():  # no backward, nothing is written: allowed
            cross_entropy(x, target, reduction=reduction, inplace_backward=True)
        # into a new tensor the overlapping logits are read in place and the gradient is right
        loss = cross_entropy(x, target, reduction=reduction)
        (grad,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
        torch.testing.assert_close(grad.double(), _ce_grad(x.detach(), target, reduction),
                                   atol=1e-6, rtol=1e-5)


def test_inplace_backward_on_expanded_vocabulary_is_read_from_a_copy(impl):
    # a stride-0 vocabulary dim is read from a copy: in place then writes the copy
    src = torch.randn(4, 3, 1, requires_grad=True)
    x = (src * 1).expand(4, 3, 23)
    target = make_target((4, 3), 23)
    loss = cross_entropy(x, target, reduction="mean", inplace_backward=True)
    (grad,) = torch.autograd.grad(loss, src)
    want = _ce_grad(x.detach(), target, "mean").sum(-1, keepdim=True)
    torch.testing.assert_close(grad.double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_backward_on_a_leaf_is_an_error(impl, reduction):
    param = torch.randn(4, 3, 37, requires_grad=True)
    kept = param.detach().clone()
    target = make_target((4, 3), 37)
    for x, t in ((param, target), (param[:, :2], target[:, :2]),  # the leaf and views of it
                 (param.transpose(0, 1), target.T)):
        with pytest.raises(ValueError, match="inplace_backward"):
            cross_entropy(x, t, reduction=reduction, inplace_backward=True)
    assert torch.equal(param.detach(), kept)
    with torch.no_grad():  # no backward, nothing is overwritten: allowed
        loss = cross_entropy(param, target, reduction=reduction, inplace_backward=True)
    torch.testing.assert_close(loss.double(), full_vocab_loss(kept, target, reduction=reduction),
                               atol=1e-5, rtol=1e-6)
    assert torch.equal(param.detach(), kept)


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("inplace", [False, True])
def test_double_backward_is_a_clear_error(impl, reduction, inplace):
    h = torch.randn(4, 3, 8, requires_grad=True)
    w = torch.randn(37, 8, requires_grad=True)
    target = make_target((4, 3), 37)
    loss = cross_entropy(h @ w.T, target, reduction=reduction, inplace_backward=inplace)
    up = torch.ones_like(loss)
    # a gradient penalty on h: its gradient depends on the loss's second derivative
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(loss, h, up, create_graph=True)
    # first-order use of the same graph is unaffected
    (gh,) = torch.autograd.grad(loss, h, up)
    x = (h @ w.T).detach().double().requires_grad_()
    ref = full_vocab_loss(x, target, reduction=reduction)
    (gx,) = torch.autograd.grad(ref, x, torch.ones_like(ref))
    torch.testing.assert_close(gh.double(), gx @ w.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gradient_changed_in_place_then_a_second_backward(impl, reduction):
    base, target, src = _inputs(reduction)
    loss = cross_entropy(src, target, reduction=reduction).sum()
    want = _ce_grad(base, target, reduction)
    (grad,) = torch.autograd.grad(loss, src, retain_graph=True)
    grad.mul_(3.0)  # the caller's tensor: a second backward must not depend on it
    (again,) = torch.autograd.grad(loss, src, retain_graph=True)
    torch.testing.assert_close(again.double(), want, atol=1e-6, rtol=1e-5)
    loss.backward(retain_graph=True)
    src.grad.zero_()  # as an optimizer's zero_grad(set_to_none=False) does
    loss.backward()
    torch.testing.assert_close(src.grad.double(), want, atol=1e-6, rtol=1e-5)


def test_module_deepcopy_shares_the_process_group(impl, tmp_path):
    logits = make_logits((4, 3, 37), torch.float32, "contiguous").requires_grad_()
    target = make_target((4, 3), 37)
    with single_rank_group(tmp_path) as group:
        module = VocabParallelCrossEntropy(group, reduction="mean", label_smoothing=0.1)
        clone = copy.deepcopy(module)
        assert clone is not module and clone.tp_group is group
        assert repr(clone) == repr(module)
        torch.testing.assert_close(clone(logits, target), module(logits, target), atol=0, rtol=0)
    assert copy.deepcopy(VocabParallelCrossEntropy()).tp_group is None
