"""The multi-GPU scripts on CPU: the scaling benchmark under torchrun (2 gloo ranks, tiny
shapes), its JSON and the run summary; ``run_multigpu.sh``'s plan for an 8-GPU machine (dry run).

The GPU runs themselves (nccl, TP = 2, 4, 8) need the multi-GPU machine:
``benchmarks/run_multigpu.sh``.
"""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests._torchrun import REPO, run_torchrun

BENCHMARKS = REPO / "benchmarks"
BENCH = BENCHMARKS / "bench_scaling.py"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_bench_scaling_cpu_smoke(tmp_path):
    out = tmp_path / "scaling"
    log = run_torchrun(BENCH, 2, "--cpu-smoke", "--out-dir", str(out), timeout=300)
    assert "bench_scaling: wrote" in log
    report = json.loads((out / "scaling.json").read_text())
    meta = report["meta"]
    assert meta["world_size"] == 2 and meta["backend"] == "gloo" and meta["cpu_smoke"]
    assert meta["tp_sizes"] == [1, 2]
    assert meta["env"]["NCCL_NVLS_ENABLE"] == "0"
    vocabs = meta["vocab"]
    # one scaling row per (V, TP), with finite timings and the derived ratios
    assert {(s["vocab"], s["tp"]) for s in report["scaling"]} == {(v, t) for v in vocabs for t in (1, 2)}
    for s in report["scaling"]:
        assert s["v_local"] == -(-s["vocab"] // s["tp"])
        for key in ("kernel_single_shard_ms", "ours_tp_ms", "collective_ms"):
            assert s[key] is not None and math.isfinite(s[key]) and s[key] >= 0, (key, s)
        assert s["collective_over_kernel"] is not None
        assert s["meets_target"] is None if s["tp"] == 1 else isinstance(s["meets_target"], bool)
    impls = {r["impl"] for r in report["results"]}
    assert {"ours", "kernel"} <= impls
    for r in report["results"]:
        assert r["error"] is None, r
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["total_ms"] > 0, r
    if importlib.util.find_spec("megatron") is not None:
        native = [r for r in report["results"] if r["impl"] == "megatron_native"]
        assert len(native) == len(report["scaling"]), report["notes"]
        # megatron-core's loss on the same shards: the same per-token loss
        assert all(r["max_abs_loss_diff_vs_ours"] < 1e-4 for r in native), native
    md = (out / "scaling.md").read_text()
    assert "collective / kernel" in md and "CPU smoke" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "scaling.png").stat().st_size > 0

    # the run summary over that output, with a pretraining pair and two step records
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir / "scaling")
    (run_dir / "logs").mkdir()
    (run_dir / "pretrain").mkdir()
    (run_dir / "logs" / "tests_core_tp2.log").write_text("tp_worker: 53 cases passed on 2 ranks (cpu, gloo)\n")
    (run_dir / "logs" / "tests_core_tp2.status").write_text("100\t0\t9\ttorchrun ...\n")
    (run_dir / "logs" / "scaling.status").write_text("200\t0\t20\ttorchrun ...\n")
    for variant, losses in (("ours", [8.0, 7.5]), ("native", [8.0, 7.5 + 2e-6])):
        (run_dir / "pretrain" / f"tp2_{variant}.json").write_text(json.dumps(dict(
            losses=losses, first_loss=losses[0], final_loss=losses[-1], step_time_s=0.1,
            tokens_per_s=1e5, peak_memory_gib=None, train_iters=2, device="cpu")))
    subprocess.run([sys.executable, str(BENCHMARKS / "summarize_multigpu.py"), str(run_dir),
                    "--mode", "cpu", "--ngpus", "2"], check=True, timeout=60)
    summary = (run_dir / "summary.md").read_text()
    assert "53 cases passed on 2 ranks" in summary
    assert "2.00e-06" in summary  # the loss curves' largest difference, ours vs native
    assert "All steps passed." in summary
    assert summary.index("tests_core_tp2") < summary.index("| scaling |")


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_multigpu_plan_for_eight_gpus(tmp_path):
    env = dict(os.environ, DRY_RUN="1", MODE="gpu", OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(BENCHMARKS / "run_multigpu.sh"), "8"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in plan
    assert "-u TRITON_INTERPRET VPL_TEST_DEVICE=cuda" in plan  # the workers on nccl, one GPU a rank
    for tp in (2, 4, 8):
        assert f"--nproc-per-node={tp} tests/cross_entropy/_distributed_worker.py" in plan
        assert f"--nproc-per-node={tp} tests/linear_cross_entropy/_distributed_worker.py" in plan
        for variant in ("ours", "native", "native_fused"):
            assert f"--tensor-model-parallel-size {tp} " in plan
            assert f"pretrain/tp{tp}_{variant}.json" in plan
    assert "--native-loss --cross-entropy-loss-fusion" in plan
    assert "--nproc-per-node=8 benchmarks/bench_scaling.py --out-dir" in plan
    assert "TRITON_INTERPRET=1" not in plan  # the GPU runs compile the kernels
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
