"""What a result needs to be reproduced, and which package it measured.

``use_checkout_package()`` makes this checkout's package importable unless PYTHONPATH names
another tree; ``environment()`` records the device, versions, commit and a hash of the package's
sources for a report's ``meta``; ``log()`` prints with the seconds since start.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def use_checkout_package() -> None:
    """Import this checkout's package unless one is importable already: with PYTHONPATH at
    another tree the benchmark measures that tree (an A/B); the report records which one ran
    (``package_dir``, ``source_hash``)."""
    if importlib.util.find_spec("vocab_parallel_loss") is None:
        sys.path.insert(0, str(REPO))


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


def environment(dev=None) -> dict:
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


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)
