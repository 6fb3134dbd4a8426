#!/usr/bin/env bash
# Session 12 GPU call K: the final tip (the count behind the student GEMM; the cluster kernel chosen by the
# occupancy query, 8 blocks where 16 do not fit): gpu_check, the study's checks at the default and an
# explicit launch, GPU fuzz seed 13.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
run gpu_check 150 python3 benchmarks/gpu_check.py --seed-tokens 4096 --json $R/gpu_check.json
grep -E "FAIL" $R/gpu_check.log | head
TAIL=8 run cluster_study 100 python3 benchmarks/cluster_row_step_study.py --launches 8:256 --vocabs 128256
grep -cE "NaN rows as spec True" $R/cluster_study.log; grep -E "rel err [0-9.]+e-0[0-5]|False" $R/cluster_study.log | head
run fuzz 150 python3 benchmarks/gpu_fuzz.py --seed 13 --cases 80 --out $R/fuzz
grep -E "cases:|FAIL" $R/fuzz.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
