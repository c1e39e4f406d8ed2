#!/usr/bin/env bash
# Stage quack-kernels (a benchmark peer) on the GPU machine, in two device calls.
#
# quack-kernels 0.6.4 with the CUTLASS DSL it pins, 4.6.2: quack 0.6.5 allows DSL >= 4.7, but its
# linear cross entropy does not import with 4.8.x (its compile-cache key rejects a DSL
# ContextVar) and its modules need 4.8's layout; 0.6.4 + 4.6.2 imports both quack.cross_entropy
# and quack.linear_cross_entropy (checked on CPU). The DSL's CUDA 13 libraries
# (nvidia-cutlass-dsl-libs-cu13, ~60 MiB as tar.xz) are more than one device call may carry next
# to the working tree and the other wheels (64 MiB). So the libraries travel as two parts, in two calls made
# while the machine stays warm (/tmp survives between them):
#
#   here, once:      bash tools/stage_quack.sh pack
#                    (wheels into .whl/, the libraries as .whl/quack/libs_cu13.tar.xz.part00/01)
#   device call 1:   bash tools/stage_quack.sh keep .whl/quack/libs_cu13.tar.xz.part00
#                    (carry that part and .whl/all, a folder of hard links to the wheels), and
#                    install .whl/all/*.whl into /tmp/site (pip --target) in the same call
#   device call 2:   bash tools/stage_quack.sh unpack .whl/quack/libs_cu13.tar.xz.part01 /tmp/site
#                    (carry the other part), then run benchmarks/bench_logits.py with
#                    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
#                    (pip --target skips the .pth file that puts dsl_packages on the path).
#
# The Python side of the DSL is in nvidia-cutlass-dsl-libs-core, which needs cuda-bindings (and
# its cuda-pathfinder) and protobuf; pack downloads them too.
set -euo pipefail

STAGE=${VPL_QUACK_STAGE:-/tmp/vpl_quack_stage}  # where keep puts the first part (/tmp survives between calls)
cmd=${1:-}

case "$cmd" in
  pack)
    cd "$(dirname "$0")/.."
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    rm -f .whl/quack_kernels-*.whl .whl/nvidia_cutlass_dsl*.whl
    python3 -m pip download -q --no-deps "${plat[@]}" -d .whl quack-kernels==0.6.4 \
      nvidia-cutlass-dsl==4.6.2 nvidia-cutlass-dsl-libs-base==4.6.2 apache-tvm-ffi==0.1.15.post2 \
      torch-c-dlpack-ext==0.1.5 einops==0.8.2 nvidia-cutlass-dsl-libs-core==4.6.2 \
      "cuda-bindings>=13,<14" cuda-pathfinder protobuf
    rm -rf .whl/all && mkdir -p .whl/all && ln -f .whl/*.whl .whl/all/
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.6.2
    mkdir -p "$tmp/x" .whl/quack
    python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/x"
    rm -f .whl/quack/libs_cu13.tar.xz.part*
    tar cf - -C "$tmp/x" . | xz -9e -T0 | split -b 31M -d - .whl/quack/libs_cu13.tar.xz.part
    rm -rf "$tmp"
    ls -l .whl/quack
    ;;
  keep)  # device call 1: put the first part aside
    mkdir -p "$STAGE"
    cp "$2" "$STAGE/"
    ls -l "$STAGE"
    ;;
  unpack)  # device call 2: the kept part(s) and this one, in order, into the target folder
    target=${3:?usage: stage_quack.sh unpack PART TARGET}
    mkdir -p "$target"
    cp "$2" "$STAGE/"
    cat "$STAGE"/libs_cu13.tar.xz.part* | xz -d | tar xf - -C "$target"
    ls "$target/nvidia_cutlass_dsl"
    # fail here, not in the middle of a benchmark, when a piece is missing (the wheels went into
    # the same folder in call 1)
    export PYTHONPATH="$target:$target/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c "import quack.cross_entropy, quack.linear_cross_entropy; print('quack imports')"
    ;;
  *)
    echo "usage: $0 pack | keep PART | unpack PART TARGET" >&2
    exit 2
    ;;
esac
