#!/usr/bin/env bash
# Session 4 GPU call G: chunk layouts against cuBLAS's 320-row tiles (NOTES item 25): the gap study's
# chunked GEMMs at 1024/1280/1536/2048 rows and the chunk loop at six student/teacher layouts.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; grep -E "T=|direct|teacher_logits|library" $R/$name.log; }
run layouts 400 python3 benchmarks/gap_study.py --tokens 8192 4096 --reps 10 --chunks 1024 1280 1536 2048 \
    --layouts 2048/1024 2048/2048 1536/1536 2560/1280 1920/960 3072/1536 --json $R/layouts.json
tar czf $OUT/results.tgz -C $R . && rm -rf $R
