"""Every input the API accepts gives the right answer or an error naming the argument: integer
target dtypes, float64 inputs, logits near a large offset or near fp32's limit, option values.

Each loss runs on both backends (``impl``); the references are fp64 PyTorch on the full logits.
"""

from __future__ import annotations

import importlib
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._oracle import full_vocab_loss, full_vocab_loss_and_grad
from tests._linear_oracle import reference_grads
from vocab_parallel_loss import (VocabParallelCrossEntropy, VocabParallelLinearCrossEntropy,
                                 backends, cross_entropy, linear_cross_entropy,
                                 parallel_cross_entropy, vocab_parallel_cross_entropy)

ce_mod = importlib.import_module("vocab_parallel_loss.ops.cross_entropy.function")


def VocabParallelLossConfig(**kw):  # noqa: N802 - megatron-core is an optional extra
    return pytest.importorskip("vocab_parallel_loss.megatron.config").VocabParallelLossConfig(**kw)


# ----------------------------------------------------------------------- integer target dtypes
def _dtype(name):
    return getattr(torch, name, None)


# (dtype, vocabulary, target values): values that wrap when compared in the narrow dtype with
# ignore_index=-100 or with V (156 is -100 in 8 bits; 32768 and 65436 wrap in 16 bits)
NARROW = [(d, v, vals) for d, v, vals in [
    (_dtype("uint8"), 300, [156, 255, 3, 200, 0, 156]),
    (_dtype("int8"), 300, [-100, 127, 5, 100, 44, 0]),
    (_dtype("int16"), 32768, [-100, 32767, 5, 156, 30000, 0]),
    (_dtype("uint16"), 65537, [65436, 40000, 5, 156, 65535, 0]),
    (_dtype("uint32"), 300, [156, 299, 5, 0, 7, 200]),
] if d is not None]
NARROW_IDS = [str(d).replace("torch.", "") for d, _, _ in NARROW]


def _case(vals, vocab, h=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if h is None:
        return torch.randn(len(vals), vocab, generator=g) * 2
    return (torch.randn(len(vals), h, generator=g), torch.randn(vocab, h, generator=g) * 0.5)


@pytest.mark.parametrize("dtype,vocab,vals", NARROW, ids=NARROW_IDS)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_narrow_integer_targets_match_int64(impl, dtype, vocab, vals, reduction):
    x = _case(vals, vocab).requires_grad_()
    t = torch.tensor(vals).to(dtype)
    wide = torch.tensor(vals)
    ref_loss, ref_grad = full_vocab_loss_and_grad(x, wide, reduction=reduction)
    entries = [lambda x, t: cross_entropy(x, t, reduction=reduction, check_targets=True)]
    if vocab < 1000:  # the same path after the entry: the long rows once (slow interpreted)
        entries += [lambda x, t: VocabParallelCrossEntropy(reduction=reduction)(x, t),
                    lambda x, t: parallel_cross_entropy(x[None], t[None], reduce_loss=reduction
                                                        == "mean").reshape(ref_loss.shape)]
    for fn in entries:
        loss = fn(x, t)
        (grad,) = torch.autograd.grad(loss.sum(), x)
        torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-5)
    if reduction == "none" and vocab < 1000:
        torch.testing.assert_close(vocab_parallel_cross_entropy(x, t).double(), ref_loss,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,vocab,vals", NARROW[:3], ids=NARROW_IDS[:3])
def test_narrow_integer_targets_under_compile(dtype, vocab, vals, monkeypatch):
    monkeypatch.setattr(backends, "triton_runs", lambda t: False)  # the ops are what is traced
    torch._dynamo.reset()
    x = _case(vals, vocab).requires_grad_()
    t = torch.tensor(vals).to(dtype)
    fn = torch.compile(lambda x, t: cross_entropy(x, t, reduction="mean"), fullgraph=True,
                       backend="aot_eager")
    loss = fn(x, t)
    (grad,) = torch.autograd.grad(loss, x)
    ref_loss, ref_grad = full_vocab_loss_and_grad(x, torch.tensor(vals), reduction="mean")
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype,vocab,vals", NARROW, ids=NARROW_IDS)
@pytest.mark.parametrize("lce_impl", ["triton", "torch"])
def test_narrow_integer_targets_linear(dtype, vocab, vals, lce_impl, monkeypatch):
    if lce_impl == "triton":
        if backends.triton_linear is None or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the CPU tests run the Triton kernels through TRITON_INTERPRET=1")
        if dtype != torch.uint8:
            pytest.skip("slow in the interpreter; the widening before it is the same")
    e, c = _case(vals, vocab, h=8)
    e.requires_grad_(), c.requires_grad_()
    t = torch.tensor(vals).to(dtype)
    for reduction in ("none", "mean"):
        loss = linear_cross_entropy(e, c, t, reduction=reduction, impl=lce_impl)
        grads = torch.autograd.grad(loss.sum(), (e, c))
        want, wgrads = reference_grads(e, c, torch.tensor(vals), reduction=reduction)
        torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)
        for a, w in zip(grads, wgrads):
            torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-4)


def test_int32_targets_with_an_ignore_index_past_int32(impl):
    x = torch.randn(4, 11)
    t = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    want = full_vocab_loss(x, t.long(), reduction="mean")
    got = cross_entropy(x, t, ignore_index=2**40, reduction="mean")
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["bool", "uint64", "float32", "complex64"])
def test_unsupported_target_dtypes_are_named(name):
    dtype = _dtype(name)
    if dtype is None:
        pytest.skip(f"torch has no {name}")
    x = torch.randn(3, 7)
    t = torch.zeros(3, dtype=dtype)
    for call in (lambda: cross_entropy(x, t), lambda: VocabParallelCrossEntropy()(x, t),
                 lambda: parallel_cross_entropy(x[None], t[None])):
        with pytest.raises(TypeError, match=r"target must be an integer tensor .*int64, int32, "
                                            r"int16, int8, uint8"):
            call()
    with pytest.raises(TypeError, match="targets must be an integer tensor .*int64"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(7, 4), t)


# ------------------------------------------------------------------------------ float64 inputs
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_float64_logits_are_computed_in_float64(impl, reduction):
    g = torch.Generator().manual_seed(3)
    # differences below fp32's resolution: an fp32 computation is off by ~1e-7
    x = (torch.randn(6, 41, generator=g, dtype=torch.float64) * 3
         + torch.rand(6, 41, generator=g, dtype=torch.float64) * 1e-9).requires_grad_()
    t = torch.randint(0, 41, (6,), generator=g)
    t[1] = -100
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    loss = cross_entropy(x, t, **kw)
    upstream = torch.rand(loss.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    ref_loss, ref_grad = full_vocab_loss_and_grad(x, t, upstream, **kw)
    assert loss.dtype == torch.float64 and grad.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(grad, ref_grad, atol=1e-14, rtol=1e-12)


def test_float64_logits_under_compile(monkeypatch):
    torch._dynamo.reset()
    x = torch.randn(5, 13, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 13, (5,))
    fn = torch.compile(lambda x, t: cross_entropy(x, t), fullgraph=True, backend="aot_eager")
    loss = fn(x, t)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    ref_loss, ref_grad = full_vocab_loss_and_grad(x, t)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(grad, ref_grad, atol=1e-14, rtol=1e-12)


# ---------------------------------------------------------------------------- extreme logits
def _relative_error(got, want):
    return ((got.double() - want) / want).abs().max().item()


# rows of one block, of several (the running max moves), and the fused mean's two passes
# (8200 fp32 columns: the smoothing sum is taken in the second pass, kernels.logits.fused_config)
@pytest.mark.parametrize("vocab,rows,reduction", [(97, 16, "none"), (4099, 3, "none"),
                                                  (97, 16, "mean"), (8200, 2, "mean")])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_large_common_offset_keeps_fp32_precision(impl, smoothing, vocab, rows, reduction):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, vocab, generator=g) * 2 + 1e4  # exact fp32 values near 1e4
    t = torch.randint(0, vocab, (rows,), generator=g)
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    want = full_vocab_loss(x, t, **kw)
    got = cross_entropy(x.requires_grad_(), t, **kw)  # a mean takes the fused path on Triton
    # lse - x_t in fp32 would lose |lse| * 2^-24 ~ 6e-4 of a loss of ~5 (1e-4 relative); the
    # loss must be within a few fp32 roundings of its own size, as PyTorch's fp32 loss is
    torch_fp32 = F.cross_entropy(x, t, **kw)
    bound = 8 * torch.finfo(torch.float32).eps
    assert _relative_error(torch_fp32, want) < bound  # the bound is fair to PyTorch too
    assert _relative_error(got, want) < bound


def _fp32_loss(x, t, reduction, label_smoothing, z_loss):
    """PyTorch's own fp32 loss, the z-loss added as the oracle adds it."""
    loss = F.cross_entropy(x, t, reduction="none", label_smoothing=label_smoothing)
    loss = loss + z_loss * torch.logsumexp(x, -1) ** 2 * (t != -100)
    return loss if reduction == "none" else loss.sum() / (t != -100).sum().clamp(min=1)


# the same shapes; "mean" takes the fused path on Triton: its gradient formed in forward (unit
# upstream) or recomputed by the backward kernel (any other)
@pytest.mark.parametrize("vocab,rows,reduction", [(97, 16, "none"), (4099, 3, "none"),
                                                  (97, 16, "mean"), (8200, 2, "mean")])
@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-4)])
@pytest.mark.parametrize("unit", [True, False])
def test_large_common_offset_gradient_keeps_fp32_precision(impl, vocab, rows, reduction,
                                                           smoothing, z_loss, unit):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(rows, vocab, generator=g) * 2 + 1e4  # exact fp32 values near 1e4
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[1] = -100
    kw = dict(label_smoothing=smoothing, z_loss=z_loss, reduction=reduction)
    shape = (rows,) if reduction == "none" else ()
    upstream = torch.ones(shape) if unit else torch.rand(shape, generator=g) + 0.5
    _, want = full_vocab_loss_and_grad(x, t, upstream, **kw)
    leaf = x.clone().requires_grad_()
    (torch_fp32,) = torch.autograd.grad(_fp32_loss(leaf, t, **kw), leaf, upstream)
    (got,) = torch.autograd.grad(cross_entropy(leaf, t, **kw), leaf, upstream)
    # a softmax from the fp32-rounded lse is off by up to ulp(1e4) / 2 ~ 5e-4 of itself in
    # every column (and the kernels' base-2 lse by as much again): 4e-4 absolute on these
    # rows. From exact x - max and the unrounded log-sum it is a few fp32 roundings, 1e-7
    # relative as PyTorch's; 2e-5 lies between (atol: where smoothing's a / V cancels p)
    tol = dict(rtol=2e-5, atol=1e-8)
    if not z_loss:  # the bound is of PyTorch's order (its logsumexp backward has the defect);
        # PyTorch's CPU fp32 reaches 2.1e-5 where smoothing cancels p, on some CPUs' kernels
        torch.testing.assert_close(torch_fp32.double(), want, rtol=5e-5, atol=1e-8)
    torch.testing.assert_close(got.double(), want, **tol)


def near_fp32_limit(rows, vocab):
    """Logits near 2e38 whose differences stay finite (their sum overflows fp32); the last row
    has a -inf column (padding), where PyTorch's smoothed loss is inf."""
    k = torch.arange(vocab, dtype=torch.float64)
    x = (2e38 + k % 13 * 1e33 * (-1) ** k).repeat(rows, 1)
    x[:, 0] = 1.9e38
    x[-1, -1] = float("-inf")
    return x.float()


# 8200 fp32 columns with "sum": the fused kernel takes the sum in its second pass
@pytest.mark.parametrize("reduction,vocab", [("none", 8), ("sum", 8), ("sum", 8200)])
def test_label_smoothing_with_logits_near_the_fp32_limit(impl, reduction, vocab):
    x = near_fp32_limit(3, vocab)
    t = torch.tensor([0, 3, 4])
    want = full_vocab_loss(x, t, label_smoothing=0.1, reduction=reduction)
    got = cross_entropy(x.requires_grad_(), t, label_smoothing=0.1, reduction=reduction)
    torch_fp32 = F.cross_entropy(x, t, label_smoothing=0.1, reduction=reduction)
    torch.testing.assert_close(torch_fp32.double(), want, rtol=1e-6, atol=0)  # fair to PyTorch
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    if reduction == "none":
        assert torch.isfinite(got[:2]).all() and got[2] == math.inf


# ---------------------------------------------------------------------- option validation
@pytest.mark.parametrize("z_loss", [float("nan"), float("inf"), -1.0])
def test_z_loss_must_be_finite_and_non_negative(z_loss):
    x, t = torch.randn(3, 7), torch.zeros(3, dtype=torch.long)
    e, c = torch.randn(3, 4), torch.randn(7, 4)
    for call in (lambda: cross_entropy(x, t, z_loss=z_loss),
                 lambda: VocabParallelCrossEntropy(z_loss=z_loss),
                 lambda: linear_cross_entropy(e, c, t, z_loss=z_loss),
                 lambda: VocabParallelLinearCrossEntropy(z_loss=z_loss),
                 lambda: VocabParallelLossConfig(z_loss=z_loss)):
        with pytest.raises(ValueError, match="z_loss"):
            call()


@pytest.mark.parametrize("ignore_index", [-100.7, -100.0, True, "-100", None, 2**70])
def test_ignore_index_must_be_an_int(ignore_index):
    x, t = torch.randn(3, 7), torch.zeros(3, dtype=torch.long)
    e, c = torch.randn(3, 4), torch.randn(7, 4)
    cross_entropy(x, t)  # a cached call plan for ignore_index=-100 must not admit -100.0
    error = ValueError if ignore_index == 2**70 else TypeError
    for call in (lambda: cross_entropy(x, t, ignore_index=ignore_index),
                 lambda: parallel_cross_entropy(x[None], t[None], ignore_idx=ignore_index),
                 lambda: VocabParallelCrossEntropy(ignore_index=ignore_index),
                 lambda: linear_cross_entropy(e, c, t, ignore_index=ignore_index),
                 lambda: VocabParallelLinearCrossEntropy(ignore_index=ignore_index),
                 lambda: VocabParallelLossConfig(ignore_index=ignore_index)):
        with pytest.raises(error, match="ignore_i(ndex|dx)"):  # as the signature names it
            call()


def test_integer_like_ignore_index_is_accepted(impl):
    x = torch.randn(4, 9)
    t = torch.tensor([1, 3, 3, 8])
    want = full_vocab_loss(x, t, ignore_index=3, reduction="mean")
    for ignore_index in (3, np.int64(3), np.int32(3)):
        got = cross_entropy(x, t, ignore_index=ignore_index, reduction="mean")
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
        got = VocabParallelCrossEntropy(ignore_index=ignore_index, reduction="mean")(x, t)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kw,name", [
    (dict(softcap=0.0), "softcap"), (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"), (dict(softcap=float("inf")), "softcap"),
    (dict(shift=-1), "shift"), (dict(shift=1.5), "shift"), (dict(shift=True), "shift"),
    (dict(z_loss=-1e-3), "z_loss"), (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(reduction="avg"), "reduction"), (dict(impl="cuda"), "impl"),
    (dict(ignore_index=0.5), "ignore_index"),
])
def test_linear_module_checks_its_options_at_construction(kw, name):
    with pytest.raises((ValueError, TypeError), match=name):
        VocabParallelLinearCrossEntropy(**kw)
    e, c, t = torch.randn(3, 2, 4), torch.randn(7, 4), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises((ValueError, TypeError), match=name):  # the same rule as the function
        linear_cross_entropy(e, c, t, **kw)


@pytest.mark.parametrize("kw,name", [
    (dict(z_loss=float("nan")), "z_loss"), (dict(label_smoothing=float("nan")), "label_smoothing"),
    (dict(reduction="avg"), "reduction"), (dict(ignore_index=1.5), "ignore_index"),
])
def test_logits_module_checks_its_options_at_construction(kw, name):
    with pytest.raises((ValueError, TypeError), match=name):
        VocabParallelCrossEntropy(**kw)
    with pytest.raises((ValueError, TypeError), match=name):
        cross_entropy(torch.randn(3, 7), torch.zeros(3, dtype=torch.long), **kw)


def test_megatron_config_accepts_what_the_loss_accepts():
    VocabParallelLossConfig(label_smoothing=1.0)
    cross_entropy(torch.randn(3, 7), torch.zeros(3, dtype=torch.long), label_smoothing=1.0)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="label_smoothing"):
            VocabParallelLossConfig(label_smoothing=bad)
