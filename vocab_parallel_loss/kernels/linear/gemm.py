"""The gradient GEMMs of the fused linear loss, always with fp32 accumulation: cuBLAS through
PyTorch (``LCEConfig.matmul="torch"``) or ``_mm_kernel``, a tiled Triton GEMM (``"triton"``, the
interpreter, and a PyTorch without the fp32-output overloads).

``gemm_acc`` adds into an fp32 accumulator (``dE += dz @ C_chunk``); ``gemm_store`` writes once,
rounded to the output dtype (``dC_chunk = dz.T @ E``), so every output element is rounded once.

With ``skip`` (a one-element int32 device tensor) both run on ``_mm_kernel``, whose programs read
it and return at once when it is nonzero: a GEMM that the device decides to leave out, with no
host sync (``gated.py``).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from ..launch import PINNED  # compile options every launch pins (FMA contraction)
from .common import (SCALED, check_tiles, dot, dot_mode, load_scales, unscale,
                     upcast)
from .config import LCEConfig
from .scales import split_scales


@triton.jit
def _mm_kernel(
    A, B, SA, SB, OUT, M, NN, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
    ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    SKIP, GATED: tl.constexpr,
):
    """``OUT (+)= A @ B`` with an fp32 accumulator; ``A (M, K)``, ``B (K, NN)``, any strides.
    ``SA`` / ``SB``: the split scales of A's rows and B's columns in the modes that scale.
    With ``GATED`` every program returns at once when ``SKIP[0]`` is nonzero."""
    if GATED:
        if tl.load(SKIP) != 0:
            return
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
    sa, ra = load_scales(SA, tl.where(m_ok, offs_m, 0), DOT_PREC)
    sb, rb = load_scales(SB, tl.where(n_ok, offs_n, 0), DOT_PREC)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            km = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & km[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=km[:, None] & n_ok[None, :], other=0.0)
        acc = dot(a, b, acc, DOT_PREC, UPCAST, sa, sb)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = unscale(acc, ra, rb, DOT_PREC)
    mask = m_ok[:, None] & n_ok[None, :]
    o_ptrs = OUT + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool,
        cfg: LCEConfig, skip=None) -> None:
    M, K = a.shape
    NN = b.shape[1]
    if M == 0 or NN == 0:
        return
    if K == 0:
        if not accumulate:
            if skip is None:
                out.zero_()
            else:  # zeros unless skipped, decided on the device
                out.copy_(torch.where(skip != 0, out, torch.zeros((), dtype=out.dtype,
                                                                  device=out.device)))
        return
    BM, BN, BK = cfg.mm_block_m, cfg.mm_block_n, cfg.mm_block_k
    stages = cfg.mm_stages
    if a.element_size() == 4 or b.element_size() == 4:  # fp32 tiles: fit the stages in smem
        BK = min(BK, cfg.wide_block_h)
        stages = min(stages, cfg.wide_mm_stages)
    check_tiles(BM, BN, BK)
    grid = (triton.cdiv(M, BM) * triton.cdiv(NN, BN),)
    mode = dot_mode(a.dtype, b.dtype, cfg.fp32_precision)
    sa, sb = ((split_scales(a, 1), split_scales(b, 0)) if mode in SCALED else (out, out))
    _mm_kernel[grid](
        a, b, sa, sb, out, M, NN, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        ACCUMULATE=accumulate, EVEN_K=K % BK == 0, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
        GROUP_M=cfg.mm_group_m, DOT_PREC=mode,
        UPCAST=upcast(), SKIP=out if skip is None else skip, GATED=skip is not None,
        num_warps=cfg.mm_warps, num_stages=stages, **PINNED,
    )


#: Whether cuBLAS works here through ``torch.mm`` (output in the input dtype), ``torch.mm``
#: with ``out_dtype=torch.float32`` and ``torch.addmm`` with it (probed on first use; older
#: PyTorch lacks ``out_dtype`` or requires ``self`` in the input dtype). Kept apart, so that a
#: PyTorch without ``out_dtype`` still runs dC through cuBLAS.
TORCH_DTYPE_MM = {"mm": True, "mm_fp32": True, "addmm": True}


def _use_torch_mm(a: torch.Tensor, b: torch.Tensor, cfg: LCEConfig, op: str) -> bool:
    # fp32 operands take the Triton GEMM: cuBLAS has no split products on Hopper (its fp32 runs
    # on CUDA cores, or in TF32 when PyTorch's global flag allows it) and no mixed dtypes
    return (cfg.matmul == "torch" and a.is_cuda and TORCH_DTYPE_MM[op]
            and a.element_size() == 2 and b.element_size() == 2)


def _torch_mm_failed(op: str, ex: Exception) -> None:
    TORCH_DTYPE_MM[op] = False
    call = {"mm": "torch.mm", "mm_fp32": "torch.mm(out_dtype=torch.float32)",
            "addmm": "torch.addmm(out_dtype=torch.float32)"}[op]
    warnings.warn(f"{call} unavailable ({ex!r}); using the Triton GEMM where it was used",
                  RuntimeWarning, stacklevel=3)


class _Fp32Reductions:
    """PyTorch lets cuBLAS reduce split-K partial sums in bf16/fp16 by default; our GEMMs promise
    fp32 accumulation, so they turn that off for themselves."""

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


def gemm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cfg: LCEConfig,
             skip=None) -> None:
    """``acc += a @ b`` accumulated in fp32 and rounded once into ``acc`` (fp32, or any float
    dtype: a bf16 ``main_grad`` gets ``round(acc + a @ b)``, not the sum of two roundings).
    ``skip``: left out where the device flag is nonzero (the module docstring)."""
    same = acc.dtype == a.dtype
    if skip is None and (same or acc.dtype == torch.float32) and _use_torch_mm(a, b, cfg, "addmm"):
        try:
            with _Fp32Reductions():
                if same:  # cuBLAS reads acc into its fp32 accumulator (beta = 1)
                    acc.addmm_(a, b)
                else:
                    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError) as ex:  # pragma: no cover - old torch
            _torch_mm_failed("addmm", ex)
    _mm(a, b, acc, True, cfg, skip)


def gemm_store(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cfg: LCEConfig,
               skip=None) -> None:
    """``out = a @ b`` accumulated in fp32 and rounded once to ``out.dtype`` (``a``'s dtype or
    fp32). ``skip``: left out where the device flag is nonzero (the module docstring)."""
    same = out.dtype == a.dtype
    op = "mm" if same else "mm_fp32"
    if skip is None and _use_torch_mm(a, b, cfg, op):
        try:
            with _Fp32Reductions():
                if same:  # fp32 accumulation, rounded once into out (fp32 split-K reductions)
                    torch.mm(a, b, out=out)
                else:
                    torch.mm(a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError) as ex:  # pragma: no cover - old torch
            _torch_mm_failed(op, ex)
    _mm(a, b, out, False, cfg, skip)
