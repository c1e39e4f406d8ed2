"""Per-token log-probs and entropy from hidden states (``linear_token_logprobs``) against the
fp64 oracle, on both backends; the fused engine's strategies (every plan ``memory_budget`` can
pick), argmax ties, second backward and ``main_grad`` accumulation."""

import pytest
import torch

from tests._budgets import one_saved_tile_budget
from tests._logprobs_oracle import TOL, logprob_grads as _grads, oracle
from vocab_parallel_loss import linear_token_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap,scale,bias", [(None, 1.0, False), (5.0, 0.5, True)])
def test_from_hidden_matches_oracle(impl, dtype, softcap, scale, bias, monkeypatch):
    from vocab_parallel_loss.reference import linear as torch_linear

    # several column chunks on the PyTorch backend
    monkeypatch.setattr(torch_linear, "LOGPROB_CHUNK_BYTES", 7 * 4 * 256)
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


@pytest.mark.parametrize("memory_budget", [None, 0])
def test_strided_bias_is_read_at_its_strides(impl, memory_budget):
    """A bias taking every other element of a longer vector: log-probs, entropy and the bias
    gradient as for its contiguous copy, with the logits tiles saved or recomputed."""
    g = torch.Generator().manual_seed(6)
    e = torch.randn(9, 16, generator=g, requires_grad=True)
    c = (torch.randn(45, 16, generator=g) * 0.5).requires_grad_()
    store = (torch.randn(90, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, 45, (9,), generator=g)
    out = linear_token_logprobs(e, c, t, store[::2], return_entropy=True,
                                memory_budget=memory_budget)
    ins64 = [x.detach().double().requires_grad_() for x in (e, c, store)]
    lp, ent, _ = oracle(ins64[0] @ ins64[1].t() + ins64[2][::2], t, 1.0)
    tol = TOL[torch.float32]
    torch.testing.assert_close(out.log_probs.double(), lp, atol=tol * 10, rtol=tol * 10)
    torch.testing.assert_close(out.entropy.double(), ent, atol=tol * 10, rtol=tol * 10)
    g_lp, g_ent = torch.randn(9, generator=g), torch.randn(9, generator=g)
    got = _grads((out.log_probs, out.entropy), (e, c, store), g_lp, g_ent)
    want = _grads((lp, ent), ins64, g_lp.double(), g_ent.double())
    for a, w in zip(got, want):
        torch.testing.assert_close(a.double(), w, atol=tol * 100 * w.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kw", [dict(softcap="a"), dict(logit_scale=None), dict(logit_scale="a"),
                                dict(ignore_index=None)])
def test_argument_errors_name_the_argument(kw):
    e, c, t = torch.randn(5, 8), torch.randn(11, 8), torch.tensor([1, 2, 3, 4, 5])
    with pytest.raises(TypeError, match=next(iter(kw))):
        linear_token_logprobs(e, c, t, impl="torch", **kw)


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
    from vocab_parallel_loss.ops.fused_linear.strategy import choose_strategy
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
    assert choose_strategy(K, e, c, b, "none", False, None, 5.0, 0.0, budget)[:3] == want_plan
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


@pytest.mark.parametrize("softcap,per_row_t", [(None, False), (5.0, True)])
def test_linear_backends_share_the_logprob_contract(softcap, per_row_t, monkeypatch):
    # the log-prob mode of both linear backends, called directly: the same (5, N) statistics
    # (over several of the PyTorch backend's column chunks) and the same gradients from one
    # 6-row coef, with de_acc, dc_out and dc_acc
    K = _kernels_or_skip()
    from vocab_parallel_loss.formulas import LogprobArgs
    from vocab_parallel_loss.kernels.linear import config as KC
    from vocab_parallel_loss.reference import linear as torch_linear

    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
    monkeypatch.setattr(torch_linear, "LOGPROB_CHUNK_BYTES", 1)  # 256-column chunks
    T = torch_linear.TorchBackend
    g = torch.Generator().manual_seed(12)
    n, h, v, v_offset = 10, 8, 300, 40
    e, c = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5
    b = torch.randn(v, generator=g) * 0.1
    t = torch.randint(0, 400, (n,), generator=g)
    inv_t = torch.rand(n, generator=g) + 0.5 if per_row_t else torch.tensor([1.25])
    lp = LogprobArgs(inv_t, 0.75, True)
    want = K.forward_stats(e, c, b, t, v_offset, softcap, False, logprob=lp)
    got = T.forward_stats(e, c, b, t, v_offset, softcap, False, logprob=lp)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    coef = torch.randn(6, n, generator=g)
    coef[0] = want[0] + torch.log(want[1])  # the lse of these columns
    coef[3] = 0.0
    for kw in ({}, {"de_acc": torch.ones(n, h)},
               {"dc_out": torch.empty(v, h)}, {"dc_acc": torch.ones(v, h)}):
        outs = []
        for B in (K, T):
            kw_b = {k: x.clone() for k, x in kw.items()}
            de, dc, db = B.backward(e, c, b, t, v_offset, coef, softcap, True, True, True,
                                    logprob=lp, **kw_b)
            outs.append((de, kw_b["dc_acc"] if "dc_acc" in kw else dc, db))
            assert ("dc_acc" in kw) == (dc is None)
            if "dc_out" in kw:
                assert dc is not None and dc.data_ptr() == kw_b["dc_out"].data_ptr()
        for w, a in zip(*outs):
            torch.testing.assert_close(a, w, atol=1e-4, rtol=1e-4)


def _masked_reference(e, c, b, keep, t, inv_t, scale):
    """fp64 log-probs, entropy and argmax over the columns ``keep``, differentiable in ``e``,
    ``c`` and ``b``, a finite bias: the softmax leaves the other columns out. Their logits stay
    finite, so that a target there gets the gradient of its logit (``log p_t = x_t - lse`` is
    -inf, its gradient that of ``x_t`` less the kept columns' softmax, whatever the bias)."""
    z = e @ c.t() + b
    x = z * scale * inv_t[:, None]
    xk = x.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(xk, dim=1)
    p = torch.exp(xk - lse[:, None])
    ignored = t == -100
    idx = torch.where(ignored, torch.zeros_like(t), t)
    lp = x.gather(1, idx[:, None])[:, 0] - lse
    ent = lse - torch.where(keep, p * x, torch.zeros_like(x)).sum(dim=1)
    zero = torch.zeros((), dtype=x.dtype)
    return torch.where(ignored, zero, lp), torch.where(ignored, zero, ent), xk.argmax(dim=1)


@pytest.mark.parametrize("plan", ["saved", "split", "recompute", "torch"])
def test_masked_columns(plan, monkeypatch):
    # a bias of -inf over whole vocabulary tiles (the first of each forward split, and one after
    # a finite tile) and over random columns: finite log-probs and entropy, zero gradients at
    # the masked columns, and the fp64 reference's gradients; two targets on masked columns
    # (log-prob -inf, the gradient of their logit); every strategy, both backends
    impl, budget = ("torch", None) if plan == "torch" else ("triton", None)
    tile = 32
    if impl == "triton":
        K = _kernels_or_skip()
        from vocab_parallel_loss.kernels.linear import config as KC

        monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
        tile = K.INTERPRET_CONFIG.fwd_block_v
    g = torch.Generator().manual_seed(13)
    n, h, v = 23, 8, 6 * tile - 3  # six tiles (split=2: tiles 0-2 and 3-5), the last partial
    e = torch.randn(n, h, generator=g, requires_grad=True)
    c = torch.randn(v, h, generator=g, requires_grad=True)
    keep = torch.rand(v, generator=g) > 0.15
    for k in (0, 2, 3):
        keep[k * tile:(k + 1) * tile] = False
    b = torch.randn(v, generator=g) * 0.3
    b[~keep] = float("-inf")
    b.requires_grad_()
    kept = keep.nonzero()[:, 0]
    t = kept[torch.randint(0, kept.numel(), (n,), generator=g)]
    t[4] = -100
    masked_t = torch.tensor([1, 7])
    t[masked_t] = torch.tensor([5, 3 * tile + 9])  # in the masked tiles 0 and 3
    temp = torch.rand(n, generator=g) + 0.5
    if impl == "triton":
        from vocab_parallel_loss.ops.fused_linear.strategy import choose_strategy

        if plan == "split":
            budget = _one_saved_tile_budget(K, n, h, v, e.element_size())
        elif plan == "recompute":
            budget = 0
        st = choose_strategy(K, e, c, b, "none", False, None, None, 0.0, budget)
        assert st.name == ("recompute" if plan == "recompute" else "saved")
        assert (st.size is not None) == (plan == "split")
    out = linear_token_logprobs(e, c, t, b, temperature=temp, logit_scale=0.75,
                                return_entropy=True, return_argmax=True, memory_budget=budget,
                                impl=impl)
    finite_b = torch.where(keep, b.detach(), torch.zeros_like(b))  # -inf only in the softmax
    ins64 = [x.detach().double().requires_grad_() for x in (e, c, finite_b)]
    lp, ent, am = _masked_reference(*ins64, keep, t, 1.0 / temp.double(), 0.75)
    tol = TOL[torch.float32]
    rows = torch.ones(n, dtype=torch.bool)
    rows[masked_t] = False
    assert torch.all(out.log_probs[masked_t] == float("-inf"))
    assert torch.isfinite(out.log_probs[rows]).all() and torch.isfinite(out.entropy).all()
    torch.testing.assert_close(out.log_probs[rows].double(), lp[rows].detach(), atol=tol * 10,
                               rtol=tol * 10)
    torch.testing.assert_close(out.entropy.double(), ent.detach(), atol=tol * 10, rtol=tol * 10)
    assert torch.equal(out.argmax, am)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    got = _grads((out.log_probs, out.entropy), (e, c, b), g_lp, g_ent)
    want = _grads((lp, ent), ins64, g_lp.double(), g_ent.double())
    untargeted = ~keep
    untargeted[t[masked_t]] = False
    for name, a, w in zip(("hidden", "weight", "bias"), got, want):
        if name != "hidden":
            assert torch.all(a[untargeted] == 0) and torch.all(a[t[masked_t]] != 0), name
        torch.testing.assert_close(a.double(), w, atol=tol * 100 * w.abs().max().item(), rtol=0,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("region", ["both", "backward"])
@pytest.mark.parametrize("plan", ["saved", "recompute", "torch"])
def test_autocast_keeps_the_inputs_precision(plan, region, monkeypatch):
    # under torch.autocast to bf16, fp32 inputs give fp32-accurate log-probs, entropy and
    # gradients on both backends (autocast would round the logits GEMM to bf16): forward and
    # backward in the autocast region, or the backward alone (a custom Function's backward runs
    # under the autocast of the region it is called in)
    impl, budget = ("torch", None) if plan == "torch" else ("triton", None)
    if impl == "triton":
        K = _kernels_or_skip()
        from vocab_parallel_loss.kernels.linear import config as KC

        monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG)
        budget = 0 if plan == "recompute" else None
    g = torch.Generator().manual_seed(17)
    n, h, v = 19, 16, 75
    e = torch.randn(n, h, generator=g, requires_grad=True)
    c = torch.randn(v, h, generator=g, requires_grad=True)
    b = (torch.randn(v, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region == "both"):
        out = linear_token_logprobs(e, c, t, b, temperature=0.8, return_entropy=True,
                                    memory_budget=budget, impl=impl)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads((out.log_probs, out.entropy), (e, c, b), g_lp, g_ent)
    ins64 = [x.detach().double().requires_grad_() for x in (e, c, b)]
    lp, ent, _ = oracle(ins64[0] @ ins64[1].t() + ins64[2], t, 0.8)
    want = _grads((lp, ent), ins64, g_lp.double(), g_ent.double())
    tol = TOL[torch.float32]
    assert out.log_probs.dtype == torch.float32
    torch.testing.assert_close(out.log_probs.double(), lp.detach(), atol=tol * 10, rtol=tol * 10)
    torch.testing.assert_close(out.entropy.double(), ent.detach(), atol=tol * 10, rtol=tol * 10)
    for name, a, w in zip(("hidden", "weight", "bias"), got, want):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), w, atol=tol * 10 * w.abs().max().item(), rtol=0,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("memory_budget", [None, 0])
def test_unusable_per_token_temperature_is_nan(impl, memory_budget):
    # as for token_logprobs: NaN outputs and a NaN gradient of that token's hidden state; the
    # other tokens exact; the weight's gradient sums over every token, so it is NaN too
    from tests.token_logprobs.test_token_logprobs import unusable_temperatures

    g = torch.Generator().manual_seed(22)
    e = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    c = (torch.randn(41, 8, generator=g) * 0.5).requires_grad_()
    t = torch.randint(0, 41, (3, 5), generator=g)
    temp, bad, usable = unusable_temperatures((3, 5), g)
    t[0, 1] = -100  # temperature 0 on an ignored token: 0, no gradient
    bad[0, 1] = False
    out = linear_token_logprobs(e, c, t, temperature=temp, return_entropy=True,
                                return_argmax=True, memory_budget=memory_budget)
    z = e.detach().double() @ c.detach().double().t()
    lp, ent, am = oracle(z, t, usable)
    assert torch.isnan(out.log_probs[bad]).all() and torch.isnan(out.entropy[bad]).all()
    assert out.log_probs[0, 1] == 0 and out.entropy[0, 1] == 0
    torch.testing.assert_close(out.log_probs[~bad].double(), lp[~bad], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy[~bad].double(), ent[~bad], atol=1e-5, rtol=1e-5)
    assert torch.equal(out.argmax, am)
    g_lp, g_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    de, dc = _grads((out.log_probs, out.entropy), (e, c), g_lp, g_ent)
    assert torch.isnan(de[bad]).all() and torch.isnan(dc).all()
    assert torch.all(de[0, 1] == 0)
    e64, c64 = e.detach().double().requires_grad_(), c.detach().double()
    lp64, ent64, _ = oracle(e64 @ c64.t(), t, usable)
    keep = (~bad).double()
    (want,) = _grads((lp64, ent64), (e64,), g_lp.double() * keep, g_ent.double() * keep)
    torch.testing.assert_close(de[~bad].double(), want[~bad], atol=1e-4, rtol=0)


@pytest.mark.parametrize("return_entropy", [False, True])
@pytest.mark.parametrize("memory_budget", [None, 0])
def test_unusable_temperature_not_differentiated_leaves_gradients_finite(impl, memory_budget,
                                                                          return_entropy):
    # a token whose temperature is unusable, left out of the loss (its upstream gradients 0):
    # every gradient is the other tokens' own, as for token_logprobs, not NaN
    g = torch.Generator().manual_seed(23)
    e = torch.randn(6, 8, generator=g, requires_grad=True)
    c = (torch.randn(41, 8, generator=g) * 0.5).requires_grad_()
    b = torch.randn(41, generator=g, requires_grad=True)
    t = torch.randint(0, 41, (6,), generator=g)
    temp = torch.tensor([1.0, 0.0, 0.7, float("nan"), 1.3, -1.0])
    keep = torch.isfinite(temp) & (temp > 0)
    out = linear_token_logprobs(e, c, t, b, temperature=temp, return_entropy=return_entropy,
                                memory_budget=memory_budget)
    loss = torch.where(keep, out.log_probs, 0.0).sum()
    if return_entropy:
        loss = loss + torch.where(keep, out.entropy, 0.0).sum()
    got = torch.autograd.grad(loss, (e, c, b))
    ins64 = [x.detach().double().requires_grad_() for x in (e, c, b)]
    lp, ent, _ = oracle(ins64[0] @ ins64[1].t() + ins64[2], t, torch.where(keep, temp, 1.0))
    w = keep.double()
    want = _grads((lp, ent), ins64, w, w * return_entropy)
    for name, a, w in zip(("hidden", "weight", "bias"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), w, atol=1e-5 * w.abs().max().item(), rtol=0,
                                   msg=lambda m: f"{name}: {m}")
