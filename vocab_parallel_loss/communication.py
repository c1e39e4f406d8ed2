"""Everything that talks to the tensor-parallel (TP) group lives here.

The losses only need a few collectives:

* ``gather_stats``: one all-gather of the packed per-row statistics (forward of every loss);
* ``all_reduce_sum``: the hidden-state gradient of the fused linear loss;
* ``gather_along_first_dim`` / ``reduce_scatter_along_first_dim``: sequence parallelism.

``group=None`` always means "no tensor parallelism": a single shard, no communication.
"""

from __future__ import annotations

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


_checked_shards: set = set()
_groups_by_key: dict = {}


def group_key(group: ProcessGroup) -> str:
    """A string naming ``group`` (registered ops take strings, not process groups)."""
    if group is None:
        return ""
    key = getattr(group, "group_name", None) or f"pg-{id(group)}"
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


def check_equal_shards(local_size: int, group: ProcessGroup, device: torch.device) -> bool:
    """Raise ``ValueError`` unless every rank of ``group`` holds ``local_size`` vocabulary columns.

    Unequal shards would silently give a wrong global vocabulary offset. The check costs one tiny
    all-gather and a host read, so it runs once per (group, size) and never while a CUDA graph is
    being captured (a capture must be preceded by an eager warm-up step, which runs it). Returns
    whether the shards are known to be equal (False: the check was skipped this time).
    """
    n = world_size(group)
    if n == 1:
        return True
    key = (id(group), local_size)
    if key in _checked_shards:
        return True
    if capturing() or compiling():
        return False
    mine = torch.tensor([local_size], dtype=torch.int64, device=device)
    sizes = torch.empty(n, dtype=torch.int64, device=device)
    _all_gather(sizes, mine, group=group)
    sizes = sizes.tolist()
    if any(s != local_size for s in sizes):
        raise ValueError(
            f"vocab shards differ across the tensor-parallel group: sizes per rank {sizes}; "
            "every rank must hold the same number of vocabulary columns (pad the vocabulary)"
        )
    _checked_shards.add(key)
    return True


def gather_stats(stats: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather ``stats`` of shape ``(K, N)`` into ``(world, K, N)`` (rank order).

    One collective per forward: its latency, not its size (``K * N`` floats), is what costs.
    """
    n = world_size(group)
    if n == 1:
        return stats.unsqueeze(0)
    k, rows = stats.shape
    # concatenated along dim 0 (the layout every backend accepts, gloo included), then split
    out = torch.empty((n * k, rows), dtype=stats.dtype, device=stats.device)
    _all_gather(out, stats.contiguous(), group=group)
    return out.view(n, k, rows)


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """In-place sum over the group; returns ``tensor``."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def gather_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (sequence-parallel gather)."""
    n = world_size(group)
    if n == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    _all_gather(out, tensor, group=group)
    return out


def reduce_scatter_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over the group, each rank keeping its slice of dim 0 (sequence-parallel scatter)."""
    n = world_size(group)
    if n == 1:
        return tensor
    if tensor.shape[0] % n:
        raise ValueError(f"dim 0 ({tensor.shape[0]}) is not divisible by the group size ({n})")
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // n,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    _reduce_scatter(out, tensor, op=dist.ReduceOp.SUM, group=group)
    return out


_vocab_of_ranges: dict = {}


def vocab_size_of_ranges(start: int, stop: int, group: ProcessGroup, device) -> int:
    """The global vocabulary size when each rank of ``group`` holds ids ``[start, stop)``.

    The ranges must tile ``[0, V)`` in rank order, without gaps or overlaps (else
    ``ValueError``). One tiny all-gather and a host read, once per (group, range) on each rank;
    a CUDA-graph capture or a ``torch.compile`` trace needs an eager call with the same range
    first.
    """
    n = world_size(group)
    if n == 1:
        if start != 0:
            raise ValueError(f"vocab_range must start at 0 without tensor parallelism, got "
                             f"({start}, {stop})")
        return stop
    key = (id(group), start, stop)
    if key in _vocab_of_ranges:
        return _vocab_of_ranges[key]
    if capturing() or compiling():
        raise RuntimeError("vocab_range: call once eagerly with this range before capturing or "
                           "compiling (the ranks' ranges are checked with a collective)")
    mine = torch.tensor([start, stop], dtype=torch.int64, device=device)
    ranges = torch.empty(2 * n, dtype=torch.int64, device=device)
    _all_gather(ranges, mine, group=group)
    pairs = ranges.view(n, 2).tolist()
    expected = 0
    for lo, hi in pairs:
        if lo != expected:
            raise ValueError(f"vocab_range of the ranks must tile [0, V) in rank order, got {pairs}")
        expected = hi
    _vocab_of_ranges[key] = expected
    return expected
