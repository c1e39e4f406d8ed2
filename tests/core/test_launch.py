"""The fast launch path (kernels/_launch.py): what can be checked without a GPU.

On the GPU, tests/gpu/test_gpu_core.py checks that the path is taken and gives the same bits.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from vocab_parallel_loss import cross_entropy
from vocab_parallel_loss.kernels import _launch

HAS_NATIVE_SPECIALIZER = hasattr(importlib.import_module("triton._C.libtriton"),
                                 "native_specialize_impl")


@pytest.mark.skipif(not HAS_NATIVE_SPECIALIZER, reason="Triton without native_specialize_impl")
def test_key_is_as_fine_as_tritons_specialization():
    assert _launch._specializer_agrees(device="cpu")


def test_key_tells_apart_what_triton_specializes_on():
    key = _launch._args_key
    x = torch.empty(64)
    distinct = [(16,), (17,), (1,), (2**31,), (2**31 + 1,), (2**63,), (2**63 + 1,), (1.0,),
                (True,), (x,), (x[1:],), (x.half(),), (x.half()[1:],)]
    assert len({key(a) for a in distinct}) == len(distinct)
    assert key((x[4:], 32, 0)) == key((x, 48, 16)) and key((x, 2)) == key((x, 3))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_off_under_the_interpreter():
    before = _launch.counts["fast"]
    x = torch.randn(4, 32, requires_grad=True)
    torch.autograd.grad(cross_entropy(x, torch.randint(0, 32, (4,))).sum(), x)
    assert _launch._enabled is False and _launch.counts["fast"] == before


def test_env_var_turns_it_off():
    code = "from vocab_parallel_loss.kernels import _launch; print(_launch._enabled)"
    env = dict(os.environ, VPL_FAST_LAUNCH="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_no_grad_shortcut_matches_the_autograd_function(reduction):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=g)
    t = torch.randint(0, 40, (2, 3), generator=g)
    t[0, 1] = -100
    plain = cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
    tracked = cross_entropy(x.clone().requires_grad_(), t, reduction=reduction,
                            label_smoothing=0.1)
    assert not plain.requires_grad and tracked.requires_grad
    assert torch.equal(plain, tracked.detach())
