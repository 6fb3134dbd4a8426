#!/usr/bin/env bash
# Session 4 GPU call I (run three times as the script grew; the last run, T = 1024 only, is kept): where the
# GPU idles inside one library call, and the host ops before the first kernel (benchmarks/idle_timeline.py).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
for t in 1024; do
  timeout 120 python3 benchmarks/idle_timeline.py --tokens $t > $R/idle_$t.log 2>&1; echo "rc=$?" >> $R/idle_$t.log
  grep -vE "USDT|Warn|warn" $R/idle_$t.log | head -40
done
tar czf $OUT/results.tgz -C $R . && rm -rf $R
