"""Viewing ``(..., V)`` logits as rows without copying them."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowView(NamedTuple):  # a NamedTuple: built on every call, cheaper than a dataclass
    """``tensor`` read as rows ``n = i0 * D1 + i1`` starting at ``i0 * s0 + i1 * s1``.

    Rows are numbered in the row-major order of the leading dims, the order of
    ``target.reshape(-1)``; the vocabulary dim has unit stride.
    """

    tensor: torch.Tensor
    D1: int
    s0: int
    s1: int

    @property
    def rows(self) -> int:
        return self.tensor.numel() // max(1, self.vocab)

    @property
    def vocab(self) -> int:
        return self.tensor.shape[-1]

    def as3d(self) -> torch.Tensor:
        d0 = self.rows // max(1, self.D1)
        return self.tensor.as_strided((d0, self.D1, self.vocab), (self.s0, self.s1, 1),
                                      self.tensor.storage_offset())


def _two_levels(shape, strides):
    """Merge the leading dims into at most two (size, stride) levels, or None."""
    levels = []
    for size, stride in zip(shape, strides):
        if size == 1:
            continue
        if levels and levels[-1][1] == stride * size:
            levels[-1] = (levels[-1][0] * size, stride)
        else:
            levels.append((size, stride))
    if len(levels) > 2:
        return None
    while len(levels) < 2:
        levels.insert(0, (1, 0))
    return levels


def row_view(t: torch.Tensor) -> RowView:
    """A RowView of ``t``; copies only for layouts no two-level view can describe."""
    shape = t.shape
    if len(shape) == 2 and (shape[1] == 1 or t.stride(1) == 1):
        # the common (N, V) case, short-cut: what _two_levels gives for one level
        return RowView(t, 1, 0, 0) if shape[0] == 1 else RowView(t, shape[0], 0, t.stride(0))
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    levels = _two_levels(t.shape[:-1], t.stride()[:-1])
    if levels is None:
        t = t.contiguous()
        levels = _two_levels(t.shape[:-1], t.stride()[:-1])
    (_, s0), (d1, s1) = levels
    return RowView(t, d1, s0, s1)


def like_rows(view: RowView) -> RowView:
    """A new uninitialised tensor shaped like ``view.tensor``, as a RowView with the same rows."""
    out = torch.empty_like(view.tensor)
    if out.stride() == view.tensor.stride():
        return RowView(out, view.D1, view.s0, view.s1)
    out = torch.empty(view.tensor.shape, dtype=view.tensor.dtype, device=view.tensor.device)
    v = view.vocab
    return RowView(out, view.D1, view.D1 * v, v)


def may_overlap(view: RowView) -> bool:
    """Whether two elements of ``view``'s rows may share memory (an expanded or overlapping
    view). Sorted by stride, levels that do not overlap each start past the extent of the
    smaller ones; a layout this cannot show apart counts as overlapping."""
    d0 = view.rows // max(1, view.D1)
    levels = sorted((s, n) for n, s in ((d0, view.s0), (view.D1, view.s1), (view.vocab, 1))
                    if n > 1)
    extent = 0  # the last element the smaller levels reach
    for stride, size in levels:
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False
