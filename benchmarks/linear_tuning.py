"""Tuning tools of ``bench_linear.py`` for this package's fused linear kernels: the tile-config
sweeps (``--sweep``, ``--sweep-set``) and the steps of the saved-tiles strategy timed alone
(``--phases``), with their sections of the report."""

from __future__ import annotations

import json

import torch

from harness.errors import rel_max_diff
from harness.peers.linear import GiB, make_inputs, make_ours, make_step
from harness.report import table
from harness.step import measure_with_grads
from harness.timing import Device
from vocab_parallel_loss import linear_cross_entropy
from vocab_parallel_loss.kernels import linear as K
from vocab_parallel_loss.kernels.linear import config as C
from vocab_parallel_loss.kernels.linear import gemm as G

# (config delta, reduction): "none" exercises the default 8NHV path; "mean" + grad_in_forward
# the 6NHV path.
SWEEP = [
    {},
    dict(chunk_bytes=256 << 20),
    dict(strategy="grad_in_forward"),
]
SWEEP_TILES = [
    {},
    dict(fwd_block_v=128, bwd_block_v=128),
    dict(fwd_stages=4, bwd_stages=4),
    dict(fwd_block_n=256, fwd_block_v=128, bwd_block_n=256, bwd_block_v=128),
    dict(fwd_block_v=128, fwd_warps=4, fwd_stages=4, bwd_block_v=128, bwd_warps=4, bwd_stages=4),
    dict(matmul="triton"),
    dict(chunk_bytes=256 << 20),
    dict(split=1),
    dict(split=8),
    dict(split=16, fwd_group_n=8),
    dict(fwd_group_n=8, bwd_group_n=16),
    dict(strategy="grad_in_forward"),
    dict(strategy="grad_in_forward", gif_rows=8192),
    dict(strategy="grad_in_forward", gif_rows=2048),
    dict(strategy="grad_in_forward", row_block=4096, row_warps=16),
]
# TMA descriptors for E and C in the fused kernels, the forward's flat loop, and tiles that let
# two programs share a multiprocessor (one's softmax epilogue overlapping the other's matmul):
# 128x128 with 4 warps and 3 stages is 96 KB of shared memory and 255 registers per thread.
_D = dict(fwd_desc=True, bwd_desc=True)
SWEEP_TMA = [
    {},
    _D,
    dict(_D, fwd_flat=True),
    dict(_D, fwd_flat=True, fwd_stages=4),
    dict(_D, fwd_flat=True, fwd_block_v=128, fwd_warps=4, bwd_block_v=128, bwd_warps=4),
    dict(_D, fwd_stages=4, bwd_stages=4),
    dict(_D, fwd_block_v=128, fwd_warps=4, bwd_block_v=128, bwd_warps=4),
    dict(_D, fwd_block_v=128, bwd_block_v=128),
    dict(_D, fwd_block_n=256, fwd_block_v=128, bwd_block_n=256, bwd_block_v=128),
    dict(fwd_block_v=128, fwd_warps=4, bwd_block_v=128, bwd_warps=4),
    dict(fwd_block_v=128, bwd_block_v=128, fwd_warps=4, bwd_warps=4, fwd_group_n=8),
    dict(_D, fwd_block_v=128, fwd_warps=4, bwd_block_v=128, bwd_warps=4, fwd_stages=4,
         bwd_stages=4),
]
# the default against the pointer kernels and its nearest neighbours (run with a long --rep)
SWEEP_TMA_AB = [
    {},
    dict(fwd_desc=False, bwd_desc=False, fwd_flat=False),
    dict(fwd_stages=4),
    dict(bwd_desc=False),
    dict(fwd_flat=False),
    dict(fwd_stages=4, bwd_stages=4),
]
# the forward's vocabulary splits per row block ({} = _forward_splits' choice); run at several
# --n: 16384 rows once chose 5, 4096 rows 17, 65536 rows 2
SWEEP_SPLIT = [{}] + [dict(split=s) for s in (2, 4, 5, 6, 7, 8, 9, 17)]
# alternated twice: the current choice at 16384 rows (6 at V=128256, 7 at 16032) against a floor
# of ceil(SMs / GROUP_N) = 9 splits (all programs in flight within one group of row blocks) and 17
SWEEP_SPLIT_AB = [dict(split=s) for s in (6, 7, 9, 17) * 2]
SWEEPS = {"modes": SWEEP, "tiles": SWEEP_TILES, "tma": SWEEP_TMA, "tma-ab": SWEEP_TMA_AB,
          "split": SWEEP_SPLIT, "split-ab": SWEEP_SPLIT_AB}


def sweep(dev: Device, n, h, v, warmup, rep, sweep_list):
    e, c, t, up = make_inputs(dev.torch, n, h, v)
    base = C.default_config(e.device)
    results = []
    ref = None  # the first config's per-token loss and gradients, to check every other one
    for delta in sweep_list:
        cfg = base.replace(**delta)
        C.OVERRIDE_CONFIG = cfg
        red = "mean" if delta.get("strategy") == "grad_in_forward" else "none"
        try:
            with torch.no_grad():  # forward statistics only (the gif path needs grad mode)
                fwd_ms = dev.bench(
                    lambda: linear_cross_entropy(e, c, t, reduction=red, impl="triton"),
                    warmup, rep)
            ms, peak, gbytes, _ = measure_with_grads(dev, make_step(make_ours(), e, c, t, red, up),
                                                     warmup, rep)
            loss = linear_cross_entropy(e, c, t, reduction="none", impl="triton")
            got = (loss.detach(), *torch.autograd.grad(loss, (e, c), up))
        except Exception as ex:
            print(f"sweep {delta}: failed {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            continue
        if ref is None:
            ref = got
        # relative to the largest entry: loss, dE, dC against the first config
        diff = [round(rel_max_diff(a, b), 8) for a, b in zip(got, ref)]
        del got, loss
        r = dict(delta=delta, reduction=red, fwd_split=K.forward_split(n, v, cfg, e.device)[0],
                 fwd_ms=round(fwd_ms, 3), ms=round(ms, 3),
                 fwd_tflops=round(2 * n * h * v / fwd_ms / 1e9, 1),
                 bwd_tflops=round(6 * n * h * v / max(ms - fwd_ms, 1e-6) / 1e9, 1),
                 tflops_8nhv=round(8 * n * h * v / ms / 1e9, 1),
                 tflops_6nhv=round(6 * n * h * v / ms / 1e9, 1),
                 peak_extra_minus_grads_GiB=round((peak - gbytes) / GiB, 3),
                 rel_diff_loss_de_dc=diff)
        print("sweep", json.dumps(r), flush=True)
        results.append(r)
    C.OVERRIDE_CONFIG = None
    return results


def phases(dev: Device, n, h, v, warmup, rep):
    """Each step of the saved-tiles strategy timed alone, with cuBLAS's rate on the logits GEMM
    (the floor's rate): where the time goes."""
    e, c, t, _ = make_inputs(dev.torch, n, h, v, grad=False)
    cfg = C.default_config(e.device)
    saved = K.saved_tiles(n, v, e.dtype, e.device, cfg)
    stats = K.forward_stats(e, c, None, t, 0, None, False, config=cfg, saved=saved)
    lse = stats[0] + stats[1].log()
    coef = torch.stack([lse, torch.full_like(lse, 1.0 / n), torch.full_like(lse, 1.0 / n),
                        torch.zeros_like(lse), stats[2]])
    de = torch.empty((n, h), dtype=e.dtype, device=e.device)
    dc = torch.empty_like(c)
    flops = 2 * n * h * v
    steps = {
        "cuBLAS logits e @ c.T (bf16 out)": (lambda: e @ c.t(), flops),
        "forward statistics": (lambda: K.forward_stats(e, c, None, t, 0, None, False, config=cfg), flops),
        "forward statistics + saved tiles": (
            lambda: K.forward_stats(e, c, None, t, 0, None, False, config=cfg, saved=saved), flops),
        "dz pass (in place)": (lambda: K.backward_saved(saved, e, c, False, t, 0, coef, None, False,
                                                        False, e.dtype, cfg), 0),
        "dE = dz @ c": (lambda: G.gemm_store(de, saved.u, c, cfg), flops),
        "dC = dz.T @ e": (lambda: G.gemm_store(dc, saved.u.t(), e, cfg), flops),
    }
    for block, warps in ((1024, 4), (4096, 8), (4096, 16), (8192, 16)):  # the dz pass's tiles
        other = cfg.replace(row_block=block, row_warps=warps)
        steps[f"dz pass, row_block {block}, {warps} warps"] = (
            lambda o=other: K.backward_saved(saved, e, c, False, t, 0, coef, None, False, False,
                                             e.dtype, o), 0)
    out = []
    for name, (fn, fl) in steps.items():
        ms = dev.bench(fn, warmup, rep)
        r = dict(v=v, step=name, ms=round(ms, 3), tflops=round(fl / ms / 1e9, 1) if fl else None,
                 gbps=round(n * v * e.element_size() * 2 / ms / 1e6, 1) if not fl else None)
        print("phase", json.dumps(r), flush=True)
        out.append(r)
    return out


def sweep_markdown(sweep_rows) -> str:
    lines = ["", "Sweep (ours; fwd = no-grad forward):", ""]
    lines += table(
        ["V", "delta", "reduction", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "bwd TFLOP/s",
         "6NHV TFLOP/s", "8NHV TFLOP/s", "extra GiB", "rel. diff loss, dE, dC vs first"],
        [(r["v"], f"`{json.dumps(r['delta'])}`", r["reduction"], r["fwd_ms"], r["ms"],
          r["fwd_tflops"], r["bwd_tflops"], r["tflops_6nhv"], r["tflops_8nhv"],
          r["peak_extra_minus_grads_GiB"], r.get("rel_diff_loss_de_dc")) for r in sweep_rows])
    return "\n".join(lines) + "\n"


def phases_markdown(phase_rows) -> str:
    return "\n".join(["", "Steps of the saved-tiles strategy, each alone:", ""] + table(
        ["V", "step", "ms", "TFLOP/s", "GB/s (read + write)"],
        [(r["v"], r["step"], r["ms"], r["tflops"], r["gbps"]) for r in phase_rows])) + "\n"
