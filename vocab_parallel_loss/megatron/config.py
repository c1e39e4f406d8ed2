"""The settings of the vocab-parallel loss inside a Megatron model (``flags.py`` parses them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from .. import checks
from ..ops.cross_entropy import contract as ce_contract
from ..ops.linear_cross_entropy import contract as lce_contract


@dataclasses.dataclass
class VocabParallelLossConfig:
    """Settings of the vocab-parallel loss inside a Megatron model.

    Attributes
    ----------
    enabled : bool
        Use ``VocabParallelCrossEntropy``; when False the model keeps megatron-core's own loss.
    label_smoothing : float
        PyTorch's convention over the GLOBAL vocabulary (megatron-core's own uses the local one).
    z_loss : float
        Weight of ``lse ** 2`` added to every token's loss.
    inplace_backward : bool
        The logits' gradient overwrites the logits buffer (no extra memory).
    fused_linear : bool
        Fuse the output layer with the loss (never materialize the logits).
    memory_budget_gib : float or None
        With ``fused_linear``: GiB of device memory the fused loss may hold beyond its inputs
        and gradients (``linear_cross_entropy``'s ``memory_budget``; None: its default, 2 GiB).
    ignore_index : int
        Target value whose token gets loss 0 and gradient 0.
    fp32_head : bool
        Keep the output layer's weight fp32 in a bf16 / fp16 model (``fp32_head.py``): the fused
        loss takes the 16-bit hidden states as they are, materialized logits are fp32. Needs
        ``enabled`` and untied embeddings.
    fp32_precision : str
        The fused loss's products of the fp32 weight: ``"fp32"`` (fp32-class error) or
        ``"tf32"`` (faster); ``linear_cross_entropy``'s ``fp32_precision``.
    """

    enabled: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    inplace_backward: bool = False
    fused_linear: bool = False
    ignore_index: int = -100
    memory_budget_gib: Optional[float] = None
    fp32_head: bool = False
    fp32_precision: str = "fp32"

    def __post_init__(self) -> None:
        # the losses' own checks: the config accepts exactly what the losses accept
        self.ignore_index = ce_contract.check_options(self.label_smoothing, self.ignore_index,
                                                      "none", self.z_loss)
        lce_contract.check_options(self.ignore_index, None, "none", 0, self.label_smoothing,
                                   self.z_loss, "auto", self.memory_budget_gib, False)
        checks.check_fp32_precision(self.fp32_precision)
        if self.fp32_head and not self.enabled:
            raise ValueError("--vocab-parallel-loss-fp32-head (fp32_head) needs --vocab-parallel-loss (enabled)")

    @classmethod
    def from_args(cls, args: Any) -> "VocabParallelLossConfig":
        """Read the flags of :func:`add_vocab_parallel_loss_args` from a parsed namespace.

        Flags missing from ``args`` (a namespace built without our argument group) keep the
        defaults.
        """
        get = lambda name, default: getattr(args, name, default)  # noqa: E731
        return cls(
            enabled=bool(get("vocab_parallel_loss", False)),
            label_smoothing=float(get("vocab_parallel_loss_label_smoothing", 0.0)),
            z_loss=float(get("vocab_parallel_loss_z_loss", 0.0)),
            inplace_backward=bool(get("vocab_parallel_loss_inplace_backward", False)),
            fused_linear=bool(get("vocab_parallel_loss_fused_linear", False)),
            ignore_index=int(get("vocab_parallel_loss_ignore_index", -100)),
            memory_budget_gib=get("vocab_parallel_loss_memory_budget", None),
            fp32_head=bool(get("vocab_parallel_loss_fp32_head", False)),
            fp32_precision=get("vocab_parallel_loss_fp32_precision", "fp32"),
        )

    @property
    def memory_budget(self) -> Optional[int]:
        """``memory_budget_gib`` in bytes (``linear_cross_entropy``'s unit)."""
        return None if self.memory_budget_gib is None else int(self.memory_budget_gib * 2**30)

    def loss_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``VocabParallelCrossEntropy`` (besides the group)."""
        return dict(
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction="none",
            z_loss=self.z_loss,
            inplace_backward=self.inplace_backward,
        )
