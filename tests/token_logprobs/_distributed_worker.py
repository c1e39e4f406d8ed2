"""torchrun worker: log-probs and entropy on vocabulary shards vs the full-vocabulary fp64 oracle.

Every rank builds the same full inputs (fixed seed) and keeps its shard: the outputs must be the
full-vocabulary values, bitwise equal on every rank; the logits' (and weight's) gradient is its
slice of the full gradient, the hidden states' the full one (or its sequence slice). Cases: equal
shards, unequal shards through ``vocab_range`` (the last rank's shard padded), sequence
parallelism; the hidden-state path (``linear_token_logprobs``) under each strategy of the fused
engine. Prints ``N log-prob cases passed on W ranks``; launched by the tests, rank 0 writes each
case's outcome as JSON (``run_checks`` in tests/_torchrun.py).

gloo on CPU by default; ``VPL_TEST_DEVICE`` (tests/_torchrun.py) puts the ranks on GPUs, e.g.
``cuda:0``, every rank on GPU 0 over gloo (the GPU tests): the inputs are built on the CPU and
moved there, and the fp64 oracle runs on the CPU.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests._torchrun import (compiled_collectives_run, end_worker, init_worker_process_group,
                             run_checks)
from tests._budgets import device_columns, narrow_chunk_config, one_saved_tile_budget
from tests._logprobs_oracle import oracle
from vocab_parallel_loss import backends, linear_token_logprobs, token_logprobs
from vocab_parallel_loss.ops.fused_linear.strategy import choose_strategy
from vocab_parallel_loss.kernels import linear as K

DEVICE = torch.device("cpu")  # main() sets the rank's GPU under VPL_TEST_DEVICE=cuda[:N]


def same_on_every_rank(t):
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    assert all(torch.equal(torch.nan_to_num(g, 7.0), torch.nan_to_num(t, 7.0)) for g in got)


def close(name, got, want, tol=2e-5):
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"{name}: max err {err:.3g}"


def shards(vocab, world, rank, unequal):
    """(start, stop, width) of this rank: equal widths, or widths 1 apart with the last padded."""
    if not unequal:
        w = vocab // world
        return rank * w, (rank + 1) * w, w
    width = -(-vocab // world)
    start = min(vocab, rank * width)
    return start, min(vocab, start + width), width


def case_logits(unequal, per_token_t):
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = 10 * world + (3 if unequal else 0)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 3, vocab, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, vocab, (4, 3), generator=g)
    t[1, 2] = -100
    temp = torch.rand(4, 3, generator=g, dtype=torch.float64) + 0.5 if per_token_t else 1.3
    g_lp, g_ent = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    start, stop, width = shards(vocab, world, rank, unequal)
    local = torch.full((4, 3, width), -1e30)
    local[..., :stop - start] = z[..., start:stop].float()
    local = local.to(DEVICE).transpose(0, 1).contiguous().transpose(0, 1)  # a [b, s, v] view
    local.requires_grad_()
    out = token_logprobs(local, t.to(DEVICE), tp_group=dist.group.WORLD, return_entropy=True,
                         return_argmax=True,
                         temperature=temp.float().to(DEVICE) if per_token_t else temp,
                         vocab_range=(start, stop) if unequal else None)
    for x in out:
        same_on_every_rank(x)
    z64 = z.clone().requires_grad_()
    lp, ent, am = oracle(z64, t, temp)
    close("log_probs", out.log_probs, lp.detach())
    close("entropy", out.entropy, ent.detach())
    assert torch.equal(out.argmax.cpu(), am)
    ((out.log_probs * g_lp.to(DEVICE)).sum() + (out.entropy * g_ent.to(DEVICE)).sum()).backward()
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    close("dlogits", local.grad[..., :stop - start], z64.grad[..., start:stop])
    assert torch.all(local.grad[..., stop - start:] == 0)


def case_masked_or_offset(kind):
    """``masked``: -inf columns (a masked vocabulary) and, in some rows, one rank's whole shard
    -inf, under a per-token temperature: 0 gradient there, not NaN. ``offset``: fp32 logits
    near 1e4, whose gradient needs the merged lse's low part (a softmax from the fp32-rounded
    lse would be 5e-4 off of itself)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    v_local, rows = 13, 6
    vocab = v_local * world
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, vocab - v_local, (rows,), generator=g)  # never in the last shard
    t[5] = -100
    g_lp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    if kind == "masked":
        z = torch.randn(rows, vocab, generator=g) * 2
        z[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")
        z[:3, vocab - v_local:] = float("-inf")  # the last rank's whole shard, rows 0-2
        z[torch.arange(rows), t.clamp(min=0)] = 0.5  # the targets stay finite
        temp = torch.rand(rows, generator=g) + 0.5
    else:
        z = torch.randn(rows, vocab, generator=g) * 2 + 1e4  # exact fp32 values near 1e4
        temp = 1.0  # a temperature would round x = z / T itself by as much
    local = z[:, rank * v_local:(rank + 1) * v_local].to(DEVICE).requires_grad_()
    out = token_logprobs(local, t.to(DEVICE), tp_group=dist.group.WORLD, return_entropy=True,
                         temperature=temp.to(DEVICE) if kind == "masked" else temp)
    for x in out[:2]:
        same_on_every_rank(x)
    z64 = z.double().requires_grad_()
    lp, ent, _ = oracle(z64, t, temp.double() if kind == "masked" else temp)
    close("log_probs", out.log_probs, lp.detach())
    close("entropy", out.entropy, ent.detach())
    ((out.log_probs * g_lp.to(DEVICE)).sum() + (out.entropy * g_ent.to(DEVICE)).sum()).backward()
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    got, want = local.grad.cpu(), z64.grad[:, rank * v_local:(rank + 1) * v_local]
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    assert torch.all(got[want == 0] == 0)  # masked columns, the ignored row
    close("dlogits", got, want, 1e-5)


def case_hidden(sp, unequal, budget):
    """The fused path under TP: ``budget`` "saved" (every tile), "split" (the first tile saved,
    the rest recomputed) or "recompute" (``memory_budget=0``; the PyTorch backend ignores it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    K.config.OVERRIDE_CONFIG = narrow_chunk_config(K, DEVICE) if budget == "split" else None
    s, b, h, v_local = 2 * world, 6, 8, device_columns(K, 75, DEVICE)
    vocab = v_local * world - (2 if unequal else 0)  # unequal: the last rank holds 2 padding rows
    g = torch.Generator().manual_seed(6)
    e = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    c = torch.randn(v_local * world, h, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, vocab, (s, b), generator=g)
    t[0, 0] = -100
    g_lp, g_ent = torch.randn(s, b, generator=g), torch.randn(s, b, generator=g)
    # a per-token temperature for the split cases (the full [s, b] one under sequence parallel)
    temp = torch.rand(s, b, generator=g, dtype=torch.float64) + 0.5 if budget == "split" else 0.8
    rows = slice(rank * (s // world), (rank + 1) * (s // world))
    start, stop = rank * v_local, min(vocab, (rank + 1) * v_local)
    e_mine = (e[rows] if sp else e).float().to(DEVICE).requires_grad_()
    c_mine = c[start:start + v_local].float().to(DEVICE).requires_grad_()
    memory_budget = None
    if budget != "saved":
        cfg = K.default_config(e_mine.device)
        n = s * b
        memory_budget = (0 if budget == "recompute"
                         else one_saved_tile_budget(K, n, h, v_local, 4, cfg,
                                                    sequence_parallel=sp and world > 1))
        if budget == "split" and backends.triton_runs(e_mine):
            picked = choose_strategy(K, e_mine, c_mine, None, "none", sp, dist.group.WORLD,
                                     None, 0.0, memory_budget)
            assert picked[:3] == ("saved", None, cfg.fwd_block_v), picked
    out = linear_token_logprobs(e_mine, c_mine, t.to(DEVICE), tp_group=dist.group.WORLD,
                                sequence_parallel=sp, return_entropy=True, return_argmax=True,
                                temperature=temp.float().to(DEVICE) if budget == "split" else temp,
                                memory_budget=memory_budget,
                                vocab_range=(start, stop) if unequal else None)
    for x in out:
        same_on_every_rank(x)
    e64, c64 = e.clone().requires_grad_(), c.clone().requires_grad_()
    lp, ent, am = oracle(e64 @ c64.t(), t, temp, valid=vocab)
    close("log_probs", out.log_probs, lp.detach())
    close("entropy", out.entropy, ent.detach())
    assert torch.equal(out.argmax.cpu(), am)
    ((out.log_probs * g_lp.to(DEVICE)).sum() + (out.entropy * g_ent.to(DEVICE)).sum()).backward()
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    close("dE", e_mine.grad, e64.grad[rows] if sp else e64.grad, 1e-4)
    close("dC", c_mine.grad[:stop - start], c64.grad[start:stop], 1e-4)
    assert torch.all(c_mine.grad[stop - start:] == 0)


# ------------------------------------------------- one group, reused: shapes and ranges change
COLS = 7  # vocabulary columns every rank holds in the cases below


def ranges_of(vocab, world):
    """``(start, stop)`` per rank of a ``vocab``-id vocabulary in shards of ``COLS`` columns."""
    return [(min(vocab, r * COLS), min(vocab, (r + 1) * COLS)) for r in range(world)]


def ranged_call(op, group, vocab, n, seed, ranges=None):
    """``op`` ("logits" or "hidden") on this rank's ``COLS`` columns with ``vocab_range``; returns
    the outputs, the inputs' gradient of this rank's columns (or hidden states) and the fp64
    oracle of the full vocabulary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start, stop = (ranges or ranges_of(vocab, world))[rank]
    g = torch.Generator().manual_seed(seed)
    h = 8
    e = torch.randn(n, h, generator=g, dtype=torch.float64)
    c = torch.randn(COLS * world, h, generator=g, dtype=torch.float64)
    z = e @ c.t()
    t = torch.randint(0, vocab, (n,), generator=g)
    temp = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    local = min(COLS, max(0, stop - start))  # a wrong range may claim more than the columns
    if op == "logits":
        x = torch.full((n, COLS), -1e30)
        x[:, :local] = z[:, start:start + local].float()
        leaf = x.to(DEVICE).requires_grad_()
        out = token_logprobs(leaf, t.to(DEVICE), tp_group=group,
                             temperature=temp.float().to(DEVICE), return_entropy=True,
                             return_argmax=True, vocab_range=(start, stop))
    else:
        leaf = e.float().to(DEVICE).requires_grad_()
        out = linear_token_logprobs(leaf, c[rank * COLS:(rank + 1) * COLS].float().to(DEVICE),
                                    t.to(DEVICE), tp_group=group,
                                    temperature=temp.float().to(DEVICE), return_entropy=True,
                                    return_argmax=True, vocab_range=(start, stop))
    return out, leaf, (z, t, temp, vocab, start, local)


def check_ranged(op, group, vocab, n, seed):
    """The outputs and gradient of ``ranged_call`` against the oracle."""
    out, leaf, (z, t, temp, vocab, start, local) = ranged_call(op, group, vocab, n, seed)
    for x in out:
        same_on_every_rank(x)
    z64 = z.clone().requires_grad_()
    lp, ent, am = oracle(z64, t, temp, valid=vocab)
    close("log_probs", out.log_probs, lp.detach())
    close("entropy", out.entropy, ent.detach())
    assert torch.equal(out.argmax.cpu(), am)
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    (lp.sum() + 0.5 * ent.sum()).backward()
    if op == "logits":
        close("dlogits", leaf.grad[:, :local], z64.grad[:, start:start + local])
        assert torch.all(leaf.grad[:, local:] == 0)


def case_reused_group(op):
    """Ranges (0, 7), (7, 14) [, ...], then a smaller vocabulary on the same group (the last
    rank's range shorter), then the first again: every rank runs the same collectives and gets
    the exact values each time, whatever it has seen before."""
    group = dist.new_group(list(range(dist.get_world_size())))
    full = COLS * dist.get_world_size()
    for i, (vocab, n) in enumerate(((full, 5), (full - 3, 4), (full, 5), (full - 3, 3))):
        check_ranged(op, group, vocab, n, seed=40 + i)


def outcome(fn, match):
    """``"raised"`` (a ValueError whose message holds ``match``), ``"nan"`` (every output NaN)
    or ``"value"``."""
    try:
        out = fn()
    except ValueError as ex:
        assert match in str(ex), ex
        return "raised"
    nan = bool(torch.isnan(out.log_probs).all()) and bool(torch.isnan(out.entropy).all())
    return "nan" if nan else "value"


def everyone(mine):
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    return seen


def case_wrong_ranges(op):
    """Ranges that do not tile the vocabulary, or leave a rank's columns: a ValueError naming
    ``vocab_range`` on every rank that has not verified its own range on this group before, NaN
    on the others; never an abort or a hang."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    full = COLS * world
    good = ranges_of(full, world)
    gap = [(a + (r == 1), b) for r, (a, b) in enumerate(good)]  # rank 1 starts one id late
    past = [(a, b + 2 * (r == 1)) for r, (a, b) in enumerate(good)]  # rank 1 past its columns
    all_raise = ["raised"] * world
    only_rank1 = ["raised" if r == 1 else "nan" for r in range(world)]

    def run(ranges, n):
        return everyone(outcome(lambda: ranged_call(op, group, full, n, 50, ranges)[0],
                                "vocab_range"))

    for want, ranges, n in ((all_raise, gap, 4), (all_raise, past, 4), (["value"] * world, good, 4),
                            (only_rank1, gap, 5), (only_rank1, past, 3),
                            (["value"] * world, good, 3)):
        got = run(ranges, n)
        assert got == want, f"ranges {ranges}: outcomes per rank {got}, expected {want}"


def case_unequal_sequence_shards():
    """linear_token_logprobs with sequence_parallel=True, rank 1 holding one more row of the
    hidden states than the (shared) targets give it: a ValueError on every rank that has not
    verified its own shapes on this group before, NaN on the others; targets whose dim 0 the
    group size does not divide: a ValueError on every rank. Never an abort or a hang."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(60)
    c = torch.randn(COLS, 8, generator=g).to(DEVICE)

    def run(rows, target_rows, match):
        e = torch.randn(rows, 2, 8, generator=g).to(DEVICE)
        t = torch.randint(0, COLS * world, (target_rows, 2), generator=g).to(DEVICE)
        return everyone(outcome(lambda: linear_token_logprobs(
            e, c, t, tp_group=group, sequence_parallel=True, return_entropy=True), match))

    seq = "sequence_parallel=True"
    for want, rows, target_rows in (
            (["raised"] * world, 2 + (rank == 1), 2 * world),
            (["value"] * world, 2, 2 * world),
            (["raised" if r == 1 else "nan" for r in range(world)], 2 + (rank == 1), 2 * world),
            (["raised"] * world, 2, 2 * world + 1)):
        got = run(rows, target_rows, seq)
        assert got == want, f"rows {rows}, targets {target_rows}: {got}, expected {want}"


def case_compiled_unequal_sequence_shards():
    """As ``case_unequal_sequence_shards`` under torch.compile, which traces the backward before
    anything runs: the rank holding other rows must not fail there alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(61)
    c = torch.randn(COLS, 8, generator=g).to(DEVICE).requires_grad_()

    def run(rows):
        e = torch.randn(rows, 2, 8, generator=g).to(DEVICE).requires_grad_()
        t = torch.randint(0, COLS * world, (2 * world, 2), generator=g).to(DEVICE)
        torch._dynamo.reset()
        f = torch.compile(lambda e, c, t: linear_token_logprobs(
            e, c, t, tp_group=group, sequence_parallel=True, return_entropy=True),
            backend="aot_eager")
        return everyone(outcome(lambda: f(e, c, t), "sequence_parallel=True"))

    unequal = 2 + (rank == 1)
    for want, rows in ((["raised"] * world, unequal), (["value"] * world, 2),
                       (["raised" if r == 1 else "nan" for r in range(world)], unequal)):
        got = run(rows)
        assert got == want, f"rows {rows}: {got}, expected {want}"


def on(impl, case, *args):
    """``case(*args)`` run on backend ``impl``."""
    def run():
        backends.triton_runs = (lambda t: True) if impl == "triton" else (lambda t: False)
        case(*args)
    return run


def group_checks(impls):
    """(name, check) of the cases above, on each backend."""
    for impl in impls:
        for op in ("logits", "hidden"):
            yield f"{impl}/groups/reused/{op}", on(impl, case_reused_group, op)
            yield f"{impl}/groups/wrong ranges/{op}", on(impl, case_wrong_ranges, op)
        yield f"{impl}/groups/unequal sequence shards", on(impl, case_unequal_sequence_shards)
    # dynamo traces the PyTorch backend (the Triton one is a graph break)
    if "torch" in impls and compiled_collectives_run(DEVICE):
        yield ("torch/groups/compiled unequal sequence shards",
               on("torch", case_compiled_unequal_sequence_shards))


def checks(impls):
    for impl in impls:
        for unequal in (False, True):
            for per_token_t in (False, True):
                yield (f"{impl}/logits/unequal={unequal}/per_token_t={per_token_t}",
                       on(impl, case_logits, unequal, per_token_t))
        for kind in ("masked", "offset"):
            yield f"{impl}/logits/{kind}", on(impl, case_masked_or_offset, kind)
        for sp, unequal, budget in ((False, False, "saved"), (True, False, "split"),
                                    (True, True, "recompute"), (False, True, "split")):
            yield (f"{impl}/hidden/sp={sp}/unequal={unequal}/{budget}",
                   on(impl, case_hidden, sp, unequal, budget))
    yield from group_checks(impls)


def main():
    global DEVICE
    DEVICE = init_worker_process_group()
    run_checks(checks(sys.argv[1].split(",")), summary="log-prob cases passed")
    dist.barrier()  # no rank tears gloo down while another still sends
    end_worker()  # no interpreter finalization: see tests/_torchrun.py

if __name__ == "__main__":
    main()
