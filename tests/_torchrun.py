"""Launch a worker script under ``torchrun`` (gloo on CPU) from a pytest test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(script, nproc: int, *args: str, timeout: float = 900) -> str:
    """Run ``script`` on ``nproc`` ranks; fail the test with the workers' output on error."""
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed ({proc.returncode}):\n{out[-8000:]}")
    return out


def init_worker_process_group():
    """In a torchrun worker: gloo on CPU (default), or nccl on this rank's GPU when
    ``VPL_TEST_DEVICE=cuda`` (how benchmarks/run_multigpu.sh runs the workers). Returns the device."""
    import torch
    import torch.distributed as dist

    if os.environ.get("VPL_TEST_DEVICE", "cpu") == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def triton_runs_here() -> bool:
    """Whether the Triton kernels can run in this environment (a GPU, or the CPU interpreter)."""
    import torch

    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "1") == "1"


def end_worker() -> None:
    """The last call of a torchrun worker that passed: tear the process group down and leave
    without interpreter finalization. With gloo, a worker thread can still hold a tensor while
    the interpreter finalizes; releasing it then needs the GIL and aborts the process ("terminate
    called without an active exception"), after every check has passed."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

