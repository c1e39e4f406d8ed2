"""The grad-in-forward strategy of the fused linear loss (``LCEConfig.strategy``): for a
scalar loss, chunks of ``gif_rows`` rows get fp32 logits over the whole local vocabulary
(``chunk_logits``, one GEMM), a row kernel reduces them to statistics (``rows_stats``) and,
once the caller has merged those across the TP group, another overwrites them with ``dz``
(``rows_dz_inplace``). The row kernels are memory-bound: one program per row, ``row_block``
columns a step. The autograd layer (``autograd/linear.py``) drives the chunks.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..launch import PINNED  # compile options every launch pins (FMA contraction)
from .common import tanh
from .config import LCEConfig
from .gemm import gemm_store


@triton.jit
def _rows_stats_kernel(
    X, BIAS, TGT, STATS, N, V, stride_xn, stride_t, stride_s, v_offset, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUMX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Statistics of one row of materialized fp32 logits ``X (rows, V)``."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TGT + row * stride_t).to(tl.int64) - v_offset
    t_local = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)
    m_vec = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s_vec = tl.zeros((BLOCK,), dtype=tl.float32)
    tg_vec = tl.zeros((BLOCK,), dtype=tl.float32)
    sx_vec = tl.zeros((BLOCK,), dtype=tl.float32)
    x_row = X + row * stride_xn
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            x += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x = softcap * tanh(x / softcap)
        xm = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m_vec, xm)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - m_safe) + tl.exp(xm - m_safe)
        m_vec = m_new
        tg_vec += tl.where(cols == t_local, x, 0.0)
        if NEED_SUMX:
            sx_vec += tl.where(mask, x, 0.0)
    m = tl.max(m_vec, axis=0)
    s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
    tl.store(STATS + row, m)
    tl.store(STATS + stride_s + row, s)
    tl.store(STATS + 2 * stride_s + row, tl.sum(tg_vec, axis=0))
    tl.store(STATS + 3 * stride_s + row, tl.sum(sx_vec, axis=0))


@triton.jit
def _rows_dz_kernel(
    X, BIAS, TGT, COEF, D, N, V, stride_xn, stride_dn, stride_t, v_offset, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    """``dz`` of one row from the materialized logits, written to ``D``.

    ``D`` may alias ``X`` (bf16 written over the fp32 row, front to back): block ``k`` writes
    bytes below every later block's reads; only block 0 overlaps its own reads, hence the
    barrier between the loads and the stores of each block.
    """
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(COEF + row)
    gp = tl.load(COEF + N + row)
    gt = tl.load(COEF + 2 * N + row)
    gc = tl.load(COEF + 3 * N + row)
    t = tl.load(TGT + row * stride_t).to(tl.int64) - v_offset
    t_local = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)
    x_row = X + row * stride_xn
    d_row = D + row * stride_dn
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(x_row + cols, mask=mask, other=0.0)
        tl.debug_barrier()
        if HAS_BIAS:
            z += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            th = tanh(z / softcap)
            x = softcap * th
        else:
            x = z
        dx = gp * tl.exp(x - lse) - gc - tl.where(cols == t_local, gt, 0.0)
        if HAS_SOFTCAP:
            dx = dx * (1.0 - th * th)
        tl.store(d_row + cols, dx.to(D.dtype.element_ty), mask=mask)


def gif_chunk_rows(n: int, cfg: LCEConfig) -> int:
    """Rows per chunk of the grad-in-forward path."""
    return max(1, min(n, cfg.gif_rows))


def gif_extra_bytes(n: int, v: int, h: int, cfg: LCEConfig) -> int:
    """Extra memory of the grad-in-forward path: logits chunk + fp32 dC and dE."""
    return gif_chunk_rows(n, cfg) * v * 4 + v * h * 4 + n * h * 4


def chunk_logits(e_rows: torch.Tensor, c: torch.Tensor, out: torch.Tensor,
                 cfg: LCEConfig) -> None:
    """``out (rows, V) fp32 = e_rows @ c.T`` with fp32 accumulation (bias/softcap come later)."""
    gemm_store(out, e_rows, c.t(), cfg)


def rows_stats(x: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
               v_offset: int, softcap: Optional[float], need_sumx: bool,
               cfg: LCEConfig) -> torch.Tensor:
    """``(4, rows)`` statistics (max, sum exp(x - max), target logit, sum of x) of materialized
    fp32 logits ``x (rows, V)`` (+ bias, softcap)."""
    n, v = x.shape
    stats = torch.empty((4, n), dtype=torch.float32, device=x.device)
    assert x.stride(1) == 1
    if n == 0:
        return stats
    _rows_stats_kernel[(n,)](
        x, bias if bias is not None else x, targets, stats, n, v, x.stride(0),
        targets.stride(0), stats.stride(0), v_offset, float(softcap) if softcap else 1.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap), NEED_SUMX=need_sumx,
        BLOCK=cfg.row_block, num_warps=cfg.row_warps, **PINNED)
    return stats


def rows_dz_inplace(x: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                    v_offset: int, coef: torch.Tensor, softcap: Optional[float],
                    dtype: torch.dtype, cfg: LCEConfig) -> torch.Tensor:
    """Overwrite the fp32 logits ``x (rows, V)`` (contiguous rows) with ``dz`` in ``dtype``;
    returns ``dz`` (a ``(rows, V)`` view of ``x``'s memory)."""
    n, v = x.shape
    assert x.stride(1) == 1 and x.dtype == torch.float32
    if dtype == torch.float32:
        d = x
    else:
        ratio = 4 // torch.empty((), dtype=dtype).element_size()
        d = x.view(dtype)[:, :v]
        assert d.stride(0) == x.stride(0) * ratio
    if n == 0:
        return d
    _rows_dz_kernel[(n,)](
        x, bias if bias is not None else x, targets, coef, d, n, v, x.stride(0), d.stride(0),
        targets.stride(0), v_offset, float(softcap) if softcap else 1.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap), BLOCK=cfg.row_block,
        num_warps=cfg.row_warps, **PINNED)
    return d
