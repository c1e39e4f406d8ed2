"""The per-token loss ``[b, s]`` a megatron-core language model returns, computed by this package:
from the output layer's logits ``[s, b, v/tp]``, or fused from its input and weight (no logits).

Shared by the model subclass (``model.py``) and the ``output_processor`` (``output_processor.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import accumulates_into_main_grad
from . import _compat
from .config import VocabParallelLossConfig


def loss_module(tp_group, loss_config: VocabParallelLossConfig) -> torch.nn.Module:
    """``VocabParallelCrossEntropy`` on ``tp_group`` with the config's settings (per-token)."""
    from vocab_parallel_loss import VocabParallelCrossEntropy

    return VocabParallelCrossEntropy(tp_group, **loss_config.loss_kwargs())


def logits_are_gathered(output_layer: Any, logits: torch.Tensor) -> bool:
    """True when the output layer gathered the vocabulary (``parallel_output=False`` or
    ``runtime_gather_output``): every rank then holds all the logits, a single shard."""
    full = getattr(output_layer, "output_size", None)
    local = getattr(output_layer, "output_size_per_partition", full)
    return full is not None and full != local and logits.size(-1) == full


def logits_loss(loss: torch.nn.Module, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32) of ``logits [s, b, v]`` read where the output layer left
    them (no copy, no transpose) against ``labels [b, s]``."""
    target = labels.transpose(0, 1)  # [s, b]; a copy of N integers at most
    if not target.is_contiguous():
        target = target.contiguous()
    return loss(logits, target).transpose(0, 1).contiguous()


def fused_linear_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    output_layer: Any,
    config: Any,
    loss_config: VocabParallelLossConfig,
    tp_group,
    loss_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32) of ``output_layer(hidden_states)`` against ``labels [b, s]``.

    ``hidden_states`` is ``[s, b, h]``, or this rank's ``[s/tp, b, h]`` under sequence
    parallelism (gathered inside the loss, its gradient reduce-scattered, as the output layer
    does). ``weight`` is the one megatron-core would pass the output layer (the embedding's when
    tied); an fp32 weight takes 16-bit hidden states as they are (an fp32 head, with the
    config's ``fp32_precision``). MuP's output multiplier is applied as megatron-core applies it
    to the logits. With the config's ``gradient_accumulation_fusion`` and a ``main_grad`` on the
    weight (DDP's), the weight's gradient is added into ``main_grad``, as the output layer would
    add it.

    ``loss_mask [b, s]``: the mask Megatron-LM's loss function multiplies the returned losses
    by (``GPTModel.forward``'s ``loss_mask``). The losses are returned unmasked, as without it;
    the fused loss then forms its gradients in forward for an upstream gradient proportional to
    the mask, and falls back to the exact gradient for any other (``linear_cross_entropy``).
    """
    from .. import linear_cross_entropy

    bias: Optional[torch.Tensor] = getattr(output_layer, "bias", None)  # GPTModel's has none
    if bias is not None and getattr(output_layer, "skip_bias_add", False):
        bias = None  # megatron-core returns it apart and leaves it out of the logits
    fp32_head = weight.dtype == torch.float32 and hidden_states.dtype in (torch.bfloat16, torch.float16)
    if hidden_states.dtype != weight.dtype and not fp32_head:  # an fp32 head takes them as they are
        hidden_states = hidden_states.to(weight.dtype)
    scale = _compat.output_logit_scale(config)
    if scale != 1.0:  # s * (e @ c.T + b) == (s * e) @ c.T + s * b
        hidden_states = hidden_states * scale
        bias = None if bias is None else bias * scale
    target = labels.transpose(0, 1).contiguous()  # [s, b], like the hidden states
    if loss_mask is not None and loss_mask.shape == labels.shape:
        loss_mask = loss_mask.detach().transpose(0, 1)
    else:  # no mask, or not one per label: the losses' gradients are recomputed in backward
        loss_mask = None
    loss = linear_cross_entropy(
        hidden_states, weight, target, bias,
        ignore_index=loss_config.ignore_index, reduction="none",
        tp_group=tp_group,
        sequence_parallel=bool(getattr(output_layer, "sequence_parallel", False)),
        label_smoothing=loss_config.label_smoothing, z_loss=loss_config.z_loss, impl="auto",
        memory_budget=loss_config.memory_budget,
        gradient_accumulation_fusion=accumulates_into_main_grad(config, weight),
        loss_mask=loss_mask,
        fp32_precision=loss_config.fp32_precision,
    )  # [s, b], fp32
    return loss.transpose(0, 1).contiguous()
