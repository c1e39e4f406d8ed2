"""The drop-ins against their peers: every parameter the peer's function has (name, kind, default)
is accepted, and each has the peer's meaning (checked against the fp64 reference)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from vocab_parallel_loss import parallel_cross_entropy, vocab_parallel_cross_entropy
from tests._oracle import full_vocab_loss_and_grad

ce_mod = importlib.import_module("vocab_parallel_loss.ops.cross_entropy.function")


# Signatures recorded from the peers' sources (bodies omitted); the live peers, where importable,
# are checked too (below).
# TransformerEngine main (NVIDIA/TransformerEngine d0067d0, 2026-08-22, 2.20.0.dev0)
def te_main(inp, target, label_smoothing=0.0, reduce_loss=False, dist_process_group=None,
            ignore_idx=-100, is_cg_capturable=False, *, _input=None): ...


# TransformerEngine pull request 3273: the gradient may overwrite the input
def te_overwrite_input(inp, target, label_smoothing=0.0, reduce_loss=False,
                       dist_process_group=None, ignore_idx=-100, is_cg_capturable=False, *,
                       overwrite_input=False, _input=None): ...


# TransformerEngine pull request 2707: z-loss and the log-sum-exp
def te_z_loss_and_lse(inp, target, label_smoothing=0.0, reduce_loss=False,
                      dist_process_group=None, ignore_idx=-100, is_cg_capturable=False,
                      z_loss_weight=0.0, *, _input=None, return_log_sum_exp=False): ...


# megatron-core main (Megatron-LM d98e8a6, 0.20 development); 0.14-0.17 have no tp_group
def megatron_main(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None): ...


def megatron_0_17(vocab_parallel_logits, target, label_smoothing=0.0): ...


def assert_accepts_signature(ours, theirs):
    """Every call that ``theirs`` accepts binds the same way to ``ours``: each of their
    parameters exists in ours with the same kind, position and default (ours may add optional
    ones after theirs, and give a default where they have none)."""
    mine = inspect.signature(ours).parameters
    their = inspect.signature(theirs).parameters
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    my_positional = [n for n, p in mine.items() if p.kind in positional]
    their_positional = [n for n, p in their.items() if p.kind in positional]
    assert my_positional[:len(their_positional)] == their_positional, (my_positional,
                                                                       their_positional)
    for name, p in their.items():
        assert name in mine, f"{ours.__name__} lacks {name!r}"
        q = mine[name]
        assert q.kind == p.kind, (name, q.kind, p.kind)
        if p.default is not inspect.Parameter.empty:
            assert q.default == p.default, (name, q.default, p.default)
    for name, q in mine.items():  # nothing extra that a call of theirs would have to pass
        if name not in their:
            assert q.default is not inspect.Parameter.empty or q.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), name


@pytest.mark.parametrize("theirs", [te_main, te_overwrite_input, te_z_loss_and_lse])
def test_transformer_engine_signatures(theirs):
    assert_accepts_signature(parallel_cross_entropy, theirs)


@pytest.mark.parametrize("theirs", [megatron_main, megatron_0_17])
def test_megatron_signatures(theirs):
    assert_accepts_signature(vocab_parallel_cross_entropy, theirs)


def test_installed_megatron_core_signature():
    tensor_parallel = pytest.importorskip("megatron.core.tensor_parallel")
    assert_accepts_signature(vocab_parallel_cross_entropy,
                             tensor_parallel.vocab_parallel_cross_entropy)


def test_installed_transformer_engine_signature():
    try:
        from transformer_engine.pytorch import parallel_cross_entropy as te_parallel_ce
    except Exception as exc:  # not installed, or no CUDA build here
        pytest.skip(f"TransformerEngine not importable: {exc}")
    assert_accepts_signature(parallel_cross_entropy, te_parallel_ce)


def test_the_signature_check_can_fail():
    def narrower(inp, target, label_smoothing=0.0, *, tp_group=None): ...

    with pytest.raises(AssertionError):  # keyword-only where megatron's is positional
        assert_accepts_signature(narrower, megatron_main)
    with pytest.raises(AssertionError):  # a parameter missing
        assert_accepts_signature(narrower, te_overwrite_input)


def _inputs(dtype=torch.float32, transposed=False):
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(3, 5, 37, generator=g) * 3).to(dtype)
    target = torch.randint(0, 37, (3, 5), generator=g)
    target[0, 1] = target[2, 4] = -100
    if transposed:  # Megatron's [s, b, v] view
        full, target = full.transpose(0, 1), target.t()
    return full, target


@pytest.mark.parametrize("reduce_loss", [False, True])
def test_overwrite_input(impl, reduce_loss):
    """TransformerEngine's meaning: inp keeps its values until backward, which writes the
    gradient over it; loss and gradient as without it."""
    full, target = _inputs(transposed=True)
    x = full.clone().requires_grad_()
    y = x * 1  # the logits buffer (not a leaf)
    loss = parallel_cross_entropy(y, target, 0.1, reduce_loss, overwrite_input=True)
    assert torch.equal(y.detach(), full)  # not yet overwritten
    upstream = None if reduce_loss else torch.randn(target.shape)
    kw = dict(label_smoothing=0.1, reduction="mean" if reduce_loss else "none")
    ref_loss, ref_grad = full_vocab_loss_and_grad(full, target, upstream, **kw)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(y.detach().double(), ref_grad, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("reduce_loss", [False, True])
def test_z_loss_weight(impl, reduce_loss):
    full, target = _inputs()
    x = full.clone().requires_grad_()
    loss = parallel_cross_entropy(x, target, 0.0, reduce_loss, None, -100, False, 1e-2)
    upstream = None if reduce_loss else torch.randn(target.shape)
    kw = dict(z_loss=1e-2, reduction="mean" if reduce_loss else "none")
    ref_loss, ref_grad = full_vocab_loss_and_grad(full, target, upstream, **kw)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-6, rtol=1e-5)
    without = parallel_cross_entropy(full, target, 0.0, reduce_loss)
    assert (loss.detach() - without).abs().max() > 1e-3  # the weight does count here


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
def test_z_loss_weight_checked(bad):
    full, target = _inputs()
    with pytest.raises(ValueError, match="z_loss_weight"):
        parallel_cross_entropy(full, target, z_loss_weight=bad)


@pytest.mark.parametrize("overwrite_input", [False, True])
@pytest.mark.parametrize("reduce_loss", [False, True])
def test_return_log_sum_exp(impl, reduce_loss, overwrite_input):
    """(loss, lse): the loss as without it; the fp32 full-vocabulary lse per token, 0 for ignored
    tokens, not differentiable."""
    full, target = _inputs(torch.bfloat16, transposed=True)
    x = full.clone().requires_grad_()
    y = x * 1
    out = parallel_cross_entropy(y, target, 0.1, reduce_loss, None, -100, False, 1e-3,
                                 overwrite_input=overwrite_input, return_log_sum_exp=True)
    assert isinstance(out, tuple) and len(out) == 2
    loss, lse = out
    kw = dict(label_smoothing=0.1, z_loss=1e-3, reduction="mean" if reduce_loss else "none")
    upstream = None if reduce_loss else torch.randn(target.shape)
    ref_loss, ref_grad = full_vocab_loss_and_grad(full, target, upstream, **kw)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-4, rtol=1e-4)
    kept = target != -100
    ref_lse = torch.where(kept, torch.logsumexp(full.double(), -1), 0.0)
    assert lse.dtype == torch.float32 and lse.shape == target.shape and not lse.requires_grad
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(lse[~kept] == 0)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    torch.testing.assert_close(grad.double(), ref_grad, atol=8e-3, rtol=1.6e-2)


def test_megatron_tp_group_positional():
    full, target = _inputs(transposed=True)
    target = target.clamp(min=0)  # megatron-core has no ignore index
    got = vocab_parallel_cross_entropy(full, target, 0.1, None)  # tp_group=None: no TP here
    ref_loss, _ = full_vocab_loss_and_grad(full, target, None, label_smoothing=0.1)
    torch.testing.assert_close(got.double(), ref_loss, atol=1e-5, rtol=1e-5)
