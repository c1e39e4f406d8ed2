"""Megatron integration, CPU: flags in-process; TP=2 checks in torchrun subprocesses (gloo).

The heavy checks run once per module in one ``torchrun --nproc-per-node 2`` of ``_worker.py``
(starting megatron-core twice costs more than the checks); each test reads its own result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._torchrun import check_passed, torchrun_results

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "_worker.py"
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
TINY_CONFIG = REPO / "examples" / "configs" / "tiny_gpt_tp2.yaml"


def torchrun(args, timeout: float) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2`` with this interpreter; the environment (TRITON_INTERPRET) is kept."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _fail(proc, what):
    tail = (proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-6000:])
    pytest.fail(f"{what} exited with {proc.returncode}:\n{tail}")


# ----------------------------------------------------------------------------- in-process tests
def test_flags_parse():
    from vocab_parallel_loss.megatron import VocabParallelLossConfig, add_vocab_parallel_loss_args

    parser = argparse.ArgumentParser()
    assert add_vocab_parallel_loss_args(parser) is parser  # Megatron-LM extra_args_provider contract
    args = parser.parse_args([
        "--vocab-parallel-loss", "--vocab-parallel-loss-label-smoothing", "0.1",
        "--vocab-parallel-loss-z-loss", "1e-4", "--vocab-parallel-loss-inplace-backward",
        "--vocab-parallel-loss-fused-linear", "--vocab-parallel-loss-memory-budget", "0.5",
    ])
    cfg = VocabParallelLossConfig.from_args(args)
    assert cfg == VocabParallelLossConfig(enabled=True, label_smoothing=0.1, z_loss=1e-4,
                                          inplace_backward=True, fused_linear=True,
                                          memory_budget_gib=0.5)
    assert cfg.memory_budget == 512 << 20
    assert cfg.loss_kwargs() == dict(label_smoothing=0.1, ignore_index=-100, reduction="none",
                                     z_loss=1e-4, inplace_backward=True)
    default = VocabParallelLossConfig.from_args(parser.parse_args([]))
    assert default == VocabParallelLossConfig()
    assert not default.enabled and not default.fused_linear
    # A namespace without our group (Megatron-LM run without the extra args) keeps the defaults.
    assert VocabParallelLossConfig.from_args(argparse.Namespace()) == VocabParallelLossConfig()
    with pytest.raises(ValueError):
        VocabParallelLossConfig(label_smoothing=1.5)
    with pytest.raises(ValueError, match="memory_budget"):
        VocabParallelLossConfig(memory_budget_gib=-1.0)
    assert default.memory_budget is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--vocab-parallel-loss-z-loss", "abc"])


def test_extra_args_provider_chaining():
    """with_vocab_parallel_loss_args(other): other's flags and ours; None (Megatron-LM without
    ModelOpt passes None) adds ours only."""
    from vocab_parallel_loss.megatron import guard, with_vocab_parallel_loss_args

    def other(parser):
        parser.add_argument("--other-flag", type=int, default=0)
        return parser

    try:
        args = with_vocab_parallel_loss_args(other)(argparse.ArgumentParser()).parse_args(
            ["--other-flag", "3", "--vocab-parallel-loss"])
        assert args.other_flag == 3 and args.vocab_parallel_loss
        args = with_vocab_parallel_loss_args(None)(argparse.ArgumentParser()).parse_args(["--vocab-parallel-loss"])
        assert args.vocab_parallel_loss
        assert guard.armed(), "adding the flags arms the check that they are wired"
    finally:
        guard.disarm()


# ------------------------------------------------------------------------------- torchrun tests
@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron") / "results.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    return torchrun_results(WORKER, 2, results=out, env=env, timeout=300)


_ok = check_passed


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_gpt_model_holds_vocab_parallel_cross_entropy(worker_results):
    _ok(worker_results, "holds_loss")


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_only_last_pipeline_stage_builds_the_loss(worker_results):
    _ok(worker_results, "pipeline_stages")


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_compute_language_model_loss_matches_megatron(worker_results):
    r = _ok(worker_results, "loss_matches_native")
    assert r["loss_vs_native"] <= 1e-5 and r["grad_vs_native"] <= 1e-6
    assert r["inplace_grad_vs_native"] <= 1e-6
    assert r["gathered_loss_vs_fp64"] <= 1e-5
    assert r["smoothing_loss_vs_fp64"] <= 1e-5 and r["smoothing_grad_vs_fp64"] <= 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_gpt_forward_backward_matches_native_path(worker_results):
    r = worker_results["model_and_curve"]
    assert "fwd_error" not in r and "fwd_loss_diff" in r, r.get("fwd_error") or r.get("error")
    assert r["n_params_compared"] > 10
    assert r["fwd_loss_diff"] <= 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_ten_training_steps_same_loss_curve(worker_results):
    r = _ok(worker_results, "model_and_curve")
    assert len(r["curve_ours"]) == len(r["curve_native"]) == 10
    assert max(abs(a - b) for a, b in zip(r["curve_ours"], r["curve_native"])) <= 1e-4
    assert r["curve_ours"][-1] < r["curve_ours"][0]


@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.parametrize("variant", ["tied", "untied", "tied_sp", "untied_sp", "untied_sp_recompute",
                                     "tied_main_grad", "untied_sp_recompute_main_grad"])
def test_fused_linear_gpt_matches_unfused(worker_results, variant):
    """--vocab-parallel-loss-fused-linear: TP=2 GPTModel loss and every parameter gradient equal
    our loss on materialized logits (sequence parallelism in the _sp variants), in training and
    in evaluation, and the output layer never runs; without labels the logits are the unfused
    model's (checked in the worker)."""
    r = _ok(worker_results, "fused_linear")
    assert r[f"{variant}_loss_diff"] <= 1e-5 and r[f"{variant}_eval_loss_diff"] <= 1e-5
    assert r[f"{variant}_n_params"] > 10
    assert f"{variant}_grad_max_diff" in r


@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.parametrize("variant", ["tied_unfused", "tied_fused", "untied_sp_per_token_unfused",
                                     "untied_sp_per_token_fused"])
def test_multi_token_prediction_matches_megatron(worker_results, variant):
    """mtp_num_layers=2, TP=2: megatron-core's own MTP block; every head's loss through this
    package (unfused: compute_language_model_loss per head; fused: no logits) equals megatron-core's
    MTP loss in the main per-token loss, each head's logged loss and every parameter gradient
    (sequence parallelism and calculate_per_token_loss in the untied variants); fused in evaluation
    too (checked in the worker)."""
    r = _ok(worker_results, "mtp")
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r[f"{variant}_loss_diff"] <= 1e-5 and r[f"{variant}_logged_diff"] <= 1e-5
    assert r[f"{variant}_n_params"] > 20 and f"{variant}_grad_max_diff" in r


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_mtp_acceptance_counts_without_logits(worker_results):
    """The fused path's MTP acceptance counts (megatron-core 0.20 logs them) equal the argmax of
    the full gathered logits, with and without sequence parallelism (checked in the worker)."""
    r = _ok(worker_results, "mtp_acceptance")
    assert r["sp0"] == r["sp1"] and r["sp0"][0] > 0


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_guard_refuses_a_model_without_our_loss(worker_results):
    """--vocab-parallel-loss parsed, model not wired: VocabParallelLossNotWiredError at the first
    forward naming the recipes; settings that differ from the flags are refused too (the other
    cases: checked in the worker)."""
    r = _ok(worker_results, "guard")
    assert "never wired" in r["wrapped_error"] and "wrap_model_provider" in r["wrapped_error"]
    assert "z_loss=0.0001" in r["mismatch_error"]


def _pretrain(tmp_path, *extra, device="cpu", compare=True, timeout=240):
    """The README's job, shortened, under ``torchrun --nproc-per-node 2`` (TP = 2) on ``device``
    (``--device``: ``cpu``, or ``cuda:0`` for both ranks on the one GPU); ``compare``: megatron-core's
    loss on the same logits every step (``--compare-native``)."""
    out = tmp_path / "summary.json"
    data = [] if importlib.util.find_spec("tokenizers") else ["--synthetic-data"]
    proc = torchrun([
        PRETRAIN, "--config", TINY_CONFIG, "--device", device,
        "--train-iters", "3", "--micro-batch-size", "2", "--seq-length", "32",
        "--vocab-size", "1024", "--data-max-bytes", "200000", *data,
        *(["--compare-native"] if compare else []),
        "--no-progress-bar", "--json-output", out, *extra,
    ], timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        _fail(proc, "examples/pretrain_gpt.py")
    return proc, json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_pretrain_script_fused_linear_three_steps_tp2(tmp_path):
    proc, s = _pretrain(tmp_path, "--vocab-parallel-loss-fused-linear")
    assert s["loss_impl"] == "vocab_parallel_loss" and s["fused_linear"] is True and s["tp"] == 2
    assert len(s["losses"]) == 3 and all(math.isfinite(x) for x in s["losses"])
    assert s["max_abs_loss_diff_vs_native"] <= 1e-4
    assert s["grad_diff_of"] == "output layer input" and s["max_abs_grad_diff_vs_native"] <= 1e-6
    assert "fused with the output layer" in proc.stdout and "step    3/3" in proc.stdout


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_pretrain_script_three_steps_tp2(tmp_path):
    proc, s = _pretrain(tmp_path)
    assert s["loss_impl"] == "vocab_parallel_loss" and s["tp"] == 2 and s["world"] == 2
    assert s["device"] == "cpu" and s["backend"] == "gloo"
    assert len(s["losses"]) == 3 and all(math.isfinite(x) for x in s["losses"])
    assert s["padded_vocab"] % (128 * 2) == 0 and s["padded_vocab"] >= s["vocab"]
    assert s["max_abs_loss_diff_vs_native"] <= 1e-4
    assert s["max_abs_grad_diff_vs_native"] <= 1e-6
    assert "step    3/3" in proc.stdout


# ------------------------------------------------------------------ the same job on one GPU
#: Both TP ranks on the one GPU, over gloo (NCCL refuses two ranks on one GPU).
SHARED_DEVICE = "cuda:0"


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["fp32", "bf16", "fused_linear"])
def test_pretrain_script_tp2_on_one_gpu(tmp_path, variant):
    """examples/pretrain_gpt.py at TP = 2 with both ranks on the GPU (the Triton kernels compiled
    for it, megatron-core's model on CUDA, its collectives over gloo): every step's per-token loss
    and gradient against megatron-core's own loss on the same logits (``--compare-native``)."""
    extra = {"fp32": [], "bf16": ["--bf16"], "fused_linear": ["--vocab-parallel-loss-fused-linear"]}
    proc, s = _pretrain(tmp_path, *extra[variant], device=SHARED_DEVICE, timeout=540)
    assert s["rank_device"] == SHARED_DEVICE and s["backend"] == "gloo" and s["device"] != "cpu"
    assert s["loss_impl"] == "vocab_parallel_loss" and s["tp"] == 2 and s["world"] == 2
    assert s["bf16"] == (variant == "bf16") and s["fused_linear"] == (variant == "fused_linear")
    assert len(s["losses"]) == 3 and all(math.isfinite(x) for x in s["losses"])
    assert "step    3/3" in proc.stdout
    # both losses are fp32 arithmetic on the same logits
    assert s["max_abs_loss_diff_vs_native"] <= 1e-4
    # the mean over 64 tokens: gradients below 1/64 in magnitude; bf16 rounds ours once (half
    # an ulp there is 2**-15), megatron-core's stays fp32
    assert s["max_abs_grad_diff_vs_native"] <= (1e-4 if variant == "bf16" else 1e-6)
    assert s["grad_diff_of"] == ("output layer input" if variant == "fused_linear" else "logits")


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
def test_pretrain_script_tp2_on_one_gpu_trains_as_native(tmp_path):
    """Three steps trained with our loss and three with megatron-core's (``--native-loss``), the
    same model, data and seed on the GPU: the same loss curve. Synthetic data: a tokenizer
    trained twice need not give the same tokens."""
    _, ours = _pretrain(tmp_path / "ours", "--synthetic-data", device=SHARED_DEVICE,
                        compare=False, timeout=270)
    _, native = _pretrain(tmp_path / "native", "--synthetic-data", "--native-loss",
                          device=SHARED_DEVICE, compare=False, timeout=270)
    assert ours["loss_impl"] == "vocab_parallel_loss" and native["loss_impl"] == "megatron native"
    # the first step sees the same logits; later ones, parameters updated from gradients that
    # differ in fp32 rounding
    assert abs(ours["losses"][0] - native["losses"][0]) <= 1e-4
    assert max(abs(a - b) for a, b in zip(ours["losses"], native["losses"])) <= 1e-3
