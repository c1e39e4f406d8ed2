"""How the fused linear engine forms its gradients under a memory budget, chosen per call.

Strategies, fastest first (docs/design.md, section 7): the forward saves every logits tile
(6NHV); the gradients are formed in forward (scalar losses without TP, and per-token losses
given the loss mask their upstream gradient is proportional to, with or without TP; 6NHV); the
first columns
saved and the rest recomputed; everything recomputed in column chunks (8NHV), the chunks
narrowed when the budget is smaller than one. The loss (``ops/linear_cross_entropy``) and the
token log-probs (``ops/linear_token_logprobs``) share the choice, and the column passes that run
it (``columns.py``).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from ... import communication


#: Extra device memory the fused linear engine may use when the caller names no budget: the
#: saved-tiles strategy up to 2 GiB of saved logits (a 16K-column TP shard up to 64K tokens, a
#: 128K vocabulary up to 8K tokens), else the fastest that fits.
DEFAULT_MEMORY_BUDGET = 2 << 30


class Strategy(NamedTuple):
    """How one call forms its gradients (``choose_strategy``)."""

    name: str = "recompute"  # "saved", "grad_in_forward" or "recompute"
    chunk_bytes: Optional[int] = None  # "recompute": the dlogits chunk, when the budget caps it
    size: Optional[int] = None  # "saved": leading columns saved (None: all); "grad_in_forward":
    # rows per chunk (None: ``LCEConfig.gif_rows``)
    # (``chunk_bytes`` for "grad_in_forward" with a loss mask: the dlogits chunk of its
    # fallback, the recompute that backward launches for any other upstream gradient)
    room: Optional[int] = None  # what the forward may allocate for a while beside what it
    # holds (the fp32 head's fp16 parts, ``fused.forward_stats``); None: the config's own


_RECOMPUTE = Strategy()


def _gif_bytes(n: int, v: int, h: int, e: torch.Tensor, c: torch.Tensor, main_grad: bool,
               sp_world: int = 1):
    """``(forward, backward rounding dC first, backward rounding dE first)``, beyond the
    gradients returned (``gif_fixed_bytes``). ``sp_world``: the ranks a sequence-parallel dE
    is reduce-scattered over (1 without): the gradient returned is their share of the rows, the
    reduce-scatter's fp32 shard is new memory beside it."""
    need_dc, need_de = c.requires_grad, e.requires_grad
    f_dc, f_de = need_dc * 4 * v * h, need_de * 4 * n * h  # the fp32 accumulators
    r_dc = 0 if main_grad else need_dc * c.element_size() * v * h  # the gradients returned
    r_de = need_de * e.element_size() * (n // sp_world) * h
    new_dc = r_dc if c.element_size() < 4 else 0  # allocated by the rounding
    new_de = r_de if e.element_size() < 4 else 0
    if sp_world > 1:
        new_de = r_de + need_de * 4 * (n // sp_world) * h * (e.element_size() < 4)
    returned = r_dc + r_de
    # live bytes at the first rounding (both accumulators and its new gradient), then at the
    # second (the first accumulator released, the gradient it became kept)
    dc_first = max(f_de + f_dc + new_dc, f_de + r_dc + new_de)
    de_first = max(f_de + f_dc + new_de, r_de + f_dc + new_dc)
    return (max(f_dc + f_de - returned, 0), max(dc_first - returned, 0),
            max(de_first - returned, 0))


def gif_round_dc_first(n: int, v: int, h: int, e: torch.Tensor, c: torch.Tensor,
                       main_grad: bool = False) -> bool:
    """Whether backward rounds the gradients formed in forward dC first: the order whose peak is
    lower. dC first where its rounding allocates nothing (into a ``main_grad``, or an fp32
    weight's accumulator that becomes its gradient) or where there are more rows than
    vocabulary rows; else dE first."""
    _, dc_first, de_first = _gif_bytes(n, v, h, e, c, main_grad)
    return dc_first <= de_first


def gif_fixed_bytes(n: int, v: int, h: int, e: torch.Tensor, c: torch.Tensor,
                    main_grad: bool = False) -> tuple:
    """``(forward, backward)``: what the gradients formed in forward hold beyond the gradients
    the call returns (``memory_budget``'s measure), in forward besides one chunk's saved tiles
    and at backward's peak. Forward: the fp32 dC and dE accumulators. Backward rounds them one
    at a time, each released once rounded, in the order ``gif_round_dc_first`` picks."""
    forward, dc_first, de_first = _gif_bytes(n, v, h, e, c, main_grad)
    return forward, min(dc_first, de_first)


def masked_gif_bytes(n: int, v: int, h: int, e: torch.Tensor, c: torch.Tensor,
                     main_grad: bool, world: int, sequence_parallel: bool,
                     fallback: int) -> tuple:
    """``(forward, backward)`` of the gradients formed in forward for a loss mask
    (``ops/linear_cross_entropy/masked.py``), as ``gif_fixed_bytes`` counts them: forward adds
    the fp32 mask kept for backward; backward holds both fp32 accumulators and the ``fallback``
    bytes of its recompute's dlogits chunk at once (launched whatever the upstream gradient,
    its kernels skip themselves when the formed gradients hold), then rounds them one at a
    time, dC first under TP (dE is summed over the group in fp32 before it is rounded)."""
    sp_world = world if sequence_parallel else 1
    held, dc_first, de_first = _gif_bytes(n, v, h, e, c, main_grad, sp_world)
    rounding = dc_first if world > 1 else min(dc_first, de_first)
    return held + 4 * n, max(held + 4 * n + fallback, rounding)


def fallback_chunk_bytes(n: int, v: int, size: int, chunk: int, cfg) -> int:
    """The dlogits buffer ``fused.backward`` allocates for ``chunk_bytes=chunk``: whole
    ``bwd_block_v`` column tiles of all ``n`` rows, at least one, at most the vocabulary."""
    block = cfg.bwd_block_v
    cols = max(block, chunk // max(n * size, 1) // block * block)
    return n * min(cols, -(-v // block) * block) * size


def choose_strategy(backend, e, c, bias, reduction: str, sequence_parallel: bool, group,
                    softcap, smoothing: float, memory_budget, main_grad: bool = False,
                    masked: bool = False, invariant: bool = False):
    """The ``Strategy``: the fastest way to form the gradients whose extra memory fits
    ``memory_budget`` bytes (docs/design.md, section 7, "Strategies"), among those the backend
    runs (``backend.STRATEGIES``).
    ``LCEConfig.strategy`` other than ``"auto"`` forces one where it applies. ``main_grad``:
    dC is added into ``c.main_grad`` (gradient-accumulation fusion), not returned. ``masked``:
    a per-token loss given its loss mask, whose gradients can be formed in forward (also under
    TP: the backend must run ``"grad_in_forward"``).

    Decided from shapes every rank shares (rows, hidden size, local vocabulary), so every rank
    takes the same path and runs the same collectives. ``invariant`` (batch-invariant
    statistics): the first columns saved are a whole number of the forward's splits
    (``invariant_tiles``), so that the statistics come from the splits of one pass."""
    if "saved" not in backend.STRATEGIES:
        return _RECOMPUTE
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    if not torch.is_grad_enabled() or not (
            e.requires_grad or c.requires_grad or (bias is not None and bias.requires_grad)):
        return Strategy(room=int(budget))  # forward only: statistics, nothing saved
    cfg = backend.default_config(e.device)
    world = communication.world_size(group)
    # the saved tiles and dlogits chunks are fp32 when either operand is (an fp32 head)
    h, v, size = e.shape[-1], c.shape[0], max(e.element_size(), c.element_size())
    cfg = cfg.for_tiles(torch.float32 if size == 4 else e.dtype)  # the tiles the kernels take
    n = e.numel() // max(h, 1) * (world if sequence_parallel else 1)
    # saved tiles (also those of the gradients in forward): without the logit, the softcap
    # slope of an underflowed probability is unknown, and smoothing needs it
    saved_ok = not (softcap and smoothing > 0)
    scalar = reduction != "none"
    masked = masked and not scalar and "grad_in_forward" in backend.STRATEGIES
    if cfg.strategy != "auto":
        ok = {"saved": saved_ok, "grad_in_forward": (scalar or masked) and saved_ok,
              "recompute": True}[cfg.strategy]
        return Strategy(cfg.strategy) if ok else _RECOMPUTE
    # fp32 dE, the TP all-reduce's operand: only where dE is formed (not for frozen inputs)
    de32 = n * h * 4 * e.requires_grad
    saved_all = backend.saved_bytes(n, v, size, cfg)
    if saved_ok and saved_all + (de32 if world > 1 else 0) <= budget:
        return Strategy("saved", room=int(budget - saved_all))
    # grad-in-forward runs one statistics all-gather per row chunk: only without TP, so that
    # ranks that disagree on V_local (an error every rank reports) cannot disagree on the path
    if scalar and world == 1 and saved_ok and n:
        forward, backward = gif_fixed_bytes(n, v, h, e, c, main_grad)
        rows = backend.gif_chunk_rows(n, v, size, budget - forward, cfg) if budget >= backward else 0
        if rows:
            room = budget - forward - backend.saved_bytes(rows, v, size, cfg)
            return Strategy("grad_in_forward", size=rows, room=int(room))
    # with a loss mask also under TP: its ranks run one all-gather per row chunk, a count that
    # follows from V_local (ranks that disagree on it, an error, may then disagree on the count)
    if masked and saved_ok and n:
        forward, _ = masked_gif_bytes(n, v, h, e, c, main_grad, world, sequence_parallel, 0)
        rows = backend.gif_chunk_rows(n, v, size, budget - forward, cfg)
        if rows:
            fallback = fallback_chunk_bytes(n, v, size, backend.saved_bytes(rows, v, size, cfg),
                                            cfg)
            _, backward = masked_gif_bytes(n, v, h, e, c, main_grad, world, sequence_parallel,
                                           fallback)
            if backward <= budget:
                room = budget - forward - backend.saved_bytes(rows, v, size, cfg)
                return Strategy("grad_in_forward", chunk_bytes=fallback, size=rows,
                                room=int(room))
    # the config's dlogits chunk as backward allocates it: whole tiles of every row, at least one
    chunk = fallback_chunk_bytes(n, v, size, cfg.chunk_bytes, cfg)
    # (the dE returned is in e's dtype, whatever the tiles')
    de_hold, de_round = recompute_de_bytes(n, h, e.element_size(), e.requires_grad,
                                           sequence_parallel and world > 1)
    recompute = max(de_hold + chunk, de_round)
    if saved_ok and n:
        # the first columns saved, the rest recomputed: 6NHV on the former, 8NHV on the latter;
        # the saved tiles live until backward returns
        tile = cfg.fwd_block_v
        per_tile = backend.saved_bytes(n, tile, size, cfg)
        # the forward's room beside the saved tiles: the fp32 head's fp16 parts, where they run
        # (their forward is faster by more than the recompute of the columns they displace),
        # unless that room leaves no column saved
        parts = backend.parts_bytes(n, h, v, e.dtype, c.dtype, e.device, cfg)
        per_split = backend.invariant_tiles(e, c, cfg) if invariant else 1
        for held in dict.fromkeys((max(recompute, parts), recompute)):
            tiles = int((budget - held) // per_tile) // per_split * per_split  # whole splits
            if tiles >= 1 and (not invariant or tiles * tile < v):
                cols = min(tiles * tile, v - 1)
                return Strategy("saved", size=cols,
                                room=int(budget - backend.saved_bytes(n, cols, size, cfg)))
    if recompute <= budget:  # the config's chunks
        return Strategy(room=int(budget))
    # chunks narrowed to the budget, down to a tile wide (the buffer is whole tiles of all the
    # rows, at least one: what it then holds beside the fp32 dE is checked against the budget)
    narrow = max(1, int(budget) - de_hold)
    held = max(de_hold + fallback_chunk_bytes(n, v, size, narrow, cfg), de_round)
    if 0 < budget < held:  # 0 asks for the least memory: no bound to break
        _warn_below_floor(int(budget), held, n, h)
    return Strategy(chunk_bytes=narrow, room=int(budget))


def _warn_below_floor(budget: int, held: int, n: int, h: int) -> None:
    """A positive budget that no strategy meets: the call holds more, and runs the slowest
    schedule (a dlogits chunk a tile wide: dE read and written once per tile of columns)."""
    warnings.warn(
        f"memory_budget={budget} bytes is below the least the fused linear engine holds for "
        f"{n} rows of hidden size {h}: {held} bytes (the fp32 (N, H) dE that the recomputed "
        "logits add into, beside one tile of columns of dlogits). This call holds that much and "
        "recomputes in chunks one tile wide, its slowest schedule. Give at least that budget, "
        "or memory_budget=0 for the least memory without this warning.", RuntimeWarning,
        stacklevel=2)


def recompute_de_bytes(n: int, h: int, size: int, need_de: bool,
                       sequence_parallel: bool) -> tuple:
    """``(while the chunks run, when it is rounded)``: what the fp32 ``(N, H)`` dE that the
    recomputed columns accumulate into holds beyond the dE returned (``memory_budget``'s
    measure). While the chunks run the returned dE does not exist yet, so the accumulator counts
    less its size; rounding it allocates that gradient beside it (nothing for fp32 inputs: the
    accumulator is the gradient). Under sequence parallelism the returned shard is a fraction
    of the gathered rows and the reduce-scatter adds its own buffer: the accumulator counts
    whole, both times. Without ``need_de`` (frozen hidden states) there is no accumulator."""
    if not need_de:
        return 0, 0
    de32 = n * h * 4
    if sequence_parallel:
        return de32, de32
    hold = max(de32 - n * h * size, 0)  # ``size``: the input's element size
    return hold, (de32 if size < 4 else hold)
