"""Memory budgets that force a strategy of the fused linear engine, from the accounting the
engine itself uses (``ops/fused_linear/strategy.py``)."""

from __future__ import annotations

from vocab_parallel_loss.ops.fused_linear.strategy import recompute_de_bytes


def one_saved_tile_budget(K, n: int, h: int, v: int, size: int, cfg, need_de: bool = True,
                          sequence_parallel: bool = False, tiles: int = 1) -> int:
    """The budget that saves the first tile (or ``tiles`` tiles) of the logits and recomputes
    the rest: the recompute path's memory (the dlogits chunk beside the fp32 dE) plus the
    saved tiles."""
    block = cfg.bwd_block_v
    chunk = min(cfg.chunk_bytes, n * -(-v // block) * block * size)
    hold, rounding = recompute_de_bytes(n, h, size, need_de, sequence_parallel)
    return max(hold + chunk, rounding) + K.saved_bytes(n, tiles * cfg.fwd_block_v, size, cfg)
