"""``--vocab-parallel-loss-fp32-head``: the flags in-process; on real megatron-core objects under TP=2
(one ``torchrun`` of ``_fp32_head_worker.py``, gloo on CPU): the output weight stays fp32 through
megatron-core's ``Float16Module`` and DDP, the loss and gradients equal fp64 cross entropy of the
bf16 hidden states @ the fp32 weight, checkpoints keep it fp32, and the refusals."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests._torchrun import check_passed, torchrun_results

pytest.importorskip("megatron.core")

WORKER = Path(__file__).resolve().parent / "_fp32_head_worker.py"


def test_fp32_head_flags_parse():
    from vocab_parallel_loss.megatron import VocabParallelLossConfig, add_vocab_parallel_loss_args, guard

    try:
        parser = add_vocab_parallel_loss_args(argparse.ArgumentParser())
    finally:
        guard.disarm()
    args = parser.parse_args(["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear",
                              "--vocab-parallel-loss-fp32-head", "--vocab-parallel-loss-fp32-precision", "tf32"])
    cfg = VocabParallelLossConfig.from_args(args)
    assert cfg == VocabParallelLossConfig(enabled=True, fused_linear=True, fp32_head=True, fp32_precision="tf32")
    default = VocabParallelLossConfig.from_args(parser.parse_args(["--vocab-parallel-loss"]))
    assert not default.fp32_head and default.fp32_precision == "fp32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--vocab-parallel-loss-fp32-precision", "bf16"])
    with pytest.raises(ValueError, match="--vocab-parallel-loss"):
        VocabParallelLossConfig.from_args(parser.parse_args(["--vocab-parallel-loss-fp32-head"]))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun_results(WORKER, 2, results=tmp_path_factory.mktemp("fp32_head") / "results.json",
                            timeout=300)


@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.parametrize("check", ["conversion_and_loss", "sequence_parallel_main_grad", "checkpoint",
                                   "errors", "output_processor", "mtp"])
def test_fp32_head_on_megatron_core(results, check):
    """See the check's docstring in _fp32_head_worker.py."""
    r = check_passed(results, check)
    if "skipped" in r:
        pytest.skip(r["skipped"])
    if check == "conversion_and_loss":
        assert r["fused_loss_err"] <= 2e-5 and r["logits_loss_err"] <= 2e-5
