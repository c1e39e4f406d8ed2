#!/usr/bin/env bash
# session 13, device call 1: A/B of the one-level row layout (branch exp/row-start-one-level,
# package in .whl/run/b) against main, alternated 3 times; the host-group diagnosis; the GPU
# tests on the branch's layout.
set -uo pipefail
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
SH=16384x32000,16384x16032,65536x16032,16384x32000-ls0.1
for i in 1 2 3; do
  for v in main branch; do
    # bench.py puts its own tree first on sys.path: run each tree's own copy
    if [ $v = main ]; then tree=$PWD; else tree=$PWD/.whl/run/b; fi
    echo "== round $i: $v ($(grep -c 'one level' $tree/vocab_parallel_loss/_layout.py) one-level mentions)" | tee -a $OUT/ab.txt
    python3 $tree/scripts/bench.py --impls ours,ours_inplace --gpu-lead-us 1000 --no-extras \
      --shapes $SH --out-dir /tmp/ab/r$i-$v 2>&1 | grep -E '^\[' | tee -a $OUT/ab.txt
  done
done
(cd /tmp && tar cf $OUT/ab_json.tar ab)
PYTHONPATH=$PWD:$PWD/scripts timeout 150 python3 scripts/diag_host_group.py --rounds 5 2>&1 | grep -v Warn | tee $OUT/host_group.txt | tail -15
cp .whl/run/b/vocab_parallel_loss/_layout.py vocab_parallel_loss/_layout.py
python3 -m pytest -q -m gpu tests/gpu 2>&1 | grep -v Warning | tee $OUT/gpu_tests_branch.txt | tail -4
