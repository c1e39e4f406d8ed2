"""Masks of -inf logits for the property tests of the ops over logits: random columns, the
columns the row kernels read as one unit (a tile row, or a whole block), and rows masked
everywhere but their target."""

from __future__ import annotations

import torch

#: mask patterns ``row_mask`` knows
PATTERNS = ("columns", "tile_rows", "block", "all_but_target")


def row_mask(target, vocab, patterns, g, block, vec=1, density=0.5):
    """A ``(rows, vocab)`` bool mask (True: -inf) that never covers a kept row's target.

    ``block``/``vec``: the row kernel's block of columns and the contiguous columns one tile row
    of it reads (``kernels/logits.py``): "tile_rows" masks some tile rows in every block (their
    running max stays -inf), "block" one whole block (only where the row has several).
    "all_but_target" masks every column of the first kept row but its target. Ignored rows
    (target < 0) are masked whole: an ignored token's row may hold no finite logit at all."""
    rows = target.shape[0]
    mask = torch.zeros(rows, vocab, dtype=torch.bool)
    cols = torch.arange(vocab)
    if "columns" in patterns:
        mask |= torch.rand(rows, vocab, generator=g) < density
    if "tile_rows" in patterns:
        n_tile_rows = max(1, block // vec)
        chosen = torch.rand(n_tile_rows, generator=g) < density
        mask |= chosen[(cols % block) // vec][None, :]
    if "block" in patterns and vocab > block:
        k = int(torch.randint(0, -(-vocab // block), (1,), generator=g))
        mask[:, k * block:(k + 1) * block] = True
    kept = (target >= 0).nonzero()[:, 0]
    mask[kept, target[kept]] = False
    if "all_but_target" in patterns and kept.numel():
        r = int(kept[0])
        mask[r] = True
        mask[r, target[r]] = False
    mask[target < 0] = True
    return mask
