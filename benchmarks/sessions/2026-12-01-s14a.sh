#!/usr/bin/env bash
# Session 14 GPU call A: gpu_check on this tree (item 64's cluster rows, first GPU run); item 65's register
# layouts against 435ab5f's kernel in the study (checks, alone and in step), one vocabulary per run.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_435ab5f.tar -C /tmp/old
run gpu_check 100 python3 benchmarks/gpu_check.py --seed-tokens 4096 --json $R/gpu_check.json
grep -E "FAIL|row step cuda" $R/gpu_check.log | head -20
STUDY="python3 benchmarks/cluster_row_step_study.py --old /tmp/old/src --in-step"
TAIL=12 run study_v262144 150 $STUDY --vocabs 262144 --launches 16:256:2 16:128:4 16:128:5 16:128:6 16:128:0
TAIL=12 run study_v128256 120 $STUDY --vocabs 128256 --launches 16:128:1 16:128:2 8:256:2 8:128:4
TAIL=10 run study_v151936 100 $STUDY --vocabs 151936 --launches 16:128:2 16:128:3 16:256:0
grep -hE "rel err [0-9.]+e-0[0-5]|False|Error|error" $R/study_*.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
