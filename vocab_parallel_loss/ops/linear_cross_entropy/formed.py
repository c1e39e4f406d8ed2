"""Rounding the gradients formed in forward: the fp32 ``[dE, dC, dbias]`` accumulators, scaled
by the upstream gradient and rounded once into the inputs' dtypes, one at a time, each released
as soon as it is rounded (so the second rounding never holds both), in the order of the lower
peak (``strategy.gif_round_dc_first``; the budget counts it so)."""

from __future__ import annotations

import torch


def round_formed(formed: list, scale: torch.Tensor, e: torch.Tensor, c: torch.Tensor, home,
                 backend, need_de: bool, need_dc: bool, dc_first: bool, de_fp32: bool = False):
    """``(dE, dC)`` from ``formed`` times ``scale`` (one fp32 element on the device), rounded
    once. dC goes into ``c.dtype``, or is added into ``home`` (a ``main_grad``: returned as
    None); dE into ``e.dtype``, or stays fp32 (scaled in place) where ``de_fp32`` (the caller
    sums it over the TP group first). fp32 inputs: the accumulator, scaled in place, is the
    gradient. Clears ``formed``."""
    def round_dc():
        acc, formed[1] = formed[1], None
        if home is not None:
            home.addcmul_(acc, scale)  # fp32 product and sum, rounded once into home
            return None
        out = acc if c.dtype == torch.float32 else torch.empty_like(acc, dtype=c.dtype)
        return backend.scaled_round(acc, scale, out)

    def round_de():
        acc, formed[0] = formed[0], None
        keep = de_fp32 or e.dtype == torch.float32
        return backend.scaled_round(acc, scale,
                                    acc if keep else torch.empty_like(acc, dtype=e.dtype))

    de = dc = None
    if need_dc and dc_first:
        dc = round_dc()
    if need_de:
        de = round_de()
    if need_dc and formed[1] is not None:
        dc = round_dc()
    formed.clear()
    return de, dc
