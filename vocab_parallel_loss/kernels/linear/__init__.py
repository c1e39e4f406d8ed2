"""Triton kernels for the fused linear cross entropy (no autograd, no torch.distributed here).

Notation: ``e`` is ``(N, H)`` hidden states, ``c`` is ``(V, H)`` this rank's classifier rows
(``V`` = local vocabulary), ``z = e @ c.T (+ bias)`` the raw logits, ``x = softcap * tanh(z /
softcap)`` (or ``x = z``) the logits the loss sees. The ``(N, V)`` logits are never stored.

Three kernels, every accumulation in fp32 and in a fixed order (deterministic, no atomics):

``_lce_fwd_kernel`` (2NHV flops)
    One program per (row block, vocabulary split). It walks its vocabulary tiles, computes each
    ``BLOCK_N x BLOCK_V`` logits tile with ``tl.dot`` (fp32 accumulator, K loop over H) and
    folds it into online per-row statistics: max ``m``, ``s = sum exp(x - m)``, the target logit
    (0 when the target is not in this split) and the sum of logits (label smoothing). The splits
    (``(SPLIT, 4, N)`` floats) are merged on the host side by ``merge_split_stats``.

``_lce_dlogits_kernel`` (2 N H Vc flops per vocabulary chunk)
    Recomputes a chunk of ``Vc`` logit columns tile by tile and writes
    ``dz = (gp * softmax - gt * onehot - gc) * dx/dz`` in the input dtype into a
    ``(N, Vc)`` buffer, plus per-row-block column sums for the bias gradient (fp32).
    ``gp, gt, gc`` are per-row coefficients prepared by the caller (they carry the upstream
    gradient, the reduction, label smoothing and z-loss), so no loss option is a constexpr.

``_mm_kernel`` (2 N H Vc flops each, twice per chunk)
    A plain tiled GEMM with an fp32 accumulator that either adds into an fp32 output
    (``dE += dz @ c_chunk``) or stores once, rounded to the output dtype (``dC_chunk = dz.T @ e``).

Backward therefore costs 6NHV on top of the forward's 2NHV (8NHV in all) and keeps extra memory
at ``N * Vc`` elements (the chunk) plus the fp32 ``(N, H)`` dE accumulator, independent of V.
Every ``dC`` row is produced by exactly one GEMM over all N rows: it is rounded once. ``dE`` is
summed over the chunks in fp32 and rounded once by the caller (after the TP all-reduce).

On Hopper (16-bit inputs, 16-byte aligned rows) the two ``tl.dot`` kernels read E and C
through TMA descriptors, whose zero fill past the ends replaces the masks, and the forward runs
one flat loop over (vocabulary tile, H step) so the next tile's loads overlap a tile's epilogue
(``LCEConfig.fwd_desc`` / ``bwd_desc`` / ``fwd_flat`` / ``bwd_flat``). ``bwd_store_desc`` also
writes the dz tiles through a descriptor (an option: measured no faster on the H200).

All row/column offsets are computed in int64.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import settings
from ..launch import PINNED, multiprocessors  # compile options every launch pins (FMA contraction)

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


# ----------------------------------------------------------------------------------------------
# Tile configurations
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LCEConfig:
    """Tile configuration of the fused linear cross entropy kernels.

    ``fwd_*``: forward statistics kernel; ``bwd_*``: dlogits recompute kernel; ``mm_*``: the two
    gradient GEMMs. ``split``: vocabulary splits per row block in the forward (0 = choose so that
    the grid covers ``4 x`` the multiprocessors). ``chunk_bytes``: size of the ``(N, Vc)`` dlogits
    buffer in backward (bigger = fewer, larger GEMMs; extra memory). ``matmul``: the two gradient
    GEMMs in ``"triton"`` (``_mm_kernel``) or ``"torch"`` (cuBLAS: ``torch.addmm`` with
    ``out_dtype=torch.float32`` accumulates ``dE`` in fp32, falling back to Triton where that
    overload is missing; ``torch.mm`` writes ``dC`` in the input dtype from fp32 accumulation
    and fp32 split-K reductions, so it is rounded once; ``dc_staging`` routes it through an fp32
    buffer instead). CPU (interpreter) always uses Triton.

    ``grad_in_forward``: ``"never"`` (default), ``"auto"`` or ``"always"``. For a scalar loss
    (``reduction`` mean or sum) that needs gradients, form both gradients already in forward
    from ``gif_rows``-row chunks of materialized fp32 logits: 6NHV flops instead of 8NHV, at
    the price of memory that grows with V: an fp32 ``(V_local, H)`` ``dC`` accumulator and a
    ``gif_rows x V_local`` fp32 chunk (plus the fp32 ``(N, H)`` ``dE`` both paths hold).
    Gradients stay fp32 until backward scales them by the upstream gradient and rounds once.
    ``"auto"`` takes it when ``gif_extra_bytes`` stays under ``gif_max_bytes``.
    ``row_block`` / ``row_warps``: the memory-bound row kernels of that path.

    ``fwd_mode`` / ``bwd_mode``: ``"fused"`` computes logits tiles with ``tl.dot`` inside the
    statistics / dlogits kernels (no logits in memory at all); ``"chunked"`` lets cuBLAS write an
    fp32 chunk of logits (``fwd_chunk_bytes`` of rows in forward, ``chunk_bytes`` of columns in
    backward) and a memory-bound row kernel turns it into statistics / dlogits. Chunked spends
    ~12 extra bytes of memory traffic per logit but runs the GEMMs at cuBLAS speed.
    """

    fwd_block_n: int = 128
    fwd_block_v: int = 256
    fwd_block_h: int = 64
    fwd_group_n: int = 16
    fwd_warps: int = 8
    fwd_stages: int = 3
    split: int = 0
    bwd_block_n: int = 128
    bwd_block_v: int = 256
    bwd_block_h: int = 64
    bwd_group_n: int = 8
    bwd_warps: int = 8
    bwd_stages: int = 3
    mm_block_m: int = 128
    mm_block_n: int = 128  # 256 spills in the fp32 read-modify-write epilogue of dE
    mm_block_k: int = 64
    mm_group_m: int = 8
    mm_warps: int = 8
    mm_stages: int = 4
    chunk_bytes: int = 128 * 1024 * 1024
    matmul: str = "torch"
    grad_in_forward: str = "never"
    gif_rows: int = 4096
    row_block: int = 2048
    row_warps: int = 8
    gif_max_bytes: int = 1 << 30
    fwd_mode: str = "fused"
    bwd_mode: str = "fused"
    fwd_chunk_bytes: int = 128 * 1024 * 1024
    # rows / columns per chunk are a multiple of this. 256, not less: cuBLAS (H200, torch 2.11)
    # computes dC = dz.T @ E with K = 2^19 rows 20x less accurately for M <= 128 rows than for
    # M = 256 (3e-3 vs 1.3e-4 relative; scripts/diag_mm_large.py), whatever the output dtype.
    chunk_align: int = 256
    x_chunk_bytes: int = 64 * 1024 * 1024  # chunked backward: fp32 logits per cuBLAS call
    # cuBLAS dC in bf16/fp16: straight into dC (fp32 accumulation and split-K reductions, see
    # _Fp32Reductions, so it is rounded once), or (True) through an fp32 staging buffer and a
    # copy: 64 MiB more memory and a pass over dC, for the same result
    dc_staging: bool = False
    # fused modes: read E and C through TMA descriptors (Hopper+, aligned operands); with them
    # the kernels may run one flat loop over (tile, H step) (their FLAT)
    fwd_desc: bool = False
    bwd_desc: bool = False
    fwd_flat: bool = False
    bwd_flat: bool = False  # the dlogits kernel: persistent programs, one flat loop
    # the dlogits kernel writes each dz tile through a TMA descriptor of the chunk buffer (with
    # bwd_desc): no per-element addresses or masks in its epilogue, 19 registers fewer. Off:
    # on the H200 it was 3-5% slower per tile and only as fast with bwd_flat (session 10,
    # benchmarks/results/tuning/linear_h200_20261203-1518-store-ab-*)
    bwd_store_desc: bool = False

    def replace(self, **kw) -> "LCEConfig":
        return dataclasses.replace(self, **kw)


# Fused modes by default. The chunked backward measured 111.5 vs 115.6 ms (V=128256, N=16384,
# H=4096) in one sweep (benchmarks/results/linear_*-1839.md) but 116.7 in the next table run:
# no reliable gain. TMA descriptors and the flat forward loop: forward 26.2 against 28.9 ms
# (657 against 596 TFLOP/s), per-token step 105.3 against 114.5-118 ms at V=128256
# (tuning/linear_h200_20261203-1157-tma-sweep.md, linear_nvidia_h200_20261203-1200.md).
HOPPER_CONFIG = LCEConfig(fwd_desc=True, bwd_desc=True, fwd_flat=True)
AMPERE_CONFIG = LCEConfig(
    fwd_block_n=128, fwd_block_v=128, fwd_block_h=32, fwd_warps=8, fwd_stages=4,
    bwd_block_n=128, bwd_block_v=128, bwd_block_h=32, bwd_warps=8, bwd_stages=4,
    mm_block_m=128, mm_block_n=128, mm_block_k=32, mm_warps=8, mm_stages=4,
)
# The interpreter runs tiles through numpy: small tiles keep the CPU tests quick.
INTERPRET_CONFIG = LCEConfig(
    fwd_block_n=16, fwd_block_v=32, fwd_block_h=16, fwd_group_n=2, fwd_warps=4, fwd_stages=1,
    split=2,
    bwd_block_n=16, bwd_block_v=32, bwd_block_h=16, bwd_group_n=2, bwd_warps=4, bwd_stages=1,
    mm_block_m=16, mm_block_n=32, mm_block_k=16, mm_group_m=2, mm_warps=4, mm_stages=1,
    chunk_bytes=37 * 24 * 4,  # a few chunks even on the tiny test shapes
    matmul="triton",
    gif_rows=16, row_block=16, row_warps=4, chunk_align=8, x_chunk_bytes=37 * 8 * 4,
)

#: Set to an ``LCEConfig`` to override the automatic choice (benchmarks and sweeps do this).
#: The environment variable ``VPL_LCE_CONFIG`` (JSON of ``LCEConfig`` fields) is applied on top.
OVERRIDE_CONFIG: Optional[LCEConfig] = None


def default_config(device: torch.device) -> LCEConfig:
    if OVERRIDE_CONFIG is not None:
        cfg = OVERRIDE_CONFIG
    elif device.type != "cuda" or settings.interpreting():
        cfg = INTERPRET_CONFIG
    else:
        major, _ = torch.cuda.get_device_capability(device)
        cfg = HOPPER_CONFIG if major >= 9 else AMPERE_CONFIG
    overrides = settings.lce_config_overrides()
    if overrides:
        cfg = cfg.replace(**overrides)
    return cfg


def _upcast(dtype: torch.dtype) -> bool:
    # Triton's interpreter (3.9) feeds bf16 operands of tl.dot to numpy as their raw uint16 bits;
    # upcasting first is exact (bf16 x bf16 products fit fp32), as the tensor cores compute.
    return dtype == torch.bfloat16 and settings.interpreting()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full precision ("tf32" would silently drop 13 mantissa bits on the GPU).
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


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
def _tanh(x):
    # exp-based tanh: saturates to +-1 (exp overflow -> inf -> 2/inf = 0), portable across
    # backends and the interpreter.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _desc_dot_step(E, C, row0, col0, h0, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc += E[row0:, h0:] @ C[col0:, h0:].T`` for one H step, through TMA descriptors."""
    a = E.load([row0, h0])
    b = C.load([col0, h0])
    if UPCAST:  # interpreter only: its bf16 dot multiplies the raw uint16 bits
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)


@triton.jit
def _logits_tile(E, C, rows_ld, cols_ld, row0, col0, H, stride_en, stride_eh, stride_cv,
                 stride_ch, EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_H: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                 DESC: tl.constexpr):
    """fp32 ``E[rows] @ C[cols].T``; ``rows_ld`` / ``cols_ld`` are in range (callers wrap them).

    With ``DESC`` E and C are TMA tensor descriptors of ``[BLOCK_N | BLOCK_V, BLOCK_H]`` blocks
    and the tile starts at ``(row0, col0)``: the copy engine fills rows, columns and H past the
    end with zeros, so no masks and no per-element addresses (``rows_ld`` etc. are unused).
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if DESC:
        for h0 in range(0, H, BLOCK_H):
            acc = _desc_dot_step(E, C, row0, col0, h0, acc, DOT_PREC, UPCAST)
    else:  # (an else, not an early return: Triton compiles what follows a return in a branch)
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
            if UPCAST:  # interpreter only: its bf16 dot multiplies the raw uint16 bits
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            e_ptrs += BLOCK_H * stride_eh
            c_ptrs += BLOCK_H * stride_ch
    return acc


@triton.jit
def _fold_tile(x, vt, V, BIAS, softcap, t_local, m, s, tg, sx, HAS_BIAS: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, NEED_SUMX: tl.constexpr, BLOCK_V: tl.constexpr):
    """Fold the fp32 logits tile ``x`` of vocabulary tile ``vt`` into the online statistics."""
    cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    if HAS_BIAS:
        b = tl.load(BIAS + tl.where(col_mask, cols, 0).to(tl.int64)).to(tl.float32)
        x += b[None, :]
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    # one live tile at a time (128x256 fp32 is half the register file): reuse x in place
    # and let every other tile be a temporary consumed by its reduction
    tg += tl.sum(tl.where(cols[None, :] == t_local[:, None], x, 0.0), axis=1)
    if NEED_SUMX:
        sx += tl.sum(tl.where(col_mask[None, :], x, 0.0), axis=1)
    x = tl.where(col_mask[None, :], x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, axis=1))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
    return m_new, s, tg, sx


@triton.jit
def _lce_fwd_kernel(
    E, C, BIAS, TGT, STATS,
    N, V, H,
    stride_en, stride_eh, stride_cv, stride_ch, stride_t,
    v_offset, softcap, tiles_per_split, n_splits,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUMX: tl.constexpr,
    EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, DESC: tl.constexpr,
    FLAT: tl.constexpr,
):
    """Nested loops (vocabulary tiles, then H), or with ``FLAT`` (``DESC`` only) one loop over
    (tile, H step) that folds a tile into the statistics after its last step, so that the
    software pipeline keeps loading the next tile's operands during that epilogue."""
    rb, split = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), n_splits, GROUP_N)

    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows_ld = tl.where(row_mask, rows, 0)
    t = tl.load(TGT + rows_ld.to(tl.int64) * stride_t).to(tl.int64) - v_offset
    t_local = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tg = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sx = tl.zeros((BLOCK_N,), dtype=tl.float32)
    num_vt = tl.cdiv(V, BLOCK_V)
    t_begin = split * tiles_per_split
    t_end = tl.minimum(num_vt, t_begin + tiles_per_split)
    if FLAT:
        num_k = tl.cdiv(H, BLOCK_H)
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for it in range(0, (t_end - t_begin) * num_k):
            vt = t_begin + it // num_k
            kk = it - (vt - t_begin) * num_k
            acc = _desc_dot_step(E, C, rb * BLOCK_N, vt * BLOCK_V, kk * BLOCK_H, acc,
                                 DOT_PREC, UPCAST)
            if kk == num_k - 1:
                m, s, tg, sx = _fold_tile(acc, vt, V, BIAS, softcap, t_local, m, s, tg, sx,
                                          HAS_BIAS, HAS_SOFTCAP, NEED_SUMX, BLOCK_V)
                acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    else:
        for vt in range(t_begin, t_end):
            cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
            cols_ld = tl.where(cols < V, cols, 0)
            x = _logits_tile(E, C, rows_ld, cols_ld, rb * BLOCK_N, vt * BLOCK_V, H, stride_en,
                             stride_eh, stride_cv, stride_ch, EVEN_H, BLOCK_N, BLOCK_V, BLOCK_H,
                             DOT_PREC, UPCAST, DESC)
            m, s, tg, sx = _fold_tile(x, vt, V, BIAS, softcap, t_local, m, s, tg, sx,
                                      HAS_BIAS, HAS_SOFTCAP, NEED_SUMX, BLOCK_V)

    base = STATS + split.to(tl.int64) * 4 * N + rows.to(tl.int64)
    tl.store(base, m, mask=row_mask)
    tl.store(base + N, s, mask=row_mask)
    tl.store(base + 2 * N, tg, mask=row_mask)
    tl.store(base + 3 * N, sx, mask=row_mask)


@triton.jit
def _dlogits_tile_out(z, rb, cb, BIAS, TGT, COEF, D, DB, N, V, v_start, n_cols, stride_t,
                      stride_dn, stride_db, v_offset, softcap, HAS_BIAS: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                      DESC_OUT: tl.constexpr):
    """dz of the fp32 logits tile ``z`` (row block ``rb``, chunk column block ``cb``) into D,
    and its column sums into the bias gradient's per-row-block partials. With ``DESC_OUT`` D is
    a TMA descriptor of the chunk's ``(N, n_cols)`` columns: the copy engine drops the rows and
    columns past their ends."""
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows_ld = tl.where(row_mask, rows, 0)
    ccols = cb * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
    col_mask = ccols < n_cols
    cols = v_start + ccols  # local vocabulary column
    if HAS_BIAS:
        b = tl.load(BIAS + tl.where(col_mask, cols, 0).to(tl.int64)).to(tl.float32)
        z += b[None, :]

    if HAS_SOFTCAP:
        th = _tanh(z / softcap)
        x = softcap * th
    else:
        x = z

    r64 = rows_ld.to(tl.int64)
    lse = tl.load(COEF + r64)
    gp = tl.load(COEF + N + r64)
    gt = tl.load(COEF + 2 * N + r64)
    gc = tl.load(COEF + 3 * N + r64)
    t = tl.load(TGT + r64 * stride_t).to(tl.int64) - v_offset
    t_local = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)
    onehot = cols[None, :] == t_local[:, None]
    dx = gp[:, None] * tl.exp(x - lse[:, None]) - gc[:, None] - tl.where(onehot, gt[:, None], 0.0)
    if HAS_SOFTCAP:
        dx = dx * (1.0 - th * th)
    mask = row_mask[:, None] & col_mask[None, :]
    dx = tl.where(mask, dx, 0.0)
    if DESC_OUT:
        D.store([rb * BLOCK_N, cb * BLOCK_V], dx.to(D.dtype))
    else:
        d_ptrs = D + rows.to(tl.int64)[:, None] * stride_dn + ccols[None, :].to(tl.int64)
        tl.store(d_ptrs, dx.to(D.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(DB + rb.to(tl.int64) * stride_db + ccols.to(tl.int64), tl.sum(dx, axis=0),
                 mask=col_mask)


@triton.jit
def _lce_dlogits_kernel(
    E, C, BIAS, TGT, COEF, D, DB,
    N, V, H, v_start, n_cols,
    stride_en, stride_eh, stride_cv, stride_ch, stride_t, stride_dn, stride_db,
    v_offset, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    EVEN_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, DESC: tl.constexpr,
    FLAT: tl.constexpr, DESC_OUT: tl.constexpr,
):
    """dz for local columns ``[v_start, v_start + n_cols)`` into ``D[:, :n_cols]`` (with
    ``DESC_OUT`` a TMA descriptor of exactly those columns).

    COEF is ``(4, N)`` fp32: lse, gp (softmax weight), gt (one-hot weight), gc (constant).
    One program per tile, or with ``FLAT`` (``DESC`` only) persistent programs that take tiles
    ``pid, pid + P, ...`` in one loop over (tile, H step), writing a tile after its last step:
    the software pipeline then loads the next tile's operands during that epilogue.
    """
    num_rb = tl.cdiv(N, BLOCK_N)
    num_cb = tl.cdiv(n_cols, BLOCK_V)
    if FLAT:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        num_k = tl.cdiv(H, BLOCK_H)
        my_tiles = tl.cdiv(num_rb * num_cb - pid, nprog)
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for it in range(0, my_tiles * num_k):
            j = it // num_k
            kk = it - j * num_k
            rb, cb = _grouped_tile(pid + j * nprog, num_rb, num_cb, GROUP_N)
            acc = _desc_dot_step(E, C, rb * BLOCK_N, v_start + cb * BLOCK_V, kk * BLOCK_H, acc,
                                 DOT_PREC, UPCAST)
            if kk == num_k - 1:
                _dlogits_tile_out(acc, rb, cb, BIAS, TGT, COEF, D, DB, N, V, v_start, n_cols,
                                  stride_t, stride_dn, stride_db, v_offset, softcap, HAS_BIAS,
                                  HAS_SOFTCAP, BLOCK_N, BLOCK_V, DESC_OUT)
                acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    else:
        rb, cb = _grouped_tile(tl.program_id(0), num_rb, num_cb, GROUP_N)
        rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ld = tl.where(rows < N, rows, 0)
        ccols = cb * BLOCK_V + tl.arange(0, BLOCK_V)
        cols_ld = tl.where(ccols < n_cols, v_start + ccols, 0)
        z = _logits_tile(E, C, rows_ld, cols_ld, rb * BLOCK_N, v_start + cb * BLOCK_V, H,
                         stride_en, stride_eh, stride_cv, stride_ch, EVEN_H, BLOCK_N, BLOCK_V,
                         BLOCK_H, DOT_PREC, UPCAST, DESC)
        _dlogits_tile_out(z, rb, cb, BIAS, TGT, COEF, D, DB, N, V, v_start, n_cols, stride_t,
                          stride_dn, stride_db, v_offset, softcap, HAS_BIAS, HAS_SOFTCAP,
                          BLOCK_N, BLOCK_V, DESC_OUT)


@triton.jit
def _mm_kernel(
    A, B, OUT, M, NN, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
    ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """``OUT (+)= A @ B`` with an fp32 accumulator; ``A (M, K)``, ``B (K, NN)``, any strides."""
    pid = tl.program_id(0)
    num_pm = tl.cdiv(M, BLOCK_M)
    num_pn = tl.cdiv(NN, BLOCK_N)
    width = GROUP_M * num_pn
    group = pid // width
    first_m = group * GROUP_M
    gsize = tl.minimum(num_pm - first_m, GROUP_M)
    pm = first_m + (pid % width) % gsize
    pn = (pid % width) // gsize

    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < NN
    offs_k = tl.arange(0, BLOCK_K)
    # Masks, not wrapped offsets: either operand may be contiguous along M or N (dz.T), and
    # wrapped offsets would hide that contiguity from the vectorizer (no cp.async pipelining).
    a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    b_ptrs = B + offs_k[:, None].to(tl.int64) * stride_bk + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            km = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & km[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=km[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    mask = m_ok[:, None] & n_ok[None, :]
    o_ptrs = OUT + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rows_stats_kernel(
    X, BIAS, TGT, STATS, N, V, stride_xn, stride_t, stride_s, v_offset, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_SUMX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grad-in-forward path: statistics of one row of materialized fp32 logits ``X (rows, V)``."""
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
            x = softcap * _tanh(x / softcap)
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
    """Grad-in-forward path: ``dz`` of one row from the materialized logits, written to ``D``.

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
            th = _tanh(z / softcap)
            x = softcap * th
        else:
            x = z
        dx = gp * tl.exp(x - lse) - gc - tl.where(cols == t_local, gt, 0.0)
        if HAS_SOFTCAP:
            dx = dx * (1.0 - th * th)
        tl.store(d_row + cols, dx.to(D.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host wrappers (allocation + launch; no autograd, no communication)
# ----------------------------------------------------------------------------------------------


def _descriptors_ok(e: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether E and C can be read through TMA descriptors: Hopper or newer (or the
    interpreter), Triton's host-side descriptors, a unit last stride and 16-byte aligned base
    and row stride (what the copy engine requires). 16-bit inputs only: fp32 tiles feed no
    tensor-core dot, and three stages of them would not fit in shared memory."""
    if TensorDescriptor is None or e.element_size() != 2:
        return False
    if not settings.interpreting():
        if e.device.type != "cuda" or torch.cuda.get_device_capability(e.device)[0] < 9:
            return False
    for t in (e, c):
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def _operands(e, c, block_n: int, block_v: int, block_h: int, desc: bool):
    if not desc:
        return e, c
    return (TensorDescriptor.from_tensor(e, [block_n, block_h]),
            TensorDescriptor.from_tensor(c, [block_v, block_h]))


def _check_tiles(*blocks: int) -> None:
    for b in blocks:
        if b < 16 or b & (b - 1):
            raise ValueError(f"tile sizes must be powers of two >= 16, got {b}")


def _forward_splits(num_rb: int, num_vt: int, sms: int) -> int:
    """Vocabulary splits per row block for the forward's grid of ``num_rb x splits`` programs.

    At most ~32 row blocks in flight (``splits >= sms / 32``), so that their E rows (1 MiB each
    at 128 x 4096 bf16) and the splits' C tiles stay in L2, and at least one program per
    multiprocessor. Within 4x that, the count with the shortest estimated run: waves times
    tiles per program, plus half a tile per program for its pipeline fill and epilogue. The
    programs are of equal length, so a last wave that is mostly idle costs a whole program:
    at 128 row blocks, 63 tiles and 132 multiprocessors, 5 splits run 5 waves of 13 tiles and 7
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


def forward_split(N: int, V: int, cfg: LCEConfig, device: torch.device):
    """The forward's vocabulary splits per row block and tiles per split (every split
    non-empty): ``cfg.split``, or ``_forward_splits``' choice when it is 0."""
    num_rb, num_vt = triton.cdiv(N, cfg.fwd_block_n), triton.cdiv(V, cfg.fwd_block_v)
    tiles = triton.cdiv(num_vt, cfg.split or _forward_splits(num_rb, num_vt, multiprocessors(device)))
    return triton.cdiv(num_vt, tiles), tiles


def forward_stats(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                  targets: torch.Tensor, v_offset: int, softcap: Optional[float],
                  need_sumx: bool, config: Optional[LCEConfig] = None) -> torch.Tensor:
    """Local per-row statistics ``(4, N)`` fp32: max, sum exp(x - max), target logit, sum of x.

    ``e (N, H)``, ``c (V, H)``, ``targets (N,)`` global class ids (``v_offset`` = first global id
    of this shard); a target outside this shard contributes 0 to the target logit.
    """
    cfg = config or default_config(e.device)
    N, H = e.shape
    V = c.shape[0]
    stats = torch.empty((4, N), dtype=torch.float32, device=e.device)
    if N == 0:
        return stats
    if cfg.fwd_mode == "chunked":
        return _forward_stats_chunked(e, c, bias, targets, v_offset, softcap, need_sumx, cfg,
                                      stats)
    if cfg.fwd_mode != "fused":
        raise ValueError(f"fwd_mode must be 'fused' or 'chunked', got {cfg.fwd_mode!r}")
    BN, BV, BH = cfg.fwd_block_n, cfg.fwd_block_v, cfg.fwd_block_h
    _check_tiles(BN, BV, BH)
    num_rb = triton.cdiv(N, BN)
    split, tiles_per_split = forward_split(N, V, cfg, e.device)
    part = stats if split == 1 else torch.empty((split, 4, N), dtype=torch.float32, device=e.device)
    grid = (num_rb * split,)
    desc = cfg.fwd_desc and _descriptors_ok(e, c)
    ea, ca = _operands(e, c, BN, BV, BH, desc)
    _lce_fwd_kernel[grid](
        ea, ca, bias if bias is not None else e, targets, part,
        N, V, H,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1), targets.stride(0),
        v_offset, float(softcap) if softcap else 1.0, tiles_per_split, split,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap), NEED_SUMX=need_sumx,
        EVEN_H=H % BH == 0, BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, GROUP_N=cfg.fwd_group_n,
        DOT_PREC=_dot_precision(e.dtype), UPCAST=_upcast(e.dtype), DESC=desc,
        FLAT=desc and cfg.fwd_flat, num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
        **PINNED,
    )
    if split == 1:
        return stats
    return merge_split_stats(part)


def _chunk_len(total: int, budget_bytes: int, per_unit_bytes: int, align: int) -> int:
    """Rows (or columns) per chunk: as many as fit ``budget_bytes``, a multiple of ``align``
    (keeps cuBLAS leading dimensions 16-byte aligned), at least ``align``, at most ``total``."""
    k = budget_bytes // max(per_unit_bytes, 1) // align * align
    return max(1, min(total, max(align, k)))


def _forward_stats_chunked(e, c, bias, targets, v_offset, softcap, need_sumx, cfg, stats):
    """``fwd_mode="chunked"``: cuBLAS writes fp32 logits for a block of rows, a row kernel
    reduces them to statistics. Extra memory: one ``(rows, V)`` fp32 chunk."""
    N, V = e.shape[0], c.shape[0]
    rows = _chunk_len(N, cfg.fwd_chunk_bytes, 4 * V, cfg.chunk_align)
    buf = torch.empty((rows, V), dtype=torch.float32, device=e.device)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        x = buf[:r1 - r0]
        chunk_logits(e[r0:r1], c, x, cfg)
        rows_stats(x, bias, targets[r0:r1], v_offset, softcap, need_sumx, cfg,
                   out=stats[:, r0:r1])
    return stats


def merge_split_stats(part: torch.Tensor) -> torch.Tensor:
    """Merge ``(S, 4, N)`` partial statistics (max, sumexp, target, sumx) into ``(4, N)``."""
    m = part[:, 0].amax(dim=0)
    s = (part[:, 1] * torch.exp(part[:, 0] - m)).sum(dim=0)
    return torch.stack([m, s, part[:, 2].sum(dim=0), part[:, 3].sum(dim=0)])


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool,
        cfg: LCEConfig) -> None:
    M, K = a.shape
    NN = b.shape[1]
    if M == 0 or NN == 0:
        return
    if K == 0:
        if not accumulate:
            out.zero_()
        return
    BM, BN, BK = cfg.mm_block_m, cfg.mm_block_n, cfg.mm_block_k
    _check_tiles(BM, BN, BK)
    grid = (triton.cdiv(M, BM) * triton.cdiv(NN, BN),)
    _mm_kernel[grid](
        a, b, out, M, NN, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        ACCUMULATE=accumulate, EVEN_K=K % BK == 0, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
        GROUP_M=cfg.mm_group_m, DOT_PREC=_dot_precision(a.dtype), UPCAST=_upcast(a.dtype),
        num_warps=cfg.mm_warps, num_stages=cfg.mm_stages, **PINNED,
    )


#: Whether cuBLAS works here through ``torch.mm`` (output in the input dtype), ``torch.mm``
#: with ``out_dtype=torch.float32`` and ``torch.addmm`` with it (probed on first use; older
#: PyTorch lacks ``out_dtype`` or requires ``self`` in the input dtype). Kept apart, so that a
#: PyTorch without ``out_dtype`` still runs dC through cuBLAS.
TORCH_DTYPE_MM = {"mm": True, "mm_fp32": True, "addmm": True}


def _use_torch_mm(a: torch.Tensor, cfg: LCEConfig, op: str) -> bool:
    return cfg.matmul == "torch" and a.is_cuda and TORCH_DTYPE_MM[op]


def _torch_mm_failed(op: str, ex: Exception) -> None:
    import warnings

    TORCH_DTYPE_MM[op] = False
    call = {"mm": "torch.mm", "mm_fp32": "torch.mm(out_dtype=torch.float32)",
            "addmm": "torch.addmm(out_dtype=torch.float32)"}[op]
    warnings.warn(f"{call} unavailable ({ex!r}); using the Triton GEMM where it was used",
                  RuntimeWarning, stacklevel=3)


class _Fp32Reductions:
    """PyTorch lets cuBLAS reduce split-K partial sums in bf16/fp16 by default; our GEMMs promise
    fp32 accumulation, so they turn that off for themselves. (It does not cure the small-M case
    measured on the H200, see ``chunk_align``.)"""

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.saved = (m.allow_bf16_reduced_precision_reduction,
                      m.allow_fp16_reduced_precision_reduction)
        m.allow_bf16_reduced_precision_reduction = False
        m.allow_fp16_reduced_precision_reduction = False

    def __exit__(self, *exc):
        m = torch.backends.cuda.matmul
        (m.allow_bf16_reduced_precision_reduction,
         m.allow_fp16_reduced_precision_reduction) = self.saved


def gemm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cfg: LCEConfig) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and fp32 accumulation."""
    if _use_torch_mm(a, cfg, "addmm"):
        try:
            with _Fp32Reductions():
                if a.dtype == torch.float32:
                    acc.addmm_(a, b)
                else:
                    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError) as ex:  # pragma: no cover - old torch
            _torch_mm_failed("addmm", ex)
    _mm(a, b, acc, True, cfg)


def gemm_store(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cfg: LCEConfig,
               tmp: Optional[torch.Tensor]) -> None:
    """``out = a @ b`` accumulated in fp32 and rounded once to ``out.dtype``."""
    same = a.dtype == torch.float32 or (tmp is None and out.dtype == a.dtype)
    op = "mm" if same else "mm_fp32"
    if _use_torch_mm(a, cfg, op):
        try:
            with _Fp32Reductions():
                if same:  # fp32 accumulation, rounded once into out (fp32 split-K reductions)
                    torch.mm(a, b, out=out)
                elif out.dtype == torch.float32:
                    torch.mm(a, b, out_dtype=torch.float32, out=out)
                else:
                    t = tmp[:out.shape[0]]
                    torch.mm(a, b, out_dtype=torch.float32, out=t)
                    out.copy_(t)
            return
        except (RuntimeError, TypeError) as ex:  # pragma: no cover - old torch
            _torch_mm_failed(op, ex)
    _mm(a, b, out, False, cfg)


def de_gemm(de: torch.Tensor, dz: torch.Tensor, c_chunk: torch.Tensor, cfg: LCEConfig,
            first: bool) -> None:
    """``dE (+)= dz @ c_chunk`` in fp32: the first vocabulary chunk stores, the others add.
    Storing spares a zero-fill of the fp32 ``(N, H)`` accumulator and one read of it (256 MiB
    each at N=16384, H=4096)."""
    if first:
        gemm_store(de, dz, c_chunk, cfg, None)
    else:
        gemm_acc(de, dz, c_chunk, cfg)


def backward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
             targets: torch.Tensor, v_offset: int, coef: torch.Tensor,
             softcap: Optional[float], need_de: bool, need_dc: bool, need_dbias: bool,
             config: Optional[LCEConfig] = None):
    """Gradients of ``sum_n [gp_n * lse_n - gt_n * x_{n,t_n} - gc_n * sum_j x_{n,j}]``.

    ``coef (4, N)`` fp32 rows: lse, gp, gt, gc. Returns ``(dE fp32 (N, H) or None,
    dC in c.dtype (V, H) or None, dbias fp32 (V,) or None)``.
    """
    cfg = config or default_config(e.device)
    N, H = e.shape
    V = c.shape[0]
    dev = e.device
    # dE is written by its first chunk's GEMM (``de_gemm``; V >= 1, checked by the caller)
    de = torch.empty((N, H), dtype=torch.float32, device=dev) if need_de else None
    dc = torch.empty_like(c, memory_format=torch.contiguous_format) if need_dc else None
    db = torch.empty((V,), dtype=torch.float32, device=dev) if need_dbias else None
    if N == 0:
        if dc is not None:
            dc.zero_()
        if db is not None:
            db.zero_()
        return de, dc, db
    if not (need_de or need_dc or need_dbias):
        return de, dc, db
    if cfg.bwd_mode == "chunked":
        return _backward_chunked(e, c, bias, targets, v_offset, coef, softcap, de, dc, db, cfg)
    if cfg.bwd_mode != "fused":
        raise ValueError(f"bwd_mode must be 'fused' or 'chunked', got {cfg.bwd_mode!r}")
    BN, BV, BH = cfg.bwd_block_n, cfg.bwd_block_v, cfg.bwd_block_h
    _check_tiles(BN, BV, BH)
    # Chunk width: a multiple of BLOCK_V whose (N, Vc) buffer fits chunk_bytes.
    per_col = N * e.element_size()
    vc = max(BV, (cfg.chunk_bytes // max(per_col, 1)) // BV * BV)
    vc = min(vc, triton.cdiv(V, BV) * BV)
    d = torch.empty((N, vc), dtype=e.dtype, device=dev)
    tmp, tmp_rows = _dc_staging(e, vc, cfg) if need_dc else (None, vc)
    num_rb = triton.cdiv(N, BN)
    db_part = torch.empty((num_rb, vc), dtype=torch.float32, device=dev) if bias is not None else None
    dot_prec = _dot_precision(e.dtype)
    desc = cfg.bwd_desc and _descriptors_ok(e, c)
    ea, ca = _operands(e, c, BN, BV, BH, desc)
    flat = desc and cfg.bwd_flat
    desc_out = desc and cfg.bwd_store_desc  # d's rows: vc (a multiple of BV) 16-bit elements
    for v0 in range(0, V, vc):
        nc = min(vc, V - v0)
        # the chunk's own columns, so that the copy engine drops what lies past them
        dd = TensorDescriptor.from_tensor(d[:, :nc], [BN, BV]) if desc_out else d
        tiles = num_rb * triton.cdiv(nc, BV)
        # flat: persistent programs, one per multiprocessor (each holds ~180 KB of shared
        # memory on sm_90, so a second would not fit anyway)
        grid = (min(tiles, multiprocessors(dev)) if flat else tiles,)
        _lce_dlogits_kernel[grid](
            ea, ca, bias if bias is not None else e, targets, coef, dd,
            db_part if db_part is not None else coef,
            N, V, H, v0, nc,
            e.stride(0), e.stride(1), c.stride(0), c.stride(1), targets.stride(0), d.stride(0), vc,
            v_offset, float(softcap) if softcap else 1.0,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap),
            EVEN_H=H % BH == 0, BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, GROUP_N=cfg.bwd_group_n,
            DOT_PREC=dot_prec, UPCAST=_upcast(e.dtype), DESC=desc, FLAT=flat, DESC_OUT=desc_out,
            num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages, **PINNED,
        )
        dz = d[:, :nc]
        if need_de:
            de_gemm(de, dz, c[v0:v0 + nc], cfg, first=v0 == 0)
        if need_dc:  # dC_chunk = dz.T @ e, rounded once
            for s0 in range(0, nc, tmp_rows):
                s1 = min(nc, s0 + tmp_rows)
                gemm_store(dc[v0 + s0:v0 + s1], dz[:, s0:s1].t(), e, cfg, tmp)
        if need_dbias:
            db[v0:v0 + nc] = db_part[:, :nc].sum(dim=0)
    return de, dc, db


def _needs_dc_staging(e: torch.Tensor, cfg: LCEConfig) -> bool:
    """``cfg.dc_staging``: cuBLAS computes dC in fp32 into a staging buffer, then it is rounded
    into ``dc``."""
    return cfg.dc_staging and _use_torch_mm(e, cfg, "mm_fp32") and e.dtype != torch.float32


def _dc_staging(e: torch.Tensor, cols: int, cfg: LCEConfig):
    """fp32 staging rows for ``dC`` (at most ~64 MiB) and how many; ``(None, cols)`` when no
    staging is needed."""
    if not _needs_dc_staging(e, cfg):
        return None, cols
    H = e.shape[1]
    # ~64 MiB, but never fewer than 256 rows (the accuracy of small-M GEMMs: chunk_align)
    rows = max(1, min(cols, max(256, (64 << 20) // (4 * max(H, 1)))))
    return torch.empty((rows, H), dtype=torch.float32, device=e.device), rows


def _backward_chunked(e, c, bias, targets, v_offset, coef, softcap, de, dc, db, cfg):
    """``bwd_mode="chunked"``: per block of ``Vc`` vocabulary columns (``chunk_bytes`` of
    dlogits in the input dtype), cuBLAS recomputes the fp32 logits in sub-blocks of
    ``x_chunk_bytes``, a row kernel turns each into dlogits, and the two gradient GEMMs read the
    whole block. The block is wide because ``dE += dz @ C_chunk`` re-reads and re-writes the fp32
    ``(N, H)`` accumulator once per block (K = Vc); the fp32 logits need not be as wide.
    Extra memory: the dlogits block + one fp32 sub-block (reused as staging for dC)."""
    N = e.shape[0]
    V = c.shape[0]
    vc = _chunk_len(V, cfg.chunk_bytes, N * e.element_size(), cfg.chunk_align)
    vx = _chunk_len(vc, cfg.x_chunk_bytes, 4 * N, cfg.chunk_align)
    xbuf = torch.empty((N, vx), dtype=torch.float32, device=e.device)
    # dlogits go over the fp32 logits in place when one sub-block covers the block
    dbuf = None if vx == vc else torch.empty((N, vc), dtype=e.dtype, device=e.device)
    H = e.shape[1]
    if (dc is not None and dbuf is not None and N * vx // H >= min(vc, 256)
            and _needs_dc_staging(e, cfg)):
        # the fp32 logits sub-block is free once a block's dlogits exist: stage dC rows there
        tmp_rows = min(vc, N * vx // H)
        tmp = xbuf.view(-1)[:tmp_rows * H].view(tmp_rows, H)
    else:
        tmp, tmp_rows = _dc_staging(e, vc, cfg) if dc is not None else (None, vc)
    for v0 in range(0, V, vc):
        nc = min(vc, V - v0)
        c_chunk = c[v0:v0 + nc]
        for s0 in range(0, nc, vx):
            s1 = min(nc, s0 + vx)
            x = xbuf[:, :s1 - s0]
            gemm_store(x, e, c[v0 + s0:v0 + s1].t(), cfg, None)
            dz = rows_dz_inplace(x, bias[v0 + s0:v0 + s1] if bias is not None else None,
                                 targets, v_offset + v0 + s0, coef, softcap, e.dtype, cfg,
                                 out=None if dbuf is None else dbuf[:, s0:s1])
        if dbuf is not None:
            dz = dbuf[:, :nc]
        if de is not None:
            de_gemm(de, dz, c_chunk, cfg, first=v0 == 0)
        if dc is not None:  # dC_chunk = dz.T @ e, rounded once
            for s0 in range(0, nc, tmp_rows):
                s1 = min(nc, s0 + tmp_rows)
                gemm_store(dc[v0 + s0:v0 + s1], dz[:, s0:s1].t(), e, cfg, tmp)
        if db is not None:  # from the rounded dz, like the grad-in-forward path
            db[v0:v0 + nc] = dz.sum(dim=0, dtype=torch.float32)
    return de, dc, db


# ----------------------------------------------------------------------------------------------
# Grad-in-forward path (scalar losses): materialized fp32 row chunks, 6NHV flops
# ----------------------------------------------------------------------------------------------


def gif_chunk_rows(n: int, v: int, cfg: LCEConfig) -> int:
    return max(1, min(n, cfg.gif_rows))


def gif_extra_bytes(n: int, v: int, h: int, cfg: LCEConfig) -> int:
    """Extra memory of the grad-in-forward path: logits chunk + fp32 dC and dE."""
    return gif_chunk_rows(n, v, cfg) * v * 4 + v * h * 4 + n * h * 4


def chunk_logits(e_rows: torch.Tensor, c: torch.Tensor, out: torch.Tensor,
                 cfg: LCEConfig) -> None:
    """``out (rows, V) fp32 = e_rows @ c.T`` with fp32 accumulation (bias/softcap come later)."""
    gemm_store(out, e_rows, c.t(), cfg, None)


def rows_stats(x: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
               v_offset: int, softcap: Optional[float], need_sumx: bool,
               cfg: LCEConfig, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(4, rows)`` statistics of materialized fp32 logits ``x (rows, V)`` (+ bias, softcap),
    written into ``out`` (a ``(4, rows)`` view with unit row stride) when given."""
    n, v = x.shape
    stats = torch.empty((4, n), dtype=torch.float32, device=x.device) if out is None else out
    assert stats.shape == (4, n) and stats.stride(1) == 1 and x.stride(1) == 1
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
                    dtype: torch.dtype, cfg: LCEConfig,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Overwrite the fp32 logits ``x (rows, V)`` (contiguous rows) with ``dz`` in ``dtype``, or
    write ``dz`` into ``out`` (``(rows, V)``, unit column stride) when given; returns ``dz``."""
    n, v = x.shape
    assert x.stride(1) == 1 and x.dtype == torch.float32
    if out is not None:
        assert out.shape == x.shape and out.stride(1) == 1 and out.dtype == dtype
        d = out
    elif dtype == torch.float32:
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
