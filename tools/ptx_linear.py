"""Instruction budget of the fused linear kernels, without a GPU: registers and spills (ptxas for
sm_90) and PTX instructions by opcode, per variant, in the Hopper tile config.

    TRITON_INTERPRET=0 PYTHONPATH=. python tools/ptx_linear.py

Variants: the forward (``_lce_fwd_kernel``: TMA descriptors, the flat loop) plain or saving its
tiles, in loss or log-prob mode, with or without a bias; the recompute dlogits kernel and the
saved tiles' dz pass, in both modes. Counts are static (the whole kernel, unrolled over a
thread's share of a tile: 128 elements of a 128 x 256 tile at 8 warps), so a change of one
instruction per element moves a count by ~128 and one per row and tile by 2. The kernels are
specialized roughly as a launch over contiguous tensors is (pointers and multiples of 16
marked divisible by 16, ints equal to 1 made constants), not exactly: compare variants and
revisions with each other, not with a profile.
"""

from __future__ import annotations

import collections
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from ptxas_registers import ptxas_verbose  # tools/
from vocab_parallel_loss.kernels.launch import PINNED
from vocab_parallel_loss.kernels.linear import config as C, fused as F, gemm as G, saved as S

SHOWN = ("ex2", "fma", "add", "sub", "mul", "max", "min", "selp", "setp", "cvt", "ld", "st",
         "wgmma")


def compile_kernel(fn, args: dict, consts: dict, warps: int, stages: int):
    """(registers, spill bytes, Counter of PTX opcodes) of ``fn`` compiled for sm_90."""
    sig, attrs, consts = {}, {}, dict(consts)
    names = [p.name for p in fn.params]
    for p in fn.params:
        if p.name in consts:
            sig[p.name] = "constexpr"
            continue
        a = args[p.name]
        is_int = isinstance(a, int) and not isinstance(a, bool)
        if is_int and a == 1:
            sig[p.name], consts[p.name] = "constexpr", 1
            continue
        sig[p.name] = mangle_type(a)
        if isinstance(a, torch.Tensor) or (is_int and a % 16 == 0):
            attrs[(names.index(p.name),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=warps, num_stages=stages, **PINNED)).asm["ptx"]
    report = ptxas_verbose(ptx)
    regs = re.search(r"Used (\d+) registers", report)
    spills = "/".join(n for n, _ in re.findall(r"(\d+) bytes spill (stores|loads)", report))
    ops = collections.Counter()
    for line in ptx.splitlines():
        words = line.strip().split()
        if words and words[0].startswith("@"):  # a predicated instruction
            words = words[1:]
        word = words[0].rstrip(";") if words else ""
        if word[:1].isalpha() and "." in word and not word.startswith("."):
            ops[word.split(".")[0]] += 1
    return (regs.group(1) if regs else "?"), spills or "0/0", ops


def show(name: str, regs: str, spills: str, ops) -> None:
    print(f"{name:34s} {regs:>4} regs, spill {spills:>7} B; {sum(ops.values()):5d} instr: "
          + " ".join(f"{o} {ops[o]}" for o in SHOWN if ops[o]), flush=True)


def main() -> None:
    cfg = C.HOPPER_CONFIG
    n, h, v = 16384, 4096, 32768
    bf = torch.bfloat16
    e, c = torch.empty(16, 64, dtype=bf), torch.empty(16, 64, dtype=bf)
    f32, i64 = torch.empty(16), torch.empty(16, dtype=torch.int64)
    fwd_e = TensorDescriptor.from_tensor(e, [cfg.fwd_block_n, cfg.fwd_block_h])
    fwd_c = TensorDescriptor.from_tensor(c, [cfg.fwd_block_v, cfg.fwd_block_h])
    fwd_u = TensorDescriptor.from_tensor(torch.empty(16, 256, dtype=bf),
                                         [cfg.fwd_block_n, cfg.fwd_block_v])
    for store in (False, True):
        for logprob in (False, True):
            for bias in (False, True):
                args = dict(E=fwd_e, C=fwd_c, E_LO=fwd_e, C_LO=fwd_c, SE=f32, SC=f32, BIAS=e[0],
                            TGT=i64, STATS=f32,
                            U=fwd_u if store else f32, MT=f32, INV_T=f32, N=n, V=v, H=h,
                            stride_en=h, stride_eh=1, stride_cv=h, stride_ch=1, stride_t=1,
                            stride_un=v, stride_it=1, stride_b=1, v_offset=0, softcap=1.0,
                            scale=1.0,
                            tiles_per_split=7, n_splits=3, split0=0, c_first=0, n_rb=64, rb0=0)
                consts = dict(HAS_BIAS=bias, HAS_SOFTCAP=False, NEED_SUMX=False, EVEN_H=True,
                              BLOCK_N=cfg.fwd_block_n, BLOCK_V=cfg.fwd_block_v,
                              BLOCK_H=cfg.fwd_block_h, GROUP_N=cfg.fwd_group_n,
                              DOT_PREC="tf32", UPCAST=False, DESC=True, FLAT=True, STORE=store,
                              DESC_U=store, LOGPROB=logprob, NEED_ARGMAX=False,
                              SAVED_FOLD=False, PARTS=False, LO_E=False, LO_C=False)
                show(f"forward {'saved' if store else 'plain'} {'logprob' if logprob else 'loss'}"
                     f"{' bias' if bias else ''}",
                     *compile_kernel(F._lce_fwd_kernel, args, consts, cfg.fwd_warps,
                                     cfg.fwd_stages))
    bwd_e = TensorDescriptor.from_tensor(e, [cfg.bwd_block_n, cfg.bwd_block_h])
    bwd_c = TensorDescriptor.from_tensor(c, [cfg.bwd_block_v, cfg.bwd_block_h])
    for logprob in (False, True):
        args = dict(E=bwd_e, C=bwd_c, SE=f32, SC=f32, BIAS=e[0], TGT=i64, COEF=f32, D=e, DB=f32,
                    INV_T=f32, N=n, V=v, H=h, v_start=0, n_cols=v, stride_en=h, stride_eh=1,
                    stride_cv=h, stride_ch=1, stride_t=1, stride_dn=v, stride_db=v, stride_it=1,
                    stride_b=1, v_offset=0,
                    softcap=1.0, scale=1.0, SKIP=f32)
        consts = dict(HAS_BIAS=True, HAS_SOFTCAP=False, LOGPROB=logprob, EVEN_H=True,
                      BLOCK_N=cfg.bwd_block_n, BLOCK_V=cfg.bwd_block_v, BLOCK_H=cfg.bwd_block_h,
                      GROUP_N=cfg.bwd_group_n, DOT_PREC="tf32", UPCAST=False, DESC=True,
                      GATED=False)
        show(f"dlogits {'logprob' if logprob else 'loss'} bias",
             *compile_kernel(F._lce_dlogits_kernel, args, consts, cfg.bwd_warps, cfg.bwd_stages))
    fp32_head(cfg, n, h, v, f32, i64)
    for logprob in (False, True):
        args = dict(U=e, MT=f32, TGT=i64, COEF=f32, INV_T=f32, N=n, V=v, stride_un=v,
                    stride_t=1, stride_it=1, v_offset=0, softcap=1.0, scale=1.0)
        consts = dict(HAS_SOFTCAP=False, LOGPROB=logprob, TILE_V=cfg.fwd_block_v,
                      BLOCK=cfg.row_block)
        show(f"saved dz {'logprob' if logprob else 'loss'}",
             *compile_kernel(S._saved_dz_kernel, args, consts, cfg.row_warps, 3))


def fp32_head(cfg, n, h, v, f32, i64) -> None:
    """An fp32 head's kernels (pointers, fp32 tiles): the log-prob forward, the dlogits kernel and
    the Triton GEMM, for fp32 hidden states (``"h3"``), bf16 ones (``"h2"``) and fp32 ones at
    ``fp32_precision="tf32"`` (``"h1"``)."""
    wide = cfg.for_tiles(torch.float32)
    for mode, e_dtype in (("h3", torch.float32), ("h2", torch.bfloat16), ("h1", torch.float32)):
        e = torch.empty(16, 64, dtype=e_dtype)
        args = dict(E=e, C=f32, E_LO=e, C_LO=f32, SE=f32, SC=f32, BIAS=f32, TGT=i64, STATS=f32,
                    U=f32, MT=f32, INV_T=f32, N=n, V=v, H=h, stride_en=h, stride_eh=1,
                    stride_cv=h, stride_ch=1, stride_t=1, stride_un=v, stride_it=1, v_offset=0,
                    stride_b=1, softcap=1.0, scale=1.0, tiles_per_split=7, n_splits=3, split0=0,
                    c_first=0, n_rb=64, rb0=0)
        consts = dict(HAS_BIAS=False, HAS_SOFTCAP=False, NEED_SUMX=False, EVEN_H=True,
                      BLOCK_N=wide.fwd_block_n, BLOCK_V=wide.fwd_block_v, BLOCK_H=wide.fwd_block_h,
                      GROUP_N=wide.fwd_group_n, DOT_PREC=mode, UPCAST=False, DESC=False,
                      FLAT=False, STORE=False, DESC_U=False, LOGPROB=True, NEED_ARGMAX=False,
                      SAVED_FOLD=False, PARTS=False, LO_E=False, LO_C=False)
        show(f"fp32 head forward logprob {mode}",
             *compile_kernel(F._lce_fwd_kernel, args, consts, wide.fwd_warps, wide.fwd_stages))
        # the forward from fp16 parts in memory (``parts.py``), plain and saving its tiles
        part = torch.empty(16, 64, dtype=torch.float16)
        pe = TensorDescriptor.from_tensor(part, [wide.fwd_block_n, wide.fwd_block_h])
        pc = TensorDescriptor.from_tensor(part, [wide.fwd_block_v, wide.fwd_block_h])
        for store in (False, True):
            args.update(E=pe, C=pc, E_LO=pe, C_LO=pc)
            stages = min(wide.fwd_stages, wide.parts_store_stages) if store and mode == "h3" \
                else wide.fwd_stages
            consts.update(FLAT=True, STORE=store, PARTS=True, LO_E=mode == "h3",
                          LO_C=mode != "h1")
            show(f"fp32 head parts forward {mode}{' saved' if store else ''}",
                 *compile_kernel(F._lce_fwd_kernel, args, consts, wide.fwd_warps, stages))
        args = dict(E=e, C=f32, SE=f32, SC=f32, BIAS=f32, TGT=i64, COEF=f32, D=f32, DB=f32,
                    INV_T=f32, N=n, V=v, H=h, v_start=0, n_cols=v, stride_en=h, stride_eh=1,
                    stride_cv=h, stride_ch=1, stride_t=1, stride_dn=v, stride_db=v, stride_it=1,
                    v_offset=0, softcap=1.0, scale=1.0, SKIP=f32)
        consts = dict(HAS_BIAS=False, HAS_SOFTCAP=False, LOGPROB=True, EVEN_H=True,
                      BLOCK_N=wide.bwd_block_n, BLOCK_V=wide.bwd_block_v, BLOCK_H=wide.bwd_block_h,
                      GROUP_N=wide.bwd_group_n, DOT_PREC=mode, UPCAST=False, DESC=False,
                      GATED=False)
        show(f"fp32 head dlogits logprob {mode}",
             *compile_kernel(F._lce_dlogits_kernel, args, consts, wide.bwd_warps, wide.bwd_stages))
        # dE += dz @ C (fp32 x fp32 either way: dz is fp32 in an fp32 head)
        args = dict(A=f32, B=f32, SA=f32, SB=f32, OUT=f32, M=n, NN=h, K=v, stride_am=v,
                    stride_ak=1, stride_bk=h, stride_bn=1, stride_om=h, stride_on=1, SKIP=f32)
        consts = dict(ACCUMULATE=True, EVEN_K=True, BLOCK_M=wide.mm_block_m,
                      BLOCK_N=wide.mm_block_n, BLOCK_K=wide.wide_block_h,
                      GROUP_M=wide.mm_group_m, DOT_PREC=mode, UPCAST=False, GATED=False)
        if mode != "h2":
            show(f"fp32 head GEMM {mode}", *compile_kernel(G._mm_kernel, args, consts,
                                                           wide.mm_warps, wide.wide_mm_stages))


if __name__ == "__main__":
    main()
