"""The benchmarks' figures, each ``plot(report, path)`` for ``report.write_report``; matplotlib
is imported only here, when a figure is drawn (ImportError without it: the report notes that)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path, dpi: int) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def logits_bandwidth(report: dict, path: Path) -> None:
    plt = _pyplot()
    ok = [r for r in report["results"] if r["status"] == "ok" and r["bw_fraction"]]
    paths = [p for p in ("none", "mean") if any(r["path"] == p for r in ok)]
    if not paths:
        return
    fig, axes = plt.subplots(len(paths), 1, figsize=(13, 4.2 * len(paths)), squeeze=False)
    for ax, p in zip(axes[:, 0], paths):
        rows = [r for r in ok if r["path"] == p]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            by_case = {r["case"]: r["bw_fraction"] for r in rows if r["impl"] == impl}
            xs = [j + (i - (len(impls) - 1) / 2) * width for j, c in enumerate(cases) if c in by_case]
            ax.bar(xs, [by_case[c] for c in cases if c in by_case], width, label=impl)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(cases)), cases, fontsize=8)
        ax.set_ylabel("fraction of HBM bandwidth (bound / time)")
        bpe = "6 B" if p == "none" else "4 B"
        ax.set_title(f"{report['meta']['device']}: {'per-token' if p == 'none' else 'mean'} loss, "
                     f"fwd+bwd (bound: {bpe}/element for bf16)")
        ax.legend(fontsize=7, ncol=min(len(impls), 6), loc="upper right")
        ax.set_ylim(0, max(1.15, 1.1 * max(r["bw_fraction"] for r in rows)))
    _save(plt, fig, path, 120)


def linear_front(report: dict, path: Path) -> None:
    """Time against memory, one panel per vocabulary and reduction."""
    plt = _pyplot()
    rows = report["rows"]
    keys = sorted({(r["v"], r["reduction"]) for r in rows}, key=lambda k: (-k[0], k[1]))
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for r in (r for r in rows if (r["v"], r["reduction"]) == key):
            ours = r["impl"].startswith("ours")
            ax.scatter(r["peak_extra_minus_grads_GiB"], r["ms"], marker="o" if ours else "s",
                       color="C0" if ours else "C1")
            ax.annotate(r["impl"], (r["peak_extra_minus_grads_GiB"], r["ms"]), fontsize=7)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_title(f"V={key[0]}, {key[1]}")
        ax.set_xlabel("peak extra memory less gradients (GiB)")
        ax.set_ylabel("fwd+bwd ms")
    _save(plt, fig, path, 110)


def scaling_curves(report: dict, path: Path, target: float) -> None:
    plt = _pyplot()
    vocabs = report["meta"]["vocab"]
    fig, axes = plt.subplots(2, len(vocabs), figsize=(6 * len(vocabs), 8), squeeze=False)
    for j, v in enumerate(vocabs):
        ax = axes[0][j]
        rows = [r for r in report["results"] if r["vocab"] == v]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["tp"], r["total_ms"]) for r in rows if r["impl"] == impl and r["total_ms"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="--" if impl == "kernel" else "-",
                        label="ours, 1 shard (no TP)" if impl == "kernel" else impl)
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["meta"]["tp_sizes"], [str(t) for t in report["meta"]["tp_sizes"]])
        ax.set_yscale("log")
        ax.set_xlabel("TP")
        ax.set_ylabel("fwd + bwd per rank (ms)")
        ax.set_title(f"V = {v}, N = {report['meta']['tokens_per_rank']} per rank")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        sc = [s for s in report["scaling"] if s["vocab"] == v and s["tp"] > 1]
        for key, label in (("collective_over_kernel", "collective / 1-shard kernel"),
                           ("collective_share_of_total", "collective share of ours"),
                           ("tp_overhead_end_to_end", "ours / kernel - 1")):
            pts = [(s["tp"], 100 * s[key]) for s in sc if s[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(100 * target, color="red", linestyle=":", label=f"target {100 * target:g} %")
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["meta"]["tp_sizes"], [str(t) for t in report["meta"]["tp_sizes"]])
        ax.set_xlabel("TP")
        ax.set_ylabel("%")
        ax.legend(fontsize=8)
    m = report["meta"]
    fig.suptitle(f"{m['device']} x {m['world_size']} ({m['backend']})" + (" — CPU smoke" if m["cpu_smoke"] else ""))
    _save(plt, fig, path, 110)


def long_context_memory(report: dict, path: Path) -> None:
    """Peak memory against sequence length, one panel per vocabulary, one line per run (tools/
    megatron_lm_long_context.py); a run's out-of-memory length marked at the limit, the memory
    model's predictions dotted."""
    plt = _pyplot()
    rows = report["results"]
    vocabs = sorted({r["vocab"] for r in rows})
    if not vocabs:
        return
    limit = report["meta"].get("limit_gib")
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6.5 * len(vocabs), 4.6), squeeze=False)
    # one color per run in every panel, whichever runs a panel has
    colors = {run: f"C{i}" for i, run in enumerate(dict.fromkeys(r["run"] for r in rows))}
    for ax, v in zip(axes[0], vocabs):
        runs = list(dict.fromkeys(r["run"] for r in rows if r["vocab"] == v))
        for run in runs:
            mine = sorted((r for r in rows if r["vocab"] == v and r["run"] == run), key=lambda r: r["seq"])
            ok = [r for r in mine if r["status"] == "ok" and r.get("peak_memory_gib") is not None]
            color = colors[run]
            ax.plot([r["seq"] for r in ok], [r["peak_memory_gib"] for r in ok], marker="o", color=color, label=run)
            pred = [r for r in mine if r.get("predicted_gib") is not None]
            ax.plot([r["seq"] for r in pred], [r["predicted_gib"] for r in pred], ls=":", color=color, lw=1)
            oom = [r["seq"] for r in mine if r["status"] == "oom"]
            if oom and limit:
                ax.scatter(oom, [limit] * len(oom), marker="x", s=60, color=color)
        if limit:
            ax.axhline(limit, color="black", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens per micro-batch)")
        ax.set_ylabel("peak memory (GiB)")
        ax.set_title(f"V = {v}: measured (solid), predicted (dotted), OOM (x at the limit)", fontsize=9)
        ax.legend(fontsize=7)
    _save(plt, fig, path, 110)
