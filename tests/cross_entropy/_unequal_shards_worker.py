"""torchrun worker: unequal shards across the TP group give a clear error, never a wrong loss or
an abort inside the collective.

    torchrun --nproc-per-node W tests/cross_entropy/_unequal_shards_worker.py

Rank 1 holds one vocabulary column (or sequence row) more than the others. Each case records
what every rank saw ("raised": the ValueError; "nan": a NaN loss; else the loss was returned) and
all-gathers those outcomes, which also shows that the ranks' collectives still pair up. Exits
non-zero on the first unexpected outcome; prints ``N shape cases passed on W ranks``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests._torchrun import end_worker, init_worker_process_group
from vocab_parallel_loss import backends, cross_entropy, linear_cross_entropy

H = 8


def outcome(fn, match: str) -> str:
    try:
        loss = fn()
    except ValueError as ex:
        assert match in str(ex), ex
        return "raised"
    return "nan" if bool(torch.isnan(loss).all()) else "value"


def everyone(mine: str) -> list:
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    return seen


def expect(name: str, got: list, want: list) -> None:
    assert got == want, f"{name}: outcomes per rank {got}, expected {want}"


def logits_loss(group, v_local, compiled=False):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, v_local, generator=gen)
    t = torch.randint(0, 4 * dist.get_world_size(), (2, 3), generator=gen)

    def f(x, t):
        return cross_entropy(x, t, tp_group=group)

    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    return lambda: f(x, t)


def linear_loss(group, v_local, impl, rows=3, targets_rows=None, compiled=False, **kw):
    """Sequence parallel when ``targets_rows`` is given: ``e`` is this rank's ``rows`` rows of
    an ``[s, b, h]`` sequence whose targets are ``[targets_rows, 2]``."""
    gen = torch.Generator().manual_seed(4)
    e = torch.randn(rows, 2, H, generator=gen)
    c = torch.randn(v_local, H, generator=gen)
    t = torch.randint(0, 4 * dist.get_world_size(), (targets_rows or rows, 2), generator=gen)
    sp = targets_rows is not None

    def f(e, c, t):
        return linear_cross_entropy(e, c, t, tp_group=group, sequence_parallel=sp, impl=impl,
                                    reduction="none", **kw)

    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, backend="aot_eager")
    return lambda: f(e, c, t)


def main() -> None:
    init_worker_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    wide = 5 + (rank == 1)  # rank 1's vocabulary shard is one column wider
    all_raise = ["raised"] * world
    only_rank1 = ["raised" if r == 1 else "nan" for r in range(world)]
    vocab, seq = "vocab shards differ", "sequence_parallel=True"
    n = 0
    for impl in ["triton", "torch"]:
        backends.triton_runs = (lambda t: True) if impl == "triton" else (lambda t: False)
        if impl == "torch":
            # unequal vocabulary shards under torch.compile: checked at run time (the check
            # does not depend on the backend; dynamo cannot trace Triton's interpreter)
            g = dist.new_group(list(range(world)))
            expect("compiled cross_entropy",
                   everyone(outcome(logits_loss(g, wide, True), vocab)), all_raise)
            expect("compiled linear", everyone(outcome(
                linear_loss(g, wide, impl, compiled=True), vocab)), all_raise)
        # a group that verified 5 columns, then rank 1 holds 6: rank 1 raises, the others (which
        # do not read the widths again) get NaN; no rank aborts
        g = dist.new_group(list(range(world)))
        expect("equal", everyone(outcome(logits_loss(g, 5), vocab)), ["value"] * world)
        expect("cross_entropy after a verified width",
               everyone(outcome(logits_loss(g, wide), vocab)), only_rank1)
        expect("equal", everyone(outcome(linear_loss(g, 5, impl), vocab)), ["value"] * world)
        expect("linear after a verified width",
               everyone(outcome(linear_loss(g, wide, impl), vocab)), only_rank1)
        # sequence parallel: rank 1 holds one more row of e than the targets give it
        g = dist.new_group(list(range(world)))
        rows = 2 + (rank == 1)
        expect("unequal sequence shards", everyone(outcome(
            linear_loss(g, 5, impl, rows=rows, targets_rows=2 * world, shift=1), seq)),
            all_raise)
        expect("equal", everyone(outcome(linear_loss(g, 5, impl, rows=2, targets_rows=2 * world),
                                         seq)), ["value"] * world)
        expect("sequence shards after verified ones", everyone(outcome(
            linear_loss(g, 5, impl, rows=rows, targets_rows=2 * world), seq)), only_rank1)
        expect("targets not divisible", everyone(outcome(
            linear_loss(g, 5, impl, rows=2, targets_rows=2 * world + 1), seq)), all_raise)
        n += 7 + 2 * (impl == "torch")
    if rank == 0:
        print(f"{n} shape cases passed on {world} ranks", flush=True)
    end_worker()  # no interpreter finalization: see tests/_torchrun.py


if __name__ == "__main__":
    main()
