"""Registers and spills of the fused kernel's configs for sm_90, without a GPU.

    TRITON_INTERPRET=0 python tools/ptxas_registers.py [--dtype bf16|fp32] \
        [--configs 16384:16384:8:1:0,4096:8192:8:1:0,...]

Each config is ``BLOCK:GRAD_BLOCK:num_warps:HAS_SMOOTHING:SUM_IN_GRAD``. The kernel is compiled
to PTX for Hopper with Triton's own toolchain and assembled by the ptxas that ships with Triton
(``ptxas-blackwell`` where present: the older one rejects newer PTX), whose ``-v`` report gives
the registers per thread and the bytes spilled. The kernel is specialized as a launch over
contiguous (16384, 32000) logits is (``specialize``: 16-byte aligned rows, so 16-byte loads);
compiled without that, it is a different program with 2-byte loads and about twice the
registers.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vocab_parallel_loss.kernels import logits as K
from vocab_parallel_loss.kernels.launch import PINNED  # compile as every launch does


def launch_ints(v: int, n: int = 16384) -> dict:
    """The integer arguments of a launch over contiguous ``(n, v)`` logits held by one shard
    (``layout.row_view``: D1 = n, s0 = 0, s1 = v) with contiguous targets and upstream
    gradient."""
    return dict(N=n, V_local=v, D1=n, s0=0, s1=v, d0=0, d1=v, tgt_stride=1, dloss_stride=1,
                vocab_start=0, V_global=v, ignore_index=-100)


def constexpr_defaults(fn, consts: dict) -> dict:
    """``consts`` plus the defaults of ``fn``'s constexpr parameters it does not set, in the
    kernel's parameter order: a compile through ``ASTSource`` gets no defaults, and fails on an
    unset constexpr."""
    out = {p.name: consts.get(p.name, p.default) for p in fn.params if p.is_constexpr
           and (p.name in consts or p.default is not inspect.Parameter.empty)}
    out.update(consts)  # anything else asked for (ints a launch turns into constants)
    return out


def specialize(sig: dict, consts: dict, v: int) -> dict:
    """Specialize ``sig`` as Triton does a launch over contiguous ``(16384, v)`` logits: an
    int equal to 1 becomes a constant (into ``consts``), pointers and multiples of 16 are
    marked divisible by 16. Returns the ``attrs`` for ``ASTSource``; ``sig`` is updated.

    Without it the compiler cannot prove the rows 16-byte aligned and emits 2-byte loads: a
    different program from the one launched (233-255 registers for the fused kernel where the
    launched one has 117)."""
    divisible = [name for name, t in sig.items() if t.startswith("*")]
    for name, value in launch_ints(v).items():
        if name not in sig:
            continue
        if value == 1:
            consts[name] = 1
        elif value % 16 == 0:
            divisible.append(name)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    return {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}


PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
SIGNATURES = {  # the run-time arguments before the options ("x": the logits' dtype)
    "backward": {"x_ptr": "x", "dx_ptr": "x", "tgt_ptr": "*i64", "lse_ptr": "*fp32",
                 "dloss_ptr": "*fp32", "count_ptr": "*fp32", "N": "i32", "V_local": "i32",
                 "D1": "i32", "s0": "i64", "s1": "i64", "d0": "i64", "d1": "i64",
                 "tgt_stride": "i32", "dloss_stride": "i32"},
    "fused": {"x_ptr": "x", "dx_ptr": "x", "tgt_ptr": "*i64", "loss_ptr": "*fp32",
              "lse_ptr": "*fp32", "count_ptr": "*i64", "N": "i32", "V_local": "i32", "D1": "i32",
              "s0": "i64", "s1": "i64", "d0": "i64", "d1": "i64", "tgt_stride": "i32"},
    "forward": {"x_ptr": "x", "tgt_ptr": "*i64", "stats_ptr": "*fp32", "loss_ptr": "*fp32",
                "lse_ptr": "*fp32", "N": "i32", "V_local": "i32", "D1": "i32", "s0": "i64",
                "s1": "i64", "tgt_stride": "i32"},
}
OPTIONS = {"vocab_start": "i32", "V_global": "i32", "ignore_index": "i32", "smoothing": "fp32",
           "z_loss": "fp32"}


def signature(dtype: str) -> dict:
    """The fused kernel's run-time arguments, for ``dtype`` ("bf16" or "fp32") logits."""
    x = f"*{dtype}"
    return {**{n: x if t == "x" else t for n, t in SIGNATURES["fused"].items()}, **OPTIONS}


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
           sum_in_grad: bool, v: int = 32000) -> str:
    consts = dict(MEAN=True, HAS_SMOOTHING=smoothing, HAS_Z=False, BLOCK=block,
                  VEC=16 // (2 if dtype == "bf16" else 4), GRAD_BLOCK=grad_block, SPLIT=False,
                  GDC=False, SUM_IN_GRAD=sum_in_grad, FIRST_HINT="evict_last",
                  SECOND_HINT="evict_first", STORE_HINT="")
    consts = constexpr_defaults(K._ce_forward_grad_kernel, consts)
    sig = signature(dtype)
    attrs = specialize(sig, consts, v)
    src = ASTSource(fn=K._ce_forward_grad_kernel, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, **PINNED))
    out = ptxas_verbose(kernel.asm["ptx"])
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill (stores|loads)", out)
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
