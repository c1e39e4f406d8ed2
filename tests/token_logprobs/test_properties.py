"""Property tests of ``token_logprobs`` on both backends, against the fp64 oracle and against each
other: -inf logits (random columns, strided columns and whole blocks of the row kernels, a row
but its target, targets on masked columns, padding past ``vocab_range``), per-token temperatures
from 2^-99 to 2^99 and unusable ones (NaN for their tokens only), and logits near a large
offset as precise as PyTorch's fp32 log-softmax. Under tensor parallelism (torchrun): one group
through a random sequence of calls of all four ops, with shapes and vocabulary ranges that change.

The other TP cases are in test_token_logprobs_distributed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._logprobs_oracle import logprob_grads, oracle
from tests._masks import PATTERNS, row_mask
from tests._torchrun import check_passed, torchrun_results, triton_runs_here
from tests.cross_entropy.test_properties import BACKENDS, forced
from vocab_parallel_loss import token_logprobs

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
#: the gradient's tolerance relative to its row's largest entry: rounded once to the dtype
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float64: 1e-12}


def _run(backend, z, t, **kw):
    """Log-probs, entropy, argmax and the gradient under upstream ``g_lp``, ``g_ent``."""
    g_lp, g_ent = kw.pop("g_lp"), kw.pop("g_ent")
    with forced(backend):
        x = z.clone().requires_grad_()
        out = token_logprobs(x, t, return_entropy=True, return_argmax=True, **kw)
        (grad,) = logprob_grads((out.log_probs, out.entropy), x,
                                g_lp.to(out.log_probs.dtype), g_ent.to(out.log_probs.dtype))
    return out.log_probs.detach(), out.entropy.detach(), out.argmax, grad


def _want(z, t, g_lp, g_ent, **kw):
    z64 = z.detach().double().requires_grad_()
    lp, ent, am = oracle(z64, t, **kw)
    (grad,) = logprob_grads((lp, ent), z64, g_lp.double(), g_ent.double())
    return lp.detach(), ent.detach(), am, grad


def _assert_rows_close(got, want, rel, what, upstream=None):
    """Each row within ``rel`` (a float, or one per row) of its own largest entry, or of its
    upstream gradients' size ``upstream`` where that is larger (``1 - p_t`` of a nearly certain
    target cancels: fp32 leaves it ``eps`` of the upstream gradient): rows of very different
    scales."""
    scale = want.abs().amax(dim=-1, keepdim=True)
    if upstream is not None:
        scale = torch.maximum(scale, upstream.double().reshape(-1, 1))
    rel = torch.as_tensor(rel, dtype=torch.float64).reshape(-1, 1)
    err = (got.double() - want).abs()
    bad = err > rel * scale
    assert not bad.any(), (f"{what}: rows {bad.any(-1).nonzero()[:, 0].tolist()}, max error "
                           f"{(err / scale.clamp(min=1e-300)).max().item():.3g} of the row scale")


def _vocab():
    # one block of the row kernels, or several (the backward's blocks are 2048 columns)
    return st.one_of(st.integers(2, 130), st.sampled_from([2053, 2111]))


def _upstream(kind, rows, g):
    g_lp = torch.randn(rows, generator=g) * (kind != "entropy")
    g_ent = torch.randn(rows, generator=g) * (kind != "log_prob")
    return g_lp, g_ent


@settings(max_examples=25, **SETTINGS)
@given(
    rows=st.integers(2, 7), vocab=_vocab(), dtype=st.sampled_from(DTYPES),
    patterns=st.sets(st.sampled_from(PATTERNS), min_size=1),
    density=st.sampled_from([0.1, 0.5, 0.95]), per_token_t=st.booleans(),
    masked_target=st.booleans(), pad=st.sampled_from([0, 0, 3]),
    upstream=st.sampled_from(["log_prob", "entropy", "both"]), seed=st.integers(0, 2**16),
)
def test_masked_logits_match_the_oracle_on_both_backends(
        rows, vocab, dtype, patterns, density, per_token_t, masked_target, pad, upstream, seed):
    """Finite log-probs and entropy wherever the target is not masked, -inf where it is (with
    the gradient of its logit, as the oracle's), gradients 0 at every other masked column and
    at padding past ``vocab_range``; ignored rows (masked whole) 0."""
    g = torch.Generator().manual_seed(seed)
    width = vocab + pad
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.2] = -100
    block = min(2048, 1 << (width - 1).bit_length())  # the backward kernel's block
    mask = row_mask(target, vocab, patterns, g, block, 1, density)
    z = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    z[:, :vocab] = z[:, :vocab].masked_fill(mask, float("-inf"))
    if pad:  # padding columns: any values, never part of an output
        z[:, vocab:] = torch.tensor([1e30, float("-inf"), 0.0][:pad], dtype=dtype)
    kept = (target >= 0).nonzero()[:, 0]
    on_masked = torch.zeros(rows, dtype=torch.bool)
    if masked_target and kept.numel() > 1 and mask[kept[-1]].any():
        r = kept[-1]
        target[r] = mask[r].nonzero()[0, 0]
        on_masked[r] = True
    temp = torch.rand(rows, generator=g) * 1.5 + 0.5 if per_token_t else 0.7
    g_lp, g_ent = _upstream(upstream, rows, g)
    ignored = target == -100
    # the oracle's log_softmax of an ignored row of -inf only is NaN: the outputs ignore it
    ref_z = z[:, :vocab].masked_fill(ignored[:, None], 0.0)
    lp, ent, am, grad = _want(ref_z, target, g_lp, g_ent, temperature=temp)
    assert torch.isfinite(grad).all()

    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float64: 1e-12}[dtype]
    results = {}
    for backend in BACKENDS:
        got = _run(backend, z, target, temperature=temp, vocab_range=(0, vocab) if pad else None,
                   g_lp=g_lp, g_ent=g_ent)
        results[backend] = got
        glp, gent, gam, ggrad = got
        msg = f"{backend}, masked {sorted(patterns)}"
        assert torch.all(glp[on_masked] == float("-inf")), msg
        assert torch.isfinite(glp[~on_masked]).all() and torch.isfinite(gent).all(), msg
        torch.testing.assert_close(glp.double(), lp, atol=tol * 10, rtol=tol,
                                   msg=lambda m: f"{msg} log-probs: {m}")
        torch.testing.assert_close(gent.double(), ent, atol=tol * 10, rtol=tol,
                                   msg=lambda m: f"{msg} entropy: {m}")
        assert torch.equal(gam[~ignored], am[~ignored]), msg
        assert torch.isfinite(ggrad).all(), msg
        assert torch.all(ggrad[:, vocab:] == 0) and torch.all(ggrad[ignored] == 0), msg
        untargeted = mask.clone()
        untargeted[on_masked, target[on_masked]] = False
        assert torch.all(ggrad[:, :vocab][untargeted] == 0), msg
        _assert_rows_close(ggrad[:, :vocab], grad, GRAD_TOL[dtype], f"{msg} gradient")
    if len(results) == 2:
        (a, b) = results.values()
        torch.testing.assert_close(a[0], b[0], atol=tol * 4, rtol=tol / 2)
        torch.testing.assert_close(a[1], b[1], atol=tol * 4, rtol=tol / 2)
        assert torch.equal(a[2], b[2])
        _assert_rows_close(a[3].double(), b[3].double(), GRAD_TOL[dtype], "backends' gradients")


#: temperatures that define no distribution (1e-45: an fp32 denormal, whose inverse overflows
#: fp32 but not fp64)
UNUSABLE = (0.0, -0.5, float("nan"), float("inf"), -float("inf"), 1e-45)


def _temperature(kind, g):
    """Tiny and large ones are powers of two (``z / T`` exact: what is measured is the kernels'
    arithmetic, not the rounding of their input); usual ones any float."""
    if kind == "tiny":
        return 2.0 ** -int(torch.randint(10, 100, (), generator=g))
    if kind == "large":
        return 2.0 ** int(torch.randint(10, 100, (), generator=g))
    if kind == "unusable":
        return UNUSABLE[int(torch.randint(0, len(UNUSABLE), (), generator=g))]
    return float(torch.empty(()).uniform_(0.3, 3.0, generator=g))


KINDS = ("tiny", "usual", "large", "unusable")


def unusable(temps, dtype):
    """The temperatures with no distribution in the compute dtype (fp64 for float64 logits,
    else fp32): those whose inverse there is not finite and > 0."""
    inv = 1.0 / temps.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return ~(torch.isfinite(inv) & (inv > 0))


@settings(max_examples=25, **SETTINGS)
@given(
    rows=st.integers(1, 7), vocab=st.integers(2, 90), dtype=st.sampled_from(DTYPES),
    as_float=st.booleans(), upstream=st.sampled_from(["log_prob", "entropy", "both"]),
    silence_unusable=st.booleans(), seed=st.integers(0, 2**16),
)
def test_extreme_temperatures_match_the_oracle_on_both_backends(
        rows, vocab, dtype, as_float, upstream, silence_unusable, seed):
    """Per-token (or float) temperatures from 2^-99 (one-hot policies, log-probs near -1e30
    and gradients near 1e30) to 2^99 (uniform ones, gradients near 1e-30), each token as the
    oracle says: relative to the token's own scale, plus for a temperature that is not a power
    of two what rounding ``z / T`` costs (a few ulps of ``max |z| / T``). Unusable ones (<= 0,
    NaN, inf, an inverse that overflows): a ValueError for a float; in a tensor, NaN log-prob
    and entropy for that token (0 if it is ignored), a NaN gradient row where either is
    differentiated (else 0: ``silence_unusable``), its argmax still given, every other token
    unaffected."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.15] = -100
    temps = torch.tensor([_temperature(KINDS[k], g) for k in torch.randint(
        0, len(KINDS), (rows,), generator=g).tolist()])  # fp32 values
    if as_float:
        temps[:] = temps[0]
    g_lp, g_ent = _upstream(upstream, rows, g)
    off = unusable(temps, dtype)
    if as_float and off.any():
        for backend in BACKENDS:
            with forced(backend), pytest.raises(ValueError, match="temperature"):
                token_logprobs(z, target, temperature=float(temps[0]))
        return
    temp = float(temps[0]) if as_float else temps
    nan_out = off & (target != -100)
    if silence_unusable:  # those tokens left out of the loss: their rows 0, not NaN
        g_lp, g_ent = g_lp * ~nan_out, g_ent * ~nan_out
    nan_grad = nan_out & ((g_lp != 0) | (g_ent != 0))
    usable = torch.where(off, torch.ones(()), temps).double()
    keep = (~nan_out).double()  # the oracle of the other tokens
    lp, ent, am, grad = _want(z, target, g_lp * keep, g_ent * keep, temperature=usable)
    eps = 1e-15 if dtype == torch.float64 else 6e-8
    inexact = torch.frexp(usable)[0] != 0.5
    rounding = 16 * eps * inexact * (z.double().abs().amax(-1) / usable)
    out_rel = 1e-12 if dtype == torch.float64 else 2e-5
    # dz_j = (g [j = t] - p_j (g + h (x_j - lse + H))) / T: the sum in the entropy's term
    # cancels near a uniform policy (a large T), to a few ulps of 1 + H
    size = (g_lp.abs() + g_ent.abs() * (1 + ent.abs())) / usable
    fine = ~nan_out
    results = {}
    for backend in BACKENDS:
        got = _run(backend, z, target, temperature=temp, g_lp=g_lp, g_ent=g_ent)
        results[backend] = got
        glp, gent, gam, ggrad = got
        for name, a, w in (("log-probs", glp, lp), ("entropy", gent, ent)):
            assert torch.isnan(a[nan_out]).all(), (backend, name, a)
            assert torch.isfinite(a[fine]).all(), (backend, name, a)
            err = (a[fine].double() - w[fine]).abs()
            assert torch.all(err <= rounding[fine] + out_rel * (1 + w[fine].abs())), (
                backend, name, err)
        assert torch.equal(gam, am), backend
        assert torch.isnan(ggrad[nan_grad]).all(), backend
        assert torch.isfinite(ggrad[~nan_grad]).all(), backend
        _assert_rows_close(ggrad[~nan_grad], grad[~nan_grad], (GRAD_TOL[dtype] + rounding)[
            ~nan_grad], f"{backend} gradient", size[~nan_grad])
    if len(results) == 2:
        (a, b) = results.values()
        for u, w in zip(a[:2], b[:2]):
            err = (u[fine].double() - w[fine].double()).abs()
            assert torch.all(err <= rounding[fine] + out_rel * (1 + w[fine].double().abs()))
        assert torch.equal(a[2], b[2])
        _assert_rows_close(a[3][~nan_grad].double(), b[3][~nan_grad].double(),
                           (GRAD_TOL[dtype] + rounding)[~nan_grad], "backends' gradients",
                           size[~nan_grad])


def _fp32_torch(z, t, temps, g_lp, g_ent):
    """PyTorch's own fp32 log-prob, entropy and gradient (its log_softmax keeps x - max exact)."""
    x = z.clone().requires_grad_()
    ls = torch.log_softmax(x / temps[:, None], dim=-1)
    lp = ls.gather(-1, t[:, None])[:, 0]
    ent = -(ls.exp() * ls).sum(-1)
    (grad,) = logprob_grads((lp, ent), x, g_lp, g_ent)
    return lp.detach(), ent.detach(), grad


@settings(max_examples=20, **SETTINGS)
@given(
    rows=st.integers(1, 6), vocab=_vocab(), offset=st.sampled_from([1e4, -1e4, 3e4]),
    spread=st.sampled_from([0.1, 2.0, 10.0]),
    # powers of two: z / T stays exact, so only the kernels' own arithmetic is measured
    temps=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=6, max_size=6),
    upstream=st.sampled_from(["log_prob", "entropy", "both"]), seed=st.integers(0, 2**16),
)
def test_large_offset_keeps_fp32_precision(rows, vocab, offset, spread, temps, upstream, seed):
    """fp32 logits near a large common offset: log-probs, entropy and gradient as close to the
    fp64 oracle as PyTorch's fp32 ones (a softmax from the fp32-rounded lse is off by
    ulp(lse) / 2 of itself, ~1e-4 of the largest entry near 1e4: outside these bounds)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * spread + offset  # exact fp32 values
    target = torch.randint(0, vocab, (rows,), generator=g)
    temp = torch.tensor(temps[:rows])
    g_lp, g_ent = _upstream(upstream, rows, g)
    lp, ent, _, grad = _want(z, target, g_lp, g_ent, temperature=temp)
    tol = dict(rtol=1e-5, atol=1e-5)
    t_lp, t_ent, t_grad = _fp32_torch(z, target, temp, g_lp, g_ent)
    torch.testing.assert_close(t_lp.double(), lp, **tol)  # the bounds are fair to PyTorch
    torch.testing.assert_close(t_ent.double(), ent, **tol)
    size = g_lp.abs() + g_ent.abs()
    _assert_rows_close(t_grad, grad, 1e-5, "PyTorch's fp32 gradient", size)
    results = {}
    for backend in BACKENDS:
        got = _run(backend, z, target, temperature=temp, g_lp=g_lp, g_ent=g_ent)
        results[backend] = got
        torch.testing.assert_close(got[0].double(), lp, **tol,
                                   msg=lambda m: f"{backend} log-probs: {m}")
        torch.testing.assert_close(got[1].double(), ent, **tol,
                                   msg=lambda m: f"{backend} entropy: {m}")
        _assert_rows_close(got[3], grad, 1e-5, f"{backend} gradient", size)
    if len(results) == 2:
        (a, b) = results.values()
        torch.testing.assert_close(a[0], b[0], **tol)
        torch.testing.assert_close(a[1], b[1], **tol)
        _assert_rows_close(a[3].double(), b[3].double(), 1e-5, "backends' gradients", size)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_one_tp_group_through_a_random_sequence_of_calls(tmp_path):
    """One TP group (torchrun, 2 ranks, gloo) through a seeded random sequence of calls of all
    four ops, both backends (``tests/_group_sequence_worker.py``): shapes from small pools, so
    that they recur and change, and ``vocab_range`` counts that change per rank (some ranks'
    ranges recur while others' do not; a rank may hold only padding). Every call: the same
    outputs on every rank, the oracle's values and gradients; never a rank failing alone or a
    collective that does not pair up."""
    worker = Path(__file__).resolve().parents[1] / "_group_sequence_worker.py"
    impls = "triton,torch" if triton_runs_here() else "torch"
    seeds, calls = (0, 1), 25
    results = torchrun_results(worker, 2, ",".join(map(str, seeds)), str(calls), impls,
                               results=tmp_path / "results.json", timeout=600)
    for seed in seeds:
        assert check_passed(results, f"seed={seed}")["calls"] == calls
