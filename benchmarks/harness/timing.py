"""Timing and peak memory on the GPU (CUDA events), with a CPU stand-in for smoke runs.

``Device``: CUDA events with an L2 flush before each timed rep on the GPU, ``perf_counter`` on the
CPU; peak memory; host time per call. The loops every benchmark times with: ``Device.bench``
(reps sized to a time budget, as ``triton.testing.do_bench``), ``timed_pairs`` and
``timed_fwd_bwd`` (a fixed number of reps, forward and backward stamped apart) and
``interleaved`` (every step once per round, in turn).
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Tuple

import torch

# the H200's SM clock, to turn a GPU sleep in microseconds into cycles
_CYCLES_PER_US = 1980


#: Timed calls per measurement at least, however long a call is.
MIN_REPS = 5


class Device:
    """Timing, synchronisation and memory statistics for CUDA, with a CPU stand-in.

    ``flush``: before each timed rep 256 MiB are zeroed, which evicts the inputs from L2 (60 MB
    on the H200), as ``triton.testing.do_bench`` does; that leaves L2 dirty and the timed kernel
    pays for the write-back. ``"clean"`` reads another 256 MiB after the zeroing, untimed, so
    the write-back happens before the rep; ``"none"``: no flush (and no 256 MiB buffer, for
    benchmarks that report absolute memory). ``gpu_lead_us``: a GPU sleep queued before each
    flush, so that the GPU has work ahead while the host issues the rep and host time cannot
    leak into the GPU timings of short steps.
    """

    def __init__(self, device="cuda", flush: str = "dirty", gpu_lead_us: float = 0.0):
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.torch = dev
        self.cuda = dev.type == "cuda"
        self._lead_cycles = int(gpu_lead_us * _CYCLES_PER_US) if self.cuda else 0
        if flush not in ("dirty", "clean", "none"):
            raise ValueError(f"flush: dirty, clean or none, not {flush!r}")
        self._flush = (torch.empty(256 << 20, dtype=torch.uint8, device=dev)
                       if self.cuda and flush != "none" else None)
        self._sweep = (torch.ones(128 << 20, dtype=torch.bfloat16, device=dev)
                       if self.cuda and flush == "clean" else None)

    # -- clocks
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.torch)

    def flush_l2(self) -> None:
        if self._lead_cycles:
            torch.cuda._sleep(self._lead_cycles)
        if self._flush is not None:
            self._flush.zero_()
        if self._sweep is not None:
            torch.amax(self._sweep)

    def stamp(self):
        """A point in time: a recorded CUDA event, or ``perf_counter()`` on the CPU."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        """Milliseconds from stamp ``a`` to stamp ``b`` (after a sync on the GPU)."""
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def median_ms(self, pairs: Iterable[tuple]) -> float:
        return statistics.median(self.ms(a, b) for a, b in pairs)

    def bench(self, fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
        """Median ms of ``fn`` with the L2 flushed before each call, the number of calls sized
        to ``warmup_ms`` and ``rep_ms`` from a first estimate (as ``triton.testing.do_bench``),
        and at least ``MIN_REPS`` timed calls (a median of one or two ~100 ms steps is noise).
        On the CPU: one call, timed."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        fn()
        self.sync()
        a = self.stamp()
        for _ in range(5):
            self.flush_l2()
            fn()
        b = self.stamp()
        self.sync()
        est = max(self.ms(a, b) / 5, 1e-3)
        for _ in range(max(1, int(warmup_ms / est))):
            fn()
        reps = max(MIN_REPS, int(rep_ms / est))
        return self.median_ms(timed_pairs(self, fn, reps, self.flush_l2))

    def host_us(self, fn: Callable[[], object], n: int, runs: int = 3) -> dict:
        """Host time per call (CPU timer, launches only) and wall time per call once synced:
        the mean over ``n`` calls in each of ``runs`` runs; the median run is reported, and the
        best one too (a mean over a run also holds whatever else the host did meanwhile)."""
        for _ in range(10):
            fn()
        host, wall = [], []
        for _ in range(runs):
            self.sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            self.sync()
            t2 = time.perf_counter()
            host.append((t1 - t0) / n * 1e6)
            wall.append((t2 - t0) / n * 1e6)
        return {"host_us": statistics.median(host), "host_us_best": min(host),
                "wall_us": statistics.median(wall), "calls": n, "runs": runs}

    # -- memory
    def empty_cache(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> int:
        """Frees what it can, resets the peak, returns the bytes allocated now (the baseline)."""
        gc.collect()
        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.torch)
        torch.cuda.reset_peak_memory_stats(self.torch)
        return torch.cuda.memory_allocated(self.torch)

    def peak(self) -> Optional[int]:
        """Peak bytes allocated since ``reset_peak`` (None on the CPU)."""
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.torch)
        return torch.cuda.max_memory_allocated(self.torch)

    def peak_during(self, fn: Callable[[], object]) -> Tuple[object, Optional[int]]:
        """``fn()`` and the peak bytes it allocated above what was allocated before it (None on
        the CPU)."""
        base = self.reset_peak()
        out = fn()
        peak = self.peak()
        return out, None if peak is None else peak - base

    # -- what it is
    def name(self) -> str:
        return torch.cuda.get_device_name(self.torch) if self.cuda else (platform.processor() or "cpu")

    def sm_clock_mhz(self) -> Optional[int]:
        """The SM clock now (NVML through torch; None without pynvml or a GPU): sampled while
        timed reps are queued, it tells a slow GPU from a slow kernel."""
        if not self.cuda:
            return None
        try:
            return int(torch.cuda.clock_rate(self.torch))
        except Exception:  # pynvml missing, or NVML unavailable here
            return None


def _nothing() -> None:
    pass


def timed_pairs(dev: Device, fn: Callable[[], object], reps: int,
                before: Callable[[], None] = _nothing, sync_each: bool = False) -> List[tuple]:
    """``reps`` calls of ``fn``, each after ``before()`` (untimed) and stamped around; with
    ``sync_each`` the host waits for each call. Returns the (start, end) stamps, synced."""
    pairs = []
    for _ in range(reps):
        before()
        a = dev.stamp()
        fn()
        pairs.append((a, dev.stamp()))
        if sync_each:
            dev.sync()
    dev.sync()
    return pairs


def timed_fwd_bwd(dev: Device, forward: Callable[[], object], backward: Callable[[object], object],
                  reps: int, before: Callable[[], None] = _nothing, sync_each: bool = False,
                  after: Optional[Callable[[int, object], None]] = None) -> List[tuple]:
    """``reps`` steps of ``backward(forward())``, each after ``before()`` (untimed), stamped at
    the start, between forward and backward and at the end; with ``sync_each`` the host waits for
    each step. ``after(i, out)`` sees step ``i``'s forward output once it is stamped (untimed; the
    steps after it may still be queued). Returns the (start, mid, end) stamps, synced."""
    stamps = []
    for i in range(reps):
        before()
        a = dev.stamp()
        out = forward()
        b = dev.stamp()
        grad = backward(out)
        c = dev.stamp()
        if sync_each:
            dev.sync()
        stamps.append((a, b, c))
        if after is not None:
            after(i, out)
        del out, grad
    dev.sync()
    return stamps


def fwd_bwd_medians(dev: Device, stamps: List[tuple]) -> Tuple[float, float, float]:
    """Median forward, backward and total ms of ``timed_fwd_bwd``'s stamps."""
    return (dev.median_ms((a, b) for a, b, _ in stamps),
            dev.median_ms((b, c) for _, b, c in stamps),
            dev.median_ms((a, c) for a, _, c in stamps))


def interleaved(dev: Device, steps: Dict[Hashable, Callable[[], object]], rounds: int) -> dict:
    """Median ms of each step over ``rounds`` rounds that time every step once in turn (L2
    flushed before each), so that a drift of the GPU's clocks over the run moves every
    implementation alike instead of whichever ran last."""
    times = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            dev.flush_l2()
            a = dev.stamp()
            step()
            times[key].append((a, dev.stamp()))
        dev.sync()
    return {key: dev.median_ms(pairs) for key, pairs in times.items()}
