"""Programmatic dependent launch of the fused path of a mean (``_pdl`` in kernels/cross_entropy.py).

What can be checked without a GPU: when it is on, and that the chained kernels compile for
Hopper (sm_90) with the grid-dependency instructions where the safety argument needs them. On
the GPU, tests/gpu/test_gpu_core.py::test_chained_launches_match_plain_ones checks the bits.
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
# grid-dependency instructions and the global loads in the PTX.
_PROBE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vocab_parallel_loss.kernels import logits as K
sys.path.insert(0, "scripts")
from ptxas_registers import constexpr_defaults, signature

def ptx(fn, sig, consts, warps):
    consts = constexpr_defaults(fn, consts)  # every constexpr, unset ones at their defaults
    sig = {**sig, **{name: "constexpr" for name in consts}}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
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
count_sig = {"tgt_ptr": "*i64", "count_ptr": "*i64", "N": "i32", "tgt_stride": "i32",
             "ignore_index": "i32"}
reduce_sig = {"loss_ptr": "*fp32", "tgt_ptr": "*i64", "out_ptr": "*fp32", "count_ptr": "*i64",
              "N": "i32", "tgt_stride": "i32", "ignore_index": "i32"}
fused_sig = signature("bf16")  # the launched signature, kept in scripts/ptxas_registers.py
print(json.dumps({
    "count": order(ptx(K._ce_count_kernel, count_sig, dict(BLOCK=4096, GDC=gdc), 16)),
    "reduce": order(ptx(K._ce_reduce_kernel, reduce_sig,
                        dict(MEAN=True, COUNTED=True, BLOCK=4096, GDC=gdc), 16)),
    "fused": order(ptx(K._ce_forward_grad_kernel, fused_sig,
                       dict(MEAN=True, HAS_SMOOTHING=False, HAS_Z=False, BLOCK=1024, VEC=8,
                            GRAD_BLOCK=1024, SPLIT=False, GDC=gdc, SUM_IN_GRAD=False,
                            FIRST_HINT="evict_last", SECOND_HINT="evict_first", STORE_HINT=""),
                       8)),
}))
'''


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
