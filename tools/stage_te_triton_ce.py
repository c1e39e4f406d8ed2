"""Build the ``te-triton-ce`` wheel: TransformerEngine's Triton cross entropy, on its own.

    python3 tools/stage_te_triton_ce.py [--version 2.20.2] [--out .whl]

TransformerEngine's ``parallel_cross_entropy`` is three pure-Python files over Triton, but
``transformer_engine.pytorch`` needs the ``transformer_engine_torch`` C++ extension, which has
no wheel for the H200 machine's torch 2.11 / CUDA 13. So benchmarks/bench_logits.py (the ``te``
and ``te_inplace`` peers) and benchmarks/bench_scaling.py fall back to ``te_triton_ce``: this
script downloads the released ``transformer-engine`` wheel (pure Python, its C++ parts come in
other wheels), takes those three files unchanged except for their imports, adds a stand-in for
TE's ``no_torch_dynamo`` decorator and TE's license, and writes
``te_triton_ce-<version>-py3-none-any.whl`` into ``--out``. The device then installs it with the
other wheels (``tools/device_peers.sh install``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# file in the TE wheel -> module of te_triton_ce, with the imports rewritten
FILES = {
    "transformer_engine/common/triton/cross_entropy.py": "te_triton_ce/kernels.py",
    "transformer_engine/pytorch/triton/cross_entropy.py": "te_triton_ce/launch.py",
    "transformer_engine/pytorch/cross_entropy.py": "te_triton_ce/cross_entropy.py",
}
IMPORTS = {
    "from transformer_engine.common.triton.cross_entropy import (":
        "from te_triton_ce.kernels import (",
    "import transformer_engine.pytorch.triton.cross_entropy as triton_cross_entropy":
        "import te_triton_ce.launch as triton_cross_entropy",
    "from transformer_engine.pytorch.jit import no_torch_dynamo":
        "from te_triton_ce._jit import no_torch_dynamo",
}
JIT = '''"""Stand-in for transformer_engine.pytorch.jit.no_torch_dynamo (written by
vocab_parallel_loss's tools/stage_te_triton_ce.py): the call is not traced by Dynamo."""
import torch


def no_torch_dynamo(recursive=True, when=None):  # ``when`` is not used by cross_entropy.py
    return lambda f: torch._dynamo.disable(f, recursive=recursive)
'''
INIT = '''"""TransformerEngine's Triton cross entropy, extracted from transformer-engine {version}
(Apache-2.0, see LICENSE) by vocab_parallel_loss's tools/stage_te_triton_ce.py."""
from te_triton_ce.cross_entropy import parallel_cross_entropy  # noqa: F401
'''


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build(te_wheel: Path, version: str, out: Path) -> Path:
    files = {}
    with zipfile.ZipFile(te_wheel) as src:
        for name, target in FILES.items():
            text = src.read(name).decode()
            for old, new in IMPORTS.items():
                text = text.replace(old, new)
            leftover = [ln for ln in text.splitlines()
                        if "import" in ln and "transformer_engine" in ln]
            if leftover:  # another TE release: its imports need adding to IMPORTS
                raise SystemExit(f"{name}: an import this script does not rewrite: {leftover}")
            files[target] = text.encode()
        license_name = next(n for n in src.namelist() if n.endswith("licenses/LICENSE")
                            or n.endswith(".dist-info/LICENSE"))
        files["te_triton_ce/LICENSE"] = src.read(license_name)
    files["te_triton_ce/_jit.py"] = JIT.encode()
    files["te_triton_ce/__init__.py"] = INIT.format(version=version).encode()
    info = f"te_triton_ce-{version}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: te-triton-ce\nVersion: {version}\n"
                                 "Summary: TransformerEngine's Triton cross entropy alone\n"
                                 "License: Apache-2.0\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: stage_te_triton_ce\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = [_record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"te_triton_ce-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as dst:
        for name, data in files.items():
            dst.writestr(name, data)
    return wheel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default="2.20.2")
    ap.add_argument("--out", type=Path, default=Path(".whl"))
    ap.add_argument("--te-wheel", type=Path, help="a transformer_engine wheel already downloaded")
    args = ap.parse_args()
    te_wheel = args.te_wheel
    with tempfile.TemporaryDirectory() as tmp:
        if te_wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary=:all:", "-d", tmp,
                            f"transformer-engine=={args.version}"], check=True)
            te_wheel = next(Path(tmp).glob("transformer_engine-*.whl"))
        print(build(te_wheel, args.version, args.out))


if __name__ == "__main__":
    main()
