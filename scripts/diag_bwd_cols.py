"""bench.py's per-token rows for ours with the backward in column blocks (``COLS_BLOCK``) or not.

    python scripts/diag_bwd_cols.py --cols 4096 --warps 4 -- --shapes 16384x16032 --impls ours ...

Sets ``kernels.cross_entropy.COLS_BLOCK`` / ``COLS_WARPS`` in this process and runs
scripts/bench.py's main with the arguments after ``--``, so the two settings can be compared in
the same way as every other row of the benchmark.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vocab_parallel_loss.kernels import cross_entropy as K  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--cols", type=int, default=0)
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    K.COLS_BLOCK, K.COLS_WARPS = args.cols, args.warps
    K.backward_config.cache_clear()
    print(f"COLS_BLOCK={K.COLS_BLOCK} COLS_WARPS={K.COLS_WARPS}: "
          f"{K.backward_config(16032, __import__('torch').bfloat16)}", flush=True)
    sys.argv = [str(REPO / "scripts" / "bench.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
