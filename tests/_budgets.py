"""Memory budgets that force a strategy of the fused linear engine, from the accounting the
engine itself uses (``ops/fused_linear/strategy.py``)."""

from __future__ import annotations

import torch

from vocab_parallel_loss import settings
from vocab_parallel_loss.ops.fused_linear.strategy import fallback_chunk_bytes, recompute_de_bytes


def one_saved_tile_budget(K, n: int, h: int, v: int, size: int, cfg, need_de: bool = True,
                          sequence_parallel: bool = False, tiles: int = 1,
                          e_size: int | None = None, device=None) -> int:
    """The budget that saves the first tile (or ``tiles`` tiles) of the logits and recomputes
    the rest: the larger of the recompute path's memory (the dlogits chunk beside the fp32 dE)
    and an fp32 head's forward parts (``K.parts_bytes``), plus the saved tiles. ``size``: the
    tiles' element size (4 when either operand is fp32: an fp32 weight); ``e_size``: the hidden
    states' (default ``size``), the dE returned; ``device``: the operands' (default the CPU)."""
    chunk = fallback_chunk_bytes(n, v, size, cfg.chunk_bytes, cfg)  # whole tiles, at least one
    e_size = size if e_size is None else e_size
    hold, rounding = recompute_de_bytes(n, h, e_size, need_de, sequence_parallel)
    dtype = {2: torch.bfloat16, 4: torch.float32}
    parts = K.parts_bytes(n, h, v, dtype[e_size], dtype[size], device or torch.device("cpu"),
                          cfg)
    return (max(hold + chunk, rounding, parts)
            + K.saved_bytes(n, tiles * cfg.fwd_block_v, size, cfg))


def device_columns(K, columns: int, device) -> int:
    """``columns`` written for the interpreter's tiles (``INTERPRET_CONFIG.fwd_block_v``), carried
    over to ``device``'s: as many whole tiles and the same remainder, so that a shard spanning
    several tiles on the CPU spans several of a GPU's wider ones too."""
    whole, rest = divmod(columns, K.INTERPRET_CONFIG.fwd_block_v)
    return whole * K.default_config(device).fwd_block_v + rest


def narrow_chunk_config(K, device):
    """For a budget between the saved and the recompute strategies on a GPU: the configuration
    ``K.default_config(device)`` gives, with backward chunks a tile wide; None on the CPU, where
    the interpreter's chunks are that narrow already. A GPU's default chunk
    (128 MiB) holds every column of a test's shard, and the recompute path then needs about what
    saving every tile does: no budget would save the first tiles and recompute the rest."""
    if device.type != "cuda" or settings.interpreting():
        return None
    return K.default_config(device).replace(chunk_bytes=1)
