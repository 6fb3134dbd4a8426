#!/usr/bin/env bash
# Session 12 GPU call B: the CUDA cluster row step in the library (impl="auto" on the H200, NOTES item 56):
# the study at launch_config's settings (checks, then times against the Triton step), gpu_check, GPU fuzz.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=12 run cluster_study 120 python3 benchmarks/cluster_row_step_study.py
grep -E "rel err [0-9.]+e-0[0-5]|False" $R/cluster_study.log | head
run gpu_check 150 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "FAIL|cuda" $R/gpu_check.log | head -30
run fuzz 240 python3 benchmarks/gpu_fuzz.py --seed 12 --cases 120 --out $R/fuzz
grep -E "cluster|FAIL|^\| " $R/fuzz.log | head -30
tar czf $OUT/results.tgz -C $R . && rm -rf $R
