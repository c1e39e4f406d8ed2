"""``batch_invariant=True`` on the CPU, each backend on its own (the Triton kernels under
TRITON_INTERPRET=1, the PyTorch one): a block of tokens gets the same output bits alone and
inside batches of other sizes, at other positions and under the memory budgets of every
strategy (``tests/_invariance.py``), for the three ops, fp32 and bf16. The Triton runs also take
the GPU's rule for the forward's vocabulary splits (``split=0``: chosen from the rows by
default). Tensor parallelism: ``test_batch_invariant_distributed.py``; real sizes on a GPU:
``test_batch_invariant_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from tests._invariance import OPS, block_case, check_block, weights
from vocab_parallel_loss import (VocabParallelLinearCrossEntropy, linear_cross_entropy,
                                 linear_token_logprobs, token_logprobs)
from vocab_parallel_loss.kernels import linear as K
from vocab_parallel_loss.verl import linear_cross_entropy as verl_linear_cross_entropy
from vocab_parallel_loss.verl import output_processor

H, V, BLOCK = 24, 301, 5  # odd sizes: partial tiles, rows and vocabulary splits


@pytest.fixture(params=["interpreter", "split=0"])
def tiles(request, impl, monkeypatch):
    """The interpreter's tile config, and that config with the forward's splits chosen by the
    GPU's rule from the rows (``_forward_splits``; 2 "multiprocessors" on the CPU)."""
    if request.param == "split=0":
        if impl != "triton":
            pytest.skip("the PyTorch backend has no vocabulary splits")
        monkeypatch.setattr(K.config, "OVERRIDE_CONFIG", K.INTERPRET_CONFIG.replace(split=0))
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_a_block_gets_the_same_bits_in_any_batch(op, dtype, impl, tiles):
    c, b = weights(H, V, dtype, "cpu")
    block = block_case(BLOCK, V if op == "token_logprobs" else H, V, dtype, "cpu")
    seen = check_block(op, block, c, b, impl=impl)
    if impl == "triton" and op != "token_logprobs":  # every strategy a budget picks was run
        # (with split=0 one split spans this vocabulary: saving part of it is not a strategy)
        assert {"saved", "recompute"} | ({"partial"} if tiles == "interpreter" else set()) \
            <= seen, seen


@pytest.mark.parametrize("op", ["linear_token_logprobs", "linear_cross_entropy"])
def test_an_fp32_head_gets_the_same_bits_in_any_batch(op, impl):
    """An fp32 head (fp32 weight, bf16 hidden states: the weight split into fp16 parts in the
    kernels) is batch-invariant too, at every strategy (its tiles are fp32)."""
    c, b = weights(H, V, torch.float32, "cpu")
    block = block_case(BLOCK, H, V, torch.bfloat16, "cpu")
    seen = check_block(op, block, c, b, impl=impl)
    if impl == "triton":
        assert {"saved", "recompute"} <= seen, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lse_of_a_mean_loss_under_every_strategy(dtype, impl):
    # a scalar loss adds the gradients-in-forward strategy; its lse is per token
    c, b = weights(H, V, dtype, "cpu")
    block = block_case(BLOCK, H, V, dtype, "cpu")
    seen = check_block("linear_cross_entropy", block, c, b, layouts=((0, 0), (3, 40)),
                       impl=impl, reduction="mean")
    if impl == "triton":
        assert "grad_in_forward" in seen, seen


@pytest.mark.parametrize("op", OPS)
def test_a_lone_row_of_a_wide_vocabulary(op, impl):
    # PyTorch's CPU reductions split a lone row of 32768 elements or more over threads (another
    # order than a row among others); the PyTorch backend's fixed blocks never reduce one row
    if impl == "triton" and op != "token_logprobs":
        pytest.skip("the fused linear kernels take minutes in the interpreter at this width")
    v, h = 33001, 8
    for seed in range(4):  # (the default path's lone row differs at seed 3 for the loss)
        c, b = weights(h, v, torch.float32, "cpu", seed=seed + 1)
        block = block_case(1, v if op == "token_logprobs" else h, v, torch.float32, "cpu",
                           seed=seed)
        check_block(op, block, c, b, layouts=((0, 0), (2, 0)), impl=impl)


def test_the_logits_gradient_of_a_row_is_invariant(impl):
    # token_logprobs' backward is per row: a row's gradient is the same bits in any batch
    dtype = torch.float32
    logits, t, temp = block_case(BLOCK, V, V, dtype, "cpu")
    others, ot, otemp = block_case(30, V, V, dtype, "cpu", seed=3)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(BLOCK, generator=g), torch.randn(BLOCK, generator=g)
    og_lp, og_ent = torch.randn(30, generator=g), torch.randn(30, generator=g)

    def grad(x, tt, tmp, a, b):
        x = x.detach().clone().requires_grad_()
        out = token_logprobs(x, tt, temperature=tmp, return_entropy=True, batch_invariant=True)
        (out.log_probs * a + out.entropy * b).sum().backward()
        return x.grad

    want = grad(logits, t, temp, g_lp, g_ent)
    cat = lambda x, y: torch.cat([y[:7], x, y[7:]])  # noqa: E731
    got = grad(cat(logits, others), cat(t, ot), cat(temp, otemp), cat(g_lp, og_lp),
               cat(g_ent, og_ent))
    assert torch.equal(want, got[7:7 + BLOCK])


def test_every_front_end_takes_the_flag(impl):
    # the module and both verl drop-ins pass batch_invariant through
    c, b = weights(H, V, torch.float32, "cpu")
    e, t, _ = block_case(BLOCK, H, V, torch.float32, "cpu")
    t = t.clamp(min=0)
    mod = VocabParallelLinearCrossEntropy(reduction="none", impl=impl, batch_invariant=True)
    assert "batch_invariant=True" in repr(mod)
    want = linear_cross_entropy(e, c, t, reduction="none", impl=impl, batch_invariant=True)
    assert torch.equal(mod(e, c, t), want)
    lp, ent = verl_linear_cross_entropy(e, c, t, 1.0, "none", batch_invariant=True)
    out = linear_token_logprobs(e, c, t, return_entropy=True, ignore_index=-(2**63),
                                batch_invariant=True)
    assert torch.equal(lp, out.log_probs) and torch.equal(ent, out.entropy)


def test_the_megatron_output_processor_passes_the_flag(monkeypatch):
    from types import SimpleNamespace

    from vocab_parallel_loss.verl import _megatron

    seen = {}

    def fake(hidden, weight, target, bias, **kw):
        seen.update(kw)
        z = torch.zeros(target.shape)
        return SimpleNamespace(log_probs=z, entropy=z)

    monkeypatch.setattr(_megatron, "linear_token_logprobs", fake)
    call = dict(hidden_states=torch.zeros(5, 2, 4),
                output_layer=SimpleNamespace(weight=torch.zeros(7, 4), tp_group="tp"),
                labels=torch.zeros(2, 5, dtype=torch.long))
    output_processor(**call)
    assert seen["batch_invariant"] is False
    output_processor(context={"batch_invariant": True}, **call)
    assert seen["batch_invariant"] is True


@pytest.mark.parametrize("value", [1, None, "yes", torch.tensor(True)])
def test_batch_invariant_must_be_a_bool(value):
    c, b = weights(H, V, torch.float32, "cpu")
    e, t, _ = block_case(BLOCK, H, V, torch.float32, "cpu")
    calls = [
        lambda: token_logprobs(e @ c.t(), t, batch_invariant=value),
        lambda: linear_token_logprobs(e, c, t, batch_invariant=value),
        lambda: linear_cross_entropy(e, c, t, batch_invariant=value),
        lambda: VocabParallelLinearCrossEntropy(batch_invariant=value),
        lambda: verl_linear_cross_entropy(e, c, t.clamp(min=0), batch_invariant=value),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="batch_invariant"):
            call()
