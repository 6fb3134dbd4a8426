#!/usr/bin/env bash
# Session 4 GPU call I: where the GPU idles inside one library call (benchmarks/idle_timeline.py).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
for t in 1024 4096; do
  timeout 120 python3 benchmarks/idle_timeline.py --tokens $t > $R/idle_$t.log 2>&1; echo "rc=$?" >> $R/idle_$t.log
  grep -E "T=|idle" $R/idle_$t.log
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
