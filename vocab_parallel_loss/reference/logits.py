"""Pure-PyTorch implementation with the kernels' exact semantics.

Used for CPU tensors when ``TRITON_INTERPRET`` is not set and wherever Triton is missing. The
functions mirror ``forward``, ``merge``, ``reduce`` and ``backward`` of ``kernels/logits.py``
(same arguments, same outputs), so the autograd layer does not care which one runs; the fused
path of reduced losses (``forward_grad``) is the Triton backend's only, an optimisation of the
same result. Rows are processed in chunks so that at most ``_CHUNK_ELEMENTS`` fp32 logits exist
at a time. Float64 logits run here whatever the device (``backends.logits_backend``), computed in
float64.
"""

from __future__ import annotations

import torch

from ..formulas import compute_dtype, lse_low, merge_stats, reduce_loss, token_loss

#: Backend capabilities (``backends.LogitsBackend``)
NAME = "torch"
FORMS_REDUCED_GRADIENT = False


_CHUNK_ELEMENTS = 1 << 24


def row_blocks(view):
    """Yield ``(lo, hi, block)``: rows ``lo:hi`` as a ``(D0', D1', V)`` view of the logits.

    Whole ``D0`` slices are taken at a time (or runs of rows when ``D0 == 1``), so every block
    is a strided view of the caller's tensor, also for in-place writes.
    """
    x3 = view.as3d()
    d0, d1, v = x3.shape
    if d0 == 1:
        step = max(1, _CHUNK_ELEMENTS // max(1, v))
        for lo in range(0, d1, step):
            hi = min(d1, lo + step)
            yield lo, hi, x3[:, lo:hi]
    else:
        step = max(1, _CHUNK_ELEMENTS // max(1, v * d1))
        for lo in range(0, d0, step):
            hi = min(d0, lo + step)
            yield lo * d1, hi * d1, x3[lo:hi]


def _loss_and_lse(t, m, s, x_t, d, opts):
    """The loss and the ``(2, rows)`` lse with its low part (``formulas.lse_low``)."""
    _, vocab_size, ignore_index, smoothing, z_loss = opts
    loss, lse, _, bad = token_loss(t, m, s, x_t, d, vocab_size, ignore_index, smoothing, z_loss)
    low = lse_low(m, s, lse)
    return loss, torch.stack([torch.where(bad, torch.full_like(lse, float("nan")), lse), low])


def _local_stats(rows, t, vocab_start, smoothing):
    x = rows.to(compute_dtype(rows.dtype))
    m = x.amax(dim=-1)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    diff = x - m_safe[:, None]
    s = torch.exp(diff).sum(dim=-1)
    m = torch.where(torch.isnan(s), s, m)
    t_local = t - vocab_start
    in_shard = (t_local >= 0) & (t_local < x.shape[-1])
    idx = torch.where(in_shard, t_local, torch.zeros_like(t_local))
    x_t = torch.where(in_shard, x.gather(1, idx[:, None])[:, 0], torch.zeros_like(m))
    # sum (x - m): the formulas' form (no overflow, exact differences)
    d = diff.sum(dim=-1) if smoothing > 0 else torch.zeros_like(m)
    return m, s, x_t, d


def forward(view, target, opts, stats=None, loss=None, lse=None, memo=None):
    """Same contract as ``kernels.logits.forward``: ``lse`` is ``(2, N)``, the lse and its
    low part (``formulas.lse_low``)."""
    vocab_start, vocab_size, ignore_index, smoothing, z_loss = opts
    t = target.long()
    n = t.numel()
    if stats is not None:  # the flat send buffer: (4, N) statistics, then this shard's width
        stats[4 * n] = view.vocab
        stats = stats[:4 * n].view(4, n)
    for lo, hi, block in row_blocks(view):
        rows = block.reshape(-1, block.shape[-1])
        m, s, x_t, d = _local_stats(rows, t[lo:hi], vocab_start, smoothing)
        if stats is None:
            l, e = _loss_and_lse(t[lo:hi], m, s, x_t, d, opts)
            loss[lo:hi], lse[:, lo:hi] = l, e
        else:
            stats[:, lo:hi] = torch.stack([m, s, x_t, d])


def merge(gathered, target, loss, lse, opts):
    """Same contract as ``kernels.logits.merge``: ``gathered`` holds every rank's flat send
    buffer; shards of unequal width give NaN; ``lse`` is ``(2, N)`` (``forward``)."""
    world, n = gathered.shape[0], target.numel()
    v_part = opts.vocab_size // world
    m, s, x_t, d = merge_stats(gathered[:, :4 * n].view(world, 4, n), v_part)
    unequal = (gathered[:, 4 * n] != v_part).any()
    m = torch.where(unequal, torch.full_like(m, float("nan")), m)
    l, e = _loss_and_lse(target.long(), m, s, x_t, d, opts)
    loss.copy_(l)
    lse.copy_(e)


def reduce(loss, target, ignore_index, mean, memo=None):
    """Same contract as the Triton backend's ``reduce``."""
    return reduce_loss(loss, target, ignore_index, mean)


def backward(view, dview, target, lse, dloss, count, opts, memo=None):
    """Same contract as ``kernels.logits.backward``."""
    vocab_start, vocab_size, ignore_index, smoothing, z_loss = opts
    n, v = target.numel(), view.vocab
    t = target.long()
    acc = lse.dtype  # fp32, or fp64 for float64 logits
    g = dloss.to(acc).expand(n) if dloss.dim() == 0 else dloss.to(acc)
    if count is not None:
        g = g / count.clamp(min=1).to(acc)
    valid = t != ignore_index
    g = torch.where(valid, g, torch.zeros_like(g))
    lse, low = (torch.where(valid, r, torch.zeros_like(r)) for r in lse)
    cols = torch.arange(v, device=lse.device)
    dblocks = row_blocks(dview)
    for lo, hi, block in row_blocks(view):
        dblock = next(dblocks)[2]
        x = block.reshape(-1, v).to(acc)
        gc, lc = g[lo:hi, None], lse[lo:hi, None]
        coef = gc * (1.0 + 2.0 * z_loss * lc) if z_loss != 0 else gc
        # softmax_j = exp((x_j - lse) - low): x - lse is exact near the max, and the low part
        # (what the rounded lse lost) is taken into the row's coefficient
        dx = (coef * torch.exp(-low[lo:hi, None])) * torch.exp(x - lc)
        onehot = cols[None, :] == (t[lo:hi, None] - vocab_start)
        dx = dx - torch.where(onehot, gc * (1.0 - smoothing), torch.zeros_like(dx))
        if smoothing > 0:
            dx = dx - gc * (smoothing / vocab_size)
        dx = torch.where(valid[lo:hi, None], dx, torch.zeros_like(dx))
        dblock.copy_(dx.view(dblock.shape))
