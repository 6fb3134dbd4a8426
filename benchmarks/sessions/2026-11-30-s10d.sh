#!/usr/bin/env bash
# Session 10 GPU call D: gap_study at V = 262144 (H = 2048) and V = 32000 (H = 4096), T = 4096 (NOTES item 47).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
TAIL=70 run gap_v262144 260 python3 benchmarks/gap_study.py --tokens 4096 --vocab 262144 --hidden 2048 --chunks 2048 512 --layouts 2048/512 2048/1024 1024/1024 --json $R/gap_v262144.json
TAIL=70 run gap_v32000 150 python3 benchmarks/gap_study.py --tokens 4096 --vocab 32000 --hidden 4096 --chunks 2048 4096 --layouts 2048/2048 4096/4096 --json $R/gap_v32000.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
