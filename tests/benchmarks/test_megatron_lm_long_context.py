"""tools/megatron_lm_long_context.py on CPU: the dry run's commands and scripts, and the sweep's
bookkeeping on synthetic Megatron-LM logs (an out-of-memory run not started at longer lengths,
results merged across calls, the markdown and the plot; a failing plot keeps the numbers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import megatron_lm_long_context as tool  # noqa: E402
import megatron_lm_memory_model as memory  # noqa: E402

# the lines of a 0.19+ pretrain_gpt.py that the pre_wrap_hook recipe edits
PRETRAIN_GPT = '''from model_provider import model_provider


if __name__ == "__main__":
    args = parse_and_validate_args(extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None)
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, forward_step)
'''
LINE = (" [2026-12-05 10:00:00] iteration {it:8d}/{n:8d} | consumed samples: {it:12d} | elapsed time per "
        "iteration (ms): {ms:.1f} | learning rate: 3.000000E-04 | global batch size:     1 | lm loss: {loss:.6E} |")


@pytest.fixture
def checkout(tmp_path):
    d = tmp_path / "Megatron-LM"
    d.mkdir()
    (d / "pretrain_gpt.py").write_text(PRETRAIN_GPT)
    return d


def _args(checkout, tmp_path, *extra):
    return [str(checkout), "--out", str(tmp_path / "out"), "--vocab", "1024", "--layers", "1", "--hidden", "64",
            "--heads", "2", "--iters", "3", "--warmup", "1", *extra]


def test_dry_run_prints_commands_and_writes_scripts_only(checkout, tmp_path, capsys):
    results = tmp_path / "r.json"
    assert tool.main(_args(checkout, tmp_path, "--seq", "512,1024", "--results", str(results), "--dry-run")) == 0
    out = capsys.readouterr().out
    assert not results.exists()
    site = tmp_path / "out" / "site"
    assert (site / "sitecustomize.py").exists() and (site / "megatron_lm_sdpa_attention.py").exists()
    hooked = (tmp_path / "out" / "pretrain_gpt_pre_wrap_hook.py").read_text()
    assert "model_cfg.pre_wrap_hooks.append(attach_vocab_parallel_loss)" in hooked
    assert (tmp_path / "out" / "pretrain_gpt_native.py").read_text() == PRETRAIN_GPT
    commands = [ln for ln in out.splitlines() if "torch.distributed.run" in ln]
    assert len(commands) == 2 * len(tool.DEFAULT_RUNS)
    for c in commands:
        assert "--spec megatron_lm_sdpa_attention layer_spec" in c and "--position-embedding-type rope" in c
        assert "--no-create-attention-mask-in-dataloader" in c and "--micro-batch-size 1" in c
    assert "--seq-length 1024 --max-position-embeddings 1024" in commands[-1]
    small = [c for c in commands if "--vocab-parallel-loss-memory-budget 0.25" in c]
    assert len(small) == 2 and all("pretrain_gpt_pre_wrap_hook.py" in c for c in small)
    assert all("pretrain_gpt_native.py" in c for c in commands if "--vocab-parallel-loss" not in c)
    assert "estimated" in out and "predicted peak" in out and "dry run:" in out
    local = tool.model_flags(1024, 512, tool.dict_replace(tool_args(), attention="local"))
    assert "--spec" not in local and local[-2:] == ["--recompute-granularity", "selective"]


def tool_args(**kw):
    a = dict(layers=1, hidden=64, heads=2, micro_batch=1, attention="sdpa", small_budget=0.25, iters=3,
             tflops=200.0, compile_s=30.0)
    a.update(kw)
    import argparse
    return argparse.Namespace(**a)


def _fake_megatron(oom_from: dict):
    """A stand-in for one Megatron-LM run: an out-of-memory error at and past ``oom_from[run
    flags]``'s length, else 3 iterations and a peak that grows with the length."""
    calls = []

    def run(cmd, cwd, env, timeout):
        seq = int(cmd[cmd.index("--seq-length") + 1])
        name = ("native_fused" if "--cross-entropy-loss-fusion" in cmd else
                "ours_fused_linear_small" if "--vocab-parallel-loss-memory-budget" in cmd else
                "ours_fused_linear" if "--vocab-parallel-loss-fused-linear" in cmd else
                "ours" if "--vocab-parallel-loss" in cmd else "native")
        calls.append((name, seq))
        if seq >= oom_from.get(name, 1 << 30):
            return 1, ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.50 GiB. GPU 0 has a "
                       "total capacity of 139.80 GiB\nVPL_PEAK_MEMORY_BYTES rank=0 %d\n" % (100 << 30))
        log = "\n".join(LINE.format(it=i, n=3, ms=seq / 10 * (2 if i == 1 else 1), loss=10.0 - i) for i in (1, 2, 3))
        return 0, log + "\nVPL_PEAK_MEMORY_BYTES rank=0 %d\n" % (seq << 20)

    return run, calls


def test_sweep_records_oom_skips_longer_lengths_and_merges(checkout, tmp_path, monkeypatch, capsys):
    run, calls = _fake_megatron({"native": 1024, "native_fused": 512})
    monkeypatch.setattr(tool, "run_command", run)
    first = tmp_path / "first.json"
    tool.main(_args(checkout, tmp_path, "--seq", "512,1024,2048", "--results", str(first)))
    assert ("native", 2048) not in calls and ("native_fused", 1024) not in calls
    assert ("ours", 2048) in calls and ("ours_fused_linear_small", 2048) in calls
    data = json.loads(first.read_text())
    by = {(r["run"], r["seq"]): r for r in data["results"]}
    assert by[("native", 1024)]["status"] == "oom" and by[("native", 1024)]["note"] == "tried to allocate 12.50 GiB"
    assert by[("native", 1024)]["peak_memory_gib"] == pytest.approx(100.0)
    ok = by[("ours", 1024)]
    assert ok["status"] == "ok" and ok["ms_per_iteration"] == pytest.approx(102.4)
    assert ok["tokens_per_s"] == pytest.approx(1024 / 0.1024) and ok["peak_memory_gib"] == pytest.approx(1.0)
    assert ok["predicted_gib"] == pytest.approx(memory.peak_bytes(
        "ours", memory.Shape(seq=1024, vocab=1024, layers=1, hidden=64, heads=2)) / memory.GIB)
    assert "saved" in by[("ours_fused_linear", 512)]["strategy"] or "gradients" in by[("ours_fused_linear", 512)]["strategy"]
    assert ("native", 2048) not in by
    md = first.with_suffix(".md").read_text()
    assert "## V = 1024" in md and "| native | 0.5 (" in md and "OOM" in md
    pytest.importorskip("matplotlib")
    assert first.with_suffix(".png").exists()

    # a later call: merged with the first, the same results not run again, native not started
    calls.clear()
    second = tmp_path / "second.json"
    tool.main(_args(checkout, tmp_path, "--seq", "1024,4096", "--results", str(second), "--merge", str(first),
                    str(tmp_path / "missing.json")))
    assert sorted(calls) == [("ours", 4096), ("ours_fused_linear", 4096), ("ours_fused_linear_small", 4096)]
    assert "not started (oom at seq 1024)" in capsys.readouterr().out
    merged = {(r["run"], r["seq"]) for r in json.loads(second.read_text())["results"]}
    assert {("native", 512), ("native", 1024), ("ours", 4096)} <= merged and ("native", 4096) not in merged

    with pytest.raises(ValueError, match="another model"):
        tool.main(_args(checkout, tmp_path, "--seq", "1024", "--results", str(tmp_path / "x.json"),
                        "--merge", str(first), "--iters", "5"))


def test_time_limit_and_a_failing_plot(checkout, tmp_path, monkeypatch, capsys):
    fake, calls = _fake_megatron({})
    clock = [0.0]

    def run(*args):  # a run of 50 s
        clock[0] += 50.0
        return fake(*args)

    monkeypatch.setattr(tool, "run_command", run)
    monkeypatch.setattr(tool.time, "monotonic", lambda: clock[0])

    def broken(report, path):
        raise ValueError("no axes")

    monkeypatch.setattr(tool.plots, "long_context_memory", broken)
    results = tmp_path / "r.json"
    tool.main(_args(checkout, tmp_path, "--seq", "512", "--runs", "native,ours", "--results", str(results),
                    "--max-seconds", "100", "--startup-s", "60"))
    assert calls == [("native", 512)]  # the second would end past 100 s
    assert "not started: 60 s estimated" in capsys.readouterr().out
    data = json.loads(results.read_text())
    assert [r["run"] for r in data["results"]] == ["native"]
    assert data["notes"] == {"plot": "plot failed: ValueError: no axes"}
    assert results.with_suffix(".md").exists() and not results.with_suffix(".png").exists()


def test_memory_model_orders_the_paths():
    m = memory.Shape(seq=65536, vocab=151936)
    peaks = {run: memory.peak_bytes(run, m) for run in ("native_fused", "native", "ours", "ours_inplace")}
    assert peaks["native_fused"] > peaks["native"] > peaks["ours"] > peaks["ours_inplace"]
    assert peaks["native"] - peaks["ours"] == 2 * 65536 * 151936
    fused = memory.peak_bytes("fused_linear", m)
    returned = 2 * (151936 + 65536) * 2048  # its bf16 dC and dE, held from the loss on
    assert memory.loss_bytes("fused_linear", m) == memory.fused_linear_strategy(m, None)["bytes"] + returned
    assert fused < peaks["ours_inplace"] and memory.loss_bytes("fused_linear", m) - returned <= 2 << 30
    small = memory.fused_linear_strategy(m, 0.25)
    assert small["strategy"] == "recompute" and small["bytes"] == 4 * 65536 * 2048  # the fp32 dE at rounding
    assert memory.longest_fit("native", memory.Shape(seq=1024, vocab=151936), 139) < \
        memory.longest_fit("ours", memory.Shape(seq=1024, vocab=151936), 139)
