"""The causal-LM loss of Hugging Face transformers, computed from hidden states without logits.

Mirrors ``transformers.loss.loss_utils.ForCausalLMLoss``: labels are shifted left by one and padded
with ``ignore_index`` (or ``shift_labels`` are used as given), the loss is computed in fp32, and
with ``num_items_in_batch`` it is the sum over non-ignored tokens divided by that count (the
gradient-accumulation-correct loss the ``Trainer`` asks for); otherwise the mean over non-ignored
tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: Optional[torch.Tensor],
    *,
    bias: Optional[torch.Tensor] = None,
    shift_labels: Optional[torch.Tensor] = None,
    num_items_in_batch=None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    impl: str = "auto",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    memory_budget: Optional[float] = None,
    fp32_precision: str = "fp32",
) -> torch.Tensor:
    """Loss of ``softcap(hidden_states @ weight.T + bias)`` against the shifted labels.

    ``hidden_states``: (..., T, H), the input of the LM head; ``labels``: (..., T) unshifted, or
    ``shift_labels``: (..., T) already shifted. ``reduction="mean"`` is transformers' own
    semantics (mean, or sum / ``num_items_in_batch`` when that is given); ``"sum"`` and
    ``"none"`` ignore ``num_items_in_batch``; ``"none"`` returns the per-token losses in the
    shape of the shifted labels (0 where ignored).
    """
    from .. import linear_cross_entropy

    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if shift_labels is None:
        if labels is None:
            raise ValueError("labels or shift_labels are needed to compute the loss")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if hidden_states.device != weight.device:  # e.g. a device map placing lm_head elsewhere
        hidden_states = hidden_states.to(weight.device)
    targets = shift_labels.to(device=weight.device, dtype=torch.long)
    if targets.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"labels of shape {tuple(targets.shape)} do not match the hidden states "
            f"{tuple(hidden_states.shape[:-1])} (is logits_to_keep set together with labels?)"
        )

    inner = reduction
    if reduction == "mean" and num_items_in_batch is not None:
        inner = "sum"
    extra = {}
    if label_smoothing:
        extra["label_smoothing"] = label_smoothing
    if z_loss:
        extra["z_loss"] = z_loss
    h = hidden_states.shape[-1]
    loss = linear_cross_entropy(
        hidden_states.reshape(-1, h),
        weight,
        targets.reshape(-1),
        bias=bias,
        ignore_index=ignore_index,
        softcap=softcap,
        reduction=inner,
        impl=impl,
        memory_budget=memory_budget,
        fp32_precision=fp32_precision,
        **extra,
    )
    if reduction == "none":
        return loss.reshape(targets.shape)
    if inner != reduction:  # transformers' fixed_cross_entropy with num_items_in_batch
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
