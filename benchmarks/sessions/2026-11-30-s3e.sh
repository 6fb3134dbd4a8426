#!/usr/bin/env bash
# Session 3 GPU call E: soak (1000 calls; T = 131072's peak) with the 2048/1024 chunk layout and the
# fp16 changes, and the loss-only row step's block / warps sweep (NOTES item 19).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $R/gpu.txt
run row_step_bench 90 python3 benchmarks/row_step_bench.py
run soak 300 python3 benchmarks/soak.py --out $R/soak
tar czf $OUT/results.tgz -C $R . && rm -rf $R
