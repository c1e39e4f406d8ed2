"""The contract of ``linear_cross_entropy``: what its arguments may be, and the one options type
its autograd Function and backends take.

``functional.linear_cross_entropy``, the module ``VocabParallelLinearCrossEntropy`` and the
integrations (Megatron, Hugging Face, verl) all check their options here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ... import checks, communication


@dataclasses.dataclass(frozen=True)
class LinearLossOptions:
    """Everything one call of the fused linear loss decided before its Function runs."""

    ignore_index: int
    softcap: Optional[float]
    reduction: str
    group: object
    sequence_parallel: bool  # True only with a group of more than one rank
    smoothing: float
    z_loss: float
    backend: object  # a ``backends.LinearBackend``
    strategy: str = "recompute"  # "saved", "grad_in_forward" or "recompute" (``fused_linear.strategy``)
    chunk_bytes: Optional[int] = None  # the recompute path's dlogits chunk, when the budget caps it
    saved_cols: Optional[int] = None  # "saved": the leading local columns saved (None: all)
    gif_rows: Optional[int] = None  # "grad_in_forward": rows per chunk (None: the config's)
    room: Optional[int] = None  # the forward's room beside what it holds (``Strategy.room``)
    main_grad: bool = False  # dC is added into ``c.main_grad``, not returned (``autograd.main_grad``)
    masked: bool = False  # "grad_in_forward" for a per-token loss, formed for its loss mask
    # (``masked.py``)
    fp32_precision: str = "fp32"  # the products of fp32 operands (``checks.FP32_PRECISIONS``)
    invariant: bool = False  # batch-invariant statistics and merges (``batch_invariant``)


def check_options(ignore_index, softcap, reduction, shift, label_smoothing, z_loss, impl,
                  memory_budget, gradient_accumulation_fusion, tp_group=None,
                  fp32_precision="fp32", batch_invariant=False) -> int:
    """The tensor-free options; returns ``ignore_index`` as an int."""
    checks.check_group(tp_group)
    checks.check_fp32_precision(fp32_precision)
    checks.check_bool("batch_invariant", batch_invariant)
    checks.check_reduction(reduction)
    checks.check_smoothing(label_smoothing)
    checks.check_z_loss(z_loss)
    checks.check_softcap(softcap)
    checks.check_shift(shift)
    checks.check_impl(impl)
    checks.check_memory_budget(memory_budget)
    if not isinstance(gradient_accumulation_fusion, bool):
        raise TypeError(f"gradient_accumulation_fusion must be a bool, got "
                        f"{gradient_accumulation_fusion!r}")
    return checks.check_ignore_index(ignore_index)


def check_loss_mask(loss_mask, targets, reduction) -> None:
    """``loss_mask``: None, or a real tensor of ``targets``' shape and device that does not
    require grad, with ``reduction="none"``."""
    if loss_mask is None:
        return
    if not isinstance(loss_mask, torch.Tensor):
        raise TypeError(f"loss_mask must be a tensor or None, got {type(loss_mask).__name__}")
    if reduction != "none":
        raise ValueError(f"loss_mask is the weights a per-token loss is multiplied by: it needs "
                         f"reduction='none', got reduction={reduction!r}")
    if loss_mask.is_complex():
        raise TypeError(f"loss_mask must be real (float, integer or bool), got {loss_mask.dtype}")
    if loss_mask.requires_grad:
        raise ValueError("loss_mask is not differentiated: pass loss_mask.detach()")
    if tuple(loss_mask.shape) != tuple(targets.shape):
        raise ValueError(f"loss_mask must have the shape of targets {tuple(targets.shape)}, got "
                         f"{tuple(loss_mask.shape)}")
    if loss_mask.device != targets.device:
        raise ValueError(f"loss_mask is on {loss_mask.device}, targets on {targets.device}")


def check(e, c, targets, bias, ignore_index, softcap, reduction, shift, group,
          sequence_parallel, label_smoothing, z_loss, impl, memory_budget,
          gradient_accumulation_fusion, loss_mask=None, fp32_precision="fp32",
          batch_invariant=False) -> None:
    """Every argument of one call: raises ``TypeError``/``ValueError`` naming the argument."""
    checks.check_float("e", e)
    checks.check_float("c", c)
    checks.check_target_dtype(targets, "targets")
    check_options(ignore_index, softcap, reduction, shift, label_smoothing, z_loss, impl,
                  memory_budget, gradient_accumulation_fusion, group, fp32_precision,
                  batch_invariant)
    if e.dim() < 2:
        raise ValueError(f"e must be (..., H) with at least one leading dim, got shape {tuple(e.shape)}")
    if c.dim() != 2:
        raise ValueError(f"c must be (V_local, H), got shape {tuple(c.shape)}")
    if c.shape[0] < 1:
        raise ValueError("c must hold at least one vocabulary row")
    if e.shape[-1] != c.shape[1]:
        raise ValueError(f"e and c disagree on the hidden size H: e {tuple(e.shape)}, "
                         f"c {tuple(c.shape)}")
    if bias is not None:
        checks.check_float("bias", bias)
        if tuple(bias.shape) != (c.shape[0],):
            raise ValueError(f"bias must be (V_local,) = ({c.shape[0]},), got {tuple(bias.shape)}")
    checks.check_linear_dtypes(e, c, bias)
    checks.check_same_device(e=e, c=c, targets=targets, bias=bias)
    checks.check_main_grad(c, gradient_accumulation_fusion)
    lead = list(e.shape[:-1])
    world = communication.world_size(group)
    if sequence_parallel and world > 1:
        # only what the targets decide (the same on every rank) is checked here: each rank's
        # rows of e are compared with targets.shape[0] // world across the group, so that every
        # rank raises, not only some while the others wait in the gather (check_shapes)
        if targets.shape[0:1] and targets.shape[0] % world:
            raise ValueError(f"sequence_parallel=True: dim 0 of targets {tuple(targets.shape)} "
                             f"is not divisible by the tensor-parallel group size {world}")
        lead[0] = targets.shape[0] if targets.shape[0:1] else lead[0] * world
    checks.check_leading_shape(
        "leading dims of e" + (" (gathered over the TP group)" if sequence_parallel else ""),
        torch.Size(lead), targets)
    check_loss_mask(loss_mask, targets, reduction)
