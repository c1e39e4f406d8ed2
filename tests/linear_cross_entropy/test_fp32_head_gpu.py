"""An fp32 LM head on the GPU: the tensor cores' split products against fp64, at every strategy
of the fused engine, for fp32 weights with bf16 and with fp32 hidden states; TF32 products are
faster and measurably less exact (run on the H200: ``pytest -m gpu
tests/linear_cross_entropy/test_fp32_head_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from tests._budgets import one_saved_tile_budget
from tests._logprobs_oracle import logprob_grads, oracle
from vocab_parallel_loss import linear_cross_entropy, linear_token_logprobs
from vocab_parallel_loss.kernels import linear as K

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: fp32-class: within this of fp64 (PyTorch's fp32 log-probs are ~5e-6 off at these sizes)
ABS = 2e-5


def _case(n, h, v, hidden, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = torch.randn(n, h, device="cuda", generator=g).to(hidden)
    c = torch.randn(v, h, device="cuda", generator=g) * h ** -0.5 * 2
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::13] = -100
    return e, c, t


def _budgets(e, c):
    n, h = e.shape
    split = one_saved_tile_budget(K, n, h, c.shape[0], 4, K.default_config(e.device),
                                  e_size=e.element_size(), device=e.device)
    return {"saved": None, "split": split, "recompute": 0}


@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("plan", ["saved", "split", "recompute"])
def test_logprobs_and_gradients_are_fp32_class(hidden, plan):
    e, c, t = _case(2048, 1024, 20000, hidden)
    leaves = [e.clone().requires_grad_(), c.clone().requires_grad_()]
    out = linear_token_logprobs(*leaves, t, return_entropy=True, temperature=0.8,
                                memory_budget=_budgets(e, c)[plan])
    g_lp, g_ent = torch.randn_like(out.log_probs), torch.randn_like(out.entropy)
    de, dc = logprob_grads((out.log_probs, out.entropy), leaves, g_lp, g_ent)
    ref = [e.double().requires_grad_(), c.double().requires_grad_()]
    lp, ent, _ = oracle(ref[0] @ ref[1].t(), t, temperature=0.8)
    rde, rdc = logprob_grads((lp, ent), ref, g_lp.double(), g_ent.double())
    assert (out.log_probs.double() - lp).abs().max() < ABS
    assert (out.entropy.double() - ent).abs().max() < ABS
    assert dc.dtype == torch.float32 and de.dtype == hidden
    assert (dc.double() - rdc).abs().max() <= 1e-4 * rdc.abs().max()
    tol = 1e-4 if hidden == torch.float32 else torch.finfo(hidden).eps
    assert (de.double() - rde).abs().max() <= tol * rde.abs().max()


@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_is_fp32_class(hidden, reduction):
    e, c, t = _case(4096, 1024, 32000, hidden, seed=1)
    loss = linear_cross_entropy(e, c, t, reduction=reduction)
    x = e.double() @ c.double().t()
    ref = torch.nn.functional.cross_entropy(x, t, reduction=reduction)
    assert (loss.double() - ref).abs().max() < ABS


def test_tf32_is_less_exact_than_fp32():
    """``fp32_precision="tf32"``: TF32 products (10-bit mantissas), errors near 1e-3 where the
    split products stay below ``ABS``."""
    e, c, t = _case(2048, 2048, 16000, torch.float32, seed=2)
    lp, _, _ = oracle(e.double() @ c.double().t(), t)
    err = {p: (linear_token_logprobs(e, c, t, fp32_precision=p).log_probs.double() - lp)
           .abs().max().item() for p in ("fp32", "tf32")}
    assert err["fp32"] < ABS < err["tf32"]


def test_under_autocast_fp32_stays_fp32_class():
    e, c, t = _case(1024, 1024, 16000, torch.float32, seed=3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = linear_token_logprobs(e, c, t)
    lp, _, _ = oracle(e.double() @ c.double().t(), t)
    assert (out.log_probs.double() - lp).abs().max() < ABS


@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
def test_far_from_fp16_range_and_large_logits_stay_fp32_class(hidden):
    """Hidden states of 2^20 (past fp16's range) and weights of 2^-20 (below its normal range),
    logits of standard deviation 6: the fp16 parts are taken of rows scaled by powers of two."""
    e, c, t = _case(2048, 1024, 20000, torch.float32, seed=4)
    e = (e * 2.0**20).to(hidden)
    c = c * 3 * 2.0**-20
    leaves = [e.clone().requires_grad_(), c.clone().requires_grad_()]
    out = linear_token_logprobs(*leaves, t, return_entropy=True)
    g_lp, g_ent = torch.randn_like(out.log_probs), torch.randn_like(out.entropy)
    de, dc = logprob_grads((out.log_probs, out.entropy), leaves, g_lp, g_ent)
    ref = [e.double().requires_grad_(), c.double().requires_grad_()]
    lp, ent, _ = oracle(ref[0] @ ref[1].t(), t)
    rde, rdc = logprob_grads((lp, ent), ref, g_lp.double(), g_ent.double())
    assert (out.log_probs.double() - lp).abs().max() < ABS
    assert (out.entropy.double() - ent).abs().max() < ABS
    assert (dc.double() - rdc).abs().max() <= 1e-4 * rdc.abs().max()
    tol = 1e-4 if hidden == torch.float32 else torch.finfo(hidden).eps
    assert (de.double() - rde).abs().max() <= tol * rde.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_scales_allocate_nothing_of_the_operand_size(dtype):
    from vocab_parallel_loss.kernels.linear.scales import split_scales

    x = torch.randn(8192, 4096, device="cuda").to(dtype)
    for view, dim in ((x, 0), (x, 1), (x.t(), 0), (x.t(), 1), (x[:, :1000], 0)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        split_scales(view, dim)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= 2**20, (view.shape, dim)


@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
def test_memory_within_a_stated_budget(hidden):
    """Forward and backward of the log-probs hold at most the stated budget beyond the inputs
    and the gradients returned (16 MiB slack), the split scales included."""
    e, c, t = _case(8192, 4096, 32000, hidden, seed=5)
    e.requires_grad_()
    c.requires_grad_()
    budget = 2**28
    for _ in range(2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = linear_token_logprobs(e, c, t, return_entropy=True, memory_budget=budget)
        de, dc = torch.autograd.grad((out.log_probs, out.entropy),
                                     (e, c), (torch.ones_like(out.log_probs),) * 2)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        returned = de.numel() * de.element_size() + dc.numel() * dc.element_size()
        del de, dc, out
    assert peak - returned <= budget + 16 * 2**20, peak / 2**30


@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_every_precision_runs_forward_and_backward(hidden, precision):
    """Both precisions through the gradient GEMMs too (fp32 tiles: their stages fit in shared
    memory), every strategy."""
    e, c, t = _case(2048, 1024, 20000, hidden, seed=6)
    for budget in _budgets(e, c).values():
        leaves = [e.clone().requires_grad_(), c.clone().requires_grad_()]
        out = linear_token_logprobs(*leaves, t, return_entropy=True, memory_budget=budget,
                                    fp32_precision=precision)
        de, dc = torch.autograd.grad((out.log_probs, out.entropy), leaves,
                                     (torch.ones_like(out.log_probs),) * 2)
        assert torch.isfinite(de).all() and torch.isfinite(dc).all()
