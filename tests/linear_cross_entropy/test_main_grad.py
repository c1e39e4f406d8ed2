"""``gradient_accumulation_fusion=True``: the classifier's gradient added into ``c.main_grad``
(megatron-core's protocol), on every strategy and both backends, against the fp64 oracle."""

from __future__ import annotations

import pytest
import torch

from tests._budgets import one_saved_tile_budget
from tests._linear_oracle import reference_grads
from tests.linear_cross_entropy.test_linear_cross_entropy import K, KC, make, strategy_mod
from vocab_parallel_loss import VocabParallelLinearCrossEntropy, linear_cross_entropy
from vocab_parallel_loss.settings import interpreting

# (impl, forced LCEConfig.strategy or None, reduction): "split" saves the first tile of columns
# and recomputes the rest (a per-token loss under a budget of one tile)
CASES = {
    "saved": ("triton", "saved", "mean"),
    "grad_in_forward": ("triton", "grad_in_forward", "mean"),
    "recompute": ("triton", "recompute", "none"),
    "split": ("triton", "split", "none"),
    "torch": ("torch", None, "mean"),
}


@pytest.fixture(params=list(CASES))
def case(request, monkeypatch):
    impl, strategy, reduction = CASES[request.param]
    kw = {"impl": impl, "reduction": reduction}
    if impl == "triton":
        if K is None or not interpreting():
            pytest.skip("the CPU tests run the Triton kernels through TRITON_INTERPRET=1")
        cfg = K.INTERPRET_CONFIG
        if strategy == "split":
            monkeypatch.setattr(KC, "OVERRIDE_CONFIG", cfg)
            n, h, v = 37, 24, 53
            kw["memory_budget"] = one_saved_tile_budget(K, n, h, v, 4, cfg)
        else:
            monkeypatch.setattr(KC, "OVERRIDE_CONFIG", cfg.replace(strategy=strategy))
    return request.param, kw


def _home(c, dtype, seed=5, flag=True):
    g = torch.Generator().manual_seed(seed)
    c.main_grad = torch.randn(c.shape, generator=g).to(dtype)
    if flag:
        c.grad_added_to_main_grad = False  # what megatron-core's DDP sets on its parameters
    return c.main_grad.clone()


def _upstream(loss, seed=9):
    if loss.dim() == 0:
        return torch.tensor(0.7)
    return torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def _assert_close(got, want, rtol, name):
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want).abs().max().item()
    assert err <= rtol * scale, f"{name}: max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("home_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_is_added_into_main_grad(case, dtype, home_dtype):
    name, kw = case
    e, c, b, t = make(dtype=dtype, bias=True)
    before = _home(c, home_dtype)
    loss = linear_cross_entropy(e, c, t, b, gradient_accumulation_fusion=True, **kw)
    up = _upstream(loss)
    loss.backward(up.to(loss.dtype))
    _, (de, dc, db) = reference_grads(e, c, t, b, up, reduction=kw["reduction"])
    # the dummy megatron-core's hook skips: zeros, flagged
    assert c.grad_added_to_main_grad is True
    assert c.grad.dtype == c.dtype and c.grad.shape == c.shape and not c.grad.any()
    rtol = 2e-5 if dtype == torch.float32 else 2e-2
    want = before.double() + dc
    # rounded once into main_grad's dtype: within one ulp of the exact sum (the interpreter's
    # bf16 stores truncate; the GPU's round to nearest)
    ulp = 2.0 ** -7 if home_dtype == torch.bfloat16 else 2.0 ** -23
    err = (c.main_grad.double() - want).abs()
    bound = rtol * dc.abs().max().item() + ulp * want.abs()
    assert torch.all(err <= bound), f"{name}: max excess {(err - bound).max().item():.3g}"
    _assert_close(e.grad, de, rtol, "dE")
    _assert_close(b.grad, db, rtol, "dbias")


def test_same_gradient_as_returned(case):
    # fp32 everywhere: the home receives what the plain call returns
    name, kw = case
    e, c, b, t = make(bias=True)
    plain = torch.autograd.grad(linear_cross_entropy(e, c, t, b, **kw).sum(), c)[0]
    before = _home(c, torch.float32)
    linear_cross_entropy(e, c, t, b, gradient_accumulation_fusion=True, **kw).sum().backward()
    torch.testing.assert_close(c.main_grad - before, plain, rtol=1e-5, atol=1e-6)


def test_tied_weight_keeps_its_other_gradient(case):
    # a tied embedding: its own gradient reaches .grad (summed with the zeros), dC main_grad
    name, kw = case
    e, c, b, t = make()
    before = _home(c, torch.float32)
    w = torch.randn(c.shape, generator=torch.Generator().manual_seed(4))
    loss = linear_cross_entropy(e, c, t, gradient_accumulation_fusion=True, **kw)
    (loss.sum() + (w * c).sum()).backward()
    assert torch.equal(c.grad, w)
    dc = reference_grads(e, c, t, None, torch.ones(loss.shape), reduction=kw["reduction"])[1][1]
    _assert_close(c.main_grad - before, dc, 2e-5, "dC")


def test_without_the_flag_no_gradient_reaches_grad(case):
    name, kw = case
    e, c, b, t = make()
    before = _home(c, torch.float32, flag=False)
    linear_cross_entropy(e, c, t, gradient_accumulation_fusion=True, **kw).sum().backward()
    assert c.grad is None and e.grad is not None
    assert not torch.equal(c.main_grad, before)


def test_grad_in_forward_budget_counts_the_whole_accumulator(monkeypatch):
    # with a home nothing of the fp32 dC is returned: fewer rows fit the same budget
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG.replace(gif_rows=10 ** 6))
    e, c, _, _ = make(n=2000, h=8, dtype=torch.bfloat16)
    n, h, v = 2000, 8, 53

    def pick(budget, main_grad):
        return strategy_mod.choose_strategy(K, e, c, None, "mean", False, None, None, 0.0,
                                            budget, main_grad)[:3]

    # forward: fp32 accumulators less the bf16 gradients returned; backward rounds one at a
    # time, in the order of the lower peak: dE first (fp32 dE and dC and the bf16 dE, then fp32
    # dC, bf16 dC and dE) where V > N, dC first (fp32 dE and dC and the bf16 dC, then fp32 dE,
    # bf16 dE and dC) where N > V, as here
    fixed, backward = strategy_mod.gif_fixed_bytes(n, v, h, e, c)
    assert (fixed, backward) == (v * h * 2 + n * h * 2, max(n * h * 2 + v * h * 4, n * h * 4))
    assert strategy_mod.gif_round_dc_first(n, v, h, e, c)
    wide = 5 * n  # a vocabulary wider than the rows
    assert strategy_mod.gif_fixed_bytes(n, wide, h, e, c)[1] == max(n * h * 4 + wide * h * 2,
                                                                   wide * h * 4)
    assert not strategy_mod.gif_round_dc_first(n, wide, h, e, c)
    # into main_grad: dC first, allocating nothing, then dE
    assert strategy_mod.gif_fixed_bytes(n, v, h, e, c, main_grad=True) == (
        v * h * 4 + n * h * 2, max(v * h * 4 + n * h * 2, n * h * 4))
    # fp32 inputs: both accumulators become the gradients returned
    e32, c32 = (x.detach().float().requires_grad_() for x in (e, c))
    assert strategy_mod.gif_fixed_bytes(n, v, h, e32, c32) == (0, 0)
    cfg = KC.OVERRIDE_CONFIG
    block = cfg.fwd_block_n
    budget = fixed + K.saved_bytes(n // 2 // block * block + block, v, 2, cfg)  # two chunks
    rows = K.gif_chunk_rows(n, v, 2, budget - fixed, cfg)
    assert pick(budget, False) == ("grad_in_forward", None, rows)
    home_rows = K.gif_chunk_rows(n, v, 2, budget - fixed - v * h * 2, cfg)
    assert 0 < home_rows < rows and pick(budget, True) == ("grad_in_forward", None, home_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_in_forward_hands_its_gradients_out_once(monkeypatch, dtype):
    # the gradients formed in forward are scaled in place (fp32 weights: the accumulator becomes
    # the gradient), so a second backward through the graph is refused by name
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG",
                        K.INTERPRET_CONFIG.replace(strategy="grad_in_forward"))
    e, c, b, t = make(dtype=dtype)
    loss = linear_cross_entropy(e, c, t, impl="triton")
    got = torch.autograd.grad(loss, c, retain_graph=True)[0]
    _assert_close(got, reference_grads(e, c, t)[1][1], 2e-5 if dtype == torch.float32 else 2e-2,
                  "dC")
    with pytest.raises(RuntimeError, match="memory_budget=0"):
        torch.autograd.grad(loss, c)


def test_errors_name_the_argument():
    e, c, b, t = make()
    with pytest.raises(ValueError, match="gradient_accumulation_fusion.*main_grad"):
        linear_cross_entropy(e, c, t, gradient_accumulation_fusion=True)
    c.main_grad = torch.zeros(c.shape[0] + 1, c.shape[1])
    with pytest.raises(ValueError, match="gradient_accumulation_fusion.*shaped like c"):
        linear_cross_entropy(e, c, t, gradient_accumulation_fusion=True)
    c.main_grad = torch.zeros(c.shape, dtype=torch.int32)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        linear_cross_entropy(e, c, t, gradient_accumulation_fusion=True)
    for bad in (1, "yes"):
        with pytest.raises(TypeError, match="gradient_accumulation_fusion"):
            linear_cross_entropy(e, c, t, gradient_accumulation_fusion=bad)
        with pytest.raises(TypeError, match="gradient_accumulation_fusion"):
            VocabParallelLinearCrossEntropy(gradient_accumulation_fusion=bad)


def test_module_passes_it_on():
    e, c, b, t = make()
    before = _home(c, torch.float32)
    mod = VocabParallelLinearCrossEntropy(gradient_accumulation_fusion=True, impl="torch")
    assert "gradient_accumulation_fusion=True" in repr(mod)
    mod(e, c, t).backward()
    assert c.grad_added_to_main_grad and not torch.equal(c.main_grad, before)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_under_torch_compile(impl):
    # the home is written at run time, each step (not once while tracing)
    if impl == "triton" and (K is None or not interpreting()):
        pytest.skip("needs TRITON_INTERPRET=1")
    e, c, b, t = make()
    before = _home(c, torch.float32)
    torch._dynamo.reset()
    step = torch.compile(lambda e, c, t: linear_cross_entropy(
        e, c, t, impl=impl, gradient_accumulation_fusion=True))
    c_plain = c.detach().requires_grad_()
    want = torch.autograd.grad(linear_cross_entropy(e, c_plain, t, impl=impl), c_plain)[0]
    for k in (1, 2):
        c.grad_added_to_main_grad = False
        step(e, c, t).backward()
        assert c.grad_added_to_main_grad
        torch.testing.assert_close(c.main_grad - before, k * want, rtol=1e-5, atol=1e-6)


def test_when_megatron_asks_for_it():
    # the integrations' rule: the config's flag and a DDP main_grad; never under Megatron-FSDP,
    # whose main_grad is fetched anew in backward
    from types import SimpleNamespace

    from vocab_parallel_loss.autograd.main_grad import requested

    on, off = (SimpleNamespace(gradient_accumulation_fusion=f) for f in (True, False))
    w = torch.nn.Parameter(torch.zeros(3, 2))
    assert not requested(on, w) and not requested(SimpleNamespace(), w)
    w.main_grad = torch.zeros(3, 2)
    assert requested(on, w) and not requested(off, w) and not requested(None, w)
    w.__fsdp_param__ = True
    assert not requested(on, w)


def test_grad_in_forward_with_the_lse_gradient(monkeypatch):
    # the lse output's gradient is recomputed into the same fp32 sum before main_grad gets it
    if K is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG",
                        K.INTERPRET_CONFIG.replace(strategy="grad_in_forward"))
    e, c, b, t = make(bias=True)
    w = torch.randn(t.shape, generator=torch.Generator().manual_seed(3))

    def total(c_):
        loss, lse = linear_cross_entropy(e, c_, t, b, return_lse=True, impl="triton",
                                         gradient_accumulation_fusion=hasattr(c_, "main_grad"))
        return 0.37 * loss + (w * lse).sum()

    c_plain = c.detach().requires_grad_()
    want = torch.autograd.grad(total(c_plain), c_plain)[0]
    before = _home(c, torch.float32)
    total(c).backward()
    assert c.grad_added_to_main_grad
    torch.testing.assert_close(c.main_grad - before, want, rtol=1e-5, atol=1e-6)
