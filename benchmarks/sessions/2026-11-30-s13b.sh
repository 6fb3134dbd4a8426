#!/usr/bin/env bash
# Session 13 GPU call B: item 61 (the loss in one kernel, no materialized zero gradients) against da75622
# (item 60's tip), call by call at T = 1024 / 2048, full and no-grad forward; gpu_check and fuzz seed 14 on
# this tree (item 60's kernel and item 61's loss); the step's kernels beside the floor's at T = 1024.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_da75622.tar -C /tmp/old
TAIL=8 run ab_seed 220 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 --modes full forward --pairs 100 --json $R/ab_seed.json
TAIL=40 run kernels 60 python3 benchmarks/step_vs_floor_kernels.py --tokens 1024
run gpu_check 150 python3 benchmarks/gpu_check.py --seed-tokens 4096 --json $R/gpu_check.json
grep -E "FAIL" $R/gpu_check.log | head
run fuzz 150 python3 benchmarks/gpu_fuzz.py --seed 14 --cases 80 --out $R/fuzz
grep -E "cases:|FAIL" $R/fuzz.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
