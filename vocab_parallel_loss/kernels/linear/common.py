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
    """The ``UPCAST`` constexpr of ``dot``: under the interpreter its products run in fp64
    (``_exact``)."""
    return settings.interpreting()


#: The modes of ``dot`` whose operands are scaled per row into fp16's range and taken as fp16
#: parts: their kernels take the scales (``scales.split_scales``) and unscale the accumulator
#: once (``unscale``)
SCALED = ("h3", "h2", "h1")


def dot_mode(a: torch.dtype, b: torch.dtype, precision: str = "fp32") -> str:
    """The ``DOT`` constexpr of ``dot`` for operands of dtypes ``a`` and ``b`` and the call's
    ``precision`` (``checks.FP32_PRECISIONS``).

    Two 16-bit operands: one tensor-core product (the string is not read). With an fp32
    operand, each operand is scaled by a power of two per row (``scales.split_scales``) into
    fp16's range. Under ``"fp32"`` an fp32 one is split into two fp16 parts, ``hi + lo``, which
    hold 22 of its 24 significand bits: two fp32 operands take ``"h3"`` (three fp16 products,
    the fourth, ``lo lo``, under 2^-22 of ``|a||b|``), a 16-bit and an fp32 one ``"h2"`` (the
    16-bit one is one fp16 part: two products). Under ``"tf32"`` both take ``"h1"``: one fp16
    product of the ``hi`` parts, TF32's precision (11 significand bits, rounded to nearest) at
    the fp16 rate, twice TF32's, and with no layout restriction (TF32 tensor-core products
    need both operands K-major in shared memory, which the gradient GEMMs' ``dz.T`` is not).
    """
    if torch.float32 not in (a, b):
        return "tf32"
    if precision == "tf32":
        return "h1"
    return "h3" if a == b else "h2"


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype of the logits' gradient tiles and saved tiles for hidden states of dtype ``a``
    and classifier rows of dtype ``b``: fp32 when either is (an fp32 head keeps fp32-class
    gradients), else the shared 16-bit dtype."""
    return torch.float32 if torch.float32 in (a, b) else a


@triton.jit
def load_scales(S, idx, DOT: tl.constexpr):
    """The scales of rows ``idx`` (``scales.split_scales``' ``(L, 2)``): ``2^k`` and ``2^-k``; ones
    for the modes that do not scale."""
    if DOT == "h3" or DOT == "h2" or DOT == "h1":
        s = tl.load(S + idx.to(tl.int64) * 2)
        r = tl.load(S + idx.to(tl.int64) * 2 + 1)
    else:
        s = tl.full(idx.shape, 1.0, tl.float32)
        r = s
    return s, r


@triton.jit
def unscale(acc, ra, rb, DOT: tl.constexpr):
    """The accumulator of scaled operands' products back to the operands' own scale (exact:
    powers of two)."""
    if DOT == "h3" or DOT == "h2" or DOT == "h1":
        acc = acc * ra[:, None] * rb[None, :]
    return acc


@triton.jit
def _fp16_parts(x):
    """scaled fp32 ``x`` as two fp16 parts ``hi + lo`` (11 + 11 significand bits)."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


@triton.jit
def _exact(a, b):
    """``a @ b`` in fp64, for the interpreter: exact for 16-bit parts (nearly for fp32 ones),
    where numpy's fp32 matmul rounds its sums in an order that depends on a row's place in the
    tile (a row's result would depend on the rows around it), and its 16-bit matmul multiplies
    the raw bits."""
    return tl.dot(a.to(tl.float64), b.to(tl.float64))


@triton.jit
def parts_dot(e, e_lo, c, c_lo, acc, LO_E: tl.constexpr, LO_C: tl.constexpr,
              UPCAST: tl.constexpr):
    """One K step of the ``"h3"`` / ``"h2"`` / ``"h1"`` products: ``e`` and ``c`` the fp16
    ``hi`` parts (or the one fp16 part of a 16-bit operand), ``e_lo`` / ``c_lo`` the ``lo``
    parts where ``LO_E`` / ``LO_C`` (else unread; neither: ``"h1"``'s one product); split
    products smallest first into a fresh step accumulator (``dot``). ``dot`` calls it on parts
    split in registers, the parts forward on parts split in memory (``parts.py``): one order of
    products for both."""
    if LO_E and LO_C:
        if UPCAST:
            acc += (_exact(e_lo, c) + _exact(e, c_lo) + _exact(e, c)).to(tl.float32)
        else:
            step = tl.dot(e_lo, c)
            step = tl.dot(e, c_lo, step)
            acc += tl.dot(e, c, step)
    elif LO_E:
        if UPCAST:
            acc += (_exact(e_lo, c) + _exact(e, c)).to(tl.float32)
        else:
            acc += tl.dot(e, c, tl.dot(e_lo, c))
    elif LO_C:
        if UPCAST:
            acc += (_exact(e, c_lo) + _exact(e, c)).to(tl.float32)
        else:
            acc += tl.dot(e, c, tl.dot(e, c_lo))
    elif UPCAST:
        acc += _exact(e, c).to(tl.float32)
    else:  # one product: into acc, as any fp16 GEMM with an fp32 accumulator
        acc = tl.dot(e, c, acc)
    return acc


@triton.jit
def dot(a, b, acc, DOT: tl.constexpr, UPCAST: tl.constexpr, sa, sb):
    """``acc + a @ b`` in fp32 for the mode ``DOT`` (``dot_mode``); ``sa`` per row of ``a`` and
    ``sb`` per column of ``b`` are the split scales (``load_scales``), and the accumulator of
    a scaled mode (``SCALED``) is of the scaled operands (``unscale`` it once after the last
    step). Each K step's split products go into a fresh accumulator, smallest first, added to
    ``acc`` in fp32: the tensor cores truncate each sum they form to the largest term's
    precision, so summing into ``acc`` itself would drop part of every small product and bias
    the result by one unit of ``acc`` per product (1e-4 relative at H = 4096)."""
    if DOT == "h3":
        a_hi, a_lo = _fp16_parts(a.to(tl.float32) * sa[:, None])
        b_hi, b_lo = _fp16_parts(b.to(tl.float32) * sb[None, :])
        acc = parts_dot(a_hi, a_lo, b_hi, b_lo, acc, True, True, UPCAST)
    elif DOT == "h2":
        if a.dtype == tl.float32:
            hi, lo = _fp16_parts(a * sa[:, None])
            b = (b.to(tl.float32) * sb[None, :]).to(tl.float16)
            acc = parts_dot(hi, lo, b, b, acc, True, False, UPCAST)
        else:
            hi, lo = _fp16_parts(b * sb[None, :])
            a = (a.to(tl.float32) * sa[:, None]).to(tl.float16)
            acc = parts_dot(a, a, hi, lo, acc, False, True, UPCAST)
    elif DOT == "h1":
        a = (a.to(tl.float32) * sa[:, None]).to(tl.float16)
        b = (b.to(tl.float32) * sb[None, :]).to(tl.float16)
        acc = parts_dot(a, a, b, b, acc, False, False, UPCAST)
    elif UPCAST:
        acc += _exact(a, b).to(tl.float32)
    else:
        acc = tl.dot(a, b, acc)
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
