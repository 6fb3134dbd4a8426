#!/usr/bin/env bash
# Session 15 GPU call F, not run (no device time was left; NOTES item 69): at V = 262144, 1536-row student chunks with 1024-row teacher
# sub-chunks (the same 1.25 GiB of buffers) as --old, against the final code's 2048 / 512, call by call.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/variant && cp -r src /tmp/variant/ && sed -i 's/^MIN_STUDENT_ROWS = 2048$/MIN_STUDENT_ROWS = 1536/' /tmp/variant/src/cosdistill/chunked.py
grep -n "^MIN_STUDENT_ROWS" /tmp/variant/src/cosdistill/chunked.py
TAIL=4 run ab_v262144 100 python3 benchmarks/ab_study.py --old /tmp/variant/src --tokens 4096 --modes full --pairs 40 --vocab 262144 --hidden 2048 --json $R/ab_v262144.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
