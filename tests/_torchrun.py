"""torchrun from pytest: launch a worker script (gloo on CPU), and the workers' side of it.

Test side: ``run_torchrun`` runs a script and fails the test with the workers' output;
``torchrun_results`` also hands the script a JSON path and returns what the ranks recorded.
``device`` (``$VPL_TEST_DEVICE`` in the workers): ``"cpu"`` (gloo; the Triton kernels through
Triton's interpreter), ``"cuda"`` (nccl, one GPU a rank: ``LOCAL_RANK``) or ``"cuda:N"`` (every
rank on GPU N, over gloo: NCCL refuses two ranks on one GPU, and gloo runs every collective the
package uses on CUDA tensors, so one GPU can hold a whole TP group).
Worker side: ``run_checks`` runs named checks on every rank, gathers the outcomes, and rank 0
writes them as JSON to the path the launcher gave (``$VPL_TORCHRUN_RESULTS``); without it (a
worker launched by hand or by benchmarks/run_multigpu.sh) it prints and exits non-zero on a
failure. ``gather_results`` is its last step, for workers that run their checks themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


RESULTS_ENV = "VPL_TORCHRUN_RESULTS"
DEVICE_ENV = "VPL_TEST_DEVICE"


def run_torchrun(script, nproc: int, *args: str, timeout: float = 900, env=None, cwd=REPO,
                 device: str | None = None) -> str:
    """Run ``script`` on ``nproc`` ranks; fail the test with the workers' output on error.
    ``env``: the workers' environment (default this process's); the repository is put first on
    its PYTHONPATH unless that names it already (where it is kept). ``device``: the workers'
    ``$VPL_TEST_DEVICE`` (default: the environment's, else ``"cpu"``)."""
    env = dict(os.environ if env is None else env)
    if device is not None:
        env[DEVICE_ENV] = device
    if env.get(DEVICE_ENV, "cpu").startswith("cuda"):
        env.pop("TRITON_INTERPRET", None)  # the kernels compile for the GPU
    else:
        env.setdefault("TRITON_INTERPRET", "1")
    if str(REPO) not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed ({proc.returncode}):\n{out[-8000:]}")
    return out


def torchrun_results(script, nproc: int, *args: str, results: Path, timeout: float = 900,
                     env=None, cwd=REPO, device: str | None = None) -> dict:
    """Run ``script`` on ``nproc`` ranks with ``$VPL_TORCHRUN_RESULTS=results`` and return the
    JSON its rank 0 wrote there: ``{check: {"ok": bool, "error": str, ...}}`` (see
    ``gather_results``). A launch that failed returns what was written when that records a failed
    check (each test reports its own); else (no results, or none failed) it fails the test with
    the workers' output."""
    env = dict(os.environ if env is None else env, **{RESULTS_ENV: str(results)})
    try:
        out = run_torchrun(script, nproc, *args, timeout=timeout, env=env, cwd=cwd, device=device)
    except AssertionError:
        if Path(results).exists():
            got = json.loads(Path(results).read_text())
            if not all(r["ok"] for r in got.values()):
                return got
        raise
    if not Path(results).exists():
        raise AssertionError(f"torchrun {script} x{nproc} wrote no results:\n{out[-8000:]}")
    return json.loads(Path(results).read_text())


def check_passed(results: dict, name: str) -> dict:
    """One check's record from ``torchrun_results``; fails the test with its error."""
    failed = [r["error"] for r in results.values() if not r["ok"]]
    assert name in results, (f"the worker did not run {name!r} (ran: {sorted(results)})"
                             + (f"; it stopped at:\n{failed[0]}" if failed else ""))
    r = results[name]
    assert r["ok"], r.get("error")
    return r


# ------------------------------------------------------------------------------ worker side
def run_checks(checks, *, keep_going: bool = False, summary: str = "cases passed") -> dict:
    """In a torchrun worker: run each ``(name, check)`` (``check()`` returns None or a dict of
    JSON-able values) on every rank, then ``gather_results``. A check that raises is recorded as
    ``{"ok": False, "error": ...}``; unless ``keep_going`` (checks that end on a barrier, so the
    ranks stay paired), the worker stops at the first failure: it prints the error, writes what
    it has, and exits non-zero, so that torchrun ends the other ranks (which may wait in a
    collective the failed rank never reaches). Returns the merged results on every rank."""
    import torch.distributed as dist

    results = {}
    for name, check in checks:
        try:
            results[name] = {"ok": True, **(check() or {})}
        except Exception as ex:  # recorded, reported by the pytest side
            error = f"rank {dist.get_rank()}: {name}: {ex!r}\n{traceback.format_exc()}"
            results[name] = {"ok": False, "error": error}
            if not keep_going:
                print(f"FAILED {error}", file=sys.stderr, flush=True)
                _write(results)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        if keep_going:
            dist.barrier()
    return gather_results(results, summary=summary)


def gather_results(results: dict, summary: str = "cases passed") -> dict:
    """In a torchrun worker, after its checks: all-gather every rank's ``{check: {"ok": bool,
    ...}}`` (a failure seen by any rank counts: that rank's record is kept, else rank 0's), and
    rank 0 writes the merge to ``$VPL_TORCHRUN_RESULTS`` (when set) and prints ``N <summary> on
    W ranks`` when every check passed. A failure makes the worker exit non-zero (after the
    write), so a launch without a results file fails too. Returns the merge."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    merged = {}
    for name in gathered[0]:
        bad = [r[name] for r in gathered if not r.get(name, {"ok": False})["ok"]]
        merged[name] = bad[0] if bad else gathered[0][name]
    failed = [name for name, r in merged.items() if not r["ok"]]
    if dist.get_rank() == 0:
        _write(merged)
        if failed:
            for name in failed:
                print(f"FAILED {merged[name].get('error', name)}", file=sys.stderr, flush=True)
        else:
            print(f"{len(merged)} {summary} on {dist.get_world_size()} ranks "
                  f"({os.environ.get(DEVICE_ENV, 'cpu')}, {dist.get_backend()})", flush=True)
    if failed:
        dist.barrier()  # rank 0 has written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return merged


def _write(results: dict) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


def compiled_collectives_run(device) -> bool:
    """In a torchrun worker: whether its torch.compile'd TP cases can run on ``device``. Dynamo
    turns torch.distributed collectives into PyTorch's functional collectives, which end the
    process (a segmentation fault, torch 2.11 on H100 and H200) on a gloo group with CUDA
    tensors, as when the ranks share one GPU; gloo with CPU tensors and NCCL run them."""
    import torch.distributed as dist

    return device.type != "cuda" or dist.get_backend() != "gloo"


def init_worker_process_group():
    """In a torchrun worker: the process group and this rank's device, from
    ``$VPL_TEST_DEVICE``: ``cpu`` (default), gloo; ``cuda``, nccl on this rank's GPU
    (``LOCAL_RANK``; how benchmarks/run_multigpu.sh runs the workers); ``cuda:N``, every rank on
    GPU N over gloo (see the module's docstring). Returns the device."""
    import torch
    import torch.distributed as dist

    spec = os.environ.get(DEVICE_ENV, "cpu")
    if spec == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    if spec.startswith("cuda:"):
        device = torch.device(spec)
        if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
            raise RuntimeError(f"{DEVICE_ENV}={spec}: no such CUDA device here")
        torch.cuda.set_device(device)
        dist.init_process_group("gloo")
        return device
    if spec != "cpu":
        raise ValueError(f"{DEVICE_ENV}={spec!r}: expected cpu, cuda or cuda:N")
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

