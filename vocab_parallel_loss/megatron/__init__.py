"""Megatron integration: flags, config, a GPTModel with the exact vocab-parallel loss.

Megatron-LM's ``pretrain_gpt.py`` takes three lines::

    from vocab_parallel_loss.megatron import add_vocab_parallel_loss_args, wrap_model_provider
    pretrain(..., wrap_model_provider(model_provider), ...,
             extra_args_provider=add_vocab_parallel_loss_args)

then ``--vocab-parallel-loss`` on the command line (``--vocab-parallel-loss-fused-linear`` also fuses
the output layer with the loss: with labels, the logits are never materialized). megatron-core
itself is not patched.
"""

from .config import VocabParallelLossConfig, add_vocab_parallel_loss_args
from .model import (
    VocabParallelLossGPTModel,
    VocabParallelLossMixin,
    attach_vocab_parallel_loss,
    wrap_model_provider,
)

__all__ = [
    "VocabParallelLossConfig",
    "VocabParallelLossGPTModel",
    "VocabParallelLossMixin",
    "add_vocab_parallel_loss_args",
    "attach_vocab_parallel_loss",
    "wrap_model_provider",
]
