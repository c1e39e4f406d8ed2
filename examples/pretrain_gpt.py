#!/usr/bin/env python
"""Train a megatron-core GPTModel with the exact vocab-parallel loss (or megatron-core's own).

Megatron-LM-style flags; defaults from a YAML file given by ``--config`` (command-line flags win).
Runs under ``torchrun`` on CPU (gloo) or GPU (nccl, one GPU a rank), chosen automatically::

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --config examples/configs/tiny_gpt_tp2.yaml

``--device cuda:0`` puts every rank on that one GPU, over gloo (NCCL refuses two ranks on one GPU):
tensor parallelism with a single GPU.

Data: by default real text needing no download, the Python standard library's source files,
tokenized by a byte-level BPE tokenizer trained on the fly (``tokenizers``); ``--synthetic-data``
gives learnable synthetic sequences over ``--vocab-size`` tokens instead.

Loss: ``--vocab-parallel-loss`` (our loss), or ``--native-loss`` for megatron-core's own
(``--cross-entropy-loss-fusion`` selects its fused one). ``--vocab-parallel-loss-fused-linear``
fuses the output layer with our loss: the logits are never materialized. ``--compare-native`` also
runs megatron-core's loss on the same logits every step and prints the largest difference in loss
and in the logits' gradient (with the fused path, which has no logits: the logits are computed
apart from the model for the comparison, and the gradient compared is the output layer's input's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import sysconfig
import time
import warnings
from pathlib import Path

# Expected here, and noisy on every rank: megatron-core's notes that TransformerEngine / Apex are
# absent and on CUDA tuning; torch's rename of all_gather_into_tensor.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|all_gather_into_tensor).*")

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from vocab_parallel_loss.megatron import (  # noqa: E402
    VocabParallelLossConfig,
    VocabParallelLossGPTModel,
    add_vocab_parallel_loss_args,
)
from vocab_parallel_loss.megatron import _compat  # noqa: E402

EOS = "<|endoftext|>"


# --------------------------------------------------------------------------------------- flags
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=str, default=None, help="YAML file of defaults (flag names, - or _).")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="grouped query attention")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times the TP size (as Megatron-LM)")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 master weights")
    g = p.add_argument_group("parallelism")
    g.add_argument("--device", type=str, default="auto",
                   help="auto: cuda if a GPU is present, else cpu; cpu: gloo; cuda: nccl, one GPU a rank "
                        "(LOCAL_RANK); cuda:N: every rank on GPU N (of those CUDA_VISIBLE_DEVICES shows), gloo")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="only 1 is supported here")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("data")
    g.add_argument("--synthetic-data", action="store_true", help="synthetic learnable sequences")
    g.add_argument("--vocab-size", type=int, default=4096,
                   help="BPE vocabulary trained on the fly, or the synthetic vocabulary")
    g.add_argument("--data-max-bytes", type=int, default=2_000_000,
                   help="how much standard-library source to train the tokenizer on and tokenize")
    g = p.add_argument_group("loss")
    g.add_argument("--native-loss", action="store_true",
                   help="megatron-core's own loss (the baseline); overrides --vocab-parallel-loss")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="with --native-loss: megatron-core's fused loss (cross_entropy_fusion_impl native)")
    g.add_argument("--compare-native", action="store_true",
                   help="also run megatron-core's loss on the same logits each step; print the difference")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--timing-skip-iters", type=int, default=2, help="warm-up steps left out of the timing")
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--json-output", type=str, default=None, help="write the run's summary here (rank 0)")
    add_vocab_parallel_loss_args(p)
    return p


def load_yaml(path: str) -> dict:
    """The config file: PyYAML when installed, else flat ``key: value`` lines (what
    examples/configs/ holds)."""
    try:
        import yaml
    except ImportError:
        yaml = None
    with open(path) as f:
        text = f.read()
    if yaml is not None:
        return yaml.safe_load(text) or {}
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, value = line.partition(":")
        value = value.strip()
        low = value.lower()
        if low in ("true", "false"):
            out[key.strip()] = low == "true"
            continue
        for conv in (int, float):
            try:
                out[key.strip()] = conv(value)
                break
            except ValueError:
                pass
        else:
            out[key.strip()] = value.strip("'\"")
    return out


def progress_bar(**kwargs):
    """tqdm when installed, else a bar that only writes the per-step lines."""
    try:
        from tqdm import tqdm

        return tqdm(**kwargs)
    except ImportError:
        class _Bar:
            def write(self, line):
                print(line, flush=True)

            def set_postfix(self, **_):
                pass

            def update(self, _n=1):
                pass

            def close(self):
                pass

        return _Bar()


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        loaded = load_yaml(pre.config)
        dests = {a.dest for a in parser._actions}
        defaults = {}
        for key, value in loaded.items():
            dest = str(key).replace("-", "_")
            if dest not in dests or dest == "config":
                parser.error(f"{pre.config}: unknown key {key!r}")
            defaults[dest] = value
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if args.native_loss:
        args.vocab_parallel_loss = False
    if args.pipeline_model_parallel_size != 1:
        parser.error("this script runs pipeline-model-parallel-size 1 only")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.device not in ("auto", "cpu", "cuda") and not (
        args.device.startswith("cuda:") and args.device[5:].isdigit()
    ):
        parser.error(f"--device {args.device}: expected auto, cpu, cuda or cuda:N")
    return args


# --------------------------------------------------------------------------------- distributed
def init_distributed(spec: str) -> torch.device:
    """torch.distributed from torchrun's environment (or a single process) for ``--device``; returns
    this rank's device. ``cuda``: nccl, the GPU of this rank's LOCAL_RANK. ``cuda:N``: every rank
    on GPU N over gloo; gloo moves CUDA tensors through the host, bf16 included, and megatron-core
    makes its groups with the default backend, so they are gloo groups too."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {spec}: no CUDA device is visible")
        shared = spec != "cuda"
        index = int(spec[5:]) if shared else int(os.environ["LOCAL_RANK"])
        if index >= torch.cuda.device_count():
            hint = "; --device cuda:0 runs every rank on one GPU" if not shared else ""
            raise SystemExit(f"--device {spec}: GPU {index} asked for, {torch.cuda.device_count()} visible{hint}")
        device, backend = torch.device("cuda", index), "gloo" if shared else "nccl"
        # megatron-core allocates on torch.cuda.current_device(): every rank's current device must
        # be the one its tensors live on (GPU N for all ranks when shared, not LOCAL_RANK)
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    return device


def print0(*a, **k) -> None:
    if dist.get_rank() == 0:
        print(*a, **k, flush=True)


# ---------------------------------------------------------------------------------------- data
def stdlib_texts(max_bytes: int):
    """Python sources in a fixed order: the standard library, then (on a stripped install)
    megatron-core's and torch's own sources."""
    import megatron.core

    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(megatron.core.__file__).parent,
             Path(torch.__file__).parent]
    texts, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).parts
            if "site-packages" in rel or "test" in rel or "tests" in rel:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            texts.append(text)
            total += len(text)
            if total >= max_bytes:
                return texts
    if not texts:
        raise SystemExit("no Python sources found for the default data; use --synthetic-data")
    return texts


def build_bpe_tokens(vocab_size: int, max_bytes: int):
    """Train a byte-level BPE on stdlib sources, return (token ids, vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = stdlib_texts(max_bytes)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32), tok.get_vocab_size(), sum(len(t) for t in texts)


def build_synthetic_tokens(vocab_size: int, seed: int, n_chunks: int = 4096, chunk: int = 64):
    """Chains ``x -> perm[x]`` from random starts: learnable (loss falls toward ln(V) / chunk)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(vocab_size)
    out = np.empty((n_chunks, chunk), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab_size, n_chunks)
    for j in range(1, chunk):
        out[:, j] = perm[out[:, j - 1]]
    return out.reshape(-1).astype(np.int32)


def get_batch(data: np.ndarray, step: int, dp_rank: int, args, device):
    rng = np.random.default_rng([args.seed, step, dp_rank])
    starts = rng.integers(0, len(data) - args.seq_length - 1, args.micro_batch_size)
    rows = np.stack([data[s : s + args.seq_length + 1] for s in starts]).astype(np.int64)
    rows = torch.from_numpy(rows).to(device)
    tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    position_ids = torch.arange(args.seq_length, device=device).unsqueeze(0).expand_as(tokens)
    return tokens, position_ids, labels


def pad_vocab(vocab: int, args) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab / multiple) * multiple)


# --------------------------------------------------------------------------------------- model
def build_model(args, vocab_size: int, device):
    from vocab_parallel_loss.megatron.layer_specs import sdpa_gpt_layer_spec

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = _compat.transformer_config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        use_cpu_initialization=device.type == "cpu",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=bool(args.cross_entropy_loss_fusion),
        cross_entropy_fusion_impl="native",
    )
    loss_config = VocabParallelLossConfig.from_args(args)
    model = VocabParallelLossGPTModel(
        config=config,
        transformer_layer_spec=sdpa_gpt_layer_spec(normalization=args.normalization),
        vocab_size=vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        loss_config=loss_config,
    )
    return model.to(device=device, dtype=dtype), config


# ----------------------------------------------------------------------------------- optimizer
class MixedPrecisionAdamW:
    """AdamW on fp32 master copies of the (bf16 or fp32) parameters, with a TP-aware grad clip."""

    def __init__(self, params, args, tp_group, tp_rank, dp_group, dp_size):
        self.params = [p for p in params if p.requires_grad]
        self.fp32 = all(p.dtype == torch.float32 for p in self.params)
        self.master = self.params if self.fp32 else [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(
            self.master, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay
        )
        self.args, self.tp_group, self.tp_rank = args, tp_group, tp_rank
        self.dp_group, self.dp_size = dp_group, dp_size

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm: TP-sharded parameters summed over the group, duplicated ones counted once."""
        sq = torch.zeros((), dtype=torch.float32, device=self.master[0].device)
        for p, m in zip(self.params, self.master):
            if m.grad is None:
                continue
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                sq += m.grad.float().pow(2).sum()
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    def step(self, lr: float) -> float:
        if self.dp_size > 1:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.dp_group)
                    p.grad.div_(self.dp_size)
        if not self.fp32:
            for p, m in zip(self.params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
        norm = self.grad_norm()
        if self.args.clip_grad > 0:
            scale = torch.clamp(self.args.clip_grad / (norm + 1e-6), max=1.0)
            for m in self.master:
                if m.grad is not None:
                    m.grad.mul_(scale)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        if not self.fp32:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        for p in self.params:
            p.grad = None
        if not self.fp32:
            for m in self.master:
                m.grad = None
        return float(norm)


def lr_at(step: int, args) -> float:
    if args.lr_warmup_iters and step < args.lr_warmup_iters:
        return args.lr * (step + 1) / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    frac = min(1.0, (step - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))


# ---------------------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    device = init_distributed(args.device)
    from megatron.core import parallel_state

    tp = args.tensor_model_parallel_size
    world = dist.get_world_size()
    if world % tp:
        raise SystemExit(f"world size {world} is not a multiple of --tensor-model-parallel-size {tp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    _compat.model_parallel_seed(args.seed)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    # Data: built on rank 0, broadcast (a tokenizer trained twice need not agree).
    t0 = time.perf_counter()
    payload = [None]
    if dist.get_rank() == 0:
        if args.synthetic_data:
            payload = [(build_synthetic_tokens(args.vocab_size, args.seed), args.vocab_size, "synthetic", 0)]
        else:
            ids, vocab, nbytes = build_bpe_tokens(args.vocab_size, args.data_max_bytes)
            payload = [(ids, vocab, "python-stdlib", nbytes)]
    dist.broadcast_object_list(payload, src=0)
    data, vocab, source, nbytes = payload[0]
    padded = pad_vocab(vocab, args)
    print0(
        f"data: {source} {len(data):,} tokens" + (f" from {nbytes:,} chars" if nbytes else "")
        + f", vocab {vocab} padded to {padded} ({padded // tp} per TP rank), built in {time.perf_counter() - t0:.1f}s"
    )

    model, config = build_model(args, padded, device)
    loss_name = "vocab_parallel_loss" if model.vocab_parallel_loss is not None else (
        "megatron native fused" if args.cross_entropy_loss_fusion else "megatron native")
    fused_linear = model.vocab_parallel_loss is not None and model.loss_config.fused_linear
    n_params = sum(p.numel() for p in model.parameters())
    print0(
        f"megatron-core {_compat.megatron_version()}, torch {torch.__version__}, {dist.get_backend()} on {device}, "
        f"world {world} = TP {tp} x DP {dp_size}; {n_params:,} parameters per rank; loss: {loss_name}"
        + (" fused with the output layer (no logits)" if fused_linear else "")
    )
    opt = MixedPrecisionAdamW(model.parameters(), args, tp_group, tp_rank, dp_group, dp_size)

    captured = {}
    if args.compare_native:
        def keep_logits(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            # A copy: megatron-core's own unfused loss overwrites its fp32 input in place.
            captured["logits"] = logits.detach().clone()
            if logits.requires_grad:
                logits.register_hook(lambda g: captured.__setitem__("grad", g.detach().clone()))
        def keep_hidden(_module, _inputs, output):
            # The fused path never runs the output layer: compute its logits apart, for the
            # comparison only, and keep the gradient of its input (the decoder's output).
            hidden = output[0] if isinstance(output, tuple) else output
            weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
                else model.output_layer.weight
            with torch.no_grad():
                logits, _ = model.output_layer(hidden.detach(), weight=weight)
            captured["logits"] = logits.detach().clone()
            captured["weight"] = weight.detach()
            if hidden.requires_grad:
                hidden.register_hook(lambda g: captured.__setitem__("hidden_grad", g.detach().clone()))

        if fused_linear:
            model.decoder.register_forward_hook(keep_hidden)
        else:
            model.output_layer.register_forward_hook(keep_logits)

    bar = progress_bar(total=args.train_iters, disable=dist.get_rank() != 0 or args.no_progress_bar,
                       dynamic_ncols=True)
    tokens_per_step = args.micro_batch_size * args.seq_length * dp_size
    losses, times, diffs = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    for step in range(args.train_iters):
        tokens, position_ids, labels = get_batch(data, step, dp_rank, args, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_start = time.perf_counter()
        per_token = model(tokens, position_ids, None, labels=labels)  # [b, s], fp32
        loss = per_token.float().mean()
        diff = None
        if args.compare_native:
            diff = native_diff(per_token, labels, captured, tp_group)
        loss.backward()
        if args.compare_native:
            diff = diff + (grad_diff(captured, tp_group),)
        grad_norm = opt.step(lr_at(step, args))
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t_start
        reported = loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(reported, group=dp_group)
            reported /= dp_size
        losses.append(float(reported))
        times.append(dt)
        if diff is not None:
            d = torch.tensor(diff, dtype=torch.float64, device=device)
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            diffs.append(d.tolist())
        if (step + 1) % args.log_interval == 0 or step + 1 == args.train_iters:
            line = (f"step {step + 1:4d}/{args.train_iters} | loss {losses[-1]:.4f} | grad norm {grad_norm:.3f} | "
                    f"{dt * 1e3:8.1f} ms | {tokens_per_step / dt:10.0f} tok/s")
            if diffs:
                line += f" | vs native: max|dloss| {diffs[-1][0]:.2e} max|dgrad| {diffs[-1][1]:.2e}"
            if dist.get_rank() == 0:
                bar.write(line)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_step / dt:.0f}")
        bar.update(1)
    bar.close()

    skip = min(args.timing_skip_iters, max(0, len(times) - 1))
    step_time = float(np.mean(times[skip:]))
    peak = None
    if device.type == "cuda":
        peak_t = torch.tensor([torch.cuda.max_memory_allocated()], dtype=torch.float64, device=device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = float(peak_t) / 2**30
    summary = dict(
        loss_impl=loss_name, megatron_core=_compat.megatron_version(), torch=torch.__version__,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", world=world, tp=tp, dp=dp_size,
        rank_device=str(device), backend=dist.get_backend(),
        vocab=vocab, padded_vocab=padded, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        hidden_size=args.hidden_size, num_layers=args.num_layers, bf16=args.bf16, train_iters=args.train_iters,
        first_loss=losses[0], final_loss=losses[-1], losses=losses, step_time_s=step_time,
        tokens_per_s=tokens_per_step / step_time, peak_memory_gib=peak,
        max_abs_loss_diff_vs_native=max((d[0] for d in diffs), default=None),
        max_abs_grad_diff_vs_native=max((d[1] for d in diffs), default=None),
        fused_linear=fused_linear,
        grad_diff_of=("output layer input" if fused_linear else "logits") if diffs else None,
    )
    print0(
        f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} | step time {step_time * 1e3:.1f} ms (mean after {skip}) | "
        f"{summary['tokens_per_s']:.0f} tok/s | peak memory "
        + (f"{peak:.2f} GiB (max over ranks)" if peak is not None else "n/a (CPU)")
        + (f" | vs native max|dloss| {summary['max_abs_loss_diff_vs_native']:.2e}"
           f" max|dgrad| {summary['max_abs_grad_diff_vs_native']:.2e}" if diffs else "")
    )
    if args.json_output and dist.get_rank() == 0:
        Path(args.json_output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_output).write_text(json.dumps(summary, indent=2))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return summary


def native_diff(per_token, labels, captured, tp_group):
    """megatron-core's unfused loss on a copy of the same logits; the largest |difference|."""
    logits = captured["logits"]
    with torch.no_grad():
        ref = _compat.native_vocab_parallel_cross_entropy(
            logits.detach().float().clone(), labels.transpose(0, 1).contiguous(), tp_group
        ).transpose(0, 1)
    # Reference gradient of the same mean loss w.r.t. the logits (on another copy).
    copy = logits.float().clone().requires_grad_(True)
    ref_loss = _compat.native_vocab_parallel_cross_entropy(copy, labels.transpose(0, 1).contiguous(), tp_group)
    (ref_grad,) = torch.autograd.grad(ref_loss.mean(), copy)
    captured["ref_grad"] = ref_grad
    captured["logits"] = None
    return (float((per_token.detach().float() - ref).abs().max()),)


def grad_diff(captured, tp_group) -> float:
    """The logits' gradient vs megatron-core's; with the fused path (no logits), the gradient of the
    output layer's input vs megatron-core's logits gradient through the output layer."""
    grad, ref = captured.pop("grad", None), captured.pop("ref_grad", None)
    hidden_grad, weight = captured.pop("hidden_grad", None), captured.pop("weight", None)
    if hidden_grad is not None and ref is not None:
        grad = hidden_grad
        ref = ref.detach() @ weight.float()  # [s, b, h]: this rank's vocabulary shard's part
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(ref, group=tp_group)
    if grad is None or ref is None:
        return float("nan")
    return float((grad.detach().float() - ref.detach()).abs().max())


if __name__ == "__main__":
    main()
