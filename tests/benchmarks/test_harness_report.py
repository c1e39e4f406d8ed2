"""The benchmark harness's report writer: the JSON, markdown and plot side by side, a failing or
missing plot noted without losing the numbers, and the markdown helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from harness import report  # noqa: E402


def test_write_report_writes_json_markdown_and_plot(tmp_path):
    def plot(rep, path):
        path.write_bytes(b"png")

    stem = tmp_path / "sub" / "run"
    data = {"meta": {"device": "cpu"}, "rows": [{"ms": 1.5}]}
    written = report.write_report(stem, data, "# title", plot)
    assert [p.name for p in written] == ["run.json", "run.md", "run.png"]
    assert json.loads((tmp_path / "sub" / "run.json").read_text()) == data
    assert (tmp_path / "sub" / "run.md").read_text() == "# title\n"


@pytest.mark.parametrize("error, note", [(ImportError("no matplotlib"), "no plot: no matplotlib"),
                                          (ValueError("bad axis"), "plot failed: ValueError: bad axis")])
def test_a_failing_plot_is_noted_and_the_numbers_kept(tmp_path, error, note):
    def plot(rep, path):
        raise error

    for notes in ({}, []):
        data = {"rows": [1], "notes": notes}
        written = report.write_report(tmp_path / "r", data, None, plot)
        assert [p.name for p in written] == ["r.json"]
        saved = json.loads((tmp_path / "r.json").read_text())
        assert saved["rows"] == [1]
        assert (saved["notes"] == {"plot": note} if isinstance(notes, dict)
                else saved["notes"] == [f"plot: {note}"])


def test_table_fmt_front_and_reason():
    assert report.table(["a", "b", "c"], [[1, "x", None]], "lrc") == [
        "| a | b | c |", "|---|---:|:---:|", "| 1 | x | None |"]
    assert report.table(["a"], [])[1] == "|---|"
    assert report.fmt(None, ".2f", "-") == "-" and report.fmt(float("nan"), ".2f") == ""
    assert report.fmt(1.234, ".2f") == "1.23"
    rows = [dict(n="fast", mem=3, ms=1), dict(n="lean", mem=1, ms=5), dict(n="worse", mem=2, ms=6),
            dict(n="mid", mem=2, ms=2)]
    assert [r["n"] for r in report.front(rows, "mem", "ms")] == ["lean", "mid", "fast"]
    assert report.slug("NVIDIA H200 (x)") == "nvidia-h200-x"
    assert report.reason(ValueError("a\nb"), first_line=True) == "ValueError: a"
    assert report.reason(KeyError("k")) == "KeyError: 'k'"


def test_fp32_head_markdown_of_the_loss_table_alone():
    """``--fp32-head-tables loss``: no empty log-prob sections, and a title that says what ran."""
    from harness import fp32_head

    meta = dict(device="cpu", n=8, hidden=4, vocab=[11], torch="t", triton="tr", commit="c")
    loss_row = dict(impl="ours", hidden="fp32", weight="fp32", reduction="mean", vocab=11,
                    ms=1.0, extra_gib=0.1, err_loss=1e-8, **{"pass": "loss fwd+bwd"})
    text = fp32_head.markdown({"meta": meta, "rows": [loss_row]})
    assert text.startswith("# The loss with an fp32 LM head") and "## V = 11, fwd" not in text
    lp_row = dict(loss_row, err_logp=1e-7, err_entropy=1e-7, **{"pass": "fwd"})
    text = fp32_head.markdown({"meta": meta, "rows": [lp_row, loss_row]})
    assert text.startswith("# Token log-probs") and "## V = 11, fwd\n" in text
    assert "## V = 11, fwd+bwd" not in text
