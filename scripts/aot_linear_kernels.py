"""Compile the fused-linear-CE kernels for a GPU target without a GPU, and report per kernel:
registers, stack (spills), shared memory, and whether the K loop got cp.async pipelining and
wgmma. Catches compile errors and spilling tile configs before any GPU time is spent.

    python scripts/aot_linear_kernels.py                      # the Hopper default config, sm_90
    python scripts/aot_linear_kernels.py --arch 80            # Ampere config, sm_80
    python scripts/aot_linear_kernels.py --config '{"fwd_block_v": 128}' --config '{"fwd_warps": 4}'
    python scripts/aot_linear_kernels.py --config '{}' --config '{"fwd_desc": false, "bwd_desc": false}'

Arguments are specialised as a real launch would (unit strides constexpr, pointers, sizes and
strides divisible by 16, as they are for H, V, N multiples of 16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vocab_parallel_loss.kernels import linear_cross_entropy as K  # noqa: E402
from vocab_parallel_loss.kernels._launch import PINNED  # noqa: E402  (as every launch)

DIV16 = ("N", "V", "H", "M", "NN", "K", "n_cols", "v_start")


def _compile(fn, sig, consts, warps, stages, arch):
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(sig)
             if sig[nm] != "constexpr" and (sig[nm].startswith("*") or nm.startswith("stride")
                                            or nm in DIV16)}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages, **PINNED))


def _usage(k) -> str:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        path = f.name
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        r = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True)
        line = next((x for x in (r.stdout + r.stderr).splitlines() if "REG:" in x), "?")
        return " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "STACK"))
    finally:
        os.unlink(path)


def _operand_types(desc: bool, block_rows: int, block_c: int, block_h: int):
    """E and C as pointers or as TMA descriptors of their blocks (what forward_stats passes)."""
    if not desc:
        return {"E": "*bf16", "C": "*bf16"}
    return {"E": f"tensordesc<bf16[{block_rows},{block_h}]>",
            "C": f"tensordesc<bf16[{block_c},{block_h}]>"}


def kernels(cfg: K.LCEConfig, arch: int):
    bf = "*bf16"
    fdesc = cfg.fwd_desc and arch >= 90
    bdesc = cfg.bwd_desc and arch >= 90
    fwd = {**_operand_types(fdesc, cfg.fwd_block_n, cfg.fwd_block_v, cfg.fwd_block_h), "BIAS": bf, "TGT": "*i64", "STATS": "*fp32", "N": "i32", "V": "i32",
           "H": "i32", "stride_en": "i32", "stride_eh": "constexpr", "stride_cv": "i32",
           "stride_ch": "constexpr", "stride_t": "constexpr", "v_offset": "i32", "softcap": "fp32",
           "tiles_per_split": "i32", "n_splits": "i32", "HAS_BIAS": "constexpr",
           "HAS_SOFTCAP": "constexpr", "NEED_SUMX": "constexpr", "EVEN_H": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_V": "constexpr", "BLOCK_H": "constexpr",
           "GROUP_N": "constexpr", "DOT_PREC": "constexpr", "UPCAST": "constexpr",
           "DESC": "constexpr", "FLAT": "constexpr"}
    for opt in (False, True):
        yield (f"fwd{' +bias+softcap+smooth' if opt else ''}", K._lce_fwd_kernel, fwd,
               dict(stride_eh=1, stride_ch=1, stride_t=1, HAS_BIAS=opt, HAS_SOFTCAP=opt,
                    NEED_SUMX=opt, EVEN_H=True, BLOCK_N=cfg.fwd_block_n, BLOCK_V=cfg.fwd_block_v,
                    BLOCK_H=cfg.fwd_block_h, GROUP_N=cfg.fwd_group_n, DOT_PREC="tf32",
                    UPCAST=False, DESC=fdesc, FLAT=fdesc and cfg.fwd_flat),
               cfg.fwd_warps, cfg.fwd_stages)
    dout = bdesc and cfg.bwd_store_desc
    d_type = f"tensordesc<bf16[{cfg.bwd_block_n},{cfg.bwd_block_v}]>" if dout else bf
    dl = {**_operand_types(bdesc, cfg.bwd_block_n, cfg.bwd_block_v, cfg.bwd_block_h), "BIAS": bf, "TGT": "*i64", "COEF": "*fp32", "D": d_type, "DB": "*fp32",
          "N": "i32", "V": "i32", "H": "i32", "v_start": "i32", "n_cols": "i32",
          "stride_en": "i32", "stride_eh": "constexpr", "stride_cv": "i32",
          "stride_ch": "constexpr", "stride_t": "constexpr", "stride_dn": "i32",
          "stride_db": "i32", "v_offset": "i32", "softcap": "fp32", "HAS_BIAS": "constexpr",
          "HAS_SOFTCAP": "constexpr", "EVEN_H": "constexpr", "BLOCK_N": "constexpr",
          "BLOCK_V": "constexpr", "BLOCK_H": "constexpr", "GROUP_N": "constexpr",
          "DOT_PREC": "constexpr", "UPCAST": "constexpr", "DESC": "constexpr",
          "FLAT": "constexpr", "DESC_OUT": "constexpr"}
    for opt in (False, True):
        yield (f"dlogits{' +bias+softcap' if opt else ''}", K._lce_dlogits_kernel, dl,
               dict(stride_eh=1, stride_ch=1, stride_t=1, HAS_BIAS=opt, HAS_SOFTCAP=opt,
                    EVEN_H=True, BLOCK_N=cfg.bwd_block_n, BLOCK_V=cfg.bwd_block_v,
                    BLOCK_H=cfg.bwd_block_h, GROUP_N=cfg.bwd_group_n, DOT_PREC="tf32",
                    UPCAST=False, DESC=bdesc, FLAT=bdesc and cfg.bwd_flat, DESC_OUT=dout),
               cfg.bwd_warps, cfg.bwd_stages)
    mm = {"A": bf, "B": bf, "OUT": "*fp32", "M": "i32", "NN": "i32", "K": "i32",
          "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "constexpr",
          "stride_om": "i32", "stride_on": "constexpr", "ACCUMULATE": "constexpr",
          "EVEN_K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
          "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "DOT_PREC": "constexpr",
          "UPCAST": "constexpr"}
    base = dict(stride_bn=1, stride_on=1, EVEN_K=True, BLOCK_M=cfg.mm_block_m,
                BLOCK_N=cfg.mm_block_n, BLOCK_K=cfg.mm_block_k, GROUP_M=cfg.mm_group_m,
                DOT_PREC="tf32", UPCAST=False)
    # dE += dz @ c_chunk: A row-major; dC = dz.T @ e: A column-major, bf16 output
    yield ("mm dE+=dz@c", K._mm_kernel, dict(mm, stride_ak="constexpr"),
           dict(base, stride_ak=1, ACCUMULATE=True), cfg.mm_warps, cfg.mm_stages)
    yield ("mm dC=dz.T@e", K._mm_kernel, dict(mm, stride_am="constexpr", OUT=bf),
           dict(base, stride_am=1, ACCUMULATE=False), cfg.mm_warps, cfg.mm_stages)
    rs = {"X": "*fp32", "BIAS": bf, "TGT": "*i64", "STATS": "*fp32", "N": "i32", "V": "i32",
          "stride_xn": "i32", "stride_t": "constexpr", "stride_s": "i32", "v_offset": "i32", "softcap": "fp32",
          "HAS_BIAS": "constexpr", "HAS_SOFTCAP": "constexpr", "NEED_SUMX": "constexpr",
          "BLOCK": "constexpr"}
    yield ("rows_stats (gif)", K._rows_stats_kernel, rs,
           dict(stride_t=1, HAS_BIAS=True, HAS_SOFTCAP=True, NEED_SUMX=True,
                BLOCK=cfg.row_block), cfg.row_warps, 1)
    rd = {"X": "*fp32", "BIAS": bf, "TGT": "*i64", "COEF": "*fp32", "D": bf, "N": "i32",
          "V": "i32", "stride_xn": "i32", "stride_dn": "i32", "stride_t": "constexpr",
          "v_offset": "i32", "softcap": "fp32", "HAS_BIAS": "constexpr",
          "HAS_SOFTCAP": "constexpr", "BLOCK": "constexpr"}
    yield ("rows_dz (gif)", K._rows_dz_kernel, rd,
           dict(stride_t=1, HAS_BIAS=True, HAS_SOFTCAP=True, BLOCK=cfg.row_block),
           cfg.row_warps, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--config", action="append", default=[],
                    help="JSON of LCEConfig fields on top of the arch's default (repeatable)")
    args = ap.parse_args()
    base = K.HOPPER_CONFIG if args.arch >= 90 else K.AMPERE_CONFIG
    deltas = [json.loads(c) for c in args.config] or [{}]
    bad = 0
    for delta in deltas:
        cfg = base.replace(**delta)
        print(f"== sm_{args.arch} config delta {json.dumps(delta)}")
        for name, fn, sig, consts, warps, stages in kernels(cfg, args.arch):
            try:
                k = _compile(fn, sig, consts, warps, stages, args.arch)
            except Exception as ex:  # a compile error is what this tool is for
                bad += 1
                print(f"  {name:28s} FAILED {type(ex).__name__}: {str(ex)[:500]}")
                continue
            ttg = k.asm["ttgir"]
            print(f"  {name:28s} {_usage(k):18s} smem={k.metadata.shared:>6d} "
                  f"cp.async={ttg.count('async_copy_global_to_local')} "
                  f"tma={ttg.count('async_tma_copy')} wgmma={ttg.count('warp_group_dot ')} "
                  f"mma={ttg.count('tt.dot ') + ttg.count('ttg.dot ')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
