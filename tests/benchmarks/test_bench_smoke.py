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


@pytest.mark.timeout(120)
def test_bench_measures_the_package_on_pythonpath(tmp_path):
    """An A/B runs this bench.py over another tree's package through PYTHONPATH: the bench must
    import that package, not put its own checkout first (it did until session 13, so an A/B
    measured one tree twice), and report which one ran."""
    import shutil
    import subprocess

    other = tmp_path / "tree"
    shutil.copytree(REPO / "vocab_parallel_loss", other / "vocab_parallel_loss",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (other / "vocab_parallel_loss" / "_marker.py").write_text("# only in the other tree\n")
    probe = ("import importlib.util, sys; "
             f"spec = importlib.util.spec_from_file_location('bench', {str(REPO / 'scripts' / 'bench.py')!r}); "
             "m = importlib.util.module_from_spec(spec); sys.modules['bench'] = m; "
             "spec.loader.exec_module(m); print(m._package_dir()); print(m._source_hash())")
    env = dict(__import__("os").environ)
    runs = {}
    for name, pythonpath in (("other", str(other)), ("own", "")):
        env["PYTHONPATH"] = pythonpath
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=100, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = out.stdout.split()
    assert Path(runs["other"][0]) == (other / "vocab_parallel_loss").resolve()
    assert runs["other"][1] != runs["own"][1]  # the hash covers the imported tree's files


@pytest.mark.timeout(120)
def test_bench_host_overhead_has_yardsticks():
    """The host-time figures come with two yardsticks timed in the same process (two bare
    ``torch.empty`` calls, one launch of a no-op Triton kernel), so a run on a slow host shows as
    one rather than as a slower loss."""
    bench = _load("bench")
    out = bench.measure_host_overhead(bench.Device("cpu", "dirty", 0), 3)
    for key in ("forward", "forward_backward", "yardstick_torch_empty_x2",
                "yardstick_triton_launch"):
        assert "error" not in out[key], (key, out[key])
        assert out[key]["host_us"] > 0, (key, out[key])
