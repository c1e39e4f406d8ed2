"""Autograd wiring and the functional API of the vocab-parallel cross entropy over logits.

Forward (per rank): one pass over the local shard gives per-row statistics; with tensor
parallelism one all-gather of those (4 x N floats) and a merge give the full-vocabulary loss and
lse on every rank. Saved for backward: the logits reference, the flat targets and the lse (O(N)).
Backward: no communication; one pass recomputes the softmax from the saved lse and writes the
gradient, rounded once to the logits dtype, into a new tensor or over the logits.

A ``"mean"``/``"sum"`` loss on one shard takes a fused path instead (``_fused_forward``): the
forward kernel also writes the gradient for a unit upstream gradient, and backward acts only
when the upstream gradient is not 1.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple, Optional

import torch

from . import _checks, distributed, reference
from ._layout import RowView, like_rows, row_view
from ._options import LossOptions
from ._runtime import compiling

try:  # Triton is optional at import time: the PyTorch path covers its absence
    from .kernels import cross_entropy as _triton_kernels
except Exception:  # pragma: no cover - depends on the platform
    _triton_kernels = None


def _backend(t: torch.Tensor):
    """Triton on CUDA (and on CPU under TRITON_INTERPRET=1), PyTorch otherwise."""
    if _triton_kernels is not None:
        if t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
            return _triton_kernels
    return reference


def loss_options(group, v_local, ignore_index, smoothing, z_loss) -> LossOptions:
    """The options of this rank's shard of a ``v_local``-column vocabulary slice."""
    if group is None:  # the common single-shard call: no process-group queries
        return LossOptions(0, v_local, ignore_index, smoothing, z_loss)
    world = distributed.world_size(group)
    rank = distributed.rank(group) if world > 1 else 0
    return LossOptions(rank * v_local, v_local * world, ignore_index, smoothing, z_loss)


def forward_impl(view, t, group, opts, memo=None):
    """Per-token fp32 loss and lse of flat targets ``t`` from the ``RowView`` of the logits."""
    logits = view.tensor
    n, device = t.numel(), logits.device
    loss = torch.empty(n, dtype=torch.float32, device=device)
    if opts.vocab_size == logits.shape[-1]:  # one shard holds the whole vocabulary
        lse = torch.empty(n, dtype=torch.float32, device=device)
        if n > 0:
            _backend(logits).forward(view, t, opts, None, loss, lse, memo)
        return loss, lse
    # the stats and the lse in one allocation: the lse is saved, the stats are gathered
    buf = torch.empty((5, n), dtype=torch.float32, device=device)
    stats, lse = buf[:4], buf[4]
    if n > 0:
        backend = _backend(logits)
        backend.forward(view, t, opts, stats, None, None, memo)
        gathered = distributed.gather_stats(stats, group)
        backend.merge(gathered, t, loss, lse, opts)
    return loss, lse


def backward_impl(view, t, lse, dloss, count, opts, inplace, memo=None):
    """The logits gradient: a new tensor, or written over ``view.tensor`` when ``inplace``."""
    if dloss.dim() > 1:
        dloss = dloss.reshape(-1)
    dview = view if inplace else like_rows(view)
    if t.numel() > 0:
        _backend(view.tensor).backward(view, dview, t, lse, dloss, count, opts, memo)
    if inplace:
        # the logits now hold their gradient: make any later use of them fail loudly
        torch.autograd.graph.increment_version(view.tensor)
    return dview.tensor


class _Plan(NamedTuple):
    """What the argument checks of one call signature established, for every later call with it.

    A signature is the logits' shape, strides, dtype and device, the target's shape, dtype and
    device, and the options; a call that matches one skips the checks and the layout analysis
    (~2-3 us of host time), and its kernels repeat their remembered launches (``memo``).
    """

    group: object
    opts: LossOptions
    reduction: str
    inplace_backward: bool
    rows: Optional[tuple]  # (D1, s0, s1) when the logits are read in place, else None
    fused: bool  # a reduced loss whose gradient is formed in forward (``_fused_forward``)
    memo: dict  # launches remembered by the kernels (kernels/_launch.launch_memo)
    # VOCAB_PARALLEL_LOSS_CHECK_TARGETS, read here rather than per call: an environment
    # lookup costs ~1 us of host time (1.5 us on the CI machine), 3-5% of a forward's
    check_targets: bool


_plans: dict = {}
_MAX_PLANS = 512  # past it new signatures are checked on every call (never expected)


def _check_args(logits, target, label_smoothing, reduction, z_loss):
    _checks.check_float("logits", logits)
    _checks.check_target_dtype(target)
    _checks.check_smoothing(label_smoothing)
    _checks.check_reduction(reduction)
    shape = logits.shape
    if not shape or shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty vocabulary dim, got shape {tuple(shape)}")
    if target.shape != shape[:-1]:
        _checks.check_leading_shape("leading dims of logits", shape[:-1], target)
    if target.device != logits.device:
        _checks.check_same_device(logits=logits, target=target)
    if float(z_loss) < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")


def _make_plan(logits, target, tp_group, label_smoothing, ignore_index, reduction, z_loss,
               inplace_backward) -> tuple:
    """Check the arguments; returns ``(plan, reusable)``."""
    _check_args(logits, target, label_smoothing, reduction, z_loss)
    verified = True
    if tp_group is not None:  # no group: one shard, nothing to check
        verified = distributed.check_equal_shards(logits.shape[-1], tp_group, logits.device)
    opts = loss_options(tp_group, logits.shape[-1], int(ignore_index), float(label_smoothing),
                        float(z_loss))
    view = row_view(logits)
    rows = (view.D1, view.s0, view.s1) if view.tensor is logits else None
    # every vocabulary size: measured faster than two passes up to 256K columns, where the rows
    # in flight outgrow the L2 (kernels/cross_entropy.py, fused_config)
    fused = (reduction != "none" and opts.vocab_size == logits.shape[-1]
             and _backend(logits) is _triton_kernels
             and os.environ.get(FUSED_ENV, "1") != "0")
    plan = _Plan(tp_group, opts, reduction, bool(inplace_backward), rows, fused, {},
                 _checks.targets_check_requested(None))
    return plan, verified


#: ``VPL_FUSED_REDUCED=0`` turns the fused path of reduced losses off (two passes instead)
FUSED_ENV = "VPL_FUSED_REDUCED"


def _fused_forward(ctx, view, t, plan):
    """A reduced loss on one shard, its gradient formed in the same kernel (4 B/element of HBM
    traffic instead of 6, see ``kernels.cross_entropy.forward_grad``) for an upstream gradient
    of 1; backward then only acts when the upstream gradient is not 1, decided on the device."""
    backend, opts, memo = _triton_kernels, plan.opts, plan.memo
    n, device = t.numel(), view.tensor.device
    mean = plan.reduction == "mean"
    count = backend.count(t, opts.ignore_index, memo) if mean else None
    dview = view if plan.inplace_backward else like_rows(view)
    buf = torch.empty((2, n), dtype=torch.float32, device=device)
    loss, lse = buf[0], buf[1]
    backend.forward_grad(view, dview, t, loss, lse, count, opts, memo)
    out, _ = backend.reduce(loss, t, opts.ignore_index, mean, memo, count, chained=True)
    if plan.inplace_backward:
        # the logits now hold the gradient: make any later use of them fail loudly
        torch.autograd.graph.increment_version(view.tensor)
    ctx.save_for_backward(view.tensor, t, lse, count, dview.tensor)
    ctx.rows = (view.D1, view.s0, view.s1)
    ctx.grad_rows = (dview.D1, dview.s0, dview.s1)
    ctx.plan = plan
    ctx.grad_taken = False
    return out


def _fused_backward(ctx, dloss):
    logits, t, lse, count, grad = ctx.saved_tensors
    plan = ctx.plan
    if ctx.grad_taken:  # a second backward through a retained graph: the buffer is handed out
        if plan.inplace_backward:
            raise RuntimeError("a loss with inplace_backward=True was differentiated twice "
                               "(retain_graph): its logits hold the first gradient; use "
                               "inplace_backward=False to backward more than once")
        return backward_impl(RowView(logits, *ctx.rows), t, lse, dloss, count, plan.opts,
                             False, plan.memo)
    ctx.grad_taken = True
    dview = RowView(grad, *ctx.grad_rows)
    if plan.inplace_backward:  # the logits are gone: scale the gradient when dloss != 1
        _triton_kernels.scale_grad(dview, t, dloss, plan.opts.ignore_index, plan.memo)
    else:  # recompute it from the logits when dloss != 1 (rounded once, as in two passes)
        _triton_kernels.backward(RowView(logits, *ctx.rows), dview, t, lse, dloss, count,
                                 plan.opts, plan.memo, unless_unit=True)
    return grad


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
        out, count = _backend(logits).reduce(loss, t, opts.ignore_index, plan.reduction == "mean",
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


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "none",
    z_loss: float = 0.0,
    inplace_backward: bool = False,
    check_targets: Optional[bool] = None,
) -> torch.Tensor:
    """Full-vocabulary cross entropy from this rank's vocabulary shard ``logits[..., V_local]``.

    Rank ``r`` of ``tp_group`` holds columns ``[r * V_local, (r + 1) * V_local)``; every rank
    returns the same fp32 loss. ``reduction`` is ``"none"`` (shape of ``target``), ``"mean"``
    (over non-ignored tokens; 0 when there are none) or ``"sum"``. ``z_loss`` adds
    ``z_loss * lse**2`` per token. A target outside the vocabulary that is not ``ignore_index``
    gives a NaN loss for that token (``check_targets=True`` or the environment variable
    ``VOCAB_PARALLEL_LOSS_CHECK_TARGETS=1``, read when a call signature is first seen, raises
    instead, at the cost of a host sync).
    """
    if compiling():
        from . import ops  # registered torch.library ops: traced by torch.compile, no graph break

        _check_args(logits, target, label_smoothing, reduction, z_loss)
        if tp_group is not None:
            distributed.check_equal_shards(logits.shape[-1], tp_group, logits.device)
        return ops.cross_entropy(logits, target, tp_group, int(ignore_index),
                                 float(label_smoothing), float(z_loss), reduction,
                                 bool(inplace_backward))
    try:
        key = (logits.shape, logits.stride(), logits.dtype, logits.device, target.shape,
               target.dtype, target.device, tp_group, label_smoothing, ignore_index, reduction,
               z_loss, inplace_backward)
        plan = _plans.get(key)
    except TypeError:  # an unhashable option: no plan is kept
        key = plan = None
    if plan is None:
        plan, reusable = _make_plan(logits, target, tp_group, label_smoothing, ignore_index,
                                    reduction, z_loss, inplace_backward)
        if key is not None and reusable and len(_plans) < _MAX_PLANS:
            _plans[key] = plan
    if plan.check_targets if check_targets is None else check_targets:
        _checks.check_target_range(target, plan.opts.vocab_size, plan.opts.ignore_index)
    if not (logits.requires_grad and torch.is_grad_enabled()):  # no graph to record: skip the
        # autograd Function's cost (and the fused path's gradient)
        return _loss_forward(None, logits, target, plan)
    if _apply_no_functorch is not None and not _functorch_active():
        return _apply_no_functorch(logits, target, plan)
    return _VocabParallelCrossEntropy.apply(logits, target, plan)


def parallel_cross_entropy(
    inp: Optional[torch.Tensor] = None,
    target: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group=None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    *,
    _input: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for TransformerEngine's ``parallel_cross_entropy``.

    ``inp`` is ``(B, SQ, V_local)`` or ``(SQ, B, V_local)`` (any strides), ``target`` has the same
    two leading dims. Returns the fp32 per-token loss shaped like ``target``, or with
    ``reduce_loss=True`` its mean over non-ignored tokens. ``is_cg_capturable`` is accepted for
    compatibility: this implementation never synchronises with the host, so it is always
    capturable. ``_input`` is the deprecated name of ``inp``.
    """
    del is_cg_capturable  # always capturable
    if _input is not None:
        warnings.warn("`_input` is deprecated; pass the logits as `inp`", FutureWarning,
                      stacklevel=2)
        if inp is not None:
            raise ValueError("pass the logits as `inp` or as the deprecated `_input`, not both")
        inp = _input
    if inp is None or target is None:
        raise ValueError("parallel_cross_entropy needs `inp` and `target`")
    return cross_entropy(inp, target, tp_group=dist_process_group,
                         label_smoothing=label_smoothing, ignore_index=ignore_idx,
                         reduction="mean" if reduce_loss else "none")


def _megatron_tp_group():
    """Megatron's tensor-parallel group when megatron-core is initialised, else None."""
    try:
        from megatron.core import parallel_state
    except Exception:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group=None) -> torch.Tensor:
    """Drop-in for ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``.

    Per-token fp32 loss with the target's shape. ``tp_group=None`` uses megatron-core's tensor
    model parallel group when it is initialised (as Megatron does), else no parallelism.
    Differences from megatron-core: label smoothing is exact (PyTorch's convention over the
    global vocabulary; Megatron uses the local vocabulary size), targets equal to -100 are
    ignored (loss 0), and the caller's logits are never modified.
    """
    group = tp_group if tp_group is not None else _megatron_tp_group()
    return cross_entropy(vocab_parallel_logits, target, tp_group=group,
                         label_smoothing=label_smoothing)
