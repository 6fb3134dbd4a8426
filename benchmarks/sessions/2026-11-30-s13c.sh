#!/usr/bin/env bash
# Session 13 GPU call C: launch settings of item 60's kernel, alone and in step, at five vocabularies.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=50 run sweep 300 python3 benchmarks/cluster_row_step_study.py --in-step --launches 16:128 16:256 16:512 8:128 8:256 8:512 --vocabs 128256 262144 151936 32000 50304
grep -cE "NaN rows as spec True" $R/sweep.log; grep -E "rel err [0-9.]+e-0[0-5]|False" $R/sweep.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
