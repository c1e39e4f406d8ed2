"""torchrun worker: ``batch_invariant=True`` under tensor parallelism (``tests/_invariance.py``).

    torchrun --nproc-per-node N tests/_batch_invariant_worker.py [triton] [torch]

Every rank builds the same block, batches and weights (fixed seeds) and keeps its vocabulary
shard; the block's outputs must be the same bits alone and in every batch, under every budget's
strategy, for the three ops, fp32 and bf16, and the same bits on every rank. gloo on the CPU;
``VPL_TEST_DEVICE=cuda:0`` puts every rank on GPU 0 (the GPU tests).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from tests._invariance import OPS, block_case, check_block, run, weights
from tests._torchrun import end_worker, init_worker_process_group, run_checks
from vocab_parallel_loss import backends

# 151 columns a rank at TP=2; ``VPL_INVARIANT_HV="H,V"`` for other sizes (the GPU test)
H, V = (int(x) for x in os.environ.get("VPL_INVARIANT_HV", "24,302").split(","))
BLOCK = 5


def check(op, dtype, impl, device):
    world, rank = dist.get_world_size(), dist.get_rank()
    v_local = V // world
    cols = slice(rank * v_local, (rank + 1) * v_local)
    c, b = weights(H, V, dtype, device)
    block = block_case(BLOCK, V if op == "token_logprobs" else H, V, dtype, device)
    group = dist.group.WORLD
    check_block(op, block, c, b, impl=impl, tp_group=group, cols=cols)
    for out in run(op, *block, c, b, impl, tp_group=group, cols=cols):  # the same on every rank
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out.contiguous())
        assert all(torch.equal(g, out) for g in gathered), "ranks disagree"


def main() -> int:
    device = init_worker_process_group()
    impls = sys.argv[1:] or ["triton", "torch"]
    cases = []
    for impl in impls:
        for op in OPS:
            for dtype in (torch.float32, torch.bfloat16):
                def case(op=op, dtype=dtype, impl=impl):
                    # the op over logits picks its backend from the device: force this one
                    backends.triton_runs = lambda t, impl=impl: impl == "triton"
                    check(op, dtype, impl, device)
                cases.append((f"{impl}/{op}/{str(dtype)[6:]}", case))
    run_checks(cases, summary="batch-invariant cases passed")
    dist.barrier()
    end_worker()  # no interpreter finalization: see tests/_torchrun.py
    return 0


if __name__ == "__main__":
    sys.exit(main())
