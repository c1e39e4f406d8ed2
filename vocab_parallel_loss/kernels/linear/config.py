"""Tile configuration of the fused linear cross entropy kernels, and how a call picks it.

``default_config(device)`` returns ``OVERRIDE_CONFIG`` when it is set (benchmarks and tests set
it), else the table for the device: Hopper, Ampere, or the interpreter's small tiles. The fields
of ``VPL_LCE_CONFIG`` (JSON, ``settings.lce_config_overrides``) are applied on top.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ... import settings


@dataclasses.dataclass
class LCEConfig:
    """Tile configuration of the fused linear cross entropy kernels.

    ``fwd_*``: forward statistics kernel; ``bwd_*``: dlogits recompute kernel; ``mm_*``: the
    Triton GEMM. ``split``: vocabulary splits per row block in the forward (0 = chosen from the
    grid, ``fused._forward_splits``). ``chunk_bytes``: size of the ``(N, Vc)`` dlogits buffer in
    backward (bigger = fewer, larger GEMMs; extra memory). ``matmul``: the gradient GEMMs in
    ``"torch"`` (cuBLAS, fp32 accumulation; Triton where PyTorch lacks the fp32-output overload)
    or ``"triton"`` (``gemm._mm_kernel``). CPU (interpreter) always uses Triton.

    ``strategy``: how gradients are formed (``autograd/linear.py`` picks one per call from the
    caller's ``memory_budget`` when this is ``"auto"``; tests and benchmarks force one):
    ``"saved"`` (the forward saves every logits tile, ``saved.py``: 6NHV for any upstream
    gradient, ``N x V_local`` elements held until backward), ``"grad_in_forward"`` (scalar
    losses: both gradients formed in forward from the saved tiles of row chunks of at most
    ``gif_rows`` rows, 6NHV, an fp32 ``(V_local, H)`` ``dC`` accumulator, ``saved.py``) or
    ``"recompute"``
    (backward recomputes the logits in ``chunk_bytes`` column chunks: 8NHV, memory
    independent of V). ``row_block`` / ``row_warps``: the saved tiles' memory-bound dz pass.

    ``fwd_desc`` / ``bwd_desc``: read E and C through TMA descriptors (Hopper+, 16-bit, aligned
    rows; the copy engine's zero fill replaces the masks). ``fwd_flat`` (with descriptors): the
    forward runs one flat loop over (tile, H step), so the next tile's loads overlap a tile's
    epilogue.

    ``fwd_parts`` (Hopper+, an fp32 head's split products): the forward splits its operands
    into fp16 parts in memory (``parts.py``: a launch's rows of E and columns of C, whole
    splits, at most ``fwd_parts_bytes`` of each and within the budget's room,
    ``fused._parts_plan``) and reads them through descriptors in the flat loop, where without
    it each tile is split in registers on every visit.
    """

    fwd_block_n: int = 128
    fwd_block_v: int = 256
    fwd_block_h: int = 64
    fwd_group_n: int = 16
    fwd_warps: int = 8
    fwd_stages: int = 3
    split: int = 0
    bwd_block_n: int = 128
    bwd_block_v: int = 256
    bwd_block_h: int = 64
    bwd_group_n: int = 8
    bwd_warps: int = 8
    bwd_stages: int = 3
    mm_block_m: int = 128
    mm_block_n: int = 128  # 256 spills in the fp32 read-modify-write epilogue of dE
    mm_block_k: int = 64
    mm_group_m: int = 8
    mm_warps: int = 8
    mm_stages: int = 4
    chunk_bytes: int = 128 * 1024 * 1024
    matmul: str = "torch"
    strategy: str = "auto"
    gif_rows: int = 4096
    gif_min_blocks: int = 4  # fewer row blocks per chunk: dC's fp32 read-modify-write per chunk
    # costs more than the recomputation the chunk saves
    row_block: int = 2048
    row_warps: int = 8
    fwd_desc: bool = False
    bwd_desc: bool = False
    fwd_flat: bool = False
    wide_block_h: int = 64  # fp32 tiles (``for_tiles``): the H step, and the Triton GEMM's K step
    wide_block_v: int = 128  # fp32 tiles: the vocabulary tile (split products spill at 256 columns)
    wide_gif_min_blocks: int = 16  # fp32 tiles: the split products' dC GEMM over a chunk's
    # rows needs a longer reduction to pay (below 2048 rows the saved columns ran faster)
    wide_mm_stages: int = 3  # fp32 tiles: the Triton GEMM's stages (four of 128 x 64 fp32 tiles of
    # both operands, 256 KB, exceed the H100's and H200's 227 KB of shared memory)
    fwd_parts: bool = True
    fwd_parts_bytes: int = 256 * 1024 * 1024
    parts_store_stages: int = 2  # the parts forward of two fp32 operands that saves its tiles:
    # three stages of four 16 KB part tiles and the fp32 tile's 64 KB store staging exceed 227 KB
    fp32_precision: str = "fp32"  # the products of fp32 operands (``common.dot_mode``): the
    # call's option, set on its config by ``default_config``

    def replace(self, **kw) -> "LCEConfig":
        return dataclasses.replace(self, **kw)

    def for_tiles(self, dtype: torch.dtype) -> "LCEConfig":
        """The config for logits tiles of ``dtype`` (``common.compute_dtype``): fp32 ones (an
        fp32 head) take H steps of ``wide_block_h`` and vocabulary tiles of at most
        ``wide_block_v`` columns (and the Triton GEMM, ``gemm._mm``, at most ``wide_mm_stages``
        stages over fp32 operands), so that the pipeline's fp32 operand tiles fit in shared
        memory and the split products' accumulator fits in registers; and chunks of the
        gradients in forward of at least ``wide_gif_min_blocks`` row blocks."""
        if dtype != torch.float32:
            return self
        return self.replace(
            fwd_block_h=min(self.fwd_block_h, self.wide_block_h),
            bwd_block_h=min(self.bwd_block_h, self.wide_block_h),
            fwd_block_v=min(self.fwd_block_v, self.wide_block_v),
            bwd_block_v=min(self.bwd_block_v, self.wide_block_v),
            gif_min_blocks=max(self.gif_min_blocks, self.wide_gif_min_blocks))


# TMA descriptors and the flat forward loop: a faster forward and step (docs/design.md, "Hopper");
# the flat dlogits loop measured no gain (docs/tried.md), so it stays off.
HOPPER_CONFIG = LCEConfig(fwd_desc=True, bwd_desc=True, fwd_flat=True)
# Pre-Hopper GPUs (supported, not tuned on hardware): smaller tiles, deeper pipelines.
AMPERE_CONFIG = LCEConfig(
    fwd_block_n=128, fwd_block_v=128, fwd_block_h=32, fwd_warps=8, fwd_stages=4,
    bwd_block_n=128, bwd_block_v=128, bwd_block_h=32, bwd_warps=8, bwd_stages=4,
    mm_block_m=128, mm_block_n=128, mm_block_k=32, mm_warps=8, mm_stages=4,
)
# The interpreter runs tiles through numpy: small tiles keep the CPU tests quick.
INTERPRET_CONFIG = LCEConfig(
    fwd_block_n=16, fwd_block_v=32, fwd_block_h=16, fwd_group_n=2, fwd_warps=4, fwd_stages=1,
    split=2,
    bwd_block_n=16, bwd_block_v=32, bwd_block_h=16, bwd_group_n=2, bwd_warps=4, bwd_stages=1,
    mm_block_m=16, mm_block_n=32, mm_block_k=16, mm_group_m=2, mm_warps=4, mm_stages=1,
    chunk_bytes=37 * 24 * 4,  # a few chunks even on the tiny test shapes
    matmul="triton",
    gif_rows=16, row_block=16, row_warps=4, wide_block_h=16, wide_block_v=32,
    fwd_parts_bytes=32 * 1024,  # a few launches even on the tiny test shapes
)

#: Values of ``LCEConfig.strategy``.
STRATEGIES = ("auto", "saved", "grad_in_forward", "recompute")

#: Set to an ``LCEConfig`` to override the automatic choice (benchmarks and tests do this, here
#: in this module: ``default_config`` reads it from here).
OVERRIDE_CONFIG: Optional[LCEConfig] = None


def default_config(device: torch.device, fp32_precision: Optional[str] = None) -> LCEConfig:
    """The configuration a call on ``device`` uses: ``OVERRIDE_CONFIG`` or the device's table,
    with the fields of ``VPL_LCE_CONFIG`` applied on top, and the call's ``fp32_precision``
    when given."""
    if OVERRIDE_CONFIG is not None:
        cfg = OVERRIDE_CONFIG
    elif device.type != "cuda" or settings.interpreting():
        cfg = INTERPRET_CONFIG
    else:
        major, _ = torch.cuda.get_device_capability(device)
        cfg = HOPPER_CONFIG if major >= 9 else AMPERE_CONFIG
    overrides = settings.lce_config_overrides()
    if overrides:
        cfg = cfg.replace(**overrides)
    if fp32_precision is not None and fp32_precision != cfg.fp32_precision:
        cfg = cfg.replace(fp32_precision=fp32_precision)
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"LCEConfig.strategy must be one of {STRATEGIES}, got {cfg.strategy!r}")
    return cfg
