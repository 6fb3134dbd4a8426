#!/usr/bin/env bash
# Session 14 GPU call C: more warps per SM at V = 262144 (item 65's sweep read warps per SM as what decides):
# layouts of 160-384 threads with 1-4 register vectors beside launch_config's (16, 256, 2), alone and in step.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=20 run study 200 python3 benchmarks/cluster_row_step_study.py --in-step --vocabs 262144 --launches 16:192:3 16:160:4 16:224:3 16:192:4 16:256:3 16:384:1 16:256:1
grep -cE "NaN rows as spec True" $R/study.log; grep -E "rel err [0-9.]+e-0[0-5]|False|rror" $R/study.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
