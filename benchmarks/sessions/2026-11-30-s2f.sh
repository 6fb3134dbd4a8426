#!/usr/bin/env bash
# Session 2 GPU call F: where the host spends time in one step (the library-vs-serial gap, NOTES items 11, 13).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p $OUT/r
for t in 1024 8192; do timeout 100 python3 benchmarks/profile_step.py --tokens $t > $OUT/r/profile_$t.log 2>&1; grep -E "step|GPU span|runtime calls" $OUT/r/profile_$t.log; done
