#!/usr/bin/env bash
# Session 4 GPU call B: the SM-partition study (NOTES item 22, benchmarks/carveout_study.py).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; cat $R/$name.log; }
run carveout 300 python3 benchmarks/carveout_study.py
tar czf $OUT/results.tgz -C $R . && rm -rf $R
