"""``linear_cross_entropy(..., reduction="none", loss_mask=...)``: gradients formed in forward for
an upstream gradient proportional to the loss mask, against the fp64 oracle.

Where the upstream gradient is ``k * loss_mask`` exactly, backward only scales what the forward
formed (the device test ``masked.upstream_scale`` says ``ok``); any other upstream gradient
(random, one token off by an ulp, non-finite, the lse's gradient too) gets the exact gradient from
the recompute that backward always launches and whose kernels skip themselves otherwise. Both
backends (the PyTorch one recomputes). Odd small shapes, the interpreter's tiles, several row
chunks and column chunks.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from tests._linear_oracle import lce_reference, reference_grads
from vocab_parallel_loss import VocabParallelLinearCrossEntropy, backends, linear_cross_entropy
from vocab_parallel_loss.settings import interpreting

K = backends.triton_linear
fn_mod = importlib.import_module("vocab_parallel_loss.ops.linear_cross_entropy.function")
masked_mod = importlib.import_module("vocab_parallel_loss.ops.linear_cross_entropy.masked")
strategy_mod = importlib.import_module("vocab_parallel_loss.ops.fused_linear.strategy")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture
def spy(monkeypatch):
    """Forces the gradients in forward on the Triton backend (the tiny shapes would save every
    tile) and records, per backward, whether the formed gradients were used (``ok``)."""
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(K.config, "OVERRIDE_CONFIG",
                        K.INTERPRET_CONFIG.replace(strategy="grad_in_forward"))
    taken = []
    orig = masked_mod.upstream_scale

    def record(*a, **kw):
        k, ok = orig(*a, **kw)
        taken.append(ok)
        return k, ok

    monkeypatch.setattr(masked_mod, "upstream_scale", record)
    return taken


def make(n=37, h=24, v=53, dtype=torch.float32, seed=0, bias=False, lead=None):
    g = torch.Generator().manual_seed(seed)
    shape = (n, h) if lead is None else (*lead, h)
    e = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    c = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, shape[:-1], generator=g)
    t[torch.rand(shape[:-1], generator=g) < 0.15] = -100
    mask = (torch.rand(shape[:-1], generator=g) > 0.3).float()
    return e, c, b, t, mask


def upstreams(mask, t, shift=0):
    """name -> (upstream of the shifted per-token loss, whether it is k * mask)."""
    m = mask[..., shift:]
    valid = (t[..., shift:] != -100)
    g = torch.Generator().manual_seed(5)
    off = (0.25 * m).clone()
    i = int(torch.nonzero((m.reshape(-1) != 0) & valid.reshape(-1))[0])
    off.view(-1)[i] = torch.nextafter(off.view(-1)[i], torch.tensor(1.0))  # one token, one ulp
    nan_kept = (0.25 * m).clone()
    nan_kept.view(-1)[i] = float("nan")
    inf_ignored = (0.25 * m).clone()
    inf_ignored[~valid] = float("inf")  # ignored tokens have gradient 0 whatever theirs is
    return {
        "k*mask": (0.37 * m, True),
        "mask/count": (m / m.sum(), True),
        "zeros": (torch.zeros_like(m), True),
        "inf-on-ignored": (inf_ignored, True),
        "random": (torch.randn(m.shape, generator=g), False),
        "one-ulp-off": (off, False),
        "nan-on-kept": (nan_kept, False),
        "k*mask+1": (0.37 * m + 1, False),
    }


def grads_of(e, c, b, t, mask, up, impl, **kw):
    loss = linear_cross_entropy(e, c, t, b, reduction="none", loss_mask=mask, impl=impl, **kw)
    leaves = [x for x in (e, c, b) if x is not None]
    return loss.detach(), torch.autograd.grad(loss, leaves, up.to(loss.dtype))


def assert_exact(got, up, e, c, b, t, dtype, **kw):
    loss, grads = got
    valid = t[..., kw.get("shift", 0):] != -100
    oracle_up = torch.where(valid, up.double(), torch.zeros((), dtype=torch.float64))
    want, wgrads = reference_grads(e, c, t, b, oracle_up, reduction="none", **kw)
    torch.testing.assert_close(loss.double(), want, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    for name, a, w in zip(("dE", "dC", "dbias"), grads, wgrads):
        assert a.dtype == dtype and a.shape == w.shape, name
        nan = torch.isnan(w)
        assert torch.equal(torch.isnan(a), nan), f"{name}: NaN where the oracle has none, or not"
        a, w = a.double()[~nan], w[~nan]
        scale = w.abs().max().item() if w.numel() else 1.0
        err = (a - w).abs().max().item() if w.numel() else 0.0
        assert err <= TOL[dtype] * (scale or 1.0) + 1e-12, f"{name}: err {err:.3g}, scale {scale:.3g}"


CASES = [
    dict(),
    dict(dtype=torch.bfloat16, bias=True),
    dict(softcap=4.0, z_loss=1e-2, shift=1, lead=(3, 13)),
    dict(label_smoothing=0.1, bias=True, n=19, h=17, v=31),
]


@pytest.mark.parametrize("case", CASES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "plain")
def test_masked_gradients_match_oracle(spy, case):
    """Triton: the formed gradients for every upstream gradient that is k * mask, the exact
    fallback for every other, all against the fp64 oracle."""
    case = dict(case)
    dtype = case.pop("dtype", torch.float32)
    shape = dict(n=case.pop("n", 37), h=case.pop("h", 24), v=case.pop("v", 53),
                 lead=case.pop("lead", None))
    e, c, b, t, mask = make(dtype=dtype, bias=case.pop("bias", False), **shape)
    ups = upstreams(mask, t, case.get("shift", 0))
    if case or dtype != torch.float32:  # every upstream on the plain case, two on the others
        ups = {k: ups[k] for k in ("mask/count", "one-ulp-off")}
    for name, (up, fast) in ups.items():
        got = grads_of(e, c, b, t, mask, up, "triton", **case)
        assert [bool(x) for x in spy] == [fast], (name, spy)
        spy.clear()
        assert_exact(got, up, e, c, b, t, dtype, **case)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_both_backends_exact_for_any_upstream(impl, monkeypatch):
    """The default strategy choice (``"auto"``): the PyTorch backend recomputes, the Triton one
    saves every tile on these shapes; the mask changes neither result."""
    if impl == "triton" and (K is None or not interpreting()):
        pytest.skip("needs TRITON_INTERPRET=1")
    e, c, b, t, mask = make(bias=True, n=21, v=45)
    ups = upstreams(mask, t)
    for name in ("k*mask", "random", "nan-on-kept", "inf-on-ignored"):
        up = ups[name][0]
        assert_exact(grads_of(e, c, b, t, mask, up, impl), up, e, c, b, t, torch.float32)


def test_lse_gradient_takes_the_fallback(spy):
    e, c, b, t, mask = make(bias=True)
    loss, lse = linear_cross_entropy(e, c, t, b, reduction="none", loss_mask=mask, impl="triton",
                                     return_lse=True)
    w = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((0.5 * mask * loss).sum() + (w * lse).sum(), (e, c, b))
    assert [bool(x) for x in spy] == [False]
    leaves = [x.detach().double().requires_grad_() for x in (e, c, b)]
    l2, lse2 = lce_reference(*leaves[:2], t, leaves[2], reduction="none")
    want = torch.autograd.grad((0.5 * mask.double() * l2).sum() + (w.double() * lse2).sum(), leaves)
    for a, wv in zip(got, want):
        assert (a.double() - wv).abs().max() <= 2e-5 * wv.abs().max()


def test_all_masked_and_main_grad(spy):
    """A mask of zeros: k = 0, the formed zeros used; ``gradient_accumulation_fusion`` adds the
    scaled dC into ``main_grad``."""
    e, c, _, t, mask = make()
    zero = torch.zeros_like(mask)
    loss = linear_cross_entropy(e, c, t, reduction="none", loss_mask=zero, impl="triton")
    de, dc = torch.autograd.grad(loss, (e, c), zero)
    assert [bool(x) for x in spy] == [True] and not de.any() and not dc.any()
    spy.clear()
    c2 = c.detach().clone().requires_grad_()
    c2.main_grad = torch.ones_like(c2)
    up = 0.37 * mask
    loss = linear_cross_entropy(e, c2, t, reduction="none", loss_mask=mask, impl="triton",
                                gradient_accumulation_fusion=True)
    loss.backward(up)
    assert [bool(x) for x in spy] == [True]
    _, (_, wdc) = reference_grads(e, c, t, upstream=torch.where(t != -100, up, 0.0),
                                  reduction="none")
    assert (c2.main_grad.double() - 1 - wdc).abs().max() <= 2e-5 * wdc.abs().max()


def test_module_second_backward_and_no_grad(spy):
    e, c, _, t, mask = make()
    loss = VocabParallelLinearCrossEntropy(reduction="none", impl="triton")(e, c, t, loss_mask=mask)
    loss.backward(mask, retain_graph=True)
    with pytest.raises(RuntimeError, match="memory_budget=0"):
        loss.backward(mask)
    with torch.no_grad():  # nothing to form: the plain forward
        linear_cross_entropy(e, c, t, reduction="none", loss_mask=mask, impl="triton")


def test_backward_reads_nothing_on_the_host(spy, monkeypatch):
    """No host sync on the way from the upstream gradient to the gradients: the device test and
    the gated fallback run with every tensor-to-host conversion raising (on a GPU the same runs
    under ``torch.cuda.set_sync_debug_mode``, test_linear_cross_entropy_gpu.py)."""
    e, c, b, t, mask = make(bias=True)
    for up in (0.37 * mask, torch.randn(mask.shape)):
        loss = linear_cross_entropy(e, c, t, b, reduction="none", loss_mask=mask, impl="triton")
        calls = []

        def refuse(name):
            def host(self, *a, **kw):
                calls.append(name)
                raise AssertionError(f"Tensor.{name} in the masked backward")
            return host

        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
                m.setattr(torch.Tensor, name, refuse(name))
            grads = torch.autograd.grad(loss, (e, c, b), up)
        assert not calls and all(torch.isfinite(g).all() for g in grads)
    source = inspect.getsource(masked_mod)
    assert ".item(" not in source and ".cpu(" not in source and ".tolist(" not in source


def test_each_accumulator_released_once_rounded(spy, monkeypatch):
    """Backward rounds the fp32 dE and dC formed in forward one at a time and releases each once
    rounded: while the second is rounded the first no longer exists (the budget counts it so;
    holding both beside the new gradient took a quarter GiB more at 16384 x 4096 x 128256)."""
    import weakref

    e, c, _, t, mask = make(dtype=torch.bfloat16)
    loss = linear_cross_entropy(e, c, t, reduction="none", loss_mask=mask, impl="triton")
    formed = [weakref.ref(x) for x in loss.grad_fn.formed[:2]]  # fp32 dE, dC
    alive_at_rounding = []
    orig = K.scaled_round

    def record(src, scale, out):
        alive_at_rounding.append([r() is not None for r in formed])
        return orig(src, scale, out)

    monkeypatch.setattr(K, "scaled_round", record)
    torch.autograd.grad(loss, (e, c), 0.37 * mask)
    assert [bool(x) for x in spy] == [True]  # the formed gradients were used
    assert len(alive_at_rounding) == 2, alive_at_rounding
    assert alive_at_rounding[0] == [True, True]
    assert sum(alive_at_rounding[1]) == 1, alive_at_rounding


def test_errors():
    e, c, _, t, mask = make()
    with pytest.raises(ValueError, match="reduction='none'"):
        linear_cross_entropy(e, c, t, reduction="mean", loss_mask=mask)
    with pytest.raises(ValueError, match="loss_mask must have the shape of targets"):
        linear_cross_entropy(e, c, t, reduction="none", loss_mask=mask[1:])
    with pytest.raises(ValueError, match="loss_mask.detach"):
        linear_cross_entropy(e, c, t, reduction="none", loss_mask=mask.requires_grad_())
    with pytest.raises(TypeError, match="loss_mask must be a tensor"):
        linear_cross_entropy(e, c, t, reduction="none", loss_mask=[1.0])


def test_strategy_with_a_loss_mask(monkeypatch):
    """Per-token losses with a mask form their gradients in forward where the saved tiles do not
    fit (with or without TP), within the same budget accounting; without a mask, never."""
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(K.config, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    cfg = K.INTERPRET_CONFIG
    e, c, _, _, _ = make(n=200, h=8, dtype=torch.bfloat16)
    n, h = e.shape
    v = c.shape[0]
    saved = K.saved_bytes(n, v, 2, cfg)

    def pick(budget, masked=True, world=1, sp=False):
        monkeypatch.setattr(strategy_mod.communication, "world_size", lambda g: world)
        return strategy_mod.choose_strategy(K, e, c, None, "none", sp, None, None, 0.0, budget,
                                            masked=masked)

    assert pick(saved).name == "saved"
    got = pick(saved - 1)
    assert got.name == "grad_in_forward" and got.size == cfg.gif_rows
    assert got.chunk_bytes == strategy_mod.fallback_chunk_bytes(n, v, 2, K.saved_bytes(
        got.size, v, 2, cfg), cfg)
    forward, backward = strategy_mod.masked_gif_bytes(n, v, h, e, c, False, 1, False,
                                                      got.chunk_bytes)
    assert forward + K.saved_bytes(got.size, v, 2, cfg) <= saved - 1 and backward <= saved - 1
    assert pick(saved - 1, masked=False).name != "grad_in_forward"
    under_tp = pick(saved * 2 + 4 * n * h, world=2, sp=True)  # n rows per rank, gathered 2n
    assert under_tp.name == "grad_in_forward", under_tp
    tight = forward + K.saved_bytes(4 * cfg.fwd_block_n, v, 2, cfg)
    assert pick(tight - 1).name != "grad_in_forward"
