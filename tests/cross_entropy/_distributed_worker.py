"""torchrun worker: every API on vocabulary shards vs the full-vocabulary fp64 reference.

Each rank builds the same full logits (fixed seed), keeps its shard of columns and checks that
its loss equals the full-vocabulary loss, is bitwise the same on every rank, and that its
gradient equals its slice of the full gradient. Exits non-zero on the first mismatch
(``run_checks`` in tests/_torchrun.py: rank 0 writes each case's outcome as JSON when launched
by the tests).

gloo on CPU by default. ``VPL_TEST_DEVICE=cuda`` runs it on GPUs over nccl (one GPU per rank,
``LOCAL_RANK``; ``benchmarks/run_multigpu.sh`` does this), ``VPL_TEST_DEVICE=cuda:0`` with every
rank on GPU 0 over gloo (the GPU tests): the inputs are still built on the CPU with the same seed
and moved to the GPU, and the fp64 reference is computed on the CPU.
"""

from __future__ import annotations

import importlib
import itertools
import sys

import torch
import torch.distributed as dist

from tests._oracle import full_vocab_loss, full_vocab_loss_and_grad
from tests._torchrun import end_worker, init_worker_process_group, run_checks
from tests.cross_entropy._unequal_shards_worker import unequal_shard_checks
from vocab_parallel_loss import (VocabParallelCrossEntropy, backends, parallel_cross_entropy,
                                 vocab_parallel_cross_entropy)

ce_mod = importlib.import_module("vocab_parallel_loss.ops.cross_entropy.function")

DEVICE = torch.device("cpu")  # main() sets the rank's GPU under VPL_TEST_DEVICE=cuda[:N]


def init_process_group() -> None:
    global DEVICE
    DEVICE = init_worker_process_group()


def same_on_every_rank(t: torch.Tensor, group) -> None:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t.contiguous(), group=group)
    for g in gathered:
        assert torch.equal(torch.nan_to_num(g, 7.0), torch.nan_to_num(t, 7.0)), "ranks disagree"


def shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    v = full.shape[-1] // world
    return full[..., rank * v:(rank + 1) * v]


def check_case(group, *, api, layout, dtype, reduction, smoothing, z_loss, v_local=23):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    s, b, v = 5, 3, v_local * world
    gen = torch.Generator().manual_seed(1234)
    full = (torch.randn(b, s, v, generator=gen) * 3).to(dtype)
    target = torch.randint(0, v, (b, s), generator=gen)
    target[torch.rand(b, s, generator=gen) < 0.2] = -100
    upstream = torch.randn(b, s, generator=gen)
    if layout == "sbv":  # Megatron's [s, b, v]: a transposed view, sharded along v
        full, target, upstream = full.transpose(0, 1), target.t(), upstream.t()
    # moved before sharding: the shard is the same strided view on either device
    x = shard(full.to(DEVICE), rank, world).detach().requires_grad_()
    target_d, upstream_d = target.to(DEVICE), upstream.to(DEVICE)
    kw = dict(label_smoothing=smoothing)
    if api == "module":
        loss = VocabParallelCrossEntropy(group, reduction=reduction, z_loss=z_loss, **kw)(x, target_d)
    elif api == "module_inplace":  # the gradient overwrites the (non-leaf) logits buffer
        y = x * 1
        loss = VocabParallelCrossEntropy(group, reduction=reduction, z_loss=z_loss,
                                         inplace_backward=True, **kw)(y, target_d)
    elif api == "transformer_engine":  # with the z-loss and the lse of TransformerEngine's PRs
        loss, lse = parallel_cross_entropy(x, target_d, smoothing, reduction == "mean", group,
                                           -100, False, z_loss, return_log_sum_exp=True)
        ref_lse = torch.logsumexp(full.double(), -1) * (target != -100)
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-5, rtol=1e-5)
        same_on_every_rank(lse, group)
    elif api == "transformer_engine_overwrite":  # the gradient written over the logits
        y = x * 1
        loss = parallel_cross_entropy(y, target_d, smoothing, reduction == "mean", group,
                                      overwrite_input=True)
        assert torch.equal(y.detach(), x.detach()), "logits overwritten before backward"
    else:  # tp_group positional, as megatron-core main takes it
        loss = vocab_parallel_cross_entropy(x, target_d, smoothing, group)
    ref_kw = dict(label_smoothing=smoothing, z_loss=z_loss, reduction=reduction)
    ref_loss, ref_grad = full_vocab_loss_and_grad(full, target, upstream if reduction == "none" else None, **ref_kw)
    (grad,) = torch.autograd.grad(loss, x, upstream_d if reduction == "none" else None)
    tol = 1e-5 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(loss.double().cpu(), ref_loss, atol=tol, rtol=tol)
    gtol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(grad.double().cpu(), shard(ref_grad, rank, world), atol=gtol,
                               rtol=2 * gtol)
    same_on_every_rank(loss.detach(), group)


def check_input_domain(group):
    """Narrow integer targets, float64 logits, logits near a large offset and near fp32's
    limit with label smoothing (the merge of the shards' sums of logits)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v = 80 * world  # at least 160 columns: the uint8 target 156 (-100 in 8 bits) is a class
    gen = torch.Generator().manual_seed(5)
    target = torch.randint(0, min(v, 256), (6,), generator=gen)
    target[0] = 156
    fn = VocabParallelCrossEntropy(group, label_smoothing=0.1, reduction="mean")
    full = torch.randn(6, v, generator=gen, dtype=torch.float64) * 3
    for dtype, tdtype in [(torch.float32, torch.uint8), (torch.float64, torch.int16)]:
        x = shard(full.to(dtype).to(DEVICE), rank, world).requires_grad_()
        loss = fn(x, target.to(tdtype).to(DEVICE))
        (grad,) = torch.autograd.grad(loss, x)
        ref_loss, ref_grad = full_vocab_loss_and_grad(full.to(dtype), target,
                                                      label_smoothing=0.1, reduction="mean")
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(loss.double().cpu(), ref_loss, atol=tol, rtol=tol)
        torch.testing.assert_close(grad.double().cpu(), shard(ref_grad, rank, world),
                                   atol=tol / 5, rtol=tol)
        same_on_every_rank(loss.detach(), group)
    # near 2e38 with finite differences (test_input_domain.near_fp32_limit), a -inf in row 2
    near_limit = 2e38 + torch.arange(v) % 7 * 1e35
    near_limit = near_limit.repeat(3, 1).float()
    near_limit[:, 0], near_limit[2, 1] = 1.9e38, float("-inf")
    for full32, rtol in [(full.float() + 1e4, 8 * torch.finfo(torch.float32).eps),
                         (near_limit, 1e-6)]:
        n = full32.shape[0]
        loss = VocabParallelCrossEntropy(group, label_smoothing=0.1)(
            shard(full32.to(DEVICE), rank, world), target[:n].to(DEVICE))
        ref = full_vocab_loss(full32, target[:n], label_smoothing=0.1)
        torch.testing.assert_close(loss.double().cpu(), ref, atol=0, rtol=rtol)


def check_masked_and_offset(group):
    """A masked vocabulary (-inf columns, and one rank's whole shard -inf in some rows) and
    logits near a large offset: the gradient from the merged lse and its low part, as precise
    as the loss (a softmax from the fp32-rounded lse would be 5e-4 off of itself)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v_local, rows = 19, 6
    v = v_local * world
    gen = torch.Generator().manual_seed(8)
    target = torch.randint(0, v - v_local, (rows,), generator=gen)  # never in the last shard
    target[4] = -100
    masked = torch.randn(rows, v, generator=gen) * 2
    masked[torch.rand(rows, v, generator=gen) < 0.3] = float("-inf")
    masked[:3, v - v_local:] = float("-inf")  # the last rank's whole shard, rows 0-2
    masked[torch.arange(rows), target.clamp(min=0)] = 1.0  # the targets stay finite
    offset = torch.randn(rows, v, generator=gen) * 2 + 1e4  # exact fp32 values near 1e4
    for full, smoothing in ((masked, 0.0), (offset, 0.0), (offset, 0.1)):
        for reduction in ("none", "mean"):
            x = shard(full.to(DEVICE), rank, world).clone().requires_grad_()
            loss = VocabParallelCrossEntropy(group, reduction=reduction,
                                             label_smoothing=smoothing)(x, target.to(DEVICE))
            upstream = torch.rand(loss.shape, generator=gen) + 0.5
            (grad,) = torch.autograd.grad(loss, x, upstream.to(DEVICE))
            ref_loss, ref_grad = full_vocab_loss_and_grad(full, target, upstream,
                                                          label_smoothing=smoothing,
                                                          reduction=reduction)
            torch.testing.assert_close(loss.double().cpu(), ref_loss, atol=1e-5, rtol=1e-5)
            mine = shard(ref_grad, rank, world)
            assert torch.isfinite(grad).all()
            assert torch.all(grad.cpu()[mine == 0] == 0)  # masked columns, ignored rows
            # a few fp32 roundings of each entry (the old lse-rounded softmax: 5e-4 of it)
            torch.testing.assert_close(grad.double().cpu(), mine, rtol=2e-5, atol=1e-8)
            same_on_every_rank(loss.detach(), group)


def check_against_megatron(group, world):
    """Our drop-in vs megatron-core's own vocab_parallel_cross_entropy (no smoothing)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        rank = parallel_state.get_tensor_model_parallel_rank()
        gen = torch.Generator().manual_seed(99)
        full = torch.randn(7, 2, 19 * world, generator=gen) * 2
        target = torch.randint(0, 19 * world, (7, 2), generator=gen)
        upstream = torch.randn(7, 2, generator=gen)
        full, target, upstream = full.to(DEVICE), target.to(DEVICE), upstream.to(DEVICE)
        mine = shard(full, rank, world).clone().requires_grad_()
        theirs = shard(full, rank, world).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target)  # tp_group from parallel_state
        ref = tensor_parallel.vocab_parallel_cross_entropy(theirs * 1.0, target)
        torch.testing.assert_close(loss, ref.float(), atol=1e-5, rtol=1e-5)
        g_mine, = torch.autograd.grad(loss, mine, upstream)
        g_ref, = torch.autograd.grad(ref, theirs, upstream)
        torch.testing.assert_close(g_mine, g_ref, atol=1e-6, rtol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


def check_unequal_shards(group):
    rank = dist.get_rank(group)
    x = torch.randn(2, 3, 10 + rank).to(DEVICE)
    try:
        parallel_cross_entropy(x, torch.zeros(2, 3, dtype=torch.long, device=DEVICE),
                               dist_process_group=group)
    except ValueError as e:
        assert "vocab shards differ" in str(e), e
    else:
        raise AssertionError("unequal shards were not rejected")


def check_compiled(group):
    """torch.compile over the TP loss: no graph break (fullgraph) and the eager result."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(3, 4, 17 * world, generator=gen)
    target = torch.randint(0, 17 * world, (3, 4), generator=gen)
    loss_fn = VocabParallelCrossEntropy(group, label_smoothing=0.1, reduction="mean")
    x = shard(full, rank, world).to(DEVICE).requires_grad_()
    target = target.to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, t: loss_fn(x, t), fullgraph=True, backend="aot_eager")
    loss = compiled(x, target)
    (grad,) = torch.autograd.grad(loss, x)
    ref_loss, ref_grad = full_vocab_loss_and_grad(full, target.cpu(), label_smoothing=0.1,
                                                  reduction="mean")
    torch.testing.assert_close(loss.double().cpu(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double().cpu(), shard(ref_grad, rank, world), atol=2e-6,
                               rtol=1e-5)
    # the functional API with a group the package has not seen before tracing
    sub = dist.new_group(list(range(world)))
    fn = torch.compile(lambda x, t: parallel_cross_entropy(x, t, 0.1, True, sub), fullgraph=True,
                       backend="aot_eager")
    torch.testing.assert_close(fn(x, target).double().cpu(), ref_loss, atol=1e-5, rtol=1e-5)


def checks(group, world, impls):
    """(name, check) of every case, both backends in turn (the backend is set as a check runs)."""

    def on(impl, check, *args, **kw):
        def run():
            backends.triton_runs = (lambda t: True) if impl == "triton" else (lambda t: False)
            ce_mod._plans.clear()
            check(*args, **kw)
        return run

    for impl in impls:
        for api, reductions in [("module", ["none", "mean", "sum"]),
                                ("module_inplace", ["none", "mean"]),
                                ("transformer_engine", ["none", "mean"]),
                                ("transformer_engine_overwrite", ["mean"]),
                                ("megatron", ["none"])]:
            with_z = api in ("module", "transformer_engine")
            for reduction in reductions:
                for layout in ["bsv", "sbv"]:
                    for smoothing, z_loss in [(0.0, 0.0), (0.1, 1e-3 if with_z else 0.0)]:
                        yield (f"{impl}/{api}/{reduction}/{layout}/ls{smoothing}/z{z_loss}",
                               on(impl, check_case, group, api=api, layout=layout,
                                  dtype=torch.float32, reduction=reduction, smoothing=smoothing,
                                  z_loss=z_loss))
        yield (f"{impl}/module/bf16", on(impl, check_case, group, api="module", layout="sbv",
                                         dtype=torch.bfloat16, reduction="none", smoothing=0.1,
                                         z_loss=0.0))
        yield f"{impl}/against_megatron", on(impl, check_against_megatron, group, world)
        yield f"{impl}/input_domain", on(impl, check_input_domain, group)
        yield f"{impl}/masked_and_offset", on(impl, check_masked_and_offset, group)
    yield "compiled", lambda: check_compiled(group)
    if world > 1:  # one rank has nothing to compare its shard with
        yield "unequal_shards", lambda: check_unequal_shards(group)


def main() -> None:
    init_process_group()
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    impls = sys.argv[1].split(",") if len(sys.argv) > 1 else ["triton", "torch"]
    cases = checks(group, world, impls)
    if "--unequal-shards" in sys.argv:  # one launch for both (each launch pays the imports)
        cases = itertools.chain(unequal_shard_checks(), cases)
    run_checks(cases)
    dist.barrier()  # no rank tears gloo down while another still sends
    end_worker()  # no interpreter finalization: see tests/_torchrun.py

if __name__ == "__main__":
    main()
