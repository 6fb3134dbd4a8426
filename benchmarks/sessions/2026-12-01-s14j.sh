#!/usr/bin/env bash
# Session 14 GPU call J (a lead, not adopted): a gradient loop whose label fix-up re-reads the label's two
# logits from the packed vectors (benchmarks/sessions/2026-12-01-s14j-patch.py), so that the unpacked logits
# need not outlive the gradient and (16, 224, 3) fits V = 262144 without a spill; this tree's kernel as --old.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/variant && cp -r src /tmp/variant/ && python3 benchmarks/sessions/2026-12-01-s14j-patch.py /tmp/variant/src
export PYTHONPATH=/tmp/variant/src
TAIL=10 run study_v262144 100 python3 benchmarks/cluster_row_step_study.py --old src --in-step --vocabs 262144 --launches 16:224:3
TAIL=6 run study_v128256 60 python3 benchmarks/cluster_row_step_study.py --old src --in-step --vocabs 128256
grep -chE "NaN rows as spec True" $R/study_*.log; grep -hE "rel err [0-9.]+e-0[0-5]|False|rror" $R/study_*.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
