"""The fast launch path (kernels/launch.py): what can be checked without a GPU.

On the GPU, tests/cross_entropy/test_cross_entropy_gpu.py checks that the path is taken and gives the same bits.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vocab_parallel_loss import cross_entropy
from vocab_parallel_loss.kernels import launch as _launch

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


def test_int_pointers_are_found_in_this_tritons_launcher(tmp_path):
    """Every Triton the fast path accepts (3.3-3.9) passes an int pointer through as is; the
    check must find that in the installed launcher's source, and not find it elsewhere."""
    assert _launch._takes_int_pointers()
    (tmp_path / "driver.c").write_text(
        "bool extractPointer(void *ptr, PyObject *obj) {\n"
        "  PyObject *ret = PyObject_CallMethodNoArgs(obj, data_ptr_str);\n}\n")
    assert not _launch._takes_int_pointers(str(tmp_path))
    (tmp_path / "driver.py").write_text(  # 3.6's launcher: a C template in a Python string
        'src = """static inline DevicePtrInfo getPointer(PyObject *obj, int idx) {{\n'
        "  if (PyLong_Check(obj)) {{\n"
        "    ptr_info.dev_ptr = PyLong_AsUnsignedLongLong(obj);\n"
        '    return ptr_info;\n  }}"""\n')
    assert _launch._takes_int_pointers(str(tmp_path))


def test_env_var_turns_it_off():
    code = "from vocab_parallel_loss.kernels import launch as _launch; print(_launch._enabled)"
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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels")
@pytest.mark.parametrize("mean", [False, True])
def test_reduction_kernel_matches_fp64(mean):
    """The single-program reduction over several 4096-token blocks (the last one partial)."""
    from vocab_parallel_loss.kernels import logits as K

    g = torch.Generator().manual_seed(11)
    loss = torch.rand(9001, generator=g) * 5
    t = torch.randint(0, 7, (9001, 2), generator=g)[:, 0]  # stride 2
    t[torch.rand(9001, generator=g) < 0.3] = -100
    loss[t == -100] = 0.0
    total, count = K.reduce(loss, t, -100, mean)
    keep = (t != -100).sum()
    want = loss.double().sum() / (keep if mean else 1)
    torch.testing.assert_close(total.double(), want, rtol=1e-6, atol=0)
    if mean:
        assert count.dtype == torch.int64 and count.item() == keep.item()
    else:
        assert count is None
    empty, n0 = K.reduce(loss[:0], t[:0], -100, True)
    assert empty.item() == 0.0 and n0.item() == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels")
@pytest.mark.parametrize("one_program_max", [0, 10**9])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduction_paths_agree_with_fp64(one_program_max, reduction, monkeypatch):
    """Both reductions of the loss: one program (small N) and PyTorch's (large N)."""
    from vocab_parallel_loss.kernels import logits as K

    monkeypatch.setattr(K, "REDUCE_ONE_PROGRAM_MAX", one_program_max)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 13, 7, generator=g, requires_grad=True)
    t = torch.randint(0, 7, (3, 13), generator=g)
    t[torch.rand(t.shape, generator=g) < 0.3] = -100
    got = cross_entropy(x, t, reduction=reduction)
    xd = x.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(xd.reshape(-1, 7), t.reshape(-1),
                                             reduction=reduction)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=1e-6)
    (g1,) = torch.autograd.grad(got, x)
    (g2,) = torch.autograd.grad(want, xd)
    torch.testing.assert_close(g1.double(), g2, rtol=1e-5, atol=1e-7)


class _Param:
    def __init__(self, name, constexpr=False):
        self.name, self.is_constexpr, self.has_default, self.default = name, constexpr, False, None


class _FakeKernel:
    """Stands in for a JITFunction: ``kernel[grid](...)`` "compiles" and records the launch."""

    params = [_Param("x"), _Param("n"), _Param("BLOCK", constexpr=True)]

    def __init__(self):
        self.compiles, self.runs = [], []

    def __getitem__(self, grid):
        def compile_and_launch(*args, **kwargs):
            self.compiles.append((args[1], kwargs["BLOCK"]))
            kernel = self

            class Compiled:
                function, packed_metadata = f"fn-{len(self.compiles)}", "meta"

                @staticmethod
                def run(g0, g1, g2, stream, function, metadata, *rest):
                    kernel.runs.append((function, rest[3:]))

            return Compiled
        return compile_and_launch


def test_launch_memo_repeats_only_identical_launches(monkeypatch):
    """A remembered launch is repeated only for the same scalars, dtypes and alignment, and
    then without building the keywords again (kernels stubbed; the GPU test checks the bits)."""
    kernel = _FakeKernel()
    monkeypatch.setattr(_launch, "_enabled", True)
    monkeypatch.setattr(_launch, "_JITFunction", _FakeKernel)
    monkeypatch.setattr(_launch, "_driver", (lambda: 0, lambda device: 7))
    monkeypatch.setattr(_launch, "_hook_owners", ())
    monkeypatch.setattr(_launch, "_knobs_runtime", None)
    monkeypatch.setattr(_launch, "_caches", {})
    made = []

    def kwargs(block=16):
        made.append(block)
        return {"BLOCK": block}

    memo, x = {}, torch.empty(64)
    _launch.launch_memo(memo, "s", kernel, (4,), (x, 5), kwargs)  # compiled, through "Triton"
    assert len(kernel.compiles) == 1 and "s" not in memo
    _launch.launch_memo(memo, "s", kernel, (4,), (x, 5), kwargs)  # the key's fast path
    assert kernel.runs[-1] == ("fn-1", (x, 5, 16)) and "s" in memo and len(made) == 2
    _launch.launch_memo(memo, "s", kernel, (4,), (x, 5), kwargs)  # the memo: no keywords built
    assert kernel.runs[-1] == ("fn-1", (x, 5, 16)) and len(made) == 2 and len(kernel.runs) == 2
    # another scalar, a misaligned pointer, another dtype: each misses the memo, and each
    # new specialization compiles once
    for args in ((x, 6), (x[1:], 5), (x.double(), 5)):
        _launch.launch_memo(memo, "s", kernel, (4,), args, kwargs)
    assert len(made) == 5 and len(kernel.compiles) == 3  # 6 shares 5's key; x[1:], double don't
    assert [r[1][1] for r in kernel.runs] == [5, 5, 6]
    # a launch hook set by a profiler: the memo steps aside too
    monkeypatch.setattr(_launch, "_hooks_set", lambda k: True)
    _launch.launch_memo(memo, "s", kernel, (4,), (x, 5), kwargs)
    assert len(made) == 6 and len(kernel.compiles) == 4


def test_every_launch_pins_fma_contraction(monkeypatch):
    """Triton 3.10 turns FMA contraction off by default: the kernels were tuned and their rounding
    tested with it on, so every launch must ask for it (``_launch.PINNED``), through the launch
    helpers and in the direct launches of the fused linear kernels."""
    calls = []

    class Recorder:  # not a JITFunction: the launch goes through ``kernel[grid]``
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(kwargs)

    monkeypatch.setattr(_launch, "_enabled", False)
    _launch.launch(Recorder(), (1,), 3, BLOCK=4)
    _launch.launch_memo({}, "slot", Recorder(), (1,), (3,), lambda: dict(BLOCK=8))
    assert calls == [dict(enable_fp_fusion=True, BLOCK=4), dict(enable_fp_fusion=True, BLOCK=8)]
    assert _launch.PINNED == {"enable_fp_fusion": True}
    launches = 0
    for path in Path(_launch.__file__).parent.rglob("*.py"):
        src = path.read_text()
        for match in re.finditer(r"\b\w+\[[^\]\n]+\]\(", src):  # ``name[grid](``
            depth, end = 1, match.end()
            while depth:  # to the matching parenthesis
                depth += {"(": 1, ")": -1}.get(src[end], 0)
                end += 1
            call = src[match.end():end]
            if "num_warps" in call:  # a kernel launch, not an indexing call
                launches += 1
                assert "**PINNED" in call, f"{path.name}: a launch without PINNED: {call[:80]}"
    assert launches >= 4  # the fused linear kernels' direct launches at least
