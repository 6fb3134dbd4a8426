#!/usr/bin/env bash
# Session 14 GPU call E: the gradient loop takes the label's entry before g (fewer live registers: ptxas
# 38-48 where it used 48-64); more warps per SM at V = 262144, 128256 and 151936 (layouts that spilled
# before now fit), beside 435ab5f's kernel and launch_config's; checks, alone and in step.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_435ab5f.tar -C /tmp/old
STUDY="python3 benchmarks/cluster_row_step_study.py --old /tmp/old/src --in-step"
TAIL=6 run study_v262144 150 $STUDY --vocabs 262144 --launches 16:224:3 16:288:2 16:256:3
TAIL=5 run study_v128256 120 $STUDY --vocabs 128256 --launches 16:192:1 16:128:3
TAIL=4 run study_v151936 100 $STUDY --vocabs 151936 --launches 16:256:1
grep -chE "NaN rows as spec True" $R/study_*.log; grep -hE "rel err [0-9.]+e-0[0-5]|False|rror" $R/study_*.log | head
grep -h "cuda step" $R/study_*.log
tar czf $OUT/results.tgz -C $R . && rm -rf $R
