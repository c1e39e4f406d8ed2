"""Lab: what keeps the fused forward (logits + statistics, one ``tl.dot`` kernel) below cuBLAS's
rate. The same kernel is timed with its per-tile fold replaced by lighter ones, beside cuBLAS's
bare logits GEMM, so the epilogue's cost is measured rather than estimated:

    python lab/forward_epilogue_ab.py [--n 16384 --hidden 4096 --vocab 128256]

Folds (each in its own process, so that Triton compiles the kernel with it):
``shipped`` (the package's statistics), ``shipped+store`` (and the tiles saved, as the
saved-tiles and gradients-in-forward strategies run it), ``exp`` (online max and sum of exp
only: no target logit, no masks), ``max`` (the row max only: the lightest fold that keeps every
product live). Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from probe_linear_gemms import _ms  # noqa: E402  (the gradient-GEMM probe's timer)


@triton.jit
def _fold_max(x, rb, vt, N, V, BIAS, softcap, scale, inv_t, t_local, m, s, tg, sx, best_col, U,
              MT, stride_un, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              NEED_SUMX: tl.constexpr, LOGPROB: tl.constexpr, NEED_ARGMAX: tl.constexpr,
              STORE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
              DESC_U: tl.constexpr, SAVED_FOLD: tl.constexpr = False):
    # s kept nonzero: a row of s == 0 stores m = -inf, and the products would be dead code
    return tl.maximum(m, tl.max(x, axis=1)), s + 1.0, tg, sx, best_col


@triton.jit
def _fold_exp(x, rb, vt, N, V, BIAS, softcap, scale, inv_t, t_local, m, s, tg, sx, best_col, U,
              MT, stride_un, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              NEED_SUMX: tl.constexpr, LOGPROB: tl.constexpr, NEED_ARGMAX: tl.constexpr,
              STORE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
              DESC_U: tl.constexpr, SAVED_FOLD: tl.constexpr = False):
    m_new = tl.maximum(m, tl.max(x, axis=1))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
    return m_new, s, tg, sx, best_col


def run_one(fold: str, n: int, h: int, v: int, reps: int) -> None:
    from vocab_parallel_loss.kernels.linear import fused, saved as S
    from vocab_parallel_loss.kernels.linear.config import default_config

    if fold in ("max", "exp"):  # before the first launch: the kernel resolves _fold at compile
        fused._fold = _fold_max if fold == "max" else _fold_exp
    torch.manual_seed(0)
    e = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    t = torch.randint(0, v, (n,), device="cuda")
    cfg = default_config(e.device)
    tiles = S.saved_tiles(n, v, e.dtype, e.device, cfg) if fold == "shipped+store" else None
    flops = 2 * n * h * v
    rows = []
    if fold == "shipped":
        rows.append(("cuBLAS e @ c.T, bf16 out", lambda: e @ c.t()))
        rows.append(("cuBLAS e @ c.T, fp32 out",
                     lambda: torch.mm(e, c.t(), out_dtype=torch.float32)))
    rows.append((f"fused forward, fold {fold}",
                 lambda: fused.forward_stats(e, c, None, t, 0, None, False, config=cfg,
                                             saved=tiles)))
    for name, fn in rows:
        ms = _ms(fn, reps)
        print(json.dumps(dict(step=name, n=n, h=h, v=v, ms=round(ms, 3),
                              tflops=round(flops / ms / 1e9, 1))), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--folds", nargs="+", default=["shipped", "shipped+store", "exp", "max"])
    ap.add_argument("--fold", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fold:
        run_one(args.fold, args.n, args.hidden, args.vocab, args.reps)
        return
    print(json.dumps(dict(device=torch.cuda.get_device_name(), triton=triton.__version__,
                          torch=torch.__version__)), flush=True)
    for _ in range(args.rounds):  # interleaved rounds: the spread between them is the noise
        for fold in args.folds:
            subprocess.run([sys.executable, __file__, "--fold", fold, "--n", str(args.n),
                            "--hidden", str(args.hidden), "--vocab", str(args.vocab),
                            "--reps", str(args.reps)], check=False)


if __name__ == "__main__":
    main()
