"""``--bf16 --vocab-parallel-loss-fp32-head`` in Megatron-LM's own ``pretrain_gpt.py`` (TP=2, gloo on CPU),
with the README's recipes, on the source snapshots ``test_megatron_lm.py`` reads (same folder
rules; without them these tests skip). One ``torchrun`` of ``_megatron_lm_fp32_head_driver.py``
per snapshot: Megatron-LM parses the flags and builds the model, its ``get_model`` makes it bf16
with megatron-core's ``Float16Module``; then a few training steps through the script's
``forward_step`` (AdamW: Megatron-LM's optimizer needs CUDA)."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from tests._torchrun import torchrun_results
from tests.integrations.megatron.test_megatron_lm import REPO, SITECUSTOMIZE, clients_dir

pytest.importorskip("megatron.core")

DRIVER = REPO / "tests" / "integrations" / "megatron" / "_megatron_lm_fp32_head_driver.py"
FP32_HEAD = ["--bf16", "--untie-embeddings-and-output-weights", "--vocab-parallel-loss",
             "--vocab-parallel-loss-fp32-head"]
FUSED = ["--vocab-parallel-loss-fused-linear"]
TIED = ["--bf16", "--vocab-parallel-loss", "--vocab-parallel-loss-fp32-head", *FUSED]
# generation: (tarball, megatron-core version prefix, scenarios)
SNAPSHOTS = {
    "0.17": ("megatron-lm-core_v0.17.1.tar.xz", "0.17.1", [
        ("provider_fused", "provider", [*FP32_HEAD, *FUSED]),
    ]),
    "main": ("megatron-lm-main-*.tar.xz", "0.20.0", [
        ("pre_wrap_hook_fused", "pre_wrap_hook", [*FP32_HEAD, *FUSED]),
        ("pre_wrap_hook_logits", "pre_wrap_hook", FP32_HEAD),
        ("pre_wrap_hook_tied", "pre_wrap_hook", TIED),
    ]),
}
TRAINS = [(gen, name) for gen, (_, _, scenarios) in SNAPSHOTS.items() for name, _, _ in scenarios
          if not name.endswith("_tied")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    clients, named = clients_dir()
    if clients is None or not clients.is_dir():
        if named:
            pytest.fail(f"VPL_MEGATRON_LM_CLIENTS={clients} is not a folder")
        pytest.skip("no Megatron-LM source snapshots (see test_megatron_lm.py)")
    root = tmp_path_factory.mktemp("megatron_lm_fp32_head")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    results = {}
    for gen, (pattern, version, scenarios) in SNAPSHOTS.items():
        tarball = next(iter(sorted(clients.glob(pattern))), None)
        if tarball is None:
            results[gen] = {"skip": f"{pattern} not in {clients}"}
            continue
        with tarfile.open(tarball) as tar:
            tar.extractall(root / gen, filter="data")
        snapshot = next(p.parent for p in (root / gen).rglob("pretrain_gpt.py"))
        (root / f"{gen}.json").write_text(json.dumps(scenarios))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
                   PYTHONPATH=os.pathsep.join([str(root / "site"), str(snapshot), str(REPO)]))
        results[gen] = {"version": version, **torchrun_results(
            DRIVER, 2, snapshot, root / f"{gen}.json", results=root / f"{gen}_results.json", env=env,
            cwd=root, timeout=600)}
    return results


def _run(runs, gen, name):
    if "skip" in runs[gen]:
        pytest.skip(runs[gen]["skip"])
    return runs[gen][name]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("gen,name", TRAINS)
def test_megatron_lm_bf16_run_keeps_an_fp32_head(runs, gen, name):
    """After Float16Module the output weight is fp32 and every other parameter bf16; the first
    step's per-token loss equals fp64 cross entropy of the bf16 hidden states @ the fp32 weight;
    training lowers the loss, moves the weight, and leaves it fp32."""
    r = _run(runs, gen, name)
    assert r["ok"], r.get("error")
    assert r["megatron_core"].startswith(runs[gen]["version"]), \
        "the snapshot's megatron-core must shadow the installed one"
    assert r["wrapper"] == "Float16Module" and r["fused_linear"] is name.endswith("_fused")
    assert r["output_weight_dtype"] == "torch.float32" and r["other_dtypes"] == ["torch.bfloat16"]
    assert r["weight_grad_dtype"] == "torch.float32" and r["step0_loss_err"] <= 2e-5
    assert r["weight_dtype_after"] == "torch.float32" and r["weight_moved"] > 0
    assert r["losses"][-1] < r["losses"][0]


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_megatron_lm_fp32_head_refuses_tied_embeddings(runs):
    r = _run(runs, "main", "pre_wrap_hook_tied")
    assert not r["ok"] and "--untie-embeddings-and-output-weights" in r["error"], r
