"""Autograd of the vocab-parallel cross entropy over logits (eager path; ``loss`` is the entry
that ``functional.cross_entropy`` calls).

Forward (per rank): one pass over the local shard gives per-row statistics; with tensor
parallelism one all-gather of those (4 x N floats) and a merge give the full-vocabulary loss and
lse on every rank. Saved for backward: the logits reference, the flat targets and the lse with
its low part (``formulas.lse_low``; 2 x N floats).
Backward: no communication; one pass recomputes the softmax from the saved lse and writes the
gradient, rounded once to the logits dtype, into a new tensor or over the logits.

A ``"mean"``/``"sum"`` loss on one shard takes a fused path instead (``_fused_forward``): the
forward kernel also writes the gradient, into a new tensor, for a unit upstream gradient, and
backward acts only when the upstream gradient is not 1. ``inplace_backward=True`` never takes
it: a gradient written over the logits in forward would be read by any later use of them.
"""

from __future__ import annotations

import atexit

from typing import NamedTuple, Optional

import torch

from ... import checks, communication, settings
from ...backends import logits_backend
from ...layout import RowView, like_rows, may_overlap, row_view
from ...runtime import compiling
from . import compiled
from ...autograd.first_order import refuse_double_backward
from . import contract
from .contract import LossOptions, loss_options
from .steps import backward_impl, forward_impl


class _Plan(NamedTuple):
    """What the argument checks of one call signature established, for every later call with it.

    A signature is the logits' shape, strides, dtype and device, the target's shape, dtype and
    device, and the options; a call that matches one skips the checks and the layout analysis
    (~2-3 us of host time), and its kernels repeat their remembered launches (``memo``).
    """

    group: object
    backend: object  # ``backends.LogitsBackend`` of the logits' device and dtype
    opts: LossOptions
    reduction: str
    inplace_backward: bool
    rows: Optional[tuple]  # (D1, s0, s1) when the logits are read in place, else None
    fused: bool  # a reduced loss whose gradient is formed in forward (``_fused_forward``)
    overlaps: bool  # elements of the logits may share memory: no gradient can be written over them
    memo: dict  # launches remembered by the kernels (kernels/launch.launch_memo)
    # VOCAB_PARALLEL_LOSS_CHECK_TARGETS, read here rather than per call: an environment
    # lookup costs ~1 us of host time (1.5 us on the CI machine), 3-5% of a forward's
    check_targets: bool


_plans: dict = {}
_MAX_PLANS = 512  # past it new signatures are checked on every call (never expected)
# The plans hold the process groups they were made for: let them go while the interpreter is
# whole, not in its teardown, where destroying a gloo group's worker threads aborts the process.
atexit.register(_plans.clear)


def _make_plan(logits, target, tp_group, label_smoothing, ignore_index, reduction, z_loss,
               inplace_backward) -> _Plan:
    """Check the arguments; returns the plan of their call signature."""
    contract.check(logits, target, label_smoothing, reduction, z_loss, ignore_index, tp_group)
    # equal vocabulary shards are checked on every forward, from the statistics' all-gather
    # (communication.check_shapes)
    opts = loss_options(tp_group, logits.shape[-1], int(ignore_index), float(label_smoothing),
                        float(z_loss))
    backend = logits_backend(logits)
    view = row_view(logits)
    rows = (view.D1, view.s0, view.s1) if view.tensor is logits else None
    # a layout read from a copy is written over the copy
    overlaps = bool(inplace_backward) and rows is not None and may_overlap(view)
    # every vocabulary size: measured faster than two passes up to 256K columns, where the rows
    # in flight outgrow the L2 (kernels/logits.py, fused_config). Not in place: the gradient
    # would be in the logits by the time the loss returns, where a use of the logits recorded
    # after the loss reads it, which no version counter can catch (its backward runs first)
    fused = (reduction != "none" and not inplace_backward
             and opts.vocab_size == logits.shape[-1]
             and backend.FORMS_REDUCED_GRADIENT
             and settings.flag(settings.FUSED_REDUCED, True))
    plan = _Plan(tp_group, backend, opts, reduction, bool(inplace_backward), rows, fused, overlaps, {},
                 settings.flag(settings.CHECK_TARGETS, False))
    return plan


def _fused_forward(ctx, view, t, plan):
    """A reduced loss on one shard, its gradient formed in the same kernel (4 B/element of HBM
    traffic instead of 6, see ``kernels.logits.forward_grad``) for an upstream gradient
    of 1; backward then only acts when the upstream gradient is not 1, decided on the device."""
    backend, opts, memo = plan.backend, plan.opts, plan.memo
    n, device = t.numel(), view.tensor.device
    mean = plan.reduction == "mean"
    count = backend.count(t, opts.ignore_index, memo) if mean else None
    dview = like_rows(view)
    buf = torch.empty((3, n), dtype=torch.float32, device=device)
    loss, lse = buf[0], buf[1:]  # the lse and its low part
    backend.forward_grad(view, dview, t, loss, lse, count, opts, memo)
    out, _ = backend.reduce(loss, t, opts.ignore_index, mean, memo, count, chained=True)
    ctx.save_for_backward(view.tensor, t, lse, count)
    ctx.rows = (view.D1, view.s0, view.s1)
    ctx.plan = plan
    # on ctx, not saved: the buffer is handed out as the gradient, and a caller who changes it
    # in place must not make a second backward (which never reads it) fail the version check
    ctx.grad = dview
    return out


def _fused_backward(ctx, dloss):
    logits, t, lse, count = ctx.saved_tensors
    plan = ctx.plan
    view = RowView(logits, *ctx.rows)
    dview = ctx.grad
    if dview is None:  # a second backward through a retained graph: the buffer is handed out
        return backward_impl(view, t, lse, dloss, count, plan.opts, False, plan.memo)
    ctx.grad = None
    # recompute the gradient from the logits when dloss != 1 (rounded once, as in two passes)
    plan.backend.backward(view, dview, t, lse, dloss, count, plan.opts, plan.memo,
                           unless_unit=True)
    return dview.tensor


def _loss_forward(ctx, logits, target, plan):
    """The forward of ``_VocabParallelCrossEntropy``; ``ctx`` is None when no gradient is needed."""
    one_dim = target.dim() == 1  # the flat targets and the loss need no reshaping
    t = target if one_dim else target.reshape(-1)
    view = row_view(logits) if plan.rows is None else RowView(logits, *plan.rows)
    opts = plan.opts
    if plan.fused and ctx is not None and t.numel() > 0:
        ctx.fused = True
        return _fused_forward(ctx, view, t, plan)
    loss, lse = forward_impl(view, t, plan.group, opts, plan.memo)
    out = count = None
    if plan.reduction != "none":
        out, count = plan.backend.reduce(loss, t, opts.ignore_index, plan.reduction == "mean",
                                         plan.memo)
    if ctx is not None:
        # view.tensor is the logits themselves except for layouts that needed a copy
        ctx.save_for_backward(view.tensor, t, lse, count)
        ctx.rows = (view.D1, view.s0, view.s1)
        ctx.plan = plan
        ctx.fused = False
    if out is None:
        if one_dim:
            return loss
        # view(*sizes): ~1 us less host time than view(torch.Size) (torch 2.x argument parsing)
        return loss.view(*target.shape) if target.dim() else loss.view(())
    return out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, plan):
        return _loss_forward(ctx, logits, target, plan)

    @staticmethod
    def backward(ctx, dloss):
        if torch.is_grad_enabled():  # create_graph=True
            refuse_double_backward("cross_entropy")
        if ctx.fused:
            return _fused_backward(ctx, dloss), None, None
        logits, t, lse, count = ctx.saved_tensors
        plan = ctx.plan
        grad = backward_impl(RowView(logits, *ctx.rows), t, lse, dloss, count, plan.opts,
                             plan.inplace_backward, plan.memo)
        return grad, None, None


try:
    # the C apply that Function.apply ends in: skips its Python prologue (argument binding for
    # setup_context, which this Function does not define, and functorch's unwrapping), ~1-2 us
    _apply_no_functorch = super(torch.autograd.Function, _VocabParallelCrossEntropy).apply
    _functorch_active = torch._C._are_functorch_transforms_active
except AttributeError:  # pragma: no cover - another torch: the public apply only
    _apply_no_functorch = _functorch_active = None


def _refuse_inplace(logits, plan) -> None:
    """Raise when ``inplace_backward=True`` cannot write the gradient over ``logits``."""
    if plan.overlaps:
        raise ValueError(
            "inplace_backward=True writes the gradient over the logits, but elements of these "
            f"logits share memory (an expanded or overlapping view: shape {tuple(logits.shape)}, "
            f"strides {logits.stride()}); use inplace_backward=False")
    base = logits._base
    if logits.is_leaf or (base is not None and base.is_leaf and base.requires_grad):
        raise ValueError(
            "inplace_backward=True would write the gradient over a leaf tensor that requires "
            "grad (a parameter, or a view of one); pass logits computed from it, or use "
            "inplace_backward=False")


def loss(logits, target, tp_group, label_smoothing, ignore_index, reduction, z_loss,
         inplace_backward, check_targets) -> torch.Tensor:
    """``functional.cross_entropy`` (see there), arguments checked once per call signature."""
    if ignore_index.__class__ is not int:  # a float would be truncated, -100.0 hash as -100
        ignore_index = checks.check_ignore_index(ignore_index)
    if target.dtype is not torch.int64:
        target = checks.widened_target(target, ignore_index)
    if compiling():
        # registered torch.library ops: traced by torch.compile, no graph break
        contract.check(logits, target, label_smoothing, reduction, z_loss, ignore_index,
                       tp_group)
        if check_targets is None:  # the switch is read when the call is traced
            check_targets = settings.flag(settings.CHECK_TARGETS, False)
        return compiled.cross_entropy_ops(logits, target, tp_group, int(ignore_index),
                                         float(label_smoothing), float(z_loss), reduction,
                                         bool(inplace_backward), bool(check_targets))
    try:
        key = (logits.shape, logits.stride(), logits.dtype, logits.device, target.shape,
               target.dtype, target.device, tp_group, label_smoothing, ignore_index, reduction,
               z_loss, inplace_backward)
        plan = _plans.get(key)
    except TypeError:  # an unhashable option: no plan is kept
        key = plan = None
    if plan is None:
        plan = _make_plan(logits, target, tp_group, label_smoothing, ignore_index, reduction,
                          z_loss, inplace_backward)
        if key is not None and len(_plans) < _MAX_PLANS:
            _plans[key] = plan
    if plan.check_targets if check_targets is None else check_targets:
        checks.check_target_range(target, plan.opts.vocab_size, plan.opts.ignore_index)
    if not (logits.requires_grad and torch.is_grad_enabled()):  # no graph to record: skip the
        # autograd Function's cost (and the fused path's gradient)
        return _loss_forward(None, logits, target, plan)
    if plan.inplace_backward:
        _refuse_inplace(logits, plan)
    if _apply_no_functorch is not None and not _functorch_active():
        return _apply_no_functorch(logits, target, plan)
    return _VocabParallelCrossEntropy.apply(logits, target, plan)


def log_sum_exp(logits, target, tp_group, ignore_index) -> torch.Tensor:
    """The full-vocabulary lse per token, shaped like ``target`` (0 where ignored), not
    differentiable: the loss's own forward step, one more read of the logits."""
    ignore_index = int(ignore_index)
    target = checks.widened_target(target, ignore_index)
    with torch.no_grad():
        _, lse = compiled.ce_forward(logits.detach(), target, communication.group_key(tp_group),
                                     ignore_index, 0.0, 0.0)
        lse = lse[0].view(target.shape)  # without its low part
        return torch.where(target.long() == ignore_index, torch.zeros_like(lse), lse)
