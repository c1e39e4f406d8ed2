#!/usr/bin/env python
"""Markdown summary of a ``benchmarks/run_multigpu.sh`` output directory.

    python benchmarks/summarize_multigpu.py OUTDIR [--mode gpu|cpu] [--ngpus N]

Reads ``logs/<step>.status`` and ``logs/<step>.log``, ``pretrain/tp<T>_<variant>.json`` and
``scaling/scaling.{json,md}``; writes ``OUTDIR/summary.md`` (and ``summary.json`` with the same
figures). Only the standard library: it runs wherever the benchmark ran.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

VARIANT_NAMES = {
    "ours": "vocab_parallel_loss",
    "native": "megatron-core native (`--native-loss`)",
    "native_fused": "megatron-core fused (`--native-loss --cross-entropy-loss-fusion`)",
    "fused_linear": "vocab_parallel_loss fused with the output layer",
    "compare": "vocab_parallel_loss with `--compare-native`",
}


def read_status(out: Path):
    """One row per ``logs/<step>.status`` (start epoch, exit code, seconds, command), in run order."""
    rows = []
    for path in (out / "logs").glob("*.status"):
        parts = path.read_text().strip().split("\t", 3)
        if len(parts) == 4:
            rows.append(dict(step=path.name[:-len(".status")], start=int(parts[0]), rc=int(parts[1]),
                             seconds=int(parts[2]), command=parts[3]))
    return sorted(rows, key=lambda r: r["start"])


def test_results(out: Path, status):
    res = []
    for s in status:
        if not s["step"].startswith("tests_"):
            continue
        log = out / "logs" / f"{s['step']}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        passed = re.findall(r"^.*cases passed on \d+ ranks.*$", text, re.M)
        failed = re.findall(r"^.*(?:FAILED impl=|AssertionError|Error:).*$", text, re.M)
        res.append(dict(step=s["step"], rc=s["rc"], seconds=s["seconds"],
                        passed=passed[-1].strip() if passed else None,
                        first_error=failed[0].strip()[:300] if failed and s["rc"] else None))
    return res


def pretrain_results(out: Path):
    runs = {}
    for p in sorted((out / "pretrain").glob("tp*_*.json")):
        m = re.match(r"tp(\d+)_(.+)\.json$", p.name)
        if not m:
            continue
        try:
            runs[(int(m.group(1)), m.group(2))] = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
    return runs


def _curve_diff(a, b):
    la, lb = a.get("losses") or [], b.get("losses") or []
    n = min(len(la), len(lb))
    return max((abs(x - y) for x, y in zip(la[:n], lb[:n])), default=None)


def fmt(x, spec=".3f"):
    return "—" if x is None else format(x, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--mode", default="?")
    p.add_argument("--ngpus", default="?")
    a = p.parse_args(argv)
    out = a.out
    status = read_status(out)
    tests = test_results(out, status)
    runs = pretrain_results(out)
    scaling = None
    if (out / "scaling" / "scaling.json").exists():
        try:
            scaling = json.loads((out / "scaling" / "scaling.json").read_text())
        except json.JSONDecodeError:
            scaling = None

    env = (out / "env.txt").read_text(errors="replace") if (out / "env.txt").exists() else ""
    lines = [f"# Multi-GPU run: mode {a.mode}, {a.ngpus} ranks", ""]
    if a.mode == "cpu":
        lines += ["**CPU smoke run (gloo, tiny shapes): checks the pipeline, not a measurement.**", ""]
    head = [ln for ln in env.splitlines() if ln.split(":")[0] in ("date_utc", "commit", "host")]
    head += [ln for ln in env.splitlines() if ln.startswith(("python ", "NCCL_NVLS", "megatron.core", "te_triton_ce", "transformer_engine", "GPU 0"))]
    if head:
        lines += ["```"] + head + ["```", ""]

    lines += ["## Steps", "", "| step | exit | seconds |", "|---|---:|---:|"]
    for s in status:
        rc = "ok" if s["rc"] == 0 else ("**timed out**" if s["rc"] in (124, 137) else f"**{s['rc']}**")
        lines.append(f"| {s['step']} | {rc} | {s['seconds']} |")
    lines.append("")

    if tests:
        lines += ["## Tensor-parallel tests vs the full-vocabulary fp64 reference", "",
                  "| step | result |", "|---|---|"]
        for t in tests:
            r = t["passed"] if t["rc"] == 0 and t["passed"] else f"**failed** ({t['rc']}): {t['first_error'] or 'see log'}"
            lines.append(f"| {t['step']} | {r} |")
        lines.append("")

    pt_summary = []
    if runs:
        lines += ["## Megatron GPT pretraining (examples/pretrain_gpt.py)", ""]
        any_run = next(iter(runs.values()))
        lines.append(
            f"{any_run.get('device')}, megatron-core {any_run.get('megatron_core')}, torch {any_run.get('torch')}; "
            f"{any_run.get('num_layers')} layers, hidden {any_run.get('hidden_size')}, seq {any_run.get('seq_length')}, "
            f"micro-batch {any_run.get('micro_batch_size')}, vocab {any_run.get('vocab')} (padded {any_run.get('padded_vocab')}), "
            f"bf16 {any_run.get('bf16')}. Step time: mean after the warm-up steps; peak: max over ranks of "
            "torch.cuda.max_memory_allocated. 'max |Δloss| vs native': largest per-step difference of the loss "
            "curve from the native run of the same TP (same seed and data).")
        lines += ["", "| TP | loss | steps | step time (ms) | tokens/s | peak memory (GiB) | loss first → last | max abs Δloss vs native |",
                  "|---:|---|---:|---:|---:|---:|---|---:|"]
        for (tp, variant), r in sorted(runs.items(), key=lambda kv: (kv[0][0], list(VARIANT_NAMES).index(kv[0][1]) if kv[0][1] in VARIANT_NAMES else 99)):
            native = runs.get((tp, "native"))
            diff = _curve_diff(r, native) if native is not None and variant != "native" else None
            if variant == "compare" and r.get("max_abs_loss_diff_vs_native") is not None:
                diff = r["max_abs_loss_diff_vs_native"]
            st = r.get("step_time_s")
            row = dict(tp=tp, variant=variant, step_time_ms=st * 1e3 if st else None,
                       tokens_per_s=r.get("tokens_per_s"), peak_memory_gib=r.get("peak_memory_gib"),
                       first_loss=r.get("first_loss"), final_loss=r.get("final_loss"),
                       train_iters=r.get("train_iters"), max_abs_loss_diff_vs_native=diff,
                       max_abs_grad_diff_vs_native=r.get("max_abs_grad_diff_vs_native"))
            pt_summary.append(row)
            lines.append(
                f"| {tp} | {VARIANT_NAMES.get(variant, variant)} | {row['train_iters']} | {fmt(row['step_time_ms'], '.1f')} | "
                f"{fmt(row['tokens_per_s'], '.0f')} | {fmt(row['peak_memory_gib'], '.2f')} | "
                f"{fmt(row['first_loss'], '.4f')} → {fmt(row['final_loss'], '.4f')} | {fmt(diff, '.2e')} |")
        grads = [r for r in pt_summary if r["max_abs_grad_diff_vs_native"] is not None]
        for r in grads:
            lines.append(f"\n`--compare-native` at TP {r['tp']}: max abs gradient difference vs native "
                         f"{r['max_abs_grad_diff_vs_native']:.2e}.")
        lines.append("")

    if scaling is not None:
        md = (out / "scaling" / "scaling.md").read_text() if (out / "scaling" / "scaling.md").exists() else ""
        lines += ["## Scaling benchmark (benchmarks/bench_scaling.py)", ""]
        tp8 = [s for s in scaling.get("scaling", []) if s["tp"] == 8]
        for s in tp8:
            c = s.get("collective_over_kernel")
            lines.append(f"- V={s['vocab']}, TP=8: collective / single-shard kernel = "
                         f"{'n/a' if c is None else f'{100 * c:.1f}%'} "
                         f"(target <= 5%: {'met' if s.get('meets_target') else 'NOT met'}).")
        if tp8:
            lines.append("")
        # the benchmark's own markdown, one heading level down
        body = md.splitlines()
        if body and body[0].startswith("# "):  # its title: kept as a line, the heading is ours
            body[0] = body[0][2:]
        lines += [re.sub(r"^(#+)", r"\1#", ln) for ln in body]
        if (out / "scaling" / "scaling.png").exists():
            lines += ["", "![scaling](scaling/scaling.png)"]
        lines.append("")

    failed = [s["step"] for s in status if s["rc"] != 0]
    lines += ["## Result", "", ("All steps passed." if status and not failed else
                                f"Failed or timed out: {', '.join(failed)}." if failed else "No step ran.")]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(dict(
        mode=a.mode, ngpus=a.ngpus, steps=status, tests=tests, pretrain=pt_summary,
        scaling=scaling.get("scaling") if scaling else None), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
