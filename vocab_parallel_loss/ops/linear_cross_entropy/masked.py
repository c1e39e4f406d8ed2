"""The gradients formed in forward for a per-token loss that the caller multiplies by a loss mask.

Megatron's loss is ``sum(loss * loss_mask)``, divided by the token count or not, times a loss
scale: the upstream gradient of the per-token loss is ``k * loss_mask`` for one scalar ``k``
that is known only in backward. Given ``loss_mask`` the forward forms both gradients for the
upstream gradient ``loss_mask`` (``function._forward_with_grads``, 6NHV, as a scalar loss's
gradients in forward), and backward

1. computes on the device ``k = g[p] / mask[p]`` at the kept token ``p`` of the largest
   ``|mask|`` (0 when every kept token's mask is 0), and ``ok``: ``k`` finite and
   ``g == k * mask`` exactly at every kept token (a token whose target is ``ignore_index`` has
   gradient 0 whatever its ``g``); with the lse output's gradient as well, ``ok`` is false;
2. where ``ok``: scales the formed fp32 accumulators by ``k`` and rounds them once;
3. where not: the exact gradient for ``g`` by the recompute path (8NHV), added into the formed
   accumulators after they are cleared. Its kernels are launched either way and skip
   themselves where ``ok`` (``kernels/linear/gated.py``): no host sync, no shape that depends on
   data, so the step stays capturable in a CUDA graph.

A wrong guess about the upstream gradient therefore costs the recompute, never a wrong
gradient. ``ok`` is exact equality in fp32: Megatron's ``losses * loss_mask`` backward gives
``c * mask_i`` for every token from one ``c``, which ``k * mask_i`` reproduces bit for bit where
``mask[p]`` is 1 (0/1 masks); other masks may take the fallback.

Under TP every rank forms the partial dE of its vocabulary shard: it is scaled (``k`` or 1) in
place and summed over the group in fp32 by the caller, then rounded once; dC is local. Each rank
decides ``ok`` from its own upstream gradient, so ranks given different upstream gradients still
get the sum of their exact partial gradients, as the recompute path gives them.
"""

from __future__ import annotations

import torch

from ..fused_linear.strategy import gif_round_dc_first
from .formed import round_formed


def upstream_scale(grad_loss, grad_lse, mask: torch.Tensor, valid: torch.Tensor):
    """``(k, ok)`` on the device: ``k`` one fp32 element, ``ok`` a bool scalar that is true
    where ``grad_loss`` (per token, or None: zeros) equals ``k * mask`` exactly at every token
    of ``valid``, ``k`` is finite and the lse output has no gradient (``grad_lse`` None; the
    formed gradients hold nothing of it): the module docstring. Nothing is read on the host."""
    n = mask.numel()
    dev = mask.device
    if grad_lse is not None:
        return torch.ones(1, dtype=torch.float32, device=dev), torch.zeros(
            (), dtype=torch.bool, device=dev)
    if n == 0:
        return torch.zeros(1, dtype=torch.float32, device=dev), torch.ones((), dtype=torch.bool,
                                                                           device=dev)
    g = (grad_loss.reshape(-1).to(torch.float32) if grad_loss is not None
         else torch.zeros(n, dtype=torch.float32, device=dev))
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    pivot = torch.where(valid, mask.abs(), zero).argmax().view(1)
    mp = mask.index_select(0, pivot)
    k = torch.where(mp != 0, g.index_select(0, pivot) / torch.where(mp != 0, mp, 1.0), zero)
    holds = (g == k * mask) | ~valid
    return k, holds.all() & torch.isfinite(k).all()


def backward(formed: list, grad_loss, grad_lse, coef: torch.Tensor, e, e2, c, bias, t2, mask,
             o, v_offset: int, world: int, need_de: bool, need_dc: bool, need_db: bool, home):
    """Gradients from ``formed``, the fp32 ``[dE, dC, dbias]`` formed in forward for the upstream
    gradient ``mask`` (``(N,)`` fp32, the rows of ``e2``: ``e``'s gathered and
    flattened), or exact for any other (the module docstring). ``coef``: the recompute's ``(4,
    N)`` coefficients for the real upstream gradients (``function._coef``); ``o`` the call's
    ``LinearLossOptions``, ``world`` the TP group's size. Each accumulator is released once
    rounded. Returns ``(dE (rounded into e.dtype without TP; fp32, scaled, for the caller to
    sum over the group and round, with it), dC in c.dtype or None when added into ``home``,
    dbias fp32)``."""
    K = o.backend
    valid = t2 != o.ignore_index
    k, ok = upstream_scale(grad_loss, grad_lse, mask, valid)
    skip = ok.to(torch.int32).view(1)
    scale = torch.where(ok, k, torch.ones_like(k))
    de_f, dc_f, db_f = formed
    de_f, dc_f = (de_f if need_de else None), (dc_f if need_dc else None)
    K.zero_unless(skip, de_f, dc_f)
    cfg = K.default_config(e2.device, o.fp32_precision)
    if o.chunk_bytes:
        cfg = cfg.replace(chunk_bytes=o.chunk_bytes)
    _, _, db_x = K.backward(e2, c, bias, t2, v_offset, coef, o.softcap, need_de, need_dc,
                            need_db, config=cfg, de_acc=de_f, dc_acc=dc_f, skip=skip)
    del de_f, dc_f  # ``formed`` alone holds them: each is released once rounded
    db = torch.where(ok, db_f * k, db_x) if need_db else None
    tp = world > 1
    h = e.shape[-1]
    dc_first = tp or gif_round_dc_first(e.numel() // max(h, 1), c.shape[0], h, e, c,
                                        home is not None)
    # under TP dE stays fp32 (scaled): the caller sums it over the group, then rounds it
    de, dc = round_formed(formed, scale, e, c, home, K, need_de, need_dc, dc_first, de_fp32=tp)
    return de, dc, db
