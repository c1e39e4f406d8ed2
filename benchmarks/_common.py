"""Timing, memory and reporting shared by the benchmarks.

``Device``: CUDA events with an L2 flush before each timed rep on the GPU, ``perf_counter`` on the
CPU (smoke runs); peak memory; host time per call. ``environment()``: what a result needs to be
reproduced (device, versions, commit, a hash of the package's sources). ``write_report()``: the
JSON, the markdown table and, with matplotlib, a plot next to each other.

Only the standard library and torch at import time; the package is imported where it is measured,
after ``use_checkout_package()``.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# the H200's SM clock, to turn a GPU sleep in microseconds into cycles
_CYCLES_PER_US = 1980


def use_checkout_package() -> None:
    """Import this checkout's package unless one is importable already: with PYTHONPATH at
    another tree the benchmark measures that tree (an A/B); the report records which one ran
    (``package_dir``, ``source_hash``)."""
    if importlib.util.find_spec("vocab_parallel_loss") is None:
        sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------- timing
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
        pairs = []
        for _ in range(max(MIN_REPS, int(rep_ms / est))):
            self.flush_l2()
            a = self.stamp()
            fn()
            pairs.append((a, self.stamp()))
        self.sync()
        return self.median_ms(pairs)

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


# ----------------------------------------------------------------------------------- metadata
def commit() -> Optional[str]:
    """The commit measured: ``BENCH_COMMIT`` / ``GIT_COMMIT`` when set (a copied tree may hold a
    stale .git), else ``git rev-parse HEAD``, marked when the package's sources are modified."""
    named = os.environ.get("BENCH_COMMIT") or os.environ.get("GIT_COMMIT")
    if named:
        return named
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "vocab_parallel_loss"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        return head + (" (package sources modified)" if dirty else "")
    except Exception:  # no git here
        return None


def package_dir() -> Path:
    import vocab_parallel_loss

    return Path(vocab_parallel_loss.__file__).resolve().parent


def source_hash() -> str:
    """sha256 of the imported package's sources: identifies the code measured where git is
    absent."""
    h = hashlib.sha256()
    pkg = package_dir()
    for p in sorted(pkg.rglob("*.py")):
        h.update(p.relative_to(pkg.parent).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def version(dist_name: Optional[str]) -> Optional[str]:
    """Installed version of a distribution; TransformerEngine falls back to the te-triton-ce
    extract of its Triton loss (tools/stage_te_triton_ce.py), this package to its own."""
    if dist_name is None:
        return None
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        pass
    if dist_name == "transformer-engine":
        try:
            return metadata.version("te-triton-ce") + " (te-triton-ce)"
        except metadata.PackageNotFoundError:
            return None
    if dist_name == "vocab_parallel_loss":
        import vocab_parallel_loss

        return getattr(vocab_parallel_loss, "__version__", None)
    return None


def environment(dev: Optional[Device] = None) -> dict:
    """Device, date, versions and the code measured, for a report's ``meta``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": dev.name() if dev is not None else None,
            "date": f"{now:%Y-%m-%d}", "time_utc": now.isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": platform.node(),
            "commit": commit(), "source_hash": source_hash(), "package_dir": str(package_dir())}


# ------------------------------------------------------------------------------------- output
def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "device"


def fmt(v, spec: str, missing: str = "") -> str:
    """``format(v, spec)``, or ``missing`` for None / NaN."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    return format(v, spec)


def table(header: Sequence[str], rows: Iterable[Sequence], align: Optional[str] = None) -> List[str]:
    """Markdown table lines; ``align``: one character per column, ``l`` or ``r``."""
    align = align or "l" * len(header)
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return (["| " + " | ".join(header) + " |", rule]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_report(stem: Path, report: dict, markdown: Optional[str] = None,
                 plot: Optional[Callable[[dict, Path], None]] = None) -> List[Path]:
    """``stem.json`` (the report), ``stem.md`` (``markdown``) and ``stem.png`` (``plot``, when
    matplotlib is importable; a failing plot never loses the numbers: it is noted in the
    report's ``notes``). Returns the paths written."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if plot is not None:
        png = stem.with_name(stem.name + ".png")
        try:
            plot(report, png)
            if png.exists():
                written.append(png)
        except ImportError as e:  # matplotlib is optional
            _note(report, "plot", f"no plot: {e}")
        except Exception as e:  # noqa: BLE001
            _note(report, "plot", f"plot failed: {type(e).__name__}: {e}")
    path = stem.with_name(stem.name + ".json")
    path.write_text(json.dumps(report, indent=1))
    written.insert(0, path)
    if markdown is not None:
        path = stem.with_name(stem.name + ".md")
        path.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
        written.insert(1, path)
    return written


def _note(report: dict, key: str, text: str) -> None:
    notes = report.setdefault("notes", {})
    if isinstance(notes, dict):
        notes[key] = text
    else:
        notes.append(f"{key}: {text}")


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)
