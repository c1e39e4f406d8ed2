"""The per-call options every backend of the loss over logits takes."""

from __future__ import annotations

from typing import NamedTuple


class LossOptions(NamedTuple):
    """One positional argument instead of five keywords: built once per forward, reused by the
    backward (keyword passing costs host time on every launch).

    ``vocab_start`` is this shard's first global column, ``vocab_size`` the global vocabulary;
    ``smoothing`` and ``z_loss`` are Python floats.
    """

    vocab_start: int
    vocab_size: int
    ignore_index: int
    smoothing: float
    z_loss: float
