"""Helpers the kernel files of the fused linear loss share: the products of ``tl.dot`` per
operand dtype and precision (split products for fp32 operands), operand handling under the
interpreter, the tile-size check, a portable tanh, and
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


def upcast() -> bool:
    # Triton's interpreter (3.9) feeds bf16 operands of tl.dot to numpy as their raw uint16 bits;
    # upcasting first is exact (16-bit x 16-bit products fit fp32), as the tensor cores compute.
    return settings.interpreting()


#: The split product for two fp32 operands under ``"fp32"`` (``dot``'s ``DOT``)
FP32_SPLIT = "x6"


def dot_mode(a: torch.dtype, b: torch.dtype, precision: str = "fp32") -> str:
    """The ``DOT`` constexpr of ``dot`` for operands of dtypes ``a`` and ``b`` and the call's
    ``precision`` (``checks.FP32_PRECISIONS``).

    Two 16-bit operands: one tensor-core product (the string is not read). An fp32 operand
    under ``"tf32"``: TF32 products. Under ``"fp32"``: a bf16 operand and an fp32 one take
    ``"w3"`` (the fp32 one split into three bf16 parts, hi + mid + lo, which hold its 24-bit
    significand: three bf16 products, each exact in the fp32 accumulator); otherwise both
    operands widened to fp32 and multiplied in ``FP32_SPLIT``.
    """
    wide = torch.float32 in (a, b)
    if not wide:
        return "tf32"
    if precision == "tf32":
        return "tf32"
    if {a, b} == {torch.bfloat16, torch.float32}:
        return "w3"
    return FP32_SPLIT


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype of the logits' gradient tiles and saved tiles for hidden states of dtype ``a``
    and classifier rows of dtype ``b``: fp32 when either is (an fp32 head keeps fp32-class
    gradients), else the shared 16-bit dtype."""
    return torch.float32 if torch.float32 in (a, b) else a


@triton.jit
def _split3(x):
    """fp32 ``x`` as three bf16 parts ``hi + mid + lo``: 24 significand bits, x's own."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _part(x, UPCAST: tl.constexpr):
    if UPCAST:  # interpreter only: its bf16 dot multiplies the raw uint16 bits
        return x.to(tl.float32)
    return x


@triton.jit
def dot(a, b, acc, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32 for the mode ``DOT`` (``dot_mode``). In ``"w3"`` the fp32
    operand is split (``_split3``), in ``"x6"`` both are (leaving out the products of parts
    i + j > 2, each under 2^-26 of |a||b|). The split products go into a fresh accumulator,
    smallest first, added to ``acc`` in fp32: the tensor cores truncate each sum they form to the
    largest term's precision, so summing into ``acc`` itself would drop part of every small
    product and bias the result by one unit of ``acc`` per product (1e-4 relative at H = 4096)."""
    if DOT == "x6":
        a0, a1, a2 = _split3(a.to(tl.float32))
        b0, b1, b2 = _split3(b.to(tl.float32))
        a0, a1, a2 = _part(a0, UPCAST), _part(a1, UPCAST), _part(a2, UPCAST)
        b0, b1, b2 = _part(b0, UPCAST), _part(b1, UPCAST), _part(b2, UPCAST)
        step = tl.dot(a2, b0)
        step = tl.dot(a1, b1, step)
        step = tl.dot(a0, b2, step)
        step = tl.dot(a1, b0, step)
        step = tl.dot(a0, b1, step)
        acc += tl.dot(a0, b0, step)
    elif DOT == "w3":
        if a.dtype == tl.float32:
            hi, mid, lo = _split3(a)
            b = _part(b, UPCAST)
            step = tl.dot(_part(lo, UPCAST), b)
            step = tl.dot(_part(mid, UPCAST), b, step)
            acc += tl.dot(_part(hi, UPCAST), b, step)
        else:
            hi, mid, lo = _split3(b)
            a = _part(a, UPCAST)
            step = tl.dot(a, _part(lo, UPCAST))
            step = tl.dot(a, _part(mid, UPCAST), step)
            acc += tl.dot(a, _part(hi, UPCAST), step)
    else:
        if a.dtype != b.dtype:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(_part(a, UPCAST), _part(b, UPCAST), acc, input_precision=DOT)
    return acc


def check_tiles(*blocks: int) -> None:
    for b in blocks:
        if b < 16 or b & (b - 1):
            raise ValueError(f"tile sizes must be powers of two >= 16, got {b}")


@triton.jit
def tanh(x):
    # exp-based tanh: saturates to +-1 (exp overflow -> inf -> 2/inf = 0), portable across
    # backends and the interpreter.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
