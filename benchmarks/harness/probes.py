"""Yardsticks measured next to the losses: the device-to-device copy bandwidth (the memory
bound's BW), the host overhead of one call of this package (with two yardsticks of the host's
own speed), the TP statistics collective on a 1-rank group and, under torchrun, this package's
collective alone on a TP group; and their sections of a markdown report."""

from __future__ import annotations

import functools
import json
from typing import Callable, List

import torch

from . import dist
from .report import reason
from .timing import Device, timed_pairs


def measure_bandwidth(dev: Device, gib: float) -> dict:
    """Device-to-device copy; bytes read + written over the median time."""
    nbytes = int(gib * (1 << 30)) if dev.cuda else 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev.torch).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = dev.median_ms(timed_pairs(dev, lambda: dst.copy_(src), 20 if dev.cuda else 5))
    return {"copy_bytes": nbytes, "copy_ms": ms, "copy_TBps": 2 * nbytes / (ms * 1e-3) / 1e12}


@functools.lru_cache(maxsize=None)
def _noop_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def noop(x_ptr, n):
        tl.store(x_ptr + tl.arange(0, 16), tl.zeros((16,), tl.float32), mask=tl.arange(0, 16) < n)

    return noop


def measure_host_overhead(dev: Device, n_calls: int) -> dict:
    """Per-forward host overhead of ours on a tiny input (Python + launches), eager and graphed,
    next to two yardsticks timed in the same process: two bare ``torch.empty`` calls and one
    launch of a one-line Triton kernel through Triton's own launch path. The H200 hosts run the
    same code at up to 2x different speeds between processes and moments (docs/performance.md);
    the yardsticks say how fast this process's host was."""
    from vocab_parallel_loss import cross_entropy

    x = torch.randn(8, 128, device=dev.torch, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 128, (8,), device=dev.torch)
    g = torch.rand(8, device=dev.torch)
    out = {"shape": [8, 128],
           "forward": dev.host_us(lambda: cross_entropy(x, t), n_calls),
           "forward_backward": dev.host_us(
               lambda: torch.autograd.grad(cross_entropy(x, t), x, g), n_calls),
           "yardstick_torch_empty_x2": dev.host_us(
               lambda: (torch.empty(8, device=dev.torch), torch.empty(8, device=dev.torch)),
               n_calls)}
    try:
        noop, buf = _noop_kernel(), torch.empty(16, device=dev.torch)
        out["yardstick_triton_launch"] = dev.host_us(lambda: noop[(1,)](buf, 8), n_calls)
    except Exception as e:  # no Triton here (or no interpreter on CPU): the other figures stand
        out["yardstick_triton_launch"] = {"error": f"{type(e).__name__}: {e}"}
    if dev.cuda:
        try:
            xs = x.detach()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    cross_entropy(xs, t)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                cross_entropy(xs, t)
            out["forward_graph_replay"] = dev.host_us(graph.replay, n_calls)
        except Exception as e:  # keep the eager figures if the capture fails
            out["forward_graph_replay"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def measure_collective(dev: Device, n: int) -> dict:
    """The TP statistics collective at N tokens on a 1-rank group. Ours skips it at world size 1,
    so the collectives are called directly: one all-gather of the packed (4, N) fp32 stats, and
    the two-all-reduce alternative (MAX of (N,), then SUM of (3, N)) for comparison."""
    import torch.distributed as tdist

    group = dist.one_rank_group(dev)
    stats = torch.randn(4, n, device=dev.torch)
    gathered = torch.empty(tdist.get_world_size(group) * 4, n, device=dev.torch)
    mx, rest = stats[0].clone(), stats[1:].clone()

    def all_gather():
        tdist.all_gather_into_tensor(gathered, stats, group=group)

    def two_all_reduces():
        tdist.all_reduce(mx, op=tdist.ReduceOp.MAX, group=group)
        tdist.all_reduce(rest, group=group)

    out = {"n": n, "world_size": tdist.get_world_size(group), "backend": tdist.get_backend(group)}
    for name, fn in (("all_gather_4xN", all_gather), ("all_reduce_max_then_sum", two_all_reduces)):
        try:
            for _ in range(10):
                fn()
            stamps = timed_pairs(dev, fn, 200 if dev.cuda else 20)
            out[name] = {"us_median": dev.median_ms(stamps) * 1e3,
                         **dev.host_us(fn, 200 if dev.cuda else 20)}
        except Exception as e:  # e.g. a backend without all_gather_into_tensor
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def measure_gather_stats(clock, group, n_rows: int, reps: int, warmup: int) -> float:
    """Median ms of this package's forward collective alone (``communication.gather_stats`` of
    (4, N) fp32 statistics) on ``group``, every rank aligned before each call
    (``dist.AlignedDevice``) and the host waiting for each."""
    from vocab_parallel_loss import communication

    # the forward's send buffer: (4, N) statistics and the shard's shapes
    stats = torch.randn(communication.stats_size(4, n_rows), dtype=torch.float32,
                        device=clock.torch)

    def gather():
        communication.gather_stats(stats, group)

    timed_pairs(clock, gather, warmup, clock.align, sync_each=True)
    return clock.median_ms(timed_pairs(clock, gather, reps, clock.align, sync_each=True))


def measure_extras(dev: Device, log: Callable[[str], None]) -> dict:
    """``host_overhead_no_group``, ``collective`` and ``host_overhead``, in that order: the host
    overhead before and after the collective has made a process group (a training process
    always has one); on the H200 the group made no difference beyond the spread between
    processes. A failing one holds its ``error``."""
    calls = 1000 if dev.cuda else 50
    out = {}
    for key, fn in (("host_overhead_no_group", lambda: measure_host_overhead(dev, calls)),
                    ("collective", lambda: measure_collective(dev, 16384)),
                    ("host_overhead", lambda: measure_host_overhead(dev, calls))):
        try:
            out[key] = fn()
        except Exception as e:
            out[key] = {"error": reason(e)}
        log(f"{key}: {json.dumps(out[key])}")
    return out


def markdown(report: dict) -> List[str]:
    """The report's sections of ``collective``, ``host_overhead`` and ``host_overhead_no_group``
    (those present)."""
    lines = []
    c = report.get("collective")
    if c:
        lines += ["## TP statistics collective", ""]
        if "error" in c:
            lines += [f"failed: {c['error']}", ""]
        else:
            lines += [f"N = {c['n']}, world size {c['world_size']} ({c['backend']}); GPU time per "
                      "call (median), host time per call:", ""]
            for k in ("all_gather_4xN", "all_reduce_max_then_sum"):
                v = c.get(k, {})
                lines.append(f"- {k}: " + (v["error"] if "error" in v else
                                             f"{v['us_median']:.1f} us GPU, {v['host_us']:.1f} us host"))
            lines.append("")
    for key, title in (("host_overhead", "with the process group of the collective above"),
                       ("host_overhead_no_group", "before any process group existed")):
        h = report.get(key)
        if not h:
            continue
        lines += [f"## Host overhead of ours (tiny input, per call), {title}", ""]
        if "error" in h:
            lines.append(f"failed: {h['error']}")
        lines += [f"- {k}: " + (v["error"] if "error" in v else
                               f"{v['host_us']:.1f} us host (best run "
                               f"{v.get('host_us_best', v['host_us']):.1f}), "
                               f"{v['wall_us']:.1f} us wall")
                  for k, v in h.items() if isinstance(v, dict)]
        lines.append("")
    return lines

