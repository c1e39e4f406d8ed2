"""fp16 parts in memory: an operand of an fp32 head's split products, scaled per row by its
split scale (``scales.split_scales``) and split once into ``hi + lo`` fp16 tensors, so that the
forward's K loop reads 16-bit tiles through TMA descriptors and runs only the products
(``common.dot`` splits each tile in registers on every visit instead).

The parts are the bits ``common.dot`` forms in registers (the same scaling and round-to-nearest
conversions), so a logit is the same sum of the same products either way. Rows are padded to a
multiple of 8 elements (16 bytes, what a descriptor's row stride needs); the tensors returned are
views of the unpadded width.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..launch import PINNED  # compile options every launch pins (FMA contraction)

_BLOCK_L, _BLOCK_K = 32, 128


@triton.jit
def _parts_kernel(X, S, HI, LO, L, K, stride_l, stride_k, stride_p, WITH_LO: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < L)[:, None] & (cols < K)[None, :]
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    s = tl.load(S + r64 * 2, mask=rows < L, other=1.0)
    x = tl.load(X + r64[:, None] * stride_l + c64[None, :] * stride_k, mask=mask, other=0.0)
    x = x.to(tl.float32) * s[:, None]
    hi = x.to(tl.float16)
    out = r64[:, None] * stride_p + c64[None, :]
    tl.store(HI + out, hi, mask=mask)
    if WITH_LO:
        tl.store(LO + out, (x - hi.to(tl.float32)).to(tl.float16), mask=mask)


def fp16_parts(x: torch.Tensor, scales: torch.Tensor, with_lo: bool,
               kernel: Optional[bool] = None):
    """``(hi, lo)`` fp16 ``(L, K)`` of 2-D ``x`` scaled per row by ``scales[:, 0]``
    (``split_scales(x, 1)``): ``hi`` the scaled values rounded to fp16, ``lo`` (with
    ``with_lo``, else None) their remainders rounded to fp16. A 16-bit ``x`` takes ``hi`` alone
    (exact: fp16 holds bf16's 8 significand bits in the scaled range).

    ``kernel``: the Triton kernel (the default on CUDA) or PyTorch's elementwise ops (the default
    on the CPU, whose temporaries are of ``x``'s size; the interpreter would run the kernel a
    program at a time); the same bits either way."""
    L, K = x.shape
    width = -(-K // 8) * 8
    buf = torch.empty((2 if with_lo else 1, L, width), dtype=torch.float16, device=x.device)
    hi, lo = buf[0, :, :K], (buf[1, :, :K] if with_lo else None)
    if not (x.is_cuda if kernel is None else kernel):
        xs = x.float() * scales[:, :1]
        hi.copy_(xs)
        if with_lo:
            lo.copy_(xs - hi.float())
        return hi, lo
    if L and K:
        _parts_kernel[(triton.cdiv(L, _BLOCK_L), triton.cdiv(K, _BLOCK_K))](
            x, scales, hi, lo if with_lo else hi, L, K, x.stride(0), x.stride(1), width,
            WITH_LO=with_lo, BLOCK_L=_BLOCK_L, BLOCK_K=_BLOCK_K, num_warps=4, **PINNED)
    return hi, lo
