"""Multi-token prediction (``mtp_num_layers``) with the fused linear loss: each head's loss from its
hidden states and the output weight, never its logits, added to the graph the way megatron-core
adds its own heads' losses.

megatron-core (``GPTModel._postprocess``, or ``process_mtp_loss`` from 0.17) splits the MTP
block's output ``[(1 + D) * s, b, h]`` into the main head's and D heads' hidden states; head k
predicts labels rolled k + 1 positions left (``roll_tensor``: zero-filled, context-parallel and
packed-sequence aware) under the loss mask rolled alike. A head's masked per-token loss, scaled
by ``mtp_loss_scaling_factor / D`` and divided by its token count, rides on the main head's
hidden states through ``MTPLossAutoScaler`` (its gradient enters in backward); in training its
mean is logged with ``MTPLossLoggingHelper``. Those megatron-core pieces are used as they are;
only the logits-and-loss step of each head is this package's fused loss.

Without the fused path nothing here runs: megatron-core calls the model's
``compute_language_model_loss`` for every head, which is already this package's loss.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from . import _compat


def add_mtp_losses(
    model: Any,
    hidden_states: torch.Tensor,
    call: Dict[str, Any],
    head_loss: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The main head's hidden states, carrying the MTP heads' losses for backward.

    ``hidden_states`` is the MTP block's output, ``call`` the ``_postprocess`` arguments by name
    (labels, loss_mask, packed_seq_params), ``head_loss(hidden, labels, weight, loss_mask=)`` the
    per-token ``[b, s]`` loss of one head, given the rolled mask its loss is multiplied by here (so
    that the fused loss can form its gradients in forward).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    config = model.config
    heads = int(config.mtp_num_layers)
    chunks = torch.chunk(hidden_states, 1 + heads, dim=0)
    hidden = chunks[0]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else model.output_layer.weight
    if getattr(config, "mtp_detach_heads", False):  # 0.20: the heads do not train the output weight
        weight = weight.detach()
    labels = call["labels"].clone()
    mask = call.get("loss_mask")
    if mask is None:
        mask = torch.ones_like(labels)
    tokens_before_rolling = mask.sum()
    cp_group = _compat.cp_group_of(model)
    scale = config.mtp_loss_scaling_factor / heads
    for k in range(heads):
        labels, _ = _compat.roll_labels(labels, call, cp_group)
        mask, num_tokens = _compat.roll_labels(mask, call, cp_group)
        loss = mask * head_loss(chunks[k + 1], labels, weight, loss_mask=mask)
        safe_tokens = num_tokens.clamp(min=1)
        if model.training:
            mean = loss.sum() * (num_tokens > 0).to(loss.dtype) / safe_tokens  # no host sync
            _compat.log_mtp_head(mean, k, heads, lambda: _acceptance_counts(model, chunks[k + 1], weight, labels, mask))
        if getattr(config, "calculate_per_token_loss", False):
            # Megatron divides every gradient by the main head's token count afterwards.
            if _compat.mtp_rescales_per_token_loss():
                term = scale * loss * (tokens_before_rolling / safe_tokens)
            else:
                term = scale * loss
        else:
            term = scale * loss / safe_tokens
        hidden = MTPLossAutoScaler.apply(hidden, term)
    return hidden


@torch.no_grad()
def _acceptance_counts(model: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       mask: torch.Tensor) -> tuple:
    """``(correct, total)``: masked tokens whose full-vocabulary argmax is the label, and masked
    tokens (what megatron-core 0.20 logs as a head's acceptance rate).

    The fused loss never builds the logits; this builds them a block of rows at a time, without
    autograd: one more output-layer GEMM per head, in training only, on releases that log it.
    """
    group = _compat.tp_group_of(model)
    world = dist.get_world_size(group) if group is not None else 1
    if world > 1 and getattr(model.output_layer, "sequence_parallel", False):
        parts = [torch.empty_like(hidden) for _ in range(world)]
        dist.all_gather(parts, hidden.contiguous(), group=group)
        hidden = torch.cat(parts, dim=0)
    rows = hidden.reshape(-1, hidden.size(-1)).to(weight.dtype)
    block = max(1, (1 << 26) // max(1, weight.size(0)))  # ~64M logits per block
    best, index = [], []
    for start in range(0, rows.size(0), block):
        value, idx = (rows[start:start + block] @ weight.t()).float().max(dim=-1)
        best.append(value)
        index.append(idx)
    best, index = torch.cat(best), torch.cat(index)
    if world > 1:  # the largest over the vocabulary shards; rank r holds [r * V_local, (r + 1) * V_local)
        index = index + dist.get_rank(group) * weight.size(0)
        all_best = [torch.empty_like(best) for _ in range(world)]
        all_index = [torch.empty_like(index) for _ in range(world)]
        dist.all_gather(all_best, best, group=group)
        dist.all_gather(all_index, index, group=group)
        winner = torch.stack(all_best).argmax(dim=0)
        index = torch.stack(all_index).gather(0, winner.unsqueeze(0)).squeeze(0)
    preds = index.view(hidden.shape[:-1])  # [s, b]
    valid = mask.transpose(0, 1).bool()
    correct = ((preds == labels.transpose(0, 1)) & valid).sum().float()
    return correct, valid.sum().float()
