#!/usr/bin/env bash
# Session 14 GPU call D: 8-block clusters with 2 blocks of 256-512 threads per SM (112 KB of shared memory
# each, 1-2 register vectors) at V = 262144 and 200064, beside launch_config's 16-block layouts and s14c's
# fastest (16, 224, 3); alone and in step.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=16 run study_v262144 200 python3 benchmarks/cluster_row_step_study.py --in-step --vocabs 262144 --launches 8:512:1 8:384:2 8:256:2 8:512:2 16:224:3
TAIL=6 run study_v200064 100 python3 benchmarks/cluster_row_step_study.py --in-step --vocabs 200064 --launches 8:512:1
grep -chE "NaN rows as spec True" $R/study_*.log; grep -hE "rel err [0-9.]+e-0[0-5]|False|rror" $R/study_*.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
