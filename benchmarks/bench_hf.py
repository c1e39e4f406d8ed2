#!/usr/bin/env python
"""Peak memory and train-step time of a ~1B Llama (Llama-3.2-1B shape, random weights, bf16):
transformers' own loss vs ``vocab_parallel_loss.transformers.patch`` vs Liger's
``apply_liger_kernel_to_llama`` (fused linear cross entropy only, so that only the head differs;
skipped if Liger is not importable).

Each variant runs in its own subprocess (Liger patches classes; peak memory starts clean). A step
is forward + backward (gradient checkpointing on by default, as in fine-tuning, so that the
(tokens x 128256) logits dominate); gradients are dropped between steps, no optimizer state.

    python benchmarks/bench_hf.py --out-dir runs/bench_hf                 # H200
    python benchmarks/bench_hf.py --tiny --out-dir /tmp/bench_hf_tiny     # CPU smoke test

``--variants`` also takes ``vocab_parallel_loss@G``: the patch under a memory budget of G GiB
(the plain name runs the default budget).

Writes ``results.json`` and ``results.md`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.env import environment, package_dir, use_checkout_package, version  # noqa: E402
from harness.report import fmt, table, write_report  # noqa: E402
from harness.timing import Device  # noqa: E402

VARIANTS = ("transformers", "vocab_parallel_loss", "liger")

LLAMA_1B = dict(  # Llama-3.2-1B
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=1031,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-grad-ckpt", action="store_true", help="keep all layer activations")
    p.add_argument("--impl", default="auto", help="impl passed to patch() (auto|triton|torch)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    p.add_argument("--timeout", type=int, default=170, help="seconds per variant")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    return p.parse_args(argv)


def _run_variant(args) -> dict:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available() and not args.tiny
    dev = Device("cuda" if cuda else "cpu", flush="none")  # whole steps: no L2 flush
    device = dev.torch
    dtype = torch.bfloat16 if cuda else torch.float32
    info = {"variant": args.variant, "transformers": transformers.__version__,
            "torch": torch.__version__, "device": dev.name() if cuda else "cpu"}

    if args.variant == "liger":
        try:
            import liger_kernel
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except Exception as exc:  # not installed, or incompatible with this transformers
            return {**info, "skipped": f"liger-kernel not importable: {exc!r}"}
        info["liger_kernel"] = getattr(liger_kernel, "__version__", None) or version("liger-kernel")
        # only the head: same model code otherwise, as for the other two variants
        apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=True)

    config = LlamaConfig(**(TINY if args.tiny else LLAMA_1B))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.to(device=device, dtype=dtype).train()
    if not args.no_grad_ckpt:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.config.use_cache = False
    name, _, gib = args.variant.partition("@")
    if name == "vocab_parallel_loss":  # "vocab_parallel_loss@G": under a memory budget of G GiB
        import vocab_parallel_loss.transformers as vh

        vh.patch(model, impl=args.impl,
                 **({"memory_budget": int(float(gib) * 2**30)} if gib else {}))
    info["params"] = sum(p.numel() for p in model.parameters())

    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    labels = ids.clone()
    labels[:, : args.seq // 8] = -100  # a masked prompt, as in SFT

    def step():
        out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        loss = out.loss.detach().float()
        logits_shape = None if out.logits is None else tuple(out.logits.shape)
        del out
        model.zero_grad(set_to_none=True)
        return loss, logits_shape

    losses = []
    for _ in range(args.warmup):
        loss, logits_shape = step()
        losses.append(loss.item())
    dev.empty_cache()
    base = dev.reset_peak()
    times = []
    for _ in range(args.steps):  # whole steps, host clock after a sync: they are long
        dev.sync()
        t0 = time.perf_counter()
        loss, logits_shape = step()
        dev.sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    info.update(
        tokens=args.batch * args.seq,
        grad_ckpt=not args.no_grad_ckpt,
        first_loss=losses[0],
        losses=losses,
        logits_returned=logits_shape,
        step_s_median=statistics.median(times),
        step_s_all=times,
        tokens_per_s=args.batch * args.seq / statistics.median(times),
    )
    if cuda:
        info.update(
            weights_and_base_gib=base / 2**30,
            peak_gib=dev.peak() / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
        )
    return info


def _markdown(results, args, meta) -> str:
    rows = []
    for r in results:
        if "error" in r or "skipped" in r:
            rows.append((r["variant"], r.get("error") or r.get("skipped"), "", "", "", ""))
            continue
        rows.append((r["variant"], fmt(r.get("peak_gib"), ".2f", "n/a"),
                     fmt(r.get("weights_and_base_gib"), ".2f", "n/a"),
                     f"{r['step_s_median']:.3f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['first_loss']:.5f}"))
    env = next((r for r in results if "torch" in r), {})
    lines = [
        f"Llama {'tiny' if args.tiny else '~1.2B (Llama-3.2-1B shape)'}, random weights, "
        f"batch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens, "
        f"gradient checkpointing {'off' if args.no_grad_ckpt else 'on'}, forward+backward; "
        f"median of {args.steps} steps after {args.warmup} warm-up.",
        "",
        *table(["variant", "peak memory (GiB)", "allocated before steps (GiB)", "step (s)",
                       "tokens/s", "first loss"], rows, "lrrrrr"),
        "",
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"{env.get('device')}, python {platform.python_version()}, commit `{meta.get('commit')}`",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = _parse(argv)
    if args.variant:
        print("RESULT " + json.dumps(_run_variant(args)), flush=True)
        return
    use_checkout_package()
    # the variants measure the package this process imports (PYTHONPATH's, else the checkout's)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(package_dir().parent), os.environ.get("PYTHONPATH")]))}
    meta = environment()
    results = []
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for variant in [v for v in args.variants.split(",") if v]:
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--variant", variant]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = next((l for l in proc.stdout.splitlines()[::-1] if l.startswith("RESULT ")), None)
            if line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                r = {"variant": variant, "error": f"rc={proc.returncode}: " + " / ".join(tail)}
            else:
                r = json.loads(line[len("RESULT "):])
        except subprocess.TimeoutExpired:
            r = {"variant": variant, "error": f"timed out after {args.timeout}s"}
        r["wall_s"] = time.time() - t0
        results.append(r)
        print(json.dumps(r), flush=True)
    md = _markdown(results, args, meta)
    write_report(Path(args.out_dir) / "results",
                        {"meta": meta, "args": vars(args), "results": results}, md)
    print(md)


if __name__ == "__main__":
    main()
