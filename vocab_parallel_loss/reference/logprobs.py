"""Pure-PyTorch row statistics and gradient of the token log-probabilities and entropy: the same
contract as ``kernels/logprobs.py`` (see there for the math), computed in float64 for float64
logits and in float32 otherwise."""

from __future__ import annotations

import torch

from .logits import row_blocks


#: Backend capabilities (``backends.RowsBackend``)
NAME = "torch"
TRACEABLE = True


def transform(z, inv_t, scale, softcap):
    """``(x, dx/dz)``: the logits ``x = cap(scale z) * inv_t`` and their slope."""
    y = z * scale
    if softcap is not None:
        th = torch.tanh(y / softcap)
        return softcap * th * inv_t, (1.0 - th * th) * (scale * inv_t)
    return y * inv_t, scale * inv_t


def _inv_t_rows(inv_t, lo, hi, dtype):
    inv = inv_t.to(dtype)
    return inv.reshape(1, 1) if inv.numel() == 1 else inv[lo:hi, None]


def stats(view, target, inv_t, col_start: int, valid: int, scale: float, softcap, out):
    if valid == 0:  # a shard of padding only: the merge's neutral element, as the kernel writes
        out[0] = float("-inf")
        out[1:4] = 0.0
        out[4] = col_start
        return
    t = target.long()
    for lo, hi, block in row_blocks(view):
        dtype = torch.float64 if block.dtype == torch.float64 else torch.float32
        z = block.reshape(-1, block.shape[-1])[:, :valid].to(dtype)
        x, _ = transform(z, _inv_t_rows(inv_t, lo, hi, dtype), scale, softcap)
        m = x.amax(dim=1)
        m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        d = x - m_safe[:, None]
        p = torch.exp(d)
        w = torch.where(p > 0, p * d, torch.zeros_like(p)).sum(dim=1)
        s = p.sum(dim=1)
        t_local = t[lo:hi] - col_start
        in_block = (t_local >= 0) & (t_local < valid)
        idx = torch.where(in_block, t_local, torch.zeros_like(t_local))
        x_t = torch.where(in_block, x.gather(1, idx[:, None])[:, 0], torch.zeros_like(m))
        # first column of the max (argmax of PyTorch returns the first on ties)
        best = torch.argmax(torch.nan_to_num(x, nan=float("-inf")), dim=1) + col_start
        out[:, lo:hi] = torch.stack([m, s, w, x_t, best.to(dtype)]).to(out.dtype)


def backward(view, dview, target, inv_t, lse, ent, g_lp, g_ent, col_start: int, valid: int,
             scale: float, softcap):
    """As ``kernels.logprobs.backward``: ``lse`` is ``(2, N)``, the lse and its low part."""
    t = target.long()
    lse, low = lse
    dblocks = row_blocks(dview)
    for lo, hi, block in row_blocks(view):
        dblock = next(dblocks)[2]
        dtype = torch.float64 if block.dtype == torch.float64 else torch.float32
        z = block.reshape(-1, block.shape[-1]).to(dtype)
        x, chain = transform(z, _inv_t_rows(inv_t, lo, hi, dtype), scale, softcap)
        # as the kernel: a masked (-inf) logit adds p * (d + H) = 0, not 0 * -inf (exp is 0
        # below -1e4 in fp32 and fp64, so the clamp changes no p; clamp keeps NaN)
        d = torch.clamp(x - lse[lo:hi, None].to(dtype), min=-1.0e4)
        glp, gent = g_lp[lo:hi, None].to(dtype), g_ent[lo:hi, None].to(dtype)
        # the low part in the row's coefficients, as the kernel: dx = g_lp [j == t] - e^d (a + b d)
        lw = low[lo:hi, None].to(dtype)
        c = torch.exp(-lw)
        a, b = c * (glp + gent * (ent[lo:hi, None] - lw)), c * gent
        cols = torch.arange(z.shape[1], device=z.device)
        onehot = cols[None, :] == (t[lo:hi, None] - col_start)
        dx = torch.where(onehot, glp, torch.zeros_like(d)) - torch.exp(d) * (a + b * d)
        live = (cols[None, :] < valid) & ((glp != 0) | (gent != 0))
        dz = torch.where(live, dx * chain, torch.zeros_like(dx))
        dblock.copy_(dz.view(dblock.shape))


class TorchGemm:
    """The products of the hidden-state path in PyTorch, in the accumulation dtype."""

    @staticmethod
    def logits(e2, c_chunk, b_chunk, out):
        z = e2.to(out.dtype) @ c_chunk.to(out.dtype).t()
        out.copy_(z if b_chunk is None else z + b_chunk.to(out.dtype))

    @staticmethod
    def acc(acc, a, b):
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))

    @staticmethod
    def store(out, a, b):
        dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
        out.copy_(a.to(dtype) @ b.to(dtype))
