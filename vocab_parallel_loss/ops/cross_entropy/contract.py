"""The contract of ``cross_entropy``: what its arguments may be, and the options its backends take.

Every front door of the loss over logits (``functional.cross_entropy``, the module
``VocabParallelCrossEntropy``, the TransformerEngine and megatron-core drop-ins, the Megatron
integration) checks its options here, so an option is refused with one message wherever it
enters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import checks, communication


class LossOptions(NamedTuple):
    """The options of one rank's shard, passed to the backends as one positional argument: built
    once per call signature, reused by the backward (keyword passing costs host time on every
    launch).

    ``vocab_start`` is this shard's first global column, ``vocab_size`` the global vocabulary;
    ``smoothing`` and ``z_loss`` are Python floats.
    """

    vocab_start: int
    vocab_size: int
    ignore_index: int
    smoothing: float
    z_loss: float


def check_options(label_smoothing, ignore_index, reduction, z_loss, tp_group=None) -> int:
    """The tensor-free options; returns ``ignore_index`` as an int."""
    checks.check_group(tp_group)
    checks.check_smoothing(label_smoothing)
    checks.check_reduction(reduction)
    checks.check_z_loss(z_loss)
    return checks.check_ignore_index(ignore_index)


def check(logits, target, label_smoothing, reduction, z_loss, ignore_index=-100,
          tp_group=None) -> None:
    """Every argument of one call: raises ``TypeError``/``ValueError`` naming the argument."""
    checks.check_float("logits", logits)
    checks.check_target_dtype(target)
    check_options(label_smoothing, ignore_index, reduction, z_loss, tp_group)
    shape = logits.shape
    if not shape or shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty vocabulary dim, got shape {tuple(shape)}")
    if target.shape != shape[:-1]:
        checks.check_leading_shape("leading dims of logits", shape[:-1], target)
    if target.device != logits.device:
        checks.check_same_device(logits=logits, target=target)


def loss_options(group, v_local, ignore_index, smoothing, z_loss) -> LossOptions:
    """The options of this rank's shard of a ``v_local``-column vocabulary slice."""
    if group is None:  # the common single-shard call: no process-group queries
        return LossOptions(0, v_local, ignore_index, smoothing, z_loss)
    world = communication.world_size(group)
    rank = communication.rank(group) if world > 1 else 0
    return LossOptions(rank * v_local, v_local * world, ignore_index, smoothing, z_loss)
