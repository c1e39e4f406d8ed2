"""The public loss functions: ``cross_entropy`` over vocabulary-sharded logits and
``linear_cross_entropy`` from hidden states and classifier rows."""

from __future__ import annotations

from typing import Optional

import torch

from . import backends, checks, communication, settings
from .autograd import linear as linear_autograd
from .autograd import logits as logits_autograd
from .backends import IMPLS


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
    returns the same fp32 loss (fp64 for float64 logits). ``reduction`` is ``"none"`` (shape of
    ``target``), ``"mean"`` (over non-ignored tokens; 0 when there are none) or ``"sum"``.
    ``z_loss`` adds ``z_loss * lse**2`` per token. A target outside the vocabulary that is not
    ``ignore_index`` gives a NaN loss for that token (``check_targets=True`` or the environment
    variable ``VOCAB_PARALLEL_LOSS_CHECK_TARGETS=1``, read when a call signature is first seen,
    raises instead, at the cost of a host sync).
    """
    return logits_autograd.loss(logits, target, tp_group, label_smoothing, ignore_index,
                                reduction, z_loss, inplace_backward, check_targets)


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    shift: int = 0,
    return_lse: bool = False,
    *,
    tp_group=None,
    sequence_parallel: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    impl: str = "auto",
):
    """Cross entropy of ``e @ c.T (+ bias)`` over the full (TP-sharded) vocabulary, fused.

    Parameters
    ----------
    e : ``(..., H)`` hidden states (float). With ``sequence_parallel=True`` this rank's shard of
        the first dim; it is all-gathered over ``tp_group`` (Megatron's output-layer layout).
    c : ``(V_local, H)`` this rank's classifier rows; rank ``r`` holds global classes
        ``[r * V_local, (r + 1) * V_local)``. Same dtype and device as ``e``.
    targets : integer tensor with ``e``'s (gathered) leading shape, global class ids.
    bias : optional ``(V_local,)``.
    ignore_index : tokens with this target get loss 0 and gradient 0.
    softcap : logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    reduction : ``"mean"`` (over non-ignored tokens; 0 when none), ``"sum"`` or ``"none"``.
    shift : drop the last ``shift`` positions of ``e`` along dim -2 and the first ``shift``
        targets (``shift=1``: causal LM with unshifted labels).
    return_lse : also return the per-token fp32 log-sum-exp (differentiable).
    tp_group : tensor-parallel process group (None: no parallelism).
    label_smoothing : PyTorch's convention, over the global vocabulary.
    z_loss : adds ``z_loss * lse**2`` per (non-ignored) token.
    impl : ``"triton"``, ``"torch"`` (chunked PyTorch) or ``"auto"`` (Triton on CUDA or under
        ``TRITON_INTERPRET=1``, else PyTorch).

    Returns
    -------
    The fp32 loss (fp64 for float64 inputs; scalar, or per token for ``reduction="none"``,
    shaped like the shifted targets), and with ``return_lse=True`` the tuple ``(loss, lse)``.
    Every rank returns the full-vocabulary values. A target outside ``[0, V)`` that is not
    ``ignore_index`` gives a NaN loss for that token (no out-of-bounds read). The gradient of
    ``c`` is this rank's slice; the gradient of ``e`` is the full gradient (summed over the group
    in fp32, rounded once). Deterministic: no atomics; every sum is taken in a fixed order.
    """
    _validate(e, c, targets, bias, ignore_index, softcap, reduction, shift, tp_group,
              sequence_parallel, label_smoothing, z_loss, impl)
    communication.check_equal_shards(c.shape[0], tp_group, c.device)
    targets = checks.widened_target(targets, int(ignore_index), "targets")
    if settings.flag(settings.CHECK_TARGETS, False):
        checks.check_target_range(targets, c.shape[0] * communication.world_size(tp_group),
                                  ignore_index)
    loss, lse = linear_autograd.linear_loss(
        e, c, bias, targets, backends.linear_backend(impl, e), ignore_index=int(ignore_index),
        softcap=float(softcap) if softcap else None, reduction=reduction, shift=int(shift),
        group=tp_group, sequence_parallel=bool(sequence_parallel),
        smoothing=float(label_smoothing), z_loss=float(z_loss))
    return (loss, lse) if return_lse else loss


def _validate(e, c, targets, bias, ignore_index, softcap, reduction, shift, group,
              sequence_parallel, label_smoothing, z_loss, impl):
    checks.check_float("e", e)
    checks.check_float("c", c)
    checks.check_target_dtype(targets, "targets")
    checks.check_ignore_index(ignore_index)
    checks.check_smoothing(label_smoothing)
    checks.check_reduction(reduction)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if e.dim() < 2:
        raise ValueError(f"e must be (..., H) with at least one leading dim, got shape {tuple(e.shape)}")
    if c.dim() != 2:
        raise ValueError(f"c must be (V_local, H), got shape {tuple(c.shape)}")
    if c.shape[0] < 1:
        raise ValueError("c must hold at least one vocabulary row")
    if e.shape[-1] != c.shape[1]:
        raise ValueError(f"e and c disagree on the hidden size H: e {tuple(e.shape)}, "
                         f"c {tuple(c.shape)}")
    if e.dtype != c.dtype:
        raise ValueError(f"e and c must have the same dtype, got {e.dtype} and {c.dtype}")
    if bias is not None:
        checks.check_float("bias", bias)
        if tuple(bias.shape) != (c.shape[0],):
            raise ValueError(f"bias must be (V_local,) = ({c.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != c.dtype:
            raise ValueError(f"bias dtype {bias.dtype} differs from c's {c.dtype}")
    checks.check_same_device(e=e, c=c, targets=targets, bias=bias)
    checks.check_z_loss(z_loss)
    checks.check_softcap(softcap)
    checks.check_shift(shift)
    lead = list(e.shape[:-1])
    if sequence_parallel:
        lead[0] *= communication.world_size(group)
    checks.check_leading_shape(
        "leading dims of e" + (" (gathered over the TP group)" if sequence_parallel else ""),
        torch.Size(lead), targets)
