"""What the code is running under: torch.compile tracing, CUDA-graph capture."""

import torch


def compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - torch < 2.3
        return False


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
