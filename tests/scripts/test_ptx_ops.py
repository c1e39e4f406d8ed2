"""The backward's per-element arithmetic, counted in PTX for sm_90 (no GPU needed): label
smoothing and z-loss must not add instructions per element to the plain loop (the unfolded
smoothing formula had one more per element)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_smoothing_and_z_loss_add_no_per_element_work_to_the_backward():
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no NVIDIA toolchain to compile for sm_90")
    # compiled in a fresh process: under TRITON_INTERPRET=1 the kernels are interpreted
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "ptx_ops.py"), "--kernel",
                          "backward", "--v", "32000"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    ops = {}
    for line in out.stdout.splitlines():
        m = re.match(r"(\w+)\s+(plain|smoothing|z-loss)\s+\d+ regs, (\d+) ops, (\d+) elem"
                     r"\w*/thread, (\d+) 16-byte", line)
        if m:  # per element a thread streams (the configs may differ by variant)
            ops[m.group(1), m.group(2)] = int(m.group(3)) / int(m.group(4))
            # compiled as launched (16-byte aligned rows): the logits move as 16-byte vectors
            assert int(m.group(5)) > 0, line
    assert len(ops) == 6, out.stdout
    for dtype in ("bfloat16", "float32"):
        plain = ops[dtype, "plain"]
        # ~19 instructions per element (~300 for a block of 16 elements per thread); a
        # per-element op adds 1, the per-row coefficients a fraction of one
        assert ops[dtype, "smoothing"] <= plain + 0.5, ops
        assert ops[dtype, "z-loss"] <= plain + 0.5, ops


@pytest.mark.timeout(600)
def test_ptxas_registers_and_ptx_ops_compile_the_fused_kernel():
    """Both compile-only scripts compile the fused kernel with every constexpr it has (a new
    constexpr with a default once broke ``ptxas_registers.py``: a compile through ASTSource
    gets no defaults)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no NVIDIA toolchain to compile for sm_90")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    for cmd in (["ptxas_registers.py", "--configs", "16384:16384:8:0:0"],
                ["ptx_ops.py", "--kernel", "fused", "--v", "16032"]):
        out = subprocess.run([sys.executable, str(REPO / "scripts" / cmd[0]), *cmd[1:]], env=env,
                             capture_output=True, text=True, timeout=600, cwd=REPO)
        assert out.returncode == 0, (cmd, out.stderr[-3000:])
        assert re.search(r"\d+ (registers|regs)", out.stdout), (cmd, out.stdout)
