"""torchrun worker: fused linear cross entropy on vocabulary shards vs the full-vocab fp64 oracle.

    torchrun --nproc-per-node N tests/linear_cross_entropy/_distributed_worker.py

Every rank builds the same full ``e``, ``c``, bias and targets (fixed seed), keeps its rows of
``c`` (and, with sequence parallelism, its slice of ``e``'s first dim) and checks: the loss is
the full-vocabulary loss and bitwise the same on every rank; ``dC`` (and dbias) is its slice of
the full gradient; ``dE`` is the full gradient (or its sequence slice). Exits non-zero on the
first mismatch; prints ``N linear cases passed on W ranks`` (``run_checks`` in
tests/_torchrun.py: rank 0 writes each case's outcome as JSON when launched by the tests).

gloo on CPU by default. ``VPL_TEST_DEVICE=cuda`` runs it on GPUs over nccl (one GPU per rank,
``LOCAL_RANK``; ``benchmarks/run_multigpu.sh`` does this), ``VPL_TEST_DEVICE=cuda:0`` with every
rank on GPU 0 over gloo (the GPU tests): the inputs are still built on the CPU with the same seed
and moved to the GPU, and the fp64 reference is computed on the CPU.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests._torchrun import (compiled_collectives_run, end_worker, init_worker_process_group,
                             run_checks)

from tests._budgets import device_columns, narrow_chunk_config, one_saved_tile_budget
from tests._linear_oracle import reference_grads
from vocab_parallel_loss import linear_cross_entropy, settings
from vocab_parallel_loss.ops.fused_linear import strategy as strategy_mod
from vocab_parallel_loss.ops.linear_cross_entropy import masked as masked_mod
from vocab_parallel_loss.kernels import linear as K

DEVICE = torch.device("cpu")  # main() sets the rank's GPU under VPL_TEST_DEVICE=cuda[:N]


def init_process_group() -> None:
    global DEVICE
    DEVICE = init_worker_process_group()


def gif_config() -> "K.LCEConfig":
    """Gradients formed in forward, in several row chunks even on the tiny shapes."""
    if DEVICE.type == "cuda" and not settings.interpreting():
        return K.default_config(DEVICE).replace(strategy="grad_in_forward", gif_rows=16)
    return K.INTERPRET_CONFIG.replace(strategy="grad_in_forward")


def same_on_every_rank(t: torch.Tensor) -> None:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    for g in gathered:
        assert torch.equal(torch.nan_to_num(g, 7.0), torch.nan_to_num(t, 7.0)), "ranks disagree"


def close(name, got, want, rtol):
    scale = want.abs().max().item() or 1.0
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= rtol * scale + 1e-9, f"{name}: max err {err:.3g}, scale {scale:.3g}"


def check_case(*, impl, dtype=torch.float32, reduction="mean", smoothing=0.0, z_loss=0.0,
               softcap=None, bias=False, shift=0, sp=False, gif=False, budget=None, v_local=23,
               h=24, s=8, b=4, padded=False, masked=None):
    """``masked``: the per-token loss given a loss mask, its upstream gradient ``"scaled"`` (k
    times the mask: Triton uses the gradients formed in forward) or ``"other"`` (the exact
    fallback)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    K.config.OVERRIDE_CONFIG = gif_config() if gif else None
    v_local = device_columns(K, v_local, DEVICE)
    if budget == "one-tile":
        K.config.OVERRIDE_CONFIG = narrow_chunk_config(K, DEVICE)
    assert (K.default_config(DEVICE).strategy == "grad_in_forward") == gif
    v = v_local * world
    gen = torch.Generator().manual_seed(1234)
    # sequence parallel: Megatron's output-layer input [s, b, h], the sequence (and the shift)
    # along dim 0; else [b, s, h], the shift along dim -2
    lead = (s, b) if sp else (b, s)
    e_full = torch.randn(*lead, h, generator=gen).to(dtype)
    c_full = torch.randn(v, h, generator=gen).to(dtype)
    bias_full = torch.randn(v, generator=gen).to(dtype) if bias else None
    t = torch.randint(0, v, lead, generator=gen)
    if padded:  # the last rank's shard is vocabulary padding: -inf logits, never a target
        bias_full[v - v_local:] = float("-inf")
        t = t % (v - v_local)
    t[torch.rand(lead, generator=gen) < 0.2] = -100
    up = torch.randn(lead, generator=gen)
    up = up[shift:] if sp else up[..., shift:]
    mask = (torch.rand(lead, generator=gen) > 0.3).float()
    if masked == "scaled":
        up = 0.37 * (mask[shift:] if sp else mask[..., shift:])

    rows = slice(rank * v_local, (rank + 1) * v_local)
    seq = slice(rank * lead[0] // world, (rank + 1) * lead[0] // world)
    e = (e_full[seq] if sp else e_full).to(DEVICE, copy=True).requires_grad_()
    c = c_full[rows].to(DEVICE, copy=True).requires_grad_()
    bb = bias_full[rows].to(DEVICE, copy=True).requires_grad_() if bias else None
    kw = dict(reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap,
              shift=shift)
    if budget == "one-tile":  # the first logits tile saved, the rest recomputed
        cfg = K.default_config(DEVICE)
        budget = one_saved_tile_budget(K, s * b, h, v_local, e.element_size(), cfg,
                                       sequence_parallel=sp and dist.get_world_size() > 1)
        picked = strategy_mod.choose_strategy(K, e, c, None, reduction, sp, dist.group.WORLD, softcap,
                                        smoothing, budget)
        assert impl != "triton" or picked[:3] == ("saved", None, cfg.fwd_block_v), picked
    taken, scale = [], masked_mod.upstream_scale

    def spied(*a, **k):
        k_, ok = scale(*a, **k)
        taken.append(bool(ok))
        return k_, ok

    masked_mod.upstream_scale = spied
    try:
        loss = linear_cross_entropy(e, c, t.to(DEVICE), bb, tp_group=dist.group.WORLD,
                                    sequence_parallel=sp, impl=impl, memory_budget=budget,
                                    loss_mask=mask.to(DEVICE) if masked else None, **kw)
        g = up if reduction == "none" else torch.ones(())
        leaves = [e, c] + ([bb] if bias else [])
        grads = torch.autograd.grad(loss, leaves, g.to(DEVICE, loss.dtype))
    finally:
        masked_mod.upstream_scale = scale
    if masked and impl == "triton":
        assert taken == [masked == "scaled"], taken
    else:
        assert not taken, taken

    if sp:  # the oracle shifts along dim -2: give it [b, s, h], then transpose back
        want, wgrads = reference_grads(e_full.transpose(0, 1), c_full, t.t(), bias_full,
                                       g.t() if g.dim() else g, **kw)
        want = want.t() if want.dim() else want
        wgrads = (wgrads[0].transpose(0, 1),) + tuple(wgrads[1:])
    else:
        want, wgrads = reference_grads(e_full, c_full, t, bias_full, g, **kw)
    same_on_every_rank(loss.detach())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.detach().double().cpu(), want, atol=tol * 10, rtol=tol)
    wde = wgrads[0][seq] if sp else wgrads[0]
    close("dE", grads[0], wde, tol)
    close("dC", grads[1], wgrads[1][rows], tol)
    if bias:
        close("dbias", grads[2], wgrads[2][rows], tol)
    assert grads[0].dtype == dtype and grads[1].dtype == dtype


CASES = [
    dict(reduction="mean", smoothing=0.1),  # label smoothing must use the GLOBAL V and sum
    dict(reduction="none", softcap=4.0, bias=True, z_loss=1e-3),
    dict(reduction="sum", shift=1, smoothing=0.1),
    dict(reduction="mean", sp=True, smoothing=0.1, bias=True),
    dict(reduction="none", sp=True, softcap=3.0),
    dict(reduction="mean", sp=True, shift=1),
    dict(reduction="none", sp=True, shift=2, bias=True),  # [s - 2, b] per-token losses
    dict(reduction="mean", dtype=torch.bfloat16, smoothing=0.1, sp=True),
    # the default budget saves the logits tiles; 0 recomputes them in backward
    dict(reduction="none", softcap=4.0, bias=True, z_loss=1e-3, budget=0),
    dict(reduction="mean", sp=True, smoothing=0.1, bias=True, budget=0),
    dict(reduction="none", sp=True, shift=2, bias=True, budget=0),
    dict(reduction="none", sp=True, bias=True, budget="one-tile", v_local=95, h=8),
    dict(reduction="mean", smoothing=0.1, budget="one-tile", v_local=95, h=8),
    # a padded vocabulary: the last rank's logits all -inf, saved or recomputed
    dict(reduction="none", bias=True, padded=True),
    dict(reduction="mean", bias=True, padded=True, budget=0, sp=True),
    # gradients formed in forward: one stats all-gather per row chunk
    dict(reduction="mean", gif=True, smoothing=0.1, bias=True, z_loss=1e-3),
    dict(reduction="sum", gif=True, sp=True, softcap=3.0, shift=1),
    # per-token losses given their loss mask (Triton forms the gradients in forward); the
    # PyTorch backend recomputes
    dict(reduction="none", gif=True, masked="scaled", sp=True, shift=1, bias=True),
    dict(reduction="none", gif=True, masked="other", sp=True, smoothing=0.1),
    dict(reduction="none", gif=True, masked="scaled", softcap=3.0, dtype=torch.bfloat16),
]


def check_reused_group(*, impl):
    """One group, call after call with other sequence lengths and vocabulary shards (sequence
    parallel, then not): each call's loss and gradients against the oracle."""
    for s, v_local, sp in ((8, 23, True), (4, 17, True), (8, 23, True), (6, 17, False)):
        check_case(impl=impl, reduction="none", sp=sp, shift=1, s=s, v_local=v_local)


def check_compiled_unequal_sequence_shards(*, impl):
    """torch.compile traces the backward before anything runs: a rank holding one more row of
    ``e`` than the targets give it must not fail there alone (the others would wait in the
    gather). Every rank raises on a new group, NaN on a rank that verified its shapes before."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(77)
    c = torch.randn(5, 8, generator=gen).to(DEVICE).requires_grad_()

    def outcome(rows):
        e = torch.randn(rows, 2, 8, generator=gen).to(DEVICE).requires_grad_()
        t = torch.randint(0, 5 * world, (2 * world, 2), generator=gen).to(DEVICE)
        torch._dynamo.reset()
        f = torch.compile(lambda e, c, t: linear_cross_entropy(
            e, c, t, tp_group=group, sequence_parallel=True, impl=impl, reduction="none",
            shift=1), backend="aot_eager")
        try:
            loss = f(e, c, t)
        except ValueError as ex:
            assert "sequence_parallel=True" in str(ex), ex
            return "raised"
        return "nan" if bool(torch.isnan(loss).all()) else "value"

    unequal = 2 + (rank == 1)
    for rows, want in ((unequal, ["raised"] * world), (2, ["value"] * world),
                       (unequal, ["raised" if r == 1 else "nan" for r in range(world)])):
        got = [None] * world
        dist.all_gather_object(got, outcome(rows))
        assert got == want, f"rows {rows}: outcomes per rank {got}, expected {want}"


def check_frozen_hidden_states_budget(*, impl):
    """Frozen hidden states under TP (a trained head over a frozen trunk): backward forms no dE,
    so no fp32 dE is all-reduced, and a budget of exactly the saved tiles saves them all; with
    trainable hidden states the same budget cannot (the fp32 dE is the all-reduce's operand).
    dC against the oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    K.config.OVERRIDE_CONFIG = None
    gen = torch.Generator().manual_seed(99)
    v_local = device_columns(K, 23, DEVICE)
    e_full = torch.randn(4, 8, 16, generator=gen)
    c_full = torch.randn(v_local * world, 16, generator=gen)
    t = torch.randint(0, v_local * world, (4, 8), generator=gen)
    rows = slice(rank * v_local, (rank + 1) * v_local)
    e = e_full.to(DEVICE)
    c = c_full[rows].to(DEVICE, copy=True).requires_grad_()
    budget = K.saved_bytes(t.numel(), v_local, 4, K.default_config(DEVICE))  # every row's tiles

    def pick(e_):
        return strategy_mod.choose_strategy(K, e_, c, None, "mean", False, dist.group.WORLD,
                                            None, 0.0, budget)[:3]

    if impl == "triton":
        assert pick(e) == ("saved", None, None), pick(e)
        assert pick(e.clone().requires_grad_()) != ("saved", None, None)
    loss = linear_cross_entropy(e, c, t.to(DEVICE), tp_group=dist.group.WORLD, impl=impl,
                                memory_budget=budget)
    (dc,) = torch.autograd.grad(loss, [c])
    want, wgrads = reference_grads(e_full, c_full, t)
    torch.testing.assert_close(loss.detach().double().cpu(), want, atol=2e-4, rtol=2e-5)
    close("dC", dc, wgrads[1][rows], 2e-5)


def case_name(impl, case) -> str:
    return impl + "/" + ",".join(f"{k}={getattr(v, '__name__', v)}".replace("torch.", "")
                                 for k, v in case.items())


def main() -> int:
    init_process_group()
    torch.manual_seed(0)
    impls = sys.argv[1:] or ["triton", "torch"]
    cases = [(case_name(impl, case), lambda impl=impl, case=case: check_case(impl=impl, **case))
             for impl in impls for case in CASES
             if impl == "triton" or not case.get("gif") or case.get("masked")]
    cases += [(f"{impl}/reused group", lambda impl=impl: check_reused_group(impl=impl))
              for impl in impls]
    cases += [(f"{impl}/frozen hidden states budget",
               lambda impl=impl: check_frozen_hidden_states_budget(impl=impl)) for impl in impls]
    # dynamo traces the PyTorch backend (the Triton one is a graph break)
    if "torch" in impls and compiled_collectives_run(DEVICE):
        cases.append(("torch/compiled unequal sequence shards",
                      lambda: check_compiled_unequal_sequence_shards(impl="torch")))
    run_checks(cases, summary="linear cases passed")
    dist.barrier()
    end_worker()  # no interpreter finalization: see tests/_torchrun.py
    return 0

if __name__ == "__main__":
    sys.exit(main())
