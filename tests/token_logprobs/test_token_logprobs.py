"""Per-token log-probs and entropy (over logits and from hidden states) against the fp64 oracle,
on both backends: values and gradients under random upstream gradients."""

import pytest
import torch

from tests._budgets import one_saved_tile_budget
from tests._logprobs_oracle import oracle
from vocab_parallel_loss import linear_token_logprobs, token_logprobs
from vocab_parallel_loss.verl import linear_cross_entropy as verl_linear_cross_entropy


def _grads(outputs, inputs, g_lp, g_ent):
    lp, ent = outputs
    return torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), inputs)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("per_token_t", [False, True])
def test_from_logits_matches_oracle(impl, dtype, per_token_t):
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(3, 5, 37, generator=g) * 3).to(dtype)
    z = z.transpose(0, 1).requires_grad_()  # a strided [s, b, v] view
    t = torch.randint(0, 37, (5, 3), generator=g)
    t[0, 1] = -100
    temp = torch.rand(5, 3, generator=g) + 0.5 if per_token_t else 0.7
    out = token_logprobs(z, t, temperature=temp, return_entropy=True, return_argmax=True)
    lp, ent, am = oracle(z.detach(), t, temp)
    tol = TOL[dtype]
    assert out.log_probs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.log_probs.double(), lp, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(out.entropy.double(), ent, atol=tol * 10, rtol=tol)
    assert torch.equal(out.argmax, am)
    g_lp, g_ent = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    (got,) = _grads((out.log_probs, out.entropy), z, g_lp.to(out.log_probs.dtype),
                    g_ent.to(out.log_probs.dtype))
    z64 = z.detach().double().requires_grad_()
    lp64, ent64, _ = oracle(z64, t, temp)
    (want,) = _grads((lp64, ent64), z64, g_lp.double(), g_ent.double())
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol * 10 * want.abs().max().item(),
                               rtol=0)


def test_large_offset_and_masked_padding_keep_precision(impl):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(4, 29, generator=g) + 1.0e4
    z[:, -3:] = float("-inf")  # masked vocabulary padding
    t = torch.randint(0, 26, (4,), generator=g)
    out = token_logprobs(z, t, return_entropy=True)
    lp, ent, _ = oracle(z, t)
    torch.testing.assert_close(out.log_probs.double(), lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ent, atol=1e-5, rtol=1e-5)


def test_vocab_range_pads_and_out_of_range_is_nan(impl):
    z = torch.randn(6, 20, requires_grad=True)
    t = torch.tensor([0, 5, 16, 17, -100, 3])  # 17: past the 17-id vocabulary
    out = token_logprobs(z, t, vocab_range=(0, 17), return_entropy=True, return_argmax=True)
    lp, ent, am = oracle(z.detach(), t.clamp(max=16), valid=17)
    assert torch.isnan(out.log_probs[3])
    keep = torch.tensor([0, 1, 2, 4, 5])
    torch.testing.assert_close(out.log_probs[keep].double(), lp[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy[keep].double(), ent[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(out.argmax, am)
    out.entropy.sum().backward()
    assert torch.all(z.grad[:, 17:] == 0) and torch.all(z.grad[4] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap,scale,bias", [(None, 1.0, False), (5.0, 0.5, True)])
def test_from_hidden_matches_oracle(impl, dtype, softcap, scale, bias, monkeypatch):
    from vocab_parallel_loss.autograd import logprobs as autograd_logprobs

    monkeypatch.setattr(autograd_logprobs, "CHUNK_BYTES", 7 * 4 * 256)  # several column chunks
    g = torch.Generator().manual_seed(3)
    e = torch.randn(2, 7, 16, generator=g, dtype=dtype, requires_grad=True)
    c = (torch.randn(600, 16, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(600, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, 600, (2, 7), generator=g)
    t[1, 3] = -100
    out = linear_token_logprobs(e, c, t, b, temperature=0.9, softcap=softcap, logit_scale=scale,
                                return_entropy=True, return_argmax=True)
    z = e.detach().double() @ c.detach().double().t()
    if bias:
        z = z + b.detach().double()
    lp, ent, am = oracle(z, t, 0.9, softcap=softcap, scale=scale)
    tol = TOL[dtype]
    torch.testing.assert_close(out.log_probs.double(), lp, atol=tol * 10, rtol=tol * 10)
    torch.testing.assert_close(out.entropy.double(), ent, atol=tol * 10, rtol=tol * 10)
    assert torch.equal(out.argmax, am)
    g_lp, g_ent = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    inputs = (e, c) + ((b,) if bias else ())
    got = _grads((out.log_probs, out.entropy), inputs, g_lp.to(dtype), g_ent.to(dtype))
    ins64 = [x.detach().double().requires_grad_() for x in inputs]
    z64 = ins64[0] @ ins64[1].t() + (ins64[2] if bias else 0)
    lp64, ent64, _ = oracle(z64, t, 0.9, softcap=softcap, scale=scale)
    want = _grads((lp64, ent64), ins64, g_lp.double(), g_ent.double())
    for a, w in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), w, atol=tol * 100 * w.abs().max().item(), rtol=0)


def test_verl_signature_and_reductions():
    import inspect

    params = list(inspect.signature(verl_linear_cross_entropy).parameters)
    assert params == ["hidden", "weight", "labels", "temperature", "reduction",
                      "dist_process_group"]
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(9, 8, generator=g), torch.randn(33, 8, generator=g)
    labels = torch.randint(0, 33, (9,), generator=g)
    lp, ent = verl_linear_cross_entropy(h, w, labels, 1.3, "none")
    want_lp, want_ent, _ = oracle(h.double() @ w.double().t(), labels, 1.3)
    torch.testing.assert_close(lp.double(), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, atol=1e-5, rtol=1e-5)
    total, _ = verl_linear_cross_entropy(h, w, labels, 1.3, "mean")
    torch.testing.assert_close(total.double(), want_lp.mean(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reduction"):
        verl_linear_cross_entropy(h, w, labels, 1.3, "max")


def test_errors_name_the_argument():
    z, t = torch.randn(3, 5), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, t, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, t, temperature=torch.ones(2))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, t, temperature=torch.ones(3, requires_grad=True))
    with pytest.raises(ValueError, match="vocab_range"):
        token_logprobs(z, t, vocab_range=(0, 9))
    with pytest.raises(TypeError, match="target"):
        token_logprobs(z, t.float())
    with pytest.raises(ValueError, match="ignore_index"):
        token_logprobs(z, t, ignore_index=-100.5)


def test_torch_compile_matches_eager(impl):
    # the Triton row kernels run as a graph break, the PyTorch backend is traced
    g = torch.Generator().manual_seed(5)
    x = torch.randn(19, 41, generator=g).requires_grad_()
    e = torch.randn(19, 24, generator=g).requires_grad_()
    c = torch.randn(41, 24, generator=g).requires_grad_()
    t = torch.randint(0, 41, (19,), generator=g)
    a, b = torch.rand(19, generator=g), torch.rand(19, generator=g)
    torch._dynamo.reset()
    for fn, leaves in ((lambda x, e, c: token_logprobs(x, t, return_entropy=True), (x,)),
                       (lambda x, e, c: linear_token_logprobs(e, c, t, return_entropy=True),
                        (e, c))):
        got = []
        for f in (torch.compile(fn), fn):
            out = f(x, e, c)
            total = (a * out.log_probs + b * out.entropy).sum()
            got.append((out.log_probs.detach(), out.entropy.detach(),
                        *torch.autograd.grad(total, leaves)))
        for u, w in zip(*got):
            torch.testing.assert_close(u, w, atol=1e-6, rtol=1e-6)


def _kernels_or_skip():
    from vocab_parallel_loss import backends
    from vocab_parallel_loss.settings import interpreting

    if backends.triton_linear is None or not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    return backends.triton_linear


def _one_saved_tile_budget(K, n, h, v_local, size):
    """The budget that saves the first tile of the logits and recomputes the rest."""
    return one_saved_tile_budget(K, n, h, v_local, size, K.INTERPRET_CONFIG)


@pytest.mark.parametrize("plan", ["saved", "split", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_strategies_match_oracle(plan, dtype, monkeypatch):
    # the Triton path runs the fused linear engine: every strategy memory_budget can pick,
    # with a per-token temperature, softcap, logit scale, bias and vocabulary padding
    K = _kernels_or_skip()
    from vocab_parallel_loss.autograd.strategy import choose_strategy
    from vocab_parallel_loss.kernels.linear import config as KC

    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    g = torch.Generator().manual_seed(7)
    n, h, v_local, valid = 50, 8, 75, 70
    e = torch.randn(2, n // 2, h, generator=g).to(dtype).requires_grad_()
    c = torch.randn(v_local, h, generator=g).to(dtype)
    c[valid:] = 1e4  # padding rows: never part of any output
    c.requires_grad_()
    b = (torch.randn(v_local, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, valid, (2, n // 2), generator=g)
    t[0, 3] = -100
    temp = torch.rand(2, n // 2, generator=g) + 0.5
    size = e.element_size()
    budget = {"saved": None, "recompute": 0,
              "split": _one_saved_tile_budget(K, n, h, v_local, size)}[plan]
    want_plan = {"saved": ("saved", None, None), "recompute": ("recompute", 1, None),
                 "split": ("saved", None, K.INTERPRET_CONFIG.fwd_block_v)}[plan]
    assert choose_strategy(K, e, c, b, "none", False, None, 5.0, 0.0, budget) == want_plan
    out = linear_token_logprobs(e, c, t, b, temperature=temp, softcap=5.0, logit_scale=0.5,
                                return_entropy=True, return_argmax=True,
                                vocab_range=(0, valid), memory_budget=budget, impl="triton")
    ins64 = [x.detach().double().requires_grad_() for x in (e, c, b)]
    z64 = ins64[0] @ ins64[1].t() + ins64[2]
    lp, ent, am = oracle(z64, t, temp.double(), softcap=5.0, scale=0.5, valid=valid)
    tol = TOL[dtype]
    torch.testing.assert_close(out.log_probs.double(), lp.detach(), atol=tol * 10, rtol=tol * 10)
    torch.testing.assert_close(out.entropy.double(), ent.detach(), atol=tol * 10, rtol=tol * 10)
    assert torch.equal(out.argmax, am)
    g_lp, g_ent = torch.randn(2, n // 2, generator=g), torch.randn(2, n // 2, generator=g)
    got = _grads((out.log_probs, out.entropy), (e, c, b), g_lp, g_ent)
    want = _grads((lp, ent), ins64, g_lp.double(), g_ent.double())
    for name, a, w in zip(("hidden", "weight", "bias"), got, want):
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.double(), w, atol=tol * 100 * w.abs().max().item(), rtol=0,
                                   msg=lambda m: f"{name}: {m}")
    assert torch.all(got[1][valid:] == 0) and torch.all(got[2][valid:] == 0)


def test_fused_argmax_ties_take_the_first_column(monkeypatch):
    # equal logits across tiles and forward splits: the lowest column wins, as torch.argmax
    K = _kernels_or_skip()
    from vocab_parallel_loss.kernels.linear import config as KC

    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    e = torch.ones(3, 4)
    c = torch.zeros(100, 4)
    c[[5, 40, 90]] = 1.0  # three tied maxima in different 32-column tiles
    c[70] = torch.tensor([1.0, 1.0, 1.0, 0.5])
    t = torch.tensor([5, 40, 1])
    out = linear_token_logprobs(e, c, t, return_argmax=True, impl="triton")
    assert out.argmax.tolist() == [5, 5, 5]


def test_fused_saved_tiles_second_backward_is_a_clear_error(monkeypatch):
    K = _kernels_or_skip()
    from vocab_parallel_loss.kernels.linear import config as KC

    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    g = torch.Generator().manual_seed(8)
    e = torch.randn(9, 8, generator=g, requires_grad=True)
    c = torch.randn(40, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (9,), generator=g)
    out = linear_token_logprobs(e, c, t, return_entropy=True, impl="triton")
    total = out.log_probs.sum() + out.entropy.sum()
    torch.autograd.grad(total, e, retain_graph=True)
    with pytest.raises(RuntimeError, match="memory_budget=0"):
        torch.autograd.grad(total, e)
    out = linear_token_logprobs(e, c, t, return_entropy=True, impl="triton", memory_budget=0)
    total = out.log_probs.sum() + out.entropy.sum()
    first = torch.autograd.grad(total, e, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(total, e)[0], first)
    with pytest.raises(ValueError, match="memory_budget"):
        linear_token_logprobs(e, c, t, memory_budget=-1)


def test_second_derivative_is_refused(impl):
    g = torch.Generator().manual_seed(9)
    e = torch.randn(5, 8, generator=g, requires_grad=True)
    c = torch.randn(12, 8, generator=g, requires_grad=True)
    z = torch.randn(5, 12, generator=g, requires_grad=True)
    t = torch.randint(0, 12, (5,), generator=g)
    for out, leaf in ((linear_token_logprobs(e, c, t), e), (token_logprobs(z, t), z)):
        with pytest.raises(RuntimeError, match="second derivative"):
            torch.autograd.grad(out.log_probs.sum(), leaf, create_graph=True)


def test_megatron_output_processor_passes_its_context(monkeypatch):
    # the context's temperature ([b, s] -> the hidden states' [s, b]), ignore index and memory
    # budget reach linear_token_logprobs; the outputs come back [b, s]
    from types import SimpleNamespace

    from vocab_parallel_loss.verl import _megatron

    seen = {}

    def fake(hidden, weight, target, bias, **kw):
        seen.update(kw, target=target)
        z = torch.zeros(target.shape)
        return SimpleNamespace(log_probs=z + 1, entropy=z + 2)

    monkeypatch.setattr(_megatron, "linear_token_logprobs", fake)
    temp = torch.rand(2, 5) + 0.5
    labels = torch.randint(0, 7, (2, 5))
    out = _megatron.output_processor(
        hidden_states=torch.zeros(5, 2, 4), output_layer=SimpleNamespace(weight=torch.zeros(7, 4),
                                                                         tp_group="tp"),
        labels=labels, context={"temperature": temp, "ignore_index": -1, "memory_budget": 123})
    assert seen["memory_budget"] == 123 and seen["ignore_index"] == -1 and seen["tp_group"] == "tp"
    assert torch.equal(seen["temperature"], temp.t()) and torch.equal(seen["target"], labels.t())
    assert out["log_probs"].shape == (2, 5) and torch.all(out["entropy"] == 2)


@pytest.mark.parametrize("plan", ["saved", "split", "recompute", "torch"])
def test_weight_gradient_added_into_main_grad(plan, monkeypatch):
    # gradient_accumulation_fusion: the weight's gradient (vocabulary padding: none) lands in
    # weight.main_grad, rounded once there; the weight receives megatron-core's zeros
    impl = "torch" if plan == "torch" else "triton"
    budget = None
    if impl == "triton":
        K = _kernels_or_skip()
        from vocab_parallel_loss.kernels.linear import config as KC

        monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
        budget = {"saved": None, "recompute": 0,
                  "split": _one_saved_tile_budget(K, 50, 8, 75, 4)}[plan]
    g = torch.Generator().manual_seed(11)
    n, h, v_local, valid = 50, 8, 75, 70
    e = torch.randn(n, h, generator=g, requires_grad=True)
    c = torch.randn(v_local, h, generator=g, requires_grad=True)
    t = torch.randint(0, valid, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    kw = dict(temperature=0.8, return_entropy=True, vocab_range=(0, valid), memory_budget=budget,
              impl=impl)
    c.main_grad = torch.randn(c.shape, generator=g)
    c.grad_added_to_main_grad = False
    before = c.main_grad.clone()
    out = linear_token_logprobs(e, c, t, gradient_accumulation_fusion=True, **kw)
    ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    assert c.grad_added_to_main_grad and not c.grad.any()
    c_plain = c.detach().requires_grad_()
    plain = linear_token_logprobs(e, c_plain, t, **kw)
    want = _grads((plain.log_probs, plain.entropy), (c_plain,), g_lp, g_ent)[0]
    torch.testing.assert_close(c.main_grad - before, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(c.main_grad[valid:], before[valid:])


def test_megatron_output_processor_fuses_gradient_accumulation(monkeypatch):
    # with the config's gradient_accumulation_fusion and a main_grad on the weight, it asks
    # linear_token_logprobs to add the weight's gradient there
    from types import SimpleNamespace

    from vocab_parallel_loss.verl import _megatron

    seen = {}

    def fake(hidden, weight, target, bias, **kw):
        seen.update(kw)
        z = torch.zeros(target.shape)
        return SimpleNamespace(log_probs=z, entropy=z)

    monkeypatch.setattr(_megatron, "linear_token_logprobs", fake)
    weight = torch.zeros(7, 4)
    layer = SimpleNamespace(weight=weight, tp_group="tp")
    call = dict(hidden_states=torch.zeros(5, 2, 4), output_layer=layer,
                labels=torch.zeros(2, 5, dtype=torch.long))
    for fusion, has_home, want in ((True, True, True), (True, False, False),
                                   (False, True, False)):
        if has_home:
            weight.main_grad = torch.zeros(7, 4)
        elif hasattr(weight, "main_grad"):
            del weight.main_grad
        _megatron.output_processor(config=SimpleNamespace(gradient_accumulation_fusion=fusion),
                                   **call)
        assert seen["gradient_accumulation_fusion"] is want, (fusion, has_home)
