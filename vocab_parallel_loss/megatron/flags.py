"""Command-line flags of the vocab-parallel loss (Megatron-LM ``extra_args_provider`` contract);
``VocabParallelLossConfig.from_args`` reads them. Adding them arms the guard (``guard.py``)."""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from . import guard


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
             "size, else recomputed; below the fp32 gradient of the hidden states, 4 bytes "
             "a token and hidden unit, it warns).",
    )
    group.add_argument(
        "--vocab-parallel-loss-ignore-index",
        type=int,
        default=-100,
        help="Label value that contributes no loss and no gradient.",
    )
    group.add_argument(
        "--vocab-parallel-loss-fp32-head",
        action="store_true",
        help="Keep the output layer's weight fp32 in a --bf16 / --fp16 run (RL: log-probs like an "
             "inference engine's fp32 LM head); the fused loss takes the 16-bit hidden states as "
             "they are, materialized logits are fp32. Needs --untie-embeddings-and-output-weights.",
    )
    group.add_argument(
        "--vocab-parallel-loss-fp32-precision",
        choices=("fp32", "tf32"),
        default="fp32",
        help="Products of the fp32 output weight in the fused loss: fp32 (fp32-class error) or "
             "tf32 (faster, TF32-class error: 11 significand bits).",
    )
    return parser
