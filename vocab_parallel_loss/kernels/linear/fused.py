"""The fused ``tl.dot`` kernels of the linear cross entropy and their host launchers.

Notation: ``e`` is ``(N, H)`` hidden states, ``c`` is ``(V, H)`` this rank's classifier rows
(``V`` = local vocabulary), ``z = e @ c.T (+ bias)`` the raw logits, ``x = softcap * tanh(z /
softcap)`` (or ``x = z``) the logits the loss sees. Every accumulation is fp32 and in a fixed
order (deterministic, no atomics); all row and column offsets are int64.

``_lce_fwd_kernel`` (2NHV flops; ``forward_stats``)
    One program per (row block, vocabulary split). It walks its vocabulary tiles, computes each
    ``BLOCK_N x BLOCK_V`` logits tile with ``tl.dot`` (fp32 accumulator, K loop over H) and
    folds it into online per-row statistics: max ``m``, ``s = sum exp(x - m)``, the target logit
    (0 when the target is not in this split) and the sum of logits (label smoothing). The
    ``(SPLIT, 4, N)`` partial statistics are merged on the host (``formulas.merge_partial_stats``).
    The ``(N, V)`` logits are never stored.

``_lce_dlogits_kernel`` (2 N H Vc flops per vocabulary chunk; ``backward``)
    Recomputes a chunk of ``Vc`` logit columns tile by tile and writes
    ``dz = (gp * softmax - gt * onehot - gc) * dx/dz`` in the input dtype into a ``(N, Vc)``
    buffer, plus per-row-block column sums for the bias gradient (fp32). ``gp, gt, gc`` are
    per-row coefficients prepared by the caller (they carry the upstream gradient, the
    reduction, label smoothing and z-loss), so no loss option is a constexpr. Per chunk,
    ``gemm.py`` then forms ``dE (+)= dz @ c_chunk`` (fp32) and ``dC_chunk = dz.T @ e``.

Backward therefore costs 6NHV on top of the forward's 2NHV (8NHV in all) and keeps extra memory
at ``N * Vc`` elements (the chunk) plus the fp32 ``(N, H)`` dE accumulator, independent of V.
Every ``dC`` row is produced by exactly one GEMM over all N rows: it is rounded once. ``dE`` is
summed over the chunks in fp32 and rounded once by the caller (after the TP all-reduce).

On Hopper (16-bit inputs, 16-byte aligned rows) both kernels can read E and C through TMA
descriptors, whose zero fill past the ends replaces the masks (``LCEConfig.fwd_desc`` /
``bwd_desc``), and run one flat loop over (vocabulary tile, H step) so the next tile's loads
overlap a tile's epilogue (``fwd_flat``); the forward that saves its tiles for backward
(``saved.py``) then stores them through a descriptor as well (asynchronous, clipped at the
ends by the copy engine: 2% faster than stores from registers at N=16384, H=4096).

Log-prob mode (``logprob=LogprobArgs``, the ``LOGPROB`` constexpr; ``ops/linear_token_logprobs``):
the logits are ``cap(scale z) / T`` with one ``1 / T`` per row; the forward folds each tile into
the five log-prob statistics (``_fold_logprob_tile``: ``(SPLIT, 5, N)``, merged by
``formulas.merge_logprob_stats``) and the dlogits kernel adds ``gx * softmax * (x - lse)`` (the
entropy's gradient) from a sixth coefficient row. Without it the kernels compile as before.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import settings
from ...formulas import merge_logprob_stats, merge_partial_stats
from ..launch import PINNED, multiprocessors  # compile options every launch pins (FMA contraction)
from .common import (LOG_UNDERFLOW, LOWEST, LogprobArgs, check_tiles, compute_dtype, dot,
                     SCALED, dot_mode, load_scales, parts_dot, tanh, unscale, upcast)
from .config import LCEConfig, default_config
from .gemm import gemm_acc, gemm_store
from .parts import fp16_parts
from .scales import split_scales

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


@triton.jit
def _grouped_tile(pid, num_rb, n_inner, GROUP_N: tl.constexpr):
    """(row block, inner index) of program ``pid`` in grouped order: consecutive programs cover
    GROUP_N row blocks x the ``n_inner`` vocabulary tiles or splits, so the programs in flight
    share E row blocks and C tiles through L2."""
    width = GROUP_N * n_inner
    first_rb = (pid // width) * GROUP_N
    gsize = tl.minimum(num_rb - first_rb, GROUP_N)
    return first_rb + (pid % width) % gsize, (pid % width) // gsize


@triton.jit
def _desc_dot_step(E, C, row0, col0, h0, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc += E[row0:, h0:] @ C[col0:, h0:].T`` for one H step, through TMA descriptors."""
    # (16-bit operands only: no split scales)
    return dot(E.load([row0, h0]), tl.trans(C.load([col0, h0])), acc, DOT_PREC, UPCAST, 1.0, 1.0)


@triton.jit
def _parts_dot_step(E, E_LO, C, C_LO, row0, col0, h0, acc, LO_E: tl.constexpr,
                    LO_C: tl.constexpr, UPCAST: tl.constexpr):
    """``_desc_dot_step`` of an fp32 head's split products, from the operands' fp16 parts
    (``parts.py``): E / C the ``hi`` parts, E_LO / C_LO the ``lo`` parts where ``LO_E`` /
    ``LO_C`` (else unread)."""
    e = E.load([row0, h0])
    c = tl.trans(C.load([col0, h0]))
    e_lo = e
    c_lo = c
    if LO_E:
        e_lo = E_LO.load([row0, h0])
    if LO_C:
        c_lo = tl.trans(C_LO.load([col0, h0]))
    return parts_dot(e, e_lo, c, c_lo, acc, LO_E, LO_C, UPCAST)


@triton.jit
def _logits_tile(E, C, SE, SC, rows_ld, cols_ld, row0, col0, H, stride_en, stride_eh,
                 stride_cv, stride_ch, EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr, DESC: tl.constexpr):
    """fp32 ``E[rows] @ C[cols].T``; ``rows_ld`` / ``cols_ld`` are in range (callers wrap them).
    ``SE`` / ``SC``: the rows' split scales (``scales.split_scales``) in the modes that scale.

    With ``DESC`` E and C are TMA tensor descriptors of ``[BLOCK_N | BLOCK_V, BLOCK_H]`` blocks
    and the tile starts at ``(row0, col0)``: the copy engine fills rows, columns and H past the
    end with zeros, so no masks and no per-element addresses (``rows_ld`` etc. are unused).
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if DESC:
        for h0 in range(0, H, BLOCK_H):
            acc = _desc_dot_step(E, C, row0, col0, h0, acc, DOT_PREC, UPCAST)
    else:  # (an else, not an early return: Triton compiles what follows a return in a branch)
        se, re = load_scales(SE, rows_ld, DOT_PREC)
        sc, rc = load_scales(SC, cols_ld, DOT_PREC)
        offs_h = tl.arange(0, BLOCK_H)
        e_ptrs = (E + rows_ld.to(tl.int64)[:, None] * stride_en
                  + offs_h[None, :].to(tl.int64) * stride_eh)
        c_ptrs = (C + cols_ld.to(tl.int64)[None, :] * stride_cv
                  + offs_h[:, None].to(tl.int64) * stride_ch)
        for h0 in range(0, H, BLOCK_H):
            if EVEN_H:
                a = tl.load(e_ptrs)
                b = tl.load(c_ptrs)
            else:
                hm = (h0 + offs_h) < H
                a = tl.load(e_ptrs, mask=hm[None, :], other=0.0)
                b = tl.load(c_ptrs, mask=hm[:, None], other=0.0)
            acc = dot(a, b, acc, DOT_PREC, UPCAST, se, sc)
            e_ptrs += BLOCK_H * stride_eh
            c_ptrs += BLOCK_H * stride_ch
        acc = unscale(acc, re, rc, DOT_PREC)
    return acc


@triton.jit
def _tile_logits(x, vt, V, BIAS, stride_b, softcap, t_local, tg, sx, HAS_BIAS: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, NEED_SUMX: tl.constexpr, BLOCK_V: tl.constexpr):
    """The logits the loss sees of the fp32 tile ``x`` of vocabulary tile ``vt`` (bias,
    softcap; -inf past V), with the target logit and the sum of logits folded in."""
    cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    if HAS_BIAS:
        b = tl.load(BIAS + tl.where(col_mask, cols, 0).to(tl.int64) * stride_b).to(tl.float32)
        x += b[None, :]
    if HAS_SOFTCAP:
        x = softcap * tanh(x / softcap)
    # one live tile at a time (128x256 fp32 is half the register file): reuse x in place
    # and let every other tile be a temporary consumed by its reduction
    tg += tl.sum(tl.where(cols[None, :] == t_local[:, None], x, 0.0), axis=1)
    if NEED_SUMX:
        sx += tl.sum(tl.where(col_mask[None, :], x, 0.0), axis=1)
    return tl.where(col_mask[None, :], x, float("-inf")), tg, sx


@triton.jit
def _fold_tile(x, vt, V, BIAS, stride_b, softcap, t_local, m, s, tg, sx, HAS_BIAS: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, NEED_SUMX: tl.constexpr, BLOCK_V: tl.constexpr):
    """Fold the fp32 logits tile ``x`` of vocabulary tile ``vt`` into the online statistics."""
    x, tg, sx = _tile_logits(x, vt, V, BIAS, stride_b, softcap, t_local, tg, sx, HAS_BIAS,
                             HAS_SOFTCAP, NEED_SUMX, BLOCK_V)
    m_new = tl.maximum(m, tl.max(x, axis=1))  # finite: m starts at LOWEST (_lce_fwd_kernel)
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
    return m_new, s, tg, sx


@triton.jit
def _fold_store_tile(x, rb, vt, N, V, BIAS, stride_b, softcap, t_local, m, s, tg, sx, U, MT,
                     stride_un, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                     NEED_SUMX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                     DESC_U: tl.constexpr,
                     WRITE: tl.constexpr = True):
    """``_fold_tile`` that also saves the tile for backward: ``u = exp(x - mt)`` in U's dtype
    (in (0, 1], so bf16 keeps 8 bits of every probability) and the tile's row max ``mt`` in
    ``MT[vt, rows]``; the statistics are folded from the fp32 values. Without ``WRITE`` nothing
    is saved: the same statistics, rounded as when the tile is saved (``SAVED_FOLD``)."""
    x, tg, sx = _tile_logits(x, vt, V, BIAS, stride_b, softcap, t_local, tg, sx, HAS_BIAS,
                             HAS_SOFTCAP, NEED_SUMX, BLOCK_V)
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    mt = tl.max(x, axis=1)
    # a tile row of -inf logits (masked columns): u = 0 and a finite max, so that backward's
    # u * exp(mt - lse) is 0 and mt + log u finite
    mts = tl.where(mt == float("-inf"), LOWEST, mt)
    u = tl.exp(x - mts[:, None])
    if WRITE:
        if DESC_U:  # the copy engine stores the tile asynchronously and clips it at (N, V)
            U.store([rb * BLOCK_N, vt * BLOCK_V], u.to(U.dtype))
        else:
            cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
            u_ptrs = U + rows.to(tl.int64)[:, None] * stride_un + cols[None, :].to(tl.int64)
            tl.store(u_ptrs, u.to(U.dtype.element_ty),
                     mask=row_mask[:, None] & (cols < V)[None, :])
        tl.store(MT + tl.cast(vt, tl.int64) * N + rows, mts, mask=row_mask)
    m_new = tl.maximum(m, mts)
    s = s * tl.exp(m - m_new) + tl.sum(u, axis=1) * tl.exp(mts - m_new)
    return m_new, s, tg, sx


@triton.jit
def _fold_logprob_tile(x, rb, vt, N, V, BIAS, stride_b, softcap, scale, inv_t, t_local, m, s, w, tg,
                       best_col, U, MT, stride_un, HAS_BIAS: tl.constexpr,
                       HAS_SOFTCAP: tl.constexpr, NEED_ARGMAX: tl.constexpr, STORE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, DESC_U: tl.constexpr):
    """Fold the fp32 tile ``z`` (``x`` here) into the log-prob statistics of
    ``x = cap(scale z) / T``: max ``m``, ``s = sum exp(x - m)``, the entropy's
    ``w = sum exp(x - m) (x - m)`` (relative to ``m``: a common offset cancels exactly), the
    target's ``x`` and the first column of the max. With ``STORE`` the tile is also saved as
    ``u = exp(x - mt)`` with its row max ``mt``, as ``_fold_store_tile`` does."""
    cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    if HAS_BIAS:
        b = tl.load(BIAS + tl.where(col_mask, cols, 0).to(tl.int64) * stride_b).to(tl.float32)
        x += b[None, :]
    x = x * scale
    if HAS_SOFTCAP:
        x = softcap * tanh(x / softcap)
    x = x * inv_t[:, None]
    tg += tl.sum(tl.where(cols[None, :] == t_local[:, None], x, 0.0), axis=1)
    x = tl.where(col_mask[None, :], x, float("-inf"))
    mt = tl.max(x, axis=1)
    mts = tl.where(mt == float("-inf"), LOWEST, mt)  # as in _fold_store_tile
    d = x - mts[:, None]
    u = tl.exp(d)
    st = tl.sum(u, axis=1)
    # u * d is 0 * -inf at a -inf logit (past V, or a masked column): clamped to 0 * finite
    wt = tl.sum(u * tl.maximum(d, LOWEST), axis=1)
    if NEED_ARGMAX:  # a later tile takes over only with a strictly larger max: first on ties
        first = tl.min(tl.where(x == mt[:, None], cols[None, :], V), axis=1)
        best_col = tl.where(mt > m, first, best_col)
    if STORE:
        rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        if DESC_U:
            U.store([rb * BLOCK_N, vt * BLOCK_V], u.to(U.dtype))
        else:
            u_ptrs = U + rows.to(tl.int64)[:, None] * stride_un + cols[None, :].to(tl.int64)
            tl.store(u_ptrs, u.to(U.dtype.element_ty),
                     mask=(rows < N)[:, None] & col_mask[None, :])
        tl.store(MT + tl.cast(vt, tl.int64) * N + rows, mts, mask=rows < N)
    m_new = tl.maximum(m, mts)
    a = tl.exp(m - m_new)
    b = tl.exp(mts - m_new)
    # both terms moved to the new max, each only once it holds a column (else its max may be
    # LOWEST, whose distance to the new one rounds to -inf past 1e31: times 0, NaN)
    w = (a * (w + tl.where(s > 0.0, m - m_new, 0.0) * s)
         + b * (wt + tl.where(st > 0.0, mts - m_new, 0.0) * st))
    s = a * s + b * st
    return m_new, s, w, tg, best_col


@triton.jit
def _fold(x, rb, vt, N, V, BIAS, stride_b, softcap, scale, inv_t, t_local, m, s, tg, sx,
          best_col, U, MT, stride_un, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
          NEED_SUMX: tl.constexpr, LOGPROB: tl.constexpr, NEED_ARGMAX: tl.constexpr,
          STORE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, DESC_U: tl.constexpr,
          SAVED_FOLD: tl.constexpr = False):
    """One tile into the running statistics: the loss's (``sx``: sum of logits) or, with
    ``LOGPROB``, the log-prob's (``sx``: the entropy's ``w``). ``SAVED_FOLD``: the loss folds
    every tile as the saved-tiles forward does, saved or not, so that its statistics are the
    same bits under every strategy (the log-prob fold is one arithmetic with or without
    ``STORE`` already)."""
    if LOGPROB:
        m, s, sx, tg, best_col = _fold_logprob_tile(
            x, rb, vt, N, V, BIAS, stride_b, softcap, scale, inv_t, t_local, m, s, sx, tg,
            best_col, U, MT, stride_un, HAS_BIAS, HAS_SOFTCAP, NEED_ARGMAX, STORE, BLOCK_N,
            BLOCK_V, DESC_U)
    elif STORE or SAVED_FOLD:
        m, s, tg, sx = _fold_store_tile(x, rb, vt, N, V, BIAS, stride_b, softcap, t_local, m,
                                        s, tg, sx, U, MT, stride_un, HAS_BIAS, HAS_SOFTCAP,
                                        NEED_SUMX, BLOCK_N, BLOCK_V, DESC_U, STORE)
    else:
        m, s, tg, sx = _fold_tile(x, vt, V, BIAS, stride_b, softcap, t_local, m, s, tg, sx,
                                  HAS_BIAS, HAS_SOFTCAP, NEED_SUMX, BLOCK_V)
    return m, s, tg, sx, best_col


@triton.jit
def _lce_fwd_kernel(
    E, C, E_LO, C_LO, SE, SC, BIAS, TGT, STATS, U, MT, INV_T,
    N, V, H,
    stride_en, stride_eh, stride_cv, stride_ch, stride_t, stride_un, stride_it, stride_b,
    v_offset, softcap, scale, tiles_per_split, n_splits, split0, c_first, n_rb, rb0,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUMX: tl.constexpr,
    EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, DESC: tl.constexpr,
    FLAT: tl.constexpr, STORE: tl.constexpr, DESC_U: tl.constexpr, LOGPROB: tl.constexpr,
    NEED_ARGMAX: tl.constexpr, SAVED_FOLD: tl.constexpr = False, PARTS: tl.constexpr = False,
    LO_E: tl.constexpr = False, LO_C: tl.constexpr = False,
):
    """Nested loops (vocabulary tiles, then H), or with ``FLAT`` (``DESC`` only) one loop over
    (tile, H step) that folds a tile into the statistics after its last step, so that the
    software pipeline keeps loading the next tile's operands during that epilogue. With
    ``STORE`` every tile is also saved for backward (``_fold_store_tile``). With ``LOGPROB``
    the statistics are the log-prob's five (``_fold_logprob_tile``) of ``cap(scale z) / T``,
    ``1 / T`` per row from ``INV_T`` (``stride_it`` 0 for one temperature). ``SAVED_FOLD``
    (batch-invariant statistics): the loss's tiles folded as ``STORE`` folds them, saved or
    not (``_fold``).

    ``PARTS`` (with ``FLAT``): an fp32 head's operands as fp16 parts split in memory
    (``parts.py``) through descriptors, E / C the ``hi`` parts and E_LO / C_LO the ``lo`` parts
    (``LO_E`` / ``LO_C``), C's rows from local column ``c_first`` on and E's from row block
    ``rb0`` on; each tile is unscaled by its rows' split scales SE / SC after its last H step.
    A launch runs the ``n_rb`` row blocks from ``rb0`` on times the ``n_splits`` splits from
    ``split0`` on (the rows and columns whose parts E and C hold)."""
    rb, split = _grouped_tile(tl.program_id(0), n_rb, n_splits, GROUP_N)
    rb += rb0
    split += split0

    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows_ld = tl.where(row_mask, rows, 0)
    t = tl.load(TGT + rows_ld.to(tl.int64) * stride_t).to(tl.int64) - v_offset
    t_local = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)

    # the running max starts finite, so that no fold subtracts -inf from -inf (a tile of
    # masked columns, logits of -inf, first in its split): it stays finite, their exp is 0
    m = tl.full((BLOCK_N,), LOWEST, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tg = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sx = tl.zeros((BLOCK_N,), dtype=tl.float32)
    best_col = tl.zeros((BLOCK_N,), dtype=tl.int32)
    inv_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if LOGPROB:
        inv_t = tl.load(INV_T + rows_ld.to(tl.int64) * stride_it).to(tl.float32)
    num_vt = tl.cdiv(V, BLOCK_V)
    t_begin = split * tiles_per_split
    t_end = tl.minimum(num_vt, t_begin + tiles_per_split)
    if FLAT:
        num_k = tl.cdiv(H, BLOCK_H)
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        if PARTS:
            _, re = load_scales(SE, rows_ld, DOT_PREC)
        for it in range(0, (t_end - t_begin) * num_k):
            vt = t_begin + it // num_k
            kk = it - (vt - t_begin) * num_k
            if PARTS:
                acc = _parts_dot_step(E, E_LO, C, C_LO, (rb - rb0) * BLOCK_N,
                                      vt * BLOCK_V - c_first, kk * BLOCK_H, acc, LO_E, LO_C,
                                      UPCAST)
            else:
                acc = _desc_dot_step(E, C, rb * BLOCK_N, vt * BLOCK_V, kk * BLOCK_H, acc,
                                     DOT_PREC, UPCAST)
            if kk == num_k - 1:
                if PARTS:
                    cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
                    _, rc = load_scales(SC, tl.where(cols < V, cols, 0), DOT_PREC)
                    acc = unscale(acc, re, rc, DOT_PREC)
                m, s, tg, sx, best_col = _fold(
                    acc, rb, vt, N, V, BIAS, stride_b, softcap, scale, inv_t, t_local, m, s,
                    tg, sx, best_col, U, MT, stride_un, HAS_BIAS, HAS_SOFTCAP, NEED_SUMX,
                    LOGPROB, NEED_ARGMAX, STORE, BLOCK_N, BLOCK_V, DESC_U, SAVED_FOLD)
                acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    else:
        for vt in range(t_begin, t_end):
            cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
            cols_ld = tl.where(cols < V, cols, 0)
            x = _logits_tile(E, C, SE, SC, rows_ld, cols_ld, rb * BLOCK_N, vt * BLOCK_V, H,
                             stride_en, stride_eh, stride_cv, stride_ch, EVEN_H, BLOCK_N, BLOCK_V,
                             BLOCK_H, DOT_PREC, UPCAST, DESC)
            m, s, tg, sx, best_col = _fold(
                x, rb, vt, N, V, BIAS, stride_b, softcap, scale, inv_t, t_local, m, s, tg, sx,
                best_col, U, MT, stride_un, HAS_BIAS, HAS_SOFTCAP, NEED_SUMX, LOGPROB,
                NEED_ARGMAX, STORE, BLOCK_N, BLOCK_V, DESC_U, SAVED_FOLD)

    m = tl.where(s == 0.0, float("-inf"), m)  # no finite logit: the merges' max of -inf
    if LOGPROB:  # kernels/logprobs.py's five rows: m, s, w, target x, global column of the max
        base = STATS + split.to(tl.int64) * 5 * N + rows.to(tl.int64)
        tl.store(base, m, mask=row_mask)
        tl.store(base + N, s, mask=row_mask)
        tl.store(base + 2 * N, sx, mask=row_mask)
        tl.store(base + 3 * N, tg, mask=row_mask)
        tl.store(base + 4 * N, (best_col.to(tl.int64) + v_offset).to(tl.float32), mask=row_mask)
    else:
        base = STATS + split.to(tl.int64) * 4 * N + rows.to(tl.int64)
        tl.store(base, m, mask=row_mask)
        tl.store(base + N, s, mask=row_mask)
        tl.store(base + 2 * N, tg, mask=row_mask)
        tl.store(base + 3 * N, sx, mask=row_mask)


@triton.jit
def _dlogits_tile_out(z, rb, cb, BIAS, stride_b, TGT, COEF, D, DB, INV_T, N, V, v_start, n_cols,
                      stride_t, stride_dn, stride_db, stride_it, v_offset, softcap, scale,
                      HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGPROB: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """dz of the fp32 logits tile ``z`` (row block ``rb``, chunk column block ``cb``) into D,
    and its column sums into the bias gradient's per-row-block partials. With ``LOGPROB`` the
    logits are ``cap(scale z) / T`` and the sixth row of COEF, ``gx``, adds
    ``gx * softmax * (x - lse)`` (the entropy's term)."""
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows_ld = tl.where(row_mask, rows, 0)
    ccols = cb * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
    col_mask = ccols < n_cols
    cols = v_start + ccols  # local vocabulary column
    if HAS_BIAS:
        b = tl.load(BIAS + tl.where(col_mask, cols, 0).to(tl.int64) * stride_b).to(tl.float32)
        z += b[None, :]

    r64 = rows_ld.to(tl.int64)
    if LOGPROB:
        z = z * scale
    if HAS_SOFTCAP:
        th = tanh(z / softcap)
        x = softcap * th
    else:
        x = z
    if LOGPROB:
        inv_t = tl.load(INV_T + r64 * stride_it).to(tl.float32)
        x = x * inv_t[:, None]

    lse = tl.load(COEF + r64)
    gp = tl.load(COEF + N + r64)
    gt = tl.load(COEF + 2 * N + r64)
    gc = tl.load(COEF + 3 * N + r64)
    t = tl.load(TGT + r64 * stride_t).to(tl.int64) - v_offset
    t_local = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)
    onehot = cols[None, :] == t_local[:, None]
    if LOGPROB:
        gx = tl.load(COEF + 5 * N + r64)
        # clamped where p underflows anyway: gx * d * p is 0, not NaN, at a -inf logit
        d = tl.maximum(x - lse[:, None], LOG_UNDERFLOW, propagate_nan=tl.PropagateNan.ALL)
        p = tl.exp(d)
        dx = ((gp[:, None] + gx[:, None] * d) * p - gc[:, None]
              - tl.where(onehot, gt[:, None], 0.0))
    else:
        dx = (gp[:, None] * tl.exp(x - lse[:, None]) - gc[:, None]
              - tl.where(onehot, gt[:, None], 0.0))
    if HAS_SOFTCAP:
        dx = dx * (1.0 - th * th)
    if LOGPROB:
        dx = dx * (scale * inv_t)[:, None]
    mask = row_mask[:, None] & col_mask[None, :]
    dx = tl.where(mask, dx, 0.0)
    d_ptrs = D + rows.to(tl.int64)[:, None] * stride_dn + ccols[None, :].to(tl.int64)
    tl.store(d_ptrs, dx.to(D.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(DB + rb.to(tl.int64) * stride_db + ccols.to(tl.int64), tl.sum(dx, axis=0),
                 mask=col_mask)


@triton.jit
def _lce_dlogits_kernel(
    E, C, SE, SC, BIAS, TGT, COEF, D, DB, INV_T,
    N, V, H, v_start, n_cols,
    stride_en, stride_eh, stride_cv, stride_ch, stride_t, stride_dn, stride_db, stride_it,
    stride_b,
    v_offset, softcap, scale,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGPROB: tl.constexpr,
    EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, DESC: tl.constexpr,
    SKIP, GATED: tl.constexpr,
):
    """dz for local columns ``[v_start, v_start + n_cols)`` into ``D[:, :n_cols]``, one program
    per tile. COEF is ``(4, N)`` fp32: lse, gp (softmax weight), gt (one-hot weight), gc
    (constant); with ``LOGPROB`` ``(6, N)`` (its fifth row unused here, the sixth ``gx``).
    With ``GATED`` every program returns at once when ``SKIP[0]`` is nonzero."""
    if GATED:
        if tl.load(SKIP) != 0:
            return
    num_rb = tl.cdiv(N, BLOCK_N)
    num_cb = tl.cdiv(n_cols, BLOCK_V)
    rb, cb = _grouped_tile(tl.program_id(0), num_rb, num_cb, GROUP_N)
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ld = tl.where(rows < N, rows, 0)
    ccols = cb * BLOCK_V + tl.arange(0, BLOCK_V)
    cols_ld = tl.where(ccols < n_cols, v_start + ccols, 0)
    z = _logits_tile(E, C, SE, SC, rows_ld, cols_ld, rb * BLOCK_N, v_start + cb * BLOCK_V, H,
                     stride_en, stride_eh, stride_cv, stride_ch, EVEN_H, BLOCK_N, BLOCK_V,
                     BLOCK_H, DOT_PREC, UPCAST, DESC)
    _dlogits_tile_out(z, rb, cb, BIAS, stride_b, TGT, COEF, D, DB, INV_T, N, V, v_start, n_cols,
                      stride_t, stride_dn, stride_db, stride_it, v_offset, softcap, scale,
                      HAS_BIAS, HAS_SOFTCAP, LOGPROB, BLOCK_N, BLOCK_V)


def _descriptors_ok(e: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether E and C can be read through TMA descriptors: Hopper or newer (or the
    interpreter), Triton's host-side descriptors, a unit last stride and 16-byte aligned base
    and row stride (what the copy engine requires). 16-bit inputs only: three stages of fp32
    tiles would not fit in shared memory."""
    if TensorDescriptor is None or e.element_size() != 2 or c.element_size() != 2:
        return False
    if not settings.interpreting():
        if e.device.type != "cuda" or torch.cuda.get_device_capability(e.device)[0] < 9:
            return False
    for t in (e, c):
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def _call_config(config: Optional[LCEConfig], device, precision: Optional[str]) -> LCEConfig:
    if config is None:
        return default_config(device, precision)
    if precision is None or precision == config.fp32_precision:
        return config
    return config.replace(fp32_precision=precision)


def _operands(e, c, block_n: int, block_v: int, block_h: int, desc: bool):
    if not desc:
        return e, c
    return (TensorDescriptor.from_tensor(e, [block_n, block_h]),
            TensorDescriptor.from_tensor(c, [block_v, block_h]))


def _forward_splits(num_rb: int, num_vt: int, sms: int) -> int:
    """Vocabulary splits per row block for the forward's grid of ``num_rb x splits`` programs.

    At most ~32 row blocks in flight (``splits >= sms / 32``), so that their E rows (1 MiB each
    at 128 x 4096 bf16) and the splits' C tiles stay in L2, and at least one program per
    multiprocessor. Within 4x that, the count with the shortest estimated run: waves times
    tiles per program, plus half a tile per program for its pipeline fill and epilogue. The
    programs are of equal length, so a last wave that is mostly idle costs a whole program:
    at 128 row blocks, 63 tiles and 132 multiprocessors, 5 splits take 5 waves of 13 tiles and 7
    splits 7 waves of 9 (65 against 63 tile times).
    """
    lo = min(num_vt, max(1, triton.cdiv(sms, 32), triton.cdiv(sms, num_rb)))
    best, best_cost = lo, None
    for s in range(lo, min(num_vt, 4 * lo) + 1):
        tiles = triton.cdiv(num_vt, s)
        waves = triton.cdiv(num_rb * triton.cdiv(num_vt, tiles), sms)
        cost = waves * (tiles + 0.5)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


#: Row blocks at which the batch-invariant split is compared with the per-grid choice: 1K to
#: 64K tokens at 128-row blocks.
INVARIANT_ROW_BLOCKS = (8, 32, 128, 512)


def _run_estimate(num_rb: int, num_vt: int, tiles: int, launch_tiles: int, launch_rb: int,
                  sms: int) -> float:
    """Estimated run, in tile times, of the forward over ``num_rb`` row blocks and ``num_vt``
    tiles in splits of ``tiles``, launched ``launch_rb`` row blocks and as many whole splits as
    ``launch_tiles`` hold at a time (the parts forward's launches; one launch where both cover
    everything): each launch's waves times the tiles per program plus half a tile
    (``_forward_splits``' cost)."""
    splits = triton.cdiv(num_vt, tiles)
    per_launch = max(1, launch_tiles // tiles)
    full_s, rest_s = divmod(splits, per_launch)
    full_r, rest_r = divmod(num_rb, launch_rb)

    def waves(rbs: int) -> int:
        return full_s * triton.cdiv(rbs * per_launch, sms) + triton.cdiv(rbs * rest_s, sms)

    return (full_r * waves(launch_rb) + waves(rest_r)) * (tiles + 0.5)


@functools.lru_cache(maxsize=None)
def _invariant_split_tiles(num_vt: int, sms: int, launch_tiles: int, launch_rb: int) -> int:
    """Tiles per split of the batch-invariant forward: one count for every number of rows, so
    that a row's statistics are folded over the same tiles and merged over the same splits in
    any batch. The count whose estimated run (``_run_estimate``) is the closest, at its worst,
    to that of the tiles per split chosen per grid (``_forward_splits`` over one launch) over
    ``INVARIANT_ROW_BLOCKS``. One launch over V = 151936 in 594 tiles on 132 multiprocessors:
    18 tiles (33 splits), within 2% of the per-grid choice from 1K to 64K tokens; an fp32
    head's parts forward, 128 of its 1187 tiles a launch: 8 tiles, within 3%, where the
    count of one launch over all the tiles (36) would take 1.28x at 8K tokens and 4.6x at 1K
    (a launch of 3 splits fills few multiprocessors)."""
    def per_grid(rb: int) -> float:
        n_rb = min(rb, launch_rb)
        tiles = triton.cdiv(launch_tiles, _forward_splits(n_rb, launch_tiles, sms))
        return _run_estimate(rb, num_vt, tiles, launch_tiles, launch_rb, sms)

    refs = {rb: per_grid(rb) for rb in INVARIANT_ROW_BLOCKS}
    best, best_worst = 1, None
    for tiles in range(launch_tiles, 0, -1):  # ties: the fewest splits
        worst = max(_run_estimate(rb, num_vt, tiles, launch_tiles, launch_rb, sms) / ref
                    for rb, ref in refs.items())
        if best_worst is None or worst < best_worst:
            best, best_worst = tiles, worst
    return best


def invariant_tiles(e: torch.Tensor, c: torch.Tensor, cfg: LCEConfig) -> int:
    """Vocabulary tiles per forward split of the batch-invariant statistics of hidden states
    like ``e`` and classifier rows ``c`` (all local columns): from V, H, the dtypes, the tile
    config and the device only (``cfg.split``, or ``_invariant_split_tiles``' count when it is
    0), never from the rows. Where an fp32 head's parts forward runs, its launches hold at most
    ``fwd_parts_bytes`` of each operand's parts, as two parts per fp32 operand in either
    precision (the strategy, which does not know the call's, reads the same count)."""
    num_vt = triton.cdiv(c.shape[0], cfg.fwd_block_v)
    if cfg.split:
        return triton.cdiv(num_vt, cfg.split)
    launch_tiles, launch_rb = num_vt, max(INVARIANT_ROW_BLOCKS)
    if _parts_device(e.device, dot_mode(e.dtype, c.dtype), cfg):
        per_row, per_tile = parts_sizes(e.shape[-1], e.dtype, c.dtype, cfg)
        launch_tiles = max(1, min(num_vt, cfg.fwd_parts_bytes // per_tile))
        launch_rb = max(1, cfg.fwd_parts_bytes // per_row // cfg.fwd_block_n)
    return _invariant_split_tiles(num_vt, multiprocessors(e.device), launch_tiles, launch_rb)


def forward_split(N: int, V: int, cfg: LCEConfig, device: torch.device,
                  tiles_per_split: Optional[int] = None):
    """The forward's vocabulary splits per row block and tiles per split (every split
    non-empty): ``cfg.split``, or ``_forward_splits``' choice when it is 0; with
    ``tiles_per_split`` (``invariant_tiles``) that many tiles per split."""
    num_rb, num_vt = triton.cdiv(N, cfg.fwd_block_n), triton.cdiv(V, cfg.fwd_block_v)
    tiles = tiles_per_split or triton.cdiv(
        num_vt, cfg.split or _forward_splits(num_rb, num_vt, multiprocessors(device)))
    return triton.cdiv(num_vt, tiles), tiles


def forward_stats(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                  targets: torch.Tensor, v_offset: int, softcap: Optional[float],
                  need_sumx: bool, config: Optional[LCEConfig] = None,
                  saved: Optional["SavedTiles"] = None,
                  logprob: Optional[LogprobArgs] = None, precision: Optional[str] = None,
                  invariant: bool = False, tiles_per_split: Optional[int] = None,
                  parts: bool = False, room: Optional[int] = None) -> torch.Tensor:
    """Local per-row statistics ``(4, N)`` fp32: max, sum exp(x - max), target logit, sum of x.

    ``e (N, H)``, ``c (V, H)``, ``targets (N,)`` global class ids (``v_offset`` = first global id
    of this shard); a target outside this shard contributes 0 to the target logit. With
    ``saved`` (``saved_tiles``) the logits are also saved for backward in that buffer. With
    ``logprob`` the statistics are instead the log-prob's ``(5, N)`` of ``cap(scale z) / T``
    (``formulas.merge_logprob_stats``; ``need_sumx`` is ignored). ``precision``: the products
    of fp32 operands (``checks.FP32_PRECISIONS``; None: the config's).

    ``invariant``: batch-invariant statistics, each row's the same bits whatever the other rows,
    their number and the strategy: ``tiles_per_split`` tiles per split (``invariant_tiles`` of
    ``V`` when None), every tile folded as a saved one is (``SAVED_FOLD``), the splits merged by
    ``formulas.ordered_sum``. ``parts``: the ``(splits, k, N)`` statistics of the splits,
    unmerged (a caller merging several column ranges at once).

    ``room``: bytes the call may allocate for a while (the memory budget's share, ``Strategy``;
    None: unbounded). An fp32 head's operands are split into fp16 parts in memory
    (``LCEConfig.fwd_parts``, ``_parts_plan``) a launch's rows and columns at a time, within
    it; where a row block's and a split's parts do not fit, each tile is split in registers
    (slower, and rounded differently: batch-invariant statistics take the parts always).
    """
    cfg = _call_config(config, e.device, precision).for_tiles(compute_dtype(e.dtype, c.dtype))
    N, H = e.shape
    V = c.shape[0]
    k = 4 if logprob is None else 5
    mode = dot_mode(e.dtype, c.dtype, cfg.fp32_precision)
    if invariant and tiles_per_split is None:
        tiles_per_split = invariant_tiles(e, c, cfg)
    plan = _parts_plan(e, c, mode, cfg, room, invariant)
    if plan and tiles_per_split is None and not cfg.split:
        tiles_per_split = _parts_split_tiles(plan[0], plan[1], cfg, e.device)
    split, tiles_per_split = forward_split(N, V, cfg, e.device, tiles_per_split)
    from_parts = plan is not None and (invariant or plan[1] >= tiles_per_split)
    stats = torch.empty((split, k, N) if parts else (k, N), dtype=torch.float32,
                        device=e.device)
    if N == 0:
        return stats
    BN, BV, BH = cfg.fwd_block_n, cfg.fwd_block_v, cfg.fwd_block_h
    check_tiles(BN, BV, BH)
    if saved is not None and saved.block_v != BV:
        raise ValueError(f"saved tiles of {saved.block_v} columns, the forward's are {BV}")
    num_rb = triton.cdiv(N, BN)
    part = stats if split == 1 or parts else torch.empty((split, k, N), dtype=torch.float32,
                                                        device=e.device)
    desc = cfg.fwd_desc and _descriptors_ok(e, c) and not from_parts
    inv_t, stride_it, scale = _row_scale(logprob, part)
    se, sc = _split_scales(e, c, mode, part)

    stages = cfg.fwd_stages
    if from_parts and saved is not None and mode == "h3":
        stages = min(stages, cfg.parts_store_stages)

    def launch(ea, ca, e_lo, c_lo, split0: int, n_splits: int, c_first: int, rb0: int = 0,
               n_rb: int = num_rb):
        ua = part
        if saved is not None:  # with descriptors for E and C, the tiles are saved through one too
            ua = TensorDescriptor.from_tensor(saved.u, [BN, BV]) if desc else saved.u
        _lce_fwd_kernel[(n_rb * n_splits,)](
            ea, ca, e_lo, c_lo, se, sc, bias if bias is not None else e, targets, part,
            ua, saved.tile_max if saved is not None else part, inv_t,
            N, V, H,
            e.stride(0), e.stride(1), c.stride(0), c.stride(1), targets.stride(0),
            saved.u.stride(0) if saved is not None else 0, stride_it,
            bias.stride(0) if bias is not None else 0,
            v_offset, float(softcap) if softcap else 1.0, scale, tiles_per_split, n_splits,
            split0, c_first, n_rb, rb0,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap),
            NEED_SUMX=need_sumx and logprob is None,
            EVEN_H=H % BH == 0, BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, GROUP_N=cfg.fwd_group_n,
            DOT_PREC=mode, UPCAST=upcast(), DESC=desc,
            FLAT=from_parts or (desc and cfg.fwd_flat),
            STORE=saved is not None, DESC_U=desc and saved is not None,
            LOGPROB=logprob is not None,
            NEED_ARGMAX=logprob is not None and logprob.need_argmax,
            num_warps=cfg.fwd_warps, num_stages=stages, **PINNED,
            **({"SAVED_FOLD": True} if invariant else {}),
            **(dict(PARTS=True, LO_E=e_lo is not ea, LO_C=c_lo is not ca) if from_parts else {}),
        )

    if not from_parts:
        ea, ca = _operands(e, c, BN, BV, BH, desc)
        launch(ea, ca, ea, ca, 0, split, 0)
    else:
        # E a launch's rows and C a launch's columns (whole splits) at a time, so that the
        # parts in memory stay within the plan; C split once where one launch holds all of it
        rows, tiles = plan
        per_launch = max(1, tiles // tiles_per_split)
        cols = tiles_per_split * BV
        whole_c = per_launch >= split
        c_parts = None
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            ea, ea_lo = _descriptor_parts(e[r0:r1], se[r0:r1], BN, BH, mode)
            for s0 in range(0, split, per_launch):
                n = min(per_launch, split - s0)
                v0, v1 = s0 * cols, min(V, (s0 + n) * cols)
                if c_parts is None:  # (the previous launch's released first)
                    c_parts = _descriptor_parts(c[v0:v1], sc[v0:v1], BV, BH, mode)
                launch(ea, c_parts[0], ea_lo, c_parts[1], s0, n, v0, r0 // BN,
                       triton.cdiv(r1 - r0, BN))
                if not whole_c:
                    c_parts = None
            del ea, ea_lo
        del c_parts
    if split == 1 or parts:
        return stats
    if logprob is not None:
        return torch.stack(merge_logprob_stats(part, ordered=invariant))
    return torch.stack(merge_partial_stats(part, ordered=invariant))


def _descriptor_parts(x: torch.Tensor, scales: torch.Tensor, block_l: int, block_h: int,
                      mode: str):
    """TMA descriptors of ``[block_l, block_h]`` blocks over the fp16 parts of ``x``
    (``parts.fp16_parts``): ``hi`` and ``lo`` for an fp32 ``x`` in a split mode, ``hi`` twice
    otherwise (the kernel's ``LO_E`` / ``LO_C`` tell them apart). The descriptors hold the
    parts alive."""
    hi, lo = fp16_parts(x, scales, _with_lo(x.dtype, mode))
    d_hi = TensorDescriptor.from_tensor(hi, [block_l, block_h])
    return d_hi, (d_hi if lo is None else TensorDescriptor.from_tensor(lo, [block_l, block_h]))


def _with_lo(dtype: torch.dtype, mode: str) -> bool:
    """Whether an operand of ``dtype`` has a ``lo`` part in ``mode``: an fp32 one, split."""
    return dtype == torch.float32 and mode != "h1"


def parts_sizes(h: int, e_dtype: torch.dtype, c_dtype: torch.dtype, cfg: LCEConfig,
                mode: str = "h3"):
    """``(per row of E, per vocabulary tile of C)``: the bytes of their fp16 parts in ``mode``
    (``parts.fp16_parts``: two parts of an fp32 operand split, one otherwise, rows padded)."""
    width = -(-h // 8) * 8
    return (width * 2 * (2 if _with_lo(e_dtype, mode) else 1),
            cfg.fwd_block_v * width * 2 * (2 if _with_lo(c_dtype, mode) else 1))


def parts_bytes(n: int, h: int, v: int, e_dtype: torch.dtype, c_dtype: torch.dtype,
                device: torch.device, cfg: LCEConfig) -> int:
    """What the parts forward of ``n`` rows and ``v`` columns holds at most with room enough
    (0 where it does not run): ``fwd_parts_bytes`` of each operand's parts, less where the
    operand is smaller (the strategy leaves this much room in forward, ``strategy.py``)."""
    cfg = cfg.for_tiles(compute_dtype(e_dtype, c_dtype))
    mode = dot_mode(e_dtype, c_dtype, cfg.fp32_precision)
    if not _parts_device(device, mode, cfg):
        return 0
    per_row, per_tile = parts_sizes(h, e_dtype, c_dtype, cfg, mode)
    cap = cfg.fwd_parts_bytes
    return min(cap, n * per_row) + min(cap, triton.cdiv(v, cfg.fwd_block_v) * per_tile)


def _parts_device(device: torch.device, mode: str, cfg: LCEConfig) -> bool:
    """Whether the parts forward runs for ``mode`` on ``device`` (``fwd_parts``): split
    products, Triton's host-side descriptors, and Hopper or newer (or the interpreter)."""
    if not (cfg.fwd_parts and mode in SCALED and TensorDescriptor is not None):
        return False
    return settings.interpreting() or (device.type == "cuda"
                                       and torch.cuda.get_device_capability(device)[0] >= 9)


def _parts_plan(e: torch.Tensor, c: torch.Tensor, mode: str, cfg: LCEConfig,
                room: Optional[int], invariant: bool):
    """``(rows, tiles)`` of E and C one launch of the parts forward holds, or None where the
    forward splits its tiles in registers: at most ``fwd_parts_bytes`` of each operand's parts,
    both within ``room`` (E's at most half of it). Batch-invariant statistics take the parts
    whatever the room (at least a row block and a tile; the launches' splits, whole, may hold
    more): which path runs must not depend on the rows or the budget, and the two round their
    products differently (tensor-core products from registers and from shared memory)."""
    if not _parts_device(e.device, mode, cfg):
        return None
    (N, H), V = e.shape, c.shape[0]
    BN = cfg.fwd_block_n
    per_row, per_tile = parts_sizes(H, e.dtype, c.dtype, cfg, mode)
    cap = cfg.fwd_parts_bytes
    rows = min(triton.cdiv(N, BN) * BN, cap // per_row // BN * BN)
    if room is not None and not invariant:
        rows = min(rows, room // 2 // per_row // BN * BN)
    tiles = min(triton.cdiv(V, cfg.fwd_block_v), cap // per_tile)
    if room is not None and not invariant:
        tiles = min(tiles, (room - rows * per_row) // per_tile)
    if invariant:
        return max(rows, BN), max(tiles, 1)
    return (rows, tiles) if rows >= BN and tiles >= 1 else None


def _parts_split_tiles(rows: int, launch_tiles: int, cfg: LCEConfig,
                       device: torch.device) -> int:
    """Tiles per split of the parts forward: ``_forward_splits``' choice for the grid of one
    launch (``rows`` rows, ``launch_tiles`` tiles), so that each launch fills the device."""
    num_rb = triton.cdiv(rows, cfg.fwd_block_n)
    return triton.cdiv(launch_tiles, _forward_splits(num_rb, launch_tiles, multiprocessors(device)))


def _split_scales(e: torch.Tensor, c: torch.Tensor, mode: str, dummy: torch.Tensor):
    """The kernels' ``SE, SC`` arguments: the rows' split scales (``scales.split_scales``) where
    ``mode`` scales its operands, else placeholders."""
    if mode in SCALED:
        return split_scales(e, 1), split_scales(c, 1)
    return dummy, dummy


def _row_scale(logprob: Optional[LogprobArgs], dummy: torch.Tensor):
    """The kernels' ``INV_T, stride_it, scale`` arguments: the log-prob's per-row ``1 / T``
    (stride 0 for one temperature) and logit scale, or placeholders for the loss."""
    if logprob is None:
        return dummy, 0, 1.0
    inv_t = logprob.inv_t
    return inv_t, (0 if inv_t.numel() == 1 else inv_t.stride(0)), float(logprob.scale)


def backward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
             targets: torch.Tensor, v_offset: int, coef: torch.Tensor,
             softcap: Optional[float], need_de: bool, need_dc: bool, need_dbias: bool,
             config: Optional[LCEConfig] = None, de_acc: Optional[torch.Tensor] = None,
             dc_out: Optional[torch.Tensor] = None, logprob: Optional[LogprobArgs] = None,
             dc_acc: Optional[torch.Tensor] = None, skip: Optional[torch.Tensor] = None,
             precision: Optional[str] = None):
    """Gradients of ``sum_n [gp_n * lse_n - gt_n * x_{n,t_n} - gc_n * sum_j x_{n,j}]``.

    ``coef (4, N)`` fp32 rows: lse, gp, gt, gc. Returns ``(dE fp32 (N, H) or None,
    dC in c.dtype (V, H) or None, dbias fp32 (V,) or None)``. ``de_acc``: an fp32 dE to add
    to (the columns before ``c``'s already in it); ``dc_out``: where dC goes; ``dc_acc``: a
    ``(V, H)`` tensor dC is added to instead (a ``main_grad``; dC is then returned as None),
    accumulated in fp32 and rounded once into its dtype. With ``logprob``
    the logits are ``cap(scale z) / T`` and ``coef`` is ``(6, N)``: its sixth row ``gx`` weighs
    ``softmax_j (x_j - lse)`` in dx as well (the entropy's gradient). ``precision`` as for
    ``forward_stats``; dz is fp32 when ``e`` or ``c`` is (``common.compute_dtype``).

    ``skip`` (one int32 element on the device): where it is nonzero every kernel returns at
    once, leaving ``de_acc`` and ``dc_acc`` as they were and the returned dbias undefined; the
    GEMMs then run on the Triton GEMM, which reads the flag (``gated.py``). It needs ``de_acc``
    (when ``need_de``) and ``dc_acc`` (when ``need_dc``): nothing is written that the flag
    could leave undefined but dbias.
    """
    cfg = _call_config(config, e.device, precision).for_tiles(compute_dtype(e.dtype, c.dtype))
    N, H = e.shape
    if skip is not None and ((need_de and de_acc is None) or (need_dc and dc_acc is None)):
        raise ValueError("backward(skip=...) adds into de_acc and dc_acc: pass both where needed")
    V = c.shape[0]
    dev = e.device
    # dE is written by its first chunk's GEMM (V >= 1, checked by the caller), or added to
    de = (de_acc if de_acc is not None
          else torch.empty((N, H), dtype=torch.float32, device=dev)) if need_de else None
    dc = ((dc_out if dc_out is not None
           else torch.empty_like(c, memory_format=torch.contiguous_format))
          if need_dc and dc_acc is None else None)
    db = torch.empty((V,), dtype=torch.float32, device=dev) if need_dbias else None
    if N == 0:
        if dc is not None:
            dc.zero_()
        if db is not None:
            db.zero_()
        return de, dc, db
    if not (need_de or need_dc or need_dbias):
        return de, dc, db
    BN, BV, BH = cfg.bwd_block_n, cfg.bwd_block_v, cfg.bwd_block_h
    check_tiles(BN, BV, BH)
    # Chunk width: a multiple of BLOCK_V whose (N, Vc) buffer fits chunk_bytes.
    d_dtype = compute_dtype(e.dtype, c.dtype)
    per_col = N * d_dtype.itemsize
    vc = max(BV, (cfg.chunk_bytes // max(per_col, 1)) // BV * BV)
    vc = min(vc, triton.cdiv(V, BV) * BV)
    d = torch.empty((N, vc), dtype=d_dtype, device=dev)
    num_rb = triton.cdiv(N, BN)
    db_part = torch.empty((num_rb, vc), dtype=torch.float32, device=dev) if bias is not None else None
    dot_prec = dot_mode(e.dtype, c.dtype, cfg.fp32_precision)
    desc = cfg.bwd_desc and _descriptors_ok(e, c)
    ea, ca = _operands(e, c, BN, BV, BH, desc)
    inv_t, stride_it, scale = _row_scale(logprob, coef)
    se, sc = _split_scales(e, c, dot_prec, coef)
    for v0 in range(0, V, vc):
        nc = min(vc, V - v0)
        tiles = num_rb * triton.cdiv(nc, BV)
        grid = (tiles,)
        _lce_dlogits_kernel[grid](
            ea, ca, se, sc, bias if bias is not None else e, targets, coef, d,
            db_part if db_part is not None else coef, inv_t,
            N, V, H, v0, nc,
            e.stride(0), e.stride(1), c.stride(0), c.stride(1), targets.stride(0), d.stride(0), vc,
            stride_it, bias.stride(0) if bias is not None else 0, v_offset,
            float(softcap) if softcap else 1.0, scale,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap), LOGPROB=logprob is not None,
            EVEN_H=H % BH == 0, BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, GROUP_N=cfg.bwd_group_n,
            DOT_PREC=dot_prec, UPCAST=upcast(), DESC=desc,
            SKIP=coef if skip is None else skip, GATED=skip is not None,
            num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages, **PINNED,
        )
        dz = d[:, :nc]
        if need_de:
            # the first chunk stores: no zero-fill and one read fewer of the fp32 (N, H) dE
            (gemm_store if v0 == 0 and de_acc is None else gemm_acc)(de, dz, c[v0:v0 + nc], cfg,
                                                                      skip=skip)
        if need_dc:  # dC_chunk = dz.T @ e, rounded once (into dc_acc: added, rounded once)
            if dc_acc is None:
                gemm_store(dc[v0:v0 + nc], dz.t(), e, cfg)
            else:
                gemm_acc(dc_acc[v0:v0 + nc], dz.t(), e, cfg, skip=skip)
        if need_dbias:
            db[v0:v0 + nc] = db_part[:, :nc].sum(dim=0)
    return de, dc, db
