#!/usr/bin/env bash
# Session 8 GPU call F: the final code's correctness on the H200: gpu_check and the GPU fuzz (fresh seed).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 120 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL" $R/gpu_check.log | head
run fuzz 170 python3 benchmarks/gpu_fuzz.py --seed 8 --cases 100 --out $R/fuzz
tar czf $OUT/results.tgz -C $R . && rm -rf $R
