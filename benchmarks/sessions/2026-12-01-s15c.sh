#!/usr/bin/env bash
# Session 15 GPU call C (NOTES item 68): each block issues its slice's loads before it waits for the row's
# label (benchmarks/sessions/2026-12-01-s15c-patch.py), against this tree's kernel (--old): checked against
# the spec, then timed in step at 512 and 1024 rows, dense and with half the rows ignored.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/variant && cp -r src /tmp/variant/ && python3 benchmarks/sessions/2026-12-01-s15c-patch.py /tmp/variant/src
export PYTHONPATH=/tmp/variant/src
TAIL=8 run study_dense 150 python3 benchmarks/cluster_row_step_study.py --old src --in-step --rows 512 1024 --vocabs 262144 128256
TAIL=4 run study_half_ignored 100 python3 benchmarks/cluster_row_step_study.py --old src --in-step --rows 1024 --ignored 0.5 --vocabs 262144 128256
grep -chE "NaN rows as spec True" $R/study_*.log; grep -hE "rel err [0-9.]+e-0[0-5]|False|rror" $R/study_*.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
