"""The benchmark harness runs end to end on CPU (dry run) and writes its three reports."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(300)
def test_bench_dry_run_writes_json_markdown_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    bench = _load("bench")
    bench.main(["--dry-run", "--impls", "ours,torch_eager", "--shapes", "16x64", "--no-extras",
                "--out-dir", str(tmp_path)])
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert {".json", ".md", ".png"} <= set(files), files
    data = json.loads(files[".json"].read_text())
    ours = [r for r in data["results"] if r["impl"] == "ours"]
    assert ours and all(r["status"] == "ok" and r["loss_err"] < 1e-4 and r["total_ms"] > 0
                        for r in ours), ours


@pytest.mark.timeout(300)
def test_bench_gpu_lead_is_recorded(tmp_path):
    """``--gpu-lead-us`` (a GPU sleep before each rep; nothing to sleep on CPU) is named in the
    file names, the JSON metadata and the table's header, so no table hides how it was timed."""
    pytest.importorskip("matplotlib")
    bench = _load("bench")
    bench.main(["--dry-run", "--impls", "ours", "--shapes", "16x64", "--paths", "mean",
                "--no-extras", "--gpu-lead-us", "250", "--out-dir", str(tmp_path)])
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert all(p.stem.endswith("-gpu-lead") for p in files.values()), files
    data = json.loads(files[".json"].read_text())
    assert data["meta"]["gpu_lead_us"] == 250
    assert "GPU sleep of 250 us" in files[".md"].read_text()
