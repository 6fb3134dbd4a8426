#!/usr/bin/env bash
# Session 12 GPU call J: the label count behind the first student GEMM (NOTES item 59) against d770e4f,
# call by call (ab_study, settled), T = 1024 and 2048, full step and no-grad forward.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_d770e4f.tar -C /tmp/old
TAIL=6 run ab_count 200 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 --modes full forward --pairs 150 --json $R/ab_count.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
