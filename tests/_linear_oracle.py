"""fp64 oracle for the fused linear cross entropy: ``F.cross_entropy(e @ c.T + bias)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lce_reference(e, c, targets, bias=None, *, ignore_index=-100, softcap=None,
                  reduction="mean", shift=0, label_smoothing=0.0, z_loss=0.0):
    """fp64 loss and per-token lse on the full vocabulary; differentiable in e, c, bias."""
    if shift:
        e = e[..., :-shift, :]
        targets = targets[..., shift:]
    x = e.double() @ c.double().t()
    if bias is not None:
        x = x + bias.double()
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    lead = targets.shape
    x = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1).long()
    keep = t != ignore_index
    # F.cross_entropy would raise on an out-of-range target: give those rows NaN instead
    bad = keep & ((t < 0) | (t >= x.shape[-1]))
    loss = F.cross_entropy(x, torch.where(bad, torch.zeros_like(t), t), reduction="none",
                           label_smoothing=label_smoothing, ignore_index=ignore_index)
    lse = torch.logsumexp(x, -1)
    if z_loss:
        loss = loss + z_loss * lse ** 2 * keep
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    if reduction == "none":
        out = loss.view(lead)
    elif reduction == "sum":
        out = loss.sum()
    else:
        out = loss.sum() / keep.sum().clamp(min=1)
    return out, lse.view(lead)


def reference_grads(e, c, targets, bias=None, upstream=None, **kw):
    """Loss (fp64) and fp64 gradients of e, c, bias for the given upstream gradient."""
    leaves = [e.detach().double().requires_grad_(), c.detach().double().requires_grad_()]
    if bias is not None:
        leaves.append(bias.detach().double().requires_grad_())
    loss, _ = lce_reference(leaves[0], leaves[1], targets, leaves[2] if bias is not None else None,
                            **kw)
    g = torch.ones_like(loss) if upstream is None else upstream.double().reshape(loss.shape)
    grads = torch.autograd.grad(loss, leaves, g)
    return loss.detach(), grads
