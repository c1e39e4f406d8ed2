#!/usr/bin/env python
"""Side-by-side benchmark of cross-entropy implementations over logits on one GPU.

Every implementation runs on the same inputs in the same process: this package (default and
``inplace_backward=True``), torch eager (input dtype, and cast to fp32), ``torch.compile`` of the
fp32 cast, megatron-core native and fused, TransformerEngine's Triton ``parallel_cross_entropy``
(default and ``overwrite_input=True``), Liger, quack (default and in-place) and apex xentropy.
Peers that cannot be imported are skipped with the reason, in the output as well. Shapes: five
bf16 shapes, then fp32 input, label smoothing 0.1 and z-loss 1e-4 on 16384 x 32000
(each only for the implementations that support it).

Two paths per shape: ``none`` (per-token loss, backward with a random non-uniform fp32 upstream
gradient through ``torch.autograd.grad``, as into an output layer) and ``mean`` (scalar loss,
backward with the implicit 1). For each: forward, backward and total ms (median over reps, CUDA
events, L2 flushed before each rep), the ratio to the memory bound ``B x N x V / BW`` (B = 6 bytes
per bf16 element per-token, 4 reduced, scaled by the element size; BW from a device-to-device copy
in the same run), the peak memory over the inputs in units of the logits' bytes (the gradient
left behind counted), and the largest loss and gradient error against an fp32 PyTorch reference.
Extras: the cost of the TP statistics collective on a 1-rank NCCL group, and the host overhead
of one forward of this package (eager, and CUDA graph replay).

Writes ``<gpu>-<date>.json``, ``.md`` and ``.png`` into ``--out-dir`` (default
``benchmarks/results``). The JSON is rewritten after every shape, so a run cut short keeps what
it measured.

    python benchmarks/bench_logits.py                 # full run on the GPU (about 5-6 minutes)
    python benchmarks/bench_logits.py --quick         # smoke run: small shapes, short timings
    python benchmarks/bench_logits.py --dry-run       # CPU, tiny shapes: checks the whole pipeline
    python benchmarks/bench_logits.py --shapes 16384x16032,16384x32000-fp32 --impls ours,liger --paths none
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import torch
import torch._dynamo
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
from _common import Device, fmt, log  # noqa: E402

common.use_checkout_package()


# --------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
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
            raise argparse.ArgumentTypeError(
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


# The shapes (N tokens x V_local): Llama-2 32K, Llama-3 128K, Gemma 256K, Llama-3 over TP8
# (128256 / 8 = 16032), and the same shard with 4x the tokens; then fp32 input, label smoothing
# and z-loss on one shape (each should be within 5% of bf16 per-token in bytes-normalised time).
FULL_CASES = [Case(16384, 32000), Case(16384, 128256), Case(8192, 256000), Case(16384, 16032),
              Case(65536, 16032), Case(16384, 32000, "fp32"), Case(16384, 32000, smoothing=0.1),
              Case(16384, 32000, z_loss=1e-4)]
QUICK_CASES = [Case(4096, 32000), Case(4096, 16032), Case(2048, 16032, "fp32"),
               Case(2048, 16032, smoothing=0.1), Case(2048, 16032, z_loss=1e-4)]
DRY_CASES = [Case(64, 1000), Case(48, 512, "fp32"), Case(48, 512, smoothing=0.1),
             Case(48, 512, z_loss=1e-4)]
PATHS = ("none", "mean")


# ---------------------------------------------------------------------------------- process
class Env:
    """Lazily created process state shared by adapters: the 1-rank process group, Megatron."""

    def __init__(self, dev: Device):
        self.dev = dev
        self._megatron_group = None
        self.notes: Dict[str, str] = {}  # adapters' remarks, written into the report

    def dist_group(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if "MASTER_PORT" not in os.environ:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            kw = {"device_id": self.dev.torch} if self.dev.cuda else {}
            dist.init_process_group("nccl" if self.dev.cuda else "gloo", rank=0, world_size=1, **kw)
        return dist.group.WORLD

    def megatron_tp_group(self):
        if self._megatron_group is None:
            from megatron.core import parallel_state

            self.dist_group()
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            self._megatron_group = parallel_state.get_tensor_model_parallel_group()
        return self._megatron_group

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ implementations
# An adapter factory takes the Env and returns loss_fn(x, target, reduction, case) for 2-D
# logits x (N, V) and targets (N,); reduction is "none" (loss shaped (N,)) or "mean" (scalar);
# case.smoothing and case.z_loss are the options (used only where the Impl declares support).
# It raises (ImportError, mostly) when the implementation cannot run here: it is then skipped.
LossFn = Callable[[torch.Tensor, torch.Tensor, str, "Case"], torch.Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    make: Callable[[Env], LossFn]
    smoothing: bool = True  # supports label smoothing
    z_loss: bool = False  # supports a z-loss term (z * lse^2 per token)
    cpu: bool = False  # runs on CPU (used by --dry-run)
    triton: bool = False  # Triton kernels: runs on CPU under TRITON_INTERPRET=1
    fp32_same_as: Optional[str] = None  # identical to that impl on fp32 input: skipped there
    package: Optional[str] = None  # distribution name whose version is recorded


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
    def make(env):
        from vocab_parallel_loss import cross_entropy

        return lambda x, t, red, c: cross_entropy(
            _Alias.apply(x) if inplace else x, t, reduction=red, label_smoothing=c.smoothing,
            z_loss=c.z_loss, inplace_backward=inplace)

    return make


register("ours", cpu=True, z_loss=True, package="vocab_parallel_loss")(_ours(False))
register("ours_inplace", cpu=True, z_loss=True, package="vocab_parallel_loss")(_ours(True))


@register("torch_eager", cpu=True, package="torch")
def _torch_eager(env):
    return lambda x, t, red, c: F.cross_entropy(x, t, reduction=red, label_smoothing=c.smoothing)


def _fp32_cross_entropy(x, t, red, c):
    return F.cross_entropy(x.float(), t, reduction=red, label_smoothing=c.smoothing)


@register("torch_fp32", cpu=True, fp32_same_as="torch_eager", package="torch")
def _torch_fp32(env):
    return _fp32_cross_entropy


@register("torch_compile", cpu=True, package="torch")
def _torch_compile(env):
    # one static graph per (shape, dtype, path, smoothing); main() raises dynamo's cache limit
    return torch.compile(_fp32_cross_entropy, dynamic=False)


@register("megatron_native", cpu=True, package="megatron-core")
def _megatron_native(env):
    from megatron.core import tensor_parallel

    env.megatron_tp_group()
    # Megatron takes [s, b, v] logits and [s, b] targets; the loss is per token, fp32
    return lambda x, t, red, c: _mean(
        tensor_parallel.vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), c.smoothing),
        red)


@register("megatron_fused", smoothing=False, cpu=True, package="megatron-core")
def _megatron_fused(env):
    from megatron.core import jit
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    # its elementwise pieces are decorated at import with megatron.core.jit.jit_fuser
    env.notes["megatron_fused"] = f"jit_fuser = {getattr(jit.jit_fuser, '__qualname__', jit.jit_fuser)}"
    group = env.megatron_tp_group()
    return lambda x, t, red, c: _mean(
        fused_vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), group), red)


def _te(overwrite: bool):
    def make(env):
        try:
            from transformer_engine.pytorch import parallel_cross_entropy
        except ImportError:
            # TE's Triton loss alone, extracted unchanged from the released wheel into the
            # te-triton-ce wheel: transformer_engine_torch has no wheel for torch 2.11 / CUDA 13
            from te_triton_ce import parallel_cross_entropy
        kw = {"overwrite_input": True} if overwrite else {}  # TE >= 2.x: gradient over the input
        # TE takes (B, SQ, V) logits; reduce_loss=True gives the mean over non-ignored tokens
        return lambda x, t, red, c: parallel_cross_entropy(
            x.unsqueeze(0), t.unsqueeze(0), c.smoothing, red == "mean", **kw).reshape(
                () if red == "mean" else -1)

    return make


register("te", package="transformer-engine")(_te(False))
register("te_inplace", package="transformer-engine")(_te(True))


@register("liger", triton=True, z_loss=True, package="liger-kernel")
def _liger(env):
    from liger_kernel.transformers import LigerCrossEntropyLoss

    @functools.lru_cache(maxsize=None)
    def module(red, ls, z):
        return LigerCrossEntropyLoss(reduction=red, label_smoothing=ls, lse_square_scale=z)

    return lambda x, t, red, c: module(red, c.smoothing, c.z_loss)(x, t)


def _quack(inplace: bool):
    def make(env):
        from quack import cross_entropy

        return lambda x, t, red, c: cross_entropy(x, t, reduction=red, inplace_backward=inplace)

    return make


register("quack", smoothing=False, package="quack-kernels")(_quack(False))
register("quack_inplace", smoothing=False, package="quack-kernels")(_quack(True))


@register("apex", package="apex")
def _apex(env):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    # (logits, labels, smoothing, padding_idx, half_to_float): no target equals -100 here
    return lambda x, t, red, c: _mean(
        SoftmaxCrossEntropyLoss.apply(x, t, c.smoothing, -100, x.dtype != torch.float32), red)


# ---------------------------------------------------------------------------------- measuring
@dataclass
class Inputs:
    logits: torch.Tensor
    target: torch.Tensor
    g: torch.Tensor  # upstream gradient of the per-token loss: random, non-uniform, fp32

    @staticmethod
    def make(case: Case, dev: Device, seed: int = 0) -> "Inputs":
        gen = torch.Generator(device=dev.torch).manual_seed(seed)
        logits = torch.randn(case.n, case.v, generator=gen, device=dev.torch,
                             dtype=torch.float32).mul_(2.0).to(case.torch_dtype)
        target = torch.randint(0, case.v, (case.n,), generator=gen, device=dev.torch)
        g = torch.rand(case.n, generator=gen, device=dev.torch).add_(0.5)
        return Inputs(logits, target, g)


@dataclass
class Reference:
    loss: torch.Tensor
    grad: torch.Tensor  # fp32

    @staticmethod
    def make(inp: Inputs, path: str, case: Case) -> "Reference":
        x = inp.logits.detach().float().requires_grad_(True)
        loss = F.cross_entropy(x, inp.target, reduction="none", label_smoothing=case.smoothing)
        if case.z_loss:
            loss = loss + case.z_loss * torch.logsumexp(x, dim=-1).square()
        loss = loss if path == "none" else loss.mean()
        (grad,) = torch.autograd.grad(loss, x, inp.g if path == "none" else None)
        return Reference(loss.detach(), grad)


@dataclass
class Result:
    impl: str
    case: str
    path: str
    n: int
    v: int
    dtype: str
    smoothing: float
    z_loss: float
    status: str = "ok"  # ok | skipped | error
    note: str = ""
    fwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    total_ms: Optional[float] = None
    reps: int = 0
    bound_ms: Optional[float] = None
    ratio: Optional[float] = None
    ratio_6b: Optional[float] = None  # mean path: vs the per-token bound (row not kept on chip)
    bw_fraction: Optional[float] = None
    peak_extra_bytes: Optional[int] = None
    mem_x_logits: Optional[float] = None
    loss_err: Optional[float] = None
    grad_err: Optional[float] = None
    loss_dtype: Optional[str] = None
    sm_clock_mhz: Optional[int] = None  # mid-way through the timed reps


def bytes_per_element(case: Case, path: str) -> int:
    """Minimal HBM traffic: per-token read + read + write (3 x elsize), reduced read + write."""
    elsize = torch.empty((), dtype=case.torch_dtype).element_size()
    return (3 if path == "none" else 2) * elsize


def max_abs_diff(a: torch.Tensor, ref: torch.Tensor, rows: int = 2048) -> float:
    """max |a - ref| in fp32, a block of rows at a time (no full-size temporary)."""
    if a.dim() < 2:
        return (a.float().reshape(ref.shape) - ref).abs().max().item()
    return max((a[i:i + rows].float() - ref[i:i + rows]).abs().max().item()
               for i in range(0, a.shape[0], rows))


def run_one(fn: LossFn, case: Case, path: str, inp: Inputs, ref: Reference, dev: Device,
            cfg: argparse.Namespace, res: Result) -> None:
    t, g = inp.target, inp.g

    def backward(loss, x):
        if path == "none":
            go = g if loss.dtype == g.dtype else g.to(loss.dtype)
            return torch.autograd.grad(loss, x, go)[0]
        return torch.autograd.grad(loss, x)[0]

    # 1. a first call (compilation, autotuning, lazy allocations), then correctness and memory
    #    on a fresh leaf copy of the logits (some peers overwrite them)
    x = inp.logits.detach().clone().requires_grad_(True)
    backward(fn(x, t, path, case), x)
    x = inp.logits.detach().clone().requires_grad_(True)
    base = dev.reset_peak()
    loss = fn(x, t, path, case)
    grad = backward(loss, x)
    peak = dev.peak()
    if peak is not None:
        res.peak_extra_bytes = peak - base
        res.mem_x_logits = res.peak_extra_bytes / x.nbytes
    res.loss_dtype = str(loss.dtype).replace("torch.", "")
    res.loss_err = max_abs_diff(loss.detach(), ref.loss)
    res.grad_err = max_abs_diff(grad, ref.grad)
    del loss, grad

    # 2. warm-up, which also sizes the number of timed reps to the time budget
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(cfg.warmup):
        backward(fn(x, t, path, case), x)
    dev.sync()
    per_rep = (time.perf_counter() - t0) / max(cfg.warmup, 1)
    reps = int(min(cfg.max_reps, max(cfg.min_reps, cfg.budget / max(per_rep, 1e-6))))

    # 3. timed reps: x is reused (in-place peers leave gradients in it: the time does not care)
    stamps = []
    for _ in range(reps):
        dev.flush_l2()
        a = dev.stamp()
        loss = fn(x, t, path, case)
        b = dev.stamp()
        grad = backward(loss, x)
        c = dev.stamp()
        stamps.append((a, b, c))
        del loss, grad
        if len(stamps) == reps // 2 + 1:  # the GPU still has reps queued: its working clock
            res.sm_clock_mhz = dev.sm_clock_mhz()
    dev.sync()
    res.fwd_ms = dev.median_ms((a, b) for a, b, _ in stamps)
    res.bwd_ms = dev.median_ms((b, c) for _, b, c in stamps)
    res.total_ms = dev.median_ms((a, c) for a, _, c in stamps)
    res.reps = reps


def runs_here(impl: Impl, dev: Device) -> bool:
    """On CPU only impls marked cpu, or Triton ones under TRITON_INTERPRET=1 (slow, tiny shapes)."""
    return dev.cuda or impl.cpu or (impl.triton and os.environ.get("TRITON_INTERPRET") == "1")


def skip_reason(impl: Impl, case: Case, dev: Device) -> Optional[str]:
    if not runs_here(impl, dev):
        return "needs CUDA"
    if case.smoothing and not impl.smoothing:
        return "no label smoothing"
    if case.z_loss and not impl.z_loss:
        return "no z-loss"
    if case.dtype == "fp32" and impl.fp32_same_as:
        return f"same as {impl.fp32_same_as} on fp32 input"
    return None


# ------------------------------------------------------------------------------------- extras
def measure_bandwidth(dev: Device, gib: float) -> dict:
    """Device-to-device copy; bytes read + written over the median time."""
    nbytes = int(gib * (1 << 30)) if dev.cuda else 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev.torch).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20 if dev.cuda else 5):
        a = dev.stamp()
        dst.copy_(src)
        b = dev.stamp()
        times.append((a, b))
    dev.sync()
    ms = dev.median_ms(times)
    del src, dst
    return {"copy_bytes": nbytes, "copy_ms": ms, "copy_TBps": 2 * nbytes / (ms * 1e-3) / 1e12}


@functools.lru_cache(maxsize=None)
def _noop_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def noop(x_ptr, n):
        tl.store(x_ptr + tl.arange(0, 16), tl.zeros((16,), tl.float32), mask=tl.arange(0, 16) < n)

    return noop


def measure_host_overhead(dev: Device, n_calls: int) -> dict:
    """Per-forward host overhead of ours on a tiny input (Python + launches), eager and graphed,
    next to two yardsticks timed in the same process: two bare ``torch.empty`` calls and one
    launch of a one-line Triton kernel through Triton's own launch path. The H200 hosts run the
    same code at up to 2x different speeds between processes and moments (docs/performance.md);
    the yardsticks say how fast this process's host was."""
    from vocab_parallel_loss import cross_entropy

    x = torch.randn(8, 128, device=dev.torch, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 128, (8,), device=dev.torch)
    g = torch.rand(8, device=dev.torch)
    out = {"shape": [8, 128],
           "forward": dev.host_us(lambda: cross_entropy(x, t), n_calls),
           "forward_backward": dev.host_us(
               lambda: torch.autograd.grad(cross_entropy(x, t), x, g), n_calls),
           "yardstick_torch_empty_x2": dev.host_us(
               lambda: (torch.empty(8, device=dev.torch), torch.empty(8, device=dev.torch)),
               n_calls)}
    try:
        noop, buf = _noop_kernel(), torch.empty(16, device=dev.torch)
        out["yardstick_triton_launch"] = dev.host_us(lambda: noop[(1,)](buf, 8), n_calls)
    except Exception as e:  # no Triton here (or no interpreter on CPU): the other figures stand
        out["yardstick_triton_launch"] = {"error": f"{type(e).__name__}: {e}"}
    if dev.cuda:
        try:
            xs = x.detach()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    cross_entropy(xs, t)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                cross_entropy(xs, t)
            out["forward_graph_replay"] = dev.host_us(graph.replay, n_calls)
        except Exception as e:  # keep the eager figures if the capture fails
            out["forward_graph_replay"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def measure_collective(env: Env, n: int) -> dict:
    """The TP statistics collective at N tokens on a 1-rank group. Ours skips it at world size 1,
    so the collectives are called directly: one all-gather of the packed (4, N) fp32 stats, and
    the two-all-reduce alternative (MAX of (N,), then SUM of (3, N)) for comparison."""
    import torch.distributed as dist

    dev = env.dev
    group = env.dist_group()
    stats = torch.randn(4, n, device=dev.torch)
    gathered = torch.empty(dist.get_world_size(group) * 4, n, device=dev.torch)
    mx, rest = stats[0].clone(), stats[1:].clone()

    def all_gather():
        dist.all_gather_into_tensor(gathered, stats, group=group)

    def two_all_reduces():
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(rest, group=group)

    out = {"n": n, "world_size": dist.get_world_size(group), "backend": dist.get_backend(group)}
    for name, fn in (("all_gather_4xN", all_gather), ("all_reduce_max_then_sum", two_all_reduces)):
        try:
            for _ in range(10):
                fn()
            stamps = []
            for _ in range(200 if dev.cuda else 20):
                a = dev.stamp()
                fn()
                stamps.append((a, dev.stamp()))
            dev.sync()
            out[name] = {"us_median": dev.median_ms(stamps) * 1e3,
                         **dev.host_us(fn, 200 if dev.cuda else 20)}
        except Exception as e:  # e.g. a backend without all_gather_into_tensor
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ------------------------------------------------------------------------------------- output
def _version(dist_name: Optional[str]) -> Optional[str]:
    return common.version(dist_name)


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"# Cross-entropy benchmark: {m['device']} ({m['date']})", "",
             f"torch {m['torch']}, triton {m['triton']}, commit `{m['commit']}`, sources "
             f"`{m['source_hash']}`. Copy bandwidth {report['hbm']['copy_TBps']:.3f} TB/s "
             "(read + write). Ratio = total / (B x N x V / BW), B = 6 B/element per-token and "
             "4 B reduced for bf16 (x2 for fp32); mem = peak over the inputs, gradient left "
             "behind included, in units of the logits' bytes; errors are max abs vs an fp32 "
             "PyTorch reference." + (" L2 flush: clean (its write-back is not timed)."
                                     if m.get("flush") == "clean" else "")
             + (f" A GPU sleep of {m['gpu_lead_us']:g} us is queued before each rep's flush, "
                "untimed." if m.get("gpu_lead_us") else ""), "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v) + ".", ""]
    notes = [f"- {k}: {v}" for k, v in report.get("notes", {}).items()]
    lines += notes + [""] * bool(notes)
    results = [r for r in report["results"] if r["status"] == "ok"]
    cases = list(dict.fromkeys(r["case"] for r in report["results"]))
    for path_name in PATHS:
        rows = [r for r in results if r["path"] == path_name]
        if not rows:
            continue
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        title = "per-token loss, non-uniform upstream gradient" if path_name == "none" else "mean loss"
        lines += [f"## Ratio to the bound: {title}", "",
                  "| impl | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
        for impl in impls:
            by_case = {r["case"]: r for r in rows if r["impl"] == impl}
            lines.append(f"| {impl} | " + " | ".join(
                fmt(by_case[c]["ratio"], ".2f") if c in by_case else "-" for c in cases) + " |")
        extra = " | ratio vs 6 B" if path_name == "mean" else ""
        lines += ["", f"## Details: {title}", "",
                  f"| impl | shape | fwd ms | bwd ms | total ms | ratio{extra} | mem | loss err "
                  "| grad err | reps |", "|---" * (10 + bool(extra)) + "|"]
        for r in rows:
            r6 = f" | {fmt(r['ratio_6b'], '.2f')}" if extra else ""
            lines.append(
                f"| {r['impl']} | {r['case']} | {fmt(r['fwd_ms'], '.3f')} | {fmt(r['bwd_ms'], '.3f')} "
                f"| {fmt(r['total_ms'], '.3f')} | {fmt(r['ratio'], '.2f')}{r6} | {fmt(r['mem_x_logits'], '.2f')} "
                f"| {fmt(r['loss_err'], '.1e')} | {fmt(r['grad_err'], '.1e')} | {r['reps']} |")
        lines.append("")
    others = [r for r in report["results"] if r["status"] != "ok"]
    if report["skipped"] or others:
        lines += ["## Not measured", ""]
        lines += [f"- {k}: {v}" for k, v in report["skipped"].items()]
        grouped: Dict[tuple, list] = {}
        for r in others:
            grouped.setdefault((r["impl"], r["status"], r["note"]), []).append(f"{r['case']} ({r['path']})")
        lines += [f"- {impl}: {status}: {note}: {', '.join(where)}"
                  for (impl, status, note), where in grouped.items()]
        lines.append("")
    c = report.get("collective")
    if c:
        lines += ["## TP statistics collective", ""]
        if "error" in c:
            lines += [f"failed: {c['error']}", ""]
        else:
            lines += [f"N = {c['n']}, world size {c['world_size']} ({c['backend']}); GPU time per "
                      "call (median), host time per call:", ""]
            for k in ("all_gather_4xN", "all_reduce_max_then_sum"):
                v = c.get(k, {})
                lines.append(f"- {k}: " + (v["error"] if "error" in v else
                                             f"{v['us_median']:.1f} us GPU, {v['host_us']:.1f} us host"))
            lines.append("")
    for key, title in (("host_overhead", "with the process group of the collective above"),
                       ("host_overhead_no_group", "before any process group existed")):
        h = report.get(key)
        if not h:
            continue
        lines += [f"## Host overhead of ours (tiny input, per call), {title}", ""]
        if "error" in h:
            lines.append(f"failed: {h['error']}")
        lines += [f"- {k}: " + (v["error"] if "error" in v else
                               f"{v['host_us']:.1f} us host (best run "
                               f"{v.get('host_us_best', v['host_us']):.1f}), "
                               f"{v['wall_us']:.1f} us wall")
                  for k, v in h.items() if isinstance(v, dict)]
        lines.append("")
    return "\n".join(lines)


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if r["status"] == "ok" and r["bw_fraction"]]
    paths = [p for p in PATHS if any(r["path"] == p for r in ok)]
    if not paths:
        return
    fig, axes = plt.subplots(len(paths), 1, figsize=(13, 4.2 * len(paths)), squeeze=False)
    for ax, p in zip(axes[:, 0], paths):
        rows = [r for r in ok if r["path"] == p]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            by_case = {r["case"]: r["bw_fraction"] for r in rows if r["impl"] == impl}
            xs = [j + (i - (len(impls) - 1) / 2) * width for j, c in enumerate(cases) if c in by_case]
            ax.bar(xs, [by_case[c] for c in cases if c in by_case], width, label=impl)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(cases)), cases, fontsize=8)
        ax.set_ylabel("fraction of HBM bandwidth (bound / time)")
        bpe = "6 B" if p == "none" else "4 B"
        ax.set_title(f"{report['meta']['device']}: {'per-token' if p == 'none' else 'mean'} loss, "
                     f"fwd+bwd (bound: {bpe}/element for bf16)")
        ax.legend(fontsize=7, ncol=min(len(impls), 6), loc="upper right")
        ax.set_ylim(0, max(1.15, 1.1 * max(r["bw_fraction"] for r in rows)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: small shapes, short timings")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, CPU-capable impls only: checks the pipeline")
    p.add_argument("--shapes", type=lambda s: [Case.parse(x) for x in s.split(",") if x],
                   help="comma list of NxV[-fp32][-ls0.1][-z1e-4] (default: the full shapes)")
    p.add_argument("--impls", type=lambda s: [x for x in s.split(",") if x],
                   help=f"comma list from: {', '.join(IMPLS)}")
    p.add_argument("--paths", type=lambda s: [x for x in s.split(",") if x], default=list(PATHS),
                   help="none,mean (default both)")
    p.add_argument("--out-dir", type=Path, help="default benchmarks/results (dry run: a temp dir)")
    p.add_argument("--budget", type=float, help="seconds of timed reps per measurement")
    p.add_argument("--min-reps", type=int)
    p.add_argument("--max-reps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--bw-gib", type=float, default=2.0, help="copy buffer for the bandwidth")
    p.add_argument("--no-extras", action="store_true", help="skip collective and host overhead")
    p.add_argument("--flush", choices=("dirty", "clean"), default="dirty",
                   help="L2 before each rep: zeroed 256 MiB left dirty (default, as do_bench), "
                        "or that followed by an untimed read so its write-back is not timed")
    p.add_argument("--gpu-lead-us", type=float, default=0.0,
                   help="queue a GPU sleep of this long before each rep's flush, so host time "
                        "cannot leak into the GPU timings of short steps (default 0: off)")
    p.add_argument("--max-seconds", type=float,
                   help="stop starting new shapes after this many seconds (results so far are kept)")
    args = p.parse_args(argv)
    for k in args.paths:
        if k not in PATHS:
            p.error(f"unknown path {k!r}")
    for k in args.impls or []:
        if k not in IMPLS:
            p.error(f"unknown impl {k!r}; known: {', '.join(IMPLS)}")
    mode = "dry" if args.dry_run else "quick" if args.quick else "full"
    defaults = {"full": (0.3, 10, 200, 3), "quick": (0.05, 5, 50, 2), "dry": (0.02, 3, 5, 1)}[mode]
    for k, d in zip(("budget", "min_reps", "max_reps", "warmup"), defaults):
        if getattr(args, k) is None:
            setattr(args, k, d)
    args.mode = mode
    if args.shapes is None:
        args.shapes = {"full": FULL_CASES, "quick": QUICK_CASES, "dry": DRY_CASES}[mode]
    if args.out_dir is None:
        args.out_dir = Path("/tmp/vpl-bench-dry") if args.dry_run else common.RESULTS
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run for the CPU pipeline check")
    dev = Device("cpu" if args.dry_run else "cuda", args.flush, args.gpu_lead_us)
    # torch.compile (and megatron's jit_fuser when it is torch.compile) compiles once per shape
    # and path: more graphs per function than dynamo's default limit of 8
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 512)
    env = Env(dev)
    start = time.perf_counter()
    meta = common.environment(dev)
    stem = args.out_dir / (f"{common.slug(dev.name())}-{meta['date']}"
                           + ("-quick" if args.quick else "")
                           + ("-clean-l2" if args.flush == "clean" else "")
                           + ("-gpu-lead" if args.gpu_lead_us else ""))

    # implementations: build every selected adapter once; a failure skips it with the reason
    selected = args.impls or list(IMPLS)
    fns: Dict[str, LossFn] = {}
    skipped: Dict[str, str] = {}
    for name in selected:
        impl = IMPLS[name]
        if not runs_here(impl, dev):
            skipped[name] = "needs CUDA (dry run)"
            continue
        try:
            fns[name] = impl.make(env)
        except Exception as e:
            skipped[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for name, why in skipped.items():
        log(f"skip {name}: {why}")
    log(f"vocab_parallel_loss from {meta['package_dir']}")

    report = {
        "meta": {**meta, "device_slug": common.slug(dev.name()), "mode": args.mode,
                 "flush": args.flush, "gpu_lead_us": args.gpu_lead_us,
                 "versions": {n: _version(IMPLS[n].package) for n in fns},
                 "settings": {k: getattr(args, k) for k in ("budget", "min_reps", "max_reps", "warmup")},
                 "cases": [c.name for c in args.shapes], "paths": args.paths,
                 "upstream_grad": "per-token: uniform [0.5, 1.5) fp32; mean: implicit 1",
                 "logits": "randn * 2, rounded to the input dtype; targets uniform"},
        "notes": env.notes, "skipped": skipped, "hbm": {}, "collective": {}, "host_overhead": {}, "results": [],
    }

    def save():  # matplotlib is optional: the JSON and the table are written without it
        return common.write_report(stem, report, markdown(report), write_plot)

    report["hbm"] = measure_bandwidth(dev, args.bw_gib)
    bw = report["hbm"]["copy_TBps"] * 1e12
    log(f"{dev.name()}: copy bandwidth {report['hbm']['copy_TBps']:.3f} TB/s")
    if not args.no_extras:
        # the host overhead before and after the collective has made a process group (a
        # training process always has one); on the H200 the group made no difference beyond
        # the spread between processes
        calls = 1000 if dev.cuda else 50
        for key, fn in (("host_overhead_no_group", lambda: measure_host_overhead(dev, calls)),
                        ("collective", lambda: measure_collective(env, 16384)),
                        ("host_overhead", lambda: measure_host_overhead(dev, calls))):
            try:
                report[key] = fn()
            except Exception as e:
                report[key] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{key}: {json.dumps(report[key])}")

    for case in args.shapes:
        if args.max_seconds and time.perf_counter() - start > args.max_seconds:
            log(f"--max-seconds reached: {case.name} not run")
            report["skipped"][f"shape {case.name}"] = "--max-seconds reached"
            continue
        inp = Inputs.make(case, dev)
        for path in args.paths:
            ref = Reference.make(inp, path, case)
            bound_ms = bytes_per_element(case, path) * case.n * case.v / bw * 1e3
            for name, fn in fns.items():
                res = Result(name, case.name, path, case.n, case.v, case.dtype, case.smoothing,
                             case.z_loss, bound_ms=bound_ms)
                why = skip_reason(IMPLS[name], case, dev)
                if why:
                    res.status, res.note = "skipped", why
                else:
                    try:
                        run_one(fn, case, path, inp, ref, dev, args, res)
                        res.ratio = res.total_ms / bound_ms
                        res.ratio_6b = res.total_ms / (bytes_per_element(case, "none") * case.n
                                                       * case.v / bw * 1e3)
                        res.bw_fraction = 1.0 / res.ratio
                        log(f"{case.name:>20} {path:4} {name:16} fwd {res.fwd_ms:8.3f} bwd "
                            f"{res.bwd_ms:8.3f} total {res.total_ms:8.3f} ms  ratio {res.ratio:5.2f}  "
                            f"mem {fmt(res.mem_x_logits, '.2f'):>5}  err {res.loss_err:.1e}/{res.grad_err:.1e}"
                            + (f"  sm {res.sm_clock_mhz} MHz" if res.sm_clock_mhz else ""))
                    except Exception as e:
                        res.status = "error"
                        res.note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                        log(f"{case.name:>20} {path:4} {name:16} ERROR {res.note}")
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                report["results"].append(asdict(res))
                gc.collect()
                if dev.cuda:
                    torch.cuda.empty_cache()
            del ref
        del inp
        save()
    written = save()
    env.close()
    log(f"wrote {', '.join(str(p) for p in written)}")
    return report


if __name__ == "__main__":
    main()
