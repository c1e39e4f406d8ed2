"""Process groups for the benchmarks: a 1-rank group in a plain process, the world under
torchrun, megatron-core's ``parallel_state``, and decisions and figures agreed over ranks.

``no_multicast()`` keeps NVLink multicast off for the groups made after it.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from typing import Dict, List, Optional

import torch

from .timing import Device

NO_MULTICAST = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                ("NVSHMEM_DISABLE_NVLS", "1"))


def no_multicast() -> None:
    """NVLink multicast off (``NCCL_NVLS_ENABLE=0`` and friends) unless whoever launched the
    process set those variables; NCCL reads them when it creates a communicator."""
    for k, v in NO_MULTICAST:
        os.environ.setdefault(k, v)


def one_rank_group(dev: Device):
    """The world as a 1-rank group (nccl on the GPU, gloo on the CPU), made on first use."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        kw = {"device_id": dev.torch} if dev.cuda else {}
        dist.init_process_group("nccl" if dev.cuda else "gloo", rank=0, world_size=1, **kw)
    return dist.group.WORLD


def init_torchrun(cpu: bool) -> torch.device:
    """torch.distributed from torchrun's environment (a plain process: a world of one): nccl with
    one GPU a rank, or gloo on the CPU (``cpu``, or no GPU). Returns this rank's device."""
    import torch.distributed as dist

    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(k, v)
    if torch.cuda.is_available() and not cpu:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(minutes=10))
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return dev


def close() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class AlignedDevice(Device):
    """A ``Device`` whose ``align()`` lines every rank of the world up before a timed rep."""

    def __init__(self, dev: torch.device):
        super().__init__(dev)
        self._one = torch.zeros(1, device=self.torch)

    def align(self) -> None:
        """Evict L2, then line every rank of the world up (all sub-groups start together)."""
        import torch.distributed as dist

        self.flush_l2()
        dist.all_reduce(self._one)
        self.sync()


def all_agree(ok: bool, dev) -> bool:
    """True on every rank iff ``ok`` on every rank (decisions that gate collectives must agree)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if ok else 0.0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def over_ranks(values: List[float], dev) -> Dict[str, List[float]]:
    """Max and min over all ranks of each value (NaN for a rank that has none)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=dev)
    hi, lo = t.clone(), t.clone()
    hi = torch.nan_to_num(hi, nan=-math.inf)
    lo = torch.nan_to_num(lo, nan=math.inf)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return {"max": hi.tolist(), "min": lo.tolist()}


def tp_sizes(requested: Optional[str], world: int) -> List[int]:
    """The TP sizes of a run: ``requested`` (comma-separated; each must divide the world size),
    else 1, 2, 4, ... up to the world size, and the world size."""
    if requested:
        sizes = sorted({int(t) for t in requested.split(",")})
        bad = [t for t in sizes if t < 1 or world % t]
        if bad:
            raise SystemExit(f"--tp {bad}: each TP size must divide the world size {world}")
        return sizes
    sizes, t = [], 1
    while t <= world:
        if world % t == 0:
            sizes.append(t)
        t *= 2
    return sorted(set(sizes) | {world})


def megatron_tp_group(tp: int, fresh: bool):
    """megatron-core's ``parallel_state`` with TP size ``tp`` (over a group made already); its TP
    group. ``fresh``: torn down and made again when it exists (another TP size), else kept."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if not fresh:
            return parallel_state.get_tensor_model_parallel_group()
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return parallel_state.get_tensor_model_parallel_group()


def megatron_agreed_group(tp: int, notes: Dict[str, str], dev) -> Optional[object]:
    """``megatron_tp_group(tp, fresh=True)`` on every rank; None with a note in ``notes`` where it
    failed on any rank."""
    err, group = None, None
    try:
        group = megatron_tp_group(tp, fresh=True)
    except Exception as e:  # noqa: BLE001 - any failure: skip the megatron peers with a note
        err, group = f"{type(e).__name__}: {e}", None
    if not all_agree(err is None, dev):
        notes[f"megatron_tp{tp}"] = f"megatron-core parallel_state failed at TP={tp}: {err or 'on another rank'}"
        return None
    return group


def megatron_teardown() -> None:
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - no megatron-core here
        pass
