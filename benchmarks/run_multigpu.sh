#!/usr/bin/env bash
# The multi-GPU run, all of it: NCCL tensor-parallel tests, Megatron GPT pretraining (ours
# vs megatron-core native / native fused) and the TP scaling benchmark, with a markdown summary.
#
#   bash benchmarks/run_multigpu.sh [NGPUS]
#
# NGPUS: default `nvidia-smi -L | wc -l`; without a GPU: 2 CPU ranks over gloo (a smoke run of the
# whole pipeline on tiny shapes, TRITON_INTERPRET=1 for the Triton tests; not a measurement).
# With NGPUS = 1 (one GPU): everything runs at world size 1 (TP = 1).
#
# Results: $OUT if set, else benchmarks/results/multigpu-<UTC date>/ (-cpu-smoke appended on CPU):
#   summary.md, summary.json   the tables (tests, pretraining, scaling), the status of every step
#   env.txt               GPUs, NVLink topology, versions
#   logs/<step>.log       each step's output; logs/<step>.status: start, exit code, seconds, command
#   pretrain/tp<T>_<variant>.json   examples/pretrain_gpt.py --json-output
#   scaling/scaling.{json,md,png}   benchmarks/bench_scaling.py
# The summary is rewritten after every step: a run cut short keeps what it did. Outputs of several
# calls (e.g. STEPS="tests scaling", then STEPS=pretrain) merge by copying them into one folder
# and running: python benchmarks/summarize_multigpu.py DIR --mode gpu --ngpus N
#
# Environment knobs (all optional):
#   STEPS="tests pretrain scaling"    which parts to run, in that order
#   TPS="2 4 8"                       TP sizes of the tests and pretraining (default: 2, 4, 8 up to
#                                     NGPUS; 1 on one GPU; 2 on CPU)
#   PRETRAIN_VARIANTS="ours native native_fused"   also: fused_linear (ours fused with the output
#                                     layer, if pretrain_gpt.py has the flag), compare (ours with
#                                     --compare-native: per-step loss / gradient diff vs native)
#   PRETRAIN_ITERS=20  PRETRAIN_ARGS="..."  BENCH_ARGS="..."  (e.g. BENCH_ARGS="--reps 10")
#   PYTHON=python3     MODE=gpu|cpu (default: gpu when nvidia-smi lists a GPU)
#   TIMEOUT_TESTS=300 TIMEOUT_PRETRAIN=300 TIMEOUT_SCALING=420   seconds per step
#   DRY_RUN=1                         print the commands, run nothing
#
# On a lent multi-GPU machine (megatron-core 0.19.2 carried as a wheel in .whl/), one call each:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && STEPS="tests scaling" bash benchmarks/run_multigpu.sh
#   ... && STEPS=pretrain bash benchmarks/run_multigpu.sh
# (2 GPUs: likely all steps in one call of 10 minutes; 4 or 8: split as above. Estimates: no GPU
# run of this script has happened yet.)
#
# NVLink multicast stays off, exported so that every subprocess inherits it.
set -uo pipefail

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}

detected=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
detected=${detected:-0}
MODE=${MODE:-$([ "$detected" -gt 0 ] && echo gpu || echo cpu)}
if [ "$MODE" = gpu ]; then
  NGPUS=${1:-$detected}
else
  NGPUS=${1:-2}
fi
if ! [[ "$NGPUS" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_multigpu: NGPUS must be a positive integer, got '$NGPUS'" >&2
  exit 2
fi

if [ -z "${TPS:-}" ]; then
  TPS=""
  for t in 2 4 8; do [ "$t" -le "$NGPUS" ] && TPS="$TPS $t"; done
  TPS=${TPS# }
  [ -z "$TPS" ] && TPS=1
fi
STEPS=${STEPS:-tests pretrain scaling}
PRETRAIN_VARIANTS=${PRETRAIN_VARIANTS:-ours native native_fused}

suffix=$([ "$MODE" = cpu ] && echo "-cpu-smoke" || true)
OUTDIR=${OUT:-$REPO/benchmarks/results/multigpu-$(date -u +%Y%m%d)$suffix}
OUTDIR=$(realpath -m "$OUTDIR")
if [ "$DRY_RUN" != 1 ]; then
  mkdir -p "$OUTDIR/logs" "$OUTDIR/pretrain" "$OUTDIR/scaling"
fi

echo "run_multigpu: mode $MODE, NGPUS $NGPUS, TP sizes [$TPS], steps [$STEPS], out $OUTDIR"
echo "run_multigpu: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"

torchrun_cmd() {  # torchrun_cmd NPROC SCRIPT ARGS...
  local n=$1; shift
  echo "$PY" -m torch.distributed.run --standalone "--nproc-per-node=$n" "$@"
}

FAILED=()

summarize() {
  [ "$DRY_RUN" = 1 ] && return 0
  "$PY" "$REPO/benchmarks/summarize_multigpu.py" "$OUTDIR" --mode "$MODE" --ngpus "$NGPUS" \
    > "$OUTDIR/logs/summarize.log" 2>&1 || echo "   (summary failed: see $OUTDIR/logs/summarize.log)"
}

# step NAME TIMEOUT_S ENV_ASSIGNMENTS... -- COMMAND...
step() {
  local name=$1 limit=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "== $name: ${envs[*]:-} $*"
  [ "$DRY_RUN" = 1 ] && return 0
  local log="$OUTDIR/logs/$name.log" t0 rc dt
  t0=$(date +%s)
  timeout -k 30 "$limit" env "${envs[@]}" "$@" > "$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\t%s\n' "$t0" "$rc" "$dt" "${envs[*]:-} $*" > "$OUTDIR/logs/$name.status"
  # interpreter warnings can make CPU logs large: keep the tail
  if [ "$(wc -c < "$log")" -gt 2000000 ]; then
    tail -c 2000000 "$log" > "$log.tail" && mv "$log.tail" "$log"
  fi
  echo "   rc=$rc in ${dt}s$([ "$rc" = 124 ] && echo ' (timed out)') — log $log"
  grep -E "cases passed|^done:|bench_scaling: wrote|Error|FAILED" "$log" | grep -v Warning | tail -n 4 | sed 's/^/   | /'
  [ "$rc" -eq 0 ] || FAILED+=("$name")
  summarize
  return 0
}

# --------------------------------------------------------------------------------- environment
if [ "$DRY_RUN" != 1 ]; then
  {
    echo "date_utc: $(date -u +%FT%TZ)"
    echo "host: $(hostname)"
    echo "mode: $MODE  ngpus: $NGPUS  tp_sizes: $TPS  steps: $STEPS"
    echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
    git -C "$REPO" status --porcelain 2>/dev/null | sed 's/^/  modified: /'
    echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
    "$PY" - <<'EOF' 2>&1
import importlib, platform, warnings
warnings.filterwarnings("ignore")
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")
for m in ("triton", "megatron.core", "transformer_engine", "te_triton_ce", "matplotlib"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "not importable:", type(e).__name__)
EOF
    if [ "$MODE" = gpu ]; then
      nvidia-smi -L
      nvidia-smi topo -m 2>/dev/null
      nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv 2>/dev/null
    fi
  } > "$OUTDIR/env.txt" 2>&1
  if [ "$MODE" = gpu ] && ! "$PY" -c "import torch, sys; sys.exit(torch.cuda.device_count() < $NGPUS)"; then
    echo "run_multigpu: torch sees fewer than $NGPUS GPUs" >&2
    exit 2
  fi
fi

# ------------------------------------------------------------------- (a) tensor-parallel tests
if [[ " $STEPS " == *" tests "* ]]; then
  if [ "$MODE" = gpu ]; then
    test_env=(-u TRITON_INTERPRET VPL_TEST_DEVICE=cuda)
  else
    test_env=(TRITON_INTERPRET=1 OMP_NUM_THREADS=1)
  fi
  for t in $TPS; do
    # core loss, every API (module, TE drop-in, Megatron drop-in, vs megatron-core), triton + torch
    step "tests_core_tp$t" "${TIMEOUT_TESTS:-300}" "${test_env[@]}" -- \
      $(torchrun_cmd "$t" tests/cross_entropy/_distributed_worker.py)
    # fused linear cross entropy, with and without sequence parallelism
    step "tests_linear_tp$t" "${TIMEOUT_TESTS:-300}" "${test_env[@]}" -- \
      $(torchrun_cmd "$t" tests/linear_cross_entropy/_distributed_worker.py)
  done
fi

# ------------------------------------------------------------------------ (b) Megatron GPT
if [[ " $STEPS " == *" pretrain "* ]]; then
  if [ "$MODE" = gpu ]; then
    pt_config=examples/configs/gpt_h200.yaml
    pt_env=(-u TRITON_INTERPRET)
    pt_iters=${PRETRAIN_ITERS:-20}
  else
    # our loss takes its PyTorch path on CPU without TRITON_INTERPRET: seconds, not minutes
    pt_config=examples/configs/tiny_gpt_tp2.yaml
    pt_env=(-u TRITON_INTERPRET OMP_NUM_THREADS=1)
    pt_iters=${PRETRAIN_ITERS:-3}
  fi
  has_fused_linear=0
  grep -q -- "--vocab-parallel-loss-fused-linear" examples/pretrain_gpt.py && has_fused_linear=1
  for t in $TPS; do
    extra=()
    if [ "$MODE" = cpu ]; then
      extra=(--synthetic-data --micro-batch-size 2 --seq-length 64 --timing-skip-iters 1)
    elif [ "$t" = 1 ]; then
      extra=(--micro-batch-size 2)  # one GPU, as examples/configs/gpt_h200.yaml says
    fi
    for variant in $PRETRAIN_VARIANTS; do
      iters=$pt_iters
      case $variant in
        ours) vargs=() ;;
        native) vargs=(--native-loss) ;;
        native_fused) vargs=(--native-loss --cross-entropy-loss-fusion) ;;
        fused_linear)
          if [ "$has_fused_linear" != 1 ]; then
            echo "== pretrain_tp${t}_fused_linear: skipped (pretrain_gpt.py has no --vocab-parallel-loss-fused-linear)"
            continue
          fi
          vargs=(--vocab-parallel-loss-fused-linear) ;;
        compare) vargs=(--compare-native); iters=$(( pt_iters < 8 ? pt_iters : 8 )) ;;
        *)
          echo "run_multigpu: unknown PRETRAIN_VARIANTS entry '$variant'" >&2
          [ "$DRY_RUN" = 1 ] || printf '%s\t2\t0\tunknown variant %s\n' "$(date +%s)" "$variant" \
            > "$OUTDIR/logs/pretrain_tp${t}_$variant.status"
          FAILED+=("pretrain_tp${t}_$variant"); continue ;;
      esac
      # shellcheck disable=SC2086
      step "pretrain_tp${t}_$variant" "${TIMEOUT_PRETRAIN:-300}" "${pt_env[@]}" -- \
        $(torchrun_cmd "$t" examples/pretrain_gpt.py) --config "$pt_config" \
        --tensor-model-parallel-size "$t" --train-iters "$iters" --no-progress-bar \
        "${extra[@]}" "${vargs[@]}" ${PRETRAIN_ARGS:-} \
        --json-output "$OUTDIR/pretrain/tp${t}_$variant.json"
    done
  done
fi

# --------------------------------------------------------------------- (c) scaling benchmark
if [[ " $STEPS " == *" scaling "* ]]; then
  if [ "$MODE" = gpu ]; then
    sc_env=(-u TRITON_INTERPRET)
    sc_args=()
  else
    sc_env=(TRITON_INTERPRET=1 OMP_NUM_THREADS=1)
    sc_args=(--cpu-smoke)
  fi
  # shellcheck disable=SC2086
  step scaling "${TIMEOUT_SCALING:-420}" "${sc_env[@]}" -- \
    $(torchrun_cmd "$NGPUS" benchmarks/bench_scaling.py) "${sc_args[@]}" --out-dir "$OUTDIR/scaling" ${BENCH_ARGS:-}
fi

if [ "$DRY_RUN" = 1 ]; then
  exit 0
fi
summarize
echo "run_multigpu: summary in $OUTDIR/summary.md"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "run_multigpu: FAILED: ${FAILED[*]}" >&2
  exit 1
fi
echo "run_multigpu: all steps passed"
