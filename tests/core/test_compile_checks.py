"""Checks that read the device run at run time under torch.compile, inside registered ops: the
ops pass opcheck and do what the eager checks do."""

from __future__ import annotations

import pytest
import torch


def test_shapes_op_passes_opcheck_and_reads_new_shapes_only():
    from vocab_parallel_loss import communication
    from vocab_parallel_loss.autograd import compiled_ops as ops

    gathered = torch.zeros(2, communication.stats_size(4, 3))
    gathered[:, 12] = 7  # both ranks: 7 vocabulary columns
    torch.library.opcheck(ops.shapes_agree, (gathered, 4, 3, [7], ""))
    assert bool(ops.shapes_agree(gathered, 4, 3, [7], ""))
    gathered[1, 12] = 8
    # 7 was verified: no host read, the device answer only; 8 is new: read, raise
    assert not bool(ops.shapes_agree(gathered, 4, 3, [7], ""))
    with pytest.raises(ValueError, match=r"vocab shards differ .* sizes per rank \[7, 8\]"):
        ops.shapes_agree(gathered, 4, 3, [8], "")
