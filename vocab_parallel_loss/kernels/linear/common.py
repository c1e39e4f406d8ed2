"""Helpers the kernel files of the fused linear loss share: operand handling for ``tl.dot``
under the interpreter, the dot precision per dtype, the tile-size check, a portable tanh, and
the arguments of the kernels' log-prob mode (``formulas.LogprobArgs``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import formulas, settings
from ...formulas import LogprobArgs  # noqa: F401  (the kernels' log-prob mode)


#: ``formulas.LOG_UNDERFLOW`` for the kernels
LOG_UNDERFLOW = tl.constexpr(formulas.LOG_UNDERFLOW)
#: The lowest finite fp32: a -inf logit's stand-in where it meets a probability of 0 (``0 *
#: -inf`` is NaN, ``0 * LOWEST`` is 0) or is subtracted from one (a tile max of -inf)
LOWEST = tl.constexpr(-3.4028234663852886e38)


def upcast(dtype: torch.dtype) -> bool:
    # Triton's interpreter (3.9) feeds bf16 operands of tl.dot to numpy as their raw uint16 bits;
    # upcasting first is exact (bf16 x bf16 products fit fp32), as the tensor cores compute.
    return dtype == torch.bfloat16 and settings.interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full precision ("tf32" would silently drop 13 mantissa bits on the GPU).
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tiles(*blocks: int) -> None:
    for b in blocks:
        if b < 16 or b & (b - 1):
            raise ValueError(f"tile sizes must be powers of two >= 16, got {b}")


@triton.jit
def tanh(x):
    # exp-based tanh: saturates to +-1 (exp overflow -> inf -> 2/inf = 0), portable across
    # backends and the interpreter.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
