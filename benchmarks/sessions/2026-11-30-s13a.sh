#!/usr/bin/env bash
# Session 13 GPU call A: item 60 (the cluster row step's relaxed arrive and FFMA exps; the study's stagger
# variant) against 6effaa7's kernel: the study's checks and timings (alone and in step), then the full step
# call by call (ab_study, settled) at T = 1024 / 2048 and V = 262144; idle_timeline at T = 1024.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_6effaa7.tar -C /tmp/old
TAIL=30 run study 150 python3 benchmarks/cluster_row_step_study.py --old /tmp/old/src --in-step --vocabs 128256 262144 --stagger 128256:49:265 262144:21:1400
grep -cE "NaN rows as spec True" $R/study.log; grep -E "rel err [0-9.]+e-0[0-5]|False" $R/study.log | head
TAIL=6 run ab_seed 200 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 --modes full --pairs 120 --json $R/ab_seed.json
TAIL=4 run ab_v262144 120 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048 --json $R/ab_v262144.json
TAIL=25 run idle 60 python3 benchmarks/idle_timeline.py --tokens 1024 --min-gap-us 5
tar czf $OUT/results.tgz -C $R . && rm -rf $R
