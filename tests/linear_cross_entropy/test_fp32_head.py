"""An fp32 LM head on the fused linear ops: fp32 weights with bf16, fp16 or fp32 hidden states,
on both backends (the Triton kernels under TRITON_INTERPRET=1 at every strategy, with fp32
operands split into fp16 parts of rows scaled by powers of two; the chunked PyTorch one), against
the fp64 oracle of the hidden states as given. ``fp32_precision`` and the dtype rules are
checked as arguments. The GPU tests hold the tensor-core products to the same bound."""

from __future__ import annotations

import pytest
import torch

from tests._linear_oracle import reference_grads
from tests._logprobs_oracle import logprob_grads, oracle
from tests.linear_cross_entropy.test_properties import PLANS, plan_call, plan_config
from vocab_parallel_loss import linear_cross_entropy, linear_token_logprobs

#: fp32-class: the log-probs, entropy and loss within this of fp64 (PyTorch's fp32 gives ~1e-6
#: here); a weight rounded to bf16 anywhere would be ~1e-3 off
ABS = 2e-5
HIDDEN = [torch.bfloat16, torch.float16, torch.float32]


def _cases(plans):
    """(plan, hidden dtype): fp16 hidden states take the fp32 products of fp32 ones, so one
    Triton strategy and the PyTorch backend cover them."""
    return [(p, h) for p in plans for h in HIDDEN
            if h != torch.float16 or p in ("recompute", "torch")]


def _inputs(n=37, h=40, v=101, hidden=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, h, generator=g).to(hidden)
    c = torch.randn(v, h, generator=g) * 0.5
    b = torch.randn(v, generator=g) * 0.1
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = -100
    return e, c, b, t


@pytest.mark.parametrize("plan,hidden", _cases(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_of_an_fp32_head_has_fp32_class_error(plan, hidden, reduction):
    if plan == "grad_in_forward" and reduction == "none":
        pytest.skip("gradients in forward need a scalar loss")
    e, c, b, t = _inputs(hidden=hidden)
    up = torch.rand(t.shape) if reduction == "none" else None
    impl, budget = plan_call(plan, e, c)
    leaves = [x.clone().requires_grad_() for x in (e, c, b)]
    with plan_config(plan):
        loss = linear_cross_entropy(*leaves[:2], t, leaves[2], reduction=reduction, impl=impl,
                                    memory_budget=budget)
        grads = torch.autograd.grad(loss, leaves, torch.ones_like(loss) if up is None else up)
    ref, ref_grads = reference_grads(e, c, t, b, upstream=up, reduction=reduction)
    assert loss.dtype == torch.float32
    assert (loss.double() - ref).abs().max() < ABS
    de, dc, db = grads
    assert de.dtype == hidden and dc.dtype == torch.float32 and db.dtype == torch.float32
    for got, want in ((dc, ref_grads[1]), (db, ref_grads[2])):
        assert (got.double() - want).abs().max() <= ABS * want.abs().max()
    # dE is rounded once to the hidden states' dtype
    tol = 2e-5 if hidden == torch.float32 else torch.finfo(hidden).eps
    assert (de.double() - ref_grads[0]).abs().max() <= tol * ref_grads[0].abs().max()


@pytest.mark.parametrize("plan,hidden", _cases([p for p in PLANS if p != "grad_in_forward"]))
def test_logprobs_of_an_fp32_head_have_fp32_class_error(plan, hidden):
    e, c, b, t = _inputs(hidden=hidden, seed=1)
    impl, budget = plan_call(plan, e, c)
    leaves = [x.clone().requires_grad_() for x in (e, c, b)]
    g_lp, g_ent = torch.rand(t.shape), torch.rand(t.shape)
    with plan_config(plan):
        out = linear_token_logprobs(*leaves[:2], t, leaves[2], temperature=0.7, impl=impl,
                                    return_entropy=True, memory_budget=budget)
        grads = logprob_grads((out.log_probs, out.entropy), leaves, g_lp, g_ent)
    ref_leaves = [x.double().requires_grad_() for x in (e, c, b)]
    lp, ent, _ = oracle(ref_leaves[0] @ ref_leaves[1].t() + ref_leaves[2], t, temperature=0.7)
    ref_grads = logprob_grads((lp, ent), ref_leaves, g_lp.double(), g_ent.double())
    assert (out.log_probs.double() - lp).abs().max() < ABS
    assert (out.entropy.double() - ent).abs().max() < ABS
    assert grads[0].dtype == hidden and grads[1].dtype == torch.float32
    for got, want in zip(grads[1:], ref_grads[1:]):
        assert (got.double() - want).abs().max() <= ABS * want.abs().max()


@pytest.mark.skipif("saved" not in PLANS, reason="the Triton kernels (interpreter or GPU)")
def test_split_scales_are_powers_of_two_within_fp16_range():
    """Each row's largest magnitude lands in [2^14, 2^15) whatever its own range (fp16 holds
    it; without the scale 1e30 overflows fp16 and 1e-30 underflows it), zeros and non-finite
    rows get normal scales, and the inverse is exact."""
    from vocab_parallel_loss.kernels.linear.scales import split_scales

    rows = torch.tensor([[1e30, -3.0], [-1e-30, 0.0], [0.0, 0.0], [1.0, 2.0**14],
                         [float("inf"), 1.0], [float("nan"), 1.0], [65504.0, 1.0]])
    sc = split_scales(rows, 1)
    s, r = sc[:, 0].double(), sc[:, 1].double()
    assert sc.dtype == torch.float32 and sc.shape == (7, 2)
    assert torch.equal(s * r, torch.ones(7, dtype=torch.float64))
    assert torch.equal(torch.frexp(s).mantissa, torch.full((7,), 0.5, dtype=torch.float64))
    top = rows.abs().amax(1).double()[[0, 1, 3, 6]] * s[[0, 1, 3, 6]]
    assert ((top >= 2**14) & (top < 2**15)).all(), top
    assert torch.isfinite(sc).all() and (sc > 0).all()
    assert torch.equal(split_scales(rows.t(), 0), sc)  # per column of the transpose
    assert torch.equal(split_scales(torch.empty(3, 0), 1)[:, 0], torch.full((3,), 2.0**126))
    # the Triton kernel (the GPU's) gives the same scales, NaN rows aside
    for kernel in (True, False):
        got = split_scales(rows.t(), 0, kernel=kernel)
        assert torch.isfinite(got).all() and torch.equal(got[[0, 1, 2, 3, 4, 6]],
                                                         sc[[0, 1, 2, 3, 4, 6]]), kernel
    assert torch.equal(split_scales(torch.empty(3, 0), 1, kernel=True)[:, 0],
                       torch.full((3,), 2.0**126))


@pytest.mark.skipif("saved" not in PLANS, reason="the Triton kernels (interpreter or GPU)")
def test_fp16_parts_in_memory_are_the_register_splits():
    """The parts split in memory are the bits the kernels split in registers: ``hi`` the scaled
    value rounded to fp16, ``lo`` its remainder, ``hi + lo`` within 2^-22 of the scaled value;
    the Triton kernel (the GPU's) and PyTorch's ops agree bit for bit, along any strides."""
    from vocab_parallel_loss.kernels.linear.parts import fp16_parts
    from vocab_parallel_loss.kernels.linear.scales import split_scales

    x = torch.randn(13, 37, generator=torch.Generator().manual_seed(3)) * 1e3
    x[2] *= 2.0**-40
    x[5] = 0.0
    s = split_scales(x, 1)
    hi, lo = fp16_parts(x, s, True)
    assert hi.shape == lo.shape == x.shape and hi.dtype == lo.dtype == torch.float16
    assert hi.stride(0) % 8 == 0  # a descriptor's 16-byte row stride
    xs = x.double() * s[:, :1].double()
    assert torch.equal(hi.double(), xs.to(torch.float16).double())
    assert ((hi.double() + lo.double() - xs).abs() <= 2.0**-22 * xs.abs().amax(1, True)).all()
    for src in (x, x.t().contiguous().t()):
        for kernel in (True, False):
            h2, l2 = fp16_parts(src, s, True, kernel=kernel)
            assert torch.equal(h2, hi) and torch.equal(l2, lo), kernel
    b = x.to(torch.bfloat16)
    bh, none = fp16_parts(b, split_scales(b, 1), False, kernel=True)
    assert none is None
    assert torch.equal(bh.double(), b.double() * split_scales(b, 1)[:, :1].double())  # exact


@pytest.mark.skipif("saved" not in PLANS, reason="the Triton kernels (interpreter or GPU)")
@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp32_weight", [True, False])
@pytest.mark.parametrize("invariant", [False, True])
def test_forward_from_parts_in_memory_matches_splits_in_registers(hidden, fp32_weight,
                                                                  invariant, monkeypatch):
    """The forward that reads fp16 parts split in memory, in several launches of row blocks
    and whole splits (``fwd_parts_bytes``), gives the statistics of the forward that splits
    each tile in registers, bit for bit here (under the interpreter both products are exact;
    on the GPU they round differently), with the loss's and the log-prob's statistics and
    saved tiles. Without room for a row block's and a split's parts the tiles are split in
    registers, but batch-invariant statistics take the parts whatever the room."""
    from vocab_parallel_loss.kernels.linear import config as lcfg, fused
    from vocab_parallel_loss.kernels.linear.saved import saved_tiles
    from vocab_parallel_loss.formulas import LogprobArgs

    e, c, b, t = _inputs(n=200, h=40, v=101, hidden=hidden, seed=7)
    c = c if fp32_weight else c.to(torch.bfloat16)
    if not fp32_weight:
        e = e.float()
    cfg = lcfg.INTERPRET_CONFIG.for_tiles(torch.float32)
    lp = LogprobArgs(inv_t=torch.full((1,), 1 / 0.7), scale=1.0, need_argmax=True)
    calls = []
    split_parts = fused.fp16_parts
    monkeypatch.setattr(fused, "fp16_parts", lambda x, *a: calls.append(x.shape) or
                        split_parts(x, *a))
    outs = {}
    # the invariant splits of the parts forward's launches, for both (without the parts the
    # invariant count is that of one launch over all the tiles)
    tps = fused.invariant_tiles(e, c, cfg.replace(split=0, fwd_parts_bytes=16 * 1024))
    same = {"invariant": invariant, "tiles_per_split": tps if invariant else None}
    for on in (True, False):
        # 96 or 192 rows and a few tiles of parts per launch
        run = cfg.replace(fwd_parts=on, split=0 if invariant else 3, fwd_parts_bytes=16 * 1024)
        sv = saved_tiles(e.shape[0], c.shape[0], torch.float32, e.device, run)
        outs[on] = (fused.forward_stats(e, c, b, t, 5, None, True, run, saved=sv, **same),
                    fused.forward_stats(e, c, b, t, 5, None, True, run, logprob=lp, **same),
                    sv.u, sv.tile_max)
        # on: E's parts and C's (in several launches) in each call; off: none
        assert (len(calls) >= 6) if on else not calls, (on, calls)
        calls.clear()
    for got, want in zip(outs[True], outs[False]):
        assert torch.equal(got, want)
    mode = fused.dot_mode(e.dtype, c.dtype)
    rows, tiles = fused._parts_plan(e, c, mode, run.replace(fwd_parts=True), None, False)
    assert rows < e.shape[0] and tiles >= 1  # several launches of rows
    assert fused._parts_plan(e, c, mode, cfg, 1000, False) is None
    assert fused._parts_plan(e, c, mode, cfg, 1000, True) is not None
    # within a stated room: one launch's parts of E and of C at a time, both within it
    per_row, per_tile = fused.parts_sizes(40, e.dtype, c.dtype, cfg)
    room = 30000  # fewer rows than E has, and a split of C
    of_e = {"E": [], "C": []}
    monkeypatch.setattr(fused, "fp16_parts", lambda x, *a: of_e[
        "E" if x.untyped_storage().data_ptr() == e.untyped_storage().data_ptr() else "C"
    ].append(x.shape[0]) or split_parts(x, *a))
    fused.forward_stats(e, c, b, t, 5, None, True, cfg.replace(split=3, fwd_parts_bytes=2**30),
                        room=room)
    assert len(of_e["E"]) > 1 and of_e["C"]  # E's rows in several launches
    rows, cols = max(of_e["E"]), max(of_e["C"])
    assert rows * per_row + -(-cols // cfg.fwd_block_v) * per_tile <= room, (of_e, room)


@pytest.mark.parametrize("plan,hidden", [(p, h) for p in PLANS if p != "grad_in_forward"
                                         for h in (torch.bfloat16, torch.float32)])
def test_an_fp32_head_far_from_fp16_range(plan, hidden):
    """Hidden rows of 2^20 (past fp16's 65504) and weights of 2^-20 (below its normal range)
    keep fp32-class error: the fp16 parts of the split products are taken of rows scaled by a
    power of two each, and unscaled exactly."""
    e, c, b, t = _inputs(hidden=torch.float32, seed=5)
    e = (e * 2.0**20).to(hidden)
    e[::3] *= 2.0**-24  # rows of logits near 0 beside rows of logits near 6
    c = c * 2.0**-20
    impl, budget = plan_call(plan, e, c)
    leaves = [x.clone().requires_grad_() for x in (e, c, b)]
    up = torch.rand(t.shape)
    with plan_config(plan):
        loss = linear_cross_entropy(*leaves[:2], t, leaves[2], reduction="none", impl=impl,
                                    memory_budget=budget)
        grads = torch.autograd.grad(loss, leaves, up)
    ref, ref_grads = reference_grads(e, c, t, b, upstream=up, reduction="none")
    assert (loss.double() - ref).abs().max() < ABS
    for got, want in zip(grads[1:], ref_grads[1:]):
        assert (got.double() - want).abs().max() <= ABS * want.abs().max()
    tol = 2e-5 if hidden == torch.float32 else torch.finfo(hidden).eps
    assert (grads[0].double() - ref_grads[0]).abs().max() <= tol * ref_grads[0].abs().max()


@pytest.mark.parametrize("plan,hidden", [(p, h) for p in PLANS if p in ("saved", "recompute", "torch")
                                         for h in (torch.bfloat16, torch.float32)])
def test_an_outlier_channel_keeps_fp32_class_error(plan, hidden):
    """One hidden channel 2^16 times the others (past the massive activations of LLMs, ~2^13),
    its weights 2^-16 times theirs, so its products weigh as much as the rest: an element 2^-16
    of its row's largest still keeps the 22 bits of its two fp16 parts (smaller ones lose a bit
    per halving, which is the documented limit)."""
    e, c, b, t = _inputs(hidden=torch.float32, seed=7)
    e[:, 0] = 2.0**16
    c[:, 0] *= 2.0**-16
    e = e.to(hidden)
    impl, budget = plan_call(plan, e, c)
    leaves = [x.clone().requires_grad_() for x in (e, c, b)]
    with plan_config(plan):
        loss = linear_cross_entropy(*leaves[:2], t, leaves[2], reduction="none", impl=impl,
                                    memory_budget=budget)
        grads = torch.autograd.grad(loss, leaves[1:], torch.ones_like(loss))
    ref, ref_grads = reference_grads(e, c, t, b, reduction="none")
    assert (loss.double() - ref).abs().max() < ABS
    for got, want in zip(grads, ref_grads[1:]):
        assert (got.double() - want).abs().max() <= ABS * want.abs().max()


@pytest.mark.parametrize("impl", ["triton", "torch"] if "saved" in PLANS else ["torch"])
@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
def test_autocast_keeps_the_fp32_head(impl, hidden):
    """torch.autocast(bf16) around the call leaves the fp32 head's products fp32-class."""
    e, c, b, t = _inputs(hidden=hidden, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(e, c, t, b, impl=impl)
        out = linear_token_logprobs(e, c, t, b, impl=impl)
    ref, _ = reference_grads(e, c, t, b)
    lp, _, _ = oracle(e.double() @ c.double().t() + b.double(), t)
    assert (loss.double() - ref).abs() < ABS
    assert (out.log_probs.double() - lp).abs().max() < ABS


def _round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp64 rounded to 11 significand bits (TF32's and fp16's), to nearest even."""
    m, ex = torch.frexp(x.double())
    return torch.ldexp(torch.round(m * 2048) / 2048, ex)


@pytest.mark.skipif("saved" not in PLANS, reason="the Triton kernels (interpreter or GPU)")
@pytest.mark.parametrize("plan", [p for p in PLANS if p != "torch"])
@pytest.mark.parametrize("hidden", [torch.bfloat16, torch.float32])
def test_tf32_takes_the_products_of_operands_rounded_to_tf32(plan, hidden):
    """The Triton kernels' ``fp32_precision="tf32"`` (one fp16 product of rows scaled by powers
    of two) gives the logits of both operands rounded to 11 significand bits, as TF32 does:
    the loss and log-probs of the rounded operands in fp64 within fp32-class error, and those
    of the operands as given ~1e-3 away."""
    e, c, b, t = _inputs(hidden=hidden, seed=4)
    e, c = e * 2.0 ** -20, c * 2.0 ** 20  # far from fp16's range: the row scales bring them in
    leaves = [x.clone().requires_grad_() for x in (e, c, b)]
    impl, budget = plan_call(plan, e, c)
    with plan_config(plan):
        loss = linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction="none",
                                    impl=impl, memory_budget=budget, fp32_precision="tf32")
        out = linear_token_logprobs(leaves[0], leaves[1], t, leaves[2], impl=impl,
                                    memory_budget=budget, fp32_precision="tf32",
                                    return_entropy=True)
    keep = t != -100
    for operands, near in (((_round_to_tf32(e), _round_to_tf32(c)), True),
                           ((e.double(), c.double()), False)):
        x = operands[0] @ operands[1].t() + b.double()
        ref_loss = torch.nn.functional.cross_entropy(x, t, reduction="none")
        lp, ent, _ = oracle(x, t)
        errs = [(loss.double() - ref_loss)[keep].abs().max(),
                (out.log_probs.double() - lp)[keep].abs().max(),
                (out.entropy.double() - ent).abs().max()]
        if near:
            assert max(errs) < ABS, errs
        else:
            assert (errs[0] > 10 * ABS) and (errs[1] > 10 * ABS), errs


@pytest.mark.parametrize("impl", ["triton", "torch"] if "saved" in PLANS else ["torch"])
def test_tf32_precision_is_accepted(impl):
    """``fp32_precision="tf32"``: TF32-class products (the Triton kernels round both operands
    to TF32's 11 significand bits, on the CPU too; PyTorch's CPU matmuls have no TF32 and stay
    fp32), within TF32-class error of fp64."""
    e, c, b, t = _inputs(seed=3)
    loss = linear_cross_entropy(e, c, t, b, impl=impl, fp32_precision="tf32")
    out = linear_token_logprobs(e, c, t, b, impl=impl, fp32_precision="tf32")
    ref, _ = reference_grads(e, c, t, b)
    assert (loss.double() - ref).abs() < 1e-3
    assert torch.isfinite(out.log_probs).all()


@pytest.mark.parametrize("op", ["loss", "logprobs"])
def test_argument_checks(op):
    e, c, b, t = _inputs()
    call = (lambda *a, **k: linear_cross_entropy(*a, impl="torch", **k)) if op == "loss" else \
        (lambda *a, **k: linear_token_logprobs(*a, impl="torch", **k))
    with pytest.raises(ValueError, match="fp32_precision"):
        call(e, c, t, fp32_precision="ieee")
    with pytest.raises(ValueError, match="fp32_precision"):
        call(e, c, t, fp32_precision=None)
    with pytest.raises(ValueError, match="fp32 head"):  # fp32 hidden, 16-bit weight
        call(e.float(), c.bfloat16(), t)
    with pytest.raises(ValueError, match="bias dtype"):
        call(e, c, t, b.bfloat16())


def test_module_takes_fp32_precision():
    from vocab_parallel_loss import VocabParallelLinearCrossEntropy

    e, c, b, t = _inputs(seed=4)
    mod = VocabParallelLinearCrossEntropy(impl="torch", fp32_precision="tf32")
    assert "fp32_precision='tf32'" in repr(mod)
    ref, _ = reference_grads(e, c, t, b)
    assert (mod(e, c, t, b).double() - ref).abs() < 1e-3
    with pytest.raises(ValueError, match="fp32_precision"):
        VocabParallelLinearCrossEntropy(fp32_precision="bf16")
