"""``nn.Module`` wrapper of the fused linear cross entropy."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import _checks
from .linear_cross_entropy import IMPLS, linear_cross_entropy


class VocabParallelLinearCrossEntropy(nn.Module):
    """Loss from hidden states and this rank's classifier rows; see ``linear_cross_entropy``.

    The module holds only options (no parameters): ``forward(e, c, targets, bias=None)`` where
    ``c`` is usually the (TP-sharded) output-layer or tied embedding weight.
    """

    def __init__(self, ignore_index: int = -100, softcap: Optional[float] = None,
                 reduction: str = "mean", shift: int = 0, return_lse: bool = False, *,
                 tp_group=None, sequence_parallel: bool = False, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, impl: str = "auto"):
        super().__init__()
        _checks.check_reduction(reduction)
        _checks.check_smoothing(label_smoothing)
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.ignore_index = ignore_index
        self.softcap = softcap
        self.reduction = reduction
        self.shift = shift
        self.return_lse = return_lse
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.impl = impl

    def forward(self, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                bias: Optional[torch.Tensor] = None):
        return linear_cross_entropy(
            e, c, targets, bias, ignore_index=self.ignore_index, softcap=self.softcap,
            reduction=self.reduction, shift=self.shift, return_lse=self.return_lse,
            tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, impl=self.impl)

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"softcap={self.softcap}, shift={self.shift}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"sequence_parallel={self.sequence_parallel}, impl={self.impl!r}")
