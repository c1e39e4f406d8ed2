"""torchrun worker: one TP group through a seeded random sequence of calls of the four ops.

    torchrun --nproc-per-node N tests/_group_sequence_worker.py SEED[,SEED...] CALLS IMPLS

Every rank draws the same sequence from ``SEED`` (a ``torch.Generator``, never the ranks'
own state): each call picks an op (``cross_entropy``, ``token_logprobs``,
``linear_cross_entropy``, ``linear_token_logprobs``), a backend, and shapes from small pools
(rows, shard width, hidden size), so that shapes recur and change: a rank's shape and range
checks see some as new and others as verified before. The log-prob ops take a ``vocab_range``
whose per-rank counts change from call to call (a rank may hold only padding); the linear ops
sometimes run sequence parallel. Each call's outputs must be bitwise the same on every rank and
the fp64 oracle's over the full vocabulary, its gradients this rank's slice of the oracle's.
Rank 0 writes each seed's outcome as JSON (``run_checks`` in tests/_torchrun.py).
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.distributed as dist

from tests._linear_oracle import reference_grads
from tests._logprobs_oracle import oracle
from tests._oracle import full_vocab_loss_and_grad
from tests._torchrun import end_worker, init_worker_process_group, run_checks
from tests.cross_entropy.test_properties import forced
from vocab_parallel_loss import (cross_entropy, linear_cross_entropy, linear_token_logprobs,
                                 token_logprobs)

DEVICE = torch.device("cpu")  # main() sets the rank's device under VPL_TEST_DEVICE
OPS = ("cross_entropy", "token_logprobs", "linear_cross_entropy", "linear_token_logprobs")
ROWS, WIDTHS, HIDDEN = (3, 4, 6), (5, 7, 12), (4, 8)


def same_on_every_rank(t):
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    assert all(torch.equal(torch.nan_to_num(g, 7.0), torch.nan_to_num(t, 7.0)) for g in got), \
        "ranks disagree"


def close(name, got, want, tol=2e-5):
    err = (got.double().cpu() - want).abs().max().item() if want.numel() else 0.0
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    assert err <= tol * scale, f"{name}: max err {err:.3g}, scale {scale:.3g}"


def pick(pool, g):
    return pool[int(torch.randint(0, len(pool), (), generator=g))]


def ranges(width, world, g):
    """Per rank ``(start, stop)``: counts of vocabulary ids from ``{0, 1, width - 1, width}``
    (at least one id in all) tiling ``[0, V)`` in rank order; the rest of each shard is padding.
    Few counts: a rank's range often recurs while another's changes."""
    counts = torch.tensor([0, 1, width - 1, width])[torch.randint(0, 4, (world,), generator=g)]
    if counts.sum() == 0:
        counts[-1] = 1
    stops = counts.cumsum(0).tolist()
    return [(stop - int(k), stop) for stop, k in zip(stops, counts)]


def call(op, impl, g, group):
    """One call of ``op`` on this rank's shard, against the oracle. Returns a short summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n, width, h = pick(ROWS, g), pick(WIDTHS, g), pick(HIDDEN, g)
    sp = op.startswith("linear") and bool(torch.randint(0, 2, (), generator=g))
    if sp:
        n = world * max(1, n // world)  # whole sequence shards
    ranged = op.endswith("logprobs") and bool(torch.randint(0, 4, (), generator=g))
    spans = (ranges(width, world, g) if ranged
             else [(r * width, (r + 1) * width) for r in range(world)])
    vocab = spans[-1][1]
    start, stop = spans[rank]
    z = torch.randn(n, world * width, generator=g, dtype=torch.float64) * 2
    e = torch.randn(n, h, generator=g, dtype=torch.float64)
    c = torch.randn(world * width, h, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    per_token = bool(torch.randint(0, 2, (), generator=g))
    temp = torch.rand(n, generator=g, dtype=torch.float64) + 0.5 if per_token else 0.8
    g_a, g_b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    # the full vocabulary: each rank's ids, in rank order (its padding columns left out)
    keep = torch.cat([torch.arange(r * width, r * width + (b - a)) for r, (a, b) in
                      enumerate(spans)])
    mine = slice(rank * width, (rank + 1) * width)
    valid = stop - start
    kw = dict(tp_group=group)
    if op.endswith("logprobs"):
        kw.update(temperature=temp.float().to(DEVICE) if per_token else temp,
                  return_entropy=True, return_argmax=True)
        if ranged:
            kw["vocab_range"] = (start, stop)
    if op == "cross_entropy":
        x = z[:, mine].float().to(DEVICE).requires_grad_()
        with forced(impl):
            loss = cross_entropy(x, t.to(DEVICE), reduction="none", **kw)
            (dx,) = torch.autograd.grad(loss, x, g_a.to(DEVICE))
        same_on_every_rank(loss)
        want, wgrad = full_vocab_loss_and_grad(z.float(), t, g_a)
        close("loss", loss, want)
        close("dlogits", dx, wgrad[:, mine])
    elif op == "token_logprobs":
        x = z[:, mine].float().to(DEVICE).requires_grad_()
        with forced(impl):
            out = token_logprobs(x, t.to(DEVICE), **kw)
            (dx,) = torch.autograd.grad((out.log_probs * g_a.to(DEVICE)).sum()
                                        + (out.entropy * g_b.to(DEVICE)).sum(), x)
        for y in out:
            same_on_every_rank(y)
        z64 = z.float().double()[:, keep].requires_grad_()
        lp, ent, am = oracle(z64, t, temp)
        (wgrad,) = torch.autograd.grad((lp * g_a.double()).sum() + (ent * g_b.double()).sum(),
                                       z64)
        close("log_probs", out.log_probs, lp.detach())
        close("entropy", out.entropy, ent.detach())
        assert torch.equal(out.argmax.cpu(), am), "argmax"
        close("dlogits", dx[:, :valid], wgrad[:, start:stop])
        assert torch.all(dx[:, valid:] == 0), "padding's gradient"
    else:
        rows = slice(rank * (n // world), (rank + 1) * (n // world)) if sp else slice(None)
        e_mine = e[rows].float().to(DEVICE).requires_grad_()
        c_mine = c[mine].float().to(DEVICE).requires_grad_()
        kw.update(sequence_parallel=sp, impl=impl)
        if op == "linear_cross_entropy":
            loss = linear_cross_entropy(e_mine, c_mine, t.to(DEVICE), reduction="none", **kw)
            de, dc = torch.autograd.grad(loss, (e_mine, c_mine), g_a.to(DEVICE))
            same_on_every_rank(loss)
            want, (wde, wdc) = reference_grads(e.float(), c.float(), t, upstream=g_a,
                                               reduction="none")
            close("loss", loss, want)
        else:
            out = linear_token_logprobs(e_mine, c_mine, t.to(DEVICE), **kw)
            de, dc = torch.autograd.grad((out.log_probs * g_a.to(DEVICE)).sum()
                                         + (out.entropy * g_b.to(DEVICE)).sum(),
                                         (e_mine, c_mine))
            for y in out:
                same_on_every_rank(y)
            e64 = e.float().double().requires_grad_()
            c64 = c.float().double()[keep].requires_grad_()
            lp, ent, am = oracle(e64 @ c64.t(), t, temp)
            wde, wdc_kept = torch.autograd.grad(
                (lp * g_a.double()).sum() + (ent * g_b.double()).sum(), (e64, c64))
            wdc = torch.zeros(world * width, h, dtype=torch.float64)
            wdc[keep] = wdc_kept
            close("log_probs", out.log_probs, lp.detach())
            close("entropy", out.entropy, ent.detach())
            assert torch.equal(out.argmax.cpu(), am), "argmax"
            assert torch.all(dc[valid:] == 0), "padding's gradient"
        close("dE", de, wde[rows], 1e-4)
        close("dC", dc, wdc[mine], 1e-4)
    return f"{op}/{impl} n={n} width={width} h={h} sp={sp} ranges={spans if ranged else None}"


def sequence(seed, calls, impls):
    """``calls`` calls drawn from ``seed`` on one new group; returns what was run."""
    group = dist.new_group(list(range(dist.get_world_size())))
    g = torch.Generator().manual_seed(seed)
    ran = []
    for i in range(calls):
        op, impl = pick(OPS, g), pick(impls, g)
        try:
            ran.append(call(op, impl, g, group))
        except AssertionError as ex:
            raise AssertionError(f"call {i} of seed {seed}: {ex}; before it: {ran[-3:]}") from ex
    kinds = Counter(r.split(" ")[0] for r in ran)
    return {"calls": len(ran), "kinds": dict(kinds)}


def main():
    global DEVICE
    DEVICE = init_worker_process_group()
    seeds, calls, impls = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    run_checks([(f"seed={s}", lambda s=int(s): sequence(s, calls, impls))
                for s in seeds.split(",")], summary="call sequences passed")
    dist.barrier()  # no rank tears gloo down while another still sends
    end_worker()  # no interpreter finalization: see tests/_torchrun.py


if __name__ == "__main__":
    main()
