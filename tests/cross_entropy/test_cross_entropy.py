"""Single-process numerics of the core loss against fp64 PyTorch, for both implementations.

``impl="triton"`` runs the Triton kernels (on CPU through TRITON_INTERPRET=1, see conftest);
``impl="torch"`` the pure-PyTorch fallback.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from vocab_parallel_loss import (VocabParallelCrossEntropy, backends, cross_entropy,
                                 parallel_cross_entropy, settings)
from tests._oracle import full_vocab_loss, full_vocab_loss_and_grad

ce_mod = importlib.import_module("vocab_parallel_loss.ops.cross_entropy.function")

TOL = {torch.float32: (2e-5, 2e-6), torch.bfloat16: (1e-4, 8e-3), torch.float16: (1e-4, 1e-3),
       torch.float64: (1e-12, 1e-13)}  # float64: computed in float64


def make_logits(shape, dtype, layout, seed=0, scale=3.0):
    """Logits of ``shape`` (SQ, B, V) in the given memory layout, values exact in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=g) * scale).to(dtype)
    if layout == "contiguous":
        return base.clone()
    if layout == "sbv_transposed":  # Megatron: [s, b, v] as a view of a [b, s, v] buffer
        return base.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "narrowed":  # a vocab slice of a wider buffer: row stride > V
        wide = torch.zeros(shape[:-1] + (shape[-1] + 7,), dtype=dtype)
        wide[..., 3:3 + shape[-1]] = base
        return wide[..., 3:3 + shape[-1]]
    raise ValueError(layout)


def make_target(shape, vocab, seed=1, ignore_frac=0.2, ignore_index=-100, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, shape, generator=g)
    t[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    return t.to(dtype)


def check(logits, target, *, reduction="none", label_smoothing=0.0, z_loss=0.0, ignore_index=-100,
          inplace_backward=False):
    dtype = logits.dtype
    ref_loss, ref_grad = None, None
    x = logits.clone() if inplace_backward else logits
    x = x.detach().requires_grad_() if x.is_leaf else x
    loss = cross_entropy(x, target, reduction=reduction, label_smoothing=label_smoothing,
                         z_loss=z_loss, ignore_index=ignore_index, inplace_backward=inplace_backward)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(5))
    ref_loss, ref_grad = full_vocab_loss_and_grad(
        logits, target, upstream, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, ignore_index=ignore_index)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    assert grad.dtype == dtype and grad.shape == logits.shape
    ltol, gtol = TOL[dtype]
    torch.testing.assert_close(loss.double(), ref_loss, atol=ltol * 10, rtol=ltol)
    # the gradient is rounded once from fp32: within one ulp of the dtype around the value
    torch.testing.assert_close(grad.double(), ref_grad, atol=gtol, rtol=gtol * 2)
    return loss, grad


@pytest.mark.parametrize("layout", ["contiguous", "sbv_transposed", "narrowed"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.3, 1e-2)])
def test_fp32_matches_fp64_reference(impl, layout, reduction, label_smoothing, z_loss):
    logits = make_logits((7, 3, 37), torch.float32, layout)
    check(logits, make_target((7, 3), 37), reduction=reduction, label_smoothing=label_smoothing,
          z_loss=z_loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "sbv_transposed"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_low_precision_inputs(impl, dtype, layout, label_smoothing):
    logits = make_logits((5, 4, 53), dtype, layout)
    check(logits, make_target((5, 4), 53), label_smoothing=label_smoothing)


@pytest.mark.parametrize("vocab", [1, 2, 17, 2053, 4099])
def test_odd_vocab_sizes_and_multi_block_rows(impl, vocab):
    # 2053 and 4099 exceed one kernel block, so the loop over blocks and its masking are exercised
    logits = make_logits((3, 2, vocab), torch.float32, "contiguous")
    check(logits, make_target((3, 2), vocab), label_smoothing=0.1)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64])
def test_target_dtypes(impl, target_dtype):
    logits = make_logits((4, 3, 29), torch.float32, "contiguous")
    check(logits, make_target((4, 3), 29, dtype=target_dtype))


def test_other_leading_shapes(impl):
    check(make_logits((2, 3, 19), torch.float32, "contiguous").reshape(6, 19),
          make_target((6,), 19))
    x4 = torch.randn(2, 3, 2, 19).permute(2, 0, 1, 3)  # three leading dims, not collapsible
    check(x4, make_target((2, 2, 3), 19))


def test_custom_ignore_index(impl):
    logits = make_logits((4, 3, 23), torch.float32, "contiguous")
    target = make_target((4, 3), 23, ignore_index=7, ignore_frac=0.4)
    check(logits, target, ignore_index=7, reduction="mean", label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_inplace_backward_matches_and_reuses_the_buffer(impl, reduction):
    logits = make_logits((4, 3, 41), torch.bfloat16, "sbv_transposed")
    target = make_target((4, 3), 41)
    _, grad_default = check(logits, target, reduction=reduction)

    # through a non-leaf, as out of an output layer: the gradient must be the logits buffer
    src = logits.detach().float().requires_grad_()
    y = src.to(torch.bfloat16)
    version = y._version
    loss = cross_entropy(y, target, reduction=reduction, inplace_backward=True)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(5))
    captured = {}
    y.register_hook(lambda g: captured.setdefault("grad", g))
    loss.backward(upstream)
    assert captured["grad"].data_ptr() == y.data_ptr()
    assert y._version > version
    assert torch.equal(captured["grad"], grad_default)


def test_inplace_backward_is_caught_by_a_later_use(impl):
    src = torch.randn(3, 5, 31, requires_grad=True)
    y = src * 1.0
    other = (y ** 2).sum()  # saves y for its own backward
    loss = cross_entropy(y, make_target((3, 5), 31), reduction="sum", inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_all_tokens_ignored(impl, reduction):
    logits = torch.randn(4, 6, 19, requires_grad=True)
    target = torch.full((4, 6), -100)
    loss = cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    assert torch.all(loss == 0)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    assert torch.all(grad == 0)


def test_padding_minus_inf_and_huge_logits(impl):
    logits = make_logits((3, 4, 37), torch.float32, "contiguous")
    logits[..., 30:] = float("-inf")  # padded vocabulary columns
    logits[0, 0, :30] += 1e4  # very large but finite logits
    target = make_target((3, 4), 30)
    x = logits.requires_grad_()
    loss = cross_entropy(x, target)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    ref_loss, ref_grad = full_vocab_loss_and_grad(logits, target)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert torch.all(grad[..., 30:] == 0)
    # near 1e4 too the loss and the softmax come from exact differences x - max
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-6, rtol=4e-6)


def test_whole_row_minus_inf_in_one_shard_only(impl):
    logits = make_logits((2, 3, 11), torch.float32, "contiguous")
    logits[1, 2, :] = float("-inf")
    target = make_target((2, 3), 11, ignore_frac=0.0)
    loss = cross_entropy(logits, target)
    ref = full_vocab_loss(logits, target)
    torch.testing.assert_close(loss.double(), ref, equal_nan=True)


def test_nan_stays_in_its_row(impl):
    logits = make_logits((3, 4, 29), torch.float32, "contiguous").requires_grad_()
    target = make_target((3, 4), 29, ignore_frac=0.0)
    with torch.no_grad():
        logits[1, 2, 5] = float("nan")
    loss = cross_entropy(logits, target)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    assert torch.isnan(loss[1, 2])
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1, 2] = False
    ref_loss, ref_grad = full_vocab_loss_and_grad(logits.detach()[keep], target[keep])
    torch.testing.assert_close(loss[keep].double(), ref_loss)
    torch.testing.assert_close(grad[keep].double(), ref_grad, atol=1e-6, rtol=1e-5)


def test_out_of_range_target_gives_nan_for_that_token_only(impl):
    logits = make_logits((2, 5, 23), torch.float32, "contiguous").requires_grad_()
    target = make_target((2, 5), 23, ignore_frac=0.0)
    target[0, 1], target[1, 3] = 23, -5
    loss = cross_entropy(logits, target)
    assert torch.isnan(loss[0, 1]) and torch.isnan(loss[1, 3])
    ok = torch.ones(2, 5, dtype=torch.bool)
    ok[0, 1] = ok[1, 3] = False
    torch.testing.assert_close(loss[ok].double(), full_vocab_loss(logits.detach()[ok], target[ok]))


def test_out_of_range_target_check_mode(impl, monkeypatch):
    logits = torch.randn(2, 3, 13)
    target = torch.zeros(2, 3, dtype=torch.long)
    target[1, 1] = 99
    with pytest.raises(ValueError, match="99"):
        cross_entropy(logits, target, check_targets=True)
    monkeypatch.setenv("VOCAB_PARALLEL_LOSS_CHECK_TARGETS", "1")
    # the variable is read when a call signature is first seen (a call plan): this one was
    # seen, without it
    assert torch.isnan(cross_entropy(logits, target)[1, 1])
    monkeypatch.setattr(ce_mod, "_plans", {})
    with pytest.raises(ValueError, match=r"target value 99 is outside the vocabulary \[0, 13\)"):
        cross_entropy(logits, target)
    with pytest.raises(ValueError, match="99"):  # and kept for that signature
        cross_entropy(logits, target)
    with pytest.raises(ValueError, match="99"):  # the explicit argument still wins either way
        cross_entropy(logits, target, check_targets=True)
    monkeypatch.delenv("VOCAB_PARALLEL_LOSS_CHECK_TARGETS")
    assert torch.isnan(cross_entropy(logits, target, check_targets=False)[1, 1])
    target[1, 1] = -100  # the ignore index is allowed
    cross_entropy(logits, target)


def test_deterministic(impl):
    logits = make_logits((6, 5, 301), torch.bfloat16, "sbv_transposed").requires_grad_()
    target = make_target((6, 5), 301)
    runs = []
    for _ in range(2):
        loss = cross_entropy(logits, target, label_smoothing=0.1, z_loss=1e-4)
        (grad,) = torch.autograd.grad(loss, logits, torch.linspace(0, 1, 30).view(6, 5))
        runs.append((loss, grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_empty_input(impl, reduction):
    logits = torch.randn(0, 4, 17, requires_grad=True)
    loss = cross_entropy(logits, torch.zeros(0, 4, dtype=torch.long), reduction=reduction)
    assert loss.shape == ((0, 4) if reduction == "none" else ())
    if reduction != "none":
        assert loss.item() == 0
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    assert grad.shape == logits.shape


def test_forward_saves_nothing_of_size_n_by_v(impl):
    logits = make_logits((8, 3, 101), torch.bfloat16, "contiguous").requires_grad_()
    n = 24
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(logits, make_target((8, 3), 101), label_smoothing=0.1)
    big = [t for t in saved if t.numel() > 2 * n]  # the lse and its low part: 2 N floats
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()


def test_module_equals_functional(impl):
    logits = make_logits((4, 3, 47), torch.float32, "sbv_transposed")
    target = make_target((4, 3), 47)
    mod = VocabParallelCrossEntropy(label_smoothing=0.1, z_loss=1e-3, reduction="mean")
    ref = full_vocab_loss(logits, target, label_smoothing=0.1, z_loss=1e-3, reduction="mean")
    torch.testing.assert_close(mod(logits, target).double(), ref)
    assert "reduction='mean'" in repr(mod)


@pytest.mark.parametrize("layout", ["bsv", "sbv"])
def test_transformer_engine_signature(impl, layout):
    x = make_logits((5, 3, 31), torch.bfloat16, "contiguous" if layout == "bsv" else "sbv_transposed")
    target = make_target((5, 3), 31)
    per_token = parallel_cross_entropy(x, target, 0.1, False, None, -100, True)
    assert per_token.shape == target.shape and per_token.dtype == torch.float32
    torch.testing.assert_close(per_token.double(), full_vocab_loss(x, target, label_smoothing=0.1),
                               atol=1e-4, rtol=1e-4)
    mean = parallel_cross_entropy(x, target, label_smoothing=0.1, reduce_loss=True)
    torch.testing.assert_close(mean.double(), full_vocab_loss(x, target, label_smoothing=0.1,
                                                              reduction="mean"), atol=1e-4, rtol=1e-4)
    with pytest.warns(FutureWarning, match="_input"):
        old = parallel_cross_entropy(target=target, _input=x)
    torch.testing.assert_close(old, parallel_cross_entropy(x, target))


def test_bad_input_errors():
    x = torch.randn(3, 4, 11)
    t = torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="does not match"):
        cross_entropy(x, torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        VocabParallelCrossEntropy(label_smoothing=-0.1)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="reduction"):
        VocabParallelCrossEntropy(reduction="batchmean")
    with pytest.raises(TypeError, match="floating-point"):
        cross_entropy(x.long(), t)
    with pytest.raises(TypeError, match="integer"):
        cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="both"):
        parallel_cross_entropy(x, t, _input=x)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("upstream", [1.0, 0.5, float("nan")])
@pytest.mark.parametrize("layout", ["contiguous", "sbv_transposed", "narrowed"])
@pytest.mark.parametrize("inplace", [False, True])
def test_reduced_loss_unit_and_scaled_upstream(impl, reduction, upstream, layout, inplace):
    # a unit upstream gradient (loss.backward()) and others, through every layout; on one shard
    # the Triton path forms the gradient in forward (15 rows over a grid of 8: the row loop runs)
    base = make_logits((5, 3, 61), torch.bfloat16, layout)
    logits = (base.clone() if inplace else base).requires_grad_()
    target = make_target((5, 3), 61)
    loss = cross_entropy(logits * 1 if inplace else logits, target, reduction=reduction,
                         label_smoothing=0.1, z_loss=1e-3, inplace_backward=inplace)
    (grad,) = torch.autograd.grad(loss, logits, torch.tensor(upstream))
    ref_loss, ref_grad = full_vocab_loss_and_grad(base, target, torch.tensor(upstream),
                                                  reduction=reduction, label_smoothing=0.1,
                                                  z_loss=1e-3)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-4, rtol=1e-5)
    if upstream != upstream:  # NaN: NaN on every kept token's row, ignored rows stay 0
        kept = (target != -100).reshape(-1)
        rows = grad.reshape(-1, 61)
        assert torch.isnan(rows[kept]).all() and (rows[~kept] == 0).all()
        return
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=8e-3)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_loss_backward_twice_through_a_retained_graph(impl, reduction):
    # the fused path hands its forward-made gradient out once; a second backward recomputes
    logits = make_logits((5, 3, 61), torch.bfloat16, "contiguous").requires_grad_()
    target = make_target((5, 3), 61)
    loss = cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1)
    for upstream in (1.0, 0.5, 1.0):
        (grad,) = torch.autograd.grad(loss, logits, torch.tensor(upstream), retain_graph=True)
        _, ref = full_vocab_loss_and_grad(logits, target, torch.tensor(upstream),
                                          reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(grad.double(), ref, atol=1e-4, rtol=8e-3)
    y = logits.detach().clone().requires_grad_() * 1
    loss = cross_entropy(y, target, reduction=reduction, inplace_backward=True)
    torch.autograd.grad(loss, y, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        torch.autograd.grad(loss, y)


def test_reduced_loss_leaf_gradient_is_not_copied(impl):
    # AccumulateGrad takes the returned buffer as .grad (the graph released it first)
    logits = make_logits((5, 3, 61), torch.bfloat16, "contiguous").requires_grad_()
    loss = cross_entropy(logits, make_target((5, 3), 61), reduction="mean")
    captured = {}
    logits.register_hook(lambda g: captured.update(ptr=g.data_ptr()))
    loss.backward()
    assert logits.grad.data_ptr() == captured["ptr"]


@pytest.mark.parametrize("upstream", [1.0, 0.25])
@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.parametrize("sum_in_grad", [True, False])
def test_fused_reduced_path_equals_the_two_passes(impl, monkeypatch, upstream, small_blocks,
                                                  sum_in_grad):
    if impl != "triton":
        pytest.skip("the fused path is Triton's")
    kernels = backends.triton_logits
    default = kernels.fused_config
    # small_blocks: blocks shorter than the row, as long rows get on the GPU (both passes loop
    # over whole blocks and a tail); else one block holds the row. sum_in_grad: label
    # smoothing's sum of logits taken in the second pass or in the first (the config picks it
    # by row size; both are forced here on one small shape)
    small = dict(BLOCK=512, GRAD_BLOCK=1024) if small_blocks else {}
    configs = []  # one per fused launch
    monkeypatch.setattr(kernels, "fused_config", lambda v, d, ls=False, inplace=False: configs.append(
        v) or dict(default(v, d, ls, inplace), SUM_IN_GRAD=sum_in_grad, **small))
    logits = make_logits((7, 3, 2053), torch.bfloat16, "sbv_transposed").requires_grad_()
    target = make_target((7, 3), 2053)
    grads = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(settings.FUSED_REDUCED, fused)
        monkeypatch.setattr(ce_mod, "_plans", {})
        loss = cross_entropy(logits, target, reduction="mean", label_smoothing=0.1, z_loss=1e-3)
        grads[fused] = (loss, *torch.autograd.grad(loss, logits, torch.tensor(upstream)))
        assert len(configs) == (fused == "1")  # "1" took the fused path, "0" did not
        configs.clear()
    # the sum of logits (label smoothing) may be added in another order: a couple of ulps (a
    # sum that missed the 5 columns of a row's tail would be 4e-7 off, relative)
    torch.testing.assert_close(grads["1"][0], grads["0"][0], rtol=2e-7, atol=0)
    assert torch.equal(grads["1"][1], grads["0"][1])  # the same fp32 formula, rounded once


@pytest.mark.parametrize("inplace", [False, True])
def test_fused_path_writes_a_new_gradient_never_the_logits(impl, monkeypatch, inplace):
    """The fused kernel writes the gradient in forward, so it writes a new tensor; in place
    takes the two passes (the logits keep their values until the backward). Both results equal
    the out-of-place two passes'."""
    if impl != "triton":
        pytest.skip("the fused path is Triton's")
    kernels = backends.triton_logits
    default, asked = kernels.fused_config, []

    def spy(v, d, ls=False, inplace=False):
        asked.append(inplace)
        return default(v, d, ls, inplace)

    monkeypatch.setattr(kernels, "fused_config", spy)
    monkeypatch.setattr(ce_mod, "_plans", {})
    logits = make_logits((5, 301), torch.bfloat16, "contiguous")
    target = make_target((5,), 301)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x * 1, target, reduction="mean", inplace_backward=inplace)
    (grad,) = torch.autograd.grad(loss, x)
    assert asked == ([] if inplace else [False])
    ref = logits.clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(cross_entropy(ref, target, reduction="mean"), ref)
    assert torch.equal(grad, ref_grad)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_backward_picks_its_config_for_label_smoothing(impl, monkeypatch, smoothing):
    """The backward's warp count depends on label smoothing (kernels/logits.py,
    backward_config): the config must be asked with it, and the result must not depend on it."""
    if impl != "triton":
        pytest.skip("the configs are Triton's")
    kernels = backends.triton_logits
    default, asked = kernels.backward_config, []

    def spy(v, d, ls=False):
        asked.append(ls)
        return default(v, d, ls)

    monkeypatch.setattr(kernels, "backward_config", spy)
    monkeypatch.setattr(ce_mod, "_plans", {})
    logits = make_logits((5, 301), torch.bfloat16, "contiguous").requires_grad_()
    target = make_target((5,), 301)
    loss = cross_entropy(logits, target, label_smoothing=smoothing)
    (grad,) = torch.autograd.grad(loss, logits, torch.linspace(0.5, 1.5, 5))
    assert asked == [smoothing > 0]
    # the other config on the same call: the same gradient, bit for bit
    monkeypatch.setattr(kernels, "backward_config", lambda v, d, ls=False: default(v, d, not ls))
    monkeypatch.setattr(ce_mod, "_plans", {})
    loss = cross_entropy(logits, target, label_smoothing=smoothing)
    (other,) = torch.autograd.grad(loss, logits, torch.linspace(0.5, 1.5, 5))
    assert torch.equal(grad, other)


def test_backward_config_for_label_smoothing():
    """8 warps for label smoothing on 16K-32K-column rows of 2-byte logits (measured on the
    H200: 498 against 518 us at 32 warps), 32 otherwise; the block is the same."""
    kernels = pytest.importorskip("vocab_parallel_loss.kernels.logits")
    plain = kernels.backward_config(32000, torch.bfloat16)
    smooth = kernels.backward_config(32000, torch.bfloat16, True)
    assert (plain["num_warps"], smooth["num_warps"]) == (32, 8)
    assert plain["BLOCK"] == smooth["BLOCK"]
    for v, dtype in ((32000, torch.float32), (16032, torch.bfloat16), (128256, torch.bfloat16)):
        assert kernels.backward_config(v, dtype, True) == kernels.backward_config(v, dtype)


def test_cached_call_plans_keep_every_check(impl):
    """Calls with a signature seen before skip the checks (a cached plan): every call that
    differs in what the checks look at must still be checked."""
    ce = importlib.import_module("vocab_parallel_loss.ops.cross_entropy.function")
    logits = torch.randn(3, 4, 37)
    target = torch.randint(0, 37, (3, 4))
    first = cross_entropy(logits, target, label_smoothing=0.1)
    plans = len(ce._plans)
    torch.testing.assert_close(cross_entropy(logits, target, label_smoothing=0.1), first)
    assert len(ce._plans) == plans  # the second call reused the plan
    with pytest.raises(TypeError, match="integer"):
        cross_entropy(logits, target.float(), label_smoothing=0.1)
    with pytest.raises(ValueError, match="does not match"):
        cross_entropy(logits, target[:, :3], label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="z_loss"):
        cross_entropy(logits, target, z_loss=-1.0)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, target, reduction="avg")
    # a transposed view of the same shape is a new signature, read with its own strides
    sbv = logits.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(cross_entropy(sbv, target, label_smoothing=0.1), first)
