"""Checks of the fused linear ops that read the device, as registered ``torch.library`` ops.

The fused linear loss is traced by torch.compile (plain ops around its kernels), so its checks
that read the device are ops of the graph, run at run time. Each returns a tensor the loss uses:
an op whose result nothing uses is dropped from the graph.
"""

from __future__ import annotations

import torch

from ... import checks, communication

_NS = "vocab_parallel_loss"


@torch.library.custom_op(f"{_NS}::checked_targets", mutates_args=())
def checked_targets(target: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """``target`` (a copy), after ``checks.check_target_range`` (a host read)."""
    checks.check_target_range(target, vocab_size, ignore_index)
    return target.clone()


@checked_targets.register_fake
def _(target, vocab_size, ignore_index):
    return torch.empty_like(target)


@torch.library.custom_op(f"{_NS}::shapes_agree", mutates_args=())
def shapes_agree(gathered: torch.Tensor, k: int, n: int, local: list[int],
                 group: str) -> torch.Tensor:
    """``communication.check_shapes``, then the device bool ``communication.shapes_agree``."""
    local = tuple(local)
    communication.check_shapes(gathered, k, n, local, communication.group_from_key(group))
    return communication.shapes_agree(communication.gathered_shapes(gathered, k, n), local)


@shapes_agree.register_fake
def _(gathered, k, n, local, group):
    return gathered.new_empty((), dtype=torch.bool)
