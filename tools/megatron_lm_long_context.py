#!/usr/bin/env python
"""Megatron-LM's own ``pretrain_gpt.py`` at growing sequence lengths on one GPU, per vocabulary
and loss path: tokens/s and peak memory until each path runs out of memory.

    python tools/megatron_lm_long_context.py MEGATRON_LM [--vocab 151936,262144] [--seq 4096,...]
        [--runs native,...] [--results FILE.json] [--merge FILE.json ...] [--max-seconds 540] [--dry-run]

The model: ``--mock-data --tokenizer-type NullTokenizer --transformer-impl local``, bf16, TP = 1,
micro-batch 1, 4 layers, hidden 2048, 16 heads (``--layers``, ``--hidden``, ``--heads``), rope
positions, tied embeddings, Megatron-LM's defaults otherwise (tools/megatron_lm_h200.py's flags
for a machine without TransformerEngine or apex). Attention (``--attention``): ``sdpa``
(default) is megatron-core's local layer with torch's ``scaled_dot_product_attention`` as its
core attention (tools/megatron_lm_sdpa_attention.py, through Megatron-LM's ``--spec``), O(s)
memory; ``local`` is megatron-core's ``DotProductAttention``, which materializes the s x s
scores, with ``--recompute-granularity selective``: every path then runs out of memory near
s = 32K (tools/megatron_lm_memory_model.py ``--attention local --recompute``).

Runs (``--runs``; ``RUNS``): ``native`` (megatron-core's loss), ``native_fused``
(``--cross-entropy-loss-fusion``), ``ours`` (``--vocab-parallel-loss``, the loss over the
logits), ``ours_inplace`` (with ``--vocab-parallel-loss-inplace-backward``; not in the default
set), ``ours_fused_linear`` (``--vocab-parallel-loss-fused-linear``, the default 2 GiB budget)
and ``ours_fused_linear_small`` (with ``--vocab-parallel-loss-memory-budget``, ``--small-budget``
GiB, 0.25 by default). Ours are wired by the README recipe of the checkout's layout
(``pre_wrap_hook``, or ``provider`` for Megatron-LM <= 0.17; tools/megatron_lm_recipes.py).

Per run: ms/iteration (Megatron-LM's elapsed time per iteration, mean after ``--warmup``),
tokens/s (sequence x micro-batch per iteration over it), peak memory
(``torch.cuda.max_memory_allocated()`` at exit, as tools/megatron_lm_h200.py records it), the
status (``ok``, ``oom``, ``failed``, ``timeout``), the memory model's prediction
(tools/megatron_lm_memory_model.py) and, for the fused linear runs, the strategy it predicts.
A run that ran out of memory (or failed, or timed out) at a length is not started at longer
lengths, in this call or a later one that merges its results.

Time-limited calls: every run prints its estimated time first (start-up plus iterations; the
start-up is measured from earlier results once there are some); with ``--max-seconds`` a run
that would end past it is not started (and one still running then is stopped, not recorded), so
the same command in the next call goes on where this one stopped: results already present are
not run again (``--rerun`` runs them again). ``--merge`` reads earlier results files (the
same model; a missing one is skipped); ``--results`` is written after every run (JSON; markdown and a plot of peak memory
against sequence length beside it, a failed plot noted in the JSON, never losing the numbers).
Logs go to ``--out``. ``--dry-run`` writes the scripts and prints the commands and estimates, the memory model's
predicted out-of-memory lengths standing in for measured ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(REPO / "benchmarks"))

import megatron_lm_h200  # noqa: E402
import megatron_lm_memory_model as memory  # noqa: E402
import megatron_lm_recipes  # noqa: E402
from harness import plots, report  # noqa: E402

DEFAULT_VOCABS = (151936, 262144)
DEFAULT_SEQS = (4096, 16384, 32768, 65536, 98304, 131072, 196608, 262144)
#: name -> (memory-model run, our flags, budget: None, or "small" for --small-budget)
RUNS = {
    "native": ("native", [], None),
    "native_fused": ("native_fused", ["--cross-entropy-loss-fusion"], None),
    "ours": ("ours", megatron_lm_h200.OURS, None),
    "ours_inplace": ("ours_inplace", megatron_lm_h200.OURS + ["--vocab-parallel-loss-inplace-backward"], None),
    "ours_fused_linear": ("fused_linear", megatron_lm_h200.FUSED_LINEAR, None),
    "ours_fused_linear_small": ("fused_linear", megatron_lm_h200.FUSED_LINEAR, "small"),
}
DEFAULT_RUNS = ("native", "native_fused", "ours", "ours_fused_linear", "ours_fused_linear_small")
FAILED = ("oom", "failed", "timeout")
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED")
ALLOC = re.compile(r"Tried to allocate ([\d.]+ [KMGT]iB)")
SPEC_MODULE = "megatron_lm_sdpa_attention"


def model_flags(vocab: int, seq: int, a) -> List[str]:
    """Megatron-LM's flags for one run's model: tools/megatron_lm_h200.py's, the shape replaced."""
    override = {"--num-layers": a.layers, "--hidden-size": a.hidden, "--num-attention-heads": a.heads,
                "--seq-length": seq, "--max-position-embeddings": seq, "--micro-batch-size": a.micro_batch,
                "--global-batch-size": a.micro_batch, "--vocab-size": vocab}
    flags = list(megatron_lm_h200.MODEL)
    for i, f in enumerate(flags[:-1]):
        if f in override:
            flags[i + 1] = str(override[f])
    flags += ["--position-embedding-type", "rope", "--no-create-attention-mask-in-dataloader"]
    if a.attention == "sdpa":
        flags += ["--spec", SPEC_MODULE, "layer_spec"]
    else:
        flags += ["--recompute-granularity", "selective"]
    return flags


def shape(vocab: int, seq: int, a) -> memory.Shape:
    return memory.Shape(seq=seq, vocab=vocab, layers=a.layers, hidden=a.hidden, heads=a.heads,
                        micro_batch=a.micro_batch, attention=a.attention, recompute=a.attention == "local")


def budget_of(name: str, a) -> Optional[float]:
    return a.small_budget if RUNS[name][2] == "small" else None


def run_flags(name: str, a) -> List[str]:
    budget = budget_of(name, a)
    return RUNS[name][1] + ([] if budget is None else ["--vocab-parallel-loss-memory-budget", f"{budget:g}"])


def step_flops(m: memory.Shape, fused_strategy: Optional[str]) -> float:
    """Flops of one iteration: 6 N per parameter of the layers and the output layer (2 more NHV
    when the fused linear loss recomputes the logits), causal attention 7 s^2 H a layer a
    sequence (forward 2 s^2 H, backward 2.5 times that), 12 s^2 H for the local attention (no
    causal skipping, recomputed forward)."""
    n, h = m.tokens, m.hidden
    # every parameter is in a GEMM once (the tied embedding as the output layer)
    flops = 6 * n * memory.params(m) + (2 * n * h * m.vocab if fused_strategy == "recompute" else 0)
    attention = (12 if m.attention == "local" else 7) * m.seq * m.seq * h * m.layers * m.micro_batch
    return flops + attention


def dict_replace(a, **kw):
    """A copy of the parsed arguments ``a`` with ``kw`` set."""
    return argparse.Namespace(**dict(vars(a), **kw))


def estimate_seconds(name: str, vocab: int, seq: int, a, startup: float) -> float:
    m = shape(vocab, seq, a)
    strategy = (memory.fused_linear_strategy(m, budget_of(name, a))["strategy"]
                if RUNS[name][0] == "fused_linear" else None)
    step = step_flops(m, strategy) / (a.tflops * 1e12)
    return startup + a.compile_s * (name == "native_fused") + a.iters * step


def measured_startup(results: List[dict], iters_default: int) -> Optional[float]:
    """Median of (wall time - iterations x ms/iteration) over the ok runs, or None."""
    xs = [r["wall_s"] - r.get("iters", iters_default) * r["ms_per_iteration"] / 1e3
          for r in results if r.get("status") == "ok" and r.get("wall_s") and r.get("ms_per_iteration")]
    return statistics.median(xs) if xs else None


def key(r: dict):
    return (int(r["vocab"]), int(r["seq"]), r["run"])


def merge(into: Dict[tuple, dict], results: List[dict]) -> None:
    for r in results:
        into[key(r)] = r


def load(path: Path, meta: dict) -> List[dict]:
    """The results of an earlier results file whose model is this one's (else ValueError)."""
    data = json.loads(Path(path).read_text())
    theirs = {k: data.get("meta", {}).get(k) for k in MODEL_KEYS}
    ours = {k: meta.get(k) for k in MODEL_KEYS}
    if theirs != ours:
        raise ValueError(f"{path}: another model ({theirs}), not this one ({ours})")
    return data.get("results", [])


MODEL_KEYS = ("layers", "hidden", "heads", "micro_batch", "attention", "iters", "warmup", "small_budget")


def stopped_at(results: Dict[tuple, dict], vocab: int, run: str, seq: int) -> Optional[dict]:
    """The result at a shorter sequence of the same vocabulary and run that ran out of memory,
    failed or timed out, if any: the run is not started at ``seq``."""
    shorter = [r for (v, s, n), r in results.items() if v == vocab and n == run and s < seq and r["status"] in FAILED]
    return min(shorter, key=lambda r: r["seq"]) if shorter else None


def classify(returncode: int, text: str, parsed: dict) -> str:
    if OOM.search(text):
        return "oom"
    if returncode == 0 and parsed.get("ms_per_iteration") is not None:
        return "ok"
    return "failed"


def run_command(cmd: List[str], cwd: Path, env: dict, timeout: Optional[float]):
    """``(returncode or None when timed out, stdout + stderr)``; a timed-out run's process group
    is stopped."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def markdown(data: dict) -> str:
    meta, rows = data["meta"], data["results"]
    lines = [f"# Megatron-LM long context: {meta.get('device') or 'GPU'}", "",
             f"Megatron-LM's own `pretrain_gpt.py` ({meta.get('megatron_lm', '?')}), {meta['layers']} layers, "
             f"hidden {meta['hidden']}, {meta['heads']} heads, micro-batch {meta['micro_batch']}, bf16, TP=1, rope, "
             f"tied embeddings, mock data; attention `{meta['attention']}`; {meta['iters']} iterations, "
             f"ms/iteration the mean after {meta['warmup']}. Peak: `torch.cuda.max_memory_allocated()` at exit "
             f"(an OOM run's: before the failed allocation). Predicted: tools/megatron_lm_memory_model.py. "
             f"Small budget: {meta['small_budget']:g} GiB. Command: `{meta.get('command', '')}`", ""]
    runs = [n for n in RUNS if any(r["run"] == n for r in rows)]
    for vocab in sorted({r["vocab"] for r in rows}):
        seqs = sorted({r["seq"] for r in rows if r["vocab"] == vocab})
        by = {(r["seq"], r["run"]): r for r in rows if r["vocab"] == vocab}
        lines += [f"## V = {vocab}", "", "Peak GiB (tokens/s); `OOM` ran out of memory, `-` not run "
                  "(out of memory, failed or timed out at a shorter length, or not asked for).", ""]
        cells = []
        for n in runs:
            row = [n]
            for s in seqs:
                r = by.get((s, n))
                if r is None:
                    row.append("-")
                elif r["status"] == "ok":
                    row.append(f"{report.fmt(r.get('peak_memory_gib'), '.1f', '?')} ({r['tokens_per_s']:,.0f})")
                else:
                    row.append(r["status"].upper())
            cells.append(row)
        lines += report.table(["run"] + [str(s) for s in seqs], cells, "l" + "r" * len(seqs)) + [""]
        detail = [[n, s, r["status"], report.fmt(r.get("ms_per_iteration"), ".1f"),
                   report.fmt(r.get("tokens_per_s"), ",.0f"), report.fmt(r.get("peak_memory_gib"), ".2f"),
                   report.fmt(r.get("predicted_gib"), ".1f"), r.get("strategy") or "", r.get("note") or ""]
                  for n in runs for s in seqs for r in [by.get((s, n))] if r is not None]
        lines += report.table(["run", "seq", "status", "ms/it", "tokens/s", "peak GiB", "predicted GiB",
                               "fused linear strategy (predicted)", "note"], detail, "lrlrrrrll") + [""]
    notes = data.get("notes")
    if notes:
        lines += ["Notes: " + "; ".join(f"{k}: {v}" for k, v in notes.items())
                  if isinstance(notes, dict) else "Notes: " + "; ".join(notes)]
    return "\n".join(lines)


def write(path: Path, data: dict) -> List[Path]:
    data = dict(data, results=sorted(data["results"], key=lambda r: (r["vocab"], r["seq"], list(RUNS).index(r["run"]))))
    data.pop("notes", None)  # a fresh plot note each time
    return report.write_report(Path(path).with_suffix(""), data, markdown(data), plots.long_context_memory)


def device_name() -> Optional[str]:
    """The GPU's name from nvidia-smi (no CUDA context in this process: the runs get it all)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("megatron_lm", type=Path, help="a Megatron-LM checkout (pretrain_gpt.py at its root)")
    p.add_argument("--vocab", default=",".join(map(str, DEFAULT_VOCABS)))
    p.add_argument("--seq", default=",".join(map(str, DEFAULT_SEQS)))
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--attention", choices=("sdpa", "local"), default="sdpa")
    p.add_argument("--small-budget", type=float, default=0.25, help="GiB, for ours_fused_linear_small")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of ms/iteration")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks/results/megatron_lm_long_context_h200.json")
    p.add_argument("--merge", type=Path, nargs="*", default=[], help="earlier results files to merge in")
    p.add_argument("--rerun", action="store_true", help="run again what the results already hold")
    p.add_argument("--out", type=Path, default=Path("megatron_lm_long_context"), help="logs and scripts")
    p.add_argument("--max-seconds", type=float, default=None, help="start no run that would end past this")
    p.add_argument("--startup-s", type=float, default=75.0, help="start-up estimate before any measured one")
    p.add_argument("--compile-s", type=float, default=30.0, help="torch.compile of native_fused's loss")
    p.add_argument("--tflops", type=float, default=200.0, help="the estimate's effective TFLOP/s")
    p.add_argument("--limit-gib", type=float, default=memory.H200_LIMIT_GIB)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    vocabs = [int(x) for x in a.vocab.split(",")]
    seqs = sorted(int(x) for x in a.seq.split(","))
    names = a.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    checkout = a.megatron_lm.resolve()
    source = (checkout / "pretrain_gpt.py").read_text()
    layout = megatron_lm_recipes.generation(source)
    recipe = "provider" if layout == "pretrain_args" else "pre_wrap_hook"
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    meta = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, micro_batch=a.micro_batch, attention=a.attention,
                iters=a.iters, warmup=a.warmup, small_budget=a.small_budget, limit_gib=a.limit_gib, recipe=recipe,
                alloc_conf=alloc_conf,
                megatron_lm=f"{checkout.name} ({layout} layout)", device=None if a.dry_run else device_name(),
                command="python tools/megatron_lm_long_context.py MEGATRON_LM " + shlex.join(
                    [x for x in (argv if argv is not None else sys.argv[1:]) if x != str(a.megatron_lm)]))
    results: Dict[tuple, dict] = {}
    for path in a.merge + ([a.results] if a.results.exists() else []):
        if not path.exists():  # the first call of a series: nothing to merge yet
            print(f"--merge {path}: no such file, nothing merged from it", flush=True)
            continue
        merge(results, load(path, meta))
    a.out.mkdir(parents=True, exist_ok=True)
    site = a.out / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(megatron_lm_h200.SITECUSTOMIZE)
    shutil.copy(Path(__file__).resolve().parent / f"{SPEC_MODULE}.py", site / f"{SPEC_MODULE}.py")
    script = a.out / f"pretrain_gpt_{recipe}.py"
    script.write_text(megatron_lm_recipes.apply(source, recipe))
    native_script = a.out / "pretrain_gpt_native.py"
    native_script.write_text(source)
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTORCH_CUDA_ALLOC_CONF=alloc_conf,
               PYTHONPATH=os.pathsep.join(filter(None, [str(site.resolve()), str(checkout), str(REPO),
                                                        os.environ.get("PYTHONPATH")])))
    startup = measured_startup(list(results.values()), a.iters) or a.startup_s
    print(f"Megatron-LM {checkout} ({layout} layout, recipe {recipe}); attention {a.attention}; "
          f"start-up estimate {startup:.0f} s; {len(results)} results merged", flush=True)
    # every run at a length before the next length: each call's results compare the runs
    pending = [(vocab, name, seq) for vocab in vocabs for seq in seqs for name in names]
    total = 0.0
    for vocab, name, seq in pending:
        k = (vocab, seq, name)
        m = shape(vocab, seq, a)
        budget = budget_of(name, a)
        predicted = memory.peak_bytes(RUNS[name][0], m, budget) / memory.GIB
        strategy = (memory.fused_linear_strategy(m, budget)["detail"] if RUNS[name][0] == "fused_linear" else None)
        if k in results and not a.rerun:
            continue
        stop = stopped_at(results, vocab, name, seq)
        if stop is not None:
            print(f"-- {name} V={vocab} seq={seq}: not started ({stop['status']} at seq {stop['seq']})", flush=True)
            continue
        oom_predicted = predicted > a.limit_gib
        # a run out of memory stops in its first iteration
        est = estimate_seconds(name, vocab, seq, dict_replace(a, iters=1) if oom_predicted else a, startup)
        flags = model_flags(vocab, seq, a) + ["--train-iters", str(a.iters)] + run_flags(name, a)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str((script if name.startswith("ours") else native_script).resolve()), *flags]
        print(f"\n== {name} V={vocab} seq={seq}: estimated {est:.0f} s, predicted peak {predicted:.1f} GiB"
              + (" (OOM predicted)" if predicted > a.limit_gib else "") + (f", {strategy}" if strategy else ""),
              flush=True)
        print(shlex.join(cmd), flush=True)
        if a.dry_run:  # the predictions stand in for the results: what the sweep would start
            total += est
            if oom_predicted:
                results[k] = dict(vocab=vocab, seq=seq, run=name, status="oom", predicted_gib=predicted)
            continue
        left = None if a.max_seconds is None else a.max_seconds - (time.monotonic() - t0)
        if left is not None and est > left:
            print(f"   not started: {est:.0f} s estimated, {left:.0f} s left of --max-seconds", flush=True)
            continue
        start = time.monotonic()
        rc, text = run_command(cmd, checkout, env, left)
        wall = time.monotonic() - start
        log = a.out / f"{name}_v{vocab}_s{seq}.log"
        log.write_text(text)
        if rc is None:
            print(f"   stopped at --max-seconds after {wall:.0f} s; not recorded", flush=True)
            break
        parsed = megatron_lm_h200.parse_log(text, a.warmup)
        status = classify(rc, text, parsed)
        ms = parsed["ms_per_iteration"] if status == "ok" else None
        alloc = ALLOC.search(text)
        r = dict(vocab=vocab, seq=seq, run=name, status=status, returncode=rc, flags=run_flags(name, a),
                 iters=a.iters, ms_per_iteration=ms, tokens_per_s=seq * a.micro_batch / (ms / 1e3) if ms else None,
                 peak_memory_gib=parsed["peak_memory_gib"], predicted_gib=predicted, strategy=strategy,
                 wall_s=wall, losses=parsed["losses"],
                 note=(f"tried to allocate {alloc.group(1)}" if status == "oom" and alloc else
                       None if status == "ok" else text.strip().splitlines()[-1][:200] if text.strip() else None))
        results[k] = r
        print(f"   {status}: " + (f"{ms:.1f} ms/iteration, {r['tokens_per_s']:,.0f} tokens/s, " if ms else "")
              + f"peak {report.fmt(r['peak_memory_gib'], '.2f', 'n/a')} GiB (predicted {predicted:.1f}), "
              f"{wall:.0f} s" + (f"; log tail:\n{text[-2000:]}" if status == "failed" else ""), flush=True)
        write(a.results, dict(meta=meta, results=list(results.values())))
    if a.dry_run:
        print(f"\ndry run: {total:.0f} s estimated for the runs above (a run predicted out of memory "
              f"counted as its start-up and one iteration, and not started at longer lengths)")
    elif results:
        for path in write(a.results, dict(meta=meta, results=list(results.values()))):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
