#!/usr/bin/env bash
# Session 11 GPU call E: the bench's new "x floor by round" column on the GPU, and a third machine's reading of
# the seed workload at T = 2048 / 8192 (three settled rounds, full step and no-grad forward), to set the spread
# of the ratios beside s10b's and s11d's.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
timeout 330 python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor --rounds 3 --tokens 2048,8192 --mode full,forward --json $R/bench.json --markdown $R/bench.md > $R/bench.log 2>&1
echo "rc=$?" >> $R/bench.log
grep -E "^\| (ours|ours-fp8|liger|floor) |rc=" $R/bench.md $R/bench.log
tar czf $OUT/results.tgz -C $R . && rm -rf $R
