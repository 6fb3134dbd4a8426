#!/usr/bin/env bash
# Session 12 GPU call C: the cluster row step in the full step against d4d75e5 (the Triton row step), call by call
# (ab_study, settled), seed full step T = 1024..8192, the FP8 teacher, and V = 262144 (NOTES item 56).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_d4d75e5.tar -C /tmp/old
TAIL=6 run ab_seed 240 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 4096 8192 --modes full --pairs 100 --json $R/ab_seed.json
TAIL=6 run ab_fp8 150 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 2048 8192 --modes full --pairs 100 --fp8 --json $R/ab_fp8.json
TAIL=4 run ab_v262144 100 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048 --json $R/ab_v262144.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
