"""Command-line flags (Megatron-LM ``extra_args_provider`` contract) and their config dataclass."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Dict, Optional

from .. import checks


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
    """

    enabled: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    inplace_backward: bool = False
    fused_linear: bool = False
    ignore_index: int = -100
    memory_budget_gib: Optional[float] = None

    def __post_init__(self) -> None:
        # the loss's own checks: the config accepts exactly what the loss accepts
        checks.check_smoothing(self.label_smoothing)
        checks.check_z_loss(self.z_loss)
        checks.check_memory_budget(self.memory_budget_gib)
        self.ignore_index = checks.check_ignore_index(self.ignore_index)

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


def with_vocab_parallel_loss_args(
    other: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """A Megatron-LM ``extra_args_provider`` adding ``other``'s flags (when not None) and ours:
    ``extra_args_provider=with_vocab_parallel_loss_args(add_modelopt_args if has_nvidia_modelopt else None)``.
    """

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if other is not None:
            parser = other(parser)
        return add_vocab_parallel_loss_args(parser)

    return provider


def add_vocab_parallel_loss_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--vocab-parallel-loss*`` flags; Megatron-LM ``extra_args_provider`` contract;
    returns ``parser``. :func:`with_vocab_parallel_loss_args` chains another provider.

    Also arms the check that a ``--vocab-parallel-loss`` run really trains with this package's
    loss (:mod:`vocab_parallel_loss.megatron.guard`).
    """
    from . import guard

    guard.arm()
    group = parser.add_argument_group(
        title="vocab parallel loss", description="exact vocab-parallel cross entropy (vocab_parallel_loss)"
    )
    group.add_argument(
        "--vocab-parallel-loss",
        action="store_true",
        help="Compute the language-model loss with vocab_parallel_loss.VocabParallelCrossEntropy.",
    )
    group.add_argument(
        "--vocab-parallel-loss-label-smoothing",
        type=float,
        default=0.0,
        help="Label smoothing over the global vocabulary (PyTorch's convention).",
    )
    group.add_argument(
        "--vocab-parallel-loss-z-loss",
        type=float,
        default=0.0,
        help="z-loss weight: adds z * logsumexp(logits)^2 to every token's loss.",
    )
    group.add_argument(
        "--vocab-parallel-loss-inplace-backward",
        action="store_true",
        help="Write the logits' gradient into the logits buffer (saves one logits-sized buffer).",
    )
    group.add_argument(
        "--vocab-parallel-loss-fused-linear",
        action="store_true",
        help="Fuse the output layer with the loss (the logits are never materialized).",
    )
    group.add_argument(
        "--vocab-parallel-loss-memory-budget",
        type=float,
        default=None,
        help="GiB the fused linear loss may hold beyond its inputs and gradients; it takes the "
             "fastest strategy that fits (default 2: the logits saved for backward up to that "
             "size, else recomputed).",
    )
    group.add_argument(
        "--vocab-parallel-loss-ignore-index",
        type=int,
        default=-100,
        help="Label value that contributes no loss and no gradient.",
    )
    return parser
