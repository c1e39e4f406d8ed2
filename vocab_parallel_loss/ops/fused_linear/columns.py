"""The column passes of the fused linear engine, shared by the loss (``ops/linear_cross_entropy``)
and the token log-probs (``ops/linear_token_logprobs``): the statistics of a rank's columns,
saving the logits tiles of the first ones when the strategy asks, and the gradients from those
saved tiles with the remaining columns recomputed.

Both run on any ``backends.LinearBackend``; only a backend whose ``STRATEGIES`` hold
``"saved"`` is given columns to save. ``logprob`` (``formulas.LogprobArgs``) selects the
log-prob mode: five statistics merged by ``merge_logprob_stats`` and ``(6, N)`` coefficients,
else the loss's four (``merge_partial_stats``) and ``(4, N)`` (``(5, N)`` with saved tiles).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...formulas import LogprobArgs, merge_logprob_stats, merge_partial_stats


def forward_columns(backend, e2, c, bias, t, v_offset: int, softcap, need_sumx: bool,
                    saved_cols: Optional[int] = None, logprob: Optional[LogprobArgs] = None,
                    precision: str = "fp32", invariant: bool = False,
                    room: Optional[int] = None):
    """Local statistics of the columns of ``c`` (``(4, N)``, or ``(5, N)`` with ``logprob``)
    and the saved tiles (None unless ``saved_cols``): with ``saved_cols`` the logits tiles of
    the first ``saved_cols`` columns are saved (in fp32 when ``e2`` or ``c`` is fp32), the rest
    get statistics only, merged in. ``precision``: the products of fp32 operands.

    ``invariant``: batch-invariant statistics (``forward_stats``' ``invariant``). With some
    columns saved, both ranges are cut into the splits of the whole ``c``
    (``invariant_tiles``; ``saved_cols`` is a whole number of them, ``strategy.py``) and all
    their splits merged at once, so that the rows get the bits of one pass over ``c``.

    ``room``: what the forward may allocate for a while beside what it holds (the strategy's;
    ``fused.forward_stats``)."""
    extra = {} if room is None else {"room": room}
    if saved_cols is None:
        return backend.forward_stats(e2, c, bias, t, v_offset, softcap, need_sumx,
                                     logprob=logprob, precision=precision,
                                     invariant=invariant, **extra), None
    cfg = backend.default_config(e2.device, precision)
    v = c.shape[0]
    vs = min(saved_cols, v)
    tiles = torch.promote_types(e2.dtype, c.dtype)
    saved = backend.saved_tiles(e2.shape[0], vs, tiles, e2.device, cfg)
    split = {}
    if invariant and vs < v:  # splits of all of c, their statistics unmerged
        split = dict(tiles_per_split=backend.invariant_tiles(e2, c, cfg.for_tiles(tiles)),
                     parts=True)
    stats = backend.forward_stats(e2, c[:vs], None if bias is None else bias[:vs], t, v_offset,
                                  softcap, need_sumx, config=cfg, saved=saved, logprob=logprob,
                                  invariant=invariant, **split, **extra)
    if vs < v:
        rest = backend.forward_stats(e2, c[vs:], None if bias is None else bias[vs:], t,
                                     v_offset + vs, softcap, need_sumx, config=cfg,
                                     logprob=logprob, invariant=invariant, **split, **extra)
        merge = merge_partial_stats if logprob is None else merge_logprob_stats
        parts = torch.cat([stats, rest]) if invariant else torch.stack([stats, rest])
        stats = torch.stack(merge(parts, ordered=invariant))
    return stats, saved


def backward_columns(backend, e2, c, bias, t, v_offset: int, coef, softcap, need_de: bool,
                     need_dc: bool, need_db: bool, saved=None, de_final: bool = False,
                     chunk_bytes: Optional[int] = None, dc_out=None, dc_acc=None,
                     logprob: Optional[LogprobArgs] = None, precision: str = "fp32"):
    """Gradients of the columns of ``c``: from the ``saved`` tiles (which this consumes) of the
    first columns, then the rest recomputed (in chunks of ``chunk_bytes`` when given) into the
    same dE. Returns ``(dE, dC, dbias)``: dE in the accumulation dtype, or in the input dtype
    where it is final already (``de_final``: nothing sums it further, and every column was
    saved); dC in ``dc_out`` when given, None when added into ``dc_acc`` (a ``main_grad``,
    rounded once there); dbias fp32 (fp64 for float64 inputs)."""
    v = c.shape[0]
    de = db = None
    start = 0
    if saved is not None:
        cfg = backend.default_config(e2.device, precision)
        start = saved.u.shape[1]
        if need_dc and dc_acc is None and dc_out is None:
            dc_out = torch.empty_like(c, memory_format=torch.contiguous_format)
        de, _, db = backend.backward_saved(
            saved, e2, c[:start], need_db, t, v_offset, coef, softcap, need_de, need_dc,
            e2.dtype if start == v and de_final else torch.float32, cfg,
            dc_out=None if dc_out is None else dc_out[:start], logprob=logprob,
            dc_acc=None if dc_acc is None else dc_acc[:start])
        if start == v:
            return de, dc_out, db
        if logprob is None:
            coef = coef[:4]  # the loss's recompute pass takes lse, gp, gt, gc
    extra = {"precision": precision}
    if chunk_bytes:
        extra["config"] = backend.default_config(e2.device, precision).replace(
            chunk_bytes=chunk_bytes)
    de, dc, db_rest = backend.backward(
        e2, c[start:], None if bias is None else bias[start:], t, v_offset + start, coef,
        softcap, need_de, need_dc, need_db, de_acc=de,
        dc_out=None if dc_out is None else dc_out[start:],
        dc_acc=None if dc_acc is None else dc_acc[start:], logprob=logprob, **extra)
    if start == 0:
        return de, dc, db_rest
    return de, dc_out, None if db is None else torch.cat([db, db_rest])
