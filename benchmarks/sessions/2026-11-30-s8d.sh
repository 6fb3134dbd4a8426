#!/usr/bin/env bash
# Session 8 GPU call D: where the autograd layer's ~0.2 ms at T = 1024 goes (s8c: +autograd over finish()
# called straight; NOTES item 41): library_overhead_study on this code with the Function's backward
# called on the main thread beside autograd's engine, and each step's forward / backward split.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=50 run layers 200 python3 benchmarks/library_overhead_study.py --tokens 1024 2048 8192 --json $R/layers.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
