"""torchrun worker: unequal shards across the TP group give a clear error, never a wrong loss or
an abort inside the collective.

    torchrun --nproc-per-node W tests/cross_entropy/_unequal_shards_worker.py

Rank 1 holds one vocabulary column (or sequence row) more than the others. Each case records
what every rank saw ("raised": the ValueError; "nan": a NaN loss; else the loss was returned) and
all-gathers those outcomes, which also shows that the ranks' collectives still pair up. Exits
non-zero on the first unexpected outcome; prints ``N shape cases passed on W ranks``. The tests
run these cases in the launch of ``_distributed_worker.py`` (``unequal_shard_checks``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests._torchrun import end_worker, init_worker_process_group, run_checks
from vocab_parallel_loss import backends, cross_entropy, linear_cross_entropy

H = 8


def outcome(fn, match: str) -> str:
    """A tuple of outputs (the loss and the lse) is "nan" when every one is all NaN."""
    try:
        out = fn()
    except ValueError as ex:
        assert match in str(ex), ex
        return "raised"
    outs = out if isinstance(out, tuple) else (out,)
    return "nan" if all(bool(torch.isnan(o).all()) for o in outs) else "value"


def everyone(mine: str) -> list:
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    return seen


def expect(name: str, got: list, want: list) -> None:
    assert got == want, f"{name}: outcomes per rank {got}, expected {want}"


def logits_loss(group, v_local, compiled=False, **kw):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, v_local, generator=gen)
    t = torch.randint(0, 4 * dist.get_world_size(), (2, 3), generator=gen)

    def f(x, t):
        return cross_entropy(x, t, tp_group=group, **kw)

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


def unequal_shard_checks():
    """(name, check) of every case, in order: a case may rely on what an earlier one verified."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wide = 5 + (rank == 1)  # rank 1's vocabulary shard is one column wider
    all_raise = ["raised"] * world
    only_rank1 = ["raised" if r == 1 else "nan" for r in range(world)]
    vocab, seq = "vocab shards differ", "sequence_parallel=True"
    state = {}

    def case(name, want, make, match, new_group=False):
        impl = name.split("/")[1]

        def run():
            backends.triton_runs = (lambda t: True) if impl == "triton" else (lambda t: False)
            if new_group:
                state["g"] = dist.new_group(list(range(world)))
            expect(name, everyone(outcome(make(state["g"]), match)), want)
        return name, run

    for impl in ["triton", "torch"]:
        if impl == "torch":
            # unequal vocabulary shards under torch.compile: checked at run time (the check
            # does not depend on the backend; dynamo cannot trace Triton's interpreter)
            yield case(f"shapes/{impl}/compiled cross_entropy", all_raise,
                       lambda g: logits_loss(g, wide, True), vocab, new_group=True)
            yield case(f"shapes/{impl}/compiled linear", all_raise,
                       lambda g, impl=impl: linear_loss(g, wide, impl, compiled=True), vocab)
        # a group that verified 5 columns, then rank 1 holds 6: rank 1 raises, the others (which
        # do not read the widths again) get NaN; no rank aborts
        yield case(f"shapes/{impl}/equal", ["value"] * world, lambda g: logits_loss(g, 5), vocab,
                   new_group=True)
        yield case(f"shapes/{impl}/cross_entropy after a verified width", only_rank1,
                   lambda g: logits_loss(g, wide), vocab)
        # with the lse, whose gather is a second collective: rank 1 runs it before raising,
        # so that the others' lse is NaN too and the next case's collectives pair up
        yield case(f"shapes/{impl}/cross_entropy and lse after a verified width", only_rank1,
                   lambda g: logits_loss(g, wide, return_lse=True), vocab)
        yield case(f"shapes/{impl}/equal linear", ["value"] * world,
                   lambda g, impl=impl: linear_loss(g, 5, impl), vocab)
        yield case(f"shapes/{impl}/linear after a verified width", only_rank1,
                   lambda g, impl=impl: linear_loss(g, wide, impl), vocab)
        # sequence parallel: rank 1 holds one more row of e than the targets give it
        rows = 2 + (rank == 1)
        yield case(f"shapes/{impl}/unequal sequence shards", all_raise,
                   lambda g, impl=impl: linear_loss(g, 5, impl, rows=rows, targets_rows=2 * world,
                                                    shift=1), seq, new_group=True)
        yield case(f"shapes/{impl}/equal sequence shards", ["value"] * world,
                   lambda g, impl=impl: linear_loss(g, 5, impl, rows=2, targets_rows=2 * world),
                   seq)
        yield case(f"shapes/{impl}/sequence shards after verified ones", only_rank1,
                   lambda g, impl=impl: linear_loss(g, 5, impl, rows=rows, targets_rows=2 * world),
                   seq)
        yield case(f"shapes/{impl}/targets not divisible", all_raise,
                   lambda g, impl=impl: linear_loss(g, 5, impl, rows=2,
                                                    targets_rows=2 * world + 1), seq)


def main() -> None:
    init_worker_process_group()
    run_checks(unequal_shard_checks(), summary="shape cases passed")
    end_worker()  # no interpreter finalization: see tests/_torchrun.py


if __name__ == "__main__":
    main()
