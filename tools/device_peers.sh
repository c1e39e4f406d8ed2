#!/usr/bin/env bash
# The benchmark peers on the GPU machine, in the steps every benchmark run on the H200 repeats.
# .whl/ is git-ignored: a new checkout stages it again here, then two device calls made while the
# machine stays warm use it:
#
#   here, once:     bash tools/device_peers.sh stage
#                   (liger-kernel, cut-cross-entropy, megatron-core wheels for cp312; quack and
#                   its DSL via stage_quack.sh pack; TE's Triton kernels via
#                   stage_te_triton_ce.py; all of them hard-linked into .whl/all)
#   device call 1:  bash tools/device_peers.sh install && <GPU tests, short runs>
#                   carry: [".whl/all", ".whl/quack/libs_cu13.tar.xz.part00"]
#                   (keeps quack's first part in /tmp; installs .whl/all into $SITE)
#   device call 2:  bash tools/device_peers.sh unpack && <python3 benchmarks/bench_logits.py ...>
#                   carry: [".whl/quack/libs_cu13.tar.xz.part01"]
#
# Then run with PYTHONPATH="$(bash tools/device_peers.sh pythonpath)" (pip --target skips
# the .pth file that puts the DSL's dsl_packages folder on the path). SITE defaults to
# /tmp/site.
set -euo pipefail

cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
cmd=${1:-}

case "$cmd" in
  stage)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      liger-kernel==0.8.5 cut-cross-entropy==25.1.1 megatron-core==0.19.2
    bash tools/stage_quack.sh pack  # also relinks .whl/all
    python3 tools/stage_te_triton_ce.py --out .whl
    ln -f .whl/*.whl .whl/all/
    du -sh .whl/all .whl/quack/*
    ;;
  install)
    bash tools/stage_quack.sh keep .whl/quack/libs_cu13.tar.xz.part00 > /dev/null
    # wheels whose modules the machine's Python already has stay out (its CUDA bindings and
    # protobuf match its own CUDA and libraries)
    skip=()
    python3 -c "import cuda.bindings" 2>/dev/null && skip+=(cuda_bindings cuda_pathfinder)
    python3 -c "import google.protobuf" 2>/dev/null && skip+=(protobuf)
    wheels=()
    for w in .whl/all/*.whl; do
      name=$(basename "$w")
      keep=1
      for s in "${skip[@]+"${skip[@]}"}"; do
        case "$name" in "$s"-*) keep=0 ;; esac
      done
      if [ "$keep" = 1 ]; then wheels+=("$w"); fi
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}"
    echo "installed ${#wheels[@]} wheels into $SITE (skipped: ${skip[*]:-none})"
    ;;
  unpack)
    bash tools/stage_quack.sh unpack .whl/quack/libs_cu13.tar.xz.part01 "$SITE" | tail -1
    ;;
  pythonpath)
    echo "$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD"
    ;;
  *)
    echo "usage: device_peers.sh stage | install | unpack | pythonpath" >&2
    exit 2
    ;;
esac
