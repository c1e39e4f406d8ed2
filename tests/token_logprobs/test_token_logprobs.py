"""Per-token log-probs and entropy over logits (``token_logprobs``) against the fp64 oracle, on
both backends: values and gradients under random upstream gradients, a masked vocabulary (-inf
logits) and logits near a large offset. (Two tests also cover ``linear_token_logprobs`` beside
it: under torch.compile and for a second derivative.)"""

import pytest
import torch

from tests._logprobs_oracle import TOL, logprob_grads as _grads, oracle
from vocab_parallel_loss import linear_token_logprobs, token_logprobs


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


#: per-token temperatures that define no distribution
UNUSABLE_T = (-0.5, 0.0, float("nan"), float("inf"), -float("inf"), 1e-45)


def unusable_temperatures(shape, generator):
    """A per-token temperature tensor: usable values, with ``UNUSABLE_T`` at the first tokens
    (flat order); returns it, the mask of the unusable ones and the usable values (1 at them)."""
    temp = torch.rand(shape, generator=generator) + 0.5
    bad = torch.zeros(shape, dtype=torch.bool)
    bad.view(-1)[:len(UNUSABLE_T)] = True
    temp.view(-1)[:len(UNUSABLE_T)] = torch.tensor(UNUSABLE_T)
    return temp, bad, torch.where(bad, torch.ones(()), temp)


def test_unusable_per_token_temperature_is_nan(impl):
    # a negative, zero, infinite, NaN (or, in fp32, denormal) temperature: that token's log-prob
    # and entropy are NaN and its logits' gradient NaN; the other tokens are exact; an ignored
    # token stays 0 whatever its temperature
    g = torch.Generator().manual_seed(21)
    z = (torch.randn(3, 5, 37, generator=g) * 3).requires_grad_()
    t = torch.randint(0, 37, (3, 5), generator=g)
    temp, bad, usable = unusable_temperatures((3, 5), g)
    t[0, 1] = -100  # temperature 0 on an ignored token
    bad[0, 1] = False
    out = token_logprobs(z, t, temperature=temp, return_entropy=True, return_argmax=True)
    lp, ent, am = oracle(z.detach(), t, usable)
    assert torch.isnan(out.log_probs[bad]).all() and torch.isnan(out.entropy[bad]).all()
    assert out.log_probs[0, 1] == 0 and out.entropy[0, 1] == 0
    torch.testing.assert_close(out.log_probs[~bad].double(), lp[~bad], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy[~bad].double(), ent[~bad], atol=1e-5, rtol=1e-5)
    assert torch.equal(out.argmax, am)  # the temperature does not move the argmax
    g_lp, g_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    (got,) = _grads((out.log_probs, out.entropy), z, g_lp, g_ent)
    assert torch.isnan(got[bad]).all() and torch.all(got[0, 1] == 0)
    z64 = z.detach().double().requires_grad_()
    lp64, ent64, _ = oracle(z64, t, usable)
    keep = (~bad).double()
    (want,) = _grads((lp64, ent64), z64, g_lp.double() * keep, g_ent.double() * keep)
    torch.testing.assert_close(got[~bad].double(), want[~bad], atol=1e-5, rtol=0)
    # only the entropy differentiated: still NaN for those tokens
    out = token_logprobs(z, t, temperature=temp, return_entropy=True)
    (got,) = torch.autograd.grad(out.entropy.sum(), z)
    assert torch.isnan(got[bad]).all() and not torch.isnan(got[~bad]).any()


@pytest.mark.parametrize("value", UNUSABLE_T[:-1])
def test_unusable_temperature_scalar_raises_tensor_is_nan(impl, value):
    z, t = torch.randn(3, 5), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, t, temperature=value)
    out = token_logprobs(z, t, temperature=torch.tensor(value), return_entropy=True)
    assert torch.isnan(out.log_probs).all() and torch.isnan(out.entropy).all()


@pytest.mark.parametrize("value", [1e-39, 1e-45, 5e-324])
def test_float_temperature_whose_inverse_overflows_raises(impl, value):
    # > 0 and finite, but 1 / T is not finite in fp32: unusable, as in a tensor (where the
    # token's outputs are NaN); in float64 it is usable down to the double's own denormals
    z, t = torch.randn(3, 5), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(z, t, temperature=value)
    out = token_logprobs(z, t, temperature=torch.tensor([value] * 3), return_entropy=True)
    assert torch.isnan(out.log_probs).all() and torch.isnan(out.entropy).all()
    if value > 1e-300:
        out = token_logprobs(z.double(), t, temperature=value, return_entropy=True)
        lp, ent, _ = oracle(z.double(), t, value)
        torch.testing.assert_close(out.log_probs, lp, atol=0, rtol=1e-12)
        torch.testing.assert_close(out.entropy, ent, atol=1e-12, rtol=1e-12)


def test_shard_of_padding_only(impl):
    # vocab_range with no vocabulary id here (a TP rank holding only padding; without TP every
    # target is then ignored or out of range): the merge's neutral statistics, no error
    z = torch.randn(3, 5, requires_grad=True)
    t = torch.tensor([-100, 0, -100])
    out = token_logprobs(z, t, vocab_range=(0, 0), return_entropy=True)
    assert out.log_probs[0] == 0 and out.log_probs[2] == 0 and torch.isnan(out.log_probs[1])
    (out.log_probs[[0, 2]].sum() + out.entropy[[0, 2]].sum()).backward()
    assert torch.all(z.grad == 0)


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
    with pytest.raises(TypeError, match="ignore_index"):
        token_logprobs(z, t, ignore_index=-100.5)


@pytest.mark.parametrize("kw,error", [
    (dict(ignore_index=None), TypeError), (dict(ignore_index="x"), TypeError),
    (dict(ignore_index=2 ** 70), ValueError), (dict(temperature=None), TypeError),
    (dict(temperature="x"), TypeError), (dict(vocab_range=(0,)), TypeError),
    (dict(vocab_range=(0.0, 5.0)), TypeError),
])
def test_argument_errors_match_the_losses(kw, error):
    """The checks the losses make, with the same exception type and the argument named."""
    z, t = torch.randn(3, 5), torch.tensor([1, 2, 3])
    with pytest.raises(error, match=next(iter(kw))):
        token_logprobs(z, t, **kw)


def test_bool_targets_are_refused_as_by_the_losses():
    z, t = torch.randn(3, 5), torch.tensor([True, False, True])
    with pytest.raises(TypeError, match="target must be an integer tensor of class ids"):
        token_logprobs(z, t)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_temperature_tensor_of_one_element_is_one_temperature(impl, shape):
    z, t = torch.randn(4, 9), torch.tensor([1, 2, 3, 0])
    got = token_logprobs(z, t, temperature=torch.full(shape, 0.7), return_entropy=True)
    want = token_logprobs(z, t, temperature=0.7, return_entropy=True)
    assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy)


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


def test_second_derivative_is_refused(impl):
    g = torch.Generator().manual_seed(9)
    e = torch.randn(5, 8, generator=g, requires_grad=True)
    c = torch.randn(12, 8, generator=g, requires_grad=True)
    z = torch.randn(5, 12, generator=g, requires_grad=True)
    t = torch.randint(0, 12, (5,), generator=g)
    for out, leaf in ((linear_token_logprobs(e, c, t), e), (token_logprobs(z, t), z)):
        with pytest.raises(RuntimeError, match="second derivative"):
            torch.autograd.grad(out.log_probs.sum(), leaf, create_graph=True)




# ------------------------------------------------------------------ masked vocabulary (-inf)
def _masked(rows, vocab, dtype, seed):
    """Logits with random -inf columns (a masked vocabulary, as RL and constrained decoding
    mask tokens), row 1 -inf everywhere but its target, row 2 ignored and all -inf, and
    targets on unmasked columns."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, vocab, (rows,), generator=g)
    masked = torch.rand(rows, vocab, generator=g) < 0.4
    masked[torch.arange(rows), t] = False
    masked[1] = True
    masked[1, t[1]] = False
    masked[2] = True
    t[2] = -100
    return z.masked_fill(masked, float("-inf")).to(dtype), t, masked


def test_oracle_gives_masked_columns_a_zero_gradient():
    # the oracle itself, against the same oracle over the unmasked columns only
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 13, generator=g, dtype=torch.float64)
    keep = torch.arange(13) % 3 != 1
    t = torch.tensor([0, 3, 5, 12])
    g_lp, g_ent = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(
        4, generator=g, dtype=torch.float64)
    full = z.masked_fill(~keep, float("-inf")).requires_grad_()
    part = z[:, keep].clone().requires_grad_()
    lp, ent, _ = oracle(full, t, 0.8)
    lp_k, ent_k, _ = oracle(part, torch.searchsorted(keep.nonzero()[:, 0], t), 0.8)
    torch.testing.assert_close(lp, lp_k)
    torch.testing.assert_close(ent, ent_k)
    (got,) = _grads((lp, ent), full, g_lp, g_ent)
    (want,) = _grads((lp_k, ent_k), part, g_lp, g_ent)
    assert torch.all(got[:, ~keep] == 0)
    torch.testing.assert_close(got[:, keep], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("per_token_t", [False, True])
@pytest.mark.parametrize("upstream", ["log_prob", "entropy", "both"])
def test_masked_vocabulary_gets_zero_gradient(impl, dtype, per_token_t, upstream):
    z, t, masked = _masked(5, 29, dtype, seed=4)
    g = torch.Generator().manual_seed(6)
    temp = torch.rand(5, generator=g) + 0.5 if per_token_t else 0.7
    x = z.clone().requires_grad_()
    out = token_logprobs(x, t, temperature=temp, return_entropy=True)
    lp, ent, _ = oracle(z, t, temp)
    tol = TOL[dtype]
    assert torch.isfinite(out.log_probs).all() and torch.isfinite(out.entropy).all()
    torch.testing.assert_close(out.log_probs.double(), lp, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(out.entropy.double(), ent, atol=tol * 10, rtol=tol)
    g_lp = torch.randn(5, generator=g) * (upstream != "entropy")
    g_ent = torch.randn(5, generator=g) * (upstream != "log_prob")
    (got,) = _grads((out.log_probs, out.entropy), x, g_lp.to(out.log_probs.dtype),
                    g_ent.to(out.log_probs.dtype))
    z64 = z.double().requires_grad_()
    (want,) = _grads(oracle(z64, t, temp)[:2], z64, g_lp.double(), g_ent.double())
    # the ignored row of -inf only: the oracle's log_softmax of it is NaN, the package's 0
    assert torch.all(got[2] == 0) and torch.all(out.log_probs[2] == 0)
    rows = torch.arange(5) != 2
    got, want = got[rows], want[rows]
    assert torch.isfinite(want).all()  # the oracle: 0 at masked columns (its own test above)
    assert torch.isfinite(got).all()
    assert torch.all(got[masked[rows]] == 0)
    torch.testing.assert_close(got.double(), want, atol=tol * 10 * want.abs().max().item(),
                               rtol=0)


@pytest.mark.parametrize("scale,softcap", [(0.5, None), (1.5, 3.0)])
def test_masked_vocabulary_under_scale_and_softcap(impl, scale, softcap):
    # the row backends' logit scale and softcap (reached from hidden states; here through the
    # Function over logits): a softcapped -inf is a finite logit of slope 0
    from vocab_parallel_loss import backends
    from vocab_parallel_loss.ops.token_logprobs import contract, function

    z, t, masked = _masked(5, 23, torch.float32, seed=8)
    g = torch.Generator().manual_seed(9)
    temp = torch.rand(5, generator=g) + 0.5
    x = z.clone().requires_grad_()
    o = contract.options(None, 23, None, -100, scale, softcap,
                         function.rows_backend(backends.triton_runs(x), x.dtype))
    lp, ent, _ = function.from_logits(x, t, *contract.inverse_temperature(temp, t, x), o)
    z64 = z.double().requires_grad_()
    want_lp, want_ent, _ = oracle(z64, t, temp, softcap=softcap, scale=scale)
    torch.testing.assert_close(lp.double(), want_lp.detach(), atol=2e-4, rtol=2e-5)
    torch.testing.assert_close(ent.double(), want_ent.detach(), atol=2e-4, rtol=2e-5)
    g_lp, g_ent = torch.randn(5, generator=g), torch.randn(5, generator=g)
    (got,) = _grads((lp, ent), x, g_lp, g_ent)
    (want,) = _grads((want_lp, want_ent), z64, g_lp.double(), g_ent.double())
    assert torch.all(got[2] == 0)  # ignored, all -inf: the oracle's row is NaN
    rows = torch.arange(5) != 2
    got, want, masked = got[rows], want[rows], masked[rows]
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    assert torch.all(got[masked] == 0)
    torch.testing.assert_close(got.double(), want, atol=2e-5 * want.abs().max().item(), rtol=0)


def _fp32_logprobs(x, t):
    """PyTorch's own fp32 log-prob and entropy (its log_softmax keeps x - max exact)."""
    ls = torch.log_softmax(x, dim=-1)
    return ls.gather(-1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)


@pytest.mark.parametrize("vocab,rows", [(67, 6), (4099, 2)])
def test_large_offset_gradient_keeps_fp32_precision(impl, vocab, rows):
    g = torch.Generator().manual_seed(13)
    z = torch.randn(rows, vocab, generator=g) * 2 + 1e4  # exact fp32 values near 1e4
    t = torch.randint(0, vocab, (rows,), generator=g)
    g_lp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    z64 = z.double().requires_grad_()
    (want,) = _grads(oracle(z64, t)[:2], z64, g_lp.double(), g_ent.double())
    leaf = z.clone().requires_grad_()
    (torch_fp32,) = _grads(_fp32_logprobs(leaf, t), leaf, g_lp, g_ent)
    out = token_logprobs(leaf, t, return_entropy=True)
    (got,) = _grads((out.log_probs, out.entropy), leaf, g_lp, g_ent)
    # p_j from the fp32-rounded lse is off by up to ulp(1e4) / 2 ~ 5e-4 of itself, and so is
    # the entropy term's x_j - lse: ~1e-4 of the largest entry. From exact x - max and the
    # unrounded log-sum the error is a few fp32 roundings, ~1e-7 as PyTorch's; 1e-5 between
    tol = dict(rtol=1e-5, atol=1e-6 * want.abs().max().item())
    torch.testing.assert_close(torch_fp32.double(), want, **tol)  # the bound is fair to PyTorch
    torch.testing.assert_close(got.double(), want, **tol)


# Compiles the row kernels for sm_90 (no GPU needed; the interpreter compiles nothing), with and
# without the softcap: the signature from the kernels' parameters, pointers 16-byte aligned.
_COMPILE_PROBE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vocab_parallel_loss.kernels import logprobs as K
from vocab_parallel_loss.kernels.launch import PINNED

POINTERS = {"z_ptr": "*bf16", "dz_ptr": "*bf16", "tgt_ptr": "*i64"}
SCALARS = {"s0": "i64", "s1": "i64", "gs0": "i64", "gs1": "i64", "scale": "fp32",
           "softcap": "fp32"}
for fn in (K._logprob_stats_kernel, K._logprob_backward_kernel):
    for cap in (False, True):
        sig = {p.name: "constexpr" if p.is_constexpr else POINTERS.get(p.name, "*fp32")
               if p.name.endswith("_ptr") else SCALARS.get(p.name, "i32") for p in fn.params}
        names = list(sig)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n][0] == "*"}
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(HAS_CAP=cap, BLOCK=1024),
                        attrs=attrs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **PINNED))
print("compiled")
"""


def test_row_kernels_compile_for_hopper():
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no NVIDIA toolchain to compile for sm_90")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(repo))
    out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, capture_output=True,
                         text=True, timeout=600, cwd=repo)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
