"""This package's loss as a ``GPTModel.forward(..., output_processor=...)`` callback, for
megatron-core releases whose ``GPTModel`` takes one: the model stays megatron-core's own class,
the caller passes the processor on each forward (RL frameworks' hook).

megatron-core calls the processor after the decoder (and the multi-token-prediction heads' losses,
which it has already computed with its own loss: so multi-token prediction is refused here) with
the hidden states, the output layer and its weight, the labels. With labels the processor returns
the per-token loss ``[b, s]`` (fp32) like megatron-core's default path, fused with the output
layer under ``fused_linear``; without labels, the logits ``[b, s, v/tp]`` as megatron-core
returns them in training and evaluation (pass it only there: megatron-core's inference trimming
is not repeated).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import _compat, fp32_head, losses
from .config import VocabParallelLossConfig


class VocabParallelLossOutputProcessor:
    """``model(tokens, position_ids, attention_mask, labels=labels, output_processor=processor)``.

    ``loss_config=None`` reads the ``--vocab-parallel-loss*`` flags when Megatron-LM has parsed
    them, else enables the loss with defaults; it is resolved at first use, so the processor can be
    built before the arguments are parsed. Without ``--vocab-parallel-loss`` (``enabled=False``)
    the loss is megatron-core's own. Under ``fp32_head`` the model's output layer must have been
    kept fp32 before Float16Module (``keep_output_layer_fp32`` as a ``pre_wrap_hooks`` entry):
    a 16-bit output weight raises.
    """

    def __init__(self, loss_config: Optional[VocabParallelLossConfig] = None):
        self._config = loss_config
        self._losses: Dict[Any, torch.nn.Module] = {}  # by TP group (None: gathered logits)

    @property
    def loss_config(self) -> VocabParallelLossConfig:
        if self._config is None:
            from .model import resolve_loss_config

            self._config = resolve_loss_config(None)
        return self._config

    def _loss(self, tp_group) -> torch.nn.Module:
        key = id(tp_group) if tp_group is not None else None
        if key not in self._losses:
            self._losses[key] = losses.loss_module(tp_group, self.loss_config)
        return self._losses[key]

    def __call__(self, *, hidden_states: torch.Tensor, output_layer: Any, output_weight=None, labels=None,
                 runtime_gather_output=None, compute_language_model_loss=None, scale_logits=None,
                 config: Any = None, loss_mask=None, **_: Any):
        if getattr(config, "mtp_num_layers", None):
            raise NotImplementedError(
                "VocabParallelLossOutputProcessor: megatron-core computes the multi-token-prediction "
                "heads' losses before the output processor, with its own loss; use "
                "attach_vocab_parallel_loss (or wrap_model_provider) for mtp_num_layers")
        cfg = self.loss_config
        model = getattr(compute_language_model_loss, "__self__", None)
        weight = output_weight if output_weight is not None else output_layer.weight
        if cfg.fp32_head:
            fp32_head.check_fp32_weight(weight, "VocabParallelLossOutputProcessor")
        if labels is not None and cfg.enabled and cfg.fused_linear:
            return losses.fused_linear_loss(hidden_states, weight, labels, output_layer=output_layer,
                                            config=config, loss_config=cfg, tp_group=_compat.tp_group_of(model),
                                            loss_mask=loss_mask)
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if scale_logits is not None:
            logits = scale_logits(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v], as megatron-core
        if not cfg.enabled:
            return compute_language_model_loss(labels, logits)
        group = None if losses.logits_are_gathered(output_layer, logits) else _compat.tp_group_of(model)
        return losses.logits_loss(self._loss(group), labels, logits)
