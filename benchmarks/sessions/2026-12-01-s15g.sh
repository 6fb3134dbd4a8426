#!/usr/bin/env bash
# Session 15 GPU call G, prepared and not run (no device time was left; NOTES items 69 and 70): the exchange
# of the partial statistics pushed by st.async into the peers' shared memory (benchmarks/sessions/
# 2026-12-01-s15g-patch.py) against this tree's kernel (--old), at the layouts this tree launches (the
# variant's larger static shared memory moves some picks, so they are given explicitly); then item 69's A/B.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/variant && cp -r src /tmp/variant/ && python3 benchmarks/sessions/2026-12-01-s15g-patch.py /tmp/variant/src
for launch in 262144:16:224:3 128256:16:128:2 151936:16:160:2; do
  vocab=${launch%%:*}
  TAIL=8 PYTHONPATH=/tmp/variant/src run study_v$vocab 100 python3 benchmarks/cluster_row_step_study.py --old src --in-step --rows 512 1024 --vocabs $vocab --launches ${launch#*:}
done
grep -chE "NaN rows as spec True" $R/study_*.log; grep -hE "rel err [0-9.]+e-0[0-5]|False|rror" $R/study_*.log | head
mkdir -p /tmp/chunks && cp -r src /tmp/chunks/ && sed -i 's/^MIN_STUDENT_ROWS = 2048$/MIN_STUDENT_ROWS = 1536/' /tmp/chunks/src/cosdistill/chunked.py
TAIL=4 PYTHONPATH=src run ab_v262144_chunks 100 python3 benchmarks/ab_study.py --old /tmp/chunks/src --tokens 4096 --modes full --pairs 40 --vocab 262144 --hidden 2048 --json $R/ab_v262144_chunks.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
