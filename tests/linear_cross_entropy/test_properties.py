"""Property tests of ``linear_cross_entropy`` on both backends (the Triton kernels under
TRITON_INTERPRET=1 with every strategy a memory budget can pick, and the chunked PyTorch one),
against the fp64 oracle and against each other: a -inf bias over random columns, whole
vocabulary tiles and all columns but one, at several output scales (MuP-style multipliers), with
softcap, smoothing and z-loss, under torch.autocast(bf16) around fp32 inputs; logits near a large
offset.

Tensor parallelism is covered by test_linear_cross_entropy_distributed.py (torchrun).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests._budgets import one_saved_tile_budget
from tests._linear_oracle import lce_reference
from vocab_parallel_loss import backends, linear_cross_entropy
from vocab_parallel_loss.settings import interpreting

K = backends.triton_linear
TILE = K.INTERPRET_CONFIG.fwd_block_v if K is not None else 32  # the interpreter's tile width
#: the Triton strategies (forced by a memory budget or the config), then the PyTorch backend
PLANS = ["saved", "split", "recompute", "grad_in_forward", "torch"]
if K is None or not interpreting():
    PLANS = ["torch"]
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
#: (loss, gradient) tolerance, the gradient's relative to its largest entry
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-4, 2e-2)}


@contextlib.contextmanager
def plan_config(plan):
    """The interpreter's tile config, forced to form the gradients in forward for that plan."""
    if plan == "torch":
        yield
        return
    from vocab_parallel_loss.kernels.linear import config as KC

    saved = KC.OVERRIDE_CONFIG
    cfg = K.INTERPRET_CONFIG
    KC.OVERRIDE_CONFIG = cfg.replace(strategy="grad_in_forward") if plan == "grad_in_forward" \
        else cfg
    try:
        yield
    finally:
        KC.OVERRIDE_CONFIG = saved


def plan_call(plan, e, c):
    """``impl`` and ``memory_budget`` for ``plan``: a budget of 0 recomputes the logits, one
    of a single saved tile saves the first tile and recomputes the rest."""
    if plan == "torch":
        return "torch", None
    if plan == "split":
        n, h = e.shape
        return "triton", one_saved_tile_budget(K, n, h, c.shape[0],
                                               max(e.element_size(), c.element_size()),
                                               K.INTERPRET_CONFIG, e_size=e.element_size())
    return "triton", 0 if plan == "recompute" else None


def run(plan, e, c, b, t, upstream, lse_weight, autocast=None, **kw):
    """The loss, the lse and the gradients of ``(loss * upstream).sum() + (lse_weight *
    lse).sum()`` for ``e``, ``c``, ``b`` by ``plan``; ``autocast``: the region under
    torch.autocast(bf16), "both" (forward and backward) or "backward"."""
    impl, budget = plan_call(plan, e, c)
    leaves = [x.detach().clone().requires_grad_() for x in (e, c, b)]
    cast = lambda on: torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)  # noqa: E731
    with plan_config(plan):
        with cast(autocast == "both"):
            loss, lse = linear_cross_entropy(*leaves[:2], t, leaves[2], return_lse=True,
                                             memory_budget=budget, impl=impl, **kw)
        with cast(autocast is not None):
            total = (loss * upstream).sum() + (lse * lse_weight).sum()
            grads = torch.autograd.grad(total, leaves)
    return loss.detach(), lse.detach(), grads


def want(e, c, b, t, upstream, lse_weight, **kw):
    leaves = [x.detach().double().requires_grad_() for x in (e, c, b)]
    loss, lse = lce_reference(*leaves[:2], t, leaves[2], **kw)
    total = (loss * upstream.double()).sum() + (lse * lse_weight.double()).sum()
    return loss.detach(), lse.detach(), torch.autograd.grad(total, leaves)


def assert_grads_close(got, wanted, rtol, what):
    for name, a, w in zip(("dE", "dC", "dbias"), got, wanted):
        scale = w.abs().max().item() or 1.0
        err = (a.double() - w).abs().max().item()
        assert err <= rtol * scale, f"{what} {name}: max error {err:.3g}, scale {scale:.3g}"


@settings(max_examples=25, **SETTINGS)
@given(
    n=st.integers(1, 23), h=st.integers(3, 20), tiles=st.integers(1, 6), short=st.integers(0, 5),
    masked=st.sets(st.sampled_from(["columns", "tiles", "all_but_one"]), min_size=1),
    density=st.sampled_from([0.1, 0.5]), mult=st.sampled_from([1 / 16, 1.0, 4.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    reduction=st.sampled_from(["none", "mean", "sum"]),
    softcap=st.sampled_from([None, None, 2.0, 15.0]), smoothing=st.sampled_from([0.0, 0.0, 0.1]),
    z_loss=st.sampled_from([0.0, 1e-3]), autocast=st.sampled_from([None, None, "both", "backward"]),
    triton_plan=st.sampled_from(PLANS[:-1] or [None]), seed=st.integers(0, 2**16),
)
def test_masked_bias_matches_the_oracle_on_both_backends(
        n, h, tiles, short, masked, density, mult, dtype, reduction, softcap, smoothing, z_loss,
        autocast, triton_plan, seed):
    """A -inf bias over random columns, whole tiles of the interpreter's config and every
    column but one (where every kept token targets it), by one of the Triton plans and by the
    PyTorch backend: the oracle's loss, lse and gradients,
    finite where they are mathematically finite (with smoothing and no softcap a masked logit
    makes the loss +inf), exactly 0 at masked columns of dC and dbias; under autocast(bf16),
    fp32 inputs still give fp32-accurate results (a bf16 logits GEMM is ~1e-3 off)."""
    v = max(1, tiles * TILE - short)
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, h, generator=g).to(dtype)
    c = (torch.randn(v, h, generator=g) * mult).to(dtype)
    b = torch.randn(v, generator=g)
    keep = torch.ones(v, dtype=torch.bool)
    if "columns" in masked:
        keep &= torch.rand(v, generator=g) > density
    if "tiles" in masked:
        keep &= ~(torch.rand(tiles, generator=g) < 0.5).repeat_interleave(TILE)[:v]
    survivor = int(torch.randint(0, v, (), generator=g))
    if "all_but_one" in masked:
        keep[:] = False
    keep[survivor] = True
    b = b.masked_fill(~keep, float("-inf")).to(dtype)
    kept = keep.nonzero()[:, 0]
    t = kept[torch.randint(0, kept.numel(), (n,), generator=g)]
    t[torch.rand(n, generator=g) < 0.15] = -100
    upstream = torch.randn(n if reduction == "none" else (), generator=g)
    lse_weight = torch.randn(n, generator=g)
    if autocast is not None:
        dtype = torch.float32  # autocast around fp32 inputs
        e, c, b = e.float(), c.float(), b.float()
    kw = dict(reduction=reduction, softcap=softcap, label_smoothing=smoothing, z_loss=z_loss)
    w_loss, w_lse, w_grads = want(e, c, b, t, upstream, lse_weight, **kw)
    mathematically_finite = softcap is not None or smoothing == 0.0 or keep.all()
    assert torch.isfinite(w_lse).all()
    assert torch.isfinite(w_loss).all() == mathematically_finite
    ltol, gtol = TOL[dtype]
    finite = w_loss[torch.isfinite(w_loss)]
    loss_scale = max([1.0] + finite.abs().tolist())
    results = {}
    if triton_plan == "grad_in_forward" and reduction == "none":
        triton_plan = "saved"  # a per-token loss has no scalar upstream gradient to form
    plans = [p for p in (triton_plan, "torch") if p is not None]  # one Triton plan a case
    for plan in plans:
        loss, lse, grads = run(plan, e, c, b, t, upstream, lse_weight, autocast, **kw)
        results[plan] = loss, lse, grads
        msg = f"{plan}, masked {sorted(masked)}"
        assert loss.dtype == torch.float32 and all(x.dtype == dtype for x in grads), msg
        assert torch.isfinite(lse).all(), msg
        torch.testing.assert_close(loss.double(), w_loss, atol=ltol * loss_scale, rtol=ltol,
                                   msg=lambda m: f"{msg} loss: {m}")
        torch.testing.assert_close(lse.double(), w_lse, atol=ltol * 10, rtol=ltol,
                                   msg=lambda m: f"{msg} lse: {m}")
        assert all(torch.isfinite(x).all() for x in grads), msg
        # smoothing gives every column a / V of the upstream gradient; under a softcap the
        # saved tiles recover a masked column's slope (0 at -softcap) from mt + log u, to
        # about 1e-9 of the largest entry
        if smoothing == 0.0 and (softcap is None or plan in ("recompute", "torch")):
            assert torch.all(grads[1][~keep] == 0) and torch.all(grads[2][~keep] == 0), msg
        assert_grads_close(grads, w_grads, gtol, msg)
    if len(results) == 2:
        (loss, lse, grads), (r_loss, r_lse, r_grads) = results.values()
        torch.testing.assert_close(loss, r_loss, atol=ltol * loss_scale, rtol=ltol)
        torch.testing.assert_close(lse, r_lse, atol=ltol * 10, rtol=ltol)
        assert_grads_close(grads, [x.double() for x in r_grads], gtol, "the backends")


def _offset_case(n, h, v, offset, seed):
    """fp32 inputs whose logits ``e @ c.T + bias`` lie near ``offset`` and are exact in fp32
    in any order of summation (multiples of 2^-10 below 2^14 in magnitude): every error is
    then the kernels' own, none the logits' rounding."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-32, 33, (n, h), generator=g) / 32.0
    c = torch.randint(-32, 33, (v, h), generator=g) / 32.0
    b = offset + torch.randint(-2048, 2049, (v,), generator=g) / 256.0
    t = torch.randint(0, v, (n,), generator=g)
    x = e.double() @ c.double().t() + b.double()
    assert torch.equal((e @ c.t() + b).double(), x)
    return e, c, b, t, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _fp32_torch(e, c, b, t, upstream, lse_weight, **kw):
    """PyTorch's own fp32 loss, lse and gradients (its log_softmax keeps x - max exact)."""
    leaves = [x.detach().clone().requires_grad_() for x in (e, c, b)]
    x = leaves[0] @ leaves[1].t() + leaves[2]
    ls = torch.log_softmax(x, -1)
    lse = x[:, 0] - ls[:, 0]  # torch.logsumexp's backward forms the softmax from its result
    a = kw.get("label_smoothing", 0.0)
    loss = -(1 - a) * ls.gather(1, t[:, None])[:, 0] - a * ls.mean(-1)
    loss = loss + kw.get("z_loss", 0.0) * lse ** 2
    total = (loss * upstream).sum() + (lse * lse_weight).sum()
    return loss.detach(), lse.detach(), torch.autograd.grad(total, leaves)


def _offset_cases(smoothing, **more):
    return given(n=st.integers(1, 17), h=st.integers(2, 12), v=st.integers(2, 150),
                 offset=st.sampled_from([1e4, -1e4]), smoothing=st.sampled_from(smoothing),
                 z_loss=st.sampled_from([0.0, 1e-4]), seed=st.integers(0, 2**16), **more)


def _check_offset_loss(n, h, v, offset, smoothing, z_loss, seed, plans=None):
    e, c, b, t, upstream, lse_weight = _offset_case(n, h, v, offset, seed)
    kw = dict(label_smoothing=smoothing, z_loss=z_loss)
    w_loss, w_lse, _ = want(e, c, b, t, upstream, lse_weight, reduction="none", **kw)
    tol = dict(rtol=1e-5, atol=1e-5)
    t_loss, t_lse, _ = _fp32_torch(e, c, b, t, upstream, lse_weight, **kw)
    torch.testing.assert_close(t_loss.double(), w_loss, **tol)  # the bounds are fair
    torch.testing.assert_close(t_lse.double(), w_lse, **tol)
    failed = []
    for plan in plans or [p for p in PLANS if p != "grad_in_forward"]:
        loss, lse, _ = run(plan, e, c, b, t, upstream, lse_weight, reduction="none", **kw)
        for name, got, w in (("loss", loss, w_loss), ("lse", lse, w_lse)):
            err = (got.double() - w).abs() - tol["rtol"] * w.abs()
            if (err > tol["atol"]).any():
                failed.append(f"{plan} {name}: {err.max().item() + tol['atol']:.3g}")
    assert not failed, failed


@settings(max_examples=10, **SETTINGS)
@_offset_cases(smoothing=[0.0], triton_plan=st.sampled_from(["saved", "split", "recompute"]))
def test_large_offset_loss_keeps_fp32_precision(n, h, v, offset, smoothing, z_loss, seed,
                                                triton_plan):
    """Logits near a large common offset, by one of the Triton plans and by the PyTorch
    backend: the loss and lse as close to the fp64 oracle as PyTorch's fp32 ones (the
    statistics take x - max before any sum)."""
    plans = [triton_plan, "torch"] if K is not None and interpreting() else ["torch"]
    _check_offset_loss(n, h, v, offset, smoothing, z_loss, seed, plans)


# no shrinking in the tests of known defects: each example runs every plan
KNOWN_DEFECT = dict(max_examples=5, phases=[Phase.explicit, Phase.generate], **SETTINGS)


@pytest.mark.xfail(strict=True, reason="the fused linear statistics sum the raw logits for "
                   "label smoothing: near a 1e4 offset the loss is ~5e-5 off, PyTorch's fp32 "
                   "one ~5e-7")
@settings(**KNOWN_DEFECT)
@_offset_cases(smoothing=[0.1])
def test_large_offset_smoothed_loss_keeps_fp32_precision(n, h, v, offset, smoothing, z_loss,
                                                         seed):
    _check_offset_loss(n, h, v, offset, smoothing, z_loss, seed)


@pytest.mark.xfail(strict=True, reason="the fused linear backward forms the softmax from the "
                   "fp32-rounded lse: near a 1e4 offset ~1e-4 of the largest gradient entry "
                   "off, where PyTorch's fp32 gradient is ~1e-7 off")
@settings(**KNOWN_DEFECT)
@_offset_cases(smoothing=[0.0, 0.1])
def test_large_offset_gradient_keeps_fp32_precision(n, h, v, offset, smoothing, z_loss, seed):
    """Logits near a large common offset: gradients as close to the fp64 oracle as PyTorch's
    fp32 ones, for every plan."""
    e, c, b, t, upstream, lse_weight = _offset_case(n, h, v, offset, seed)
    kw = dict(label_smoothing=smoothing, z_loss=z_loss)
    *_, w_grads = want(e, c, b, t, upstream, lse_weight, reduction="none", **kw)
    *_, t_grads = _fp32_torch(e, c, b, t, upstream, lse_weight, **kw)
    assert_grads_close(t_grads, w_grads, 1e-5, "PyTorch fp32")  # the bound is fair
    failed = []
    for plan in [p for p in PLANS if p != "grad_in_forward"]:
        *_, grads = run(plan, e, c, b, t, upstream, lse_weight, reduction="none", **kw)
        try:
            assert_grads_close(grads, w_grads, 1e-5, plan)
        except AssertionError as err:
            failed.append(str(err))
    assert not failed, failed
