"""Error against a higher-precision reference: the fp32 references of each problem, computed
from the same (low-precision) inputs, and the distances reported."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def max_abs_diff(a: torch.Tensor, ref: torch.Tensor, rows: int = 2048) -> float:
    """max |a - ref| in fp32, a block of rows at a time (no full-size temporary)."""
    if a.dim() < 2:
        return (a.float().reshape(ref.shape) - ref).abs().max().item()
    return max((a[i:i + rows].float() - ref[i:i + rows]).abs().max().item()
               for i in range(0, a.shape[0], rows))


def rel_max_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| over max |ref|, in fp32."""
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def logits_reference(logits: torch.Tensor, target: torch.Tensor, upstream: Optional[torch.Tensor],
                     smoothing: float = 0.0, z_loss: float = 0.0
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 cross entropy over ``logits`` (with label smoothing and a z-loss term ``z * lse^2``)
    and its fp32 gradient: per token under ``upstream``, or the mean's when it is None."""
    x = logits.detach().float().requires_grad_(True)
    loss = F.cross_entropy(x, target, reduction="none", label_smoothing=smoothing)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(x, dim=-1).square()
    loss = loss if upstream is not None else loss.mean()
    (grad,) = torch.autograd.grad(loss, x, upstream)
    return loss.detach(), grad


def linear_reference_loss(e: torch.Tensor, c: torch.Tensor, t: torch.Tensor,
                          chunk: int = 2048) -> torch.Tensor:
    """fp32 per-token loss from the materialized logits ``e @ c.T``, in row chunks."""
    out = torch.empty(t.shape[0], dtype=torch.float32, device=e.device)
    cf = c.float()
    for r in range(0, t.shape[0], chunk):
        x = e[r:r + chunk].float() @ cf.t()
        out[r:r + chunk] = F.cross_entropy(x, t[r:r + chunk], reduction="none")
    return out


def logprobs_reference(plain, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor,
                       g_lp: torch.Tensor, g_ent: torch.Tensor):
    """fp32 log-probs, entropy and dE from ``plain(h, w, t) -> (log_probs, entropy)`` on fp32
    copies of h and w, backward under the upstream gradients ``g_lp`` and ``g_ent``."""
    hf = h.detach().float().requires_grad_()
    lp, ent = plain(hf, w.detach().float(), t)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    return lp.detach(), ent.detach(), hf.grad.detach()
