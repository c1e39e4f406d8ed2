"""The loss as registered ``torch.library`` ops, the path taken under ``torch.compile``.

Eager code uses the ``autograd.Function`` in ``function.py`` (less dispatch overhead); while
``torch.compile`` traces, ``function.loss`` routes here instead, so the compiled graph holds two
opaque ops with fake (meta) implementations and no graph break. The reduction is done with plain
torch ops around the per-token op, so autograd hands the backward op a per-token gradient (an
expanded scalar for ``"mean"``/``"sum"``).
"""

from __future__ import annotations


import torch

from ... import checks, communication
from ...formulas import compute_dtype
from ...layout import row_view
from .contract import loss_options
from .steps import backward_impl, forward_impl

_NS = "vocab_parallel_loss"


@torch.library.custom_op(f"{_NS}::ce_forward", mutates_args=())
def ce_forward(logits: torch.Tensor, target: torch.Tensor, group: str, ignore_index: int,
               smoothing: float, z_loss: float,
               check_targets: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # the body runs at run time, on real tensors: the checks that read the device (the shard
    # widths, opt-in target range) happen here, as in eager
    g = communication.group_from_key(group)
    opts = loss_options(g, logits.shape[-1], ignore_index, smoothing, z_loss)
    if check_targets:
        checks.check_target_range(target, opts.vocab_size, ignore_index)
    return forward_impl(row_view(logits), target.reshape(-1), g, opts)


@ce_forward.register_fake
def _(logits, target, group, ignore_index, smoothing, z_loss, check_targets=False):
    n, dtype = target.numel(), compute_dtype(logits.dtype)
    # the lse with its low part (steps.forward_impl)
    return (logits.new_empty(n, dtype=dtype), logits.new_empty((2, n), dtype=dtype))


@torch.library.custom_op(f"{_NS}::ce_backward", mutates_args=())
def ce_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                dloss: torch.Tensor, group: str, ignore_index: int, smoothing: float,
                z_loss: float) -> torch.Tensor:
    opts = loss_options(communication.group_from_key(group), logits.shape[-1], ignore_index,
                        smoothing, z_loss)
    return backward_impl(row_view(logits), target.reshape(-1), lse, dloss, None, opts, False)


@ce_backward.register_fake
def _(logits, target, lse, dloss, group, ignore_index, smoothing, z_loss):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, target, group, ignore_index, smoothing, z_loss = inputs[:6]
    ctx.save_for_backward(logits, target, output[1])
    ctx.args = (group, ignore_index, smoothing, z_loss)


def _backward(ctx, dloss, dlse):
    logits, target, lse = ctx.saved_tensors
    return (ce_backward(logits, target, lse, dloss, *ctx.args), None, None, None, None, None,
            None)


torch.library.register_autograd(f"{_NS}::ce_forward", _backward, setup_context=_setup)


def cross_entropy_ops(logits, target, group, ignore_index, smoothing, z_loss, reduction,
                  inplace_backward, check_targets=False) -> torch.Tensor:
    """Same arguments and result as ``_VocabParallelCrossEntropy.apply``."""
    # inplace_backward is not honoured here: a compiled graph is functional, so the backward op
    # returns a new tensor (the compiler may still reuse the dead logits buffer)
    del inplace_backward
    loss, _ = ce_forward(logits, target, communication.group_key(group), ignore_index, smoothing,
                         z_loss, check_targets)
    if reduction == "none":
        return loss.view(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().clamp(min=1)
