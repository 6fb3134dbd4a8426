#!/usr/bin/env bash
# Session 7 GPU call E: the final bench of the session's code (the per-row row step back, NOTES 38; no-grad
# teacher sub-chunks of 2048 rows, NOTES 39), settled, one round (the device time left): seed workload,
# full step and no-grad forward on the same tensors, plot.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -2 $R/$name.log; }
run bench 250 python3 -m cosdistill bench --device cuda --rounds 1 --mode full,forward --json $R/bench.json --markdown $R/bench.md --plot $R/bench.png
grep -E "^\| (ours|ours-fp8|liger|floor) " $R/bench.md
tar czf $OUT/results.tgz -C $R . && rm -rf $R
