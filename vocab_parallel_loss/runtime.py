"""What the code is running under: torch.compile tracing, CUDA-graph capture, autocast."""

import contextlib

import torch


def compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - torch < 2.3
        return False


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@torch._dynamo.disable
def untraced(fn, *args):
    """``fn(*args)`` outside torch.compile's graph (a graph break), run as eager code runs it:
    for the Triton paths whose host code (chunk loops, descriptors, saved tiles) Dynamo cannot
    trace."""
    return fn(*args)


def no_autocast(device: torch.device):
    """A context with autocast off on ``device``: the ops inside compute in their inputs' dtypes
    whatever autocast region the caller is in (a custom Function's backward runs under the
    autocast of the region that calls it, not that of its forward)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
