"""Triton row kernels of the token log-probabilities and entropy (``autograd/logprobs.py``).

One program per row of a ``(rows, columns)`` block of raw logits ``z`` (a TP shard, or a column
chunk of one in the fused linear path). The logits the statistics see are
``x = cap(scale * z) / T`` with ``cap(y) = softcap * tanh(y / softcap)`` (or ``cap(y) = y``) and a
per-row temperature ``T``. Columns at or past ``valid`` are vocabulary padding: they are skipped in
forward and get a zero gradient.

Forward writes five statistics per row (``formulas.merge_logprob_stats`` merges them over column
ranges and TP ranks): the max ``m``, ``s = sum exp(x - m)``, ``w = sum exp(x - m) (x - m)`` (the
entropy's term, kept relative to ``m`` so a large common offset cancels exactly), the target's
``x`` (0 when the target is not in this block) and the global column of the max (first on ties).

Backward writes ``dz = chain * (g_lp [j == t] - p_j (g_lp + g_ent (x_j - lse + H)))`` from the
saved ``lse`` (with its low part, ``formulas.lse_low``) and entropy ``H``, where ``chain`` is
``d x / d z``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch


#: Backend capabilities (``backends.RowsBackend``)
NAME = "triton"
TRACEABLE = False


@triton.jit
def _row_start(row, D1, s0, s1):
    r = row.to(tl.int64)
    return (r // D1) * s0 + (r % D1) * s1


@triton.jit
def _transform(z, inv_t, scale, softcap, HAS_CAP: tl.constexpr):
    """``x = cap(scale z) / T`` and ``dx/dz``."""
    y = z * scale
    # one return per branch: the compiler checks every return of a static if against the others
    if HAS_CAP:
        th = 2.0 / (1.0 + tl.exp(-2.0 * (y / softcap))) - 1.0  # tanh, stable for large |y|
        x, chain = softcap * th * inv_t, (1.0 - th * th) * scale * inv_t
    else:
        x, chain = y * inv_t, tl.broadcast_to(scale * inv_t, y.shape)
    return x, chain


@triton.jit
def _logprob_stats_kernel(z_ptr, tgt_ptr, inv_t_ptr, stats_ptr, N, valid, D1, s0, s1,
                          tgt_stride, inv_t_stride, col_start, scale, softcap,
                          HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + _row_start(row, D1, s0, s1)
    t_local = tl.load(tgt_ptr + row.to(tl.int64) * tgt_stride).to(tl.int64) - col_start
    inv_t = tl.load(inv_t_ptr + row.to(tl.int64) * inv_t_stride).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    w = tl.full([], 0.0, tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_col = tl.full([], 0, tl.int32)
    for start in range(0, valid, BLOCK):
        cols = start + offs
        mask = cols < valid
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        x, _ = _transform(z, inv_t, scale, softcap, HAS_CAP)
        x = tl.where(mask, x, float("-inf"))
        b_max = tl.max(x, 0)
        # first column holding the block's max; a later block replaces only a strictly larger max
        b_col = tl.min(tl.where(x == b_max, cols, valid), 0)
        take = b_max > best
        best_col = tl.where(take, b_col, best_col)
        best = tl.where(take, b_max, best)
        m_new = tl.maximum(m, b_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        # rescale the running terms to the new max: w is relative to m, so shift it too
        shift = tl.where(s > 0.0, (m - m_safe) * s, 0.0)
        d = tl.where(mask, x - m_safe, 0.0)
        p = tl.where(mask, tl.exp(d), 0.0)
        # p = 0 where x = -inf (masked vocabulary): its term is 0, not 0 * -inf
        w = alpha * (w + shift) + tl.sum(tl.where(p > 0.0, p * d, 0.0), 0)
        s = alpha * s + tl.sum(p, 0)
        m = m_new
    in_block = (t_local >= 0) & (t_local < valid)
    z_t = tl.load(z_row + tl.where(in_block, t_local, 0), mask=in_block, other=0.0).to(tl.float32)
    x_t, _ = _transform(z_t, inv_t, scale, softcap, HAS_CAP)
    x_t = tl.where(in_block, x_t, 0.0)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + N + row, s)
    tl.store(stats_ptr + 2 * N + row, w)
    tl.store(stats_ptr + 3 * N + row, x_t)
    tl.store(stats_ptr + 4 * N + row, (best_col + col_start).to(tl.float32))


@triton.jit
def _logprob_backward_kernel(z_ptr, dz_ptr, tgt_ptr, inv_t_ptr, lse_ptr, ent_ptr, glp_ptr,
                             gent_ptr, N, valid, V, D1, s0, s1, gD1, gs0, gs1, tgt_stride,
                             inv_t_stride, col_start, scale, softcap, HAS_CAP: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    z_row = z_ptr + _row_start(row, D1, s0, s1)
    dz_row = dz_ptr + _row_start(row, gD1, gs0, gs1)
    t_local = tl.load(tgt_ptr + r64 * tgt_stride).to(tl.int64) - col_start
    inv_t = tl.load(inv_t_ptr + r64 * inv_t_stride).to(tl.float32)
    lse = tl.load(lse_ptr + r64)  # (2, N): the lse, then its low part
    low = tl.load(lse_ptr + N + r64)
    ent = tl.load(ent_ptr + r64)
    g_lp = tl.load(glp_ptr + r64)
    g_ent = tl.load(gent_ptr + r64)
    live = (g_lp != 0.0) | (g_ent != 0.0)
    # p_j = exp(d_j - low) and x_j - (lse + low) = d_j - low with d_j = x_j - lse, exact near
    # the max (the rounded lse would be off by half an ulp of a large offset): the low part
    # goes into the row's coefficients, dx = g_lp [j == t] - exp(d_j) (a + b d_j)
    c = tl.exp(-low)
    a = c * (g_lp + g_ent * (ent - low))
    b = c * g_ent
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        in_row = cols < V
        mask = cols < valid
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        x, chain = _transform(z, inv_t, scale, softcap, HAS_CAP)
        # a masked (-inf) logit has p = 0 and must add 0, not 0 * -inf: below -1e4 exp is 0
        # in fp32, so the clamp changes no p; NaN still propagates
        d = tl.maximum(x - lse, -1.0e4, propagate_nan=tl.PropagateNan.ALL)
        dx = tl.where(cols == t_local, g_lp, 0.0) - tl.exp(d) * (a + b * d)
        # g_lp = g_ent = 0 (an ignored token) gives exact zeros, whatever p is
        dz = tl.where(mask, tl.where(live, dx * chain, 0.0), 0.0)
        tl.store(dz_row + cols, dz.to(dz_ptr.dtype.element_ty), mask=in_row)


def _block(v: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(max(1, v))))


def _scalar_or_rows(temperature_inv: torch.Tensor):
    return temperature_inv, (0 if temperature_inv.numel() == 1 else temperature_inv.stride(0))


def stats(view, target, inv_t, col_start: int, valid: int, scale: float, softcap, out,
          invariant: bool = False):
    """Write ``(5, N)`` statistics of the RowView ``view`` into ``out`` (see the module doc).
    Batch-invariant as they are: a row is one program whose blocks and warps depend on
    ``valid`` only, so ``invariant`` changes nothing."""
    n = target.numel()
    if n == 0:
        return
    inv_t, inv_stride = _scalar_or_rows(inv_t)
    launch(_logprob_stats_kernel, (n,), view.tensor, target, inv_t, out, n, valid, view.D1,
           view.s0, view.s1, target.stride(0), inv_stride, col_start, float(scale),
           float(softcap or 1.0), HAS_CAP=softcap is not None, BLOCK=_block(valid),
           num_warps=4 if valid <= 4096 else 8)


def backward(view, dview, target, inv_t, lse, ent, g_lp, g_ent, col_start: int, valid: int,
             scale: float, softcap):
    """Write the gradient of ``sum(g_lp * log_prob + g_ent * entropy)`` w.r.t. the raw logits
    of ``view`` into ``dview`` (which may be ``view`` itself: each element is read before it is
    written, by the same program). ``lse``: contiguous ``(2, N)``, the lse and its low part."""
    n = target.numel()
    if n == 0:
        return
    v = view.vocab
    inv_t, inv_stride = _scalar_or_rows(inv_t)
    launch(_logprob_backward_kernel, (n,), view.tensor, dview.tensor, target, inv_t, lse, ent,
           g_lp, g_ent, n, valid, v, view.D1, view.s0, view.s1, dview.D1, dview.s0, dview.s1,
           target.stride(0), inv_stride, col_start, float(scale), float(softcap or 1.0),
           HAS_CAP=softcap is not None, BLOCK=min(_block(v), 2048),
           num_warps=4 if v <= 4096 else 8)

