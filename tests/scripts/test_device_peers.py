"""scripts/device_peers.sh: the two device calls' steps, run here on stand-ins (a tiny wheel,
and a tar.xz split in two as stage_quack.sh pack splits quack's libraries)."""

from __future__ import annotations

import io
import lzma
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _wheel(folder: Path) -> None:
    dist = "vpl_probe-1.0.dist-info"
    # a stand-in quack too: unpack checks that quack imports once its libraries are in place
    files = {"vpl_probe/__init__.py": "VALUE = 7\n", "quack/__init__.py": "",
             "quack/cross_entropy.py": "", "quack/linear_cross_entropy.py": "",
             f"{dist}/METADATA": "Metadata-Version: 2.1\nName: vpl-probe\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / "vpl_probe-1.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


def _split_libs(folder: Path) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = os.urandom(4096)  # incompressible: both parts hold part of the stream
        info = tarfile.TarInfo("nvidia_cutlass_dsl/lib.bin")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    packed = lzma.compress(raw.getvalue())
    half = len(packed) // 2
    (folder / "libs_cu13.tar.xz.part00").write_bytes(packed[:half])
    (folder / "libs_cu13.tar.xz.part01").write_bytes(packed[half:])
    return data


@pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")
def test_install_then_unpack(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("device_peers.sh", "stage_quack.sh"):
        shutil.copy(REPO / "scripts" / name, repo / "scripts" / name)
    (repo / ".whl" / "all").mkdir(parents=True)
    (repo / ".whl" / "quack").mkdir()
    _wheel(repo / ".whl" / "all")
    lib = _split_libs(repo / ".whl" / "quack")
    env = dict(os.environ, SITE=str(tmp_path / "site"), VPL_QUACK_STAGE=str(tmp_path / "stage"))
    script = ["bash", str(repo / "scripts" / "device_peers.sh")]

    out = subprocess.run(script + ["install"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "installed 1 wheels" in out.stdout
    assert (tmp_path / "site" / "vpl_probe" / "__init__.py").read_text() == "VALUE = 7\n"
    assert (tmp_path / "stage" / "libs_cu13.tar.xz.part00").exists()

    # the next call carries only the second part
    (repo / ".whl" / "quack" / "libs_cu13.tar.xz.part00").unlink()
    out = subprocess.run(script + ["unpack"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "site" / "nvidia_cutlass_dsl" / "lib.bin").read_bytes() == lib

    out = subprocess.run(script + ["pythonpath"], env=env, capture_output=True, text=True)
    assert out.stdout.strip().split(":") == [str(tmp_path / "site"),
                                            str(tmp_path / "site" / "nvidia_cutlass_dsl" /
                                                "dsl_packages"), str(repo)]


def test_unknown_step_fails():
    out = subprocess.run(["bash", str(REPO / "scripts" / "device_peers.sh"), "nope"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr
