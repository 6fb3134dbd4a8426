#!/usr/bin/env bash
# Session 4 GPU call J: the fp16 seed bench on the final code (the lifted gradients run NOTES item 24's loops too).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
timeout 150 python3 -m cosdistill bench --device cuda --dtype fp16 --providers ours,naive,liger,floor --tokens 1024,4096 \
    --markdown $R/bench_fp16.md > $R/bench_fp16.log 2>&1; echo "rc=$?" >> $R/bench_fp16.log
grep -E "^\| |check|rc=" $R/bench_fp16.log
tar czf $OUT/results.tgz -C $R . && rm -rf $R
