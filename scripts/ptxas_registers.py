"""Registers and spills of the fused kernel's configs for sm_90, without a GPU.

    TRITON_INTERPRET=0 python scripts/ptxas_registers.py [--dtype bf16|fp32] \
        [--configs 16384:16384:8:1:0,4096:8192:8:1:0,...]

Each config is ``BLOCK:GRAD_BLOCK:num_warps:HAS_SMOOTHING:SUM_IN_GRAD``. The kernel is compiled
to PTX for Hopper with Triton's own toolchain and assembled by the ptxas that ships with Triton
(``ptxas-blackwell`` where present: the older one rejects newer PTX), whose ``-v`` report gives
the registers per thread and the bytes spilled. A config that spills is slow on the H200 long
before it is measured there (fused_config's comments cite these figures).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vocab_parallel_loss.kernels import cross_entropy as K
from vocab_parallel_loss.kernels._launch import PINNED  # compile as every launch does


def signature(dtype: str) -> dict:
    ptrs = {"x_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}", "tgt_ptr": "*i64", "loss_ptr": "*fp32",
            "lse_ptr": "*fp32", "count_ptr": "*i64"}
    scalars = {"N": "i32", "V_local": "i32", "D1": "i32", "s0": "i64", "s1": "i64", "d0": "i64",
               "d1": "i64", "tgt_stride": "i32", "vocab_start": "i32", "V_global": "i32",
               "ignore_index": "i32", "smoothing": "fp32", "z_loss": "fp32"}
    consts = {name: "constexpr" for name in ("MEAN", "HAS_SMOOTHING", "HAS_Z", "BLOCK", "VEC",
                                             "GRAD_BLOCK", "SPLIT", "GDC", "SUM_IN_GRAD",
                                             "FIRST_HINT", "SECOND_HINT", "STORE_HINT")}
    return {**ptrs, **scalars, **consts}


def ptxas() -> str:
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise SystemExit("this Triton ships no ptxas")


def ptxas_verbose(ptx: str) -> str:
    """What ``ptxas -v`` reports for ``ptx`` assembled for sm_90a (registers, spills)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        return subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                              capture_output=True, text=True).stderr


def report(dtype: str, block: int, grad_block: int, warps: int, smoothing: bool,
           sum_in_grad: bool) -> str:
    consts = dict(MEAN=True, HAS_SMOOTHING=smoothing, HAS_Z=False, BLOCK=block,
                  VEC=16 // (2 if dtype == "bf16" else 4), GRAD_BLOCK=grad_block, SPLIT=False,
                  GDC=False, SUM_IN_GRAD=sum_in_grad, FIRST_HINT="evict_last",
                  SECOND_HINT="evict_first", STORE_HINT="")
    src = ASTSource(fn=K._ce_forward_grad_kernel, signature=signature(dtype), constexprs=consts)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, **PINNED))
    report = ptxas_verbose(kernel.asm["ptx"])
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.findall(r"(\d+) bytes spill (stores|loads)", report)
    return (f"{regs.group(1) if regs else '?'} registers, "
            + ", ".join(f"{n} B spill {kind}" for n, kind in spills))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--configs", default="16384:16384:8:0:0,16384:16384:8:1:0,4096:8192:8:1:0,"
                                         "16384:16384:8:1:1,16384:8192:8:1:1")
    args = ap.parse_args()
    for spec in args.configs.split(","):
        block, grad_block, warps, ls, sg = (int(v) for v in spec.split(":"))
        print(f"{args.dtype} BLOCK {block} GRAD_BLOCK {grad_block} warps {warps} smoothing "
              f"{bool(ls)} SUM_IN_GRAD {bool(sg)}: "
              f"{report(args.dtype, block, grad_block, warps, bool(ls), bool(sg))}", flush=True)


if __name__ == "__main__":
    main()
