"""Instruction budget of the kernels over logits, without a GPU: registers (ptxas for sm_90) and
PTX instructions by opcode, per variant.

    TRITON_INTERPRET=0 python tools/ptx_ops.py [--kernel backward|forward|fused] [--v 32000]

``fused`` is the reduced loss's kernel (``_ce_forward_grad_kernel``, the mean, out of place).

The kernels stream memory at 4-6 B per element, so a change to the per-element arithmetic can
be checked here first, and what it costs or saves is in the counts. (The counts do not tell the
whole story: taking label smoothing's per-element subtraction out of the backward saved 4 of 309
instructions per block of 16 elements per thread, and on the H200 it stayed 5% slower than plain
at 32 warps, yet matched plain at 8 warps: ``backward_config``.) Counts are
per kernel, for the block each thread streams per loop step (``elements/thread``, printed), so
compare variants per element when their configs differ.
Pointers and the row sizes are specialised as a real launch of aligned tensors would be (16-byte
divisibility), so the loads are vectorised as on the GPU; the configs are the shipped ones.
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ptxas_registers import (OPTIONS, PTR, SIGNATURES, constexpr_defaults,  # tools/
                             ptxas_verbose, specialize)
from vocab_parallel_loss.kernels import logits as K
from vocab_parallel_loss.kernels.launch import PINNED

def compile_variant(kernel: str, v: int, dtype: torch.dtype, smoothing: bool, z: bool):
    """(registers, Counter of PTX opcodes, elements per thread per loop step, 16-byte global
    loads and stores) of one shipped config (the gradient loop's step for the fused kernel)."""
    args = SIGNATURES[kernel]
    sig = {name: PTR[dtype] if t == "x" else t for name, t in args.items()}
    sig.update(OPTIONS)
    if kernel == "backward":
        fn, cfg = K._ce_backward_kernel, dict(K.backward_config(v, dtype, smoothing))
        consts = dict(MEAN=False, HAS_SMOOTHING=smoothing, HAS_Z=z, UNLESS_UNIT=False)
    elif kernel == "fused":  # the mean, out of place, without programmatic dependent launch
        fn, cfg = K._ce_forward_grad_kernel, dict(K.fused_config(v, dtype, smoothing))
        cfg.pop("programs_per_sm", None)
        consts = dict(MEAN=True, HAS_SMOOTHING=smoothing, HAS_Z=z, GDC=False)
    else:
        fn, cfg = K._ce_forward_kernel, dict(K.forward_config(v, dtype))
        consts = dict(FINALIZE=True, HAS_SMOOTHING=smoothing, HAS_Z=z)
    warps = cfg.pop("num_warps")
    per_thread = cfg.get("GRAD_BLOCK", cfg["BLOCK"]) // (32 * warps)
    consts = constexpr_defaults(fn, {**consts, **cfg})
    attrs = specialize(sig, consts, v)  # as a launch over contiguous (16384, v) logits
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, **PINNED))
    ptx = compiled.asm["ptx"]
    regs = re.search(r"Used (\d+) registers", ptxas_verbose(ptx))
    ops = collections.Counter()
    vectors = 0
    for line in ptx.splitlines():
        words = line.strip().split()
        if words and words[0].startswith("@"):  # a predicated instruction (masked loads, stores)
            words = words[1:]
        word = words[0].rstrip(";") if words else ""
        if word[:1].isalpha() and "." in word and not word.startswith("."):
            ops[word.split(".")[0]] += 1
            vectors += word.startswith(("ld.global", "st.global")) and ".v4." in word
    return (int(regs.group(1)) if regs else None), ops, per_thread, vectors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="backward", choices=tuple(SIGNATURES))
    ap.add_argument("--v", type=int, default=32000, help="columns of the shard (picks the config)")
    args = ap.parse_args()
    shown = ("ld", "st", "ex2", "fma", "add", "sub", "mul", "selp", "setp", "cvt", "max")
    print(f"{args.kernel}, {args.v} columns: registers, PTX instructions (all, and by opcode)")
    for dtype in (torch.bfloat16, torch.float32):
        for smoothing, z in ((False, False), (True, False), (False, True)):
            regs, ops, per_thread, vectors = compile_variant(args.kernel, args.v, dtype,
                                                             smoothing, z)
            name = {(False, False): "plain", (True, False): "smoothing",
                    (False, True): "z-loss"}[(smoothing, z)]
            counts = " ".join(f"{op} {ops[op]}" for op in shown if ops[op])
            print(f"{str(dtype).replace('torch.', ''):9s} {name:10s} {regs} regs, "
                  f"{sum(ops.values())} ops, {per_thread} elements/thread, {vectors} 16-byte "
                  f"accesses: {counts}", flush=True)


if __name__ == "__main__":
    main()
