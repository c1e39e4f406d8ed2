"""Independent references: fp64 ``torch.nn.functional.cross_entropy`` on the full logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def full_vocab_loss(logits, target, *, label_smoothing=0.0, z_loss=0.0, ignore_index=-100,
                    reduction="none"):
    """fp64 loss of ``logits (..., V)``; z-loss added as ``z * logsumexp**2`` on kept tokens."""
    x = logits.double().reshape(-1, logits.shape[-1])
    t = target.reshape(-1).long()
    loss = F.cross_entropy(x, t, reduction="none", label_smoothing=label_smoothing,
                           ignore_index=ignore_index)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(x, -1) ** 2 * (t != ignore_index)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (t != ignore_index).sum().clamp(min=1)


def full_vocab_loss_and_grad(logits, target, upstream=None, **kw):
    x = logits.detach().double().requires_grad_()
    loss = full_vocab_loss(x, target, **kw)
    g = torch.ones_like(loss) if upstream is None else upstream.double().reshape(loss.shape)
    (grad,) = torch.autograd.grad(loss, x, g)
    return loss.detach(), grad
