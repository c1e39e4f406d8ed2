"""The benchmarks run end to end on CPU (tiny shapes, the Triton interpreter) and write their
reports: bench_logits (dry run), bench_linear (--smoke-cpu), bench_hf (--tiny)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(300)
def test_bench_dry_run_writes_json_markdown_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    bench = _load("bench_logits")
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
    bench = _load("bench_logits")
    bench.main(["--dry-run", "--impls", "ours", "--shapes", "16x64", "--paths", "mean",
                "--no-extras", "--gpu-lead-us", "250", "--out-dir", str(tmp_path)])
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert all(p.stem.endswith("-gpu-lead") for p in files.values()), files
    data = json.loads(files[".json"].read_text())
    assert data["meta"]["gpu_lead_us"] == 250
    assert "GPU sleep of 250 us" in files[".md"].read_text()


@pytest.mark.timeout(120)
def test_bench_measures_the_package_on_pythonpath(tmp_path):
    """An A/B runs this checkout's bench_logits.py over another tree's package through
    PYTHONPATH: the bench must import that package, not put its own checkout first (an A/B would
    measure one tree twice), and report which one ran."""
    import shutil
    import subprocess

    other = tmp_path / "tree"
    shutil.copytree(REPO / "vocab_parallel_loss", other / "vocab_parallel_loss",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (other / "vocab_parallel_loss" / "_marker.py").write_text("# only in the other tree\n")
    probe = ("import importlib.util, sys; "
             "spec = importlib.util.spec_from_file_location("
             f"'bench', {str(BENCHMARKS / 'bench_logits.py')!r}); "
             "m = importlib.util.module_from_spec(spec); sys.modules['bench'] = m; "
             "spec.loader.exec_module(m); print(m.env.package_dir()); "
             "print(m.env.source_hash())")
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
    bench = _load("bench_logits")
    out = bench.probes.measure_host_overhead(bench.Device("cpu", "dirty", 0), 3)
    for key in ("forward", "forward_backward", "yardstick_torch_empty_x2",
                "yardstick_triton_launch"):
        assert "error" not in out[key], (key, out[key])
        assert out[key]["host_us"] > 0, (key, out[key])


@pytest.mark.timeout(300)
def test_bench_linear_smoke_cpu_writes_json_and_markdown(tmp_path):
    bench = _load("bench_linear")
    assert bench.parse_args(["--hidden", "8"]).hidden == 8  # not --h: the CUTLASS DSL eats it
    report = bench.main(["--smoke-cpu", "--n", "32", "--hidden", "32", "--vocab", "301",
                         "--impls", "ours", "ours@0", "torch", "ours_main_grad@0.001", "ours_logits",
                         "--rounds", "2", "--out", str(tmp_path)])
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert {".json", ".md"} <= set(files), files
    rows = json.loads(files[".json"].read_text())["rows"]
    assert {(r["impl"], r["reduction"]) for r in rows} == {
        (i, red) for i in ("ours", "ours@0", "torch", "ours_main_grad@0.001", "ours_logits")
        for red in ("mean", "none", "masked")}
    assert all(r["ms"] > 0 and r["ms_alone"] > 0 for r in rows), rows
    # ours against the fp32 reference; torch and ours_logits round their bf16 logits before the loss
    assert all(r["max_loss_err"] < 1e-4 for r in rows
               if r["impl"].startswith("ours") and r["impl"] != "ours_logits"), rows
    err = {(r["impl"], r["reduction"]): r["max_loss_err"] for r in rows}
    assert all(abs(err["ours_logits", red] - err["torch", red]) < 1e-5 for red in ("mean", "none", "masked")), err
    assert "Pareto front" in files[".md"].read_text()
    assert report["meta"]["device"] == "cpu-smoke" and report["meta"]["source_hash"]
    assert "| 301 | mean | ours |" in files[".md"].read_text()


@pytest.mark.timeout(300)
def test_bench_hf_tiny_writes_results(tmp_path):
    pytest.importorskip("transformers")
    import os
    import subprocess

    # this checkout's package (the variants' subprocesses inherit it)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                    os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_hf.py"), "--tiny", "--out-dir",
                          str(tmp_path), "--batch", "2", "--seq", "32", "--warmup", "1",
                          "--steps", "1", "--variants", "transformers,vocab_parallel_loss"],
                         capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    by = {r["variant"]: r for r in data["results"]}
    assert set(by) == {"transformers", "vocab_parallel_loss"}
    assert all("error" not in r for r in by.values()), by
    # the same model, seed and data: the same first loss through either loss
    assert abs(by["transformers"]["first_loss"] - by["vocab_parallel_loss"]["first_loss"]) < 1e-4
    assert data["meta"]["source_hash"]
    assert "| vocab_parallel_loss |" in (tmp_path / "results.md").read_text()


def test_bench_logprobs_smoke_cpu_writes_json_and_markdown(tmp_path):
    """bench_logprobs end to end on tiny CPU shapes: every implementation measured, errors
    against the fp32 reference reported, the report written."""
    import json
    import subprocess

    stem = tmp_path / "lp"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_logprobs.py"), "--smoke-cpu",
                           "--out", str(stem)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(stem.with_suffix(".json").read_text())
    impls = {r["impl"]: r for r in report["rows"]}
    assert {"ours", "torch", "torch chunked (TRL-style)", "ours, batch-invariant",
            "ours @0.5 GiB, batch-invariant"} <= set(impls)
    for r in impls.values():
        assert "error" not in r and r["err_logp"] < 1e-4 and r["err_de_rel"] < 1e-4
    md = stem.with_suffix(".md").read_text()
    assert "| ours |" in md and "`batch_invariant=True`, ours: " in md


def test_bench_logprobs_fp32_head_smoke_cpu(tmp_path):
    """The fp32-head tables end to end on tiny CPU shapes: every row of the log-probs' two
    passes and of the loss measured, fp32-class errors against fp64 for every fp32-weight row
    but ours at ``fp32_precision="tf32"`` (TF32-class: its operands rounded to 11 bits)."""
    import json
    import subprocess

    stem = tmp_path / "lp"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_logprobs.py"), "--smoke-cpu",
                           "--fp32-head", "--out", str(stem)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "lp_fp32_head"
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["rows"]
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd", "loss fwd+bwd"}
    assert {r["reduction"] for r in rows if r["pass"] == "loss fwd+bwd"} == {"mean", "none"}
    for r in rows:
        assert "error" not in r, r
        errs = [r["err_loss"]] if "err_loss" in r else [r["err_logp"], r["err_entropy"]]
        if r["weight"] == "fp32":
            bound = 1e-2 if r["impl"].startswith("ours") and "tf32" in r["impl"] else 2e-5
            assert max(errs) < bound, r
    md = out.with_suffix(".md").read_text()
    assert "| ours, fp32_precision=fp32 |" in md and "loss (linear_cross_entropy)" in md
