"""Split scales: the power of two per row that brings an operand of an fp32 head's split
products into fp16's range (``common.dot``'s ``"h3"`` and ``"h2"``).

A row's largest magnitude times ``2^k`` lands in [2^14, 2^15), below fp16's 65504: every element
of the row then has fp16's range; those within 2^-16 of the largest keep the 22 bits of two fp16
parts, smaller ones lose a bit per halving (the low part goes subnormal), their absolute error
staying below 2^-39 of the largest. Powers of two scale exactly, so the
products are those of the unscaled operands, and a row's scale depends on that row alone.

One pass over the operand along any strides, with no temporary: PyTorch's reductions over a
dimension other than the innermost allocate a buffer of the operand's size on CUDA.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..launch import PINNED  # compile options every launch pins (FMA contraction)

#: The exponent a scaled row's largest magnitude gets
_TOP = 14
_BLOCK_L, _BLOCK_K = 32, 128


@triton.jit
def _row_amax_kernel(X, OUT, L, K, stride_l, stride_k, BLOCK_L: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < L
    cols = tl.arange(0, BLOCK_K)
    base = X + rows.to(tl.int64)[:, None] * stride_l
    amax = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        x = tl.load(base + k.to(tl.int64)[None, :] * stride_k,
                    mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    tl.store(OUT + rows, amax, mask=row_ok)


def _scales_of(amax: torch.Tensor) -> torch.Tensor:
    """``(L, 2)`` ``2^k, 2^-k`` of fp32 row maxima: ``amax`` lies in [2^(b - 127), 2^(b - 126))
    for its biased exponent ``b`` (0 for zeros and subnormals, 255 for inf / NaN); ``k`` is
    clamped to [-126, 126], where ``2^k`` and ``2^-k`` are normal fp32."""
    biased = (amax.view(torch.int32) >> 23) & 0xFF
    k = (_TOP + 127 - biased).clamp_(-126, 126)
    return torch.stack(((k + 127) << 23, (127 - k) << 23), dim=1).view(torch.float32)


def split_scales(x: torch.Tensor, dim: int, kernel: Optional[bool] = None) -> torch.Tensor:
    """``(L, 2)`` fp32 for 2-D ``x``: per row along ``dim`` (each slice of ``x`` reduced over
    ``dim``; ``L`` the other dimension's size), ``2^k`` and ``2^-k`` (the module docstring).
    A row of zeros, of inf or of NaN gets a normal scale and keeps its values' own result.

    ``kernel``: the row maxima from the Triton kernel (the default on CUDA) or from PyTorch's
    reductions (the default on the CPU, where they allocate nothing of ``x``'s size and the
    interpreter would run the kernel a program at a time); the same scales either way."""
    if x.dim() != 2 or dim not in (0, 1):
        raise ValueError(f"split_scales takes a 2-D tensor and dim 0 or 1, got {tuple(x.shape)} "
                         f"and {dim}")
    L, K = x.shape[1 - dim], x.shape[dim]
    if not (x.is_cuda if kernel is None else kernel):
        amax = (torch.zeros(L, device=x.device) if K == 0 else
                torch.linalg.vector_norm(x, float("inf"), dim=dim).float())
        return _scales_of(amax)
    amax = torch.empty((L,), dtype=torch.float32, device=x.device)
    if L:
        _row_amax_kernel[(triton.cdiv(L, _BLOCK_L),)](
            x, amax, L, K, x.stride(1 - dim), x.stride(dim), BLOCK_L=_BLOCK_L,
            BLOCK_K=_BLOCK_K, num_warps=4, **PINNED)
    return _scales_of(amax)
