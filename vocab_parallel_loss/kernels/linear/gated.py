"""Kernels the device decides to leave out: a one-element int32 flag that the programs read
first, returning at once where it is nonzero.

The gradients formed in forward for an upstream gradient proportional to a loss mask
(``ops/linear_cross_entropy/masked.py``) are right only when backward's upstream gradient turns
out to be that; whether it is, is known on the device only. The exact gradient for any other
upstream gradient is therefore always launched, and its kernels skip themselves when the flag
says the formed gradients hold: the recompute pass (``fused._lce_dlogits_kernel`` with
``GATED``), its GEMMs (``gemm._mm_kernel``, the Triton GEMM: cuBLAS cannot read a flag), and
``zero_unless`` here, which clears the formed accumulators before the recompute adds into them.
No host sync, so a step stays capturable in a CUDA graph; a skipped launch costs its launch and
one load per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import PINNED  # compile options every launch pins (FMA contraction)

_BLOCK = 4096


@triton.jit
def _zero_unless_kernel(OUT, SKIP, numel, BLOCK: tl.constexpr):
    if tl.load(SKIP) != 0:
        return
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + offs, tl.zeros((BLOCK,), dtype=OUT.dtype.element_ty), mask=offs < numel)


def zero_unless(skip: torch.Tensor, *tensors) -> None:
    """Fill each contiguous tensor of ``tensors`` (None entries are passed over) with zeros
    unless ``skip`` (one int32 element on their device) is nonzero."""
    for t in tensors:
        if t is None or not t.numel():
            continue
        if not t.is_contiguous():
            raise ValueError("zero_unless takes contiguous tensors")
        n = t.numel()
        _zero_unless_kernel[(triton.cdiv(n, _BLOCK),)](t, skip, n, BLOCK=_BLOCK, num_warps=4,
                                                       **PINNED)
