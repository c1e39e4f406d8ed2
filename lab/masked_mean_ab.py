"""Lab: why the masked per-token fused linear step can time below the mean step, though both
run the same forward and plan. Hypothesis: the data, not the code. The masked step's loss
mask zeroes every seventh row of the formed dlogits, and a GEMM over zeros draws less power,
so a power-limited GPU holds a higher clock through the two gradient GEMMs.

    python lab/masked_mean_ab.py [--n 16384 --hidden 4096 --vocab 128256 --rounds 7]

Times, interleaved (every step once per round, L2 flushed before each):
- the package's steps: ``mean``; ``masked`` (every seventh token masked out); ``masked_ones``
  (the same masked call, no token masked out);
- cuBLAS alone: the dE GEMM ``dlogits @ C`` with dlogits dense, every seventh row zero, and
  all zero.
If ``masked_ones`` times as ``mean`` and the GEMM with zero rows times below the dense one, the
gap is the data's. The mean SM clock and power over each step's rounds are printed beside
(NVML), when it is importable. One JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import env  # noqa: E402

env.use_checkout_package()

from harness.peers.linear import loss_mask, make_inputs, make_ours, make_step  # noqa: E402
from harness.timing import Device  # noqa: E402


class Sampler:
    """SM clock (MHz) and power (W) sampled every millisecond while ``key`` is set."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # NVML absent: timings only
            self.nv = None
        self.key, self.samples, self.stop = None, {}, False
        if self.nv:
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        nv = self.nv
        while not self.stop:
            k = self.key
            if k is not None:
                clk = nv.nvmlDeviceGetClockInfo(self.h, nv.NVML_CLOCK_SM)
                pw = nv.nvmlDeviceGetPowerUsage(self.h) / 1000
                self.samples.setdefault(k, []).append((clk, pw))
            time.sleep(0.001)

    def summary(self, k):
        s = self.samples.get(k)
        if not s:
            return {}
        return {"sm_mhz": round(statistics.mean(x for x, _ in s)),
                "watts": round(statistics.mean(y for _, y in s))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    dev = Device("cuda")
    e, c, t, up = make_inputs(dev.torch, a.n, a.hidden, a.vocab)
    ours = make_ours()
    ones = torch.ones_like(loss_mask(t))

    def masked_with(mask):
        def step():
            loss, leaves = ours(e, c, t, "none", mask)
            total = torch.sum(loss.float().view(-1) * mask.view(-1)) / mask.sum()
            return torch.autograd.grad(total, leaves)
        return step

    g = torch.Generator(device=dev.torch).manual_seed(1)
    dl = (torch.randn(a.n, a.vocab, device=dev.torch, generator=g) * 1e-3).bfloat16()
    dl7 = dl * loss_mask(t).view(-1, 1).bfloat16()
    dl0 = torch.zeros_like(dl)
    cw = c.detach()
    steps = {
        "mean": make_step(ours, e, c, t, "mean", up),
        "masked": make_step(ours, e, c, t, "masked", up),
        "masked_ones": masked_with(ones),
        "gemm_dE_dense": lambda: dl @ cw,
        "gemm_dE_every7_zero": lambda: dl7 @ cw,
        "gemm_dE_zero": lambda: dl0 @ cw,
    }
    for s in steps.values():  # compile and warm
        s()
    dev.sync()
    sampler = Sampler()
    times = {k: [] for k in steps}
    for _ in range(a.rounds):
        for k, s in steps.items():
            dev.flush_l2()
            dev.sync()
            sampler.key = k
            x, y = dev.stamp(), None
            s()
            y = dev.stamp()
            dev.sync()
            sampler.key = None
            times[k].append(x.elapsed_time(y))
    sampler.stop = True
    for k, ts in times.items():
        row = {"step": k, "ms": round(statistics.median(ts), 3), "min": round(min(ts), 3),
               "max": round(max(ts), 3), "rounds": len(ts), **sampler.summary(k)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
