"""Megatron integration: flags, config, a GPTModel with the exact vocab-parallel loss.

In your copy of Megatron-LM's ``pretrain_gpt.py``, two edits: the flags, and the model wiring,
which depends on how that Megatron-LM builds the model.

Megatron-LM <= 0.17, ``pretrain(..., extra_args_provider=...)``::

    from vocab_parallel_loss.megatron import with_vocab_parallel_loss_args, wrap_model_provider
    pretrain(train_valid_test_datasets_provider,
             wrap_model_provider(partial(model_provider, gpt_builder)),
             ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=with_vocab_parallel_loss_args(add_modelopt_args if has_nvidia_modelopt else None),
             ...)

Megatron-LM 0.18 (``parse_and_validate_args`` parses the flags; ``pretrain`` takes the config
container and calls the model provider given as its third positional argument: passing it as
``model_provider=`` raises ``TypeError``)::

    args = parse_and_validate_args(
        extra_args_provider=with_vocab_parallel_loss_args(add_modelopt_args if has_nvidia_modelopt else None), ...)
    pretrain(full_config, train_valid_test_datasets_provider,
             wrap_model_provider(partial(model_provider, gpt_builder)), ...)

Megatron-LM >= 0.19 and main (the model is built from a ``GPTModelConfig``; a model provider given
to ``pretrain`` is not called), the same ``parse_and_validate_args`` line and, after the whole
ModelOpt ``if ...: model_cfg = ... else: model_cfg = gpt_config_from_args(args)`` block::

    model_cfg.pre_wrap_hooks.append(attach_vocab_parallel_loss)

or, keeping megatron-core's model class, ``output_processor=VocabParallelLossOutputProcessor()``
on the model's forward in ``forward_step``. Then ``--vocab-parallel-loss`` on the command line
(``--vocab-parallel-loss-fused-linear`` also fuses the output layer with the loss: with labels,
the logits are never materialized; multi-token prediction heads included). If the flag is
parsed but the model that trains does not compute its loss with this package, the first forward
raises :class:`VocabParallelLossNotWiredError` (:mod:`.guard`). megatron-core itself is not patched.

``--vocab-parallel-loss-fp32-head`` (with ``--untie-embeddings-and-output-weights``) keeps the
output layer's weight fp32 in a ``--bf16`` / ``--fp16`` run (:mod:`.fp32_head`); the wiring above
does it, and with the output processor ``model_cfg.pre_wrap_hooks.append(keep_output_layer_fp32)``.
"""

from .config import VocabParallelLossConfig
from .flags import add_vocab_parallel_loss_args, with_vocab_parallel_loss_args
from .fp32_head import keep_output_layer_fp32
from .guard import VocabParallelLossNotWiredError
from .model import (
    VocabParallelLossGPTModel,
    VocabParallelLossMixin,
    attach_vocab_parallel_loss,
    wrap_model_provider,
)
from .output_processor import VocabParallelLossOutputProcessor

__all__ = [
    "VocabParallelLossConfig",
    "VocabParallelLossGPTModel",
    "VocabParallelLossMixin",
    "VocabParallelLossNotWiredError",
    "VocabParallelLossOutputProcessor",
    "add_vocab_parallel_loss_args",
    "attach_vocab_parallel_loss",
    "keep_output_layer_fp32",
    "with_vocab_parallel_loss_args",
    "wrap_model_provider",
]
