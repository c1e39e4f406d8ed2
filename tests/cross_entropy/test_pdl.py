"""Programmatic dependent launch of the fused path of a mean (``_pdl`` in kernels/logits.py).

What can be checked without a GPU: when it is on, and that the chained kernels compile for
Hopper (sm_90) with the grid-dependency instructions where the safety argument needs them. On
the GPU, tests/cross_entropy/test_cross_entropy_gpu.py::test_chained_launches_match_plain_ones checks the bits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vocab_parallel_loss.kernels import logits as K

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("env,on", [(None, True), ("0", False), ("1", True)])
def test_on_unless_turned_off_and_never_off_cuda(monkeypatch, env, on):
    K._pdl.cache_clear()
    try:
        if env is None:
            monkeypatch.delenv(K.PDL_ENV, raising=False)
        else:
            monkeypatch.setenv(K.PDL_ENV, env)
        assert not K._pdl(torch.device("cpu"))
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
            assert K._pdl(torch.device("cuda")) == on
    finally:
        K._pdl.cache_clear()
    assert K._chain(False) == {}
    assert K._chain(True) == dict(GDC=True, launch_pdl=True)


# Compiles the three kernels for sm_90 (no GPU needed) and reports, per kernel, the order of the
# grid-dependency instructions and the global loads in the PTX. The signature is read from the
# kernel's parameters (pointers 16-byte aligned, as launches get them), and every constexpr not
# given takes its default: a compile through ASTSource applies none.
_PROBE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vocab_parallel_loss.kernels import logits as K
from vocab_parallel_loss.kernels.launch import PINNED

POINTERS = {"x_ptr": "*bf16", "dx_ptr": "*bf16", "tgt_ptr": "*i64", "count_ptr": "*i64"}
SCALARS = {"s0": "i64", "s1": "i64", "d0": "i64", "d1": "i64", "smoothing": "fp32",
           "z_loss": "fp32"}

def ptx(fn, consts, warps):
    sig, full = {}, {}
    for p in fn.params:
        if p.is_constexpr:
            full[p.name] = consts[p.name] if p.name in consts else p.default
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = POINTERS.get(p.name, "*fp32")
        else:
            sig[p.name] = SCALARS.get(p.name, "i32")
    assert set(consts) <= set(full), set(consts) - set(full)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n][0] == "*"}
    src = ASTSource(fn=fn, signature=sig, constexprs=full, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, **PINNED))
    return k.asm["ptx"]

def order(text):
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("griddepcontrol."):
            out.append(s.split()[0].rstrip(";"))
        elif s.startswith("ld.global"):
            out.append("ld")
    return out

gdc = sys.argv[1] == "1"
print(json.dumps({
    "count": order(ptx(K._ce_count_kernel, dict(BLOCK=4096, GDC=gdc), 16)),
    "reduce": order(ptx(K._ce_reduce_kernel, dict(MEAN=True, COUNTED=True, BLOCK=4096, GDC=gdc),
                        16)),
    "fused": order(ptx(K._ce_forward_grad_kernel,
                       dict(MEAN=True, HAS_SMOOTHING=False, HAS_Z=False, BLOCK=1024, VEC=8,
                            GRAD_BLOCK=1024, GDC=gdc), 8)),
}))
"""


def _compiled_order(gdc: bool) -> dict:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no NVIDIA toolchain to compile for sm_90")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _PROBE, "1" if gdc else "0"], env=env,
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_chained_kernels_compile_for_hopper_with_the_waits_where_they_belong():
    got = _compiled_order(gdc=True)
    # the count kernel lets its dependents start before it reads anything
    assert got["count"][0] == "griddepcontrol.launch_dependents"
    # the reduction waits before its first load
    assert got["reduce"][0] == "griddepcontrol.wait"
    # the fused kernel reads (the row's first pass) before it waits, and reads after (the count
    # and the second pass)
    fused = got["fused"]
    assert fused.count("griddepcontrol.wait") == 1
    wait = fused.index("griddepcontrol.wait")
    assert 0 < wait < len(fused) - 1
    plain = _compiled_order(gdc=False)
    assert not any(op.startswith("griddepcontrol") for ops in plain.values() for op in ops)
