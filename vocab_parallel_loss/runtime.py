"""What the code is running under: torch.compile tracing, CUDA-graph capture."""

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
