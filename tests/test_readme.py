"""README.md's code blocks, run as a reader would run them, so that the README cannot drift.

Every ```python block runs, in the order it appears, unless an HTML comment on the line above
says otherwise:

* no marker: executed in this process, in a fresh namespace (the first block, the Quick start,
  must be one of these; it is also run in a fresh interpreter without the Triton interpreter,
  i.e. on the pure-PyTorch backend a CPU user gets);
* ``<!-- readme-test: torchrun N -->``: a complete script, written to a file and launched with
  ``torchrun --nproc-per-node N`` (gloo on CPU);
* ``<!-- readme-test: skip (reason) -->``: not code to run (signatures); the reason is required.

Blocks without a language (shell commands, the layout) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"(?:^<!-- readme-test: (?P<marker>[^>]*?) -->\n)?^```(?P<lang>[^\n`]*)\n(?P<body>.*?)^```$",
                   re.M | re.S)


def code_blocks():
    """[(index, language, marker or None, body)] for every fenced block of README.md."""
    return [(i, m["lang"].strip(), m["marker"], m["body"]) for i, m in enumerate(FENCE.finditer(README.read_text()))]


def python_blocks(kind):
    out = []
    for i, lang, marker, body in code_blocks():
        if lang != "python":
            continue
        if marker is None:
            k = "inprocess"
        elif marker.startswith("torchrun"):
            k = "torchrun"
        elif re.fullmatch(r"skip \(.+\)", marker):
            k = "skip"
        else:
            raise ValueError(f"README block {i}: unknown marker {marker!r}")
        if k == kind:
            out.append(pytest.param(i, marker, body, id=f"block{i}"))
    return out


def test_markers_and_quick_start():
    blocks = code_blocks()
    assert blocks, "no code blocks found in README.md"
    first_index, lang, marker, _ = blocks[0]
    assert lang == "python" and marker is None, "README's first code block (the Quick start) must be runnable python"
    for _, lang, marker, _ in blocks:
        if marker is not None:
            assert lang == "python", "a readme-test marker stands above a python block"
    text = README.read_text()
    assert text.count("<!-- readme-test:") == sum(1 for b in blocks if b[2] is not None), \
        "a readme-test marker that is not directly above a code block"
    assert python_blocks("torchrun"), "the README's torchrun example is gone"


@pytest.mark.parametrize("index,marker,body", python_blocks("inprocess"))
def test_block_runs_in_process(index, marker, body):
    if "from transformers import" in body:
        pytest.importorskip("transformers")
    exec(compile(body, f"README.md block {index}", "exec"), {"__name__": f"readme_block_{index}"})


def test_quick_start_in_a_fresh_python(tmp_path):
    """The Quick start as a CPU user runs it: a fresh interpreter, Triton not interpreting."""
    _, _, _, body = code_blocks()[0]
    script = tmp_path / "quick_start.py"
    script.write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("index,marker,body", python_blocks("torchrun"))
def test_block_runs_under_torchrun(index, marker, body, tmp_path):
    nproc = int(marker.split()[1])
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(body)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
