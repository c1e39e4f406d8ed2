"""The core loss on CUDA (run on the H200: ``pytest -m gpu tests/cross_entropy``); at the end,
tensor parallelism with every rank on the one GPU."""

from __future__ import annotations

import pytest
import torch

from tests._oracle import full_vocab_loss, full_vocab_loss_and_grad
from tests._torchrun import torchrun_results
from tests.cross_entropy.test_cross_entropy_distributed import WORKER, check_every_api
from vocab_parallel_loss import VocabParallelCrossEntropy, cross_entropy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _case(n, v, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, v, device="cuda", generator=g) * 4).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    up = torch.rand(n, device="cuda", generator=g)
    return x, t, up


@pytest.mark.parametrize("n,v", [(4096, 32000), (2048, 128256), (1024, 256000), (4096, 16032)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.1, 1e-4)])
def test_real_shapes_match_fp64(n, v, dtype, smoothing, z_loss):
    x, t, up = _case(n, v, dtype)
    xr = x.detach().requires_grad_()
    loss = cross_entropy(xr, t, label_smoothing=smoothing, z_loss=z_loss)
    (grad,) = torch.autograd.grad(loss, xr, up)
    ref_loss, ref_grad = full_vocab_loss_and_grad(x, t, up, label_smoothing=smoothing, z_loss=z_loss)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-4, rtol=1e-5)
    gtol = 2e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(grad.double(), ref_grad, atol=gtol, rtol=1e-2)


def test_sbv_transposed_and_inplace():
    x, t, up = _case(4096, 16032, torch.bfloat16)
    sbv = x.view(64, 64, 16032).transpose(0, 1)  # [s, b, v] view of a [b, s, v] buffer
    tt, uu = t.view(64, 64).t(), up.view(64, 64).t()
    ref_loss, ref_grad = full_vocab_loss_and_grad(sbv, tt, uu)
    for inplace in (False, True):
        y = sbv.clone() if inplace else sbv.detach().requires_grad_()
        src = y.detach().requires_grad_() if inplace else y
        inp = src * 1 if inplace else src
        loss = cross_entropy(inp, tt, inplace_backward=inplace)
        (grad,) = torch.autograd.grad(loss, inp, uu)
        torch.testing.assert_close(loss.double(), ref_loss, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(grad.double(), ref_grad, atol=4e-3, rtol=1e-2)
        if inplace:
            assert grad.data_ptr() == inp.data_ptr()


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_more_than_2_pow_31_elements(reduction):
    # "sum" takes the fused path of reduced losses (gradient written in forward)
    n, v = 8400, 256000  # 2.15e9 elements
    assert n * v > 2**31
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    xr = x.requires_grad_()
    loss = cross_entropy(xr, t, reduction=reduction)
    (grad,) = torch.autograd.grad(loss.sum(), xr)
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device="cuda")  # rows past 2^31 included
    ref_loss, ref_grad = full_vocab_loss_and_grad(x.detach()[rows], t[rows])
    if reduction == "none":
        torch.testing.assert_close(loss[rows].double(), ref_loss, atol=1e-4, rtol=1e-5)
    else:
        ref_sum = sum(full_vocab_loss(x.detach()[i:i + 512], t[i:i + 512], reduction="sum")
                      for i in range(0, n, 512))  # fp64 in chunks: 17 GB at once otherwise
        torch.testing.assert_close(loss.double(), ref_sum, atol=1e-3, rtol=1e-6)
    torch.testing.assert_close(grad[rows].double(), ref_grad, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("n,v", [(4096, 32000), (1024, 128256), (4096, 16032)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction,upstream,inplace", [
    ("mean", 1.0, False), ("mean", 0.5, False), ("sum", 1.0, True), ("mean", 0.5, True)])
def test_reduced_fused_path_matches_fp64(n, v, dtype, reduction, upstream, inplace):
    """The fused path of reduced losses on one shard: the gradient written in forward (unit
    upstream gradient) or recomputed (0.5); in place, the two passes over the logits buffer."""
    x, t, _ = _case(n, v, dtype)
    xr = x.clone().requires_grad_()
    inp = xr * 1 if inplace else xr  # in place needs a non-leaf, as out of an output layer
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-4)
    loss = cross_entropy(inp, t, inplace_backward=inplace, **kw)
    g = torch.tensor(upstream, device="cuda")
    (grad,) = torch.autograd.grad(loss, inp, g)
    ref_loss, ref_grad = full_vocab_loss_and_grad(x, t, g, **kw)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-4, rtol=1e-5)
    # a mean's gradient is ~1/count: compared at the scale of a per-token one
    scale = float((t != -100).sum()) / upstream if reduction == "mean" else 1.0 / upstream
    gtol = 2e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(grad.double() * scale, ref_grad * scale, atol=gtol, rtol=1e-2)
    if inplace:
        assert grad.data_ptr() == inp.data_ptr()


@pytest.mark.parametrize("n", [16384, 16385, 65537])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_path_reductions_are_deterministic(n, reduction):
    """The fused path's count and reduction: one program up to 16384 tokens, PyTorch's above
    (and for the count above 65536). Fifty calls are bitwise equal and match fp64."""
    x, t, _ = _case(n, 1000, torch.bfloat16)
    xr = x.requires_grad_()
    first = cross_entropy(xr, t, reduction=reduction).detach()
    ref = full_vocab_loss(x.detach(), t, reduction=reduction)
    torch.testing.assert_close(first.double(), ref, atol=1e-5, rtol=1e-6)
    again = torch.stack([cross_entropy(xr, t, reduction=reduction).detach() for _ in range(50)])
    assert torch.equal(again, first.expand(50))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chained_launches_match_plain_ones(reduction, monkeypatch):
    """Programmatic dependent launch (count -> fused kernel -> reduction, compute capability 9+)
    gives bitwise the loss and gradient of plain launches. The targets differ from call to call
    in how many are ignored, so a fused kernel that read the count before the count kernel
    wrote it would scale the gradient with a stale count."""
    import importlib

    from vocab_parallel_loss.kernels import launch as _launch
    from vocab_parallel_loss.kernels import logits as K

    if not K._pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch: compute capability 9.0+, VPL_PDL not 0")
    ce_mod = importlib.import_module("vocab_parallel_loss.ops.cross_entropy.function")
    x, _, _ = _case(8192, 16032, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    targets = []
    for k in range(12):
        t = torch.randint(0, 16032, (8192,), device="cuda", generator=g)
        t[torch.rand(8192, device="cuda", generator=g) < k / 12] = -100
        targets.append(t)

    def run(t):
        xr = x.clone().requires_grad_()
        loss = cross_entropy(xr, t, reduction=reduction)
        loss.backward()
        return loss.detach(), xr.grad

    chained = [run(t) for t in targets]
    if _launch._enabled and reduction == "mean":  # the fast path's keys hold the keywords
        keys = _launch._caches[K._ce_forward_grad_kernel].keys()
        assert any(("launch_pdl", True) in key for key in keys)
    monkeypatch.setattr(K, "_pdl", lambda device: False)
    monkeypatch.setattr(ce_mod, "_plans", {})  # the cached plans remember chained launches
    for t, (loss, grad) in zip(targets, chained):
        plain_loss, plain_grad = run(t)
        assert torch.equal(loss, plain_loss)
        assert torch.equal(grad, plain_grad)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_cuda_graph_capture_and_replay(reduction):
    x, t, up = _case(2048, 32000, torch.bfloat16)
    mod = VocabParallelCrossEntropy(reduction=reduction, label_smoothing=0.1)
    static_x = x.clone().requires_grad_()
    static_up = up if reduction == "none" else up[0]

    def step():
        loss = mod(static_x, t)
        (grad,) = torch.autograd.grad(loss, static_x, static_up)
        return loss, grad

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_loss, g_grad = step()
    new_x, _, _ = _case(2048, 32000, torch.bfloat16, seed=7)
    with torch.no_grad():
        static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    e_loss, e_grad = step()
    assert torch.equal(g_loss, e_loss) and torch.equal(g_grad, e_grad)


def test_deterministic_on_gpu():
    x, t, up = _case(4096, 32000, torch.bfloat16)
    xr = x.requires_grad_()
    out = []
    for _ in range(2):
        loss = cross_entropy(xr, t, label_smoothing=0.1)
        out.append((loss, torch.autograd.grad(loss, xr, up)[0]))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_torch_compile_inductor_no_graph_break():
    torch._dynamo.reset()
    head = torch.nn.Linear(256, 32000, bias=False, device="cuda", dtype=torch.bfloat16)
    loss_fn = VocabParallelCrossEntropy(reduction="mean", label_smoothing=0.1)
    h = torch.randn(8, 128, 256, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 32000, (8, 128), device="cuda")

    def step(h, t):
        loss = loss_fn(head(h), t)
        loss.backward()
        return loss

    eager = step(h, t)
    g_eager = head.weight.grad.clone()
    head.weight.grad = None
    compiled = torch.compile(step, fullgraph=False)
    explain = torch._dynamo.explain(lambda h, t: loss_fn(head(h), t))(h, t)
    assert explain.graph_break_count == 0, explain.break_reasons
    loss = compiled(h, t)
    torch.testing.assert_close(loss, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.weight.grad.float(), g_eager.float(), atol=2e-2, rtol=2e-2)


def _fast_launch_cases():
    """Logits and targets whose pointers, sizes and strides hit every specialization Triton
    makes: 16-byte aligned or not, divisible by 16 or not, equal to 1."""
    g = torch.Generator(device="cuda").manual_seed(11)
    cases = []
    for n, v in [(64, 4096), (63, 4000), (1, 4096), (17, 33), (2, 1)]:
        for dtype in (torch.bfloat16, torch.float32):
            buf = torch.randn(n * v + 8, device="cuda", generator=g).to(dtype)
            tbuf = torch.randint(0, v, (n + 1,), device="cuda", generator=g)
            aligned = buf[:n * v].view(n, v)
            odd = buf[1:1 + n * v].view(n, v)  # one element past an aligned address
            assert odd.data_ptr() % 16 != 0
            for x, t in ((aligned, tbuf[:n]), (odd, tbuf[1:])):
                cases.append((x, t, torch.rand(n, device="cuda", generator=g)))
    # a strided [s, b, v] view with a row stride that is not a multiple of 16
    wide = torch.randn(8, 4, 1003, device="cuda", generator=g).to(torch.bfloat16)
    sbv = wide[..., :1000].transpose(0, 1)
    t = torch.randint(0, 1000, (4, 8), device="cuda", generator=g)
    cases.append((sbv, t, torch.rand(4, 8, device="cuda", generator=g)))
    return cases


def _run_cases(cases, **kw):
    out = []
    for x, t, up in cases:
        xr = x.detach().requires_grad_()
        loss = cross_entropy(xr, t, **kw)
        (grad,) = torch.autograd.grad(loss, xr, up if kw.get("reduction", "none") == "none"
                                      else up.sum())
        out.append((loss, grad))
    return out


@pytest.mark.parametrize("kw", [{}, dict(reduction="mean", label_smoothing=0.1, z_loss=1e-4)])
def test_fast_launch_is_taken_and_bitwise_equal(kw):
    """The direct launch of the compiled kernel gives exactly Triton's launch results, also when
    an aligned call of the same kernel is cached before a misaligned one (a key missing the
    alignment or an integer's divisibility would launch the wrong specialization)."""
    from vocab_parallel_loss.kernels import launch as _launch

    cases = _fast_launch_cases()
    try:
        _launch.set_enabled(False)
        expected = _run_cases(cases, **kw)
        _launch.set_enabled(True)
        _launch._caches.clear()
        _run_cases(cases, **kw)  # the first launch of each key goes through Triton
        before = dict(_launch.counts)
        got = _run_cases(cases, **kw)
        enabled = _launch._enabled  # set_enabled(True) below resets it to "decide again"
    finally:
        _launch.set_enabled(True)
    assert enabled, "the fast launch path is not supported by this Triton"
    assert _launch._int_pointers, "this Triton's launcher was not found to take int pointers"
    # forward and backward; a mean on one shard: count, fused forward+gradient, reduction, and
    # the backward that acts only when the upstream gradient is not 1
    per_case = 2 if kw.get("reduction", "none") == "none" else 4
    assert _launch.counts["fast"] - before["fast"] == per_case * len(cases)
    assert _launch.counts["triton"] == before["triton"]
    for (loss, grad), (e_loss, e_grad) in zip(got, expected):
        assert torch.equal(loss, e_loss) and torch.equal(grad, e_grad)


def test_fast_launch_steps_aside_for_launch_hooks():
    """A profiler's launch hook must see every launch: the fast path falls back to Triton."""
    from triton import knobs

    from vocab_parallel_loss.kernels import launch as _launch

    x, t, _ = _case(64, 4096, torch.bfloat16)
    cross_entropy(x, t)  # cached
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # newer Triton: a chain of hooks, never None
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        before = dict(_launch.counts)
        cross_entropy(x, t)
        torch.cuda.synchronize()
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 1
    assert _launch.counts["triton"] == before["triton"] + 1
    assert _launch.counts["fast"] == before["fast"]


# ------------------------------------------------------------- tensor parallelism on one GPU
#: Where the TP ranks run: all on the one GPU, over gloo (NCCL refuses two ranks on one GPU).
SHARED_DEVICE = "cuda:0"


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_ranks_sharing_the_gpu(nproc, tmp_path):
    """The CPU tests' TP worker (``_distributed_worker.py``) with the kernels compiled for the
    GPU: every API on vocabulary shards (both layouts, the reductions, label smoothing, z-loss,
    in-place backward; fp32 and bf16), megatron-core's own loss, narrow targets and extreme
    logits, torch.compile, both backends, against the fp64 full-vocabulary reference."""
    impls = ["triton", "torch"]
    got = torchrun_results(WORKER, nproc, ",".join(impls), results=tmp_path / "results.json",
                           timeout=900, device=SHARED_DEVICE)
    check_every_api(got, impls)
