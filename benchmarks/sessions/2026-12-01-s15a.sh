#!/usr/bin/env bash
# Session 15 GPU call A: s14j's label fix-up (now in the source) at the layouts with the most warps per SM
# that Triton's ptxas compiles without a spill (threads 128-256 in steps of 32, NOTES "Not tried yet"),
# per vocabulary: checked against the spec, then timed alone and in step beside 0d578a8's kernel (--old).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_0d578a8.tar -C /tmp/old
study() { vocab=$1; shift; TAIL=${TAIL:-12} run study_v$vocab 120 python3 benchmarks/cluster_row_step_study.py --old /tmp/old/src --in-step --vocabs $vocab --launches "$@"; }
TAIL=14 study 262144 16:224:3 16:192:4 16:256:2
TAIL=14 study 256000 16:224:3 16:256:2 16:256:1
TAIL=14 study 128256 16:256:1 16:224:1 16:192:1 16:128:2
TAIL=14 study 151936 16:256:1 16:224:1 16:160:2 16:256:0
TAIL=12 study 65536 8:256:1 8:224:1 8:128:2
TAIL=12 study 32000 8:256:1 8:128:1 8:128:0
TAIL=12 study 49152 8:224:1 8:192:1 8:128:0
TAIL=12 study 98304 8:256:1 8:192:2
grep -chE "NaN rows as spec True" $R/study_*.log; grep -hE "rel err [0-9.]+e-0[0-5]|False|rror|no kernel" $R/study_*.log | head
tar czf $OUT/results.tgz -C $R . && rm -rf $R
