"""Where the host time of one forward goes (CUDA): allocation, kernel launch, Python layers.

    python scripts/host_overhead.py [--import megatron.core,liger_kernel.transformers,...]

``--import`` imports those modules first (what a training process has loaded): the figures then
show whether any of them slows the path down (a Triton launch hook, say, turns the fast launch
off), and the Triton hooks found set are printed.

Each figure is the mean CPU time per call over many calls on a tiny input (the GPU work is
negligible, so this is the launch-bound cost a small model or a short sequence pays), with the
fast launch path of kernels/_launch.py on, on but handing the launcher tensors instead of the
pointer ints, and off (as with ``VPL_FAST_LAUNCH=0``).
"""

from __future__ import annotations

import time

import torch

from vocab_parallel_loss import cross_entropy
from vocab_parallel_loss._layout import row_view
from vocab_parallel_loss._options import LossOptions
from vocab_parallel_loss.kernels import _launch
from vocab_parallel_loss.kernels import cross_entropy as K


def per_call_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def _import_first() -> None:
    import importlib
    import sys

    if "--import" not in sys.argv:
        return
    for name in sys.argv[sys.argv.index("--import") + 1].split(","):
        try:
            importlib.import_module(name)
            print(f"imported {name}")
        except Exception as e:  # a peer that is not installed: say so and go on
            print(f"not imported {name}: {type(e).__name__}: {e}")
    from triton import knobs

    rt = knobs.runtime
    for hook in ("launch_enter_hook", "launch_exit_hook"):
        h = getattr(rt, hook, None)
        print(f"triton {hook}: {getattr(h, 'calls', h)}")


def _set_mode(mode: str) -> None:
    """The launch path: "fast", "tensor ptrs" (fast, but tensors to the launcher) or "off"."""
    _launch.set_enabled(mode != "off")
    if mode != "off":
        _launch._decide()  # decides now, so that the setting below is not undone at first use
        _launch._int_pointers = _launch._enabled and mode == "fast" and _launch._takes_int_pointers()


def main() -> None:
    _import_first()
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 128, (8,), device="cuda")
    loss = torch.empty(8, device="cuda")
    lse = torch.empty(8, device="cuda")
    view = row_view(x)
    opts = LossOptions(0, 128, -100, 0.0, 0.0)
    rows = {
        "torch.empty x2": lambda: (torch.empty(8, device="cuda"), torch.empty(8, device="cuda")),
        "triton forward launch": lambda: K.forward(view, t, opts, None, loss, lse),
        "cross_entropy(none), no grad": lambda: cross_entropy(x.detach(), t),
        "cross_entropy(none)": lambda: cross_entropy(x, t),
        "cross_entropy(mean)": lambda: cross_entropy(x, t, reduction="mean"),
        "fwd+bwd (none)": lambda: torch.autograd.grad(cross_entropy(x, t).sum(), x),
    }
    print(f"{'':32s} {'fast launch':>12s} {'tensor ptrs':>12s} {'off':>9s}   (best of 3 "
          "alternating runs; tensor ptrs: the fast path handing the launcher tensors, not ints)")
    for name, fn in rows.items():
        times = {"fast": [], "tensor ptrs": [], "off": []}
        for _ in range(3):  # alternate, so that drift of the host does not favour one side
            for mode, out in times.items():
                _set_mode(mode)
                out.append(per_call_us(fn))
        print(f"{name:32s} {min(times['fast']):9.1f} us {min(times['tensor ptrs']):9.1f} us "
              f"{min(times['off']):6.1f} us", flush=True)
    # the floor: Triton's compiled launcher called with ready arguments (no key, no lookup)
    _launch.set_enabled(True)
    K.forward(view, t, opts, None, loss, lse)
    K.forward(view, t, opts, None, loss, lse)
    cache = _launch._caches.get(K._ce_forward_kernel)
    if cache:
        run, function, metadata, tail, _ = next(iter(cache.values()))
        stream = torch.cuda.current_stream().cuda_stream
        # exactly K.forward's arguments
        args = (x, t, loss, loss, lse, 8, 128, view.D1, view.s0, view.s1, t.stride(0), 0, 128,
                -100, 0.0, 0.0)
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        floors = {"ints": [], "tensors": []}
        for _ in range(3):
            for kind, a in (("ints", ints), ("tensors", args)):
                floors[kind].append(per_call_us(lambda a=a: run(
                    8, 1, 1, stream, function, metadata, None, None, None, *a, *tail)))
        print(f"{'compiled launcher alone':32s} {min(floors['ints']):9.1f} us "
              f"{min(floors['tensors']):9.1f} us  (pointers as ints / as tensors)", flush=True)
    _set_mode("fast")
    fn = rows["cross_entropy(none)"]
    before = dict(_launch.counts)
    fn()
    print(f"launches of one cross_entropy(none): {_launch.counts['fast'] - before['fast']} fast, "
          f"{_launch.counts['triton'] - before['triton']} through Triton (fast path "
          f"{'on' if _launch._enabled else 'not supported here'})")


if __name__ == "__main__":
    main()
