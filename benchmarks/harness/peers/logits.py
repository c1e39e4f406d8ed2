"""Cross entropy over logits: this package and its peers behind one call.

``IMPLS[name].make(ctx)`` returns ``loss_fn(x, target, reduction, case)`` for 2-D logits x (N, V)
(a vocabulary shard under tensor parallelism) and targets (N,) (global ids); reduction is
``"none"`` (loss shaped (N,)) or ``"mean"`` (scalar); ``case.smoothing`` and ``case.z_loss`` are
the options (used only where the ``Impl`` declares support). ``make`` imports its peer and raises
(ImportError, mostly) when it cannot run here: the benchmark then skips it with the reason.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import dist
from ..report import reason


@dataclass(frozen=True)
class Case:
    """One problem: N tokens x V (a vocabulary shard under TP), the input dtype and the loss
    options an adapter reads."""

    n: int
    v: int
    dtype: str = "bf16"
    smoothing: float = 0.0
    z_loss: float = 0.0

    @property
    def name(self) -> str:
        s = f"{self.n}x{self.v}"
        if self.dtype != "bf16":
            s += f"-{self.dtype}"
        if self.smoothing:
            s += f"-ls{self.smoothing:g}"
        if self.z_loss:
            s += f"-z{self.z_loss:g}"
        return s

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[self.dtype]

    @staticmethod
    def parse(spec: str) -> "Case":
        """``NxV`` with optional ``-fp32``/``-fp16``, ``-ls<a>`` (label smoothing) and ``-z<w>``
        (z-loss weight) suffixes, e.g. ``8192x256000-ls0.1`` or ``16384x32000-z1e-4``."""
        opt = r"fp32|fp16|bf16|ls[0-9.]+(?:e-?\d+)?|z[0-9.]+(?:e-?\d+)?"
        m = re.fullmatch(rf"(\d+)x(\d+)((?:-(?:{opt}))*)", spec.strip())
        if not m:
            raise ValueError(
                f"bad shape {spec!r}: expected NxV[-fp32][-ls0.1][-z1e-4]")
        dtype, ls, z = "bf16", 0.0, 0.0
        for part in re.findall(rf"-({opt})", m.group(3)):
            if part.startswith("ls"):
                ls = float(part[2:])
            elif part.startswith("z"):
                z = float(part[1:])
            else:
                dtype = part
        return Case(int(m.group(1)), int(m.group(2)), dtype, ls, z)


class Context:
    """What adapters share in one process: the TP group (None: one GPU, no communication),
    megatron-core's TP group, and remarks for the report."""

    def __init__(self, dev, group=None, megatron_group=None,
                 notes: Optional[Dict[str, str]] = None):
        self.dev = dev
        self.group = group
        self._megatron_group = megatron_group
        self.notes: Dict[str, str] = {} if notes is None else notes

    def megatron_tp_group(self):
        """The group given, or megatron-core's TP group of size 1 over a 1-rank world."""
        if self._megatron_group is None:
            dist.one_rank_group(self.dev)
            self._megatron_group = dist.megatron_tp_group(1, fresh=False)
        return self._megatron_group


LossFn = Callable[[torch.Tensor, torch.Tensor, str, Case], torch.Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    make: Callable[[Context], LossFn]
    smoothing: bool = True  # supports label smoothing
    z_loss: bool = False  # supports a z-loss term (z * lse^2 per token)
    cpu: bool = False  # runs on CPU (used by dry runs)
    triton: bool = False  # Triton kernels: runs on CPU under TRITON_INTERPRET=1
    fp32_same_as: Optional[str] = None  # identical to that impl on fp32 input: skipped there
    package: Optional[str] = None  # distribution name whose version is recorded

    def runs_on(self, cuda: bool) -> bool:
        """On CPU only impls marked cpu, or Triton ones under TRITON_INTERPRET=1 (slow, tiny
        shapes)."""
        return cuda or self.cpu or (self.triton and os.environ.get("TRITON_INTERPRET") == "1")

    def skip_reason(self, case, cuda: bool) -> Optional[str]:
        """Why this impl does not run ``case`` (its dtype and options) here, or None."""
        if not self.runs_on(cuda):
            return "needs CUDA"
        if case.smoothing and not self.smoothing:
            return "no label smoothing"
        if case.z_loss and not self.z_loss:
            return "no z-loss"
        if case.dtype == "fp32" and self.fp32_same_as:
            return f"same as {self.fp32_same_as} on fp32 input"
        return None


IMPLS: Dict[str, Impl] = {}


def register(name: str, **kw):
    def deco(make):
        IMPLS[name] = Impl(name, make, **kw)
        return make

    return deco


def _mean(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """For implementations without a reduction: no ignored targets here, so mean = sum / N."""
    loss = loss.reshape(-1)
    return loss if reduction == "none" else loss.mean()


class _Alias(torch.autograd.Function):
    """The same buffer as a non-leaf: ``inplace_backward=True`` refuses a leaf (it would
    overwrite a parameter), while the bench's leaf is a throwaway copy whose buffer the
    gradient may take, as the in-place peers' gradients do."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        return g


def _ours(inplace: bool):
    def make(ctx):
        from vocab_parallel_loss import cross_entropy

        g = ctx.group
        return lambda x, t, red, c: cross_entropy(
            _Alias.apply(x) if inplace else x, t, tp_group=g, reduction=red,
            label_smoothing=c.smoothing, z_loss=c.z_loss, inplace_backward=inplace)

    return make


register("ours", cpu=True, z_loss=True, package="vocab_parallel_loss")(_ours(False))
register("ours_inplace", cpu=True, z_loss=True, package="vocab_parallel_loss")(_ours(True))


@register("torch_eager", cpu=True, package="torch")
def _torch_eager(ctx):
    return lambda x, t, red, c: F.cross_entropy(x, t, reduction=red, label_smoothing=c.smoothing)


def _fp32_cross_entropy(x, t, red, c):
    return F.cross_entropy(x.float(), t, reduction=red, label_smoothing=c.smoothing)


@register("torch_fp32", cpu=True, fp32_same_as="torch_eager", package="torch")
def _torch_fp32(ctx):
    return _fp32_cross_entropy


@register("torch_compile", cpu=True, package="torch")
def _torch_compile(ctx):
    # one static graph per (shape, dtype, path, smoothing): allow_many_graphs() raises dynamo's
    # cache limit
    return torch.compile(_fp32_cross_entropy, dynamic=False)


@register("megatron_native", cpu=True, package="megatron-core")
def _megatron_native(ctx):
    from megatron.core import tensor_parallel

    ctx.megatron_tp_group()
    # Megatron takes [s, b, v] logits and [s, b] targets, its TP group from parallel_state; the
    # loss is per token, fp32; it works in place on its input
    return lambda x, t, red, c: _mean(
        tensor_parallel.vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), c.smoothing),
        red)


@register("megatron_fused", smoothing=False, cpu=True, package="megatron-core")
def _megatron_fused(ctx):
    from megatron.core import jit
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    # its elementwise pieces are decorated at import with megatron.core.jit.jit_fuser
    ctx.notes["megatron_fused"] = f"jit_fuser = {getattr(jit.jit_fuser, '__qualname__', jit.jit_fuser)}"
    group = ctx.megatron_tp_group()
    return lambda x, t, red, c: _mean(
        fused_vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), group), red)


def _te(overwrite: bool):
    def make(ctx):
        try:
            from transformer_engine.pytorch import parallel_cross_entropy
        except ImportError:
            # TE's Triton loss alone, extracted unchanged from the released wheel into the
            # te-triton-ce wheel: transformer_engine_torch has no wheel for torch 2.11 / CUDA 13
            from te_triton_ce import parallel_cross_entropy
        kw = {"overwrite_input": True} if overwrite else {}  # TE >= 2.x: gradient over the input
        g = ctx.group
        # TE takes (B, SQ, V) logits; reduce_loss=True gives the mean over non-ignored tokens
        return lambda x, t, red, c: parallel_cross_entropy(
            x.unsqueeze(0), t.unsqueeze(0), c.smoothing, red == "mean", g, **kw).reshape(
                () if red == "mean" else -1)

    return make


register("te", package="transformer-engine")(_te(False))
register("te_inplace", package="transformer-engine")(_te(True))


@register("liger", triton=True, z_loss=True, package="liger-kernel")
def _liger(ctx):
    from liger_kernel.transformers import LigerCrossEntropyLoss

    @functools.lru_cache(maxsize=None)
    def module(red, ls, z):
        return LigerCrossEntropyLoss(reduction=red, label_smoothing=ls, lse_square_scale=z)

    return lambda x, t, red, c: module(red, c.smoothing, c.z_loss)(x, t)


def _quack(inplace: bool):
    def make(ctx):
        from quack import cross_entropy

        return lambda x, t, red, c: cross_entropy(x, t, reduction=red, inplace_backward=inplace)

    return make


register("quack", smoothing=False, package="quack-kernels")(_quack(False))
register("quack_inplace", smoothing=False, package="quack-kernels")(_quack(True))


@register("apex", package="apex")
def _apex(ctx):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    # (logits, labels, smoothing, padding_idx, half_to_float): no target equals -100 here
    return lambda x, t, red, c: _mean(
        SoftmaxCrossEntropyLoss.apply(x, t, c.smoothing, -100, x.dtype != torch.float32), red)


def make_all(names, ctx: Context, cuda: bool) -> Tuple[Dict[str, LossFn], Dict[str, str]]:
    """Every adapter of ``names`` made once: ``{name: loss_fn}``, and ``{name: why}`` for those
    that cannot run here (on the CPU, or their peer unavailable)."""
    fns: Dict[str, LossFn] = {}
    skipped: Dict[str, str] = {}
    for name in names:
        impl = IMPLS[name]
        if not impl.runs_on(cuda):
            skipped[name] = "needs CUDA (dry run)"
            continue
        try:
            fns[name] = impl.make(ctx)
        except Exception as e:
            skipped[name] = f"unavailable: {reason(e, first_line=True)}"
    return fns, skipped


def allow_many_graphs() -> None:
    """torch.compile (and megatron's jit_fuser when it is torch.compile) compiles once per shape
    and path: more graphs per function than dynamo's default limit of 8."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 512)
