#!/usr/bin/env bash
# session 13, device call 2: the fused mean's rows in flight. a = main (a program per row; 119
# registers cap residency at 2 programs per SM), b = one-level layout (59 registers: 4 per SM),
# c = b with a grid of 2 programs per SM, d = main with 2 per SM, e = b with 3 per SM
# (plain rows up to 64 KB); alternated twice. Then the host diagnosis with idle phases.
set -uo pipefail
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
SH=16384x32000,16384x16032,65536x16032,16384x32000-ls0.1
for i in 1 2; do
  for v in a c d e b; do
    if [ $v = a ]; then tree=$PWD; else tree=$PWD/.whl/run/$v; fi
    echo "== round $i: $v" | tee -a $OUT/occ.txt
    python3 $tree/scripts/bench.py --impls ours,ours_inplace --paths mean --gpu-lead-us 1000 --no-extras \
      --shapes $SH --out-dir /tmp/occ/r$i-$v 2>&1 | grep -E '^\[' | grep -v wrote | tee -a $OUT/occ.txt
  done
done
(cd /tmp && tar cf $OUT/occ_json.tar occ)
PYTHONPATH=$PWD:$PWD/scripts timeout 200 python3 scripts/diag_host_group.py --rounds 5 2>&1 | grep -v Warn | tee $OUT/host_group2.txt | grep median
