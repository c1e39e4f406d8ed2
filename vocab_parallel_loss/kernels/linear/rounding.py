"""Rounding an fp32 gradient accumulator, scaled by a device scalar, once into the output dtype.

The gradients formed in forward (``saved.py``) wait in fp32 for the loss's upstream gradient.
PyTorch's ``torch.mul(acc, g, out=bf16)`` takes its dynamically casting elementwise path, which
reads and writes at a third of the bandwidth; this kernel reads 4 bytes and writes 2 per element
in one pass, and takes ``g`` by pointer, so nothing waits for the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import PINNED  # compile options every launch pins (FMA contraction)

_BLOCK = 4096


@triton.jit
def _scaled_round_kernel(SRC, SCALE, OUT, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(SCALE).to(tl.float32)
    x = tl.load(SRC + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, (x * g).to(OUT.dtype.element_ty), mask=mask)


def scaled_round(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = round(src * scale)``: ``src`` fp32 and ``out`` of the same shape, both
    contiguous (``out`` may be ``src``: scaled in place); ``scale`` one element on the same
    device. Returns ``out``."""
    if src.dtype != torch.float32 or not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError("scaled_round takes a contiguous fp32 src and a contiguous out")
    if src.shape != out.shape or scale.numel() != 1:
        raise ValueError(f"scaled_round: src {tuple(src.shape)}, out {tuple(out.shape)}, "
                         f"scale of {scale.numel()} elements")
    n = src.numel()
    if n:
        _scaled_round_kernel[(triton.cdiv(n, _BLOCK),)](src, scale, out, n, BLOCK=_BLOCK,
                                                        num_warps=8, **PINNED)
    return out
