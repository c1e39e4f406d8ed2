"""Fused linear cross entropy on CUDA with real shapes (run on the H200:
``pytest -m gpu tests/linear_cross_entropy/test_linear_cross_entropy_gpu.py``); at the end,
tensor parallelism with every rank on the one GPU.

References are fp32 PyTorch on the materialized logits (``e.float() @ c.float().T``), which is
exact up to fp32 summation order for bf16 inputs.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from tests._cuda_graph import assert_capture_replays_eager
from tests._torchrun import torchrun_results
from tests.linear_cross_entropy.test_linear_cross_entropy_distributed import WORKER, check_every_case
from vocab_parallel_loss import linear_cross_entropy

K = importlib.import_module("vocab_parallel_loss.kernels.linear")
KC = K.config  # default_config reads OVERRIDE_CONFIG here
KF = importlib.import_module("vocab_parallel_loss.kernels.linear.fused")
KG = importlib.import_module("vocab_parallel_loss.kernels.linear.gemm")
LCE = importlib.import_module("vocab_parallel_loss.ops.linear_cross_entropy.function")
STRATEGY = importlib.import_module("vocab_parallel_loss.ops.fused_linear.strategy")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _case(n, h, v, dtype=torch.bfloat16, seed=0, bias=False, ignore_every=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = (torch.randn(n, h, device="cuda", generator=g) * 0.5).to(dtype)
    c = (torch.randn(v, h, device="cuda", generator=g) * 0.05).to(dtype)
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    up = torch.rand(n, device="cuda", generator=g)
    return e, c, b, t, up


def _reference(e, c, b, t, up, *, reduction, softcap=None, label_smoothing=0.0, z_loss=0.0):
    leaves = [e.detach().float().requires_grad_(), c.detach().float().requires_grad_()]
    if b is not None:
        leaves.append(b.detach().float().requires_grad_())
    x = leaves[0] @ leaves[1].t()
    if b is not None:
        x = x + leaves[2]
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(x, t, reduction="none", label_smoothing=label_smoothing)
    keep = t != -100
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(x, -1) ** 2 * keep
    if reduction == "mean":
        loss = loss.sum() / keep.sum().clamp(min=1)
    elif reduction == "sum":
        loss = loss.sum()
    g = up if reduction == "none" else torch.ones_like(loss)
    grads = torch.autograd.grad(loss, leaves, g)
    return loss.detach(), grads


def _run(e, c, b, t, up, **kw):
    leaves = [e.detach().requires_grad_(), c.detach().requires_grad_()]
    if b is not None:
        leaves.append(b.detach().requires_grad_())
    loss = linear_cross_entropy(leaves[0], leaves[1], t, leaves[2] if b is not None else None, **kw)
    g = up if kw.get("reduction") == "none" else torch.ones_like(loss)
    return loss.detach(), torch.autograd.grad(loss, leaves, g)


def _close_grads(got, want, rtol):
    for name, a, w in zip(("dE", "dC", "dbias"), got, want):
        scale = w.abs().max().item()
        err = (a.float() - w).abs().max().item()
        assert err <= rtol * scale, f"{name}: max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("n,h,v", [(4096, 4096, 32000), (4096, 4096, 16032), (1000, 1536, 50257)])
def test_bf16_real_shapes(impl, reduction, n, h, v):
    e, c, b, t, up = _case(n, h, v)
    loss, grads = _run(e, c, b, t, up, reduction=reduction, impl=impl)
    want, wgrads = _reference(e, c, b, t, up, reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
    _close_grads(grads, wgrads, 1e-2)


@pytest.mark.parametrize("matmul", ["triton", "torch"])
def test_matmul_backends(matmul, monkeypatch):
    cfg = K.default_config(torch.device("cuda")).replace(matmul=matmul)
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", cfg)
    e, c, b, t, up = _case(2048, 2048, 32003, bias=True)  # odd V: masked last tile
    kw = dict(reduction="none", softcap=30.0, label_smoothing=0.1, z_loss=1e-4)
    loss, grads = _run(e, c, b, t, up, impl="triton", **kw)
    want, wgrads = _reference(e, c, b, t, up, **kw)
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
    _close_grads(grads, wgrads, 1e-2)


TMA_CONFIGS = {
    "pointers": dict(fwd_desc=False, bwd_desc=False),
    "desc": dict(fwd_desc=True, bwd_desc=True, fwd_flat=False),
    "desc-flat": dict(fwd_desc=True, bwd_desc=True, fwd_flat=True),
    "desc-flat-128x128-4warps": dict(fwd_desc=True, bwd_desc=True, fwd_flat=True,
                                     fwd_block_v=128, fwd_warps=4, bwd_block_v=128,
                                     bwd_warps=4),
}


@pytest.mark.parametrize("cfg", list(TMA_CONFIGS), ids=list(TMA_CONFIGS))
@pytest.mark.parametrize("h", [2048, 1000, 1001])
def test_tma_descriptor_paths(cfg, h, monkeypatch):
    """E and C through TMA descriptors (zero fill past odd N, V and an H that ends inside a
    64-wide step), and the pointer fallback where a row is not 16-byte aligned (H = 1001)."""
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG",
                        K.default_config(torch.device("cuda")).replace(**TMA_CONFIGS[cfg]))
    e, c, b, t, up = _case(2049, h, 32003, bias=True)
    assert KF._descriptors_ok(e, c) == (h % 8 == 0)
    # with smoothing through the softcap: the recompute strategy; without: the saved tiles
    for kw in (dict(reduction="none", softcap=30.0, label_smoothing=0.1, z_loss=1e-4),
               dict(reduction="none", softcap=30.0, z_loss=1e-4)):
        loss, grads = _run(e, c, b, t, up, impl="triton", **kw)
        want, wgrads = _reference(e, c, b, t, up, **kw)
        torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
        _close_grads(grads, wgrads, 1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    # "sum": fp16 dlogits of a mean over many tokens underflow exactly as PyTorch's own fp16
    # backward does (loss scaling is the usual remedy), which is not what this test checks
    e, c, b, t, up = _case(1024, 1024, 8191, dtype=dtype)
    loss, grads = _run(e, c, b, t, up, reduction="sum", impl="triton")
    want, wgrads = _reference(e, c, b, t, up, reduction="sum")
    torch.testing.assert_close(loss, want, atol=1e-2, rtol=1e-5)
    _close_grads(grads, wgrads, 1e-2 if dtype == torch.float16 else 1e-4)


def test_deterministic_bitwise():
    e, c, b, t, up = _case(4096, 2048, 32000, bias=True)
    r1 = _run(e, c, b, t, up, reduction="none", impl="triton")
    r2 = _run(e, c, b, t, up, reduction="none", impl="triton")
    assert torch.equal(r1[0], r2[0])
    for a, b_ in zip(r1[1], r2[1]):
        assert torch.equal(a, b_)


def _extra_memory(e, c, t, memory_budget=None, **kw):
    """Peak bytes above the inputs during forward + backward, minus the gradients left behind
    (second run: compiled, allocator warm)."""
    e.requires_grad_()
    c.requires_grad_()
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = linear_cross_entropy(e, c, t, impl="triton", memory_budget=memory_budget, **kw)
        de, dc = torch.autograd.grad(loss, (e, c))
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base - de.numel() * de.element_size()
                 - dc.numel() * dc.element_size())
        del de, dc, loss
    return extra


def test_extra_memory_independent_of_vocab(monkeypatch):
    """Peak memory of the recompute strategy over inputs + gradients stays far below the
    logits' size."""
    n, h, v = 16384, 1024, 128256
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG",
                        K.default_config(torch.device("cuda")).replace(strategy="recompute"))
    e, c, _, t, _ = _case(n, h, v)
    extra = _extra_memory(e, c, t)
    logits_bytes = n * v * 2
    cfg = K.default_config(e.device)
    bound = cfg.chunk_bytes + n * h * 4 * 2 + 64 * 2**20 + (4096 * h * 4)
    assert extra < bound, (extra / 2**30, bound / 2**30)
    assert extra < logits_bytes / 4


@pytest.mark.parametrize("what", ["rows_x_hidden", "vocab_x_hidden", "rows_x_chunk",
                                  "saved_tiles"])
def test_int64_offsets(what, monkeypatch):
    """Tensors with more than 2^31 elements: E (N*H), C (V*H), the dlogits chunk (N*Vc), the
    saved tiles (N*V)."""
    if what == "rows_x_hidden":
        n, h, v = 2**19 + 3, 4096, 256
    elif what == "vocab_x_hidden":
        n, h, v = 64, 4096, 2**19 + 5
    else:
        n, h, v = 65536, 64, 40000
        delta = dict(chunk_bytes=8 << 30) if what == "rows_x_chunk" else dict(strategy="saved")
        monkeypatch.setattr(KC, "OVERRIDE_CONFIG",
                            K.default_config(torch.device("cuda")).replace(**delta))
    e, c, b, t, up = _case(n, h, v)
    loss, grads = _run(e, c, b, t, up, reduction="none", impl="triton")
    want, wgrads = _reference(e, c, b, t, up, reduction="none")
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
    _close_grads(grads, wgrads, 1e-2)
    del grads, wgrads
    torch.cuda.empty_cache()


@pytest.mark.parametrize("budget", [None, 0, "gif"], ids=["saved", "recompute", "gif"])
def test_cuda_graph_capture(budget, monkeypatch):
    """No host synchronisation in forward or backward: the step captures into a CUDA graph
    (the gradients formed in forward too: their accumulators are released in backward)."""
    if budget == "gif":
        monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.default_config(torch.device("cuda")).replace(
            strategy="grad_in_forward", gif_rows=768))
        budget = None
    e, c, b, t, up = _case(2048, 1024, 16032)
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()

    def step():
        loss = linear_cross_entropy(e, c, t, reduction="mean", label_smoothing=0.1, impl="triton",
                                    memory_budget=budget)
        return (loss, *torch.autograd.grad(loss, (e, c)))

    assert_capture_replays_eager(step)


@pytest.mark.parametrize("n,h,v", [(4096, 4096, 32000), (8192, 4096, 16032)])
@pytest.mark.parametrize("reduction,kw", [("mean", dict(softcap=30.0)),
                                          ("sum", dict(label_smoothing=0.1, z_loss=1e-4))])
def test_grad_in_forward_path(n, h, v, reduction, kw, monkeypatch):
    cfg = K.default_config(torch.device("cuda")).replace(strategy="grad_in_forward", gif_rows=3000)
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", cfg)
    calls = []
    orig = LCE._forward_with_grads
    monkeypatch.setattr(LCE, "_forward_with_grads", lambda *a: calls.append(1) or orig(*a))
    e, c, b, t, up = _case(n, h, v, bias=True)
    kw = dict(reduction=reduction, **kw)
    loss, grads = _run(e, c, b, t, up, impl="triton", **kw)
    want, wgrads = _reference(e, c, b, t, up, **kw)
    torch.testing.assert_close(loss, want, atol=2e-4 * max(1.0, want.abs().item()), rtol=2e-5)
    _close_grads(grads, wgrads, 1e-2)
    # bitwise deterministic too
    loss2, grads2 = _run(e, c, b, t, up, impl="triton", **kw)
    assert torch.equal(loss, loss2) and all(torch.equal(x, y) for x, y in zip(grads, grads2))
    assert calls, "the gradients were not formed in forward"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_round_rounds_to_nearest(dtype):
    """On the GPU the accumulator of the gradients formed in forward is rounded exactly as
    PyTorch rounds ``src * g``: to nearest, once."""
    g = torch.Generator(device="cuda").manual_seed(5)
    src = torch.randn(1000, 4099, device="cuda", generator=g) * 7
    scale = torch.tensor(0.731, device="cuda")
    out = K.scaled_round(src, scale, torch.empty(src.shape, dtype=dtype, device="cuda"))
    assert torch.equal(out, (src * scale).to(dtype))


@pytest.mark.parametrize("weights", ["bf16", "fp32", "main_grad"])
def test_grad_in_forward_memory(weights, monkeypatch):
    """The gradients formed in forward hold what ``gif_fixed_bytes`` counts, measured apart in
    forward and in backward, beyond the gradients returned: within 32 MiB both ways (the
    rounding order saves 4 N H bytes of backward's peak here, 128 MiB, against both
    accumulators held at once). Forward also holds one chunk's saved tiles and, with an fp32
    operand, the fp16 parts of its forward (the forced strategy leaves them the config's room)."""
    n, h, v = 32768, 1024, 128256
    cfg = K.default_config(torch.device("cuda")).replace(strategy="grad_in_forward")
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", cfg)
    e, c, _, t, _ = _case(n, h, v)
    if weights == "fp32":  # fp32 inputs: both accumulators become the gradients returned
        e, c = e.float(), c.float()
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    home = weights == "main_grad"
    if home:
        c.main_grad = torch.zeros(c.shape, device="cuda")
        c.grad_added_to_main_grad = False
    forward, backward = STRATEGY.gif_fixed_bytes(n, v, h, e, c, main_grad=home)
    slack = 32 * 2**20
    for _ in range(2):  # the second run: compiled, allocator warm
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = linear_cross_entropy(e, c, t, impl="triton", gradient_accumulation_fusion=home)
        torch.cuda.synchronize()
        fwd_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        de, dc = torch.autograd.grad(loss, (e, c))
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated() - base
        returned = de.numel() * de.element_size() + (0 if home else dc.numel() * dc.element_size())
        del de, dc, loss
    tiles = K.saved_bytes(cfg.gif_rows, v, e.element_size(), cfg)
    parts = K.parts_bytes(cfg.gif_rows, h, v, e.dtype, c.dtype, e.device, cfg)
    assert fwd_peak - returned <= forward + tiles + parts + slack, (fwd_peak / 2**30,
                                                                    forward / 2**30)
    assert abs(bwd_peak - returned - backward) <= slack, (bwd_peak / 2**30, backward / 2**30)


@pytest.mark.parametrize("n,h,v", [(4096, 4096, 32000), (3000, 2048, 16032)])
@pytest.mark.parametrize("kw", [dict(reduction="mean"),
                                dict(reduction="none", softcap=30.0),
                                dict(reduction="sum", label_smoothing=0.1, z_loss=1e-4)],
                         ids=["mean", "none-softcap", "sum-smoothing-z"])
def test_saved_and_recompute_strategies_agree(n, h, v, kw):
    e, c, b, t, up = _case(n, h, v, bias=True)
    want, wgrads = _reference(e, c, b, t, up, **kw)
    got = {}
    # the default saves the logits tiles; 0 recomputes them; 300 MiB saves the first columns
    # and recomputes the rest (at 4096 x 32000, not at 3000 x 16032, whose tiles fit whole)
    for budget in (None, 0, 300 << 20):
        loss, grads = _run(e, c, b, t, up, impl="triton", memory_budget=budget, **kw)
        torch.testing.assert_close(loss, want, atol=2e-4 * max(1.0, want.abs().max().item()),
                                   rtol=2e-5)
        _close_grads(grads, wgrads, 1e-2)
        got[budget] = grads
    # the two differ only by the bf16 rounding of the saved probabilities
    _close_grads(got[None], [g.float() for g in got[0]], 1e-2)
    again = _run(e, c, b, t, up, impl="triton", **kw)[1]
    assert all(torch.equal(x, y) for x, y in zip(got[None], again))  # deterministic


def test_saved_strategy_memory():
    n, h, v = 16384, 4096, 16032
    e, c, _, t, _ = _case(n, h, v)
    cfg = K.default_config(torch.device("cuda"))
    extra = _extra_memory(e, c, t)
    # the saved tiles and nothing else of size: dE is written in bf16 straight away
    bound = K.saved_bytes(n, v, 2, cfg) + 16 * 2**20
    assert extra < bound, (extra / 2**30, bound / 2**30)


def test_cublas_fp32_out_gemms_available():
    """The default backward GEMMs go through cuBLAS with out_dtype=float32; on a PyTorch without
    that overload (or one that wants ``self`` in bf16 for addmm) they fall back to the Triton
    GEMM with a RuntimeWarning: correct, but check the speed then. Reported as xfail."""
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    acc = torch.randn(256, 64, device="cuda")
    want = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        out = torch.empty(256, 64, device="cuda")
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError) as ex:
        pytest.xfail(f"cuBLAS fp32-out GEMM unavailable in torch {torch.__version__}: {ex}")
    torch.testing.assert_close(acc, want, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(out, a.float() @ b.float(), atol=1e-3, rtol=1e-4)


def test_torch_without_out_dtype_keeps_dc_on_cublas(monkeypatch):
    """A PyTorch whose ``mm`` / ``addmm`` lack ``out_dtype`` (older releases): the fp32-out GEMMs of
    dE fall back to Triton with a warning, dC (bf16 out, no ``out_dtype``) stays on cuBLAS, and
    the gradients stay right."""
    real_mm, real_addmm = torch.mm, torch.addmm
    calls = []

    def old_mm(*args, **kw):
        if "out_dtype" in kw:
            raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
        calls.append("mm")
        return real_mm(*args, **kw)

    def old_addmm(*args, **kw):
        if "out_dtype" in kw:
            raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")
        return real_addmm(*args, **kw)

    monkeypatch.setattr(torch, "mm", old_mm)
    monkeypatch.setattr(torch, "addmm", old_addmm)
    monkeypatch.setattr(KG, "TORCH_DTYPE_MM", {k: True for k in KG.TORCH_DTYPE_MM})
    # 1024-column chunks: dE is stored by the first chunk's GEMM and added to by the others
    # (the recompute strategy: its dE accumulates in fp32)
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG", K.default_config(torch.device("cuda")).replace(
        chunk_bytes=2049 * 2 * 1024, strategy="recompute"))
    e, c, b, t, up = _case(2049, 256, 3001)
    with pytest.warns(RuntimeWarning, match="out_dtype"):
        loss, grads = _run(e, c, b, t, up, reduction="none", impl="triton")
    assert KG.TORCH_DTYPE_MM == {"mm": True, "mm_fp32": False, "addmm": False}
    assert "mm" in calls  # dC went through cuBLAS
    want, wgrads = _reference(e, c, b, t, up, reduction="none")
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
    _close_grads(grads, wgrads, 1e-2)


def test_reduced_precision_flags_are_restored():
    """The GEMMs turn off cuBLAS's reduced-precision split-K reductions for themselves only."""
    m = torch.backends.cuda.matmul
    before = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    e, c, b, t, up = _case(512, 256, 1000)
    _run(e, c, b, t, up, reduction="mean", impl="triton")
    assert (m.allow_bf16_reduced_precision_reduction,
            m.allow_fp16_reduced_precision_reduction) == before



@pytest.mark.parametrize("m,k,n", [(256, 65536, 512), (4096, 16384, 4096)])
def test_dc_gemm_rounds_once(m, k, n):
    """``gemm_store`` into a bf16 output (how dC is written) is an fp32-accumulated product
    rounded once. Where |x| >= 64 the fp32 accumulation error (~3e-3 at K = 65536) is below
    0.03 bf16 ulp, so rounding once stays within ~0.53 ulp of the fp64 product; the long K
    invites split-K, and partial sums reduced in bf16 would land past 0.6 ulp."""
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    K.gemm_store(out, a, b, K.default_config(a.device))
    exact = a.double() @ b.double()
    big = exact.abs() >= 64
    assert int(big.sum()) > exact.numel() // 2
    ulp = torch.exp2(torch.floor(torch.log2(exact[big].abs())) - 7)  # bf16: 8 significant bits
    err_ulp = (out.double()[big] - exact[big]).abs() / ulp
    assert float(err_ulp.max()) <= 0.6, float(err_ulp.max())


@pytest.mark.parametrize("budget", [None, 0], ids=["saved", "recompute"])
def test_torch_compile_matches_eager(budget):
    """torch.compile over the fused linear loss (Dynamo traces the Triton kernels) gives the
    eager loss and gradients, for both strategies."""
    e, c, b, t, up = _case(1024, 512, 16032)
    kw = dict(reduction="none", memory_budget=budget, impl="triton")
    torch._dynamo.reset()
    compiled = torch.compile(lambda e, c, t: linear_cross_entropy(e, c, t, **kw))
    got = []
    for fn in (compiled, lambda e, c, t: linear_cross_entropy(e, c, t, **kw)):
        leaves = [e.detach().requires_grad_(), c.detach().requires_grad_()]
        loss = fn(leaves[0], leaves[1], t)
        got.append((loss.detach(), *torch.autograd.grad(loss, leaves, up)))
    for a, w in zip(*got):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["saved", "grad_in_forward", "recompute"])
@pytest.mark.parametrize("home_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_accumulation_fusion(strategy, home_dtype, monkeypatch):
    """dC added into ``main_grad`` through cuBLAS (fp32 out, or bf16 with beta = 1): the sum of
    what was there and the fp32 reference dC, rounded once into main_grad's dtype."""
    monkeypatch.setattr(KC, "OVERRIDE_CONFIG",
                        K.default_config(torch.device("cuda")).replace(strategy=strategy))
    n, h, v = 4096, 1024, 32000
    e, c, b, t, up = _case(n, h, v)
    red = "none" if strategy == "recompute" else "mean"
    _, (_, want) = _reference(e, c, b, t, up, reduction=red)
    e.requires_grad_()
    c.requires_grad_()
    g = torch.Generator(device="cuda").manual_seed(2)
    c.main_grad = (torch.randn(c.shape, device="cuda", generator=g) * want.abs().max()).to(home_dtype)
    c.grad_added_to_main_grad = False
    before = c.main_grad.double()
    loss = linear_cross_entropy(e, c, t, reduction=red, gradient_accumulation_fusion=True)
    loss.backward(up if red == "none" else None)
    assert c.grad_added_to_main_grad and not c.grad.any()
    exact = before + want.double()
    ulp = 2.0 ** -8 if home_dtype == torch.bfloat16 else 2.0 ** -24  # half an ulp, relative
    err = (c.main_grad.double() - exact).abs()
    assert bool((err <= 1e-2 * want.abs().max() + ulp * exact.abs()).all()), float(err.max())


@pytest.mark.parametrize("budget_gib", [0.2, 0.4, 0.7])
def test_memory_stays_within_the_budget(budget_gib):
    """Whatever strategy a budget picks (split columns, gradients in forward), the peak beyond
    the inputs and the gradients returned stays within it."""
    n, h, v = 8192, 2048, 64000
    e, c, _, t, _ = _case(n, h, v)
    budget = int(budget_gib * 2**30)
    extra = _extra_memory(e, c, t, memory_budget=budget)
    assert extra <= budget + 32 * 2**20, (extra / 2**30, budget_gib)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shift_stays_within_the_budget(dtype):
    """``shift`` over [b, s, h] hidden states copies neither them nor their gradient (it moves
    the targets): a budget just above the saved tiles, which saves them all, keeps the peak
    within it."""
    b, s, h, v = 4, 2048, 2048, 32000
    e, c, _, t, _ = _case(b * s, h, v, dtype=dtype)
    e, t = e.view(b, s, h), t.view(b, s)
    cfg = K.default_config(e.device)
    budget = K.saved_bytes(b * s, v, e.element_size(), cfg) + 8 * 2**20
    extra = _extra_memory(e, c, t, memory_budget=budget, shift=1)
    assert extra <= budget + 32 * 2**20, (extra / 2**20, budget / 2**20)


@pytest.mark.parametrize("budget", [None, 0], ids=["saved", "recompute"])
def test_cuda_graph_capture_into_main_grad(budget):
    """Gradient-accumulation fusion adds no host synchronisation either."""
    e, c, b, t, up = _case(2048, 1024, 16032)
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    c.main_grad = torch.zeros(c.shape, device="cuda")
    c.grad_added_to_main_grad = False

    def step():
        c.main_grad.zero_()
        loss = linear_cross_entropy(e, c, t, reduction="mean", impl="triton",
                                    memory_budget=budget, gradient_accumulation_fusion=True)
        (de,) = torch.autograd.grad(loss, (e,))
        return loss, de, c.main_grad.clone()

    assert_capture_replays_eager(step)


# ------------------------------------------------------------- tensor parallelism on one GPU
#: Where the TP ranks run: all on the one GPU, over gloo (NCCL refuses two ranks on one GPU).
SHARED_DEVICE = "cuda:0"


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_ranks_sharing_the_gpu(nproc, tmp_path):
    """The CPU tests' TP worker (``_distributed_worker.py``) with the kernels compiled for the
    GPU: TP and TP + sequence parallelism under each strategy (every tile saved, the first tile
    saved and the rest recomputed a tile at a time, everything recomputed, gradients formed in
    forward), label smoothing, z-loss, softcap, bias, shifts; fp32 and bf16; both backends;
    against the fp64 full-vocabulary reference. The torch.compile'd case stays on CPU
    (``tests._torchrun.compiled_collectives_run``)."""
    impls = ["triton", "torch"]
    got = torchrun_results(WORKER, nproc, *impls, results=tmp_path / "results.json",
                           timeout=900, device=SHARED_DEVICE)
    check_every_case(got, impls, compiled=False)


def _masked_bias(b, n, v, seed=5):
    """``b`` with -inf over whole tiles of the shipped config (the first of the first two forward
    splits, one after a finite tile, the last whole one) and over random columns (a padded
    vocabulary); returns it and the kept columns."""
    cfg = K.default_config(b.device)
    tile = cfg.fwd_block_v
    _, per_split = KF.forward_split(n, v, cfg, b.device)
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = torch.rand(v, device="cuda", generator=g) > 0.1
    for k in {0, 2, per_split, v // tile - 1}:
        keep[k * tile:(k + 1) * tile] = False
    return b.masked_fill(~keep, float("-inf")), keep


@pytest.mark.parametrize("plan", ["saved", "split", "gif", "recompute", "torch"])
def test_masked_columns(plan, monkeypatch):
    """-inf logits over whole vocabulary tiles and random columns: finite losses, the fp32
    reference's gradients and exactly zero gradients at the masked columns, for every strategy
    and both backends."""
    n, h, v = 4096, 1024, 32003
    e, c, b, t, up = _case(n, h, v, bias=True)
    b, keep = _masked_bias(b, n, v)
    kept = keep.nonzero()[:, 0]
    g = torch.Generator(device="cuda").manual_seed(6)
    t = torch.where(t == -100, t, kept[torch.randint(0, kept.numel(), (n,), device="cuda",
                                                     generator=g)])
    cfg = K.default_config(e.device)
    reduction, budget = "none", None
    if plan == "gif":
        reduction = "mean"
        monkeypatch.setattr(KC, "OVERRIDE_CONFIG",
                            cfg.replace(strategy="grad_in_forward", gif_rows=1536))
    elif plan == "split":  # four tiles saved beside a whole recompute chunk
        from tests._budgets import one_saved_tile_budget

        budget = one_saved_tile_budget(K, n, h, v, 2, cfg, tiles=4)
    elif plan == "recompute":
        budget = 0
    impl = "torch" if plan == "torch" else "triton"
    if impl == "triton":
        picked = STRATEGY.choose_strategy(K, e.requires_grad_(), c.requires_grad_(),
                                          b.requires_grad_(), reduction, False, None, None, 0.0,
                                          budget)
        assert picked.name == {"gif": "grad_in_forward", "recompute": "recompute"}.get(
            plan, "saved"), picked
        assert (picked.size == 4 * cfg.fwd_block_v) if plan == "split" else True, picked
    loss, grads = _run(e, c, b, t, up, reduction=reduction, impl=impl, memory_budget=budget)
    want, wgrads = _reference(e, c, b, t, up, reduction=reduction)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
    _close_grads(grads, wgrads, 1e-2)
    assert torch.all(grads[1][~keep] == 0) and torch.all(grads[2][~keep] == 0)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_keeps_fp32(impl, reduction):
    """fp32 inputs under torch.autocast to bf16, forward and backward inside the region: fp32
    accuracy on both backends (a bf16 logits GEMM would be ~1e-3 off)."""
    e, c, b, t, up = _case(1024, 1024, 8191, dtype=torch.float32, bias=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, grads = _run(e, c, b, t, up, reduction=reduction, impl=impl)
    want, wgrads = _reference(e, c, b, t, up, reduction=reduction)
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
    _close_grads(grads, wgrads, 1e-4)


MASKED = importlib.import_module("vocab_parallel_loss.ops.linear_cross_entropy.masked")


def _masked_case(n, h, v):
    """Megatron's loss on a per-token loss given its mask: the inputs, the mask (every 5th token
    out), and a budget under which the saved logits do not fit and the gradients in forward do."""
    e, c, b, t, up = _case(n, h, v)
    mask = (torch.arange(n, device="cuda") % 5 != 0).float()
    saved = K.saved_bytes(n, v, e.element_size(), K.default_config(e.device))
    return e, c, t, mask, up, saved - 1


@pytest.mark.parametrize("n,h,v", [(8192, 4096, 128256), (4096, 2048, 50257)])
@pytest.mark.parametrize("upstream", ["mask/count", "k*mask", "random", "one-token-off", "nan"])
def test_masked_grad_in_forward(n, h, v, upstream, monkeypatch):
    """Megatron-sized per-token losses given their loss mask, under a budget that does not save
    every tile: the gradients are formed in forward and used when the upstream gradient is k
    times the mask; any other upstream gradient gets its exact gradient (the gated recompute);
    no host sync either way (``set_sync_debug_mode("error")``)."""
    e, c, t, mask, up, budget = _masked_case(n, h, v)
    st = STRATEGY.choose_strategy(K, e.requires_grad_(), c.requires_grad_(), None, "none", False,
                                  None, None, 0.0, budget, masked=True)
    assert st.name == "grad_in_forward", st
    g = {"mask/count": mask / mask.sum(), "k*mask": 0.37 * mask, "random": up}.get(upstream)
    if upstream == "one-token-off":
        g = (mask / mask.sum()).clone()
        g[1] = torch.nextafter(g[1], torch.ones((), device="cuda"))
    elif upstream == "nan":
        g = (mask / mask.sum()).clone()
        g[5] = float("nan")  # a kept target, masked out: its loss's gradient is NaN, not 0
    taken = []
    orig = MASKED.upstream_scale
    monkeypatch.setattr(MASKED, "upstream_scale",
                        lambda *a: (lambda r: taken.append(r[1]) or r)(orig(*a)))
    leaves = [e.detach().requires_grad_(), c.detach().requires_grad_()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = linear_cross_entropy(*leaves, t, reduction="none", loss_mask=mask, impl="triton",
                                    memory_budget=budget)
        grads = torch.autograd.grad(loss, leaves, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(taken[0]) == (upstream in ("mask/count", "k*mask"))
    want, wgrads = _reference(e, c, None, t, torch.where(t != -100, g, 0.0), reduction="none")
    torch.testing.assert_close(loss, want, atol=2e-4, rtol=2e-5)
    if upstream == "nan":  # dE of that row and all of dC are NaN, as the reference's
        assert torch.isnan(grads[0][5]).all() and torch.isnan(grads[1]).all()
        rows = torch.arange(n, device="cuda") != 5
        grads, wgrads = (grads[0][rows],), (wgrads[0][rows],)
    _close_grads(grads, wgrads, 1e-2)


@pytest.mark.parametrize("upstream", ["k*mask", "random"])
def test_masked_cuda_graph_capture(upstream):
    """The masked gradients in forward, and their gated fallback, capture into a CUDA graph."""
    e, c, t, mask, up, budget = _masked_case(2048, 1024, 16032)
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    g = 0.37 * mask if upstream == "k*mask" else up

    def step():
        loss = linear_cross_entropy(e, c, t, reduction="none", loss_mask=mask, impl="triton",
                                    memory_budget=budget)
        return (loss, *torch.autograd.grad(loss, (e, c), g))

    assert_capture_replays_eager(step)


def test_masked_memory_within_the_budget():
    """The gradients in forward for a loss mask, 16384 x 4096 x 128256 bf16 at the default
    2 GiB: forward and backward (the gated fallback's chunk included) hold at most the
    budget beyond the inputs and the gradients returned (32 MiB slack)."""
    n, h, v = 16384, 4096, 128256
    e, c, t, mask, _, _ = _masked_case(n, h, v)
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    st = STRATEGY.choose_strategy(K, e, c, None, "none", False, None, None, 0.0, None, masked=True)
    assert st.name == "grad_in_forward", st
    g = mask / mask.sum()
    for _ in range(2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = linear_cross_entropy(e, c, t, reduction="none", loss_mask=mask, impl="triton")
        torch.cuda.synchronize()
        fwd_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        de, dc = torch.autograd.grad(loss, (e, c), g)
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated() - base
        returned = (de.numel() + dc.numel()) * 2
        del de, dc, loss
    limit = STRATEGY.DEFAULT_MEMORY_BUDGET + 32 * 2**20
    assert fwd_peak - returned <= limit and bwd_peak - returned <= limit, (
        fwd_peak / 2**30, bwd_peak / 2**30)
