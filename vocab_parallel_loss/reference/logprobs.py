"""Pure-PyTorch row statistics and gradient of the token log-probabilities and entropy: the same
contract as ``kernels/logprobs.py`` (see there for the math), computed in float64 for float64
logits and in float32 otherwise.

Batch-invariant statistics (``stats(..., invariant=True)``) run every PyTorch op on blocks of
one fixed shape, ``invariant_rows`` rows (the last block padded) by the columns rounded up to
``INVARIANT_ALIGN`` (padding columns at ``-inf``, outside every sum): a reduction kernel picks
its order from the shape and a row's alignment (PyTorch's CPU reductions split a lone row over
threads, its CUDA ones vectorize a row from its first aligned element), so each row then sees
the same order in any batch and at any position. Elementwise ops round each element alone."""

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


#: Columns of the batch-invariant blocks are a multiple of this (256 B rows in fp32).
INVARIANT_ALIGN = 64

#: Elements of one batch-invariant block at most (64 MiB in fp32), and its rows at most.
INVARIANT_ELEMENTS = 1 << 24
INVARIANT_MAX_ROWS = 256


def padded_width(v: int) -> int:
    """``v`` columns rounded up to ``INVARIANT_ALIGN``."""
    return -(-v // INVARIANT_ALIGN) * INVARIANT_ALIGN


def invariant_rows(width: int) -> int:
    """Rows of a batch-invariant block ``width`` columns wide: from the width only."""
    return max(2, min(INVARIANT_MAX_ROWS, INVARIANT_ELEMENTS // max(1, width)))


def padded_stats(z, t_local, inv_t, valid: int, col_start: int, scale: float, softcap):
    """The ``(5, rows)`` statistics of a block ``z`` of raw logits whose columns at or past
    ``valid`` are padding (left out: ``-inf`` after the transform); ``t_local`` the targets'
    columns in the block, ``inv_t`` ``(1, 1)`` or ``(rows, 1)``. Every reduction runs over all
    of ``z``'s columns."""
    x, _ = transform(z, inv_t, scale, softcap)
    cols = torch.arange(z.shape[1], device=z.device)
    x = torch.where(cols[None, :] < valid, x, torch.full((), float("-inf"), dtype=x.dtype,
                                                          device=x.device))
    m = x.amax(dim=1)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    d = x - m_safe[:, None]
    p = torch.exp(d)
    w = torch.where(p > 0, p * d, torch.zeros_like(p)).sum(dim=1)
    s = p.sum(dim=1)
    in_block = (t_local >= 0) & (t_local < valid)
    idx = torch.where(in_block, t_local, torch.zeros_like(t_local))
    x_t = torch.where(in_block, x.gather(1, idx[:, None])[:, 0], torch.zeros_like(m))
    best = torch.argmax(torch.nan_to_num(x, nan=float("-inf")), dim=1) + col_start
    return torch.stack([m, s, w, x_t, best.to(x.dtype)])


def _invariant_stats(view, target, inv_t, col_start: int, valid: int, scale: float, softcap,
                     out):
    """``stats`` in blocks of one shape (the module doc): each block's rows gathered into a
    ``(invariant_rows, padded_width)`` buffer, the last one's missing rows zeros."""
    x3 = view.as3d()
    d1 = x3.shape[1]
    n = target.numel()
    dtype = torch.float64 if x3.dtype == torch.float64 else torch.float32
    width = padded_width(valid)
    rows = invariant_rows(width)
    dev = x3.device
    t = target.long()
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        idx = torch.arange(lo, hi, device=dev)
        z = torch.zeros((rows, width), dtype=dtype, device=dev)
        z[:hi - lo, :valid] = x3[idx // d1, idx % d1][:, :valid]
        t_local = torch.full((rows,), -1, dtype=torch.long, device=dev)
        t_local[:hi - lo] = t[lo:hi] - col_start
        inv = inv_t.to(dtype)
        if inv.numel() == 1:
            inv = inv.reshape(1, 1)
        else:
            inv = torch.ones((rows, 1), dtype=dtype, device=dev)
            inv[:hi - lo, 0] = inv_t[lo:hi].to(dtype)
        part = padded_stats(z, t_local, inv, valid, col_start, scale, softcap)
        out[:, lo:hi] = part[:, :hi - lo].to(out.dtype)


def stats(view, target, inv_t, col_start: int, valid: int, scale: float, softcap, out,
          invariant: bool = False):
    """Write the ``(5, N)`` statistics of ``view``'s rows into ``out``; ``invariant``: each
    row's the same bits in any batch (the module doc)."""
    if valid == 0:  # a shard of padding only: the merge's neutral element, as the kernel writes
        out[0] = float("-inf")
        out[1:4] = 0.0
        out[4] = col_start
        return
    if invariant:
        return _invariant_stats(view, target, inv_t, col_start, valid, scale, softcap, out)
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
