"""scripts/stage_te_triton_ce.py: the extracted package imports without TransformerEngine.

A stand-in for the TE wheel holds the three files with TE's own import lines (the real wheel
is downloaded on the machine that stages the benchmark peers, not in CI)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _stage():
    spec = importlib.util.spec_from_file_location("stage_te", REPO / "scripts" /
                                                  "stage_te_triton_ce.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_te_wheel(path: Path, extra_import: str = "") -> Path:
    files = {
        "transformer_engine/common/triton/cross_entropy.py":
            "def cross_entropy_forward_kernel():\n    return 'kernel'\n",
        "transformer_engine/pytorch/triton/cross_entropy.py":
            "from transformer_engine.common.triton.cross_entropy import (\n"
            "    cross_entropy_forward_kernel,\n)\n" + extra_import +
            "def launch():\n    return cross_entropy_forward_kernel()\n",
        "transformer_engine/pytorch/cross_entropy.py":
            "import transformer_engine.pytorch.triton.cross_entropy as triton_cross_entropy\n"
            "from transformer_engine.pytorch.jit import no_torch_dynamo\n\n\n"
            "@no_torch_dynamo()\ndef parallel_cross_entropy():\n"
            "    return triton_cross_entropy.launch()\n",
        "transformer_engine-9.9.dist-info/licenses/LICENSE": "Apache License 2.0 (stand-in)\n",
    }
    wheel = path / "transformer_engine-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def test_extracted_package_installs_and_runs_without_te(tmp_path):
    wheel = _stage().build(_fake_te_wheel(tmp_path), "9.9", tmp_path / "out")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True)
    out = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['transformer_engine'] = None\n"
         "import importlib.metadata as m, te_triton_ce\n"
         "print(te_triton_ce.parallel_cross_entropy(), m.version('te-triton-ce'))"],
        env={"PYTHONPATH": str(site), "PATH": ""}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kernel", "9.9"]
    assert (site / "te_triton_ce" / "LICENSE").read_text().startswith("Apache")


def test_an_import_it_does_not_know_stops_the_build(tmp_path):
    te = _fake_te_wheel(tmp_path, "from transformer_engine.pytorch.utils import helper\n")
    with pytest.raises(SystemExit, match="does not rewrite"):
        _stage().build(te, "9.9", tmp_path / "out")
