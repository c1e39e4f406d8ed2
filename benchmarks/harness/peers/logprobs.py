"""Per-token log-probs and entropy from hidden states: this package and its peers.

Each implementation is ``fn(h, w, t) -> (log_probs, entropy)`` for hidden states h (N, H), the
output layer's weight w (V, H) and targets t (N,), at ``TEMPERATURE``. ``load_verl`` and
``load_liger`` raise when their peer cannot be loaded.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.utils.checkpoint

GiB = 2**30
TEMPERATURE = 0.9


#: The name of a batch-invariant row: ``INVARIANT.format(name of its default twin)``.
INVARIANT = "{}, batch-invariant"


def ours(h, w, t, memory_budget=None, batch_invariant=False):
    from vocab_parallel_loss import linear_token_logprobs

    out = linear_token_logprobs(h, w, t, temperature=TEMPERATURE, return_entropy=True,
                                memory_budget=memory_budget, batch_invariant=batch_invariant)
    return out.log_probs, out.entropy


def ours_at(gib):
    """Ours under ``memory_budget`` = ``gib`` GiB (the default budget is the ``ours`` row)."""
    return f"ours @{gib:g} GiB", lambda h, w, t: ours(h, w, t, int(gib * GiB))


def ours_invariant(gib=None):
    """Ours with ``batch_invariant=True``, under the default budget or ``gib`` GiB: the twin of
    the ``ours`` / ``ours_at(gib)`` row."""
    name = "ours" if gib is None else f"ours @{gib:g} GiB"
    budget = None if gib is None else int(gib * GiB)
    return INVARIANT.format(name), lambda h, w, t: ours(h, w, t, budget, batch_invariant=True)


def torch_plain(h, w, t):
    x = (h @ w.t()).float() / TEMPERATURE
    ls = x.log_softmax(-1)
    return ls.gather(-1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)


def _chunk(h, w, t):
    return torch_plain(h, w, t)


def torch_chunked(h, w, t, rows=1024):
    """TRL-style: row chunks, each recomputed in backward (activation checkpointing)."""
    lps, ents = [], []
    for r0 in range(0, h.shape[0], rows):
        lp, ent = torch.utils.checkpoint.checkpoint(_chunk, h[r0:r0 + rows], w, t[r0:r0 + rows],
                                                    use_reentrant=False)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def load_verl(verl_dir):
    """verl's ``linear_cross_entropy`` from an unpacked wheel, with ``verl.utils.device``
    stubbed (the real one imports verl's platform plugins)."""
    root = Path(verl_dir) / "verl" / "utils" / "kernel"
    for name in ("verl", "verl.utils", "verl.utils.kernel"):
        sys.modules.setdefault(name, types.ModuleType(name)).__path__ = []
    sys.modules["verl.utils.kernel"].__path__ = [str(root)]
    device = types.ModuleType("verl.utils.device")
    device.get_device_capability = lambda: torch.cuda.get_device_capability()
    device.get_device_name = lambda: "cuda"
    device.is_cuda_available = torch.cuda.is_available()
    device.get_torch_device = lambda: torch.cuda
    sys.modules["verl.utils.device"] = device
    mods = {}
    for name in ("kernels", "linear_cross_entropy"):
        spec = importlib.util.spec_from_file_location(f"verl.utils.kernel.{name}", root / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mods[name]
        spec.loader.exec_module(mods[name])
    fn = mods["linear_cross_entropy"].linear_cross_entropy

    def verl(h, w, t):
        return fn(h, w, t, TEMPERATURE, "none", None)
    return verl


def load_liger():
    """Liger's fused linear scaled cross entropy: its Hopper CuTe kernel where the CUTLASS DSL
    imports, else its own chunked PyTorch fallback (what Liger itself runs then)."""
    from liger_kernel.ops import fused_linear_scaled_cross_entropy as lsce

    try:
        impl = lsce._resolve_implementation(torch.device("cuda"))
    except ImportError:
        impl = lsce._FusedLinearPPOFallbackFunction
    if impl is lsce._FusedLinearPPOFallbackFunction:
        def liger(h, w, t):
            nll, ent = impl.apply(h, w, t, TEMPERATURE, -100, True)
            return -nll, ent
        return "liger (its PyTorch fallback: no CUTLASS DSL)", liger

    def liger(h, w, t):
        nll, ent = impl.apply(h, w, t, TEMPERATURE, -100, 1, True)
        return -nll, ent
    return "liger", liger
