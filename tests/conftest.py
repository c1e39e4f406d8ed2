"""Test-wide setup.

Without a GPU the Triton kernels run on CPU through Triton's interpreter. TRITON_INTERPRET must be
set before any kernel is defined, so it is set here, before a test module imports the package
(an explicit TRITON_INTERPRET in the environment is respected).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["triton", "torch"])
def impl(request, monkeypatch):
    """Each backend in turn: the Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1) and
    the pure-PyTorch one, forced through ``backends.triton_runs``; the call plans are reset (a
    plan records the backend's fused path)."""
    from vocab_parallel_loss import backends
    from vocab_parallel_loss.ops.cross_entropy import function as logits

    if request.param == "triton":
        if backends.triton_logits is None:
            pytest.skip("triton not importable")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1")
    monkeypatch.setattr(backends, "triton_runs", lambda t: request.param == "triton")
    monkeypatch.setattr(logits, "_plans", {})
    return request.param

