"""``nn.Module`` front ends of the losses."""

from __future__ import annotations

import copy

import torch
from torch import nn

from typing import Optional

from . import communication
from .functional import cross_entropy, linear_cross_entropy
from .ops.cross_entropy import contract as ce_contract
from .ops.linear_cross_entropy import contract as lce_contract


class _SharesGroup:
    """``copy.deepcopy`` of a loss module: the copy runs on the same process group (a
    ``ProcessGroup`` cannot be copied, and a copy of one would not be a group of its ranks)."""

    def __deepcopy__(self, memo):
        memo[id(self.tp_group)] = self.tp_group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new


class VocabParallelCrossEntropy(_SharesGroup, nn.Module):
    """Cross entropy over vocabulary-sharded logits; every rank gets the full-vocabulary loss.

    ``forward(logits, target)``: ``logits`` is ``(..., V_local)`` (any strides: Megatron's
    ``[s, b, v/tp]`` included), ``target`` is ``(...)`` of integer class ids. See
    :func:`vocab_parallel_loss.cross_entropy` for the semantics.
    """

    def __init__(self, tp_group=None, *, label_smoothing: float = 0.0, ignore_index: int = -100,
                 reduction: str = "none", z_loss: float = 0.0, inplace_backward: bool = False):
        super().__init__()
        ignore_index = ce_contract.check_options(label_smoothing, ignore_index, reduction, z_loss,
                                                 tp_group)
        self.tp_group = tp_group
        communication.group_key(tp_group)  # register the group by name before any compiled call
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.z_loss = float(z_loss)
        self.inplace_backward = bool(inplace_backward)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, tp_group=self.tp_group,
                             label_smoothing=self.label_smoothing, ignore_index=self.ignore_index,
                             reduction=self.reduction, z_loss=self.z_loss,
                             inplace_backward=self.inplace_backward)

    def extra_repr(self) -> str:
        return (f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction!r}, z_loss={self.z_loss}, "
                f"inplace_backward={self.inplace_backward}")


class VocabParallelLinearCrossEntropy(_SharesGroup, nn.Module):
    """Loss from hidden states and this rank's classifier rows; see ``linear_cross_entropy``.

    The module holds only options (no parameters): ``forward(e, c, targets, bias=None,
    loss_mask=None)`` where ``c`` is usually the (TP-sharded) output-layer or tied embedding
    weight.
    """

    def __init__(self, ignore_index: int = -100, softcap: Optional[float] = None,
                 reduction: str = "mean", shift: int = 0, return_lse: bool = False, *,
                 tp_group=None, sequence_parallel: bool = False, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, impl: str = "auto", memory_budget: Optional[float] = None,
                 gradient_accumulation_fusion: bool = False, fp32_precision: str = "fp32",
                 batch_invariant: bool = False):
        super().__init__()
        # every option checked here, as linear_cross_entropy checks it, not at the first forward
        self.ignore_index = lce_contract.check_options(
            ignore_index, softcap, reduction, shift, label_smoothing, z_loss, impl,
            memory_budget, gradient_accumulation_fusion, tp_group, fp32_precision,
            batch_invariant)
        self.softcap = softcap
        self.reduction = reduction
        self.shift = shift
        self.return_lse = return_lse
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.impl = impl
        self.memory_budget = memory_budget
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.fp32_precision = fp32_precision
        self.batch_invariant = batch_invariant

    def forward(self, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                bias: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None):
        return linear_cross_entropy(
            e, c, targets, bias, loss_mask=loss_mask, ignore_index=self.ignore_index,
            softcap=self.softcap,
            reduction=self.reduction, shift=self.shift, return_lse=self.return_lse,
            tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, impl=self.impl,
            memory_budget=self.memory_budget,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            fp32_precision=self.fp32_precision, batch_invariant=self.batch_invariant)

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"softcap={self.softcap}, shift={self.shift}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"sequence_parallel={self.sequence_parallel}, impl={self.impl!r}, "
                f"memory_budget={self.memory_budget}, "
                f"gradient_accumulation_fusion={self.gradient_accumulation_fusion}, "
                f"fp32_precision={self.fp32_precision!r}, "
                f"batch_invariant={self.batch_invariant}")
