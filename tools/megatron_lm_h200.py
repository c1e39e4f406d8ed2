#!/usr/bin/env python
"""Megatron-LM's own ``pretrain_gpt.py`` on one GPU: native, ``--cross-entropy-loss-fusion``, and
each README recipe of this package (tools/megatron_lm_recipes.py writes it into a copy of the
script); loss per iteration, ms/iteration and peak memory per run, and each run's largest loss
difference from the native run.

    python tools/megatron_lm_h200.py /path/to/Megatron-LM [--runs native,pre_wrap_hook,...] [--out DIR]

The model (the measurement of the issue): ``--mock-data --tokenizer-type NullTokenizer
--transformer-impl local``, bf16, TP=1, 8 layers, hidden 2048, 16 heads, seq 4096, micro-batch 2,
vocab 128256, 30 iterations (``--iters``). Runs (``--runs``, default all that fit the checkout's
``pretrain_gpt.py`` layout): ``native``, ``native_fused`` (``--cross-entropy-loss-fusion``), each
recipe with ``--vocab-parallel-loss`` and with ``--vocab-parallel-loss-fused-linear``
(``<recipe>``, ``<recipe>_fused_linear``), and multi-token prediction (``--mtp-num-layers 1``,
rope positions, which Megatron-LM requires with MTP): ``mtp_native``, ``mtp_ours``,
``mtp_ours_fused_linear``. A run takes a minute or two (Megatron-LM's start-up included): give a
few runs per call where calls are time-limited. Each run's log and a ``summary.json`` go to
``--out``. ``--dry-run`` writes the scripts and prints the commands only.

Peak memory is ``torch.cuda.max_memory_allocated()`` at the process's exit (a ``sitecustomize``
on PYTHONPATH records it; it also gives Python 3.11 the ``typing.override`` Megatron-LM main
imports). ms/iteration is Megatron-LM's "elapsed time per iteration", the mean after
``--warmup`` iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_lm_recipes  # noqa: E402

MODEL = [
    "--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
    "--max-position-embeddings", "4096", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--tensor-model-parallel-size", "1", "--bf16", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style",
    "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234", "--mock-data", "--tokenizer-type",
    "NullTokenizer", "--vocab-size", "128256", "--transformer-impl", "local", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "100000",
    # without TransformerEngine or apex: their fused kernels off
    "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-rope-fusion",
]
OURS = ["--vocab-parallel-loss"]
FUSED_LINEAR = OURS + ["--vocab-parallel-loss-fused-linear"]
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
SITECUSTOMIZE = '''import atexit, os, sys, typing
if not hasattr(typing, "override"):
    try:
        import typing_extensions
        typing.override = typing_extensions.override
    except ImportError:
        pass


def _peak():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        print(f"VPL_PEAK_MEMORY_BYTES rank={os.environ.get('RANK', '0')} {torch.cuda.max_memory_allocated()}",
              flush=True)


atexit.register(_peak)
'''
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
LM_LOSS = re.compile(r"lm loss: ([-+.\dEe]+)")
MTP_LOSS = re.compile(r"mtp_(\d+) loss: ([-+.\dEe]+)")
PEAK = re.compile(r"VPL_PEAK_MEMORY_BYTES rank=\d+ (\d+)")


def runs_for(layout: str):
    """{run name: (recipe, flags)} for a pretrain_gpt.py of this layout."""
    recipes = ["provider"] if layout == "pretrain_args" else ["pre_wrap_hook", "container_provider", "output_processor"]
    runs = {"native": ("native", []), "native_fused": ("native", ["--cross-entropy-loss-fusion"])}
    for recipe in recipes:
        runs[recipe] = (recipe, OURS)
        runs[f"{recipe}_fused_linear"] = (recipe, FUSED_LINEAR)
    mtp_recipe = recipes[0]
    runs.update(mtp_native=("native", MTP), mtp_ours=(mtp_recipe, OURS + MTP),
                mtp_ours_fused_linear=(mtp_recipe, FUSED_LINEAR + MTP))
    return runs


def parse_log(text: str, warmup: int) -> dict:
    losses, times, mtp = {}, {}, {}
    for line in text.splitlines():
        m = ITERATION.search(line)
        if not m:
            continue
        it = int(m.group(1))
        times[it] = float(m.group(2))
        loss = LM_LOSS.search(line)
        if loss:
            losses[it] = float(loss.group(1))
        for head, value in MTP_LOSS.findall(line):
            mtp.setdefault(head, {})[it] = float(value)
    peaks = [int(p) for p in PEAK.findall(text)]
    steady = [t for it, t in sorted(times.items()) if it > warmup]
    return dict(
        losses=[losses[i] for i in sorted(losses)],
        ms_per_iteration=statistics.mean(steady) if steady else None,
        peak_memory_gib=max(peaks) / 2**30 if peaks else None,
        mtp_losses={head: [v[i] for i in sorted(v)] for head, v in mtp.items()},
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("megatron_lm", type=Path, help="a Megatron-LM checkout (pretrain_gpt.py at its root)")
    p.add_argument("--runs", default=None, help="comma-separated run names (default: all for this layout)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of ms/iteration")
    p.add_argument("--out", type=Path, default=Path("megatron_lm_h200"))
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    checkout = a.megatron_lm.resolve()
    source = (checkout / "pretrain_gpt.py").read_text()
    layout = megatron_lm_recipes.generation(source)
    available = runs_for(layout)
    names = a.runs.split(",") if a.runs else list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        p.error(f"unknown runs {unknown} for a {layout} pretrain_gpt.py; choose from {list(available)}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "site").mkdir(exist_ok=True)
    (a.out / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str((a.out / "site").resolve()), str(checkout), str(REPO),
                                                        os.environ.get("PYTHONPATH")])))
    summary_path = a.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    print(f"Megatron-LM {checkout} ({layout} layout); runs: {', '.join(names)}", flush=True)
    for name in names:
        recipe, flags = available[name]
        script = a.out / f"pretrain_gpt_{recipe}.py"
        script.write_text(megatron_lm_recipes.apply(source, recipe))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(script.resolve()), *MODEL, "--train-iters", str(a.iters), *flags]
        print(f"\n== {name}: {shlex.join(cmd)}", flush=True)
        if a.dry_run:
            continue
        proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        log = proc.stdout + "\n--- stderr ---\n" + proc.stderr
        (a.out / f"{name}.log").write_text(log)
        result = dict(recipe=recipe, flags=flags, command=shlex.join(cmd), returncode=proc.returncode,
                      **parse_log(proc.stdout + proc.stderr, a.warmup))
        summary[name] = result
        if proc.returncode != 0 or not result["losses"]:
            print(f"{name} failed ({proc.returncode}); log tail:\n{log[-3000:]}", flush=True)
            continue
        print(f"{name}: lm loss per iteration {' '.join(f'{x:.4f}' for x in result['losses'])}", flush=True)
        for head, values in result["mtp_losses"].items():
            print(f"{name}: mtp_{head} loss per iteration {' '.join(f'{x:.4f}' for x in values)}", flush=True)
        print(f"{name}: {result['ms_per_iteration']:.1f} ms/iteration (mean after {a.warmup}), peak memory "
              + (f"{result['peak_memory_gib']:.2f} GiB" if result["peak_memory_gib"] else "n/a"), flush=True)
        summary_path.write_text(json.dumps(summary, indent=1))
    if a.dry_run:
        return 0
    print("\n| run | ms/iteration | peak GiB | loss it 1 | loss it N | max abs diff vs native (mtp: vs mtp_native) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        r = summary.get(name)
        if not r or not r["losses"]:
            print(f"| {name} | failed | | | | |")
            continue
        base = summary.get("mtp_native" if name.startswith("mtp") else "native")
        diff = max((abs(x - y) for x, y in zip(r["losses"], base["losses"])), default=None) \
            if base and base.get("losses") else None
        peak = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] else "n/a"
        print(f"| {name} | {r['ms_per_iteration']:.1f} | {peak} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | "
              + (f"{diff:.2e} |" if diff is not None else "n/a |"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
