"""Property tests: random shapes, layouts and options against the fp64 reference."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._oracle import full_vocab_loss_and_grad
from tests.core.test_cross_entropy import make_logits, make_target
from vocab_parallel_loss import cross_entropy


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    s=st.integers(0, 6), b=st.integers(1, 4), vocab=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    layout=st.sampled_from(["contiguous", "sbv_transposed", "narrowed"]),
    reduction=st.sampled_from(["none", "mean", "sum"]),
    smoothing=st.sampled_from([0.0, 0.05, 1.0]), z_loss=st.sampled_from([0.0, 1e-2]),
    ignore_frac=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16),
    inplace=st.booleans(),
)
def test_random_cases(s, b, vocab, dtype, layout, reduction, smoothing, z_loss, ignore_frac, seed,
                      inplace):
    logits = make_logits((s, b, vocab), dtype, layout, seed=seed)
    target = make_target((s, b), vocab, seed=seed + 1, ignore_frac=ignore_frac)
    upstream = torch.randn(target.shape if reduction == "none" else (),
                           generator=torch.Generator().manual_seed(seed))
    ref_loss, ref_grad = full_vocab_loss_and_grad(logits, target, upstream, reduction=reduction,
                                                  label_smoothing=smoothing, z_loss=z_loss)
    x = (logits.clone() if inplace else logits).requires_grad_()
    loss = cross_entropy(x * 1 if inplace else x, target, reduction=reduction,
                         label_smoothing=smoothing, z_loss=z_loss, inplace_backward=inplace)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-4, rtol=1e-4)
    gtol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(grad.double(), ref_grad, atol=gtol, rtol=2 * gtol)
