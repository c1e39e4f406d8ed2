"""Megatron-LM's own ``pretrain_gpt.py`` with the README's recipes, on CPU (TP=2, gloo).

The source snapshots of Megatron-LM (``megatron-lm-*.tar.xz``: core_v0.17.1, and main with
megatron-core 0.20) are read from the folder ``$VPL_MEGATRON_LM_CLIENTS`` names, or, with the
variable unset, from ``../shared/clients`` relative to the repository root (where CI puts
them), else a ``shared/clients`` folder in or above the checkout; without one these tests
skip. A folder or snapshot missing where the variable points fails them. Each snapshot is unpacked once
and put first on PYTHONPATH (its megatron-core shadows the installed one: checked); one
``torchrun`` of ``_megatron_lm_driver.py`` per snapshot runs every scenario: the recipe written
into the snapshot's ``pretrain_gpt.py`` (tools/megatron_lm_recipes.py), Megatron-LM's argument
parsing, config and model building, then one micro-batch through its ``forward_step``. Python
3.11 gets ``typing.override`` from a ``sitecustomize`` written here (Megatron-LM main uses it).
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from tests._torchrun import torchrun_results

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).resolve().parent / "_megatron_lm_driver.py"
MTP = ["--position-embedding-type", "rope"]  # Megatron-LM refuses MTP with learned positions
# the fused loss with the loss mask under sequence parallelism, a budget (GiB) under which the tiny
# model's saved logits (21 KB with the fp32 dE of the TP sum) do not fit and the gradients formed
# in forward do (10.6 KB): megatron-core's schedule steps run the script's loss_func (whose NaN
# check needs the training loop's rerun state machine: off)
MASKED = ["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear", "--sequence-parallel",
          "--vocab-parallel-loss-memory-budget", "0.0000149", "--no-check-for-nan-in-loss-and-grad"]
PER_TOKEN = ["--calculate-per-token-loss"]
# generation: (tarball pattern, megatron-core version prefix, scenarios[, optional]). The optional
# snapshots (tarballs of a Megatron-LM checkout at core_v0.18.* / core_v0.19.*, same layout as the
# others) are run when present and skipped when absent, also from a folder named by the variable.
SNAPSHOTS = {
    "0.17": ("megatron-lm-core_v0.17.1.tar.xz", "0.17.1", [
        ("provider", "provider", ["--vocab-parallel-loss"]),
        ("provider_fused_mtp", "provider", ["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear",
                                            "--mtp-num-layers", "2", "--calculate-per-token-loss", *MTP]),
        ("flags_only", "flags_only", ["--vocab-parallel-loss"]),
        ("provider_masked", "provider", MASKED),
        ("provider_masked_per_token", "provider", [*MASKED, *PER_TOKEN]),
    ]),
    "0.18": ("megatron-lm-core_v0.18*.tar.xz", "0.18.", [
        ("provider", "provider", ["--vocab-parallel-loss"]),
        ("provider_fused_mtp", "provider", ["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear",
                                            "--mtp-num-layers", "2", "--calculate-per-token-loss", *MTP]),
        ("flags_only", "flags_only", ["--vocab-parallel-loss"]),
        ("provider_masked", "provider", MASKED),
        ("provider_masked_per_token", "provider", [*MASKED, *PER_TOKEN]),
    ], "optional"),
    "0.19": ("megatron-lm-core_v0.19*.tar.xz", "0.19.", [
        ("pre_wrap_hook", "pre_wrap_hook", ["--vocab-parallel-loss"]),
        ("pre_wrap_hook_fused_mtp", "pre_wrap_hook", ["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear",
                                                      "--mtp-num-layers", "2", *MTP]),
        ("output_processor_fused", "output_processor", ["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear"]),
        ("ignored_provider", "ignored_provider", ["--vocab-parallel-loss"]),
        ("flags_only", "flags_only", ["--vocab-parallel-loss"]),
        ("pre_wrap_hook_masked", "pre_wrap_hook", MASKED),
        ("pre_wrap_hook_masked_per_token", "pre_wrap_hook", [*MASKED, *PER_TOKEN]),
        ("output_processor_masked", "output_processor", [*MASKED, *PER_TOKEN]),
    ], "optional"),
    "main": ("megatron-lm-main-*.tar.xz", "0.20.0", [
        ("pre_wrap_hook", "pre_wrap_hook", ["--vocab-parallel-loss"]),
        ("pre_wrap_hook_fused_mtp", "pre_wrap_hook", ["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear",
                                                      "--mtp-num-layers", "2", *MTP]),
        ("pre_wrap_hook_mtp", "pre_wrap_hook", ["--vocab-parallel-loss", "--mtp-num-layers", "1", *MTP]),
        ("container_provider", "container_provider", ["--vocab-parallel-loss"]),
        ("output_processor_fused", "output_processor", ["--vocab-parallel-loss", "--vocab-parallel-loss-fused-linear"]),
        ("ignored_provider", "ignored_provider", ["--vocab-parallel-loss"]),
        ("flags_only", "flags_only", ["--vocab-parallel-loss"]),
        ("pre_wrap_hook_masked", "pre_wrap_hook", MASKED),
        ("pre_wrap_hook_masked_per_token", "pre_wrap_hook", [*MASKED, *PER_TOKEN]),
        ("pre_wrap_hook_masked_mtp", "pre_wrap_hook", [*MASKED, "--mtp-num-layers", "2", *MTP]),
        ("output_processor_masked", "output_processor", [*MASKED, *PER_TOKEN]),
    ]),
}
WIRED = [(gen, name) for gen, (_, _, scenarios, *_) in SNAPSHOTS.items() for name, recipe, _ in scenarios
         if recipe not in ("flags_only", "ignored_provider")]
NOT_WIRED = [(gen, name) for gen, (_, _, scenarios, *_) in SNAPSHOTS.items() for name, recipe, _ in scenarios
             if recipe in ("flags_only", "ignored_provider")]
SITECUSTOMIZE = """import typing
if not hasattr(typing, "override"):  # Python < 3.12: Megatron-LM main imports typing.override
    import typing_extensions
    typing.override = typing_extensions.override
"""


def clients_dir():
    """(folder of the snapshots or None, whether the user named it through the variable)."""
    env = os.environ.get("VPL_MEGATRON_LM_CLIENTS")
    if env:
        return Path(env), True
    candidates = [REPO.parent / "shared" / "clients", REPO / "shared" / "clients",
                  *(p / "shared" / "clients" for p in REPO.parents[1:])]
    return next((p for p in candidates if p.is_dir()), None), False


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    """Run every scenario of every snapshot once; {generation: {scenario: result}}."""
    clients, named = clients_dir()
    if named and not clients.is_dir():
        pytest.fail(f"VPL_MEGATRON_LM_CLIENTS={clients} is not a folder")
    if clients is None:
        pytest.skip("no Megatron-LM source snapshots: set VPL_MEGATRON_LM_CLIENTS to the folder of "
                    "megatron-lm-*.tar.xz, or put them in ../shared/clients")
    root = tmp_path_factory.mktemp("megatron_lm")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    results = {}
    for gen, (pattern, version, scenarios, *optional) in SNAPSHOTS.items():
        tarball = next(iter(sorted(clients.glob(pattern))), None)
        if tarball is None:
            if named and not optional:
                pytest.fail(f"{pattern} not in VPL_MEGATRON_LM_CLIENTS={clients}")
            results[gen] = {"skip": f"{pattern} not in {clients}"}
            continue
        with tarfile.open(tarball) as tar:
            tar.extractall(root / gen, filter="data")
        snapshot = next(p.parent for p in (root / gen).rglob("pretrain_gpt.py"))
        (root / f"{gen}.json").write_text(json.dumps(scenarios))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
                   PYTHONPATH=os.pathsep.join([str(root / "site"), str(snapshot), str(REPO)]))
        out = root / f"{gen}_results.json"
        runs = torchrun_results(DRIVER, 2, snapshot, root / f"{gen}.json", results=out, env=env,
                                cwd=root, timeout=600)
        results[gen] = {"version": version, **runs}
    return results


def _result(megatron_lm, gen, name):
    runs = megatron_lm[gen]
    if "skip" in runs:
        pytest.skip(runs["skip"])
    r = runs[name]
    assert r["ok"], r.get("error")
    assert r["megatron_core"].startswith(runs["version"]), "the snapshot's megatron-core must shadow the installed one"
    return r


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("gen,name", WIRED)
def test_recipe_trains_with_our_loss(megatron_lm, gen, name):
    """The recipe's model computes its loss with VocabParallelCrossEntropy on the TP group (fused:
    the output layer never runs), and the per-token loss and every gradient equal megatron-core's
    own loss on the same model; MTP heads' logged losses (0.20: and acceptance counts) too."""
    r = _result(megatron_lm, gen, name)
    fused = "fused" in name or "masked" in name
    if name.startswith("output_processor"):
        assert r["classes"] == ["GPTModel"] and r["processor_fused_linear"] is fused
    else:
        assert r["ours"] and r["loss_module"] == "VocabParallelCrossEntropy" and r["loss_tp_ranks"] == [0, 1]
        assert r["fused_linear"] is fused
    assert r["output_layer_ran"] is not fused
    assert r["loss_diff"] <= 1e-5 and r["grad_max_rel_diff"] <= 1e-4 and r["n_grads"] > 20
    if "mtp" in name:
        logged, ref = r["mtp_logged"], r["mtp_logged_ref"]
        assert logged.keys() == ref.keys() and logged.get("loss_values", logged.get("values"))  # 0.20 / 0.17
        for key in ref:
            assert logged[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("gen,name", [w for w in WIRED if "masked" in w[1]])
def test_masked_fused_loss_forms_its_gradients_in_forward(megatron_lm, gen, name):
    """The fused loss given GPTModel.forward's loss_mask under sequence parallelism, TP=2, one
    micro-batch through megatron-core's schedule steps with the script's loss_func (token count
    divided out, or not with --calculate-per-token-loss): every head's fused loss formed its
    gradients in forward for the mask and backward used them; the per-token losses, every
    gradient (test_recipe_trains_with_our_loss), the reported lm loss and the token count equal
    megatron-core's own loss."""
    r = _result(megatron_lm, gen, name)
    heads = 3 if "mtp" in name else 1
    assert r["masked_taken"] == [True] * heads, r["masked_taken"]
    assert r["num_tokens"] == r["num_tokens_ref"] == 2 * 16 - 3
    assert r["report"][1] == r["report_ref"][1] == r["num_tokens"]
    assert r["report"][0] == pytest.approx(r["report_ref"][0], rel=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("gen,name", NOT_WIRED)
def test_guard_fires_when_the_flag_is_not_wired(megatron_lm, gen, name):
    """--vocab-parallel-loss parsed, model built without our loss (no wiring; or, 0.19+, a model
    provider that pretrain never calls): the first forward raises, naming the recipes."""
    r = _result(megatron_lm, gen, name)
    assert r["classes"] == ["GPTModel"] and not r["ours"]
    assert "never wired" in r["guard_error"] and "pre_wrap_hooks.append(attach_vocab_parallel_loss)" in r["guard_error"]


def test_gpu_tool_reads_megatron_lm_logs():
    """tools/megatron_lm_h200.py: the runs of each layout, and Megatron-LM's log lines (its
    training_log format) read into loss per iteration, ms/iteration after warm-up, peak memory."""
    sys.path.insert(0, str(REPO / "tools"))
    import megatron_lm_h200 as tool

    assert {"native", "native_fused", "provider", "provider_fused_linear", "mtp_ours_fused_linear"} \
        == set(tool.runs_for("pretrain_args")) - {"mtp_native", "mtp_ours"}
    assert {"pre_wrap_hook", "container_provider", "output_processor_fused_linear"} <= set(tool.runs_for("config_container"))
    line = (" [2026-08-22 10:00:00.000000] iteration {it:8d}/{n:8d} | consumed samples: {c:12d} | elapsed time per "
            "iteration (ms): {ms:.1f} | learning rate: 3.000000E-04 | global batch size:     2 | lm loss: {loss:.6E} |"
            " mtp_1 loss: {mtp:.6E} | loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 |")
    log = "\n".join(line.format(it=i, n=4, c=2 * i, ms=100.0 * i, loss=12.0 - i, mtp=13.0 - i) for i in range(1, 5))
    log += "\nVPL_PEAK_MEMORY_BYTES rank=0 3221225472\n"
    r = tool.parse_log(log, warmup=2)
    assert r["losses"] == [11.0, 10.0, 9.0, 8.0] and r["mtp_losses"] == {"1": [12.0, 11.0, 10.0, 9.0]}
    assert r["ms_per_iteration"] == pytest.approx(350.0) and r["peak_memory_gib"] == pytest.approx(3.0)
