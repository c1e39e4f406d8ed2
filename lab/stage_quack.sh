# Lab: carry quack (the CuTe DSL peer) to the device machine, whose calls carry at most 64 MiB.
#
# quack-kernels 0.6.4 needs nvidia-cutlass-dsl 4.6.2, whose CUDA library wheel alone is 88 MB;
# the DSL's Python package `cutlass` is in nvidia-cutlass-dsl-libs-core, which needs
# cuda-python (bindings, core, pathfinder), protobuf and nvdisasm. Unpacked together with quack,
# tvm-ffi and the dlpack extension and packed with xz -9e it is too much beside the tree in one
# call, so it travels in two halves, on one warm
# machine (it goes back after ~30 s idle: issue the second call at once).
#
#   bash lab/stage_quack.sh                 # here: .lab_tmp/qa/ and .lab_tmp/qb/ (ignored paths)
#   call 1, carry [".lab_tmp/qa", ...]:     mkdir -p /tmp/stage && cp .lab_tmp/qa/* /tmp/stage/
#   call 2, carry [".lab_tmp/qb", ...]:     cp .lab_tmp/qb/* /tmp/stage/ && mkdir -p /tmp/cutl &&
#       cat /tmp/stage/cutl.part.* | xz -d | tar -x -C /tmp/cutl &&
#       export PYTHONPATH=/tmp/cutl:/tmp/cutl/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
#   (the second entry is what the DSL's .pth file adds in a site directory: PYTHONPATH reads none)
#   then e.g. python3 benchmarks/bench_linear.py --vocab 128256 --reductions mean \
#       --impls ours ours@3.07 ours_saved quack liger torch --rounds 3
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work/whl" quack-kernels==0.6.4 nvidia-cutlass-dsl==4.6.2 nvidia-cutlass-dsl-libs-base==4.6.2 \
    nvidia-cutlass-dsl-libs-core==4.6.2 nvidia-cutlass-dsl-libs-cu12==4.6.2 \
    'apache-tvm-ffi>=0.1.6,<0.2' torch-c-dlpack-ext einops 'protobuf>=6.30.2,<7' \
    'nvidia-cuda-nvdisasm>=13.3,<14' cuda-python==13.4.4 'cuda-bindings~=13.4.4' \
    'cuda-core~=1.2.0' 'cuda-pathfinder~=1.1'
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do unzip -q -o "$w" -d "$work/site"; done
tar -C "$work/site" -cf - . | xz -T2 -9e > "$work/cutl.tar.xz"
grep -qx "/.lab_tmp/" .git/info/exclude 2>/dev/null || echo "/.lab_tmp/" >> .git/info/exclude  # carry: ignored
mkdir -p .lab_tmp/qa .lab_tmp/qb
rm -f .lab_tmp/qa/cutl.part.* .lab_tmp/qb/cutl.part.*
half=$(( ($(stat -c %s "$work/cutl.tar.xz") + 1) / 2 ))
split -b "$half" "$work/cutl.tar.xz" "$work/cutl.part."
mv "$work/cutl.part.aa" .lab_tmp/qa/ && mv "$work/cutl.part.ab" .lab_tmp/qb/
ls -la .lab_tmp/qa .lab_tmp/qb
rm -rf "$work"
