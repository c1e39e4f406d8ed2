"""Token log-probs and entropy from hidden states on CUDA with real shapes, every strategy of the
fused engine (run on the H200: ``pytest -m gpu tests/linear_token_logprobs/test_linear_token_logprobs_gpu.py``).

The reference is fp32 PyTorch on the materialized logits of the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch

from tests._cuda_graph import assert_capture_replays_eager
from tests._budgets import one_saved_tile_budget
from vocab_parallel_loss import linear_token_logprobs
from vocab_parallel_loss.ops.fused_linear.strategy import choose_strategy
from vocab_parallel_loss.kernels import linear as K

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MiB = 1 << 20


def _case(n, h, v, seed=0, valid=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    c = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).bfloat16().requires_grad_()
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, valid or v, (n,), device="cuda", generator=g)
    t[::11] = -100
    temp = torch.rand(n, device="cuda", generator=g) + 0.5
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    return e, c, b, t, temp, g_lp, g_ent


def _reference(e, c, b, t, temp, g_lp, g_ent, softcap, scale, valid):
    leaves = [x.detach().float().requires_grad_() for x in (e, c, b)]
    y = (leaves[0] @ leaves[1][:valid].t() + leaves[2][:valid]) * scale
    if softcap:
        y = softcap * torch.tanh(y / softcap)
    ls = torch.log_softmax(y / temp[:, None], dim=-1)
    keep = t != -100
    lp = torch.where(keep, ls.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(keep, -(ls.exp() * ls).sum(-1), 0.0)
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), leaves)
    return lp.detach(), ent.detach(), ls.argmax(-1), y.detach(), grads


def _run(e, c, b, t, temp, g_lp, g_ent, softcap, scale, valid, budget):
    out = linear_token_logprobs(e, c, t, b, temperature=temp, softcap=softcap,
                                logit_scale=scale, return_entropy=True, return_argmax=True,
                                vocab_range=(0, valid), memory_budget=budget, impl="triton")
    grads = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(),
                                (e, c, b))
    return out, grads


@pytest.mark.parametrize("plan", ["saved", "split", "recompute"])
@pytest.mark.parametrize("softcap,scale", [(None, 1.0), (30.0, 0.7)])
def test_strategies_match_fp32(plan, softcap, scale):
    # a shard with 8 padding rows, wide enough that four saved tiles plus the fp32 dE and one
    # recompute chunk stay below the whole saved logits
    n, h, v, valid = 4096, 1024, 64000, 63992
    e, c, b, t, temp, g_lp, g_ent = _case(n, h, v, valid=valid)
    cfg = K.default_config(e.device)
    tile = cfg.fwd_block_v
    four_tiles = one_saved_tile_budget(K, n, h, v, 2, cfg, tiles=4)  # four saved, rest not
    budget = {"saved": None, "split": four_tiles, "recompute": 0}[plan]
    picked = choose_strategy(K, e, c, b, "none", False, None, softcap, 0.0, budget)
    assert picked[:3] == {"saved": ("saved", None, None), "split": ("saved", None, 4 * tile),
                      "recompute": ("recompute", 1, None)}[plan], picked
    out, grads = _run(e, c, b, t, temp, g_lp, g_ent, softcap, scale, valid, budget)
    lp, ent, am, y, want = _reference(e, c, b, t, temp, g_lp, g_ent, softcap, scale, valid)
    torch.testing.assert_close(out.log_probs, lp, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ent, atol=2e-4, rtol=1e-5)
    # the argmax column holds the largest logit up to the fp32 summation order
    best = y.gather(1, out.argmax[:, None])[:, 0]
    assert torch.all(best >= y.gather(1, am[:, None])[:, 0] - 1e-3)
    for name, got, w in zip(("hidden", "weight", "bias"), grads, want):
        w = w if name == "hidden" else w[:valid]
        err = (got[:w.shape[0]].float() - w).abs().max() / w.abs().max()
        assert err < 1e-2, (name, err.item())
    assert torch.all(grads[1][valid:] == 0) and torch.all(grads[2][valid:] == 0)
    # deterministic: a second call gives the same bits
    out2, grads2 = _run(e, c, b, t, temp, g_lp, g_ent, softcap, scale, valid, budget)
    assert torch.equal(out.log_probs, out2.log_probs) and torch.equal(out.entropy, out2.entropy)
    assert all(torch.equal(x, y_) for x, y_ in zip(grads, grads2))


@pytest.mark.parametrize("budget", [None, 0], ids=["saved", "recompute"])
def test_cuda_graph_capture(budget):
    """No host synchronisation in forward or backward: the step captures into a CUDA graph."""
    e, c, b, t, temp, g_lp, g_ent = _case(2048, 1024, 16032)

    def step():
        out = linear_token_logprobs(e, c, t, temperature=0.9, return_entropy=True,
                                    memory_budget=budget, impl="triton")
        total = (out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()
        return (out.log_probs, out.entropy, *torch.autograd.grad(total, (e, c)))

    assert_capture_replays_eager(step)


def test_memory_follows_the_budget():
    """Extra memory (peak above inputs and the gradients left) stays within the budget."""
    n, h, v = 8192, 2048, 32000
    e, c, b, t, temp, g_lp, g_ent = _case(n, h, v)
    for budget in (0, 256 * MiB, 512 * MiB):
        e.grad = c.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = linear_token_logprobs(e, c, t, temperature=temp, return_entropy=True,
                                    memory_budget=budget, impl="triton")
        ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
        del out
        torch.cuda.synchronize()
        grads = e.grad.numel() * 2 + c.grad.numel() * 2
        extra = torch.cuda.max_memory_allocated() - base - grads
        # outputs, statistics and cuBLAS workspaces: a few MiB beyond the strategy's own buffers
        assert extra <= max(budget, 200 * MiB) + 16 * MiB, (budget, extra / MiB)


@pytest.mark.parametrize("budget", [None, 0], ids=["saved", "recompute"])
def test_gradient_accumulation_fusion(budget):
    # the weight's gradient added into an fp32 main_grad equals the one returned otherwise (to
    # the returned gradient's bf16 rounding); padding rows receive nothing
    n, h, v, valid = 4096, 1024, 32000, 31990
    e, c, b, t, temp, g_lp, g_ent = _case(n, h, v, valid=valid)
    _, grads = _run(e, c, b, t, temp, g_lp, g_ent, None, 1.0, valid, budget)
    c.main_grad = torch.randn(c.shape, device="cuda") * grads[1].float().abs().max()
    c.grad_added_to_main_grad = False
    before = c.main_grad.clone()
    out = linear_token_logprobs(e, c, t, b, temperature=temp, return_entropy=True,
                                vocab_range=(0, valid), memory_budget=budget, impl="triton",
                                gradient_accumulation_fusion=True)
    ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
    assert c.grad_added_to_main_grad and not c.grad.any()
    added = c.main_grad - before
    scale = grads[1].float().abs().max()
    assert (added - grads[1].float()).abs().max() <= 1e-2 * scale
    assert torch.equal(c.main_grad[valid:], before[valid:])


@pytest.mark.parametrize("plan", ["saved", "split", "recompute", "torch"])
def test_masked_columns(plan):
    # a bias of -inf over whole tiles of the shipped config and random columns: finite outputs,
    # the fp32 reference over the kept columns (the masked ones' logits finite stand-ins outside
    # the softmax), zero gradients at the masked columns; every strategy, both backends
    n, h, v = 4096, 1024, 32003
    e, c, b, t, temp, g_lp, g_ent = _case(n, h, v)
    cfg = K.default_config(e.device)
    tile = cfg.fwd_block_v
    g = torch.Generator(device="cuda").manual_seed(5)
    keep = torch.rand(v, device="cuda", generator=g) > 0.1
    for k in (0, 2, 3, v // tile - 1):
        keep[k * tile:(k + 1) * tile] = False
    kept = keep.nonzero()[:, 0]
    t = torch.where(t == -100, t, kept[torch.randint(0, kept.numel(), (n,), device="cuda",
                                                     generator=g)])
    masked_b = b.detach().masked_fill(~keep, float("-inf")).requires_grad_()
    budget = {"saved": None, "torch": None, "recompute": 0,
              "split": one_saved_tile_budget(K, n, h, v, 2, cfg, tiles=4)}[plan]
    if plan != "torch":
        picked = choose_strategy(K, e, c, masked_b, "none", False, None, None, 0.0, budget)
        assert picked.name == ("recompute" if plan == "recompute" else "saved"), picked
    out = linear_token_logprobs(e, c, t, masked_b, temperature=temp, return_entropy=True,
                                memory_budget=budget,
                                impl="torch" if plan == "torch" else "triton")
    grads = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(),
                                (e, c, masked_b))
    leaves = [x.detach().float().requires_grad_() for x in (e, c, b)]
    x = (leaves[0] @ leaves[1].t() + leaves[2]) / temp[:, None]
    xk = x.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(xk, dim=-1)
    p = torch.exp(xk - lse[:, None])
    keep_t = t != -100
    lp = torch.where(keep_t, x.gather(1, t.clamp(min=0)[:, None])[:, 0] - lse, 0.0)
    ent = torch.where(keep_t, lse - torch.where(keep, p * x, 0.0).sum(-1), 0.0)
    want = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), leaves)
    assert torch.isfinite(out.log_probs).all() and torch.isfinite(out.entropy).all()
    torch.testing.assert_close(out.log_probs, lp.detach(), atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ent.detach(), atol=2e-4, rtol=1e-5)
    for name, a, w in zip(("hidden", "weight", "bias"), grads, want):
        err = (a.float() - w).abs().max() / w.abs().max()
        assert err < 1e-2, (name, err.item())
    assert torch.all(grads[1][~keep] == 0) and torch.all(grads[2][~keep] == 0)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_autocast_keeps_fp32(impl):
    # fp32 inputs under torch.autocast to bf16, forward and backward inside the region: fp32
    # accuracy on both backends (a bf16 logits GEMM would be ~1e-3 off)
    g = torch.Generator(device="cuda").manual_seed(3)
    n, h, v = 1024, 1024, 8191
    e = (torch.randn(n, h, device="cuda", generator=g) * 0.5).requires_grad_()
    c = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp, g_ent = (torch.randn(n, device="cuda", generator=g) for _ in range(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = linear_token_logprobs(e, c, t, temperature=0.8, return_entropy=True, impl=impl)
        grads = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(),
                                    (e, c))
    leaves = [x.detach().requires_grad_() for x in (e, c)]
    ls = torch.log_softmax((leaves[0] @ leaves[1].t()) / 0.8, dim=-1)
    lp = ls.gather(1, t[:, None])[:, 0]
    ent = -(ls.exp() * ls).sum(-1)
    want = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), leaves)
    torch.testing.assert_close(out.log_probs, lp.detach(), atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ent.detach(), atol=2e-4, rtol=1e-5)
    for name, a, w in zip(("hidden", "weight"), grads, want):
        err = (a - w).abs().max() / w.abs().max()
        assert err < 1e-4, (name, err.item())
