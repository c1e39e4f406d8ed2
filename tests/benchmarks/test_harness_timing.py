"""The benchmark harness's timed loops on the CPU clock: what runs between which stamps, and the
medians; and the logits problem's shape specs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from harness import timing  # noqa: E402
from harness.peers.logits import IMPLS, Case  # noqa: E402


class FakeClock(timing.Device):
    """A CPU device whose stamps are a counter, advanced by the steps themselves."""

    def __init__(self):
        super().__init__("cpu")
        self.now = 0.0
        self.log = []

    def stamp(self):
        self.log.append("stamp")
        return self.now

    def sync(self):
        self.log.append("sync")


def test_timed_fwd_bwd_stamps_forward_and_backward_apart():
    dev = FakeClock()

    def before():
        dev.log.append("before")

    def forward():
        dev.log.append("fwd")
        dev.now += 1e-3  # 1 ms
        return "loss"

    def backward(out):
        assert out == "loss"
        dev.log.append("bwd")
        dev.now += 3e-3
        return "grad"

    seen = []
    stamps = timing.timed_fwd_bwd(dev, forward, backward, 3, before, sync_each=True,
                                  after=lambda i, out: seen.append((i, out)))
    assert seen == [(0, "loss"), (1, "loss"), (2, "loss")]
    assert dev.log == ["before", "stamp", "fwd", "stamp", "bwd", "stamp", "sync"] * 3 + ["sync"]
    fwd, bwd, total = timing.fwd_bwd_medians(dev, stamps)
    assert fwd == pytest.approx(1) and bwd == pytest.approx(3) and total == pytest.approx(4)


def test_timed_pairs_and_interleaved_rounds():
    dev = FakeClock()
    pairs = timing.timed_pairs(dev, lambda: setattr(dev, "now", dev.now + 2e-3), 4)
    assert len(pairs) == 4 and dev.median_ms(pairs) == pytest.approx(2)
    order = []
    steps = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    out = timing.interleaved(dev, steps, 3)
    assert order == ["a", "b"] * 3 and set(out) == {"a", "b"}


def test_peak_during_on_cpu():
    out, peak = timing.Device("cpu").peak_during(lambda: 7)
    assert out == 7 and peak is None


def test_case_specs_and_skips():
    c = Case.parse("16384x32000-fp32-ls0.1-z1e-4")
    assert (c.n, c.v, c.dtype, c.smoothing, c.z_loss) == (16384, 32000, "fp32", 0.1, 1e-4)
    assert Case.parse(c.name) == c and Case(8, 16).name == "8x16"
    with pytest.raises(ValueError, match="bad shape"):
        Case.parse("16384")
    assert IMPLS["quack"].skip_reason(Case(8, 16, smoothing=0.1), cuda=True) == "no label smoothing"
    assert IMPLS["torch_fp32"].skip_reason(Case(8, 16, "fp32"), cuda=True) == \
        "same as torch_eager on fp32 input"
    assert IMPLS["te"].skip_reason(Case(8, 16), cuda=False) == "needs CUDA"
    assert IMPLS["ours"].skip_reason(Case(8, 16, z_loss=1e-4), cuda=False) is None
