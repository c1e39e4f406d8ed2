"""Fused linear cross entropy, single process: both implementations against the fp64 oracle.

``impl="triton"`` runs the Triton kernels through TRITON_INTERPRET=1 (tests/conftest.py) with
the tiny interpreter tile config (forward split over 2 vocabulary ranges, several backward
chunks), ``impl="torch"`` the chunked PyTorch path. Odd N, H and V exercise every mask.
"""

from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch

from tests._process_group import single_rank_group
from tests._budgets import one_saved_tile_budget
from tests._linear_oracle import lce_reference, reference_grads
from vocab_parallel_loss import VocabParallelLinearCrossEntropy, backends, linear_cross_entropy
from vocab_parallel_loss.reference.linear import TorchBackend
from vocab_parallel_loss.settings import interpreting

lce_mod = importlib.import_module("vocab_parallel_loss.ops.linear_cross_entropy.function")
strategy_mod = importlib.import_module("vocab_parallel_loss.ops.fused_linear.strategy")
K = backends.triton_linear
KC = K.config if K is not None else None  # default_config reads OVERRIDE_CONFIG here
KF = K.fused if K is not None else None

# the Triton backend with the strategy the default budget picks on these shapes (the logits
# tiles saved for backward), and forced to recompute them (a budget of 0)
IMPLS = ["triton", "triton-recompute", "torch"]
# (loss atol, grad tolerance relative to the largest gradient entry)
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-4, 2e-2)}


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    if request.param.startswith("triton") and (K is None or not interpreting()):
        pytest.skip("the CPU tests run the Triton kernels through TRITON_INTERPRET=1")
    if request.param == "triton-recompute":
        monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG.replace(strategy="recompute"))
        return "triton"
    return request.param


def make(n=37, h=24, v=53, dtype=torch.float32, seed=0, bias=False, lead=None, scale=1.0,
         ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    shape = (n, h) if lead is None else (*lead, h)
    e = (torch.randn(shape, generator=g) * scale).to(dtype).requires_grad_()
    c = (torch.randn(v, h, generator=g) * scale).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g)).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, shape[:-1], generator=g)
    t[torch.rand(shape[:-1], generator=g) < 0.15] = ignore_index
    return e, c, b, t


def run(e, c, b, t, impl, upstream=None, **kw):
    out = linear_cross_entropy(e, c, t, b, impl=impl, **kw)
    g = torch.ones_like(out) if upstream is None else upstream.to(out.dtype).reshape(out.shape)
    leaves = [e, c] + ([b] if b is not None else [])
    grads = torch.autograd.grad(out, leaves, g)
    return out.detach(), grads


def assert_grads_close(got, want, dtype):
    rtol = TOL[dtype][1]
    for name, a, w in zip(("dE", "dC", "dbias"), got, want):
        assert a.dtype == dtype, (name, a.dtype)
        assert a.shape == w.shape, (name, a.shape, w.shape)
        scale = w.abs().max().item() or 1.0
        err = (a.double() - w).abs().max().item()
        assert err <= rtol * scale + 1e-12, f"{name}: max err {err:.3g} vs scale {scale:.3g}"


def check(impl, dtype=torch.float32, *, bias=False, lead=None, n=37, h=24, v=53, seed=0,
          upstream=False, **kw):
    e, c, b, t = make(n, h, v, dtype, seed, bias, lead, ignore_index=kw.get("ignore_index", -100))
    red = kw.get("reduction", "mean")
    up = None
    if upstream and red == "none":
        up = torch.randn(t[..., kw.get("shift", 0):].shape, generator=torch.Generator().manual_seed(9))
    budget = kw.pop("memory_budget", None)
    loss, grads = run(e, c, b, t, impl, up, memory_budget=budget, **kw)
    want, wgrads = reference_grads(e, c, t, b, up, **kw)
    assert loss.dtype == torch.float32
    assert loss.shape == want.shape
    torch.testing.assert_close(loss.double(), want, atol=TOL[dtype][0] * max(1, want.abs().max().item()),
                               rtol=TOL[dtype][0])
    assert_grads_close(grads, wgrads, dtype)


CASES = [
    dict(reduction="mean"),
    dict(reduction="sum"),
    dict(reduction="none", upstream=True),
    dict(reduction="mean", bias=True),
    dict(reduction="none", softcap=4.0, upstream=True),
    dict(reduction="mean", label_smoothing=0.1),
    dict(reduction="sum", z_loss=1e-2),
    dict(reduction="mean", shift=1),
    dict(reduction="none", shift=1, lead=(3, 13), upstream=True),
    dict(reduction="mean", bias=True, softcap=3.0, label_smoothing=0.2, z_loss=1e-3, shift=1),
    dict(reduction="mean", ignore_index=5),
    dict(reduction="mean", h=17, v=31, n=19),  # H not a multiple of the tile: masked K loop
    dict(reduction="none", v=1, upstream=True),  # a single class
    dict(reduction="mean", label_smoothing=1.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_fp32_matches_oracle(impl, case):
    check(impl, torch.float32, **case)


@pytest.mark.parametrize("case", [
    dict(reduction="mean"),
    dict(reduction="none", softcap=5.0, bias=True, upstream=True),
    dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3, shift=1, lead=(2, 19)),
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_bf16_matches_oracle(impl, case):
    check(impl, torch.bfloat16, **case)


def test_return_lse_and_its_gradient(impl):
    e, c, b, t = make(bias=True)
    loss, lse = linear_cross_entropy(e, c, t, b, reduction="sum", return_lse=True, impl=impl)
    want, wlse = lce_reference(e, c, t, b, reduction="sum")
    torch.testing.assert_close(lse.double(), wlse.detach(), atol=1e-5, rtol=1e-5)
    # gradient through both outputs: loss + sum(w * lse)
    w = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(loss + (w * lse).sum(), (e, c, b))
    leaves = [x.detach().double().requires_grad_() for x in (e, c, b)]
    l2, lse2 = lce_reference(*leaves[:2], t, leaves[2], reduction="sum")
    wanted = torch.autograd.grad(l2 + (w.double() * lse2).sum(), leaves)
    assert_grads_close(got, wanted, torch.float32)


def test_all_ignored_gives_zero_not_nan(impl):
    e, c, b, t = make(bias=True)
    t.fill_(-100)
    for red in ("mean", "sum", "none"):
        loss, grads = run(e, c, b, t, impl, reduction=red)
        assert torch.all(loss == 0)
        for gr in grads:
            assert torch.all(gr == 0)


def test_empty_input(impl):
    e, c, _, _ = make()
    e0 = e.detach()[:0].requires_grad_()
    t0 = torch.zeros(0, dtype=torch.long)
    loss = linear_cross_entropy(e0, c, t0, impl=impl)
    assert loss.item() == 0.0
    de, dc = torch.autograd.grad(loss, (e0, c))
    assert de.shape == (0, 24) and torch.all(dc == 0)
    loss = linear_cross_entropy(e0, c, t0, reduction="none", impl=impl)
    assert loss.shape == (0,)


def test_out_of_range_target_is_nan_without_oob_read(impl):
    e, c, _, t = make()
    t[0] = 53
    t[1] = -7
    t[2] = 10 ** 12
    loss = linear_cross_entropy(e, c, t, reduction="none", impl=impl)
    assert torch.isnan(loss[:3]).all()
    want, _ = lce_reference(e, c, t, reduction="none")
    torch.testing.assert_close(loss[3:].double(), want[3:].detach(), atol=2e-5, rtol=2e-5)
    assert torch.isnan(linear_cross_entropy(e, c, t, impl=impl))


OUT_OF_RANGE_CASES = [("none", False), ("none", True), ("mean", False)]


@pytest.mark.parametrize("reduction,masked", OUT_OF_RANGE_CASES)
def test_out_of_range_target_gradient_is_nan_as_over_logits(impl, reduction, masked):
    check_out_of_range_gradient(impl, reduction, masked)


def check_out_of_range_gradient(impl, reduction, masked):
    """As for the loss over the logits: the token's loss, lse and dlogits row are NaN, so its
    row of dE and all of dC and dbias are NaN; every other row of dE is exact."""
    e, c, b, t = make(bias=True)
    t[4] = 53
    bad = torch.zeros(t.shape, dtype=torch.bool)
    bad[4] = True
    mask = (torch.arange(t.numel()) % 3 != 0).float() if masked else None
    out, lse = linear_cross_entropy(e, c, t, b, impl=impl, reduction=reduction, return_lse=True,
                                    loss_mask=mask)
    assert torch.isnan(lse[4]) and not torch.isnan(lse[~bad]).any()
    g = mask if masked else (torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
                             if reduction == "none" else None)
    de, dc, db = torch.autograd.grad(out, (e, c, b), g)
    assert torch.isnan(de[4]).all() and torch.isnan(dc).all() and torch.isnan(db).all()
    # the other rows of dE: those of the loss without the bad token (dE's rows are per token)
    t_ok = torch.where(bad, torch.full_like(t, -100), t)
    up = None if g is None else torch.where(bad, 0.0, g)
    if reduction == "mean":  # the same divisor: the bad token is counted
        up = torch.full(t.shape, 1.0 / (t != -100).sum().item())
    _, (wde, _, _) = reference_grads(e, c, t_ok, b, upstream=up, reduction="none")
    assert_grads_close((de[~bad],), (wde[~bad],), torch.float32)


def test_deterministic_bitwise(impl):
    e, c, b, t = make(bias=True, dtype=torch.bfloat16)
    r1 = run(e, c, b, t, impl, reduction="mean", label_smoothing=0.1)
    r2 = run(e, c, b, t, impl, reduction="mean", label_smoothing=0.1)
    assert torch.equal(r1[0], r2[0])
    for a, b_ in zip(r1[1], r2[1]):
        assert torch.equal(a, b_)


def test_strided_inputs(impl):
    """Views with non-unit strides (a narrowed hidden dim, a transposed classifier)."""
    g = torch.Generator().manual_seed(4)
    big = torch.randn(37, 50, generator=g)
    e = big[:, 1:49:2].requires_grad_()  # (37, 24) with stride (50, 2)
    ct = torch.randn(24, 53, generator=g)
    c = ct.t().requires_grad_()  # (53, 24) column-major
    t = torch.randint(0, 53, (37,), generator=g)
    loss, grads = run(e, c, None, t, impl, reduction="mean", softcap=6.0)
    want, wgrads = reference_grads(e, c, t, None, reduction="mean", softcap=6.0)
    torch.testing.assert_close(loss.double(), want, atol=2e-5, rtol=2e-5)
    assert_grads_close(grads, wgrads, torch.float32)


@pytest.mark.parametrize("layout", ["every-other", "expanded"])
def test_strided_bias(impl, layout):
    """A bias view with a stride other than 1 is read at its strides: every other element of a
    longer vector, or one value expanded over the vocabulary (stride 0)."""
    g = torch.Generator().manual_seed(5)
    e, c, _, t = make(seed=5)
    store = torch.randn(2 * 53 if layout == "every-other" else 1, generator=g).requires_grad_()
    b = store[::2] if layout == "every-other" else store.expand(53)
    assert b.stride(0) != 1
    out = linear_cross_entropy(e, c, t, b, impl=impl, reduction="mean", softcap=6.0)
    grads = torch.autograd.grad(out, (e, c, store))
    want, wgrads = reference_grads(e, c, t, b, reduction="mean", softcap=6.0)
    torch.testing.assert_close(out.detach().double(), want, atol=2e-5, rtol=2e-5)
    dstore = torch.zeros(store.shape, dtype=torch.float64)
    if layout == "every-other":
        dstore[::2] = wgrads[2]
    else:
        dstore[0] = wgrads[2].sum()
    assert_grads_close(grads, (*wgrads[:2], dstore), torch.float32)


def test_impls_agree_and_only_needed_grads(impl):
    e, c, b, t = make(bias=True)
    c2 = c.detach()  # no grad for c: the kernel skips dC
    loss = linear_cross_entropy(e, c2, t, b.detach(), impl=impl)
    (de,) = torch.autograd.grad(loss, (e,))
    _, (wde, _, _) = reference_grads(e, c, t, b)
    assert_grads_close((de,), (wde,), torch.float32)


@pytest.mark.skipif(K is None or not interpreting(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("cfg", [
    dict(split=1, chunk_bytes=1 << 30),
    dict(split=3, fwd_block_v=16, bwd_block_v=16, bwd_block_n=32, mm_block_k=32, chunk_bytes=256),
    dict(split=0, fwd_block_v=16),  # _forward_splits chooses (2 "multiprocessors" on CPU)
    # TMA descriptors: the copy engine's zero fill replaces every mask of the logits tile
    dict(fwd_desc=True, bwd_desc=True),
    dict(fwd_desc=True, fwd_flat=True, split=3, fwd_block_v=16),
    dict(fwd_desc=True, bwd_desc=True, split=3, fwd_block_v=16, bwd_block_v=16, chunk_bytes=256),
], ids=["one-split-one-chunk", "three-splits-many-chunks", "auto-split", "desc",
        "desc-flat-three-splits", "desc-three-splits-many-chunks"])
def test_triton_tile_configs(cfg, monkeypatch):
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG.replace(**cfg))
    # descriptors take 16-bit inputs only (fp32 keeps pointers)
    desc = cfg.get("fwd_desc") or cfg.get("bwd_desc")
    if desc:
        assert KF._descriptors_ok(*make(dtype=torch.bfloat16)[:2])
    dtype = torch.bfloat16 if desc else torch.float32
    # smoothing through a softcap takes the recompute strategy, without it the saved tiles
    # (stored through a descriptor with the forward's)
    check("triton", dtype, bias=True, softcap=5.0, label_smoothing=0.1, reduction="none",
          upstream=True)
    check("triton", dtype, bias=True, softcap=5.0, reduction="none", upstream=True)


def test_forward_splits_fill_the_waves():
    """The split choice keeps at most 32 row blocks in flight, and its estimated run (waves x
    tiles per program) is never longer than the ~4-wave rule it replaced, nor than any other
    count in its range."""
    if K is None:
        pytest.skip("no Triton")

    def run_length(num_rb, num_vt, sms, s):
        tiles = -(-num_vt // s)
        return -(-num_rb * -(-num_vt // tiles) // sms) * (tiles + 0.5)

    for sms in (4, 108, 132):
        for num_rb in (1, 7, 128, 129, 512):
            for num_vt in (1, 2, 63, 125, 501, 1000):
                s = KF._forward_splits(num_rb, num_vt, sms)
                assert 1 <= s <= num_vt
                if num_vt >= -(-sms // 32):
                    assert -(-sms // s) <= 32  # row blocks in flight
                old = min(max(1, -(-4 * sms // num_rb)), num_vt)
                lo = min(num_vt, max(1, -(-sms // 32), -(-sms // num_rb)))
                mine = run_length(num_rb, num_vt, sms, s)
                if lo <= old <= 4 * lo:
                    assert mine <= run_length(num_rb, num_vt, sms, old)
                for other in range(lo, min(num_vt, 4 * lo) + 1):
                    assert mine <= run_length(num_rb, num_vt, sms, other)


def test_descriptors_only_for_aligned_rows():
    """TMA needs a unit last stride and 16-byte aligned rows: anything else keeps pointers."""
    if K is None:
        pytest.skip("no Triton")
    bf = torch.bfloat16
    e = torch.zeros(5, 24, dtype=bf)
    c = torch.zeros(7, 24, dtype=bf)
    assert KF._descriptors_ok(e, c) == (KF.TensorDescriptor is not None and interpreting())
    assert not KF._descriptors_ok(e.float(), c.float())  # fp32: pointers
    assert not KF._descriptors_ok(torch.zeros(5, 17, dtype=bf), torch.zeros(7, 17, dtype=bf))
    assert not KF._descriptors_ok(e.t().contiguous().t(), c)  # column-major
    assert not KF._descriptors_ok(torch.zeros(5 * 24 + 1, dtype=bf)[1:].view(5, 24), c)  # 2 B off


def test_default_config_override_and_environment(monkeypatch):
    """``config.OVERRIDE_CONFIG`` is what every call uses (the tests above rely on it), with the
    fields of ``VPL_LCE_CONFIG`` on top; a field the config does not have is an error naming it."""
    if K is None:
        pytest.skip("no Triton")
    cpu = torch.device("cpu")
    monkeypatch.delenv("VPL_LCE_CONFIG", raising=False)
    assert K.default_config(cpu) == K.INTERPRET_CONFIG
    cfg = K.INTERPRET_CONFIG.replace(split=3, chunk_bytes=256)
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", cfg)
    assert K.default_config(cpu) == cfg
    monkeypatch.setenv("VPL_LCE_CONFIG", '{"fwd_block_v": 64}')
    assert K.default_config(cpu) == cfg.replace(fwd_block_v=64)
    monkeypatch.setenv("VPL_LCE_CONFIG", '{"bwd_mode": "chunked"}')
    with pytest.raises(TypeError, match="bwd_mode"):
        K.default_config(cpu)


def test_module(impl):
    e, c, b, t = make(lead=(2, 19))
    mod = VocabParallelLinearCrossEntropy(reduction="sum", shift=1, label_smoothing=0.05,
                                          impl=impl)
    assert "shift=1" in repr(mod)
    loss = mod(e, c, t)
    want, _ = lce_reference(e, c, t, reduction="sum", shift=1, label_smoothing=0.05)
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-4, rtol=2e-5)
    mod2 = VocabParallelLinearCrossEntropy(return_lse=True, impl=impl)
    out, lse = mod2(e, c, t, b)
    assert lse.shape == t.shape


def test_module_deepcopy_shares_the_process_group(impl, tmp_path):
    e, c, _, t = make(lead=(2, 19))
    with single_rank_group(tmp_path) as group:
        mod = VocabParallelLinearCrossEntropy(reduction="sum", shift=1, tp_group=group, impl=impl)
        clone = copy.deepcopy(mod)
        assert clone is not mod and clone.tp_group is group and repr(clone) == repr(mod)
        torch.testing.assert_close(clone(e, c, t), mod(e, c, t), atol=0, rtol=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_double_backward_is_a_clear_error(impl, reduction, return_lse):
    # a gradient penalty or Hessian-vector product needs the loss's second derivative
    e, c, b, t = make(bias=True)
    out = linear_cross_entropy(e, c, t, b, reduction=reduction, return_lse=return_lse, impl=impl)
    total = sum(x.sum() for x in out) if return_lse else out.sum()
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(total, (e, c), create_graph=True)
    got = torch.autograd.grad(total, (e, c))  # first order is unaffected
    leaves = [x.detach().double().requires_grad_() for x in (e, c, b)]
    ref = lce_reference(*leaves[:2], t, leaves[2], reduction=reduction)
    ref_total = ref[0].sum() + (ref[1].sum() if return_lse else 0)
    assert_grads_close(got, torch.autograd.grad(ref_total, leaves[:2]), torch.float32)


def test_grad_in_forward_double_backward_is_a_clear_error(grad_in_forward):
    e, c, b, t = make(bias=True)
    loss = linear_cross_entropy(e, c, t, b, impl="triton")
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(loss, e, create_graph=True)
    assert grad_in_forward


@pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")
def test_auto_uses_triton_under_interpreter():
    e, c, _, t = make()
    assert backends.linear_backend("auto", e) is (K if K is not None else TorchBackend)
    assert backends.linear_backend("torch", e) is TorchBackend


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp64_inputs_are_computed_in_fp64(reduction):
    e, c, b, t = make(dtype=torch.float64, bias=True)
    got, grads = run(e, c, b, t, "auto", reduction=reduction, label_smoothing=0.1, z_loss=1e-3,
                     softcap=5.0)
    want, wgrads = reference_grads(e, c, t, b, reduction=reduction, label_smoothing=0.1,
                                   z_loss=1e-3, softcap=5.0)
    assert got.dtype == torch.float64
    # fp64 accuracy: fp32 arithmetic would be off by ~1e-7
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for a, w in zip(grads, wgrads):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, w, atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------------------------ errors


def test_errors():
    e, c, b, t = make(bias=True)
    with pytest.raises(ValueError, match="hidden size"):
        linear_cross_entropy(e, c[:, :-1], t)
    with pytest.raises(ValueError, match="target shape"):
        linear_cross_entropy(e, c, t[:-1])
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(e, c.double(), t)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(e, c, t, b[:-1])
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy(e, c, t, b.double())
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(e, c, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(e, c, t, label_smoothing=-0.1)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(e, c, t, reduction="avg")
    with pytest.raises(ValueError, match="impl"):
        linear_cross_entropy(e, c, t, impl="cuda")
    with pytest.raises(ValueError, match="z_loss"):
        linear_cross_entropy(e, c, t, z_loss=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(e, c, t, softcap=0.0)
    with pytest.raises(ValueError, match="shift"):
        linear_cross_entropy(e, c, t, shift=-1)
    with pytest.raises(ValueError, match="c must be"):
        linear_cross_entropy(e, c[0], t)
    with pytest.raises(ValueError, match="at least one leading"):
        linear_cross_entropy(e[0], c, t[0])
    with pytest.raises(TypeError, match="floating"):
        linear_cross_entropy(e.detach().long(), c.detach().long(), t)
    with pytest.raises(TypeError, match="floating"):
        linear_cross_entropy(e, c.detach().long(), t)
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(e, c, t.float())
    with pytest.raises(ValueError, match="impl"):
        VocabParallelLinearCrossEntropy(impl="nope")
    if torch.device("meta") is not None:
        with pytest.raises(ValueError, match="device"):
            linear_cross_entropy(e, c, t.to("meta"))


def test_triton_on_plain_cpu_is_a_clear_error(monkeypatch):
    if K is None:
        pytest.skip("triton not importable")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    e, c, _, t = make()
    with pytest.raises(ValueError, match="impl='triton' needs"):
        linear_cross_entropy(e, c, t, impl="triton")
    # auto falls back to torch and still computes the right loss
    loss = linear_cross_entropy(e, c, t)
    want, _ = lce_reference(e, c, t)
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-5)


# ------------------------------------------------------- grad-in-forward path (scalar losses)

GIF_CASES = [
    dict(reduction="mean"),
    dict(reduction="sum", bias=True, softcap=4.0),
    dict(reduction="mean", label_smoothing=0.1, z_loss=1e-2, shift=1, lead=(3, 13)),
    dict(reduction="mean", h=17, v=31, n=19, bias=True),
]


@pytest.fixture
def grad_in_forward(monkeypatch):
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG.replace(strategy="grad_in_forward"))
    calls = []
    orig = lce_mod._forward_with_grads

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(lce_mod, "_forward_with_grads", spy)
    return calls


@pytest.mark.parametrize("case", GIF_CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_in_forward_matches_oracle(grad_in_forward, case, dtype):
    check("triton", dtype, **case)
    assert grad_in_forward, "the grad-in-forward path did not run"


@pytest.mark.parametrize("reduction,masked", [("none", True), ("mean", False)])
def test_grad_in_forward_out_of_range_target_gradient_is_nan(grad_in_forward, reduction, masked):
    check_out_of_range_gradient("triton", reduction, masked)
    assert grad_in_forward, "the grad-in-forward path did not run"


@pytest.mark.parametrize("n,v", [(19, 53), (90, 31)], ids=["dE-first", "dC-first"])
def test_grad_in_forward_both_rounding_orders(grad_in_forward, n, v, monkeypatch):
    """Backward rounds dE first where the vocabulary is wider than the rows, dC first where the
    rows outnumber it (the lower peak): both orders against the fp64 oracle."""
    e, c, _, _ = make(n, 8, v, torch.bfloat16)
    dc_first = strategy_mod.gif_round_dc_first(n, v, 8, e, c)
    assert dc_first == (n > v)
    check("triton", torch.bfloat16, reduction="sum", bias=True, n=n, h=8, v=v)
    assert grad_in_forward


def test_grad_in_forward_scaled_upstream_and_lse(grad_in_forward):
    e, c, b, t = make(bias=True)
    loss, lse = linear_cross_entropy(e, c, t, b, reduction="mean", return_lse=True,
                                     impl="triton", softcap=5.0)
    w = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(0.37 * loss + (w * lse).sum(), (e, c, b))
    leaves = [x.detach().double().requires_grad_() for x in (e, c, b)]
    l2, lse2 = lce_reference(*leaves[:2], t, leaves[2], reduction="mean", softcap=5.0)
    wanted = torch.autograd.grad(0.37 * l2 + (w.double() * lse2).sum(), leaves)
    assert_grads_close(got, wanted, torch.float32)
    assert grad_in_forward


def test_grad_in_forward_edge_cases(grad_in_forward):
    e, c, b, t = make(bias=True)
    t.fill_(-100)
    loss, grads = run(e, c, b, t, "triton", reduction="mean")
    assert loss.item() == 0 and all(torch.all(gr == 0) for gr in grads)
    e0 = e.detach()[:0].requires_grad_()
    loss = linear_cross_entropy(e0, c, torch.zeros(0, dtype=torch.long), impl="triton")
    de, dc = torch.autograd.grad(loss, (e0, c))
    assert loss.item() == 0 and de.shape == (0, 24) and torch.all(dc == 0)
    # no gradient needed: the plain forward runs
    n_before = len(grad_in_forward)
    with torch.no_grad():
        linear_cross_entropy(e, c, t, impl="triton")
    assert len(grad_in_forward) == n_before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_round(dtype):
    """The gradients formed in forward are rounded once from ``src * g``: fp32 exactly as
    PyTorch; 16-bit within one ulp (the interpreter truncates where the GPU rounds to nearest)."""
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(7)
    src = torch.randn(37, 53, generator=g) * 3
    scale = torch.tensor(0.37)
    out = K.scaled_round(src, scale, torch.empty(37, 53, dtype=dtype))
    want = src.double() * 0.37
    if dtype == torch.float32:
        assert torch.equal(out, src * scale)
    else:
        ulp = torch.finfo(dtype).eps  # one ulp at 1, relative
        assert bool(((out.double() - want).abs() <= ulp * want.abs()).all())
    assert K.scaled_round(src[:0], scale, torch.empty(0, 53, dtype=dtype)).shape == (0, 53)
    with pytest.raises(ValueError, match="contiguous"):
        K.scaled_round(src.t(), scale, torch.empty(53, 37, dtype=dtype))
    with pytest.raises(ValueError, match="scale of 2"):
        K.scaled_round(src, torch.ones(2), torch.empty(37, 53, dtype=dtype))


def test_recompute_counts_de_beyond_the_returned_gradient(monkeypatch):
    """The fp32 dE of the recomputed columns counts as the budget measures: less the dE it
    becomes while the chunks run, whole when rounded into it; whole under sequence parallelism."""
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    n, h = 300, 8
    de = strategy_mod.recompute_de_bytes
    assert de(n, h, 2, True, False) == (2 * n * h, 4 * n * h)  # bf16
    assert de(n, h, 4, True, False) == (0, 0)  # fp32: the accumulator is the gradient
    assert de(n, h, 2, False, False) == (0, 0)  # frozen hidden states: no dE accumulated
    assert de(n, h, 2, False, True) == (0, 0)
    assert de(n, h, 2, True, True) == (4 * n * h, 4 * n * h)
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    cfg = K.INTERPRET_CONFIG
    e, c, _, _ = make(n=n, h=h, dtype=torch.bfloat16)
    v = c.shape[0]
    # the dlogits buffer backward allocates: one tile of all 300 rows, above the config's chunk
    chunk = n * cfg.bwd_block_v * 2
    assert cfg.chunk_bytes < chunk < n * v * 2  # several chunks, each wider than configured
    assert strategy_mod.fallback_chunk_bytes(n, v, 2, cfg.chunk_bytes, cfg) == chunk

    def pick(budget):
        return strategy_mod.choose_strategy(K, e, c, None, "none", False, None, 5.0, 0.1,
                                            budget)[:3]  # softcap and smoothing: nothing saved

    # the buffer as allocated beside the fp32 dE fits once the returned dE is not counted twice
    assert pick(max(2 * n * h + chunk, 4 * n * h)) == ("recompute", None, None)
    with pytest.warns(RuntimeWarning, match="memory_budget="):  # a byte short: no strategy fits
        assert pick(2 * n * h + chunk - 1) == ("recompute", chunk - 1, None)
    # an fp32 head with bf16 hidden states: fp32 tiles, a bf16 dE returned beside the fp32 one
    c = c.detach().float().requires_grad_()
    need = max(2 * n * h + 2 * chunk, 4 * n * h)
    assert pick(need) == ("recompute", None, None)
    with pytest.warns(RuntimeWarning, match="memory_budget="):
        assert pick(need - 1)[1] is not None


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_shift_is_the_loss_of_the_shifted_rows(impl, monkeypatch):
    """``shift`` moves the targets (and the loss mask), not the hidden states: the per-token
    losses, lse and dE of the kept positions are those of the shifted rows given alone, the
    dropped positions' dE is exactly 0, the outputs are contiguous; and the strategy a budget
    picks is the unshifted call's (the shift copies nothing: a budget of exactly the saved tiles
    saves them all)."""
    if impl == "triton" and (K is None or not interpreting()):
        pytest.skip("needs TRITON_INTERPRET=1")
    from vocab_parallel_loss.ops.linear_cross_entropy import function as lce_function

    if K is not None:
        monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    e, c, _, t = make(n=None, lead=(3, 20), h=8, v=101)
    mask = (torch.arange(60).view(3, 20) % 5 != 0).float()
    picked = []
    if K is not None:
        choose = lce_function.choose_strategy

        def spy(*a, **k):
            picked.append(choose(*a, **k))
            return picked[-1]

        monkeypatch.setattr(lce_function, "choose_strategy", spy)
    budget = K.saved_bytes(60, 101, 4, K.INTERPRET_CONFIG) if K is not None else None
    up = torch.randn(3, 19, generator=torch.Generator().manual_seed(3))
    loss, lse = linear_cross_entropy(e, c, t, shift=1, reduction="none", return_lse=True,
                                     impl=impl, memory_budget=budget, loss_mask=mask)
    assert loss.shape == lse.shape == (3, 19) and loss.is_contiguous() and lse.is_contiguous()
    (de,) = torch.autograd.grad((loss * up * mask[:, 1:]).sum() + lse.sum(), [e])
    if impl == "triton":
        assert picked[0][:3] == ("saved", None, None), picked
    e1 = e.detach()[:, :-1].clone().requires_grad_()
    want, want_lse = linear_cross_entropy(e1, c, t[:, 1:], reduction="none", return_lse=True,
                                          impl=impl)
    (want_de,) = torch.autograd.grad((want * up * mask[:, 1:]).sum() + want_lse.sum(), [e1])
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(de[:, :-1], want_de, rtol=1e-5, atol=1e-6)
    assert torch.equal(de[:, -1], torch.zeros_like(de[:, -1]))
    # a shift as long as the sequence keeps nothing: empty outputs, a zero gradient
    loss = linear_cross_entropy(e, c, t, shift=20, reduction="none", impl=impl)
    assert loss.shape == (3, 0)
    assert not torch.autograd.grad(loss.sum(), [e])[0].any()


def test_strategy_follows_memory_budget(monkeypatch):
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    # N > 2H: the fp32 dC is smaller than the saved tiles; four tiles of columns, so that one
    # saved beside the recompute's dlogits (a tile of every row) holds less than all of them
    e, c, b, t = make(n=200, h=8, v=101)
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    cfg = K.INTERPRET_CONFIG
    n, h = e.shape
    v = c.shape[0]
    saved = K.saved_bytes(n, v, e.element_size(), cfg)
    fixed, _ = strategy_mod.gif_fixed_bytes(n, v, h, e, c)
    rows = K.gif_chunk_rows(n, v, e.element_size(), saved - 1 - fixed, cfg)
    assert rows == cfg.gif_rows  # 13 chunks of 16 rows
    gif = fixed + K.saved_bytes(rows, v, e.element_size(), cfg)
    assert gif < saved

    def pick(budget, reduction="mean", softcap=None, smoothing=0.0):
        return strategy_mod.choose_strategy(K, e, c, None, reduction, False, None, softcap,
                                            smoothing, budget)[:3]

    assert pick(None) == ("saved", None, None)
    assert pick(saved) == ("saved", None, None)
    assert pick(saved - 1) == ("grad_in_forward", None, rows)
    assert pick(gif) == ("grad_in_forward", None, rows)
    assert pick(gif - 1)[0] == "recompute"  # under one chunk of the config's rows
    # per token: the first tiles saved, the rest recomputed into the fp32 dE
    # (fp32 inputs: the recompute's dE accumulator is the gradient; its dlogits, a tile of
    # every row, is what the saved tiles share the budget with)
    per_tile = K.saved_bytes(n, cfg.fwd_block_v, e.element_size(), cfg)
    chunk = strategy_mod.fallback_chunk_bytes(n, v, e.element_size(), cfg.chunk_bytes, cfg)
    split = (saved - 1 - chunk) // per_tile * cfg.fwd_block_v
    assert 0 < split < v
    assert pick(saved - 1, "none") == ("saved", None, split)
    assert pick(0) == ("recompute", 1, None)  # too small for any chunk: the narrowest
    # smoothing through a softcap needs every logit: the saved probabilities lack them
    assert pick(None, softcap=3.0, smoothing=0.1)[0] == "recompute"
    assert pick(None, "none", softcap=3.0, smoothing=0.1)[0] == "recompute"
    with torch.no_grad():
        assert pick(None) == ("recompute", None, None)

    # the forward's room for temporaries (an fp32 head's parts): the budget less what the
    # forward holds, so that the forward's peak stays within the budget too
    def room(budget, reduction="mean"):
        return strategy_mod.choose_strategy(K, e, c, None, reduction, False, None, None, 0.0,
                                            budget).room

    assert room(saved) == 0 and room(saved + 1000) == 1000
    assert room(gif) == gif - fixed - K.saved_bytes(rows, v, e.element_size(), cfg)
    assert room(saved - 1, "none") == saved - 1 - K.saved_bytes(n, split, e.element_size(), cfg)
    assert room(gif - 1) == gif - 1  # recompute: nothing held in forward
    with torch.no_grad():
        assert room(12345) == 12345 and room(None) == strategy_mod.DEFAULT_MEMORY_BUDGET
    with pytest.raises(ValueError, match="memory_budget"):
        linear_cross_entropy(e, c, t, memory_budget=-1)
    for bad in ("1GiB", True):
        with pytest.raises(TypeError, match="memory_budget"):
            linear_cross_entropy(e, c, t, memory_budget=bad)


def test_a_budget_no_strategy_meets_warns(monkeypatch):
    """A positive budget below the least the engine holds (the fp32 dE beyond the dE returned,
    beside one tile of dlogits columns; at its rounding the whole fp32 dE) warns, naming the
    budget and what the call holds instead; one that meets it does not, nor does 0 (the least
    memory, asked for) or the default. The narrowest chunks give the same gradients either way."""
    import warnings

    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    cfg = K.INTERPRET_CONFIG
    tile = cfg.bwd_block_v
    for dtype in (torch.float32, torch.bfloat16):
        e, c, _, t = make(n=200, h=8, dtype=dtype)
        n, h = e.shape
        size = e.element_size()
        hold, rounding = strategy_mod.recompute_de_bytes(n, h, size, True, False)
        floor = max(hold + n * tile * size, rounding)

        def pick(budget):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = strategy_mod.choose_strategy(K, e, c, None, "none", False, None, None,
                                                   0.0, budget)
            return got[0], [str(w.message) for w in caught if w.category is RuntimeWarning]

        assert pick(floor) == ("recompute", [])
        name, said = pick(floor - 1)
        assert name == "recompute" and len(said) == 1, said
        assert f"memory_budget={floor - 1} bytes" in said[0] and f"{floor} bytes" in said[0]
        assert pick(0) == ("recompute", []) and pick(None)[1] == []
        # a frozen input holds no dE: one tile of dlogits is the least
        e = e.detach()
        assert pick(n * tile * size) == ("recompute", [])
        assert "memory_budget=" in pick(n * tile * size - 1)[1][0]

    e, c, _, t = make(n=200, h=8)
    with pytest.warns(RuntimeWarning, match="memory_budget=1 bytes"):
        low = run(e, c, None, t, "triton", reduction="none", memory_budget=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        least = run(e, c, None, t, "triton", reduction="none", memory_budget=0)
    assert torch.equal(low[0], least[0])
    assert all(torch.equal(a, b) for a, b in zip(low[1], least[1]))


def test_fp32_tiles_take_longer_gradient_in_forward_chunks():
    """The GPU config's rows per chunk of the gradients in forward: fp32 tiles (an fp32 head)
    need at least ``wide_gif_min_blocks`` row blocks, 16-bit ones ``gif_min_blocks``; below, the
    strategy saves columns instead (0 rows)."""
    if K is None:
        pytest.skip("needs triton")
    n, v = 8192, 151936
    base = KC.LCEConfig()
    wide = base.for_tiles(torch.float32)
    assert base.for_tiles(torch.bfloat16) == base
    block = base.fwd_block_n
    for cfg, size in ((base, 2), (wide, 4)):
        least = cfg.gif_min_blocks * block
        per_row = K.saved_bytes(1, v, size, cfg)
        assert K.gif_chunk_rows(n, v, size, least * per_row, cfg) >= least
        assert K.gif_chunk_rows(n, v, size, (least - 1) * per_row, cfg) == 0
        # a batch shorter than the floor runs in one chunk when it fits whole
        assert K.gif_chunk_rows(least // 2, v, size, least * per_row, cfg) == least // 2
    assert wide.gif_min_blocks > base.gif_min_blocks
    mid = (wide.gif_min_blocks * block - 1) * K.saved_bytes(1, v, 4, wide)
    assert K.gif_chunk_rows(n, v, 2, mid, base) > 0 and K.gif_chunk_rows(n, v, 4, mid, wide) == 0


def _one_saved_tile_budget(n, h, v, size):
    """The budget that saves one tile of the logits and recomputes the rest."""
    return one_saved_tile_budget(K, n, h, v, size, K.INTERPRET_CONFIG)


@pytest.mark.parametrize("budget", [None, 0, "one-tile"])
def test_memory_budget_results_agree(budget, monkeypatch):
    # every strategy against the oracle, with the budget passed the way users pass it
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    if budget == "one-tile":  # 200 rows of H = 8: the saved tiles outweigh the fp32 dE
        e, c, _, _ = make(n=200, h=8, v=101)  # four tiles of columns: one saved, three not
        budget = _one_saved_tile_budget(200, 8, 101, 4)
        picked = strategy_mod.choose_strategy(K, e, c, None, "none", False, None, None, 0.0,
                                              budget)
        assert picked[:3] == ("saved", None, K.INTERPRET_CONFIG.fwd_block_v)
        check("triton", torch.float32, reduction="none", upstream=True, bias=True,
              softcap=3.0, memory_budget=budget, n=200, h=8, v=101)
        check("triton", torch.bfloat16, reduction="none", upstream=True, bias=True,
              memory_budget=_one_saved_tile_budget(200, 8, 101, 2), lead=(4, 50), shift=1, h=8,
              v=101)
        return
    check("triton", torch.float32, reduction="none", upstream=True, bias=True, memory_budget=budget)
    check("triton", torch.bfloat16, reduction="mean", label_smoothing=0.1, memory_budget=budget)


def test_saved_strategy_second_backward_is_a_clear_error():
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    e, c, b, t = make()
    loss = linear_cross_entropy(e, c, t, impl="triton")
    torch.autograd.grad(loss, e, retain_graph=True)
    with pytest.raises(RuntimeError, match="memory_budget=0"):
        torch.autograd.grad(loss, e)
    loss = linear_cross_entropy(e, c, t, impl="triton", memory_budget=0)
    first = torch.autograd.grad(loss, e, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(loss, e)[0], first)


@pytest.mark.parametrize("budget", [None, 0], ids=["saved", "recompute"])
def test_torch_compile_matches_eager(budget):
    # the Triton backend runs as a graph break inside the compiled program
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    e, c, b, t = make(bias=True)
    up = torch.rand(t.shape, generator=torch.Generator().manual_seed(4))
    kw = dict(reduction="none", memory_budget=budget, impl="triton", softcap=4.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda e, c, b, t: linear_cross_entropy(e, c, t, b, **kw))
    got = []
    for fn in (compiled, lambda e, c, b, t: linear_cross_entropy(e, c, t, b, **kw)):
        loss = fn(e, c, b, t)
        got.append((loss.detach(), *torch.autograd.grad(loss, (e, c, b), up)))
    for a, w in zip(*got):
        assert torch.equal(a, w)


# ------------------------------------------- masked vocabulary columns (-inf logits), autocast


def _masked_bias(v, g, dtype=torch.float32):
    """A bias of ``v`` columns with ``-inf`` over whole vocabulary tiles of the interpreter's
    config (the first tile of each forward split, and one after a finite tile) and over random
    columns: the padded columns of a vocabulary. Returns the bias and the kept columns."""
    tile = K.INTERPRET_CONFIG.fwd_block_v if K is not None else 32
    b = torch.randn(v, generator=g)
    keep = torch.rand(v, generator=g) > 0.15
    for k in (0, 2, 3):  # split=2 over 6 tiles: tiles 0-2 and 3-5
        keep[k * tile:(k + 1) * tile] = False
    b[~keep] = float("-inf")
    return b.to(dtype).requires_grad_(), keep


def _masked_case(dtype, n=37, h=24, v=None, seed=21):
    """Inputs whose targets avoid the masked columns (a masked target's loss is infinite)."""
    tile = K.INTERPRET_CONFIG.fwd_block_v if K is not None else 32
    v = 6 * tile - 3 if v is None else v  # six tiles, the last one partial
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    c = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    b, keep = _masked_bias(v, g, dtype)
    kept = keep.nonzero()[:, 0]
    t = kept[torch.randint(0, kept.numel(), (n,), generator=g)]
    t[3] = -100
    return e, c, b, t, keep


MASKED_PLANS = ["saved", "split", "grad_in_forward", "recompute", "desc", "torch"]


@pytest.mark.parametrize("plan", MASKED_PLANS)
def test_masked_columns_match_oracle(plan, monkeypatch):
    """-inf logits over whole vocabulary tiles (a tile whose fold starts from a running max of
    -inf, and one saved as u = exp(x - max) with max = -inf) and over random columns: finite
    loss and lse, the oracle's gradients and exactly zero gradients at the masked columns, for
    every strategy a memory budget can pick and on both backends."""
    if plan != "torch" and (K is None or not interpreting()):
        pytest.skip("needs TRITON_INTERPRET=1")
    dtype = torch.bfloat16 if plan == "desc" else torch.float32
    reduction, budget = "none", None
    if plan != "torch":
        cfg = K.INTERPRET_CONFIG
        if plan == "grad_in_forward":
            cfg, reduction = cfg.replace(strategy="grad_in_forward"), "mean"
        if plan == "desc":  # TMA descriptors: the flat loop, the tiles saved through one
            cfg = cfg.replace(fwd_desc=True, fwd_flat=True, bwd_desc=True)
        monkeypatch.setattr(KC, "OVERRIDE_CONFIG", cfg)
    e, c, b, t, keep = _masked_case(dtype)
    n, h = e.shape
    v = c.shape[0]
    if plan == "split":
        budget = _one_saved_tile_budget(n, h, v, e.element_size())
    elif plan == "recompute":
        budget = 0
    impl = "torch" if plan == "torch" else "triton"
    if impl == "triton":
        want_plan = {"saved": "saved", "split": "saved", "desc": "saved",
                     "grad_in_forward": "grad_in_forward", "recompute": "recompute"}[plan]
        picked = strategy_mod.choose_strategy(K, e, c, b, reduction, False, None, None, 0.0,
                                              budget)
        assert picked.name == want_plan
        assert (picked.size is not None) == (plan == "split")
    up = None if reduction != "none" else torch.randn(n, generator=torch.Generator().manual_seed(5))
    out, lse = linear_cross_entropy(e, c, t, b, reduction=reduction, return_lse=True,
                                    memory_budget=budget, impl=impl)
    w = torch.randn(n, generator=torch.Generator().manual_seed(6))
    total = (out * (1.0 if up is None else up)).sum() + (w * lse).sum()
    got = torch.autograd.grad(total, (e, c, b))
    leaves = [x.detach().double().requires_grad_() for x in (e, c, b)]
    want, wlse = lce_reference(*leaves[:2], t, leaves[2], reduction=reduction)
    wtotal = (want * (1.0 if up is None else up.double())).sum() + (w.double() * wlse).sum()
    wanted = torch.autograd.grad(wtotal, leaves)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tol = TOL[dtype][0] * 10
    torch.testing.assert_close(out.double(), want.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), wlse.detach(), atol=tol, rtol=tol)
    assert_grads_close(got, wanted, dtype)
    assert torch.all(got[1][~keep] == 0) and torch.all(got[2][~keep] == 0)


def test_masked_shard_statistics_on_both_backends():
    """A shard whose every column is masked (the padding rank of a TP vocabulary): max -inf and
    a sum of 0, which the merge over the ranks leaves out, on both backends."""
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    e, c, _, t, _ = _masked_case(torch.float32)
    b = torch.full((c.shape[0],), float("-inf"))
    for backend in (K, TorchBackend):
        stats = backend.forward_stats(e.detach(), c.detach(), b, t, 0, None, False)
        assert torch.all(stats[0] == float("-inf")), backend.NAME
        assert torch.all(stats[1] == 0), backend.NAME


@pytest.mark.parametrize("reduction,region", [("mean", "both"), ("none", "both"),
                                              ("none", "backward")])
def test_autocast_keeps_the_inputs_precision(impl, reduction, region):
    """Under torch.autocast to bf16, fp32 inputs still give fp32-accurate losses and gradients on
    both backends (autocast would round the logits GEMM to bf16: ~1e-3 relative), the forward
    and backward in the autocast region, or the backward alone (a custom Function's backward
    runs under the autocast of the region it is called in)."""
    e, c, b, t = make(bias=True)
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(9))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region == "both"):
        out = linear_cross_entropy(e, c, t, b, reduction=reduction, impl=impl)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad((out * (up if reduction == "none" else 1.0)).sum(), (e, c, b))
    want, wgrads = reference_grads(e, c, t, b, up if reduction == "none" else None,
                                   reduction=reduction)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    assert_grads_close(got, wgrads, torch.float32)
