#!/usr/bin/env bash
# Session 3 GPU call F: the loss-only row step at block 2048 / 16 warps (NOTES item 19): its speed,
# and the no-grad forward beside the floor and Liger (the bench checks its loss against naive).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run row_step_bench 90 python3 benchmarks/row_step_bench.py
run forward 150 python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor --mode forward --markdown $R/forward.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
