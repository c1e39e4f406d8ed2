"""The saved-tiles strategy of the fused linear loss: 6NHV for any upstream gradient.

The forward kernel (``fused.forward_stats`` with ``saved=``) writes, next to the statistics,
every logits tile as ``u = exp(x - mt)`` in the input dtype, with ``mt`` the tile's row max
(fp32, one per row and ``BLOCK_V`` columns). Backward needs no recomputation: one memory-bound
pass turns ``u`` into ``dz`` in place (``softmax = u * exp(mt - lse)``; the target column
from its exact fp32 logit), then two cuBLAS GEMMs over the whole local vocabulary give
``dE = dz @ C`` and ``dC = dz.T @ E``, each accumulated in fp32 and rounded once.

Why ``u`` and not the logits: ``u`` lies in (0, 1], so bf16 keeps 8 significant bits of every
probability, as the bf16 ``dz`` that feeds the GEMMs keeps anyway; bf16 logits would lose
``|x| * 2**-9`` in the exponent (4% of a probability at ``|x| = 20``).

Memory: ``N x V`` elements of the input dtype plus ``N x V / BLOCK_V`` fp32 tile maxima, held
from forward to backward (``saved_bytes``). Under a smaller budget only the first columns are
saved and backward recomputes the rest (``fused.backward``, 8NHV on those), adding into the same
fp32 dE.

For a scalar loss the same tiles, a chunk of rows at a time, let the forward form both
gradients (``LCEConfig.strategy`` "grad_in_forward", ``autograd/linear.py``): each chunk's
statistics are complete once its tiles are folded, so ``dz`` follows at once; dE rows are one
GEMM each, dC accumulates over the chunks in fp32 (``gif_chunk_rows`` sizes them to a budget).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ..launch import PINNED  # compile options every launch pins (FMA contraction)
from .common import LOWEST, LogprobArgs
from .config import LCEConfig
from .gemm import gemm_acc, gemm_store

#: Row stride of ``u`` in elements is a multiple of this: 16-byte aligned rows for cuBLAS.
_ROW_ALIGN = 8


@dataclasses.dataclass
class SavedTiles:
    """``u (N, V)`` in the input dtype (rows 16-byte aligned) and ``tile_max (V / block_v, N)``
    fp32; ``block_v`` is the forward's tile width, which ``tile_max`` is indexed by."""

    u: torch.Tensor
    tile_max: torch.Tensor
    block_v: int


def _padded(v: int) -> int:
    return triton.cdiv(v, _ROW_ALIGN) * _ROW_ALIGN


def saved_bytes(n: int, v: int, element_size: int, cfg: LCEConfig) -> int:
    """Bytes ``saved_tiles`` allocates for ``n`` rows of ``v`` columns."""
    cfg = cfg.for_tiles(torch.float32 if element_size == 4 else torch.bfloat16)
    return n * _padded(v) * element_size + triton.cdiv(v, cfg.fwd_block_v) * n * 4


def saved_tiles(n: int, v: int, dtype: torch.dtype, device: torch.device,
                cfg: LCEConfig) -> SavedTiles:
    cfg = cfg.for_tiles(dtype)
    u = torch.empty((n, _padded(v)), dtype=dtype, device=device)[:, :v]
    tile_max = torch.empty((triton.cdiv(v, cfg.fwd_block_v), n), dtype=torch.float32,
                           device=device)
    return SavedTiles(u, tile_max, cfg.fwd_block_v)


@triton.jit
def _saved_dz_kernel(
    U, MT, TGT, COEF, INV_T, N, V, stride_un, stride_t, stride_it, v_offset, softcap, scale,
    HAS_SOFTCAP: tl.constexpr, LOGPROB: tl.constexpr, TILE_V: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: ``dz = (gp * softmax - gt * onehot - gc) * dx/dz`` over ``u``, in place.

    COEF is ``(5, N)`` fp32: lse, gp (softmax weight), gt (one-hot weight), gc (constant) and
    the target's logit, which gives the target column's probability (and softcap slope)
    exactly instead of through its rounded ``u``. Elsewhere the logit is ``mt + log u`` (for
    the softcap slope clamped to the cap). With ``LOGPROB`` the logits are ``cap(scale z) / T``
    and a sixth row ``gx`` adds ``gx * softmax * (x - lse)`` (the entropy's term).
    """
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(COEF + row)
    gp = tl.load(COEF + N + row)
    gt = tl.load(COEF + 2 * N + row)
    gc = tl.load(COEF + 3 * N + row)
    xt = tl.load(COEF + 4 * N + row)
    inv_t = 1.0
    gx = 0.0
    if LOGPROB:
        inv_t = tl.load(INV_T + row * stride_it).to(tl.float32)
        gx = tl.load(COEF + 5 * N + row)
        xt = tl.maximum(xt, LOWEST)  # a masked target: gx * pt * (xt - lse) is 0, not NaN
    t = tl.load(TGT + row * stride_t).to(tl.int64) - v_offset
    t_local = tl.where((t >= 0) & (t < V), t, -1).to(tl.int32)
    pt = tl.exp(xt - lse)
    u_row = U + row * stride_un
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        u = tl.load(u_row + cols, mask=mask, other=0.0).to(tl.float32)
        mt = tl.load(MT + (cols // TILE_V).to(tl.int64) * N + row, mask=mask, other=0.0)
        onehot = cols == t_local
        p = tl.where(onehot, pt, u * tl.exp(mt - lse))
        dx = gp * p - gc - tl.where(onehot, gt, 0.0)
        if LOGPROB or HAS_SOFTCAP:
            # (an underflowed u has probability 0: its dx is 0 whatever its logit)
            x = tl.where(onehot, xt, mt + tl.log(tl.maximum(u, 1e-30)))
        if LOGPROB:
            dx += gx * p * (x - lse)
        if HAS_SOFTCAP:
            th = (x / inv_t) / softcap
            th = tl.minimum(tl.maximum(th, -1.0), 1.0)
            dx = dx * (1.0 - th * th)
        if LOGPROB:
            dx = dx * (scale * inv_t)
        tl.store(u_row + cols, dx.to(U.dtype.element_ty), mask=mask)


def rows_of(saved: SavedTiles, rows: int) -> SavedTiles:
    """The first ``rows`` rows of a buffer from ``saved_tiles``, as tiles of ``rows`` rows (the
    tile maxima re-laid out densely: the kernels index them by the row count)."""
    nt = saved.tile_max.shape[0]
    return SavedTiles(saved.u[:rows], saved.tile_max.view(-1)[:nt * rows].view(nt, rows),
                      saved.block_v)


def saved_dz_inplace(saved: SavedTiles, targets: torch.Tensor, v_offset: int,
                     coef: torch.Tensor, softcap: Optional[float], cfg: LCEConfig,
                     logprob: Optional[LogprobArgs] = None) -> torch.Tensor:
    """Turn the saved tiles into ``dz`` in place (``_saved_dz_kernel``) and return it."""
    dz = saved.u
    n, v = dz.shape
    if n:
        inv_t = coef if logprob is None else logprob.inv_t
        _saved_dz_kernel[(n,)](
            dz, saved.tile_max, targets, coef, inv_t, n, v, dz.stride(0), targets.stride(0),
            0 if inv_t.numel() == 1 else inv_t.stride(0), v_offset,
            float(softcap) if softcap else 1.0, 1.0 if logprob is None else float(logprob.scale),
            HAS_SOFTCAP=bool(softcap), LOGPROB=logprob is not None,
            TILE_V=saved.block_v, BLOCK=cfg.row_block, num_warps=cfg.row_warps, **PINNED)
    return dz


def gif_chunk_rows(n: int, v: int, element_size: int, room: float, cfg: LCEConfig) -> int:
    """Rows per chunk of the gradients formed in forward when ``room`` bytes are left for one
    chunk's saved tiles: at most ``cfg.gif_rows``, chunks of equal size in whole row blocks; 0
    when fewer than ``cfg.gif_min_blocks`` row blocks (or ``cfg.gif_rows``, or all ``n``) fit:
    smaller chunks cost more in dC's per-chunk GEMM and fp32 read-modify-write than the
    recomputation they save (``LCEConfig.for_tiles`` asks more of fp32 tiles)."""
    per_row = saved_bytes(1, v, element_size, cfg)
    fit = min(cfg.gif_rows, int(room // per_row)) if room > 0 else 0
    block = cfg.fwd_block_n
    if fit < min(n, cfg.gif_rows, cfg.gif_min_blocks * block):
        return 0
    if fit >= n:
        return max(n, 1)
    chunks = triton.cdiv(n, fit)
    while True:  # the same work per chunk, each a whole number of row blocks
        rows = triton.cdiv(triton.cdiv(n, chunks), block) * block
        if rows <= fit:
            return rows
        chunks += 1


def backward_saved(saved: SavedTiles, e: torch.Tensor, c: torch.Tensor, bias_needs_grad: bool,
                   targets: torch.Tensor, v_offset: int, coef: torch.Tensor,
                   softcap: Optional[float], need_de: bool, need_dc: bool,
                   de_dtype: torch.dtype, cfg: LCEConfig, dc_out: Optional[torch.Tensor] = None,
                   logprob: Optional[LogprobArgs] = None, dc_acc: Optional[torch.Tensor] = None):
    """Gradients from saved tiles, which this consumes (``u`` becomes ``dz``). ``coef (5, N)``
    (``_saved_dz_kernel``; ``(6, N)`` with ``logprob``); ``c`` holds the saved columns. Returns
    ``(dE (N, H) in de_dtype or None, dC in c.dtype or None (in ``dc_out`` when given; None
    when added into ``dc_acc``, rounded once there), dbias fp32 (V,) or None)``."""
    n, h = e.shape
    dz = saved_dz_inplace(saved, targets, v_offset, coef, softcap, cfg, logprob)
    de = dc = db = None
    if need_de:
        de = torch.empty((n, h), dtype=de_dtype, device=e.device)
        gemm_store(de, dz, c, cfg)
    if need_dc and dc_acc is not None:
        if n:
            gemm_acc(dc_acc, dz.t(), e, cfg)
    elif need_dc:
        dc = dc_out if dc_out is not None else torch.empty_like(
            c, memory_format=torch.contiguous_format)
        if n:
            gemm_store(dc, dz.t(), e, cfg)
        else:
            dc.zero_()
    if bias_needs_grad:
        db = dz.sum(dim=0, dtype=torch.float32)
    return de, dc, db
