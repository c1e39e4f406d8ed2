"""Property tests: every target dtype, logits dtype, layout and option, on both backends, against
the fp64 reference and against each other (the backends promise the same semantics); -inf
logits over columns, tile rows, blocks and whole rows at several logit scales; logits near a
large offset, as precise as PyTorch's fp32 loss.

Tensor parallelism is covered by test_cross_entropy_distributed.py (torchrun).
"""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._masks import PATTERNS, row_mask
from tests._oracle import full_vocab_loss_and_grad
from tests.cross_entropy.test_cross_entropy import make_logits
from vocab_parallel_loss import backends, cross_entropy

ce_mod = importlib.import_module("vocab_parallel_loss.ops.cross_entropy.function")

#: every integer dtype this torch has; bool and uint64 must be refused (TypeError naming target)
TARGET_DTYPES = [getattr(torch, n) for n in ("bool", "uint8", "int8", "int16", "uint16",
                                             "int32", "uint32", "int64", "uint64")
                 if hasattr(torch, n)]
REFUSED = {torch.bool, getattr(torch, "uint64", torch.bool)}
LOGITS_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# (loss, gradient) tolerance against the fp64 reference: the loss is computed in fp32 (fp64
# for float64) from the exact input values; the gradient is rounded once to the logits dtype
TOL = {torch.float16: (1e-5, 1e-3), torch.bfloat16: (1e-5, 8e-3), torch.float32: (1e-5, 2e-6),
       torch.float64: (1e-12, 1e-13)}

BACKENDS = ["torch"]
if backends.triton_logits is not None and (torch.cuda.is_available()
                                           or os.environ.get("TRITON_INTERPRET") == "1"):
    BACKENDS.append("triton")


@contextlib.contextmanager
def forced(backend):
    """Run the loss on ``backend`` (call plans remember the backend's fused path: fresh ones)."""
    saved_runs, saved_plans = backends.triton_runs, ce_mod._plans
    backends.triton_runs = lambda t: backend == "triton"
    ce_mod._plans = {}
    try:
        yield
    finally:
        backends.triton_runs, ce_mod._plans = saved_runs, saved_plans


def fits(value, dtype):
    if dtype.is_floating_point or dtype == torch.bool:
        return False
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    s=st.integers(1, 5), b=st.integers(1, 3), vocab=st.sampled_from(range(2, 101)),
    dtype=st.sampled_from(LOGITS_DTYPES), target_dtype=st.sampled_from(TARGET_DTYPES),
    layout=st.sampled_from(["contiguous", "sbv_transposed", "narrowed"]),
    reduction=st.sampled_from(["none", "mean", "sum"]),
    smoothing=st.sampled_from([0.0, 0.1, 1.0]), z_loss=st.sampled_from([0.0, 1e-2]),
    ignore=st.sampled_from(["-100", "in_vocab", "none"]), ignore_frac=st.sampled_from([0.3, 1.0]),
    inplace=st.booleans(), seed=st.integers(0, 2**16),
)
def test_both_backends_match_the_reference_and_each_other(
        s, b, vocab, dtype, target_dtype, layout, reduction, smoothing, z_loss, ignore,
        ignore_frac, inplace, seed):
    g = torch.Generator().manual_seed(seed)
    logits = make_logits((s, b, vocab), dtype, layout, seed=seed)
    target = torch.randint(0, vocab, (s, b), generator=g)
    ignore_index = {"-100": -100, "in_vocab": vocab // 2, "none": -100}[ignore]
    if ignore != "none" and fits(ignore_index, target_dtype):
        target[torch.rand(s, b, generator=g) < ignore_frac] = ignore_index
    typed = target.to(target_dtype)  # the same class ids in the drawn dtype (all < 128)
    kw = dict(reduction=reduction, label_smoothing=smoothing, z_loss=z_loss,
              ignore_index=ignore_index)
    upstream = torch.randn(target.shape if reduction == "none" else (), generator=g)

    results = {}
    for backend in BACKENDS:
        with forced(backend):
            x = (logits.clone() if inplace else logits).requires_grad_()
            if target_dtype in REFUSED:
                with pytest.raises(TypeError, match="target must be an integer tensor"):
                    cross_entropy(x, typed, **kw)
                continue
            loss = cross_entropy(x * 1 if inplace else x, typed, inplace_backward=inplace, **kw)
            (grad,) = torch.autograd.grad(loss, x, upstream.to(loss.dtype))
            results[backend] = (loss.detach(), grad)
    if target_dtype in REFUSED:
        return

    ref_loss, ref_grad = full_vocab_loss_and_grad(logits, target, upstream, **kw)
    ltol, gtol = TOL[dtype]
    for backend, (loss, grad) in results.items():
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert grad.dtype == dtype and grad.shape == logits.shape
        torch.testing.assert_close(loss.double(), ref_loss, atol=ltol, rtol=ltol,
                                   msg=lambda m: f"{backend} loss: {m}")
        torch.testing.assert_close(grad.double(), ref_grad, atol=gtol, rtol=2 * gtol,
                                   msg=lambda m: f"{backend} gradient: {m}")
    if len(results) == 2:
        (l1, g1), (l2, g2) = results.values()
        # the same fp32 arithmetic in another order: a few roundings of the loss apart, and
        # gradients at most one rounding of the logits dtype apart
        torch.testing.assert_close(l1, l2, atol=ltol / 4, rtol=ltol / 4)
        torch.testing.assert_close(g1.double(), g2.double(), atol=gtol / 2, rtol=gtol)


def _run(backend, logits, target, upstream, inplace=False, **kw):
    """The loss and its gradient on ``backend`` (a fresh leaf; with ``inplace`` a non-leaf)."""
    with forced(backend):
        x = logits.clone().requires_grad_()
        loss = cross_entropy(x * 1 if inplace else x, target, inplace_backward=inplace, **kw)
        (grad,) = torch.autograd.grad(loss, x, upstream.to(loss.dtype))
    return loss.detach(), grad


def _vocab():
    # mostly one block of the row kernels, sometimes two (2048 columns a block)
    return st.one_of(st.integers(2, 130), st.sampled_from([2053, 2111]))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(2, 7), vocab=_vocab(),
    dtype=st.sampled_from(LOGITS_DTYPES),
    patterns=st.sets(st.sampled_from(PATTERNS), min_size=1),
    density=st.sampled_from([0.1, 0.5, 0.95]),
    scale=st.sampled_from([1e-2, 1.0, 3.0, 30.0]),
    reduction=st.sampled_from(["none", "mean", "sum"]),
    smoothing=st.sampled_from([0.0, 0.0, 0.1]), z_loss=st.sampled_from([0.0, 1e-2]),
    inplace=st.booleans(), seed=st.integers(0, 2**16),
)
def test_masked_logits_match_the_reference_on_both_backends(
        rows, vocab, dtype, patterns, density, scale, reduction, smoothing, z_loss, inplace,
        seed):
    """-inf logits (random columns, whole tile rows and blocks of the row kernels, a row but
    its target; ignored rows wholly masked) at logit scales from 1e-2 to 30 (MuP-style output
    multipliers): the loss finite where it is mathematically finite, and the oracle's loss and
    gradient (0 at every masked column without smoothing)."""
    from vocab_parallel_loss.kernels.logits import forward_config

    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.2] = -100
    cfg = forward_config(vocab, dtype if dtype != torch.float64 else torch.float32)
    mask = row_mask(target, vocab, patterns, g, cfg["BLOCK"], cfg["VEC"], density)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
    logits = logits.masked_fill(mask, float("-inf"))
    upstream = torch.randn(rows if reduction == "none" else (), generator=g)
    kw = dict(reduction=reduction, label_smoothing=smoothing, z_loss=z_loss)

    ignored = target == -100
    # the oracle's log_softmax of an ignored row of -inf only is NaN; the loss ignores the row
    ref_in = logits.masked_fill(ignored[:, None], 0.0)
    ref_loss, ref_grad = full_vocab_loss_and_grad(ref_in, target, upstream, **kw)
    assert torch.isfinite(ref_grad).all()
    if smoothing == 0.0:
        assert torch.isfinite(ref_loss).all()  # a kept target's logit is never masked
    ltol, gtol = TOL[dtype]
    results = {}
    for backend in BACKENDS:
        loss, grad = _run(backend, logits, target, upstream, inplace, **kw)
        results[backend] = loss, grad
        msg = f"{backend}, masked {sorted(patterns)}"
        # inf where the oracle is inf (smoothing averages every logit, -inf included)
        torch.testing.assert_close(loss.double(), ref_loss, atol=ltol * 10, rtol=ltol,
                                   msg=lambda m: f"{msg} loss: {m}")
        assert torch.isfinite(grad).all(), msg
        assert torch.all(grad[ignored] == 0), msg
        if smoothing == 0.0:
            assert torch.all(grad[mask] == 0), msg
        torch.testing.assert_close(grad.double(), ref_grad, atol=gtol, rtol=2 * gtol,
                                   msg=lambda m: f"{msg} gradient: {m}")
    if len(results) == 2:
        (l1, g1), (l2, g2) = results.values()
        torch.testing.assert_close(l1, l2, atol=ltol / 4, rtol=ltol / 4)
        torch.testing.assert_close(g1.double(), g2.double(), atol=gtol / 2, rtol=gtol)


def _fp32_torch(logits, target, upstream, **kw):
    """PyTorch's own fp32 loss and gradient (its log_softmax keeps x - max exact). The z-loss
    takes the lse as ``x_0 - log_softmax(x)_0``: torch.logsumexp's backward forms the softmax
    from its rounded result."""
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, target, reduction="none",
                           label_smoothing=kw.get("label_smoothing", 0.0))
    if kw.get("z_loss"):
        lse = x[:, 0] - torch.log_softmax(x, -1)[:, 0]
        loss = loss + kw["z_loss"] * lse ** 2
    (grad,) = torch.autograd.grad(loss, x, upstream)
    return loss.detach(), grad


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 6), vocab=_vocab(), offset=st.sampled_from([1e4, -1e4, 3e4]),
    spread=st.sampled_from([0.1, 2.0, 10.0]),
    smoothing=st.sampled_from([0.0, 0.1]), z_loss=st.sampled_from([0.0, 1e-4]),
    seed=st.integers(0, 2**16),
)
def test_large_offset_keeps_fp32_precision(rows, vocab, offset, spread, smoothing, z_loss,
                                           seed):
    """fp32 logits near a large common offset: loss and gradient as close to the fp64 oracle as
    PyTorch's fp32 ones (a softmax from the fp32-rounded lse is off by ulp(lse) / 2 of itself,
    ~1e-4 of the largest entry near 1e4: far outside these bounds)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * spread + offset  # exact fp32 values
    target = torch.randint(0, vocab, (rows,), generator=g)
    upstream = torch.randn(rows, generator=g)
    kw = dict(label_smoothing=smoothing, z_loss=z_loss)
    ref_loss, ref_grad = full_vocab_loss_and_grad(logits, target, upstream, **kw)
    loss_tol = dict(rtol=1e-5, atol=1e-5)
    grad_tol = dict(rtol=1e-5, atol=1e-6 * ref_grad.abs().max().item())
    t_loss, t_grad = _fp32_torch(logits, target, upstream, **kw)
    torch.testing.assert_close(t_loss.double(), ref_loss, **loss_tol)  # the bounds are fair
    torch.testing.assert_close(t_grad.double(), ref_grad, **grad_tol)
    results = {}
    for backend in BACKENDS:
        loss, grad = _run(backend, logits, target, upstream, reduction="none", **kw)
        results[backend] = loss, grad
        torch.testing.assert_close(loss.double(), ref_loss, **loss_tol,
                                   msg=lambda m: f"{backend} loss: {m}")
        torch.testing.assert_close(grad.double(), ref_grad, **grad_tol,
                                   msg=lambda m: f"{backend} gradient: {m}")
    if len(results) == 2:
        (l1, g1), (l2, g2) = results.values()
        torch.testing.assert_close(l1, l2, **loss_tol)
        torch.testing.assert_close(g1.double(), g2.double(), **grad_tol)
