"""Property test: every target dtype, logits dtype, layout and option, on both backends, against
the fp64 reference and against each other (the backends promise the same semantics).

Tensor parallelism is covered by test_cross_entropy_distributed.py (torchrun).
"""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
