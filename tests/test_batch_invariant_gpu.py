"""``batch_invariant=True`` on CUDA at real sizes (run on the H200: ``pytest -m gpu
tests/test_batch_invariant_gpu.py``): a block of tokens gets the same bits alone and inside
batches of 64 to 16384 rows, at other positions and under the memory budget of every strategy
(``tests/_invariance.py``), each backend on its own; the forward's default split count varies
over these batches (checked), so the fixed one is what keeps them equal. Also TP=2 with both
ranks on GPU 0 over gloo (the CPU test's torchrun worker)."""

from __future__ import annotations

import os

import pytest
import torch

from tests._invariance import block_case, check_block, weights
from tests._torchrun import check_passed, torchrun_results
from vocab_parallel_loss.kernels import linear as K

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 37
#: (rows before the block, rows after it): the block alone, then batches of 64, 1000, 4097 and
#: 16384 rows with the block first, in the middle, near the end and split over row blocks
LAYOUTS = ((0, 0), (27, 0), (500, 463), (4000, 60), (1, 16346))
SMALL_LAYOUTS = ((0, 0), (27, 0), (500, 463), (4000, 60))


def test_the_default_split_count_varies_over_these_batches():
    # what the test below guards against: _forward_splits picks the splits from the rows
    cfg = K.default_config(torch.device("cuda"))
    counts = {K.forward_split(BLOCK + a + b, 151936, cfg, torch.device("cuda"))[0]
              for a, b in LAYOUTS}
    assert len(counts) >= 3, counts
    e = torch.empty((1, 4096), dtype=torch.bfloat16, device="cuda")
    assert K.invariant_tiles(e, e.expand(151936, 4096), cfg) * cfg.fwd_block_v < 151936


@pytest.mark.parametrize("op", ["linear_token_logprobs", "linear_cross_entropy"])
def test_linear_ops_bf16_every_strategy(op):
    h, v = 4096, 151936
    c, b = weights(h, v, torch.bfloat16, "cuda")
    block = block_case(BLOCK, h, v, torch.bfloat16, "cuda")
    seen = check_block(op, block, c, b, layouts=LAYOUTS, impl="triton")
    assert {"saved", "partial", "recompute"} <= seen, seen


def test_the_lse_of_a_mean_loss_with_gradients_in_forward():
    h, v = 4096, 151936
    c, b = weights(h, v, torch.bfloat16, "cuda")
    block = block_case(BLOCK, h, v, torch.bfloat16, "cuda")
    seen = check_block("linear_cross_entropy", block, c, b, layouts=LAYOUTS, impl="triton",
                       reduction="mean")
    assert "grad_in_forward" in seen, seen


@pytest.mark.parametrize("op", ["linear_token_logprobs", "linear_cross_entropy"])
def test_linear_ops_fp32(op):
    h, v = 1024, 32000
    c, b = weights(h, v, torch.float32, "cuda")
    block = block_case(BLOCK, h, v, torch.float32, "cuda")
    check_block(op, block, c, b, layouts=SMALL_LAYOUTS, impl="triton")


@pytest.mark.parametrize("op", ["linear_token_logprobs", "linear_cross_entropy"])
def test_linear_ops_on_the_pytorch_backend(op):
    h, v = 1024, 32011  # a last column block that is not a multiple of the alignment
    c, b = weights(h, v, torch.bfloat16, "cuda")
    block = block_case(BLOCK, h, v, torch.bfloat16, "cuda")
    check_block(op, block, c, b, layouts=SMALL_LAYOUTS, impl="torch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs(dtype, impl):
    v = 151936 if dtype == torch.bfloat16 else 32011
    c, b = weights(8, v, dtype, "cuda")  # unused by the op over logits
    block = block_case(BLOCK, v, v, dtype, "cuda")
    check_block("token_logprobs", block, c, b, layouts=LAYOUTS, impl=impl)


@pytest.mark.timeout(1800)
def test_tp2_on_one_gpu(tmp_path):
    results = torchrun_results(os.path.join(os.path.dirname(__file__),
                                            "_batch_invariant_worker.py"), 2, "triton", "torch",
                               results=tmp_path / "results.json", timeout=1800,
                               device="cuda:0",
                               env=dict(os.environ, VPL_INVARIANT_HV="1024,76032"))
    for name in results:
        check_passed(results, name)
    assert len(results) == 12
