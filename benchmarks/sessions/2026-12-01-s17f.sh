#!/usr/bin/env bash
# Session 17 GPU calls F and G: gpu_check on the tip after each review commit (5af9c9e: s17f; b192fe4: s17g, results
# kept under 2026-12-01-s17g).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-2} $R/$name.log; }
TAIL=3 run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "loss fp8|FAIL" $R/gpu_check.log | head -20
tar czf $OUT/results.tgz -C $R . && rm -rf $R
