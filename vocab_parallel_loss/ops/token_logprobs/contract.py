"""The contract of ``token_logprobs`` (and of ``linear_token_logprobs``, which shares it): what
the arguments may be, the options type its Functions and backends take, and the output type."""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Optional

import torch

from ... import checks, communication


class TokenLogprobs(NamedTuple):
    """Per-token outputs, shaped like the targets: fp32 ``log_probs`` (float64 for float64
    inputs), ``entropy`` (None unless asked for), int64 ``argmax`` (None unless asked for)."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    argmax: Optional[torch.Tensor]


class LogprobOptions(NamedTuple):
    """Everything one call decided before its Function runs."""

    group: object
    col_start: int  # global id of this rank's first column
    valid: int  # columns of this rank that are vocabulary (the rest is padding)
    ignore_index: int
    vocab_size: int  # global vocabulary (targets outside it give NaN log-probs); with tensor
    # parallelism 0: the ranks' ranges give it, from the statistics' all-gather
    scale: float
    softcap: Optional[float]
    rows: object  # the row backend (``backends.RowsBackend``); None from hidden states
    shapes: tuple  # this rank's shapes, gathered with the statistics and checked there
    # (``communication.SHAPE_SLOTS``): columns, rows of e and the rows the targets give it
    # (sequence parallel, else 0, 0), the ids (start, stop) its columns hold
    invariant: bool = False  # batch-invariant statistics and merges (``batch_invariant``)

    @property
    def sequence_rows(self) -> int:
        """Rows of the hidden states every rank sends to the sequence-parallel gather."""
        return self.shapes[2]


def check(logits, tp_group) -> None:
    checks.check_group(tp_group)
    checks.check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty vocabulary dim, got {tuple(logits.shape)}")


def flat_targets(target, lead, device) -> torch.Tensor:
    """``target`` checked against the inputs' leading dims, flat, as int64."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be an integer tensor, got {type(target)}")
    checks.check_target_dtype(target)  # as the losses: class ids, not bool
    if tuple(target.shape) != tuple(lead):
        raise ValueError(f"target shape {tuple(target.shape)} does not match the leading dims "
                         f"{tuple(lead)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device}, the inputs on {device}")
    return target.reshape(-1).to(torch.int64)  # any integer dtype compares exactly as int64


def options(group, v_local, vocab_range, ignore_index, scale, softcap, rows,
            seq_rows=(0, 0), batch_invariant: bool = False) -> LogprobOptions:
    """The options of this rank's ``v_local`` columns. ``vocab_range`` is checked here only
    without tensor parallelism; with it, the ranks' ranges travel with the statistics and are
    checked there on every rank (``communication.check_shapes``), so that a rank whose range
    is wrong does not raise alone while the others wait in the all-gather. ``seq_rows``: this
    rank's rows of the hidden states and the rows the targets give it (sequence parallel).
    ``batch_invariant`` (a bool, else ``TypeError``): the outputs of a token the same bits in
    any batch (``functional.token_logprobs``)."""
    checks.check_bool("batch_invariant", batch_invariant)
    ignore_index = checks.check_ignore_index(ignore_index)
    world = communication.world_size(group)
    if vocab_range is None:  # equal shards
        start = communication.rank(group) * v_local
        stop = start + v_local
    else:
        start, stop = _vocab_range(vocab_range)
        if world == 1 and not 0 == start <= stop <= v_local:
            raise ValueError(f"vocab_range must be (0, stop) with stop <= V_local ({v_local}) "
                             f"without tensor parallelism, got {tuple(vocab_range)}")
    valid = min(max(stop - start, 0), v_local)  # a wrong range reads no column past the shard
    return LogprobOptions(group, start, valid, int(ignore_index), stop if world == 1 else 0,
                          scale, softcap, rows, (v_local, *seq_rows, start, stop),
                          batch_invariant)


def _vocab_range(vocab_range) -> tuple:
    """``(start, stop)`` from a pair of ints, or an error naming ``vocab_range``."""
    try:
        start, stop = vocab_range
    except (TypeError, ValueError):
        raise TypeError(f"vocab_range must be a pair (start, stop), got {vocab_range!r}") from None
    wrong = TypeError(f"vocab_range must hold two ints, got {vocab_range!r}")
    if isinstance(start, bool) or isinstance(stop, bool):
        raise wrong
    try:
        return operator.index(start), operator.index(stop)
    except TypeError:
        raise wrong from None


def inverse_temperature(temperature, target, like):
    """``(1 / temperature, unusable)`` on ``like``'s device: one element, or one per token.

    A float must be finite and > 0, and its inverse finite in the compute dtype
    (``ValueError``). A tensor's values cannot be checked without
    a host sync: ``unusable`` marks its elements that are not (NaN, inf, zero or negative, also
    once cast to the compute dtype), whose tokens get NaN outputs (``finish``); the kernels see
    1 there instead. ``unusable`` is None for a float."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    if isinstance(temperature, torch.Tensor):
        if temperature.requires_grad and torch.is_grad_enabled():
            raise ValueError("temperature is not differentiated: pass it detached")
        if not temperature.is_floating_point():
            raise TypeError(f"temperature must be a float tensor, got {temperature.dtype}")
        if temperature.numel() != 1 and tuple(temperature.shape) != tuple(target.shape):
            raise ValueError(f"a temperature tensor must have the target's shape "
                             f"{tuple(target.shape)} or one element, got "
                             f"{tuple(temperature.shape)}")
        inv = 1.0 / temperature.to(device=like.device, dtype=dtype).reshape(-1)
        usable = torch.isfinite(inv) & (inv > 0)
        return torch.where(usable, inv, torch.ones((), dtype=dtype, device=like.device)), ~usable
    value = checks.number("temperature", temperature)
    # as for a tensor, the inverse must be finite in the compute dtype: 1 / T of a T below
    # ~2.9e-39 overflows fp32
    if not (math.isfinite(value) and value > 0 and 1.0 / value <= torch.finfo(dtype).max):
        raise ValueError(f"temperature must be a finite float > 0 whose inverse is finite in "
                         f"{dtype}, got {temperature!r}")
    return torch.full((1,), 1.0 / value, dtype=dtype, device=like.device), None


def shaped(lp, ent, col, shape, return_entropy, return_argmax) -> TokenLogprobs:
    return TokenLogprobs(lp.view(shape), ent.view(shape) if return_entropy else None,
                         col.view(shape) if return_argmax else None)
