"""Everything that talks to the tensor-parallel (TP) group lives here.

The losses only need a few collectives:

* ``gather_stats``: one all-gather of the packed per-row statistics and each rank's shard shapes
  (forward of every loss; ``check_shapes``);
* ``all_reduce_sum``: the hidden-state gradient of the fused linear loss;
* ``gather_along_first_dim`` / ``reduce_scatter_along_first_dim``: sequence parallelism.

``group=None`` always means "no tensor parallelism": a single shard, no communication.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .runtime import capturing, compiling

ProcessGroup = Optional["dist.ProcessGroup"]

# torch 2.13 renamed the tensor-to-tensor collectives (the old names warn); older torch has only
# the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size(group: ProcessGroup) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank(group: ProcessGroup) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# Weak: a process group the user destroyed must not live on here until the interpreter's
# teardown, where gloo's worker threads abort the process as its destructor runs.
_groups_by_key: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def group_key(group: ProcessGroup) -> str:
    """A string naming ``group`` (registered ops take strings, not process groups)."""
    if group is None:
        return ""
    key = getattr(group, "group_name", None) or f"pg-{id(group)}"
    if not compiling():  # a trace cannot build weak references; group_from_key resolves it
        _groups_by_key[key] = group
    return key


def group_from_key(key: str) -> ProcessGroup:
    if not key:
        return None
    group = _groups_by_key.get(key)
    if group is None:
        # a key first seen inside a torch.compile trace was not registered at run time:
        # c10d keeps its own registry of group names
        from torch.distributed import distributed_c10d

        group = distributed_c10d._resolve_process_group(key)
        _groups_by_key[key] = group
    return group


# Shard shapes travel with the statistics. A separate check collective, run only while a shape is
# new to a rank, cannot work: a rank that has seen its shape before would skip it while another
# ran it, and the two collectives would pair up (an abort inside the backend). Instead each rank
# appends its shapes to the statistics of the all-gather that every forward runs anyway, so every
# rank receives every rank's shapes from the same collective:
#
# * on the device, the merge turns the loss and lse into NaN when the shapes disagree (every rank
#   sees the same gathered shapes, so every rank does; no host sync);
# * on the host, a rank reads the gathered shapes (one sync) while its own shapes are new to it
#   and raises ``ValueError`` on a mismatch. On a first call every rank's shapes are new, so every
#   rank raises; a rank whose shapes it has already verified reads nothing and gets the NaN.
#
# So what a rank has seen before decides at most whether it reads the host, never whether it runs
# a collective, and a collective's size comes from what every rank shares (the number of tokens,
# the targets), never from one rank's own shard: the sequence gather sends the rows the targets
# give each rank (``gather_along_first_dim``), and the vocabulary of the log-prob ops'
# ``vocab_range`` is the last rank's stop, read from the gathered shapes on the device.

#: Floats each rank appends to its statistics, by slot: 0, its vocabulary columns; 1 and 2, with
#: ``sequence_parallel``, its rows of ``e`` and the rows the targets give it (else 0, 0); 3 and 4,
#: for the log-prob ops, the global ids ``[start, stop)`` its columns hold (``vocab_range``, or
#: its equal shard's). Eight slots keep each rank's block 16-byte aligned. Exact as fp32 below
#: 2**24 columns, rows or ids.
SHAPE_SLOTS = 8
_verified_shapes: set = set()


def stats_size(k: int, n: int) -> int:
    """Floats of one rank's send buffer: ``(k, n)`` statistics, then ``SHAPE_SLOTS`` shapes."""
    return k * n + SHAPE_SLOTS


def put_shapes(send: torch.Tensor, k: int, n: int, local: tuple) -> None:
    """Write this rank's shapes ``local`` after the ``(k, n)`` statistics of a zeroed ``send``
    buffer: one fill per non-zero slot, no host-to-device copy (it would sync)."""
    for i, v in enumerate(local):
        if v:
            send[k * n + i].fill_(v)


def gather_stats(send: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather every rank's flat ``send`` buffer (``stats_size`` floats) into ``(world, L)``
    (rank order). One collective per forward: its latency, not its size, is what costs."""
    n = world_size(group)
    if n == 1:
        return send.unsqueeze(0)
    # concatenated along dim 0 (the layout every backend accepts, gloo included), then split
    out = torch.empty(n * send.numel(), dtype=send.dtype, device=send.device)
    _all_gather(out, send.contiguous(), group=group)
    return out.view(n, send.numel())


def gathered_stats(gathered: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The ``(world, k, n)`` statistics of a ``gather_stats`` result."""
    return gathered[:, :k * n].view(gathered.shape[0], k, n)


def gathered_shapes(gathered: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The ``(world, SHAPE_SLOTS)`` shapes of a ``gather_stats`` result."""
    return gathered[:, k * n:]


def gathered_vocab(shapes: torch.Tensor) -> torch.Tensor:
    """Device int64 scalar: the global vocabulary of ranges that tile it, the last rank's stop
    (``shapes`` of the log-prob ops, ``gathered_shapes``)."""
    return shapes[-1, 4].to(torch.int64)


class ShapesDiffer(ValueError):
    """The ranks' shapes disagree (``check_shapes``), raised after the collective that
    gathered them."""


def shapes_agree(shapes: torch.Tensor, local: tuple) -> torch.Tensor:
    """Device bool scalar, the same on every rank (no host sync): with ``local`` of one or
    three slots, every rank's vocabulary columns equal ``local[0]``; of five (the log-prob
    ops), the ranks' ranges tile ``[0, V)`` in rank order, each within its rank's columns; with
    three or more, every rank's rows of ``e`` equal the rows the targets imply."""
    if len(local) >= 5:
        cols, start, stop = shapes[:, 0], shapes[:, 3], shapes[:, 4]
        before = torch.cat([torch.zeros_like(stop[:1]), stop[:-1]])  # 0, then the last stop
        ok = (start == before) & (start <= stop) & (stop <= start + cols)
    else:
        ok = shapes[:, 0] == local[0]
    if len(local) > 1:
        ok = ok & (shapes[:, 1] == local[2])
    return ok.all()


def check_shapes(gathered: torch.Tensor, k: int, n: int, local: tuple,
                 group: ProcessGroup) -> None:
    """Raise ``ShapesDiffer`` (a ``ValueError``) when the shapes in ``gathered``
    (``gather_stats`` of ``(k, n)`` statistics) disagree, as ``shapes_agree`` decides.

    ``local`` is this rank's first slots (see ``SHAPE_SLOTS``): ``(vocabulary columns,)``,
    ``(vocabulary columns, sequence rows, rows the targets imply)`` or those and ``(start,
    stop)``. Reads the shapes on the host (a sync) only while ``local`` is new to this rank for
    ``group``, and never while a CUDA graph is being captured (its eager warm-up step reads
    them); see the comment above ``SHAPE_SLOTS``.
    """
    key = (group_key(group), local)
    if key in _verified_shapes or capturing():
        return
    shapes = gathered_shapes(gathered, k, n)[:, :len(local)]
    rows = [[int(v) for v in r] for r in shapes.tolist()]
    vocab = [r[0] for r in rows]
    if len(local) >= 5:
        ranges = [(r[3], r[4]) for r in rows]
        before = [0] + [hi for _, hi in ranges[:-1]]
        if not all(lo == b and lo <= hi <= lo + c for (lo, hi), b, c in zip(ranges, before, vocab)):
            if all(r == (i * c, (i + 1) * c) for i, (r, c) in enumerate(zip(ranges, vocab))):
                raise ShapesDiffer(
                    f"vocab shards differ across the tensor-parallel group: sizes per rank "
                    f"{vocab}; every rank must hold the same number of vocabulary columns (pad "
                    "the vocabulary), or pass vocab_range")
            raise ShapesDiffer(
                f"vocab_range of the ranks must tile [0, V) in rank order, each within its "
                f"rank's columns: (start, stop) per rank {ranges}, columns per rank {vocab}")
    elif any(v != local[0] for v in vocab):
        raise ShapesDiffer(
            f"vocab shards differ across the tensor-parallel group: sizes per rank {vocab}; "
            "every rank must hold the same number of vocabulary columns (pad the vocabulary)"
        )
    if len(local) > 1 and any(r[1] != local[2] for r in rows):
        raise ShapesDiffer(
            f"sequence_parallel=True: the sequence shards of e differ from the targets: rows of e "
            f"per rank {[r[1] for r in rows]}, while the targets' dim 0 gives "
            f"{local[2]} rows to each of the {len(rows)} ranks; every rank must hold an equal "
            "slice of dim 0 (pad the sequence)"
        )
    _verified_shapes.add(key)


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """In-place sum over the group; returns ``tensor``."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def gather_along_first_dim(tensor: torch.Tensor, group: ProcessGroup,
                           rows: Optional[int] = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (sequence-parallel gather).

    ``rows``: the dim-0 size every rank is meant to send (agreed, e.g. from the targets). A rank
    whose ``tensor`` has another size sends ``rows`` rows of NaN instead, so the collective still
    pairs up on every rank; the shapes that travel with the statistics then report it
    (``check_shapes``).
    """
    n = world_size(group)
    if n == 1:
        return tensor
    if rows is not None and tensor.shape[0] != rows:
        tensor = tensor.new_full((rows,) + tuple(tensor.shape[1:]), float("nan"))
    tensor = tensor.contiguous()
    out = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    _all_gather(out, tensor, group=group)
    return out


def reduce_scatter_along_first_dim(tensor: torch.Tensor, group: ProcessGroup,
                                   shape: Optional[tuple] = None) -> torch.Tensor:
    """Sum over the group, each rank keeping its slice of dim 0 (sequence-parallel scatter).

    ``shape``: that of the tensor this rank gave ``gather_along_first_dim``. A rank whose
    tensor had other rows than it sent gets NaN of that shape, after the collective (its forward
    reported the mismatch; under torch.compile this backward is traced before anything runs,
    and must not fail on that rank alone).
    """
    n = world_size(group)
    if n == 1:
        return tensor
    if tensor.shape[0] % n:
        raise ValueError(f"dim 0 ({tensor.shape[0]}) is not divisible by the group size ({n})")
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // n,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    _reduce_scatter(out, tensor, op=dist.ReduceOp.SUM, group=group)
    if shape is not None and tuple(shape) != tuple(out.shape):
        return out.new_full(tuple(shape), float("nan"))
    return out
